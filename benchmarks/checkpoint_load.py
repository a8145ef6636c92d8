"""What load_checkpoint's CRC check costs: torch.load against load_checkpoint on one file.

    python benchmarks/checkpoint_load.py [--mb 256] [--runs 5]

The file is saved once and read alternately by both (medians), so both read it from the
page cache; the difference is the CRC-32 pass over every record that torch.load skips.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torchbridge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=256, help="checkpoint size in MB")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    tensors = max(1, args.mb // 16)
    state = {f"w{i}": torch.randn(4 << 20) for i in range(tensors)}  # 16 MB each
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ckpt.pt"
        torchbridge.save_checkpoint(state, path)
        plain, checked = [], []
        for _ in range(args.runs):
            started = time.perf_counter()
            torch.load(path, map_location="cpu", weights_only=True)
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            torchbridge.load_checkpoint(path)
            checked.append(time.perf_counter() - started)
    print(f"{tensors * 16} MB checkpoint, median of {args.runs}: torch.load "
          f"{statistics.median(plain):.3f} s, load_checkpoint (CRC checked) "
          f"{statistics.median(checked):.3f} s")


if __name__ == "__main__":
    main()
