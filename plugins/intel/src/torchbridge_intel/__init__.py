"""TorchBridge's Intel XPU backend plugin. Public API: `torchbridge.backends.intel`."""
