"""An LM head tied to its embedding keeps its float32 weight at O3 (casting it would untie
it). Under autocast, uncompiled calls (generate()'s decoding steps) cast all of it at every
call: on the suite's Llama, generate() after O3 ran 0.79x eager's tokens per second. Such
a head now computes from a bfloat16 copy, made once and made again when the weight
changes; the tie, the state_dict, gradients and outputs are as they were. No timing: what
is counted is the casts of the head's weight."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torchbridge
from torch import nn
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB, WIDTH = 64, 16


class TiedLM(nn.Module):
    def __init__(self, head: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = head(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(self.embed(ids))))
        return out


class ScaledHead(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 0.5


class _Ops(TorchDispatchMode):
    """The aten ops a call runs, with their first argument's shape and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...], torch.dtype | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.ops.append((str(func.overloadpacket.__name__),
                         tuple(first.shape) if first is not None else (),
                         first.dtype if first is not None else None))
        return func(*args, **(kwargs or {}))

    def casts_of(self, shape: tuple[int, ...]) -> int:
        return sum(1 for name, s, dtype in self.ops
                   if name == "_to_copy" and s == shape and dtype == torch.float32)


@contextmanager
def _recorded() -> Iterator[_Ops]:
    with _Ops() as ops:
        yield ops


def _timer(label: str, fn: Callable[[], Any]) -> float:
    fn()
    return 1.0 if label == "prepared" else 2.0


def _prepare(model: nn.Module, ids: torch.Tensor) -> tuple[nn.Module, Any]:
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        precision="bfloat16", optimization={"disabled_passes": ["compile"]}))
    from torchbridge.optimize.pipeline import run_pipeline

    result = run_pipeline(backend, model, "O3", sample_input=ids, timer=_timer)
    assert "low_precision_weights" in result.optimizations_applied, result.summary()
    return result.model, result


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TiedLM().eval(), torch.randint(0, VOCAB, (2, 5))


def test_a_tied_head_casts_its_weight_once_not_at_every_call() -> None:
    """Before: one cast of the 64x16 float32 weight at every call (3 in 3 calls)."""
    prepared, result = _prepare(*_model())
    ids = torch.randint(0, VOCAB, (3, 7))
    with _recorded() as ops, torch.no_grad():
        for _ in range(3):
            prepared(ids)
    assert ops.casts_of((VOCAB, WIDTH)) <= 1  # none if prepare_model's checks made it
    assert any(note.startswith("low_precision_weights: head: ") and "compute from a "
               "bfloat16 copy of it" in note for note in result.notes), result.notes


def test_the_copy_gives_what_casting_at_each_call_gives_and_the_tie_stays() -> None:
    model, ids = _model()
    names = list(model.state_dict())
    count = sum(p.numel() for p in model.parameters())
    prepared, _ = _prepare(model, ids)
    assert prepared.head.weight is prepared.embed.weight
    assert prepared.head.weight.dtype == torch.float32
    assert list(prepared.state_dict()) == names
    assert sum(p.numel() for p in prepared.parameters()) == count
    for batch in (ids, torch.randint(0, VOCAB, (1, 9)), torch.randint(0, VOCAB, (4,))):
        with torch.enable_grad():  # the weight needs a gradient: cast at the call
            cast_each_call = prepared(batch)
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                assert torch.equal(prepared(batch), cast_each_call)


def test_the_copy_follows_the_weight_when_it_changes() -> None:
    """A stale copy would keep computing from the weights the model had before."""
    prepared, _ = _prepare(*_model())
    ids = torch.randint(0, VOCAB, (2, 6))

    def agrees() -> bool:
        with torch.enable_grad():
            cast_each_call = prepared(ids)
        with torch.no_grad():
            return torch.equal(prepared(ids), cast_each_call)

    with torch.no_grad():
        prepared(ids)  # the copy is made
    changes: list[Callable[[], Any]] = [
        lambda: prepared.load_state_dict({**prepared.state_dict(),
                                          "embed.weight": torch.randn(VOCAB, WIDTH)}),
        lambda: prepared.embed.weight.mul_(2.0),
        lambda: setattr(prepared.embed.weight, "data", torch.randn(VOCAB, WIDTH)),
    ]
    for change in changes:
        before = prepared(ids).detach()
        with torch.no_grad():
            change()
        assert agrees()
        assert not torch.equal(prepared(ids).detach(), before)


def test_gradients_still_reach_the_tied_weight_through_the_head() -> None:
    """Rows of the embedding no input looks up get a gradient only through the head: a
    copy used while training would leave them at zero."""
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
    torch.inference_mode(): a batched matmul over the weight expanded and copied (4 ms
    once per generate() on the suite's Llama). The profiler names the ops run."""
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
        assert got.shape == (1, 1, VOCAB)


def test_a_deep_copy_has_a_copy_of_its_own() -> None:
    prepared, _ = _prepare(*_model())
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        first = prepared(ids)
        twin = copy.deepcopy(prepared)
        twin.embed.weight.mul_(3.0)
        assert torch.equal(prepared(ids), first)
        with torch.enable_grad():
            cast_each_call = twin(ids)
        assert torch.equal(twin(ids), cast_each_call)
        assert not torch.equal(twin(ids), first)


def test_weights_made_under_inference_mode_follow_changes_as_before() -> None:
    """Inference tensors have no version counter to tell a change by: their head casts
    the weight at each call, and an in-place change shows in the next call."""

    def expected() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = torch.relu(prepared.body(prepared.embed(ids)))
            out = torch.nn.functional.linear(hidden, prepared.embed.weight)
        return out.float()

    with torch.inference_mode():
        model, ids = _model()
        prepared, _ = _prepare(model, ids)
        for _ in range(2):
            assert torch.equal(prepared(ids), expected())
            prepared.embed.weight.mul_(2.0)


def test_a_linear_subclass_with_its_own_forward_is_left_to_it() -> None:
    torch.manual_seed(0)
    model = TiedLM(head=ScaledHead).eval()
    ids = torch.randint(0, VOCAB, (2, 5))
    prepared, result = _prepare(model, ids)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model.head(torch.relu(prepared.body(prepared.embed(ids))))
        assert torch.equal(prepared(ids), expected.float())
    assert not any("bfloat16 copy of it" in note for note in result.notes)
