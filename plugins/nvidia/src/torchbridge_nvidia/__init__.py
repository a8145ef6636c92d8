"""TorchBridge's NVIDIA CUDA backend plugin. Public API: `torchbridge.backends.nvidia`."""
