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


def test_hf_suite_profile_and_targets() -> None:
    """The hf suite's evidence for its targets: where eager time goes (measured), and the
    O3 and no-sample targets read from the rows."""
    pytest.importorskip("transformers")
    from torchbridge.hf_models import hf_reference_models

    ref = next(m for m in hf_reference_models(scale=0.125) if m.name == "bert")
    profile = bench.matmul_profile(ref.build(), ref.make_input(2))
    assert profile["eager_ms"] > 0 and 0 < profile["kernel_share"] <= 1
    assert profile["top_matmuls"] and "x" in profile["top_matmuls"][0]

    def row(variant: str, vs_eager: float, first: float = 1.0) -> dict[str, object]:
        return {"model": "bert", "batch": 8, "variant": variant, "speedup_vs_eager": vs_eager,
                "speedup_vs_compile": vs_eager / 1.2, "rel_error": 5e-3,
                "first_call_s": first, "latency_ms": 10 / vs_eager}

    report = {"suite": "hf", "rows": [row("eager", 1.0, 0.0), row("compile", 1.2, 5.0),
                                      row("O1", 1.0), row("O2", 2.9), row("O3", 2.5, 2.0),
                                      row("O3 no sample", 0.9)]}
    found = {name: ok for name, ok, _ in bench.targets(report)}
    assert found["bert at O3: >=2x eager, >=1.5x compile, err<1e-2"] is True  # O3, not O2
    assert found["bert at O3: first call <= 1.5x torch.compile's"] is True
    assert found["bert at O3 without a sample input: not slower than eager"] is False
