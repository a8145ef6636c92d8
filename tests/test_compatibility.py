"""check_compatibility for targets that are not here, and the seed aliases over it."""

from __future__ import annotations

import torch
import torchbridge
from torch import nn


class BranchyAttention(nn.Module):
    def __init__(self, dim: int = 40, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x)
        if out.sum() > 0:  # a host round trip on XLA
            out = out * 2
        keep = out[out > 0]  # a data-dependent shape
        return out + keep.numel()


def issues(report: torchbridge.compatibility.CompatibilityReport) -> dict[str, str]:
    return {i.what: f"{i.severity}: {i.detail}" for i in report.issues}


def test_float64_and_host_round_trips_on_tpu_that_is_not_here() -> None:
    model = BranchyAttention().double()
    report = torchbridge.check_compatibility(model, torch.randn(2, 5, 40).double(), "tpu")
    found = issues(report)
    assert "float64" in found and "TPU" in found["float64"]
    assert found["host round trip"].startswith("slow")
    assert "boolean mask" in found["dynamic shape"]
    assert report.compatible  # slow, not broken
    assert "tpu" in report.summary()


def test_head_size_bf16_and_fp8_against_an_absent_gpu() -> None:
    model = BranchyAttention(dim=40, heads=2).to(torch.bfloat16)  # head size 20
    report = torchbridge.check_compatibility(model, None, "cuda", compute_capability=(7, 5))
    found = issues(report)
    assert "head size 20" in found["attention head size"]
    assert "before Ampere" in found["bfloat16"]
    fp8 = nn.Linear(16, 16).to(torch.float8_e4m3fn)
    report = torchbridge.check_compatibility(fp8, None, "cuda", compute_capability=(8, 0))
    assert not report.compatible and "8.9" in issues(report)["fp8"]
    assert torchbridge.check_compatibility(fp8, None, "cuda",
                                           compute_capability=(9, 0)).compatible


def test_a_clean_model_on_cpu_has_no_issues_and_the_model_is_untouched() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    stats = model[1].running_mean.clone()
    report = torchbridge.check_compatibility(model, torch.randn(4, 8), "cpu")
    assert report.compatible and not report.issues
    assert torch.equal(model[1].running_mean, stats) and model.training


def test_seed_aliases() -> None:
    detector = torchbridge.HardwareDetector()
    profile = detector.detect()
    assert profile.hardware_type == detector.get_optimal_backend() == "cpu"
    validator = torchbridge.UnifiedValidator()
    report = validator.validate_nvidia_compatibility(BranchyAttention(),
                                                     compute_capability=(8, 0))
    assert report.backend == "cuda" and "attention head size" in issues(report)
    assert validator.validate_tpu_compatibility(nn.Linear(2, 2)).backend == "tpu"
