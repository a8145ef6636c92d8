"""Cross-backend validation: run one model on several backends and compare every output
with the first backend's."""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from torchbridge import trees
from torchbridge.backend import get_backend
from torchbridge.levels import LEVEL_TOLERANCE, OptimizationLevel
from torchbridge.optimize.measure import preserved_state, sample_call, tensor_drift
from torchbridge.selection import list_backends

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputComparison:
    index: int
    shape: tuple[int, ...]
    max_abs_diff: float
    max_rel_diff: float  # max |diff| / max |reference|
    passed: bool


@dataclass
class BackendValidation:
    backend: str
    device: str | None = None
    passed: bool = False
    outputs: list[OutputComparison] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


@dataclass
class ValidationReport:
    """`passed` is True when every backend ran and every output is within `tolerance`
    (relative to the reference output's largest magnitude)."""

    reference: str
    level: str
    tolerance: float
    results: list[BackendValidation] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        """As JSON takes it: an output that could not be compared (another shape) has
        None for its differences, not infinity (which strict JSON parsers refuse)."""
        def finite(value: Any) -> Any:
            return None if isinstance(value, float) and not math.isfinite(value) else value
        results = [{**asdict(r), "outputs": [{k: finite(v) for k, v in asdict(o).items()}
                                             for o in r.outputs]} for r in self.results]
        return {"reference": self.reference, "level": self.level,
                "tolerance": self.tolerance, "passed": self.passed, "results": results}

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        lines = [f"validation against {self.reference} at {self.level}, tolerance "
                 f"{self.tolerance:g} (max |diff| / max |reference|):"]
        for r in self.results:
            verdict = "PASS" if r.passed else "FAIL"
            if r.error is not None:
                lines.append(f"  {verdict} {r.backend}: {r.error}")
                continue
            worst = max((o.max_rel_diff for o in r.outputs), default=0.0)
            lines.append(f"  {verdict} {r.backend} ({r.device}): {len(r.outputs)} output(s), "
                         f"max rel diff {worst:.3g}, {r.seconds:.2f} s")
            lines += [f"      output {o.index} {list(o.shape)}: max abs {o.max_abs_diff:.3g}, "
                      f"max rel {o.max_rel_diff:.3g}" for o in r.outputs if not o.passed]
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def _run(backend: Any, model: nn.Module, sample_input: Any, level: OptimizationLevel
         ) -> list[torch.Tensor]:
    """Every tensor and Python number the model returns, on the CPU, in its own dtype:
    converted to float32 here, an int64 of 16777217 equalled 16777216 and a complex
    output lost its imaginary part."""
    prepared = backend.prepare_model(model, level)  # a copy: `model` stays on the CPU
    with preserved_state(prepared):
        out = sample_call(backend, sample_input)(prepared)
    return [leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else torch.tensor(leaf)
            for leaf in trees.leaves(out)
            if isinstance(leaf, (torch.Tensor, bool, int, float, complex))]


def validate(model: nn.Module, sample_input: Any, backends: list[Any] | None = None, *,
             level: Any = "O0", tolerance: float | None = None) -> ValidationReport:
    """Run `model` on each backend (names or Backend objects; None: every available one),
    prepared at `level`, and compare each output tensor with the first backend's. The
    default tolerance is the level's (torchbridge.levels.LEVEL_TOLERANCE), at least 1e-4.
    A backend that fails to run is reported as failed with its error; the others still
    run."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"validate takes an nn.Module, got {type(model).__name__}")
    parsed = OptimizationLevel.parse(level)
    if tolerance is None:
        # Two backends order float32 sums differently (about 1e-6 relative seen between
        # eager CPU and XLA:CPU), so even O0 gets float32 slack.
        tolerance = max(LEVEL_TOLERANCE[parsed.value], 1e-4)
    if backends is None:
        backends = [s.name for s in list_backends() if s.available]
    if len(backends) < 2:
        raise ValueError(f"validate needs at least two backends to compare, got {backends}")
    from torchbridge.selection import same_device_key

    # Names by the device they name ("cpu", "CPU:0"); objects by identity (a wrapped
    # backend on the same device is another backend to compare).
    keys = [same_device_key(entry) if isinstance(entry, str) else id(entry)
            for entry in backends]
    if len(set(keys)) < len(keys):  # compared with itself, a backend passes whatever it does
        raise ValueError(f"validate got a backend more than once in {backends}: name each "
                         "backend once")
    model = copy.deepcopy(model).eval()  # the caller's model keeps its mode
    report: ValidationReport | None = None
    reference: list[torch.Tensor] = []
    for entry in backends:
        name = entry if isinstance(entry, str) else entry.name
        result = BackendValidation(name)
        started = time.perf_counter()
        try:
            backend = get_backend(entry) if isinstance(entry, str) else entry
            result.device = str(backend.device)
            outputs = _run(backend, model, sample_input, parsed)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            logger.warning("validation on %s failed: %s", name, result.error)
            outputs = None
        result.seconds = time.perf_counter() - started
        if report is None:
            if outputs is None:
                raise RuntimeError(f"the reference backend {name} failed: {result.error}")
            report = ValidationReport(name, parsed.value, tolerance)
            reference = outputs
        if outputs is not None:
            _compare(result, reference, outputs, tolerance)
        report.results.append(result)
    assert report is not None
    return report


def _compare(result: BackendValidation, reference: list[torch.Tensor],
             outputs: list[torch.Tensor], tolerance: float) -> None:
    if len(outputs) != len(reference):
        result.error = f"returned {len(outputs)} output tensor(s), the reference " \
                       f"{len(reference)}"
        return
    if not reference:
        result.error = "the model returned no tensor or number to compare"
        return
    for i, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        if ref.shape != out.shape:
            result.outputs.append(OutputComparison(i, tuple(out.shape), float("inf"),
                                                   float("inf"), False))
            continue
        if ref.is_complex() or out.is_complex():  # both parts, not the real one alone
            ref, out = (torch.view_as_real(t.to(torch.complex128)) for t in (ref, out))
        if ref.is_floating_point() or out.is_floating_point():
            diff, rel = tensor_drift(ref, out)
            ok = rel <= tolerance and \
                bool(torch.isfinite(out).all() == torch.isfinite(ref).all())
        else:
            # Integers and booleans (token ids, counts, masks) are equal or not: a relative
            # tolerance let 50000 ids, each off by one, pass at O1.
            wide_ref, wide_out = ref.to(torch.int64), out.to(torch.int64)
            diff = float((wide_ref - wide_out).abs().max()) if ref.numel() else 0.0
            scale = float(wide_ref.abs().max()) if ref.numel() else 0.0
            rel, ok = (diff / scale if scale else diff), diff == 0
        result.outputs.append(OutputComparison(i, tuple(ref.shape), diff, rel, ok))
    result.passed = all(o.passed for o in result.outputs)
