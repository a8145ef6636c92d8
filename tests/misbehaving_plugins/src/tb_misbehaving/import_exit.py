"""Failure class 1: `raise SystemExit(3)` at import."""

from tb_misbehaving import ACTIVE

if ACTIVE:
    raise SystemExit(3)
