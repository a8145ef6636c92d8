"""prepare_model on Hugging Face transformers models built from small configs (no
downloads): a prepared model is a drop-in for the one passed in, and nothing of the
caller's changes. Compile is left out here (config) to keep these fast; test_drop_in.py
and the compile test below cover it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge.levels import LEVEL_TOLERANCE

transformers = pytest.importorskip("transformers")
from torchbridge.hf_models import hf_reference_models  # noqa: E402

MODELS = {m.name: m for m in hf_reference_models(scale=0.125)}
LEVELS = ["O0", "O1", "O2", "O3"]


def no_compile() -> torchbridge.Backend:
    return torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))


def call(model: nn.Module, sample: Any) -> Any:
    with torch.no_grad():
        if isinstance(sample, dict):
            return model(**sample)
        return model(sample)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_is_a_drop_in_at_every_level(name: str, level: str) -> None:
    ref = MODELS[name]
    model, sample = ref.build(), ref.make_input(2)
    expected = call(model, sample)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fired: list[str] = []
    model.register_forward_hook(lambda m, a, out: fired.append("hook"))
    rng = torch.get_rng_state()

    prepared = no_compile().prepare_model(model, level, sample_input=sample)

    # Nothing of the caller's changed: weights, buffers, global RNG.
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # Drop-in: same class, attributes, state_dict keys, ties, hooks, output type and dtypes.
    assert type(prepared) is type(model)
    assert prepared.config is not None and prepared.config.to_dict() == model.config.to_dict()
    assert list(prepared.state_dict()) == list(model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False) and \
            model.get_output_embeddings() is not None:
        assert prepared.get_output_embeddings().weight is \
            prepared.get_input_embeddings().weight
    fired.clear()
    out = call(prepared, sample)
    assert fired == ["hook"]
    assert type(out) is type(expected) and list(out.keys()) == list(expected.keys())
    assert out.logits.dtype == expected.logits.dtype == torch.float32
    rel = (out.logits - expected.logits).abs().max() / expected.logits.abs().max()
    assert rel <= LEVEL_TOLERANCE[level]
    result = torchbridge.optimization_result(prepared)
    assert result is not None and not result.failed, result.summary()
    assert result.max_rel_diff is not None and result.max_rel_diff <= LEVEL_TOLERANCE[level]


def test_hf_resnet_folds_batchnorm_that_torch_fx_cannot_trace() -> None:
    ref = MODELS["resnet"]
    model, sample = ref.build(), ref.make_input(2)
    result = no_compile().optimize(model, "O1", sample_input=sample)
    assert [p.status for p in result.passes if p.name == "conv_bn_folding"] == ["applied"]
    assert any("folded" in n for n in result.notes)
    assert result.max_rel_diff is not None and result.max_rel_diff < 1e-4
    # The checkpoint of the folded model computes the same in the unprepared class.
    fresh = ref.build()
    fresh.load_state_dict(result.model.state_dict())
    torch.testing.assert_close(call(fresh, sample).logits, call(model, sample).logits,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sample_form", ["dict", "tuple", "tensor"])
def test_sample_input_forms(sample_form: str) -> None:
    ref = MODELS["bert"]
    model = ref.build()
    kwargs = ref.make_input(2)
    sample: Any = {"dict": kwargs, "tuple": (kwargs["input_ids"], kwargs["attention_mask"]),
                   "tensor": kwargs["input_ids"]}[sample_form]
    result = no_compile().optimize(model, "O3", sample_input=sample)
    assert not result.failed, result.summary()
    assert result.max_rel_diff is not None and 0 < result.max_rel_diff < 3e-2


@pytest.mark.slow
def test_generate_at_every_level_greedy_identical_at_o1() -> None:
    ref = MODELS["llama"]
    model = ref.build()
    ids = ref.make_input(1)["input_ids"][:, :8]
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        eager = model.generate(ids, **kwargs)
    for level in LEVELS:
        prepared = no_compile().prepare_model(model, level, sample_input={"input_ids": ids})
        with torch.no_grad():
            tokens = prepared.generate(ids, **kwargs)
        assert tokens.shape == eager.shape
        if level in ("O0", "O1"):
            assert torch.equal(tokens, eager), level


@pytest.mark.slow
def test_compiled_hf_model_keeps_its_output_type_config_and_generate() -> None:
    """Compile runs inside prepare_model on the sample input; the model stays the model."""
    ref = MODELS["llama"]
    model = ref.build()
    sample = ref.make_input(2)
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile_value_check"]}))
    result = backend.optimize(copy.deepcopy(model), "O2", sample_input=sample)
    assert [p.status for p in result.passes if p.name == "compile"] == ["applied"]
    prepared = result.model
    out = call(prepared, sample)
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.logits.dtype == torch.float32
    assert prepared.config.vocab_size == model.config.vocab_size
    tokens = prepared.generate(sample["input_ids"][:1, :8], max_new_tokens=3, do_sample=False,
                               pad_token_id=0)
    assert tokens.shape == (1, 11)


def test_gpt2_conv1d_weights_are_stored_in_bf16_at_o3() -> None:
    ref = MODELS["gpt2"]
    model, sample = ref.build(), ref.make_input(2)
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        precision="bfloat16", optimization={"disabled_passes": ["compile"]}))
    result = backend.optimize(model, "O3", sample_input=sample)
    assert [p.status for p in result.passes if p.name == "low_precision_weights"] == ["applied"]
    conv1d = [m for m in result.model.modules() if type(m).__name__ == "Conv1D"]
    assert conv1d and all(m.weight.dtype == torch.bfloat16 for m in conv1d)
    assert result.model.lm_head.weight is result.model.transformer.wte.weight  # still tied
    assert call(result.model, sample).logits.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_o3_compiled_on_the_sample_serves_other_inputs_of_its_shape(name: str) -> None:
    """The graph compiled on the sample input (no padding) must not be specialised on its
    values: a batch of the same shape with padding and other tokens goes through the same
    compiled graph and still matches eager. A mask shortcut taken on the sample's values
    (all ones: no mask) would give the padded rows wrong outputs."""
    from torchbridge.optimize.forward import compile_state

    ref = MODELS[name]
    model, sample = ref.build(), ref.make_input(3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # weights at 1/sqrt(fan-in): with HF's small init, BERT's
        for p in model.parameters():  # attention barely moves its logits (0.1%)
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5, generator=g)
    prepared = torchbridge.get_backend("cpu").prepare_model(model, "O3", sample_input=sample)
    result = torchbridge.optimization_result(prepared)
    assert result is not None
    assert [p.status for p in result.passes if p.name == "compile"] == ["applied"], \
        result.summary()
    ids = torch.randint(0, model.config.vocab_size, sample["input_ids"].shape,
                        generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0  # padding, as a batch of unequal lengths has it (left for the
    mask[2, -9:] = 0  # decoder: right padding would change only the padded rows)
    if ref.is_decoder:
        mask = mask.flip(-1)
    other = {"input_ids": ids, "attention_mask": mask}
    state = compile_state(prepared)
    assert state is not None
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    expected, out = call(model, other), call(prepared, other)
    assert state.error is None and not state.bypass
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # no recompile
    rel = (out.logits - expected.logits).abs().max() / expected.logits.abs().max()
    assert rel <= LEVEL_TOLERANCE["O3"]
    # The padding changed the outputs: the comparison was not of two unmasked runs.
    unmasked = call(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert (unmasked.logits - expected.logits).abs().max() > 3 * LEVEL_TOLERANCE["O3"] * \
        expected.logits.abs().max()
