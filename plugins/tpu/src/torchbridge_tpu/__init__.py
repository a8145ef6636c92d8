"""TorchBridge's Google TPU (torch-xla) backend plugin. Public API: `torchbridge.backends.tpu`."""
