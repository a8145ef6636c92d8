"""What a pass really changed, and putting it back exactly, in place.

A pass's declaration (`mutates=False`: "I only wrap the forward") is not trusted. Before
every pass the pipeline takes a ModelSnapshot: each module's class and attribute table (its
parameter, buffer, submodule and hook tables copied one level deep), every parameter,
buffer and tensor attribute (the tensor object, its storage at the time, and a copy of its
values), and the process-wide settings the pipeline watches. After the pass, `changes()`
compares the model with it: tensor values bit for bit (an in-place write through `.data`
bumps no version counter, so versions alone would miss it), storage, dtype, shape, device;
module classes and attributes by identity; the instance forward; the settings.

Restoring writes all of it back into the same objects, so that every reference the caller
holds (inplace=True) sees the old state, and then checks that it did: a restore that did not
take is a SnapshotRestoreError, never a silent half-state.

Unchanged tensors share their saved copy with the previous snapshot: a run holds one copy of
the model's tensors plus one per version a pass created. That holds only while nothing
writes to the model between the comparison that found them unchanged and the next
snapshot: the pipeline takes a pass's snapshot before its check, and compares after a check
that skips the pass, so that a check's write is found as that pass's.

A pass that returns another object than it was given is compared with the given model as
it was, by name: the returned model's tensors against the saved copies, its modules'
classes and training flags, and its class and state_dict keys, which a prepared model keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from torchbridge.errors import ModelOptimizationError
from torchbridge.optimize import settings as process
from torchbridge.optimize.forward import FORWARD_KEYS
from torchbridge.suggestions import shortened
from torchbridge.tensor_bits import same_bits

_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_GONE = object()


class SnapshotRestoreError(ModelOptimizationError):
    """Putting a model back as it was before a pass did not take."""


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's values live and how they are laid out."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:
        ptr = id(t)
    return ptr, t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset()


def _contents(table: dict[str, Any]) -> dict[str, Any]:
    """Copies of the dict and set values of a module's attribute table (its parameter,
    buffer, submodule and hook tables): restored into the same objects, so that handles
    the caller holds (a hook's RemovableHandle) keep pointing at the live table."""
    return {k: v.copy() for k, v in table.items() if isinstance(v, (dict, set))}


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, set) and type(a) is type(b):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict) and type(a) is type(b):
        return list(a) == list(b) and all(a[k] is b[k] for k in a)
    return isinstance(a, _PLAIN) and type(a) is type(b) and a == b


def _differs(key: str, now: dict[str, Any], table: dict[str, Any],
             contents: dict[str, Any]) -> bool:
    """Whether a module attribute changed: a table (dict, set) must be the same object
    with the same items; anything else the same object, or an equal plain value."""
    current, saved = now.get(key, _GONE), table.get(key, _GONE)
    if key in contents:
        return current is not saved or not _same_value(current, contents[key])
    return not _same_value(current, saved)


@dataclass
class TensorRecord:
    name: str
    tensor: torch.Tensor     # the Parameter, buffer or attribute object itself
    data: torch.Tensor       # its values' storage at snapshot time (an alias)
    saved: torch.Tensor      # a copy of its values
    requires_grad: bool
    layout: tuple[Any, ...]
    cls: type = torch.Tensor
    registered: bool = True  # a parameter or buffer (else a plain tensor attribute)

    def changed(self) -> bool:
        t = self.tensor
        if t.__class__ is not self.cls:  # a lazy parameter materialized, or retyped
            return True
        if is_lazy(t):
            return False  # no values yet
        return (_layout(t) != self.layout or t.requires_grad != self.requires_grad
                or not same_bits(t.detach(), self.saved))

    def holds(self, t: torch.Tensor) -> bool:
        """Whether another tensor (one of a model a pass returned in place of this one's)
        holds the values saved here: class, requires_grad, dtype, shape, device, bits."""
        if t.__class__ is not self.cls or t.requires_grad != self.requires_grad:
            return False
        if self.layout == () or is_lazy(t):
            return self.layout == () and is_lazy(t)
        return same_bits(t.detach(), self.saved)


def _record(name: str, t: torch.Tensor, registered: bool) -> TensorRecord:
    if is_lazy(t):  # an uninitialized parameter (LazyLinear): no values to copy
        empty = torch.empty(0)
        return TensorRecord(name, t, empty, empty, t.requires_grad, (), t.__class__,
                            registered)
    data = t.detach()
    return TensorRecord(name, t, data, data.clone(), t.requires_grad, _layout(t), t.__class__,
                        registered)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Parameters and buffers (True), and plain tensor attributes (False), each once, by
    first name."""
    seen: dict[int, tuple[str, torch.Tensor, bool]] = {}
    for prefix, module in model.named_modules(remove_duplicate=True):
        dot = f"{prefix}." if prefix else ""
        tables = ((module.__dict__.get("_parameters", {}), True),
                  (module.__dict__.get("_buffers", {}), True), (module.__dict__, False))
        for table, registered in tables:
            for key, value in table.items():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen[id(value)] = (dot + key, value, registered)
    return list(seen.values())


@dataclass
class ModelChanges:
    """What one pass changed, as observed."""

    replaced: bool = False  # apply returned another object than it was given
    tensors: list[str] = field(default_factory=list)  # parameters and buffers
    structure: list[str] = field(default_factory=list)  # classes, parameter/module tables
    # Plain attributes (numbers, tensors a forward keeps): running the model may change
    # them (a call counter), so they are restored and checked, but are no lie.
    attributes: list[str] = field(default_factory=list)
    forward: list[str] = field(default_factory=list)
    # Modules whose training flag changed: the mode is the caller's, and the checks on the
    # sample input run in eval mode, where dropout switched on is not seen.
    training: list[str] = field(default_factory=list)
    # How a returned model is no drop-in for the one given: another class, other
    # state_dict keys.
    unlike: list[str] = field(default_factory=list)
    settings: dict[str, tuple[process.ProcessSetting, Any, Any]] = field(default_factory=dict)
    unchanged: set[int] = field(default_factory=set)  # ids of tensors found unchanged

    @property
    def model(self) -> bool:
        """The model changed: weights, structure or how it runs."""
        return self.replaced or bool(self.tensors or self.structure or self.forward
                                     or self.attributes or self.training)

    @property
    def mutated(self) -> bool:
        """What a pass declaring mutates=False promised not to do."""
        return bool(self.tensors or self.structure)

    def __bool__(self) -> bool:
        return self.model or bool(self.settings)

    def describe(self) -> str:
        parts = []
        if self.tensors:
            parts.append(f"tensors {shortened(self.tensors, 4)}")
        if self.structure:
            parts.append(f"modules {shortened(self.structure, 4)}")
        if self.attributes:
            parts.append(f"attributes of {shortened(self.attributes, 4)}")
        if self.forward:
            parts.append(f"the forward of {shortened(self.forward, 4)}")
        if self.training:
            parts.append(f"the training flag of {shortened(self.training, 4)}")
        parts += [f"{name} ({before!r} -> {after!r})"
                  for name, (_, before, after) in self.settings.items()]
        if self.replaced:
            parts.append("returned a different model object")
        return "; ".join(parts) or "nothing"


def _flipped(where: str, before: dict[str, Any], now: dict[str, Any]) -> str:
    def mode(table: dict[str, Any]) -> str:
        return "train" if table.get("training") else "eval"
    return f"{where} ({mode(before)} -> {mode(now)})"


class ModelSnapshot:
    def __init__(self, model: nn.Module, settings: Sequence[process.ProcessSetting] = (),
                 previous: ModelSnapshot | None = None,
                 unchanged: set[int] | None = None, *, tensors: bool = True) -> None:
        """`previous`/`unchanged`: a snapshot taken earlier and the ids of the tensors found
        unchanged since; their saved copies are reused instead of copied again (unless the
        tensor moved since, or is a lazy parameter: running the model between two passes
        materializes it). `tensors=False`: module tables only (undoing an installed
        forward)."""
        self.model = model
        self.modules = [(name, m, m.__class__, dict(m.__dict__), _contents(m.__dict__))
                        for name, m in model.named_modules(remove_duplicate=True)]
        # The keys as they were: a pass may change the given model's keys in place and
        # return a replacement with the changed ones, which must not count as kept.
        self.state_keys = list(model.state_dict(keep_vars=True)) if tensors else None
        reuse = {id(r.tensor): r for r in previous.tensors} \
            if previous is not None and unchanged else {}
        self.tensors: list[TensorRecord] = []
        with torch.no_grad():
            for name, t, registered in _named_tensors(model) if tensors else ():
                old = reuse.get(id(t))
                if old is not None and id(t) in (unchanged or ()) and old.layout != () \
                        and t.__class__ is old.cls and _layout(t) == old.layout:
                    self.tensors.append(TensorRecord(name, t, old.data, old.saved,
                                                     old.requires_grad, old.layout, old.cls,
                                                     registered))
                    continue
                self.tensors.append(_record(name, t, registered))
        self.settings = process.values(settings)

    def changes(self, result: nn.Module) -> ModelChanges:
        """What changed since the snapshot; `result` is what the pass returned."""
        found = ModelChanges(replaced=result is not self.model)
        for record in self.tensors:
            if record.changed():
                (found.tensors if record.registered else found.attributes).append(record.name)
            else:
                found.unchanged.add(id(record.tensor))
        for name, module, cls, table, contents in self.modules:
            where = name or "(the model)"
            now = module.__dict__
            if now.get("training") != table.get("training"):
                found.training.append(_flipped(where, table, now))
            if module.__class__ is not cls:
                found.structure.append(f"{where} (class {cls.__name__} -> "
                                       f"{module.__class__.__name__})")
                continue
            keys = (set(now) | set(table)) - {"_torchbridge_optimization_result", "training"}
            if any(now.get(k) is not table.get(k) for k in keys & FORWARD_KEYS):
                found.forward.append(where)
            changed = [k for k in keys - FORWARD_KEYS if _differs(k, now, table, contents)]
            plain = [k for k in changed if not isinstance(table.get(k, now.get(k)),
                                                          (dict, set))]
            if len(plain) < len(changed):
                found.structure.append(where)
            if plain:
                found.attributes.append(where)
        if found.replaced:
            self._compare_returned(result, found)
        for name, (setting, before) in self.settings.items():
            after = process.read(setting)
            if process.differs(before, after):
                found.settings[name] = (setting, before, after)
        return found

    def _compare_returned(self, result: nn.Module, found: ModelChanges) -> None:
        """The model a pass returned in place of the given one, against the given one as it
        was, by name: what the given model's own comparison cannot see (a copy's weights,
        modules and training flags); and its class and state_dict keys, which a prepared
        model keeps. The given model's own tensors and modules in it were compared already.
        One more comparison of the returned model's values: passes that replace the model
        are few."""
        given_cls = self.modules[0][2]
        if type(result) is not given_cls:
            found.unlike.append(f"returned a {type(result).__name__} for the "
                                f"{given_cls.__name__} it was given")
        keys = result.state_dict(keep_vars=True)
        given_keys = self.state_keys if self.state_keys is not None \
            else list(self.model.state_dict(keep_vars=True))
        lacks = [k for k in given_keys if k not in keys]
        adds = [k for k in keys if k not in given_keys]
        if lacks or adds:
            found.unlike.append("its state_dict keys differ" + (
                f", lacking {shortened(lacks, 4)}" if lacks else "") + (
                f", adding {shortened(adds, 4)}" if adds else ""))
        modules = {name: (module, cls, table)
                   for name, module, cls, table, _ in self.modules}
        own = {id(module) for module, _, _ in modules.values()}
        named = dict(result.named_modules(remove_duplicate=True))
        for name, module in named.items():
            where = name or "(the model)"
            if id(module) in own:
                continue
            if name not in modules:
                found.structure.append(f"{where} (new)")
                continue
            _, cls, table = modules[name]
            if module.training != table.get("training"):
                found.training.append(_flipped(where, table, module.__dict__))
            if module.__class__ is not cls:
                found.structure.append(f"{where} (class {cls.__name__} -> "
                                       f"{module.__class__.__name__})")
        kept = {id(module) for module in named.values()}
        found.structure += [f"{name} (gone)" for name, (module, _, _) in modules.items()
                            if name not in named and id(module) not in kept]
        records = {r.name: r for r in self.tensors}
        own_tensors = {id(r.tensor) for r in self.tensors}
        for name, t, registered in _named_tensors(result):
            if id(t) in own_tensors:
                continue
            record = records.get(name)
            if record is None or not record.holds(t):
                (found.tensors if registered else found.attributes).append(name)

    def restore(self, *, after_timing: bool = False) -> None:
        """The model and the watched settings exactly as they were; raises
        SnapshotRestoreError when something could not be put back. `after_timing`: the
        settings declared kept_after_timing stay as they are now."""
        problems: list[str] = []
        for _, module, cls, table, contents in self.modules:
            if module.__class__ is not cls:
                module.__class__ = cls
            module.__dict__.clear()
            module.__dict__.update(table)
            for key, saved in contents.items():
                live = table[key]
                live.clear()
                live.update(saved)
        with torch.no_grad():
            for record in self.tensors:
                try:
                    self._restore_tensor(record)
                except Exception as exc:
                    problems.append(f"{record.name}: {type(exc).__name__}: {exc}")
        for name, (setting, before) in self.settings.items():
            if after_timing and setting.stays_after_timing:
                continue
            if process.differs(before, process.read(setting)):
                try:
                    process.put(setting, before)
                except Exception as exc:
                    problems.append(f"{name}: {exc}")
        problems += [f"{r.name} still differs" for r in self.tensors if r.changed()]
        if problems:
            raise SnapshotRestoreError("could not put the model back as it was: "
                                       + "; ".join(problems))

    @staticmethod
    def _restore_tensor(record: TensorRecord) -> None:
        t = record.tensor
        if record.layout == ():
            if t.__class__ is not record.cls:  # materialized: uninitialized again
                t.__class__ = record.cls
                t.data = record.data
            return
        if _layout(t) != record.layout:
            t.data = record.data
        if not same_bits(record.data, record.saved):
            if _layout(record.data) == record.layout:
                record.data.copy_(record.saved)
            else:  # its storage was resized in place: the values move to a fresh copy
                t.data = record.saved.clone()
                record.data, record.layout = t.detach(), _layout(t)
        if t.requires_grad != record.requires_grad and t.is_leaf:
            t.requires_grad_(record.requires_grad)

