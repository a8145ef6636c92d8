"""Without a sample input, the first call decides: O2 and O3 time the prepared model on
the first call's own input, as they would have on a sample input, and keep the fastest.

Without it, nothing held "never slower than eager" for such a run: a small MLP at O3 with
no sample input (bf16 autocast and weights, compiled) ran at 0.23x eager on the 2-core
AMD EPYC (batch 1, width 64: 142.7 us a call against 32.4 us;
benchmarks/no_sample_first_call.py): compiling and casting cost more than a model that
small computes.

Until that first call the run is kept (the snapshots that undo its passes: one copy of the
model's tensors) and O0 is the caller's own model, which prepare_model did not change: it
is a candidate only when prepare_model made a copy and the model was already on the
device, so that nothing is copied for it. Otherwise (inplace=True, a model placed by
prepare_model) the prepared model is timed against itself uncompiled only.

The first call's input is replayed: the candidates, the final check against O0 and the
timing each run on a copy of it (its tensors cloned), through the models' forward (their
hooks ran on the call itself), under no_grad, leaving the models' buffers and the RNG as
they were; then the call itself runs once on the model kept. A model changed since
prepare_model (a load_state_dict, a hook) is not timed: undoing would put back what the
passes saw. Only inputs of tensors and plain values in tuples, lists and dicts are
replayed: an object such as a Hugging Face KV cache (generate() passes one) may change at
every call, so such a first call is not timed and the report says so, as it says for a
first call in training mode.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from torchbridge.errors import ModelOptimizationError
from torchbridge.optimize.fastest import keep_fastest, running_compiled
from torchbridge.optimize.measure import Timer
from torchbridge.optimize.report import attach_result
from torchbridge.optimize.run import run_sample

if TYPE_CHECKING:
    from torchbridge.optimize.run import Run

logger = logging.getLogger("torchbridge.optimize.pipeline")

_PLAIN = (int, float, bool, str, type(None))
_CONTAINERS = (tuple, list, dict)
ON = "the first call's input"


def _not_replayable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why the call's input cannot be replayed (anything but tensors and plain values in
    tuples, lists and dicts), or None."""
    for leaf in _leaves(args, kwargs):
        if not isinstance(leaf, (torch.Tensor, *_PLAIN)):
            return f"it holds a {type(leaf).__name__}"
    return None


def _unreal(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call passes fake or meta tensors (a trace, an export, a shape probe):
    not the first call to time on."""
    return any(isinstance(leaf, torch.Tensor) and (leaf.device.type == "meta"
                                                   or is_fake(leaf))
               for leaf in _leaves(args, kwargs))


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    # Only Python's own containers are looked into: any other object is a leaf here.
    return pytree.tree_leaves((args, kwargs),
                              is_leaf=lambda node: type(node) not in _CONTAINERS)


def _copied(args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # Outside inference mode: a clone of an inference tensor is then an ordinary tensor,
    # which the candidates may use as the model's checks and compile did.
    with torch.inference_mode(False):
        copied: tuple[tuple[Any, ...], dict[str, Any]] = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
    return copied


def _fingerprint(model: nn.Module) -> list[Any]:
    """What a caller may change on a model between prepare_model and its first call: each
    tensor (object, storage, version counter, requires_grad; load_state_dict bumps the
    version) and each module's attribute, hook and submodule tables by identity. Cheap:
    no values are read."""
    found: list[Any] = []
    for _, module in model.named_modules(remove_duplicate=True):
        # Not the training flag (a first call in training mode says so itself), nor the
        # report prepare_model attaches after this is taken.
        found.append((id(module), type(module),
                      {k: id(v) for k, v in module.__dict__.items()
                       if k != "training" and not k.startswith("_torchbridge_")}))
        for table in ("_parameters", "_buffers", "_modules", "_forward_hooks",
                      "_forward_pre_hooks"):
            found.append({k: id(v) for k, v in module.__dict__.get(table, {}).items()})
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None:
                try:
                    where = t.untyped_storage().data_ptr()
                except (RuntimeError, NotImplementedError):  # no storage (lazy, subclass)
                    where = None
                found.append((id(t), where, t._version, t.requires_grad, t.dtype, t.device))
    return found


def install_first_call_timing(run: Run, baseline: nn.Module | None, timer: Timer) -> None:
    """The prepared model (run.work) times itself at its first call in eval mode, against
    `baseline` (O0; None: against itself uncompiled only), and keeps the fastest."""
    model = run.work
    if any(entry.before.model is not model for entry in run.applied):
        # Undoing would give back another object than the one the caller holds.
        run.result.notes.append("no sample input, and a pass replaced the model object: "
                                "the first call is not timed")
        return
    against = [*(["O0"] if baseline is not None else []),
               *(["itself uncompiled"] if running_compiled(run) is not None else [])]
    if not against:
        return  # nothing to time against: the prepared model is all there is
    run.result.notes.append(
        "no sample input: the first call in eval mode times the prepared model on its "
        f"own input against {' and '.join(against)}, and keeps the fastest (until then, "
        "what undoes the passes is kept" + (", and the model as given, as O0)"
                                            if baseline is not None else ")"))
    timing = _FirstCallTiming(model, run, baseline, timer)
    model.forward = timing  # type: ignore[method-assign]
    timing.fingerprints = [_fingerprint(m) for m in (model, baseline) if m is not None]


class _FirstCallTiming:
    """The prepared model's forward until its first call has decided. Not a function made by
    forward.install_forward: a pickled or deep-copied model must not carry the run along,
    so this forward pickles and copies as the one it wraps (the copy keeps the prepared
    model as it is; the run undoes this model's passes, not the copy's)."""

    def __init__(self, model: nn.Module, run: Run, baseline: nn.Module | None,
                 timer: Timer) -> None:
        self.model, self.__wrapped__ = model, model.forward  # forward.compile_state follows it
        self.pending: list[tuple[Run, nn.Module | None, Timer]] = [(run, baseline, timer)]
        self.fingerprints: list[list[Any]] = []  # the models as prepare_model left them

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Not while a trace, an export or a compile calls the model, nor on fake or meta
        # tensors: timings and replays would mean nothing there (and a jit trace would
        # record them).
        if self.pending and not (torch.compiler.is_compiling()
                                 or torch._C._get_tracing_state() is not None
                                 or _unreal(args, kwargs)):
            run, baseline, timer = self.pending.pop()  # calls while deciding run through
            models = [m for m in (self.model, baseline) if m is not None]
            if [_fingerprint(m) for m in models] != self.fingerprints:
                # Undoing restores the tensors and tables the passes saw: it would throw
                # away a load_state_dict, a hook or a move made since.
                run.result.notes.append("first call: not timed (the model, or the model "
                                        "given as O0, changed since prepare_model); the "
                                        "prepared model is kept")
            else:
                _decide(run, baseline, timer, args, kwargs)
            if self.model.__dict__.get("forward") is self:  # nothing undone: step aside
                self._step_aside()
            # The forward the decision left: called directly, so the model's hooks fire
            # once (nn.Module.__call__ already ran them around this one).
            return self.model.forward(*args, **kwargs)
        return self.__wrapped__(*args, **kwargs)

    def _step_aside(self) -> None:
        wrapped = self.__wrapped__
        if getattr(wrapped, "__self__", None) is self.model and \
                getattr(wrapped, "__func__", None) is type(self.model).forward:
            del self.model.__dict__["forward"]  # it was the class's own forward
        else:
            self.model.__dict__["forward"] = wrapped

    def __reduce__(self) -> tuple[Any, ...]:
        return _same, (self.__wrapped__,)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # The class's forward bound to the model is copied bound to the model's copy.
        return copy.deepcopy(self.__wrapped__, memo)


def _same(forward: Any) -> Any:
    return forward


def _decide(run: Run, baseline: nn.Module | None, timer: Timer, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> None:
    result = run.result
    if run.work.training:
        result.notes.append("first call: not timed (the model was in training mode: a "
                            "forward is not a training step); the prepared model is kept")
        return
    started = time.perf_counter()
    try:
        why = _not_replayable(args, kwargs)
        if why is not None:
            result.notes.append(f"first call: not timed (its input cannot be replayed: "
                                f"{why}); the prepared model is kept")
            return
        # A fresh copy each time (the model may change its input; the call itself runs on
        # the caller's own after the replays), through forward: the call already ran the
        # model's hooks on these arguments.
        def replay(m: nn.Module) -> Any:
            copied_args, copied_kwargs = _copied(args, kwargs)
            return m.forward(*copied_args, **copied_kwargs)
        run.call = replay
        if baseline is not None:
            run.reference = run_sample(baseline, replay)
            run.have_reference = True
            run.final_check()  # outside the level's tolerance: passes undone
            keep_fastest(run, baseline, timer, on=ON, warm_baseline=False)
        else:
            # No O0: nothing to measure drift against; the report keeps "not measured".
            keep_fastest(run, None, timer, on=ON)
            result.max_abs_diff = result.max_rel_diff = None
    except ModelOptimizationError:
        if run.strict:
            leftover = run.undo_all()  # the model as given, not an unchecked prepared one
            run.settle_settings()  # the report's process-wide settings: as they are now
            result.notes.append("first call: the prepared model failed its check on the "
                                "call's input (strict): every pass undone"
                                + (f", except: {leftover}" if leftover else ""))
            raise
        logger.warning("prepare_model's first-call timing failed", exc_info=True)
        result.notes.append("first call: the check or timing on its input failed (see the "
                            "log); the model is kept as it was left")
    except Exception as exc:  # the model's own error: the call itself raises it next
        logger.warning("prepare_model's first-call timing failed: %s: %s",
                       type(exc).__name__, exc)
        result.notes.append(f"first call: not timed ({type(exc).__name__}: {exc})")
    finally:
        run.call = None  # the copied input is not kept
        result.stage_seconds["first_call_timing"] = time.perf_counter() - started
        # Undoing a pass puts back the model's attribute table as it was before it, without
        # the report prepare_model attached afterwards.
        attach_result(run.work, result)
