"""The CPU backend's bfloat16 attention (builtin/cpu/attention.py): F.scaled_dot_product_attention's
semantics (masks, causality, GQA, scale, fully masked rows) within bfloat16's tolerance, the
calls it declines, and prepare_model at O3 routing a Hugging Face model's attention to it
under autocast (its figures are in benchmarks/cpu_attention.py, not here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchbridge
from torchbridge.builtin.cpu.attention import (
    BF16_MATMUL_ATTENTION,
    MAX_SCORE_BYTES,
    bf16_matmul_attention,
)
from torchbridge.kernels import REFERENCE_KERNELS
from torchbridge.kernels.choice import choose
from torchbridge.kernels.implementations import bind, call_problem, decline_reason

SDPA = "scaled_dot_product_attention"


def qkv(batch: int = 2, heads: int = 4, kv_heads: int = 4, q_len: int = 9, k_len: int = 9,
        dim: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def t(h: int, n: int) -> torch.Tensor:
        return torch.randn(batch, h, n, dim, generator=g).to(torch.bfloat16)

    return t(heads, q_len), t(kv_heads, k_len), t(kv_heads, k_len)


def padding_mask(batch: int, q_len: int, k_len: int) -> torch.Tensor:
    keep = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool)
    keep[0, :, :, -3:] = False  # padded keys
    keep[1, :, 2, :] = False  # a query that sees no key at all
    return keep


CASES: dict[str, Any] = {
    "no mask": lambda: (*qkv(), None, False, None, False),
    "boolean mask, a row fully masked": lambda: (*qkv(), padding_mask(2, 9, 9), False, None,
                                                 False),
    "additive float mask": lambda: (*qkv(), torch.zeros(2, 1, 9, 9).masked_fill(
        ~padding_mask(2, 9, 9), torch.finfo(torch.float32).min).to(torch.bfloat16), False,
        None, False),
    "causal": lambda: (*qkv(), None, True, None, False),
    "causal, fewer queries than keys": lambda: (*qkv(q_len=3, k_len=9), None, True, None,
                                                False),
    "grouped-query attention": lambda: (*qkv(heads=4, kv_heads=2), None, True, None, True),
    "explicit scale": lambda: (*qkv(), None, False, 0.3, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torchs_attention_within_bfloat16s_tolerance(case: str) -> None:
    args = CASES[case]()
    expected = REFERENCE_KERNELS[SDPA](*args)
    out = bf16_matmul_attention(*args)
    assert call_problem(out, expected, args) is None
    if case == "boolean mask, a row fully masked":  # zeros there, as torch gives
        assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
        assert torch.equal(expected[1, :, 2], out[1, :, 2])


def test_compiled_it_computes_the_same() -> None:
    args = CASES["boolean mask, a row fully masked"]()
    compiled = torch.compile(bf16_matmul_attention, fullgraph=True)
    torch.testing.assert_close(compiled(*args), bf16_matmul_attention(*args), atol=2e-2,
                               rtol=2e-2)


def test_declines_calls_it_should_not_take() -> None:
    q, k, v = qkv()
    assert decline_reason(BF16_MATMUL_ATTENTION, (q, k, v, None, False, None, False)) is None
    # float32 calls are the reference's (the flash kernel is fast there)
    why = decline_reason(BF16_MATMUL_ATTENTION, (q.float(), k.float(), v.float(), None,
                                                 False, None, False))
    assert why is not None and "float32" in why
    # a score matrix too large to materialize: flash attention's tiles never hold it
    # (meta tensors: the size is all that is read)
    rows = int((MAX_SCORE_BYTES // 4) ** 0.5) + 1
    big = torch.empty(1, 1, rows, 8, dtype=torch.bfloat16, device="meta")
    why = decline_reason(BF16_MATMUL_ATTENTION, (big, big, big, None, False, None, False))
    assert why is not None and "MiB" in why
    small = torch.empty(1, 1, 8, 8, dtype=torch.bfloat16, device="meta")
    why = decline_reason(BF16_MATMUL_ATTENTION, (small, small, small, None, False, None,
                                                 False))
    assert why is not None and "meta" in why
    # a declined call runs the reference through the bound kernel
    kernel = bind(BF16_MATMUL_ATTENTION, "cpu", SDPA)
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert torch.equal(kernel(q32, k32, v32), REFERENCE_KERNELS[SDPA](q32, k32, v32))


ON = {"cpu": {"bf16_matmul_attention": True}}


def test_offered_only_when_the_config_turns_it_on() -> None:
    """Off by default: it costs compile time and was not measured on a CPU with AMX."""
    default = torchbridge.get_backend("cpu")
    assert "cpu_bf16_matmul_attention" not in [
        c.implementation.name for c in choose(SDPA, default, dtype=torch.bfloat16).eligible]


def test_chosen_on_the_cpu_for_bfloat16_inference_only() -> None:
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(hardware=ON))
    names = [c.implementation.name for c in choose(SDPA, backend, dtype=torch.bfloat16)
             .eligible]
    assert "cpu_bf16_matmul_attention" in names
    assert "cpu_bf16_matmul_attention" not in [
        c.implementation.name for c in choose(SDPA, backend, dtype=torch.bfloat16,
                                              training=True).eligible]
    assert "cpu_bf16_matmul_attention" not in [
        c.implementation.name for c in choose(SDPA, backend, dtype=torch.float32).eligible]


def _bert() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, num_labels=3,
        attn_implementation="sdpa")).eval()


def _llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa")).eval()


def _tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _attention_records(model: torch.nn.Module) -> list[dict[str, Any]]:
    result = torchbridge.optimization_result(model)
    assert result is not None
    return [s for s in result.kernel_substitutions if s["pattern"] == "hf_attention"]


# Compile is left out here (its first call costs seconds); the routing is what is tested.
NO_COMPILE = {"disabled_passes": ["compile", "inference_freezing", "compile_value_check"]}


@pytest.mark.parametrize("build", [_bert, _llama], ids=["bert", "llama"])
def test_o3_routes_a_hugging_face_models_attention_to_it_under_autocast(
        build: Any) -> None:
    """Autocast makes the attention module's q, k and v bfloat16 while its input stays
    float32: the implementation is chosen for the dtype the op is called in. Llama's
    rotary embeddings (float32 cos and sin) make q and k float32 again while v stays
    bfloat16: the op is called as autocast calls torch's attention, all in bfloat16."""
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization=NO_COMPILE, hardware=ON))
    if backend.low_precision_dtype(backend.get_device_info()) != torch.bfloat16:
        pytest.skip("this CPU has no bfloat16 autocast")
    model, inputs = build(), _tokens()
    with torch.no_grad():
        expected = model(**inputs).logits
    prepared = backend.prepare_model(model, "O3", sample_input=inputs)
    records = _attention_records(prepared)
    assert len(records) == 2
    for record in records:
        assert (record["status"], record["implementation"], record["plugin"]) == \
            ("substituted", "cpu_bf16_matmul_attention", "cpu"), record
    with torch.no_grad():
        out = prepared(**inputs).logits
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=5e-2, rtol=5e-2)


def test_in_float32_the_model_keeps_its_own_attention() -> None:
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(optimization={
        "disabled_passes": [*NO_COMPILE["disabled_passes"], "autocast"]}, hardware=ON))
    prepared = backend.prepare_model(_bert(), "O3", sample_input=_tokens())
    records = _attention_records(prepared)
    assert len(records) == 2
    for record in records:
        assert record["status"] == "kept"
        assert any("cpu_bf16_matmul_attention" in r and "bfloat16" in r
                   for r in record["rejected"]), record
    # and the report does not call the pass applied: it changed nothing
    result = torchbridge.optimization_result(prepared)
    assert result is not None
    passes = {p.name: p for p in result.passes}
    assert passes["kernel_substitution"].status == "skipped"
    assert "no module was substituted" in passes["kernel_substitution"].detail
