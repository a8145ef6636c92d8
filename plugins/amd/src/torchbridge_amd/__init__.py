"""TorchBridge's AMD ROCm backend plugin. Public API: `torchbridge.backends.amd`."""
