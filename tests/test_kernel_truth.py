"""What the kernel machinery says must be what runs: a refused implementation stays refused,
its refusal names the hook it came from, a checked kernel works on meta tensors, and
overrides of the ops made with torch.library are reported wherever they were made."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
import torchbridge
from torchbridge import KernelImplementation
from torchbridge.kernels.choice import kernel_table
from torchbridge.plugins import plugin_records

_SRC = str(Path(torchbridge.__file__).resolve().parents[1])


def _wrong_shape(x: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    return x[..., :-1].clone()


def _wrong_values(x: torch.Tensor, weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    return x * 2.0


class _Declares:
    """A plugin declaring one rms_norm implementation for cpu, preferred over the others."""

    def __init__(self, name: str, forward: Any) -> None:
        self.name, self.forward = name, forward

    @torchbridge.hookimpl
    def torchbridge_kernel_implementations(self, backend: Any) -> list[KernelImplementation]:
        return [KernelImplementation(op="rms_norm", name=self.name, forward=self.forward,
                                     backends=("cpu",), priority=100)]


def _rms_entry(name: str) -> tuple[str, dict[str, Any]]:
    entry = next(e for e in kernel_table(torchbridge.get_backend("cpu"))
                 if e["op"] == "rms_norm")
    return entry["selected"], next(i for i in entry["implementations"] if i["name"] == name)


def test_a_refused_implementation_is_not_chosen_again(reload_plugins: None) -> None:
    # Bug: the refusal marked only the BoundKernel that made it; selection never learnt
    # of it, so the next get_kernel returned the same wrong implementation unchecked-for
    # (refused=None) and the kernel table kept showing it selected.
    torchbridge.register_plugin(_Declares("wrong_shape_rms", _wrong_shape), name="truth_e")
    kernel = torchbridge.get_kernel("rms_norm", "cpu")
    assert kernel.label == "wrong_shape_rms (plugin truth_e)"
    x, w = torch.randn(4, 64), torch.ones(64)
    out = kernel(x, w, 1e-6)
    assert kernel.refused is not None and out.shape == x.shape

    again = torchbridge.get_kernel("rms_norm", "cpu")
    assert again.implementation is None or again.implementation.name != "wrong_shape_rms"
    assert any(r.startswith("wrong_shape_rms (plugin truth_e): refused")
               for r in again.reasons), again.reasons
    torch.testing.assert_close(again(x, w, 1e-6),
                               torchbridge.kernels.reference("rms_norm")(x, w, 1e-6))
    selected, row = _rms_entry("wrong_shape_rms")
    assert selected != "wrong_shape_rms (plugin truth_e)"
    assert not row["eligible"] and row["reason"].startswith("refused")
    assert "returns shape [4, 63]" in row["reason"]


def test_a_refusal_is_forgotten_when_its_plugin_is_registered_again(
        reload_plugins: None) -> None:
    # The refusal belongs to that registration of the plugin: registered again (a fixed
    # version, a test reloading plugins), its implementation is tried afresh.
    torchbridge.register_plugin(_Declares("flaky_rms", _wrong_values), name="truth_e2")
    torchbridge.get_kernel("rms_norm", "cpu")(torch.randn(2, 8), None, 1e-6)
    assert _rms_entry("flaky_rms")[1]["reason"].startswith("refused")
    torchbridge.plugins.unregister_plugin("truth_e2")
    torchbridge.register_plugin(_Declares("flaky_rms", _wrong_values), name="truth_e2")
    assert torchbridge.get_kernel("rms_norm", "cpu").label == "flaky_rms (plugin truth_e2)"


def test_a_refused_first_contract_kernel_is_the_error_of_its_own_hook(
        reload_plugins: None) -> None:
    # Bug: every refusal was recorded "in torchbridge_kernel_implementations", a hook a
    # first-contract plugin (torchbridge_kernel) does not implement.
    class Legacy:
        @torchbridge.hookimpl
        def torchbridge_kernel(self, op: str, backend_name: str) -> Any:
            if op == "silu_mul" and backend_name == "cpu":
                return lambda gate, up: gate * up  # not silu

    torchbridge.register_plugin(Legacy(), name="truth_legacy")
    kernel = torchbridge.get_kernel("silu_mul", "cpu")
    assert kernel.provider == "truth_legacy"
    kernel(torch.randn(4, 8), torch.randn(4, 8))
    assert kernel.refused is not None
    errors = next(r.errors for r in plugin_records() if r.name == "truth_legacy")
    assert any(e.startswith("in torchbridge_kernel: op silu_mul:") for e in errors), errors
    assert not any("torchbridge_kernel_implementations" in e for e in errors), errors


def test_a_checked_kernel_on_meta_tensors_checks_at_the_first_real_call(
        reload_plugins: None) -> None:
    # Bug: the first-use check compared values on meta tensors and failed with
    # "Tensor.item() cannot be called on meta tensors". Meta inputs have no values: the
    # call goes through unchecked and the first real call is checked.
    torchbridge.register_plugin(_Declares("meta_wrong_rms", _wrong_values), name="truth_j")
    kernel = torchbridge.get_kernel("rms_norm", "cpu")
    x, w = torch.randn(4, 8, device="meta"), torch.ones(8, device="meta")
    out = kernel(x, w, 1e-6)
    assert out.device.type == "meta" and out.shape == (4, 8)
    assert kernel.refused is None
    real = torch.randn(4, 8)
    torch.testing.assert_close(kernel(real, torch.ones(8), 1e-6),
                               torchbridge.kernels.reference("rms_norm")(real, torch.ones(8),
                                                                         1e-6))
    assert kernel.refused is not None


def test_a_checked_kernel_on_fake_tensors_is_not_checked(reload_plugins: None) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    torchbridge.register_plugin(_Declares("fake_wrong_rms", _wrong_values), name="truth_j2")
    kernel = torchbridge.get_kernel("rms_norm", "cpu")
    with FakeTensorMode():
        out = kernel(torch.randn(4, 8), torch.ones(8), 1e-6)
    assert out.shape == (4, 8) and kernel.refused is None


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": _SRC}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_overrides_registered_before_the_ops_are_defined_are_reported() -> None:
    # Bug: register_op took its baseline (the dispatcher table) after defining the op, so
    # kernels registered for torchbridge::<op> before torchbridge's ops were imported
    # (torch accepts an impl ahead of its definition) counted as the op's own and
    # overridden_ops() said nothing, while they ran. In a fresh process: the ops are
    # defined once per process.
    out = _run("""
        import warnings; warnings.filterwarnings("ignore")
        import torch
        def my_silu(gate, up): return gate * 0 + 7
        torch.library.register_kernel("torchbridge::silu_mul", "cpu", my_silu)
        lib = torch.library.Library("torchbridge", "IMPL")
        lib.impl("rms_norm", lambda x, weight=None, eps=1e-6: x * 0, "CPU")
        from torchbridge.kernels import ops, overridden_ops
        assert float(ops.silu_mul(torch.ones(2), torch.ones(2))[0]) == 7.0
        for op, what in overridden_ops():
            print(op, "|", what)
    """)
    lines = [line for line in out.splitlines() if " | " in line]
    assert any(line.startswith("silu_mul | a CPU kernel") for line in lines), out
    assert any(line.startswith("rms_norm | a CPU kernel") and "Library.impl" in line
               for line in lines), out
    assert not any(line.startswith(("linear", "add_rms_norm")) for line in lines), out


def test_an_override_is_labelled_with_the_users_function() -> None:
    # Bug: register_kernel keeps the function inside torch wrappers (wrapped_fn, under
    # torch._disable_dynamo), and the label named torch/_compile.py's wrapper.
    out = _run("""
        import warnings; warnings.filterwarnings("ignore")
        import torch
        from torchbridge.kernels import ops, overridden_ops
        def my_silu(gate, up): return gate * 0 + 7
        torch.library.register_kernel("torchbridge::silu_mul", "cpu", my_silu)
        for op, what in overridden_ops():
            print(op, "|", what)
    """)
    assert "silu_mul | its kernel for device 'cpu' was replaced by __main__.my_silu" in out, \
        out
    assert "_compile.py" not in out and "wrapped_fn" not in out, out
