"""What an optimization pass is, and the context it runs in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torchbridge.levels import OptimizationLevel

if TYPE_CHECKING:
    from torch import nn

    from torchbridge.backend import Backend
    from torchbridge.config import TorchBridgeConfig
    from torchbridge.optimize.settings import ProcessSetting
    from torchbridge.types import DeviceInfo


@dataclass
class PassContext:
    """Shared by the passes of one run. `state` carries decisions between passes (e.g. the
    autocast dtype, which the compile pass must wrap inside the compiled region)."""

    backend: Backend
    level: OptimizationLevel
    config: TorchBridgeConfig
    device_info: DeviceInfo
    training: bool
    sample_input: Any = None
    # The quantization mode asked for (prepare_model(quantize=...) or config
    # optimization.quantize): "int8", "int8_weight_only", "int4_weight_only", "float8".
    quantize: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class PassSkipped(Exception):
    """Raised by a pass's `apply` when it found, on looking closer than `check` can, that
    it has nothing to do: the model is restored and the pass reported skipped, with the
    message as the reason."""


def _always(model: nn.Module, ctx: PassContext) -> str | None:
    return None


@dataclass(frozen=True)
class OptimizationPass:
    """A named transformation.

    `check(model, ctx)` returns None when the pass applies, else the reason it is skipped;
    it only looks (a check that skips its pass after changing the model fails the pass).
    `apply(model, ctx)` returns the transformed model: the one given, or a replacement of
    the same class and state_dict keys (a wrapper fails the pass); no pass changes a
    module's training flag. Passes run in ascending `order`:
    placement 0, exact rewrites 10-40, precision 60, compilation 80, after compilation 90.
    `mutates=False` says apply changes neither the weights nor the structure of the model
    (it may replace the forward: autocast, compile). The pipeline does not trust it: it
    snapshots the model before every pass and compares after; a pass that declared False
    and changed weights or structure is rolled back and reported as having done so.

    `settings`: the process-wide settings apply changes (torchbridge.optimize.settings:
    TF32_MATMUL, CUDNN_BENCHMARK, ...). The report lists each change with its value before
    and after; settings torch reads at call time are then scoped to the prepared model's
    calls. A change to a setting the pipeline watches that the pass did not declare is
    rolled back as a failure.

    `effect(model, ctx)`: what the pass's effect looks like once every pass has run (a pass
    may depend on a later one: max_autotune on compile). None when it is observed on the
    prepared model or the process, else what is missing: the pass is then reported skipped
    ("no effect: ..."), and the settings it changed are put back. Without `effect`, the
    pipeline takes what it observes right after apply: a pass that changed nothing in the
    model, the watched settings or `ctx.state` is reported skipped.

    `output_check(reference, output)`: for passes that change what the model computes on
    purpose (quantization), the check of its output against O0's on the sample input
    instead of the level's tolerance, for this pass and every check after it in the run.
    It returns None when the output passes, else what failed with the figures; either
    way it may append its figures to the run's notes through the pass's apply.
    """

    name: str
    description: str
    min_level: OptimizationLevel
    apply: Callable[[nn.Module, PassContext], nn.Module] | None
    check: Callable[[nn.Module, PassContext], str | None] = _always
    mode: Literal["any", "inference", "training"] = "any"
    order: int = 50
    mutates: bool = True
    veto_reason: str | None = None
    settings: tuple[ProcessSetting, ...] = ()
    effect: Callable[[nn.Module, PassContext], str | None] | None = None
    output_check: Callable[[Any, Any], str | None] | None = None

    @classmethod
    def veto(cls, name: str, reason: str) -> OptimizationPass:
        """Returned from the passes hook: the pass `name` must not run, because `reason`."""
        return cls(name=name, description=reason, min_level=OptimizationLevel.O0, apply=None,
                   veto_reason=reason)
