"""Failure class 17: a list of broken passes for every backend. Three are malformed (left
out, reported when collected): apply=None without being a veto, min_level "O7", order None.
Two are well-formed but fail when run: check raises, apply returns None."""

from __future__ import annotations

from typing import Any

from torchbridge import OptimizationLevel, OptimizationPass, hookimpl

from tb_misbehaving import ACTIVE

O0 = OptimizationLevel.O0


def _identity(model: Any, ctx: Any) -> Any:
    return model


def _check_raises(model: Any, ctx: Any) -> str | None:
    raise RuntimeError("mb_check_raises: the check exploded")


def _apply_returns_none(model: Any, ctx: Any) -> Any:
    return None


def passes() -> list[Any]:
    """What the hook returns, in order (a plain function: no hook, no side effect)."""
    return [
        OptimizationPass("mb_no_apply", "apply is None but this is no veto", O0, None),
        OptimizationPass("mb_check_raises", "its check raises", O0, _identity,
                         check=_check_raises),
        OptimizationPass("mb_apply_none", "its apply returns None", O0, _apply_returns_none),
        OptimizationPass("mb_level_o7", "min_level beyond O3", "O7", _identity),  # type: ignore[arg-type]
        OptimizationPass("mb_order_none", "order is None", O0, _identity, order=None),  # type: ignore[arg-type]
    ]


if ACTIVE:

    @hookimpl
    def torchbridge_optimization_passes() -> list[Any]:
        return passes()
