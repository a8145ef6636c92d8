"""The benchmark's report as text and charts: the latency table, where each first call's time
goes, the issue's targets checked against the rows. Every table is headed by the machine it
was measured on."""

from __future__ import annotations

from typing import Any


def machine_line(report: dict[str, Any]) -> str:
    """The machine a report's figures come from, in one line."""
    m = report.get("machine")
    if m is None:  # a report from before machines were recorded
        return (f"machine: {report['device']} ({report['backend']}), torch "
                f"{report['torch']}, {report['threads']} threads")
    flags = ", ".join(m["cpu_flags"]) or "none of them"
    absent = f"; without {', '.join(m['cpu_flags_absent'])}" if m["cpu_flags_absent"] else ""
    load = m.get("load_average") or {}
    busy = f"; load average {load['start']:.1f} at start, {load['end']:.1f} at end" \
        if load.get("start") is not None and load.get("end") is not None else ""
    return (f"machine: {m['cpu']}, CPU flags {flags}{absent}; backend {m['backend']} "
            f"({m['device']}), torch {m['torch']}, {m['threads']} threads, {m['date']}"
            f"{busy}")


def _seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _second_process(r: dict[str, Any]) -> str:
    if r.get("second_process_error"):
        return "failed"
    if r.get("second_process_s") is None:
        return "-"
    cache = r.get("second_process_cache") or {}
    hits, misses = cache.get("fxgraph_cache_hit", 0), cache.get("fxgraph_cache_miss", 0)
    # Bypassed: inductor would not cache the graph (up to 0.3.0, prepacked oneDNN weights;
    # now a graph holding another object its cache cannot key).
    bypassed = cache.get("fxgraph_cache_bypass", 0)
    graphs = hits + misses + bypassed
    why = f", {bypassed} not cacheable" if bypassed else ""
    return f"{r['second_process_s']:.1f}" + (f" ({hits}/{graphs} graphs cached{why})"
                                            if graphs else "")


def _gate(r: dict[str, Any]) -> str:
    if r.get("quantize") is None:
        return "-"
    if r["quantize_status"] != "applied":  # the report's words say why, with the figures
        return f"{r['quantize_status']}: {r.get('quantize_detail')}"
    figures = []
    if r.get("quantize_cosine") is not None:
        figures.append(f"cosine {r['quantize_cosine']:.4f}")
    if r.get("quantize_argmax_agreement") is not None:
        figures.append(f"argmax {r['quantize_argmax_agreement']:.1%}")
    return f"{r['quantize_status']}" + (f": {', '.join(figures)}" if figures else "")


def _not_timed(s: dict[str, Any]) -> str:
    """A variant skipped or failed, in the latency table (a long error cut short: the
    JSON report has all of it)."""
    reason = s["reason"] if len(s["reason"]) <= 300 else s["reason"][:300] + " ..."
    return f"| {s['model']} | {s['batch']} | {s['variant']} | " \
           f"{s.get('status', 'skipped')}: {reason} |" + " |" * 9


def _first_call_table(report: dict[str, Any]) -> list[str]:
    lines = ["where the first call's time goes (seconds; prepare_model's passes and, in "
             "parentheses, its stages outside them, from its report, slowest first; rest: "
             "the remainder):",
             "",
             "| model | batch | variant | first call | torch.compile / prepare_model | "
             "passes | first forward |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        if r.get("prepare_s") is None:
            continue
        timed = sorted((p for p in r.get("passes", []) if p["seconds"] >= 0.05),
                       key=lambda p: -p["seconds"])
        rest = r["prepare_s"] - sum(p["seconds"] for p in r.get("passes", []))
        parts = [f"{p['name']} {p['seconds']:.1f}" for p in timed]
        if r.get("passes") and rest >= 0.05:
            parts.append(f"rest {rest:.1f}")
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | "
                     f"{r['first_call_s']:.1f} | {r['prepare_s']:.1f} | "
                     f"{', '.join(parts) or '-'} | {r.get('first_forward_s', 0.0):.1f} |")
    return lines


def render(report: dict[str, Any]) -> str:
    peaks = ", ".join(f"{k} {v:.3f}" for k, v in report["matmul_peak_tflops"].items())
    here = machine_line(report)
    lines = [here, f"matmul peak TFLOP/s: {peaks}", "",
             "| model | batch | variant | latency ms | vs eager | vs compile | first call s "
             "| vs compile's first call | second process first call s | quantize gate "
             "| rel error | TFLOP/s | % of peak (dtype) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    skipped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for s in report.get("skipped", []):
        skipped.setdefault((s["model"], s["batch"]), []).append(s)
    rows = report["rows"]
    for i, r in enumerate(rows):
        ratio = r.get("first_call_vs_compile")
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['latency_ms']:.2f} "
                     f"| {r['speedup_vs_eager']:.2f}x | {r['speedup_vs_compile']:.2f}x "
                     f"| {r['first_call_s']:.1f} | {'-' if ratio is None else f'{ratio:.2f}x'} "
                     f"| {_second_process(r)} | {_gate(r)} "
                     f"| {r['rel_error']:.1e} | {r['tflops']:.3f} "
                     f"| {r['peak_fraction']:.0%} ({r['compute_dtype']}) |")
        last = i + 1 == len(rows) or (rows[i + 1]["model"], rows[i + 1]["batch"]) != \
            (r["model"], r["batch"])
        if last:  # a model's skipped variants after its measured ones
            for s in skipped.pop((r["model"], r["batch"]), []):
                lines.append(_not_timed(s))
    for group in skipped.values():  # a model whose every variant was skipped
        for s in group:
            lines.append(_not_timed(s))
    failed = [r for r in rows if r.get("second_process_error")]
    lines += [f"second process of {r['model']} b{r['batch']} {r['variant']} failed: "
              f"{r['second_process_error']}" for r in failed]
    lines += ["", here, *_first_call_table(report), ""]
    for key, prof in report.get("matmul_profile", {}).items():
        lines.append(f"{key}: eager fp32 {prof['eager_ms']:.1f} ms, "
                     f"{prof['kernel_share']:.0%} in matmul/attention/conv kernels; top "
                     f"matmuls (MxKxN, time share, fp32 rate): "
                     f"{', '.join(prof['top_matmuls'])}")
    for g in report.get("generation", []):
        lines.append(f"generate {g['model']} prompt {g['prompt']}, {g['new_tokens']} new "
                     f"tokens: eager {g['eager_tokens_per_s']:.1f} tok/s, O3 "
                     f"{g['O3_tokens_per_s']:.1f} tok/s ({g['speedup']:.2f}x), same tokens: "
                     f"{g['same_tokens']}")
    checked = targets(report)
    if checked:  # none without an O1-O3 row: no heading over nothing
        lines += ["", "targets:"]
        lines += [f"  [{'met' if ok else 'MISSED'}] {name}: {ev}" for name, ok, ev in checked]
    return "\n".join(lines)


def targets(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Issues 3 and 21's targets checked against one run: (target, met, evidence)."""
    rows = report["rows"]
    out = []
    hf = report.get("suite") == "hf"
    for model in sorted({r["model"] for r in rows}):
        candidates = [r for r in rows if r["model"] == model and r["variant"] in
                      (("O3",) if hf else ("O1", "O2", "O3"))]
        if not candidates:
            continue
        best = max(candidates, key=lambda r: r["speedup_vs_eager"])
        mine = [r for r in rows if r["model"] == model and r["variant"] == best["variant"]]
        ok = all(r["speedup_vs_eager"] >= 2 and r["speedup_vs_compile"] >= 1.5 and
                 r["rel_error"] < 1e-2 for r in mine)
        evidence = "; ".join(f"b{r['batch']}: {r['speedup_vs_eager']:.2f}x eager, "
                             f"{r['speedup_vs_compile']:.2f}x compile, err {r['rel_error']:.1e}"
                             for r in mine)
        out.append((f"{model} at {best['variant']}: >=2x eager, >=1.5x compile, err<1e-2",
                    ok, evidence))
        comp = {r["batch"]: r for r in rows if r["model"] == model and r["variant"] == "compile"}
        first = [(r, comp[r["batch"]]) for r in mine]
        ok = all(r["first_call_s"] <= 1.5 * c["first_call_s"] for r, c in first)
        out.append((f"{model} at {best['variant']}: first call <= 1.5x torch.compile's", ok,
                    "; ".join(f"b{r['batch']}: {r['first_call_s']:.1f}s vs "
                              f"{c['first_call_s']:.1f}s" for r, c in first)))
        blind = [r for r in rows if r["model"] == model and r["variant"] == "O3 no sample"]
        if blind:
            out.append((f"{model} at O3 without a sample input: not slower than eager",
                        all(r["speedup_vs_eager"] >= 1.0 for r in blind),
                        "; ".join(f"b{r['batch']}: {r['speedup_vs_eager']:.2f}x eager"
                                  for r in blind)))
    int8 = [r for r in rows if r["model"] == "llama" and r["variant"] == "O3 int8"]
    if int8:
        out.append(("llama at O3 int8: >=3x eager with the accuracy gate passing",
                    all(r["speedup_vs_eager"] >= 3 and r["quantize_status"] == "applied"
                        for r in int8),
                    "; ".join(f"b{r['batch']}: {r['speedup_vs_eager']:.2f}x eager, "
                              f"{_gate(r)}" for r in int8)))
    mlp = [r for r in rows if r["model"] == "mlp" and r["batch"] == 256 and
           r["variant"] in ("O1", "O2", "O3") and r["compute_dtype"] != "float32"]
    if mlp:
        top = max(mlp, key=lambda r: r["peak_fraction"])
        out.append(("mlp batch 256: >=60% of the low-precision matmul peak",
                    top["peak_fraction"] >= 0.6, f"{top['variant']}: "
                    f"{top['peak_fraction']:.0%} of the {top['compute_dtype']} peak"))
    return out


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    keys = sorted({(r["model"], r["batch"]) for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, len(keys) * 1.4), 4.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        vals = [next((r["speedup_vs_eager"] for r in rows if (r["model"], r["batch"]) == k
                      and r["variant"] == variant), 0.0) for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))],
                  [f"{m}\nb{b}" for m, b in keys])
    ax.set_ylabel("speedup over eager fp32")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.legend(fontsize="small")
    ax.set_title(f"prepare_model, {machine_line(report).removeprefix('machine: ')}",
                 fontsize="small", wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
