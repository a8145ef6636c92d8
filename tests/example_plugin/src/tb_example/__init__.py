"""A third-party TorchBridge plugin used by the test suite."""
