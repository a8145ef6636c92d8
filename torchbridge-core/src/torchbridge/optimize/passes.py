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

    `check(model, ctx)` returns None when the pass applies, else the reason it is skipped.
    `apply(model, ctx)` returns the transformed model. Passes run in ascending `order`:
    placement 0, exact rewrites 10-40, precision 60, compilation 80, after compilation 90.
    `mutates=True` means apply changes the model it is given, so the pipeline snapshots it
    first to roll back on failure; a pass that only wraps the model sets it False.
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

    @classmethod
    def veto(cls, name: str, reason: str) -> OptimizationPass:
        """Returned from the passes hook: the pass `name` must not run, because `reason`."""
        return cls(name=name, description=reason, min_level=OptimizationLevel.O0, apply=None,
                   veto_reason=reason)
