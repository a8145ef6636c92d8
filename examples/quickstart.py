"""Prepare a conv net on this machine's best backend and show what was done."""

from __future__ import annotations

import torch
import torchbridge
from torchbridge.models import ConvNet


def main() -> None:
    backend = torchbridge.get_backend()
    info = backend.get_device_info()
    print(f"backend: {backend.name} on {info.name} ({info.vendor}); "
          f"low precision: {info.preferred_low_precision_dtype or 'none'}")

    torch.manual_seed(0)
    model = ConvNet(width=32).eval()  # torchbridge's reference conv net with BatchNorm
    x = torch.randn(32, 3, 64, 64)

    for level in ("O1", "O3"):
        result = backend.optimize(model, level, sample_input=x, measure=True)
        print(result.summary())
        out = result.model(backend.to_device(x))
        print(f"  output {tuple(out.shape)} {out.dtype} on {out.device}\n")

    stats = backend.get_memory_stats()
    print(f"memory: free {stats['free_gib']:.1f} GiB of {stats['total_gib']:.1f} GiB"
          if stats.total_bytes else "memory: unknown")


if __name__ == "__main__":
    main()
