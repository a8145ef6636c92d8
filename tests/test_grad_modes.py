"""A prepared model compiled on its sample input (under no_grad, as prepare_model's checks
and timing run) serves calls under torch.inference_mode() from the same graphs: the first
inference call of a user does not compile the model a second time (dynamo guards on the
dispatch keys inference mode changes; measured 4.6-6.4 s of the first call for the small
Hugging Face models at O3). Compiles are counted, not timed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchbridge
from torch._dynamo.testing import CompileCounter
from torchbridge.optimize.forward import compile_state, compiled_forward


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4)).eval()


def _counted(model: torch.nn.Module) -> CompileCounter:
    counter = CompileCounter()
    compiled_forward(model, lambda fn: torch.compile(fn, backend=counter))
    return counter


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_inference_mode_call_reuses_the_graph_compiled_under_no_grad() -> None:
    model, x = _mlp(), torch.randn(2, 16)
    expected = model(x).detach()
    counter = _counted(model)
    with torch.no_grad():
        model(x)
    assert counter.frame_count == 1
    with torch.inference_mode():
        out = model(x)
        again = model(x)
    assert counter.frame_count == 1  # no second compile
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(again, expected)
    # An ordinary tensor, usable outside inference mode too (an inference tensor is not).
    assert not out.is_inference() and not out.requires_grad
    (out + torch.ones(4, requires_grad=True)).sum().backward()


def test_first_call_under_inference_mode_then_no_grad_compiles_once() -> None:
    model, x = _mlp(), torch.randn(2, 16)
    counter = _counted(model)
    with torch.inference_mode():
        model(x)
    with torch.no_grad():
        model(x)
    assert counter.frame_count == 1


def test_inference_tensor_input_keeps_inference_mode() -> None:
    """An input made under inference_mode may be updated in place by the model: outside
    inference mode that raises, so such calls stay in the caller's mode."""

    class Accumulate(torch.nn.Module):
        def forward(self, total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            total.add_(x)
            return total * 2

    model = Accumulate().eval()
    _counted(model)
    with torch.inference_mode():
        total, x = torch.zeros(3), torch.ones(3)
        out = model(total, x)
    state = compile_state(model)
    assert state is not None and state.error is None  # ran compiled, no fallback
    assert out.is_inference()
    torch.testing.assert_close(total, torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 2.0))


def test_grad_enabled_calls_keep_their_autograd() -> None:
    model, x = _mlp(), torch.randn(2, 16)
    _counted(model)
    out = model(x)
    assert out.requires_grad
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_prepared_model_first_inference_call_does_not_recompile() -> None:
    """End to end: O2 with a sample input compiles inside prepare_model; the user's first
    call under inference_mode compiles nothing more (inductor's compile counter)."""
    from torch._dynamo.utils import counters

    model, x = _mlp(), torch.randn(2, 16)
    expected = model(x).detach()
    result = torchbridge.get_backend("cpu").optimize(model, "O2", sample_input=x)
    status = {p.name: p.status for p in result.passes}
    assert status["compile"] == "applied", result.passes
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    with torch.inference_mode():
        out = result.model(x)
    assert counters["stats"]["unique_graphs"] == graphs
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
