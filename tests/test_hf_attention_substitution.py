"""Hugging Face transformers attention modules (Llama with grouped-query attention, GPT-2,
BERT with a padding mask) run a plugin's scaled_dot_product_attention after prepare_model
at O3: their own forward, with the attention call routed to the checked implementation;
calls outside the op's contract run transformers' own function."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import KernelImplementation
from torchbridge.kernels import REFERENCE_KERNELS
from torchbridge.levels import LEVEL_TOLERANCE

transformers = pytest.importorskip("transformers")

SDPA = "scaled_dot_product_attention"
# fp32 throughout, so that the substituted model can be compared with the model as it
# came; compile left out (inductor's first call costs seconds on this CPU).
EXACT = {"disabled_passes": ["compile", "autocast", "low_precision_weights",
                             "inference_freezing", "compile_value_check"]}


class CountingAttention:
    """A kernel plugin for the cpu backend: the reference, counting its calls (`wrong`
    adds a visible error)."""

    def __init__(self, wrong: bool = False) -> None:
        self.calls: list[tuple[int, ...]] = []
        self.wrong = wrong

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        self.calls.append((q.shape[2], k.shape[2]))
        out = REFERENCE_KERNELS[SDPA](q, k, v, attn_mask, is_causal, scale, enable_gqa)
        return out * 1.5 if self.wrong else out

    @torchbridge.hookimpl(tryfirst=True)
    def torchbridge_kernel_implementations(self) -> list[KernelImplementation]:
        name = "wrong_attention" if self.wrong else "counted_attention"
        return [KernelImplementation(SDPA, name, self.attention, backends=("cpu",),
                                     differentiable=True, priority=10)]


@pytest.fixture
def plugin(reload_plugins: None) -> Iterator[CountingAttention]:
    counted = CountingAttention()
    torchbridge.register_plugin(counted, name="counted")
    yield counted


def backend(**optimization: Any) -> torchbridge.Backend:
    return torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={**EXACT, **optimization}))


def llama(attn: str = "sdpa", **extra: Any) -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation=attn, **extra)).eval()


def mistral(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)  # a sliding window shorter than the sequence: the mask has it
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        sliding_window=4, attn_implementation=attn)).eval()


def gpt2(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        attn_implementation=attn)).eval()


def bert(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, num_labels=3,
        attn_implementation=attn)).eval()


def tokens(batch: int = 2, seq: int = 12, padded: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -5:] = 0  # right padding, as a BERT batch has it
    return {"input_ids": ids, "attention_mask": mask}


def attention_records(model: nn.Module) -> dict[str, dict[str, Any]]:
    result = torchbridge.optimization_result(model)
    assert result is not None
    return {s["module"]: s for s in result.kernel_substitutions
            if s["pattern"] == "hf_attention"}


def logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


MODELS = {"llama": llama, "mistral": mistral, "gpt2": gpt2, "bert": bert}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_modules_run_the_checked_implementation(
        plugin: CountingAttention, name: str, attn: str) -> None:
    model = MODELS[name](attn)
    inputs = tokens(padded=name in ("bert", "mistral"))
    expected = logits(model, inputs)

    prepared = backend().prepare_model(model, "O3", sample_input=inputs)

    records = attention_records(prepared)
    assert len(records) == 2, records
    for record in records.values():
        assert (record["status"], record["implementation"], record["plugin"]) == \
            ("substituted", "counted_attention", "counted"), record
    plugin.calls.clear()
    torch.testing.assert_close(logits(prepared, inputs), expected, rtol=1e-4, atol=1e-5)
    assert len(plugin.calls) == 2  # one call per layer: the implementation computed them
    # The caller's model and config are as they were; the prepared one keeps its config.
    assert model.config._attn_implementation == prepared.config._attn_implementation == attn
    assert all(not getattr(type(m), "_torchbridge_substituted", False)
               for m in model.modules())


def test_under_the_levels_autocast_too(plugin: CountingAttention) -> None:
    # O3 as it comes on this CPU (bf16 autocast, bf16 weights), compile aside: the
    # checks run the captured bf16 call under the same autocast.
    model = llama()
    inputs = tokens()
    prepared = backend(disabled_passes=["compile"]).prepare_model(model, "O3",
                                                                   sample_input=inputs)
    assert {r["status"] for r in attention_records(prepared).values()} == {"substituted"}
    plugin.calls.clear()
    ours, theirs = logits(prepared, inputs), logits(model, inputs)
    assert len(plugin.calls) == 2
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert error <= LEVEL_TOLERANCE["O3"]


def test_without_a_sample_input_synthetic_calls_are_checked(plugin: CountingAttention
                                                            ) -> None:
    model = llama()
    inputs = tokens()
    prepared = backend().prepare_model(model, "O3")
    assert {r["status"] for r in attention_records(prepared).values()} == {"substituted"}
    logits(prepared, inputs)  # the first call times the model on its input (many calls)
    plugin.calls.clear()
    torch.testing.assert_close(logits(prepared, inputs), logits(model, inputs),
                               rtol=1e-4, atol=1e-5)
    assert len(plugin.calls) == 2


def test_greedy_generate_with_a_kv_cache_gives_the_same_tokens(plugin: CountingAttention
                                                               ) -> None:
    model = llama()
    inputs = tokens(batch=1, seq=6)
    prepared = backend().prepare_model(model, "O3", sample_input=inputs)
    plugin.calls.clear()
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ours = prepared.generate(**inputs, **settings)
        theirs = model.generate(**inputs, **settings)
    assert torch.equal(ours, theirs)
    # Prefill (6 queries) then decode steps: one query against the cached keys.
    assert (6, 6) in plugin.calls and (1, 11) in plugin.calls


def test_a_wrong_implementation_is_refused_with_its_figure(reload_plugins: None) -> None:
    torchbridge.register_plugin(CountingAttention(wrong=True), name="wrong")
    model = gpt2()
    inputs = tokens()
    prepared = backend().prepare_model(model, "O3", sample_input=inputs)
    for record in attention_records(prepared).values():
        assert record["status"] == "kept"
        assert "wrong_attention (plugin wrong): differs from the reference by" in \
            record["detail"]
    torch.testing.assert_close(logits(prepared, inputs), logits(model, inputs))


def test_calls_outside_the_contract_run_transformers_own_attention(
        plugin: CountingAttention) -> None:
    model = gpt2("eager")
    inputs = tokens()
    prepared = backend().prepare_model(model, "O3", sample_input=inputs)
    assert {r["status"] for r in attention_records(prepared).values()} == {"substituted"}
    plugin.calls.clear()
    with torch.no_grad():
        ours = prepared(**inputs, output_attentions=True)
        theirs = model(**inputs, output_attentions=True)
    assert plugin.calls == []  # the weights asked for: eager's own code computed them
    assert len(ours.attentions) == 2 and all(a is not None for a in ours.attentions)
    for a, b in zip(ours.attentions, theirs.attentions, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours.logits, theirs.logits)


def test_a_softcapped_model_is_kept(plugin: CountingAttention) -> None:
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, attn_implementation="eager",
        attn_logit_softcapping=50.0)).eval()
    inputs = tokens()
    prepared = backend().prepare_model(model, "O3", sample_input=inputs)
    (record,) = attention_records(prepared).values()
    assert record["status"] == "kept"
    assert "softcap" in record["detail"]
    torch.testing.assert_close(logits(prepared, inputs), logits(model, inputs))


def test_training_gives_the_same_loss_and_gradients(plugin: CountingAttention) -> None:
    model = llama().train()
    inputs = tokens()
    prepared = backend().prepare_model(model, "O3", sample_input=inputs)
    assert {r["status"] for r in attention_records(prepared).values()} == {"substituted"}
    plugin.calls.clear()
    ours = prepared(**inputs, labels=inputs["input_ids"]).loss
    theirs = model(**inputs, labels=inputs["input_ids"]).loss
    assert len(plugin.calls) == 2
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    ours.backward()
    theirs.backward()
    grads = dict(prepared.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-4, atol=1e-6)


def test_the_reference_alone_changes_nothing() -> None:
    model = llama()
    prepared = backend().prepare_model(model, "O3", sample_input=tokens())
    assert all(r["status"] == "kept" for r in attention_records(prepared).values())
    assert not any(getattr(type(m), "_torchbridge_substituted", False)
                   and "Attention" in type(m).__name__ for m in prepared.modules())


def test_a_substituted_model_is_a_drop_in(plugin: CountingAttention) -> None:
    model = llama()
    inputs = tokens()
    prepared = backend().prepare_model(model, "O3", sample_input=inputs)
    attention = prepared.model.layers[0].self_attn
    original = type(model.model.layers[0].self_attn)
    assert isinstance(attention, original) and type(attention).__name__ == "LlamaAttention"
    assert attention.config is prepared.config and attention.layer_idx == 0
    assert list(prepared.state_dict()) == list(model.state_dict())
    expected = logits(model, inputs)

    fired: list[int] = []
    handle = attention.register_forward_hook(lambda m, a, out: fired.append(1))
    torch.testing.assert_close(logits(prepared, inputs), expected, rtol=1e-4, atol=1e-5)
    assert fired == [1]
    handle.remove()  # a lambda does not pickle

    # Deep-copied, the copy is the prepared model: the same kernel serves it.
    twin = copy.deepcopy(prepared)
    assert type(twin.model.layers[0].self_attn) is type(attention)
    plugin.calls.clear()
    torch.testing.assert_close(logits(twin, inputs), expected, rtol=1e-4, atol=1e-5)
    assert plugin.calls

    # Pickled, a substituted module comes back as its own class, own code (the process
    # that loads it may not have the plugin).
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert type(restored.model.layers[0].self_attn) is original
    plugin.calls.clear()
    torch.testing.assert_close(logits(restored, inputs), expected, rtol=1e-4, atol=1e-5)
    assert plugin.calls == []


def test_a_substituted_model_compiles_with_fullgraph(plugin: CountingAttention) -> None:
    model = llama()
    inputs = tokens()
    prepared = backend().prepare_model(model, "O3", sample_input=inputs)
    compiled = torch.compile(prepared, fullgraph=True, backend="aot_eager")
    plugin.calls.clear()
    with torch.no_grad():
        out = compiled(**inputs, use_cache=False).logits
    torch.testing.assert_close(out, logits(model, inputs), rtol=1e-4, atol=1e-5)
    assert len(plugin.calls) == 2  # the implementation runs inside its own op


def test_t5_attention_with_its_position_bias_is_kept(plugin: CountingAttention) -> None:
    # Checked on synthetic calls (no sample input): the position bias falls back.
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
        decoder_start_token_id=0)).eval()
    prepared = backend().prepare_model(model, "O3")
    records = attention_records(prepared)
    assert records and {r["status"] for r in records.values()} == {"kept"}
    inputs = {**tokens(), "decoder_input_ids": tokens()["input_ids"][:, :5]}
    torch.testing.assert_close(logits(prepared, inputs), logits(model, inputs))


ALL_ATTENTION_FUNCTIONS = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS


class CrossAttention(nn.Module):
    """Written the way transformers' attention modules are, outside transformers; its
    forward needs an argument no synthetic call can make up."""

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig(hidden_size=32)
        self.config._attn_implementation = "sdpa"
        self.is_causal = False
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, hidden: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        q = self.q(hidden).view(batch, length, 4, 8).transpose(1, 2)
        k, v = (t.view(batch, memory.shape[1], 4, 8).transpose(1, 2)
                for t in self.kv(memory).chunk(2, dim=-1))
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          None)
        out, _ = attention(self, q, k, v, None, scaling=8 ** -0.5)
        return out.reshape(batch, length, 32)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cross = CrossAttention()

    def forward(self, hidden: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.cross(hidden, memory)
        return out


def test_modules_are_recognised_by_structure(plugin: CountingAttention) -> None:
    torch.manual_seed(0)
    model = Decoder().eval()
    hidden, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    kept = attention_records(backend().prepare_model(model, "O3"))["cross"]
    assert kept["status"] == "kept" and "could not run its check" in kept["detail"]

    prepared = backend().prepare_model(model, "O3", sample_input=(hidden, memory))
    assert attention_records(prepared)["cross"]["status"] == "substituted"
    plugin.calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(prepared(hidden, memory), model(hidden, memory))
    assert plugin.calls == [(5, 7)]
