"""The kernel side of the plugin contract (issue 23, items 5 and 6), against misbehaving
plugins from tests/misbehaving_plugins: ops a plugin declares are registered under
validated names and without waiting for get_kernel; direct torch.library overrides of an
op are reported; the gate checks in the dtype and on the shapes the level runs, names a
wrong dtype, and get_kernel's kernel is checked on first use."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import OpDefinition
from torchbridge.kernels import ops, overridden_ops, register_plugin_ops
from torchbridge.kernels.choice import kernel_table, known_ops

SOURCES = Path(__file__).parent / "misbehaving_plugins" / "src" / "tb_misbehaving"
GATE = "TB_MISBEHAVING_PLUGINS"


def load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The misbehaving module `name`, active, loaded from its source on its own (not in
    sys.modules: the installed package and every other module of it stay inert)."""
    monkeypatch.setenv(GATE, "1")
    spec = importlib.util.spec_from_file_location(f"tb_misbehaving_{name}",
                                                  SOURCES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv(GATE)
    assert module.ACTIVE
    return module


@pytest.fixture
def plugins(reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Register misbehaving modules by name; plugins are reloaded as installed after."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton's would serve cpu

    def register(name: str) -> ModuleType:
        module = load(name, monkeypatch)
        torchbridge.register_plugin(module, name=name)
        return module

    yield register


def errors_of(name: str) -> list[str]:
    return next(r for r in torchbridge.plugins.plugin_records() if r.name == name).errors


def cpu_without_compile() -> Any:
    """The cpu backend with the compile pass off (these tests are about the gate)."""
    backend = torchbridge.get_backend("cpu")
    optimization = backend.config.optimization.model_copy(update={"disabled_passes": [
        "compile"]})
    return torchbridge.Backend(backend.status, backend.config.model_copy(
        update={"optimization": optimization}))


class ProjectedNorm(nn.Module):
    """A norm right after a projection: under bf16 autocast it receives bfloat16."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.add_(0.5 * torch.randn(hidden))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


def norm_record(model: nn.Module) -> dict[str, Any]:
    result = torchbridge.optimization_result(model)
    assert result is not None
    return next(s for s in result.kernel_substitutions if s["module"] == "norm")


def refusal(record: dict[str, Any], kernel: str) -> str:
    return next(r for r in record["rejected"] if r.startswith(kernel))


# -- item 6: the gate ---------------------------------------------------------------------
def test_a_kernel_returning_the_wrong_dtype_is_refused_as_such_without_a_sample(
        plugins: Any) -> None:
    misfit = plugins("kernel_dtype_misfit")
    torch.manual_seed(0)
    prepared = cpu_without_compile().prepare_model(ProjectedNorm().eval(), "O3")
    record = norm_record(prepared)
    assert record.get("implementation") != misfit.NAME
    why = refusal(record, misfit.NAME)
    assert "returns float32 where the reference returns bfloat16" in why, why
    assert "bfloat16[2, 8, 64]" in why and "inf" not in why


def test_a_kernel_returning_the_wrong_dtype_is_refused_as_such_with_a_sample(
        plugins: Any) -> None:
    misfit = plugins("kernel_dtype_misfit")
    torch.manual_seed(0)
    prepared = cpu_without_compile().prepare_model(ProjectedNorm().eval(), "O3",
                                                   sample_input=torch.randn(3, 5, 64))
    why = refusal(norm_record(prepared), misfit.NAME)
    assert "returns float32 where the reference returns bfloat16" in why, why
    assert "differs from the reference by inf" not in why


def test_a_kernel_wrong_above_one_tile_is_refused_without_a_sample(plugins: Any) -> None:
    shaped = plugins("kernel_shape_dependent")
    torch.manual_seed(0)
    prepared = cpu_without_compile().prepare_model(ProjectedNorm().eval(), "O3")
    record = norm_record(prepared)
    assert record.get("implementation") != shaped.NAME
    why = refusal(record, shaped.NAME)
    assert "differs from the reference by" in why and "131" in why, why


def test_a_right_kernel_passes_every_probe(reload_plugins: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    class Right:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_kernel_implementations(self) -> list[Any]:
            return [torchbridge.KernelImplementation(
                "rms_norm", "right_rms_norm", torchbridge.kernels.reference("rms_norm"),
                priority=100, backends=("cpu",))]

    torchbridge.register_plugin(Right(), name="right")
    torch.manual_seed(0)
    record = norm_record(cpu_without_compile().prepare_model(ProjectedNorm().eval(), "O3"))
    assert (record["status"], record["implementation"]) == ("substituted", "right_rms_norm")
    assert "4 inputs checked" in record["detail"]  # fp32 and bf16, two shapes each


def test_get_kernel_checks_a_kernel_on_first_use(plugins: Any) -> None:
    misfit = plugins("kernel_dtype_misfit")
    kernel = torchbridge.get_kernel("rms_norm", "cpu")
    assert kernel.checked and kernel.implementation.name == misfit.NAME
    unchecked = kernel.unchecked()
    x32, w = torch.randn(4, 64), torch.randn(64)
    torch.testing.assert_close(kernel(x32, w, 1e-6), ops.rms_norm(x32, w, 1e-6))
    assert kernel.implementation is not None  # right in float32
    x16 = torch.randn(4, 64, dtype=torch.bfloat16)
    out = kernel(x16, w, 1e-6)
    assert out.dtype == torch.bfloat16  # the reference ran
    assert kernel.implementation is None and kernel.label == "reference"
    assert "returns float32 where the reference returns bfloat16" in str(kernel.refused)
    assert any("returns float32 where the reference returns bfloat16" in e
               for e in errors_of("kernel_dtype_misfit"))
    assert unchecked(x16, w, 1e-6).dtype == torch.float32  # unchecked: as it is


def test_get_kernel_checks_each_new_shape(plugins: Any) -> None:
    shaped = plugins("kernel_shape_dependent")
    kernel = torchbridge.get_kernel("rms_norm", "cpu")
    w = torch.randn(64) + 1.5
    small, large = torch.randn(16, 64), torch.randn(2, 65, 64)
    torch.testing.assert_close(kernel(small, w, 1e-6), ops.rms_norm(small, w, 1e-6))
    assert kernel.implementation is not None and kernel.implementation.name == shaped.NAME
    torch.testing.assert_close(kernel(large, w, 1e-6), ops.rms_norm(large, w, 1e-6))
    assert kernel.implementation is None
    assert "differs from the reference by" in str(kernel.refused)


# -- item 5: ops ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["__class__", "name", "_dir", "lambda", "match", "a-b",
                                  "rms_norm__x", "x" * 65, "é", 3])
def test_op_names_are_validated(name: Any) -> None:
    assert ops.op_name_problem(name) is not None
    with pytest.raises(torchbridge.KernelError, match="op name"):
        ops.register_op(OpDefinition(name, lambda x: x * 2, "(Tensor x) -> Tensor"))


def test_ops_with_bad_names_are_the_plugins_error(plugins: Any,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = plugins("op_bad_name")
    names = known_ops()
    assert bad.GOOD_NAME in names and not set(bad.BAD_NAMES) & set(names)
    errors = errors_of("op_bad_name")
    for name in bad.BAD_NAMES:
        assert any(f"op name {name!r}" in e for e in errors), (name, errors)
    x = torch.ones(3)
    torch.testing.assert_close(getattr(torch.ops.torchbridge, bad.GOOD_NAME)(x), x * 2)
    assert torchbridge.get_kernel(bad.GOOD_NAME, "cpu")(x).tolist() == [2.0] * 3
    assert callable(torchbridge.get_kernel("rms_norm", "cpu"))
    table = kernel_table(torchbridge.get_backend("cpu"))
    assert bad.GOOD_NAME in {row["op"] for row in table}
    from torchbridge.cli import main

    assert main(["kernels", "--backend", "cpu", "--json"]) == 0
    assert bad.GOOD_NAME in {row["op"] for row in json.loads(capsys.readouterr().out)}


def late_plugin(monkeypatch: pytest.MonkeyPatch, op: str) -> Any:
    return load("op_late", monkeypatch).LateOps(op)


def registered(op: str) -> bool:
    return hasattr(torch.ops.torchbridge, op) and ops.definition(op) is not None


def test_a_plugins_op_exists_after_register_plugin_ops(reload_plugins: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    torchbridge.register_plugin(late_plugin(monkeypatch, "late_scale_a"), name="op_late")
    assert not registered("late_scale_a")
    assert "late_scale_a" in register_plugin_ops()
    x = torch.ones(2)
    assert torch.ops.torchbridge.late_scale_a(x, 3.0).tolist() == [3.0, 3.0]


def test_a_plugins_op_exists_after_an_o3_prepare_model_that_never_uses_it(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    torchbridge.register_plugin(late_plugin(monkeypatch, "late_scale_b"), name="op_late")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # no module any pattern knows
    cpu_without_compile().prepare_model(model, "O3")
    assert registered("late_scale_b")


def test_a_plugins_op_exists_after_get_backend(reload_plugins: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    torchbridge.register_plugin(late_plugin(monkeypatch, "late_scale_c"), name="op_late")
    torchbridge.get_backend("cpu")
    assert registered("late_scale_c")


def test_the_module_level_late_op_plugin(plugins: Any) -> None:
    late = plugins("op_late")
    assert late.OP in known_ops()
    kernel = torchbridge.get_kernel(late.OP, "cpu")
    assert kernel.implementation.name == "late_scale_kernel"
    assert kernel(torch.ones(2)).tolist() == [2.0, 2.0]


def core_overrides() -> list[tuple[str, str]]:
    core = {d.name for d in ops.BUILTIN_OPS}
    return [(op, what) for op, what in overridden_ops() if op in core]


def test_a_direct_override_of_a_core_op_is_reported() -> None:
    assert core_overrides() == []
    x = torch.randn(3, 8)
    lib = torch.library.Library("torchbridge", "IMPL")
    try:
        lib.impl("silu_mul", lambda gate, up: gate * 0, "CPU")
        assert ops.silu_mul(x, x).abs().max() == 0  # the override runs
        found = core_overrides()
        assert [op for op, _ in found] == ["silu_mul"]
        assert "a CPU kernel was registered at" in found[0][1]
        assert "test_kernel_contract.py" in found[0][1]
    finally:
        lib._destroy()
    assert core_overrides() == []
    torch.testing.assert_close(ops.silu_mul(x, x), torch.nn.functional.silu(x) * x)


def test_a_replaced_fake_or_autograd_is_reported(reload_plugins: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    torchbridge.register_plugin(late_plugin(monkeypatch, "late_scale_e"), name="op_late")
    register_plugin_ops()
    qualified = "torchbridge::late_scale_e"
    torch.library.register_fake(qualified)(lambda x, factor=2.0: x.new_empty(x.shape))
    torch.library.register_autograd(qualified, lambda ctx, grad: (grad, None))
    found = [what for op, what in overridden_ops() if op == "late_scale_e"]
    assert any("its fake (meta) implementation was replaced" in w for w in found), found
    assert any("its autograd was replaced" in w for w in found), found
