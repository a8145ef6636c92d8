"""Test helpers for backend authors. Needs pytest.

    from torchbridge.testing import BackendContract

    class TestMyBackend(BackendContract):
        backend_name = "mybackend"
"""

from torchbridge.testing.contract import LEVEL_TOLERANCE, BackendContract

__all__ = ["LEVEL_TOLERANCE", "BackendContract"]
