"""copy.deepcopy of a model whose modules the kernel substitution pass changed keeps them
substituted (same kernel, same outputs); pickling still rebuilds them as their own classes,
which exist where the pickle is loaded (the substituted subclasses are made at run time)."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import KernelImplementation
from torchbridge.kernels import REFERENCE_KERNELS
from torchbridge.optimize.forward import install_forward


class Net(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def substituted(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules()
            if getattr(type(m), "_torchbridge_substituted", False)]


@pytest.fixture
def calls(reload_plugins: None) -> list[tuple[int, ...]]:
    """A counting rms_norm implementation, preferred on the example backend: the calls it
    records show which code a module runs."""
    recorded: list[tuple[int, ...]] = []

    def counting_rms_norm(x: torch.Tensor, weight: Any, eps: Any) -> torch.Tensor:
        recorded.append(tuple(x.shape))
        out: torch.Tensor = REFERENCE_KERNELS["rms_norm"](x, weight, eps)
        return out

    class Counting:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_kernel_implementations(self) -> list[KernelImplementation]:
            return [KernelImplementation("rms_norm", "counting_rms_norm", counting_rms_norm,
                                         priority=9, backends=("example",))]

    torchbridge.register_plugin(Counting(), name="counting")
    return recorded


def prepare(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """`model` at O3 on the example backend, the compile pass off (inductor's first call
    costs seconds here, and this is about the substituted modules)."""
    backend = torchbridge.get_backend("example")
    optimization = backend.config.optimization.model_copy(update={"disabled_passes": [
        "compile"]})
    backend = torchbridge.Backend(backend.status, backend.config.model_copy(
        update={"optimization": optimization}))
    prepared: nn.Module = backend.prepare_model(model, "O3", sample_input=x)
    result = torchbridge.optimization_result(prepared)
    assert result is not None
    records = {s["module"]: s for s in result.kernel_substitutions}
    norm = records.get("norm", records.get("(model)"))
    assert norm is not None
    assert (norm["status"], norm.get("implementation")) == ("substituted", "counting_rms_norm")
    return prepared


def test_a_deepcopy_keeps_the_substituted_modules_and_their_kernel(
        calls: list[tuple[int, ...]]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    prepared = prepare(Net().eval(), x)
    assert substituted(prepared) == ["norm"]
    calls.clear()
    with torch.no_grad():
        expected = prepared(x)
    assert calls == [(2, 8, 64)]

    twin = copy.deepcopy(prepared)
    assert substituted(twin) == ["norm"]
    assert type(twin.norm) is type(prepared.norm) and isinstance(twin.norm, nn.RMSNorm)
    assert twin.norm._torchbridge_substitution is prepared.norm._torchbridge_substitution
    # A copy, not the same module: its own parameters, with the same values.
    assert twin.norm is not prepared.norm
    assert twin.norm.weight.data_ptr() != prepared.norm.weight.data_ptr()
    assert torch.equal(twin.norm.weight, prepared.norm.weight)
    assert twin.norm.eps == prepared.norm.eps
    calls.clear()
    with torch.no_grad():
        out = twin(x)
    assert calls == [(2, 8, 64)]  # the copy runs the kernel
    assert torch.equal(out, expected)  # bit for bit

    # A substituted module copied on its own keeps its kernel too.
    norm = copy.deepcopy(prepared.norm)
    assert type(norm) is type(prepared.norm)
    calls.clear()
    with torch.no_grad():
        assert torch.equal(norm(x), prepared.norm(x))
    assert len(calls) == 2

    # The copy is independent: changing its weight leaves the original's output alone.
    with torch.no_grad():
        twin.norm.weight.mul_(2.0)
        assert torch.equal(prepared(x), expected)
        assert not torch.equal(twin(x), expected)


def test_a_deepcopy_of_a_substituted_top_level_model_keeps_its_kernel(
        calls: list[tuple[int, ...]]) -> None:
    # The prepared model is itself the substituted module; with a forward installed on it
    # (as the autocast and compile passes do), forward.py's deepcopy of the instance makes
    # the copy, and copies the substitution with the rest of its attributes.
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    model = nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        model.weight.add_(0.1 * torch.randn(64))
    prepared = prepare(model.eval(), x)
    assert substituted(prepared) == [""]
    with torch.no_grad():
        expected = prepared(x)
    twin = copy.deepcopy(prepared)
    assert type(twin) is type(prepared)
    assert twin._torchbridge_substitution is prepared._torchbridge_substitution
    calls.clear()
    with torch.no_grad():
        assert torch.equal(twin(x), expected)
    assert calls == [(2, 8, 64)]

    install_forward(prepared, lambda inner: lambda *args, **kwargs: inner(*args, **kwargs))
    assert "__deepcopy__" in prepared.__dict__
    twin = copy.deepcopy(prepared)
    assert type(twin) is type(prepared) and "__deepcopy__" not in twin.__dict__
    assert twin._torchbridge_substitution is prepared._torchbridge_substitution
    calls.clear()
    with torch.no_grad():
        assert torch.equal(twin(x), expected)
    assert calls == [(2, 8, 64)]


def test_pickled_substituted_modules_come_back_as_their_own_classes(
        calls: list[tuple[int, ...]]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    prepared = prepare(Net().eval(), x)
    with torch.no_grad():
        expected = prepared(x)
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    buffer.seek(0)
    twin = copy.deepcopy(prepared)
    for restored in (pickle.loads(pickle.dumps(prepared)), pickle.loads(pickle.dumps(twin)),
                     torch.load(buffer, weights_only=False)):
        assert type(restored.norm) is nn.RMSNorm
        assert "_torchbridge_substitution" not in restored.norm.__dict__
        assert substituted(restored) == []
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(restored(x), expected, rtol=1e-5, atol=1e-6)
        assert calls == []  # its own code
