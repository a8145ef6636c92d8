"""Relative error of the core's FP8Linear against float32, per FP8 dtype, on random layers.

`python benchmarks/fp8_error.py`: runs on CPU (torch._scaled_mm for OCP e4m3; the fnuz
dtype, which oneDNN refuses, as the same quantized operands multiplied in float32) or on a
GPU with `--device cuda`. Error is ||fp8(x) - linear(x)|| / ||linear(x)|| (Frobenius).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torchbridge.fp8 import FP8Linear

SHAPES = ((256, 128), (1024, 1024), (4096, 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        errors = []
        for fan_in, fan_out in SHAPES:
            linear = nn.Linear(fan_in, fan_out).to(args.device)
            x = torch.randn(64, fan_in, device=args.device)
            with torch.no_grad():
                got = FP8Linear.from_linear(linear, fp8_dtype=dtype)(x).float()
                expected = linear(x).float()
            errors.append(float((got - expected).norm() / expected.norm()))
        print(f"{str(dtype).removeprefix('torch.'):<16} "
              + "  ".join(f"{i}x{o}: {e:.2%}" for (i, o), e in zip(SHAPES, errors, strict=True)))


if __name__ == "__main__":
    main()
