"""The second half of failure class 24: a distribution whose entry point "twin" clashes with
torchbridge-misbehaving-plugins'. Inert unless TB_MISBEHAVING_PLUGINS=1, like that package."""

from __future__ import annotations

import os

ACTIVE = os.environ.get("TB_MISBEHAVING_PLUGINS") == "1"
