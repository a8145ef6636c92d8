"""`torchbridge bench` runs end to end (tiny models: figures come from the real run)."""

from __future__ import annotations

import pytest
from torchbridge import bench


@pytest.mark.slow
def test_bench_runs_every_variant_and_checks_targets(tmp_path: object) -> None:
    seen: list[str] = []
    report = bench.run(models=["mlp"], batches={"mlp": (4,)}, scale=0.125,
                       progress=lambda done, total, what: seen.append(what))
    rows = report["rows"]
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    assert seen[-1] == "done"
    for r in rows:
        assert r["latency_ms"] > 0 and r["first_call_s"] > 0 and r["tflops"] > 0
        assert r["rel_error"] < 3e-2
    assert next(r for r in rows if r["variant"] == "eager")["speedup_vs_eager"] == 1.0
    assert report["matmul_peak_tflops"]["float32"] > 0
    names = [name for name, _, _ in bench.targets(report)]
    assert any("first call" in n for n in names)
    text = bench.render(report)
    assert "| mlp | 4 | O2 |" in text and "targets:" in text
