"""`torchbridge bench`: which variants run, the ratios and columns computed from what was
measured, skipped quantize modes, the machine in every report, progress at INFO, and the
second process's plumbing. The logic is tested with an injected prepare step, timer and
child process (no compiling, no timing assertions); one test starts the real processes,
and a slow one runs the whole benchmark on a tiny model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torchbridge
from torchbridge import bench, bench_firstcall, bench_render
from torchbridge.errors import ConfigurationError


def test_variants_are_the_baselines_then_the_levels() -> None:
    assert bench.variants_for("reference", None) == ("eager", "compile", "O1", "O2", "O3")
    assert bench.variants_for("reference", ["balanced"]) == ("eager", "compile", "O2")
    hf = bench.variants_for("hf", ["O3"])
    assert hf[:3] == ("eager", "compile", "O3")
    assert {"O3 no sample", "O3 int8", "O3 int8_weight_only", "O3 int4_weight_only",
            "O3 float8"} <= set(hf)
    assert bench.variants_for("reference", ["O3 int8"]) == ("eager", "compile", "O3 int8")
    assert bench.parse_variant("O3 no sample") == ("O3", False, None)
    assert bench.parse_variant("o2 int8_weight_only") == ("O2", True, "int8_weight_only")
    with pytest.raises(ValueError, match="quantize mode"):
        bench.variants_for("reference", ["O3 int3"])
    with pytest.raises(ConfigurationError, match="unknown optimization level"):
        bench.variants_for("reference", ["O7"])


def test_the_same_model_and_input_in_every_process() -> None:
    first_model, first_x = bench.build("reference", "mlp", 2, 0.125)
    torch.manual_seed(123)  # whatever the process did before
    second_model, second_x = bench.build("reference", "mlp", 2, 0.125)
    assert torch.equal(first_x, second_x)
    for a, b in zip(first_model.state_dict().values(), second_model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_the_warm_up_builds_a_generated_kernel() -> None:
    """Inductor's first generated C++ kernel in a process carries its one-time setup (2-5 s
    on the 2-core CI machine): the warm-up must build one, or the first variant that
    compiles pays it in its first-call column."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    before = metrics.generated_kernel_count
    with bench.cold_compiles():  # caches off: the warm-up compiles for real
        pass
    assert metrics.generated_kernel_count > before


def test_machine_names_the_cpu_and_its_speed_flags() -> None:
    m = bench.machine()
    assert m["cpu"] and m["torch"] == torch.__version__
    assert m["threads"] == torch.get_num_threads()
    assert sorted(m["cpu_flags"] + m["cpu_flags_absent"]) == sorted(bench.SPEED_FLAGS)
    from torchbridge.builtin.cpu.host import cpu_flags

    assert set(m["cpu_flags"]) == set(bench.SPEED_FLAGS) & cpu_flags()


# Injected figures: variant -> (prepare s, first forward s, latency s, quantize outcome).
FAKE = {
    "eager": (None, 0.01, 0.010, None),
    "compile": (0.1, 3.9, 0.008, None),
    "O2": (5.0, 1.0, 0.004, None),
    "O3 int8": (7.0, 1.0, 0.002, {"mode": "int8", "status": "applied", "cosine": 0.9994,
                                  "argmax_agreement": 0.945, "detail": "int8 through torchao"}),
    # Supported by this device's description, skipped by the run (e.g. no torchao).
    "O3 int8_weight_only": (2.0, 0.5, 0.0, {
        "mode": "int8_weight_only", "status": "skipped", "cosine": None,
        "argmax_agreement": None, "detail": "int8_weight_only: needs torchao"}),
}


def bench_backend() -> Any:
    import torchbridge

    return torchbridge.get_backend("cpu")


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """bench.run with prepare, timer, peak and child processes injected; what the fake child
    was asked is recorded."""
    calls: list[tuple[list[str], dict[str, str]]] = []

    def prepare(backend: Any, variant: str, model: Any, x: Any, expected: Any) -> Any:
        prepare_s, forward_s, latency, quantize = FAKE[variant]
        passes = [] if prepare_s is None or variant == "compile" else [
            {"name": "compile", "status": "applied", "seconds": prepare_s - 0.5},
            {"name": "autocast", "status": "applied", "seconds": 0.01}]
        v = bench._Variant(variant, lambda: latency, prepare_s, forward_s, 1e-3, "float32",
                           None, passes, quantize)
        return v

    def timer(fns: list[Any], synchronize: Any, **kwargs: Any) -> list[float]:
        return [fn() for fn in fns]  # each fake call returns its latency

    def child(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        calls.append((argv, env))
        second = sum(1 for a, _ in calls if a == argv) == 2
        return {"first_call_s": 1.5 if second else 6.0, "prepare_s": 1.0,
                "first_forward_s": 0.5,
                "cache": {"fxgraph_cache_hit": 2 if second else 0,
                          "fxgraph_cache_miss": 0 if second else 2}}

    monkeypatch.setattr(bench, "_prepare", prepare)
    monkeypatch.setattr(bench, "interleaved_latency", timer)
    monkeypatch.setattr(bench, "matmul_peak", lambda dtype, backend=None: 1e12)
    monkeypatch.setattr(bench, "_warm_inductor", lambda: None)
    monkeypatch.setattr(bench_firstcall, "run_child", child)
    return {"calls": calls}


class _MovingBackend:
    """The CPU backend, recording the modules moved to its device."""

    def __init__(self) -> None:
        import torchbridge

        self.cpu = torchbridge.get_backend("cpu")
        self.moved: list[torch.nn.Module] = []

    def to_device(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            self.moved.append(obj)
        return self.cpu.to_device(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cpu, name)


@pytest.mark.parametrize("variant", ["eager", "compile"])
def test_the_baselines_run_on_the_backend_device(monkeypatch: pytest.MonkeyPatch,
                                                 variant: str) -> None:
    """Eager and plain compile are timed on a copy of the model placed on the backend's
    device, where their input is moved (on an H100 every row failed: the model was left on
    the CPU); the model itself stays where it was, for the variants after them."""
    monkeypatch.setattr(torch, "compile", lambda model: model)  # what is compiled, not how
    backend = _MovingBackend()
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        expected = model(x)
    calls: list[torch.nn.Module] = []
    model.register_forward_hook(lambda module, *_: calls.append(module))  # copies keep it
    prepared = bench._prepare(backend, variant, model, x, expected)
    [moved] = backend.moved
    assert moved is not model and isinstance(moved, torch.nn.Linear)
    assert torch.equal(prepared.call(), expected) and prepared.rel_error == 0.0
    assert calls == [moved, moved]  # the first call, then a timed one: never the model


def test_the_matmul_peak_is_measured_on_the_backends_device() -> None:
    """Each row's "% of peak" is over the peak of the device it ran on: on a GPU the peak
    was the host CPU's, and a GPU row would have read far over 100%."""
    from types import SimpleNamespace

    made: list[torch.device] = []
    synced: list[int] = []

    class Device(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func is torch.randn:
                made.append(out.device)
            return out

    backend = SimpleNamespace(device=torch.device("meta"),
                              synchronize=lambda: synced.append(1))
    with Device():
        assert bench.matmul_peak(torch.bfloat16, backend, size=64) > 0
    assert made == [torch.device("meta")] * 2 and synced


def test_rows_ratios_skips_and_second_process(faked: dict[str, Any],
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="torchbridge.bench"):
        report = bench.run(models=["mlp"], scale=0.125, batch=2, backend="cpu",
                           levels=["O2", "O3 int8", "O3 int8_weight_only", "O3 float8"])
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == ["eager", "compile", "O2", "O3 int8"]
    assert {r["batch"] for r in rows.values()} == {2}
    assert rows["O2"]["speedup_vs_eager"] == pytest.approx(2.5)
    assert rows["O2"]["speedup_vs_compile"] == pytest.approx(2.0)
    assert rows["O3 int8"]["speedup_vs_eager"] == pytest.approx(5.0)
    # First call = prepare + first forward; its ratio to plain torch.compile's (4.0 s).
    assert rows["O2"]["first_call_s"] == pytest.approx(6.0)
    assert rows["O2"]["first_call_vs_compile"] == pytest.approx(1.5)
    assert rows["compile"]["first_call_vs_compile"] == pytest.approx(1.0)
    assert rows["eager"]["first_call_vs_compile"] is None
    assert rows["O3 int8"]["quantize_status"] == "applied"
    assert rows["O3 int8"]["quantize_cosine"] == pytest.approx(0.9994)
    # A mode the device does not support (float8 on a CPU: asked of the quantize pass's
    # support table, not prepared), or one the run skipped: not timed, with the reason.
    skipped = {s["variant"]: s for s in report["skipped"]}
    assert list(skipped) == ["O3 int8_weight_only", "O3 float8"]
    assert skipped["O3 float8"]["reason"] == bench.unsupported_quantize(
        bench_backend(), "float8")
    assert skipped["O3 float8"]["reason"].startswith("float8: ")
    assert skipped["O3 int8_weight_only"] == {
        "model": "mlp", "batch": 2, "variant": "O3 int8_weight_only", "status": "skipped",
        "reason": "int8_weight_only: needs torchao"}
    # The second process: for compile and each TorchBridge variant, two processes sharing
    # one cache folder; the second one's figures in the row.
    assert rows["eager"]["second_process_s"] is None
    for variant in ("compile", "O2", "O3 int8"):
        assert rows[variant]["second_process_s"] == pytest.approx(1.5)
        assert rows[variant]["first_process_s"] == pytest.approx(6.0)
        assert rows[variant]["second_process_cache"]["fxgraph_cache_hit"] == 2
    calls = faked["calls"]
    assert len(calls) == 6
    by_variant: dict[str, list[tuple[list[str], dict[str, str]]]] = {}
    for argv, env in calls:
        by_variant.setdefault(argv[argv.index("--variant") + 1], []).append((argv, env))
    for variant, pair in by_variant.items():
        (argv1, env1), (argv2, env2) = pair
        assert argv1 == argv2 and "--cache-dir" in argv1
        assert argv1[argv1.index("--model") + 1] == "mlp"
        assert argv1[argv1.index("--batch") + 1] == "2"
        assert argv1[argv1.index("--scale") + 1] == "0.125"
        assert argv1[argv1.index("--backend") + 1] == "cpu"
        cache = argv1[argv1.index("--cache-dir") + 1]
        if variant == "compile":  # plain torch.compile finds the folder through inductor
            assert env1["TORCHINDUCTOR_CACHE_DIR"] == env2["TORCHINDUCTOR_CACHE_DIR"] == cache
        else:  # TorchBridge only through its config; inductor's own folder empty each time
            assert cache not in (env1["TORCHINDUCTOR_CACHE_DIR"],
                                 env2["TORCHINDUCTOR_CACHE_DIR"])
            assert env1["TORCHINDUCTOR_CACHE_DIR"] != env2["TORCHINDUCTOR_CACHE_DIR"]
        assert not Path(cache).exists()  # removed afterwards
    steps = [r.getMessage() for r in caplog.records if r.name == "torchbridge.bench"]
    assert steps[0] == "bench 1/11: mlp batch 2 eager"
    assert "bench 7/11: mlp batch 2 compile second process" in steps
    assert steps[-2:] == ["bench 10/11: mlp batch 2 O3 int8_weight_only second process: "
                          "none, skipped",
                          "bench 11/11: mlp batch 2 O3 float8 second process: none, skipped"]
    assert report["machine"]["cpu"] and report["machine"]["date"]
    json.dumps(report)  # --json


def test_render_states_the_machine_and_every_column(faked: dict[str, Any]) -> None:
    report = bench.run(models=["mlp"], scale=0.125, batch=2,
                       levels=["O2", "O3 int8", "O3 int8_weight_only", "O3 float8"])
    text = bench.render(report)
    machine = text.splitlines()[0]
    assert machine.startswith("machine: ") and report["machine"]["cpu"] in machine
    assert report["machine"]["torch"] in machine and "threads" in machine
    assert text.count(machine) == 2  # above each table
    if report["machine"]["load_average"]["start"] is not None:  # what else ran beside it
        assert "load average" in machine
    assert "| first call s | vs compile's first call | second process first call s |" in text
    assert "| mlp | 2 | O2 | 4.00 | 2.50x | 2.00x | 6.0 | 1.50x | 1.5 (2/2 graphs cached) |" \
        in text
    assert "| applied: cosine 0.9994, argmax 94.5% |" in text
    assert "| mlp | 2 | O3 int8_weight_only | skipped: int8_weight_only: needs torchao |" \
        in text
    assert "| mlp | 2 | O3 float8 | skipped: float8: " in text
    # Where the first call's time goes: prepare_model's passes, slowest first, the rest.
    assert "| mlp | 2 | O2 | 6.0 | 5.0 | compile 4.5, rest 0.5 | 1.0 |" in text
    assert "| mlp | 2 | compile | 4.0 | 0.1 | - | 3.9 |" in text


def test_a_graph_inductor_would_not_cache_is_counted_as_such() -> None:
    """A second process whose graph inductor bypassed (prepacked oneDNN weights do not
    pickle) is not shown as "0/0 graphs": the graph is counted, and said not cacheable."""
    from torchbridge.bench_render import _second_process

    row = {"second_process_s": 4.2, "second_process_cache": {"fxgraph_cache_bypass": 1}}
    assert _second_process(row) == "4.2 (0/1 graphs cached, 1 not cacheable)"
    row["second_process_cache"] = {"fxgraph_cache_hit": 1}
    assert _second_process(row) == "4.2 (1/1 graphs cached)"


def test_a_failed_second_process_is_reported_not_fatal(faked: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    def broken(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        raise bench_firstcall.FirstCallError("exit status 1: RuntimeError: boom")

    monkeypatch.setattr(bench_firstcall, "run_child", broken)
    report = bench.run(models=["mlp"], scale=0.125, batch=2, levels=["O2"])
    o2 = next(r for r in report["rows"] if r["variant"] == "O2")
    assert o2["second_process_s"] is None and "boom" in o2["second_process_error"]
    assert "second process of mlp b2 O2 failed: exit status 1: RuntimeError: boom" in \
        bench.render(report)


def test_second_process_left_out_on_request(faked: dict[str, Any]) -> None:
    report = bench.run(models=["mlp"], scale=0.125, batch=2, levels=["O2"],
                       second_process=False)
    assert faked["calls"] == []
    assert all(r["second_process_s"] is None for r in report["rows"])


def test_second_process_for_real() -> None:
    """The processes start, build the model, prepare it and answer; the cache folder
    reaches them (O1 compiles nothing, so this stays quick: what the cache saves is
    measured by the benchmark, not asserted here)."""
    first, second = bench_firstcall.measure("reference", "mlp", 1, "O1", scale=0.125,
                                            backend="cpu", threads=1)
    for result in (first, second):
        assert result["first_call_s"] >= result["prepare_s"] > 0
        assert isinstance(result["cache"], dict)


def test_a_failing_process_says_why(tmp_path: Path) -> None:
    with pytest.raises(bench_firstcall.FirstCallError, match="exit status 2"):
        bench_firstcall.run_child(["--suite", "reference"], {"PATH": "/usr/bin"})


@pytest.mark.slow
def test_bench_runs_every_variant_and_checks_targets() -> None:
    report = bench.run(models=["mlp"], batch=4, scale=0.125, second_process=False)
    rows = report["rows"]
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
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
    O3, no-sample and int8 targets read from the rows."""
    pytest.importorskip("transformers")
    from torchbridge.hf_models import hf_reference_models

    ref = next(m for m in hf_reference_models(scale=0.125) if m.name == "bert")
    profile = bench.matmul_profile(ref.build(), ref.make_input(2))
    assert profile["eager_ms"] > 0 and 0 < profile["kernel_share"] <= 1
    assert profile["top_matmuls"] and "x" in profile["top_matmuls"][0]

    def row(variant: str, vs_eager: float, first: float = 1.0, model: str = "bert",
            **extra: Any) -> dict[str, Any]:
        return {"model": model, "batch": 8, "variant": variant, "speedup_vs_eager": vs_eager,
                "speedup_vs_compile": vs_eager / 1.2, "rel_error": 5e-3,
                "first_call_s": first, "latency_ms": 10 / vs_eager, **extra}

    gate = {"quantize": "int8", "quantize_cosine": 0.999, "quantize_argmax_agreement": 0.95}
    report = {"suite": "hf", "rows": [
        row("eager", 1.0, 0.0), row("compile", 1.2, 5.0), row("O1", 1.0), row("O2", 2.9),
        row("O3", 2.5, 2.0), row("O3 no sample", 0.9),
        row("O3", 2.2, model="llama"), row("compile", 1.1, model="llama"),
        row("O3 int8", 3.4, model="llama", quantize_status="rolled back", **gate)]}
    found = {name: ok for name, ok, _ in bench.targets(report)}
    assert found["bert at O3: >=2x eager, >=1.5x compile, err<1e-2"] is True  # O3, not O2
    assert found["bert at O3: first call <= 1.5x torch.compile's"] is True
    assert found["bert at O3 without a sample input: not slower than eager"] is False
    # Fast, but the gate rolled the quantization back: not the goal.
    assert found["llama at O3 int8: >=3x eager with the accuracy gate passing"] is False


def test_quantized_rows_read_the_report() -> None:
    """The figures and status of a quantized row come from prepare_model's report."""
    from torch import nn
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.quantize_gate import QuantizationReport
    from torchbridge.optimize.report import OptimizationResult, PassRecord

    def result(status: str, detail: str) -> OptimizationResult:
        out = OptimizationResult(nn.Linear(2, 2), "cpu", OptimizationLevel.O3,
                                 passes=[PassRecord("quantize", status, detail)])
        out.quantize_mode = "int8"
        out.quantization = QuantizationReport("int8", "torchao on 2 Linear layers", 0.99,
                                              0.9, cosine=0.9991, argmax_agreement=0.93)
        return out

    applied = bench.quantize_outcome(result("applied", "quantize int8"))
    assert applied["status"] == "applied" and applied["cosine"] == pytest.approx(0.9991)
    assert applied["argmax_agreement"] == pytest.approx(0.93)
    back = bench.quantize_outcome(result(
        "failed", "quantization int8 rolled back: cosine 0.9500 < 0.99"))
    assert back["status"] == "rolled back" and "cosine 0.9500 < 0.99" in back["detail"]
    row = {"quantize": "int8", "quantize_status": back["status"],
           "quantize_detail": back["detail"]}
    assert bench_render._gate(row) == \
        "rolled back: quantization int8 rolled back: cosine 0.9500 < 0.99"


def test_a_variant_prepare_model_cannot_prepare_is_reported(faked: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from torchbridge.errors import ModelOptimizationError

    fake = bench._prepare

    def failing(backend: Any, variant: str, *args: Any) -> Any:
        if variant == "O3 int8":
            raise ModelOptimizationError("pass 'inference_freezing' failed")
        return fake(backend, variant, *args)

    monkeypatch.setattr(bench, "_prepare", failing)
    report = bench.run(models=["mlp"], scale=0.125, batch=2, levels=["O2", "O3 int8"],
                       second_process=False)
    assert [r["variant"] for r in report["rows"]] == ["eager", "compile", "O2"]
    assert report["skipped"] == [{
        "model": "mlp", "batch": 2, "variant": "O3 int8", "status": "failed",
        "reason": "ModelOptimizationError: pass 'inference_freezing' failed"}]
    assert "| mlp | 2 | O3 int8 | failed: ModelOptimizationError: pass " \
        "'inference_freezing' failed |" in bench.render(report)


def test_a_calls_breakdown_counts_every_form_of_matrix_product() -> None:
    """The FLOPs behind call_breakdown's matmul rate, from the shapes the profiler records
    for each form a prepared model runs: the addend of addmm comes first, _int_mm.out
    records its out= tensor last, oneDNN's linear takes (..., K) by (N, K)."""
    from torchbridge.bench_profile import _part, _product_flops

    assert _product_flops("aten::mm", [[512, 256], [256, 8192]]) == 2 * 512 * 256 * 8192
    assert _product_flops("aten::_int_mm", [[512, 256], [256, 672], [512, 672]]) == \
        2 * 512 * 256 * 672
    assert _product_flops("aten::addmm", [[672], [512, 256], [256, 672], [], []]) == \
        2 * 512 * 256 * 672
    assert _product_flops("aten::bmm", [[16, 128, 64], [16, 64, 128]]) == \
        2 * 16 * 128 * 64 * 128
    assert _product_flops("mkldnn::_linear_pointwise", [[4, 128, 256], [672, 256], [672],
                                                        [], [], []]) == 2 * 512 * 256 * 672
    assert _product_flops("aten::_weight_int8pack_mm", [[512, 256], [672, 256], [672]]) == \
        2 * 512 * 256 * 672
    assert _product_flops("aten::_weight_int4pack_mm", [[512, 256], [84, 2, 32, 4], []]) == 0
    assert _product_flops("aten::mm", [[], []]) == 0
    assert [_part(n) for n in ("aten::_int_mm", "aten::_scaled_dot_product_flash_attention_"
                               "for_cpu", "aten::mkldnn_convolution",
                               "TorchDynamo Cache Lookup", "aten::add")] == \
        ["matmuls", "attention", "convolutions", "guards", "rest"]


def test_a_calls_breakdown_adds_up_to_the_profiled_call() -> None:
    from torchbridge.bench_profile import call_breakdown

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).eval()
    b = call_breakdown(model, torch.randn(32, 64), calls=3)
    parts = ("matmuls", "attention", "convolutions", "guards", "rest")
    assert b["profiled_ms"] == pytest.approx(sum(b[f"{p}_ms"] for p in parts))
    assert b["matmuls_ms"] > 0 and b["attention_ms"] == b["guards_ms"] == 0
    assert b["matmul_gflops"] is not None and b["matmul_gflops"] > 0 and b["wall_ms"] > 0


def test_a_row_without_a_sample_input_describes_what_its_first_call_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a sample input the first call decides what is kept: the row's passes and
    compute dtype are read after it (they were read before, and a row timing O0 in float32
    said bfloat16 and listed the undone passes as applied)."""
    def o0_fastest(synchronize: Any) -> Any:
        def time_call(label: str, fn: Any) -> float:
            fn()
            return {"O0": 0.1}.get(label, 1.0)
        return time_call

    monkeypatch.setattr("torchbridge.optimize.fastest.default_timer", o0_fastest)
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64)).eval()
    x = torch.randn(4, 64)
    with torch.inference_mode():
        expected = model(x)
    row = bench._prepare(backend, "O3 no sample", model, x, expected)
    applied = [p["name"] for p in row.passes if p["status"] == "applied"]
    assert row.compute_dtype == "float32" and "autocast" not in applied, row.passes
    assert any(p["name"] == "(first call timing)" for p in row.passes)
