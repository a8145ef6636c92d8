"""Test helpers for backend authors. Needs pytest.

    from torchbridge.testing import BackendContract

    class TestMyBackend(BackendContract):
        backend_name = "mybackend"
"""

from torchbridge.levels import LEVEL_TOLERANCE
from torchbridge.testing.contract import BackendContract

__all__ = ["LEVEL_TOLERANCE", "BackendContract"]
