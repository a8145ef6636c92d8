"""Failure class 3: calls back into torchbridge (backend selection) while being imported by
the plugin loader."""

from tb_misbehaving import ACTIVE

if ACTIVE:
    import torchbridge

    SELECTED = torchbridge.detect_best_backend()
