"""The Triton kernels as the core's implementations: chosen on this backend (cpu under the
interpreter), right forward and backward through the op wrappers, compiled with
fullgraph, and substituted into a tiny Hugging Face Llama that gives the same logits, loss
and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchbridge
from torchbridge.kernels import ops
from torchbridge.kernels.choice import choose
from torchbridge.kernels.implementations import TOLERANCES

TRITON_OPS = {"rms_norm": "triton_rms_norm", "silu_mul": "triton_silu_mul",
              "rotary_embedding": "triton_rotary", "add_rms_norm": "triton_add_rms_norm"}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def without_the_example_plugin(monkeypatch: pytest.MonkeyPatch, reload_plugins: None) -> None:
    """The example plugin's first-contract rms_norm is tryfirst for every backend, so it
    would be chosen before the built-in Triton kernels these tests are about."""
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "example")
    torchbridge.reload_plugins()


@pytest.fixture
def backend(device: str) -> Any:
    return torchbridge.get_backend(device)


def _args(op: str, dtype: torch.dtype, device: str) -> tuple[Any, ...]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)

    if op == "rms_norm":
        return t(6, 40), t(40), 1e-6
    if op == "add_rms_norm":
        return t(6, 40), t(6, 40), t(40), 1e-6
    if op == "silu_mul":
        return t(6, 40), t(6, 40)
    cos = torch.randn(2, 1, 5, 16, dtype=dtype, device=device)  # broadcast over heads
    return t(2, 3, 5, 16), cos, torch.randn(2, 1, 5, 16, dtype=dtype, device=device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()  # a prepared model's output is on its device
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(TRITON_OPS))
def test_triton_implementations_are_chosen_and_right(op: str, dtype: torch.dtype,
                                                     backend: Any) -> None:
    choice = choose(op, backend, dtype=dtype, training=True)
    assert choice.chosen is not None
    assert (choice.chosen.implementation.name, choice.chosen.provider) == (TRITON_OPS[op],
                                                                           "triton")
    kernel = choice.bound()
    torch.manual_seed(0)
    args = _args(op, dtype, backend.device.type)
    ref_args = tuple(a.detach().clone().requires_grad_(a.requires_grad)
                     if isinstance(a, torch.Tensor) else a for a in args)
    out, ref = kernel(*args), getattr(ops, op)(*ref_args)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    tol = TOLERANCES[dtype]
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == r.dtype and _rel(o, r) <= tol
    grads = [torch.randn_like(r) for r in refs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    for a, r in zip(args, ref_args, strict=True):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert _rel(a.grad, r.grad) <= 4 * tol, op


def _tiny_llama() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _substitution_only(backend: Any) -> Any:
    """The backend with every O3 pass but placement and the substitution off, so the
    comparison is about the kernels: autocast's bf16 would swamp their figures, and so
    would a GPU's passes (TF32, the FP8 linear), which a list of the CPU's passes missed
    on an H100."""
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.pipeline import collect_passes

    kept = {"device_placement", "kernel_substitution"}
    off = [p.name for _, p in collect_passes(backend, OptimizationLevel.O3).passes
           if p.name not in kept]
    optimization = backend.config.optimization.model_copy(update={"disabled_passes": off})
    return torchbridge.Backend(backend.status, backend.config.model_copy(
        update={"optimization": optimization}))


def test_tiny_llama_logits_match_with_triton_kernels(backend: Any) -> None:
    model = _tiny_llama().eval()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    prepared = _substitution_only(backend).prepare_model_with_custom_kernels(
        model, sample_input=(ids,))
    subs = torchbridge.optimization_result(prepared).kernel_substitutions
    used = {s["module"]: s.get("implementation") for s in subs}
    assert used["model.layers.0.input_layernorm"] == "triton_rms_norm"
    assert used["model.norm"] == "triton_rms_norm"
    assert used["model.layers.1.mlp"] == "triton_silu_mul"
    with torch.no_grad():
        logits = prepared(input_ids=ids.to(backend.device)).logits
    assert _rel(logits, expected) <= 1e-4


def test_tiny_llama_trains_the_same_with_triton_kernels(backend: Any) -> None:
    model = _tiny_llama().train()
    ids = torch.randint(0, 128, (2, 8))
    prepared = _substitution_only(backend).prepare_model_with_custom_kernels(
        model, sample_input=(ids,))
    subs = torchbridge.optimization_result(prepared).kernel_substitutions
    assert sum(s["status"] == "substituted" for s in subs) == 7  # 5 norms, 2 MLPs
    ours = model(input_ids=ids, labels=ids).loss
    on_device = ids.to(backend.device)
    theirs = prepared(input_ids=on_device, labels=on_device).loss
    assert abs(theirs.item() - ours.item()) <= 1e-5 * abs(ours.item())
    ours.backward()
    theirs.backward()
    mine = dict(prepared.named_parameters())
    for name, param in model.named_parameters():
        assert _rel(mine[name].grad, param.grad) <= 1e-4, name


def test_substituted_model_compiles_fullgraph_and_with_inductor(backend: Any) -> None:
    model = _tiny_llama().model.layers[0].mlp.eval()  # a SwiGLU MLP
    norm = _tiny_llama().model.norm.eval()
    seq = torch.nn.Sequential(norm, model)
    x = torch.randn(2, 8, 64)
    prepared = _substitution_only(backend).prepare_model_with_custom_kernels(
        seq, sample_input=x)
    assert all(s["status"] == "substituted" for s in
               torchbridge.optimization_result(prepared).kernel_substitutions)
    expected = seq(x)
    for compiler in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(prepared, fullgraph=True, backend=compiler)
        assert _rel(compiled(x.to(backend.device)), expected) <= 1e-4, compiler


def test_a_strided_weight_is_read_right(device: str) -> None:
    from torchbridge.kernels import triton as kernels

    x, weight = torch.randn(4, 64, device=device), torch.randn(128, device=device)[::2]
    y, _ = kernels.rms_norm_forward(x, weight, 1e-6)
    assert _rel(y, ops.rms_norm(x, weight, 1e-6)) <= 1e-5
    normed, _ = kernels.add_rms_norm_forward(x, x, weight, 1e-6)
    assert _rel(normed, ops.rms_norm(2 * x, weight, 1e-6)) <= 1e-5
