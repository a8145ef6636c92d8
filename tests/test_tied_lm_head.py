"""An LM head tied to its embedding at O3. Its weight stayed float32 (an embedding shared
it), so autocast cast all of it at every uncompiled call: every decoding step of
generate(), where that was most of what O3 lost to eager. It is now stored in bfloat16 for
both, one tensor still, and the embedding's output comes back in the model's dtype. The
tie, the state_dict keys, gradients, writes to the weight (also through `.data`) and the
outputs' dtype are as before. No timing: what is counted is the casts of the weight."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torchbridge
from torch import nn
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode
from torchbridge.optimize.pipeline import run_pipeline

VOCAB, WIDTH = 64, 16


class TiedLM(nn.Module):
    def __init__(self, head: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = (head or nn.Linear)(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(self.embed(ids))))
        return out


class MatmulHead(nn.Module):
    """An output projection that is no nn.Linear: its weight is not known to feed only
    matmuls autocast covers, so the weight it shares stays float32."""

    def __init__(self, width: int, vocab: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class _Casts(TorchDispatchMode):
    """Casts of a float32 tensor of one shape (autocast's casts of the weight)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func.overloadpacket.__name__ == "_to_copy" and first is not None and \
                tuple(first.shape) == self.shape and first.dtype == torch.float32:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _timer(label: str, fn: Callable[[], Any]) -> float:
    fn()
    return 1.0 if label == "prepared" else 2.0


def _prepare(model: nn.Module, ids: torch.Tensor) -> tuple[nn.Module, Any]:
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        precision="bfloat16", optimization={"disabled_passes": ["compile"]}))
    result = run_pipeline(backend, model, "O3", sample_input=ids, timer=_timer)
    assert "low_precision_weights" in result.optimizations_applied, result.summary()
    return result.model, result


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TiedLM().eval(), torch.randint(0, VOCAB, (2, 5))


def _autocast_reference(prepared: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What the prepared model computes, written out: bf16 weights under autocast, the
    embedding's rows as the weight holds them, in float32."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rows = torch.nn.functional.embedding(ids, prepared.embed.weight).float()
        hidden = torch.relu(torch.nn.functional.linear(rows, prepared.body.weight,
                                                       prepared.body.bias))
        out = torch.nn.functional.linear(hidden, prepared.embed.weight)
    return out.float()


def test_a_tied_head_does_not_cast_its_weight_at_every_call() -> None:
    """Before: one cast of the 64x16 float32 weight at every call (3 in 3 calls)."""
    prepared, result = _prepare(*_model())
    ids = torch.randint(0, VOCAB, (3, 7))
    for mode in (torch.no_grad, torch.inference_mode):
        with _Casts((VOCAB, WIDTH)) as casts, mode():
            for _ in range(3):
                prepared(ids)
        assert casts.count == 0
    assert any(note.startswith("low_precision_weights: embed share(s) its weight with a "
                               "Linear") for note in result.notes), result.notes


def test_the_tie_state_dict_and_output_dtypes_stay() -> None:
    model, ids = _model()
    names = list(model.state_dict())
    count = sum(p.numel() for p in model.parameters())
    prepared, _ = _prepare(model, ids)
    assert prepared.head.weight is prepared.embed.weight
    assert prepared.head.weight.dtype == torch.bfloat16
    assert list(prepared.state_dict()) == names
    assert sum(p.numel() for p in prepared.parameters()) == count
    with torch.no_grad():
        assert prepared(ids).dtype == torch.float32
        assert prepared.embed(ids).dtype == torch.float32  # called on its own too
        assert prepared.head(torch.randn(2, WIDTH)).dtype == torch.float32
        assert torch.equal(prepared(ids), _autocast_reference(prepared, ids))


def test_writes_to_the_shared_weight_show_in_the_next_call() -> None:
    """Through .data too, which leaves the version counter as it was: a copy of the
    weight kept for the head, checked by that counter, missed it (token 7's logit 0.18
    where it was 159 on a GPT-2)."""
    prepared, _ = _prepare(*_model())
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        prepared(ids)
    writes: list[Callable[[], Any]] = [
        lambda: prepared.embed.weight.data.__setitem__(7, torch.full((WIDTH,), 3.0)),
        lambda: prepared.embed.weight.data.mul_(2.0),
        lambda: prepared.load_state_dict({**prepared.state_dict(),
                                          "embed.weight": torch.randn(VOCAB, WIDTH)}),
        lambda: prepared.head.weight.mul_(0.5),
    ]
    for write in writes:
        with torch.no_grad():
            before = prepared(ids)
            write()
            assert prepared.head.weight is prepared.embed.weight
            assert torch.equal(prepared(ids), _autocast_reference(prepared, ids))
            assert not torch.equal(prepared(ids), before)


def test_gradients_still_reach_the_tied_weight_through_the_head() -> None:
    """Rows of the embedding no input looks up get a gradient only through the head."""
    prepared, _ = _prepare(*_model())
    prepared.train()
    ids = torch.zeros(2, 3, dtype=torch.long)  # looks up row 0 only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prepared(ids).float().sum().backward()
    grad = prepared.embed.weight.grad
    assert grad is not None
    assert grad[1:].abs().sum() > 0


def test_a_last_position_slice_runs_one_mm_without_copying_the_expanded_weight() -> None:
    """hidden[:, -1:] of a prefill: torch.matmul folds a 3-D input with a weight that needs
    no gradient only where the strides allow it, and this one's do not. Before, under
    torch.inference_mode(), the weight autocast cast for the call needed none: a batched
    matmul over the weight expanded and copied (4 ms once per generate() on the suite's
    Llama). The profiler names the ops run."""
    prepared, _ = _prepare(*_model())
    hidden = torch.randn(1, 16, WIDTH)[:, -1:]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = prepared.head(hidden.clone(memory_format=torch.contiguous_format))
            with profile() as run:
                got = prepared.head(hidden)
        names = {event.name for event in run.events()}
        assert "aten::mm" in names and not names & {"aten::bmm", "aten::expand"}, names
        assert torch.equal(got, expected)


def test_a_deep_copy_has_its_own_weight() -> None:
    prepared, _ = _prepare(*_model())
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        first = prepared(ids)
        twin = copy.deepcopy(prepared)
        assert twin.head.weight is twin.embed.weight
        twin.embed.weight.mul_(3.0)
        assert torch.equal(prepared(ids), first)
        assert torch.equal(twin(ids), _autocast_reference(twin, ids))
        assert twin.embed(ids).dtype == torch.float32


def test_a_weight_shared_with_a_module_that_is_no_linear_stays_float32() -> None:
    torch.manual_seed(0)
    model = TiedLM(head=MatmulHead).eval()
    ids = torch.randint(0, VOCAB, (2, 5))
    prepared, result = _prepare(model, ids)
    assert prepared.embed.weight.dtype == torch.float32
    assert prepared.head.weight is prepared.embed.weight
    assert prepared.body.weight.dtype == torch.bfloat16
    assert not any("share(s) its weight with a Linear" in n for n in result.notes)
