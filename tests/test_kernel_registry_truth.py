"""What the kernel registry accepts must be what it can serve: a malformed priority is its
plugin's error and leaves the op working for everyone, an op's reference must take the
schema's arguments in the schema's order, and the kernels guide's examples and claims hold
as written (on an install without the test plugins too)."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torchbridge
from torchbridge import KernelImplementation, OpDefinition
from torchbridge.errors import KernelError
from torchbridge.kernels import ops
from torchbridge.kernels.choice import kernel_table
from torchbridge.plugins import plugin_records

_SRC = str(Path(torchbridge.__file__).resolve().parents[1])
_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "kernels.md"


def _rms(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
         ) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps).clone()


def _errors(plugin: str) -> list[str]:
    return next(r.errors for r in plugin_records() if r.name == plugin)


# --- 4. priority ------------------------------------------------------------------------------

class _Priority:
    """A plugin declaring one cpu rms_norm implementation with the given priority."""

    def __init__(self, name: str, priority: Any) -> None:
        self.name, self.priority = name, priority

    @torchbridge.hookimpl
    def torchbridge_kernel_implementations(self, backend: Any) -> list[KernelImplementation]:
        return [KernelImplementation(op="rms_norm", name=self.name, forward=_rms,
                                     backends=("cpu",), priority=self.priority)]


@pytest.mark.parametrize("priority", ["10", None, float("nan"), float("inf"), True],
                         ids=["str", "None", "nan", "inf", "bool"])
def test_a_malformed_priority_is_its_plugins_error_and_the_op_keeps_working(
        priority: Any, reload_plugins: None) -> None:
    # Bug: contributions sorted on -impl.priority: "10" or None raised TypeError from
    # get_kernel, `torchbridge kernels` and O3's kernel pass for every user of the op,
    # naming no plugin and recording no error; NaN was accepted and ordered arbitrarily.
    torchbridge.register_plugin(_Priority("good_rms", 50), name="prio_good")
    torchbridge.register_plugin(_Priority("bad_prio_rms", priority), name="prio_bad")
    kernel = torchbridge.get_kernel("rms_norm", "cpu")
    assert kernel.label == "good_rms (plugin prio_good)"
    x, w = torch.randn(4, 64), torch.ones(64)
    torch.testing.assert_close(kernel(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    errors = _errors("prio_bad")
    assert any("'bad_prio_rms'" in e and "priority must be a finite number" in e
               and e.startswith("in torchbridge_kernel_implementations:") for e in errors), errors
    assert not _errors("prio_good")
    entry = next(e for e in kernel_table(torchbridge.get_backend("cpu")) if e["op"] == "rms_norm")
    assert "bad_prio_rms" not in [i["name"] for i in entry["implementations"]]
    json.dumps(entry)  # what `torchbridge kernels --json` prints


def test_a_malformed_priority_leaves_o3_kernel_substitution_working(
        reload_plugins: None) -> None:
    torchbridge.register_plugin(_Priority("bad_prio_rms", "10"), name="prio_bad_o3")
    config = torchbridge.TorchBridgeConfig(optimization={"disabled_passes": ["compile"]})
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8)).eval()
    prepared = torchbridge.get_backend("cpu", config=config).prepare_model(model, "O3")
    summary = torchbridge.optimization_result(prepared).summary()
    assert "failed   kernel_substitution" not in summary and "TypeError" not in summary, summary
    assert any("priority" in e for e in _errors("prio_bad_o3"))


def test_int_and_float_priorities_order_as_before(reload_plugins: None) -> None:
    torchbridge.register_plugin(_Priority("float_rms", 7.5), name="prio_float")
    torchbridge.register_plugin(_Priority("int_rms", 7), name="prio_int")
    assert torchbridge.get_kernel("rms_norm", "cpu").label == "float_rms (plugin prio_float)"
    assert not _errors("prio_float") and not _errors("prio_int")


# --- 9. an op's reference takes the schema's arguments in order -------------------------------

def _scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return x * scale + shift


def test_a_schema_naming_the_references_parameters_in_another_order_is_refused() -> None:
    # Bug: registered; torch.ops.torchbridge.<op>(x, shift=10, scale=2) computed x*10+2,
    # since torch passes the schema's arguments to the reference by position.
    definition = OpDefinition("truth_swapped_names", _scale_shift,
                              "(Tensor x, Tensor shift, Tensor scale) -> Tensor")
    with pytest.raises(KernelError) as caught:
        ops.register_op(definition)
    message = str(caught.value)
    assert "(x, shift, scale)" in message and "(x, scale, shift)" in message, message
    assert "'shift' in the schema but 'scale' in the reference" in message, message
    assert ops.definition("truth_swapped_names") is None
    assert not hasattr(torch.ops.torchbridge, "truth_swapped_names")


def _positional_eps(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * eps


def _keyword_eps(x: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    return x * eps


def _needs_extra(x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    return x + extra


def _own_default(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    return x * factor


def _star_args(x: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x * rest[0]


def _star_kwargs(x: torch.Tensor, **options: Any) -> torch.Tensor:
    return x * options["eps"]


@pytest.mark.parametrize("reference, schema, why", [
    (_keyword_eps, "(Tensor x, float eps=1e-06) -> Tensor",
     "'eps' is positional in the schema but keyword-only in the reference"),
    (_positional_eps, "(Tensor x, *, float epsilon=1e-06) -> Tensor",
     "keyword-only argument 'epsilon' is not a parameter of the reference"),
    (_needs_extra, "(Tensor x) -> Tensor", "'extra' is not in the schema and has no default"),
    (_positional_eps, "(Tensor x, float eps, float factor) -> Tensor",
     "no parameter at position 2 for the schema's argument 'factor'"),
], ids=["keyword-only in the reference", "keyword name differs", "extra without default",
        "too few parameters"])
def test_other_disagreements_with_the_schema_are_refused(reference: Any, schema: str,
                                                         why: str) -> None:
    name = f"truth_refused_{abs(hash((reference.__name__, schema))) % 10**8}"
    with pytest.raises(KernelError, match=re.escape(why)):
        ops.register_op(OpDefinition(name, reference, schema))
    assert ops.definition(name) is None


@pytest.mark.parametrize("name, reference, schema, call", [
    ("truth_ok_positional", _positional_eps, "(Tensor x, float eps=1e-06) -> Tensor",
     lambda op, x: op(x, 0.5)),
    ("truth_ok_keyword", _keyword_eps, "(Tensor x, *, float eps=1e-06) -> Tensor",
     lambda op, x: op(x, eps=0.5)),
    ("truth_ok_keyword_positional", _positional_eps, "(Tensor x, *, float eps) -> Tensor",
     lambda op, x: op(x, eps=0.5)),
    ("truth_ok_own_default", _own_default, "(Tensor x) -> Tensor",
     lambda op, x: op(x) * 0.25),
    ("truth_ok_star_args", _star_args, "(Tensor x, float eps) -> Tensor",
     lambda op, x: op(x, 0.5)),
    ("truth_ok_star_kwargs", _star_kwargs, "(Tensor x, *, float eps) -> Tensor",
     lambda op, x: op(x, eps=0.5)),
])
def test_references_that_agree_with_the_schema_register_and_compute(
        name: str, reference: Any, schema: str, call: Any) -> None:
    op = ops.register_op(OpDefinition(name, reference, schema))
    x = torch.randn(3)
    torch.testing.assert_close(call(op, x), x * 0.5)


def _renamed(inp: torch.Tensor, factor: float) -> torch.Tensor:
    return inp * factor


def test_a_reference_naming_its_parameters_otherwise_registers_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    # Another name at the same position binds right by position: such ops registered before
    # and compute right, so it is a warning, not a refusal (a swap is refused).
    with caplog.at_level("WARNING", logger="torchbridge.kernels.ops"):
        op = ops.register_op(OpDefinition("truth_ok_renamed", _renamed,
                                          "(Tensor x, float scale) -> Tensor"))
    x = torch.randn(3)
    torch.testing.assert_close(op(x, 0.5), x * 0.5)
    assert any("'x' is 'inp', 'scale' is 'factor'" in r.getMessage() for r in caplog.records)


class _SwappedOp:
    @torchbridge.hookimpl
    def torchbridge_ops(self) -> list[OpDefinition]:
        return [OpDefinition("truth_plugin_swapped", _scale_shift,
                             "(Tensor x, Tensor shift, Tensor scale) -> Tensor")]


def test_a_plugin_op_with_swapped_names_is_its_plugins_error(reload_plugins: None) -> None:
    from torchbridge.kernels.choice import known_ops

    torchbridge.register_plugin(_SwappedOp(), name="truth_swapped_op")
    assert "truth_plugin_swapped" not in known_ops()
    errors = _errors("truth_swapped_op")
    assert any(e.startswith("in torchbridge_ops: op 'truth_plugin_swapped'")
               and "(x, shift, scale)" in e for e in errors), errors


# --- 8. the guide's examples run as written -------------------------------------------------

def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_guides_first_examples_run_without_the_test_plugins(tmp_path: Path) -> None:
    # Bug: `kernel.implementation.name` raised AttributeError where the reference is chosen
    # (a CPU install without Triton): CI passed only because the test-only example plugin
    # contributes a cpu rms_norm. TORCHBRIDGE_PLUGINS=cpu loads the built-in plugins only.
    blocks = _python_blocks(_GUIDE.read_text(encoding="utf-8"))[:2]
    assert "get_kernel" in blocks[0] and "register_plugin" in blocks[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBRIDGE_")}
    env.update(TORCHBRIDGE_PLUGINS="cpu", PYTHONPATH=_SRC)
    done = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "reference", done.stdout


def test_the_guide_names_only_keywords_the_calls_take() -> None:
    # Bug: the guide said kernels are timed "only with prepare_model(..., measure=True)",
    # a TypeError: only backend.optimize takes measure.
    from torchbridge.backend import Backend

    text = _GUIDE.read_text(encoding="utf-8")
    calls = re.findall(r"\b(prepare_model|optimize)\(([^`]*?)\)", text)
    assert calls
    for method, arguments in calls:
        accepted = inspect.signature(getattr(Backend, method)).parameters
        for keyword in re.findall(r"\b(\w+)=", arguments):
            assert keyword in accepted, f"{method}(..., {keyword}=...) in kernels.md"


# --- 7. what get_kernel's check compares ----------------------------------------------------

def _wrong_backward(inputs: Any, output: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    return (grad * 3.0, None, None)


def test_the_guide_says_get_kernels_check_compares_no_gradients(reload_plugins: None) -> None:
    # The guide said "every kernel is checked before it runs" without saying that
    # get_kernel's check never looks at gradients: a wrong declared backward trains silently
    # through get_kernel (the substitution gate compares gradients when the model trains).
    text = " ".join(_GUIDE.read_text(encoding="utf-8").split())
    assert "The check compares the forward's outputs only, never gradients" in text
    assert "Gradients are compared by the substitution gate" in text

    class WrongBackward:
        @torchbridge.hookimpl
        def torchbridge_kernel_implementations(self, backend: Any) -> list[Any]:
            return [KernelImplementation(op="rms_norm", name="wrong_backward_rms",
                                         forward=_rms, backward=_wrong_backward,
                                         backends=("cpu",), priority=100)]

    torchbridge.register_plugin(WrongBackward(), name="truth_wrong_backward")
    kernel = torchbridge.get_kernel("rms_norm", "cpu")
    x = torch.randn(4, 64, requires_grad=True)
    kernel(x, None, 1e-6).sum().backward()
    reference_x = x.detach().clone().requires_grad_()
    ops.rms_norm(reference_x, None, 1e-6).sum().backward()
    # As documented: the forward matched, so the kernel stays; its gradients were not compared.
    assert kernel.refused is None
    assert x.grad is not None and reference_x.grad is not None
    assert not torch.allclose(x.grad, reference_x.grad)
