"""Folding BatchNorm into the convolution before it, by module structure, without torch.fx.

torch.fx's `fuse` traces the model by patching nn.Module.__call__ for the whole process
(plain inference in other threads crashed while it ran), fails on models it cannot trace
(Hugging Face's ResNet), and hands back a GraphModule without the model's attributes,
methods and hooks. Here the model keeps its classes; two ways find the pairs:

- structure: a Conv directly followed by a BatchNorm in an nn.Sequential (whose forward
  feeds each child's output to the next);
- one traced call on the sample input, with hooks on the conv and BatchNorm instances and
  a TorchFunctionMode (thread-local) counting who uses each conv output: a pair folds when
  the BatchNorm's input is the conv's output and nothing else used it.

A folded BatchNorm stays in the model (same state_dict keys): its scale goes into the conv's
weight; its shift into the conv's bias, or where the conv has none (adding one would add a
state_dict key), into the BatchNorm's running mean as -shift, with variance 1 - eps, scale
1 and shift 0. Its forward is then the identity or one subtraction. A checkpoint of the
prepared model therefore computes the same in the unprepared class. A state dict that
loads into a folded pair (the model's whole dict, or part of one: strict=False, or a load
into the conv or the BatchNorm alone) first unfolds that pair as `train()` does (the conv's
load_state_dict pre-hook, FoldedBatchNorm._load_from_state_dict), so any load gives what
it gives the model as built, a checkpoint of either; pairs it does not reach stay folded.

A pair is left unfolded, with the reason (`fold`'s `left`, noted in the report), where the
fold would not be exact or would change what something else sees:
- the conv's weight is recomputed at every call: a parametrization (parametrizations.
  weight_norm, spectral_norm, orthogonal), the legacy weight_norm and spectral_norm, or
  torch.nn.utils.prune (forward pre-hooks rebuilding `weight` from `weight_orig`, `weight_g`
  and `weight_v`): the fold, written into `weight`, was overwritten at the next call while
  the BatchNorm had become an identity (outputs 38-50% off);
- a hook on the conv or the BatchNorm (forward, forward pre-, backward), or a global module
  hook: it would see the folded features (a forward hook on the conv, as in feature
  extraction or Grad-CAM, got conv + BatchNorm: 1.05 relative drift from eager's);
- a weight that is no plain nn.Parameter, a non-float weight, a class overriding torch's
  forward (a weight-standardizing conv undoes the scale), a forward set on the instance,
  a conv or BatchNorm used in more than one place, a weight tied to another module's.

Training: `train()` on a folded BatchNorm (model.train() reaches every one) unfolds it:
the conv's weight and bias and the BatchNorm's own parameters and statistics come back as
they were before the fold, bit for bit, and the BatchNorm trains as eager's does. The fold
keeps what that takes (on the CPU, not on the accelerator): the BatchNorm's vectors and
the conv's bias, and of the conv's weight only the elements that dividing the folded
weight by the scale does not give back exactly (about 9% of them in float32: IEEE
multiply-then-divide is not always the identity; a full copy where that would be more).
A weight changed in place after the fold (an optimizer step in eval mode, a cast) is
divided back instead, which is exact only up to rounding (logged).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from torchbridge import trees
from torchbridge.suggestions import shortened

logger = logging.getLogger(__name__)

_Conv = nn.modules.conv._ConvNd
_BatchNorm = nn.modules.batchnorm._BatchNorm
# Reading a tensor's metadata is not a use of its values.
_METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "stride",
             "is_contiguous", "element_size", "data_ptr"}


# Where the fold record and the reason for unfolding live on a BatchNorm (its __dict__:
# neither a parameter nor a buffer, so the state_dict keys stay as they are).
_RECORD = "_torchbridge_fold"
_UNFOLDED = "_torchbridge_unfolded"
UNFOLDED_BY_TRAIN = "train() on the model made its folded BatchNorms BatchNorms again, " \
    "their convolutions' weights and biases and their own statistics back as they were " \
    "before the fold (a folded BatchNorm cannot train)"
UNFOLDED_BY_LOAD = "a state dict loaded into the model made its BatchNorms BatchNorms again"


@dataclass
class _FoldRecord:
    """What unfolding a BatchNorm needs, kept on the CPU: the conv it was folded into, the
    per-channel scale the fold multiplied the weight by, the weight elements that
    dividing by that scale does not give back exactly (flat indices and values), or the
    whole weight where those would take more room, the conv's bias before and after the
    fold, and the BatchNorm's own parameters and statistics."""

    conv: nn.Module
    dtype: torch.dtype
    shape: tuple[int, ...]
    scale: torch.Tensor
    weight_fix: tuple[torch.Tensor, torch.Tensor] | torch.Tensor
    bias: torch.Tensor | None
    folded_bias: torch.Tensor | None
    norm: dict[str, torch.Tensor]


def _own_class(module: Any) -> Any:
    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FoldedBatchNorm))


class FoldedBatchNorm:
    """Mixed into a folded BatchNorm's class: its forward is the identity, or subtracts the
    running mean where that holds the conv's shift. `train()` unfolds it (see `unfold`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if getattr(self, "training", False):
            # Set without Module.train() (which unfolds): the conv before has already
            # computed with the folded weight, so this call cannot be what eager computes.
            raise RuntimeError(
                "this BatchNorm was folded into the convolution before it for inference "
                "(torchbridge conv_bn_folding) and its training flag was set without "
                "Module.train(): call model.train(), which puts the BatchNorm and the "
                "convolution back as they were before the fold, then run the model again")
        mean = getattr(self, "running_mean", None)
        if not getattr(self, "_torchbridge_keeps_shift", False) or mean is None:
            return input
        shifted: torch.Tensor = input - mean.view([1, -1] + [1] * (input.dim() - 2))
        return shifted

    def train(self, mode: bool = True) -> Any:
        # Module.train(True) reaches every submodule: a folded BatchNorm in training mode
        # would stay an identity (no batch statistics, running statistics never updated:
        # output 0.57 off eager's on a small conv net), so it unfolds first.
        own = _own_class(self)
        if mode is True:
            unfold(self, UNFOLDED_BY_TRAIN)  # type: ignore[arg-type]
        return own.train(self, mode)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # A state dict that loads into the BatchNorm (or into its conv: _unfold_before_load)
        # first unfolds the pair, both put back as they were before the fold, so that the
        # load, whole or partial, gives what it gives the model as built. Unfolding only the
        # BatchNorm assumed the conv had its weights from the same dict: a load of the conv
        # alone ran it unscaled into an identity (outputs 0.66 off), of the BatchNorm alone
        # scaled twice (0.84 off), the report still saying drift 1.8e-7.
        own = _own_class(self)
        if _loads_into(state_dict, prefix):
            unfold(self, UNFOLDED_BY_LOAD)  # type: ignore[arg-type]
        own._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)


def undone_reason(model: nn.Module) -> str | None:
    """Why BatchNorms of the model that were folded are BatchNorms again (train(), a state
    dict loaded), or None where none was unfolded: for the report's conv_bn_folding
    record once none is left folded."""
    reasons = list(dict.fromkeys(
        why for m in model.modules() if isinstance(why := m.__dict__.get(_UNFOLDED), str)))
    return "; ".join(reasons) or None


def _per_out(conv: nn.Module, scale: torch.Tensor) -> torch.Tensor:
    """`scale` (one value per output channel) shaped to multiply the conv's weight: a
    Conv's weight is (out, in / groups, *k); a ConvTranspose's (in, out / groups, *k), whose
    output channel g * out / groups + j is column j of the rows of group g."""
    weight = _tensor(conv, "weight")
    ones = [1] * (weight.dim() - 2)
    if not isinstance(conv, nn.modules.conv._ConvTransposeNd):
        return scale.reshape([-1, 1, *ones])
    groups = int(conv.groups)
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    if groups == 1:
        return scale.reshape([1, -1, *ones])
    grouped = scale.reshape(groups, 1, cols).expand(groups, rows // groups, cols)
    return grouped.reshape([rows, cols, *ones])


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor)
    return value


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: compared bit for bit (-0.0 is not 0.0, a NaN is
    equal to itself)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(as_int[t.element_size()])


def _keep(t: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU (`.cpu()` of a CPU tensor is the same tensor)."""
    return t.detach().to("cpu", copy=True)


def unfold(bn: nn.Module, why: str) -> bool:
    """Make a folded BatchNorm a BatchNorm again, and put the conv it was folded into and
    its own parameters and statistics back as they were before the fold. Returns whether
    the weights came back bit for bit (False: the conv's weight or bias changed after the
    fold, and was divided back: exact up to rounding). A BatchNorm that is not folded is
    left as it is (True)."""
    if not isinstance(bn, FoldedBatchNorm):
        return True
    record = bn.__dict__.get(_RECORD)
    if isinstance(record, _FoldRecord):
        # Checked before anything changes: a DTensor (FSDP sharded the model after the
        # fold) cannot be divided back with the scale kept here.
        odd = [f"{name} is a {type(t.data).__name__}" for name in ("weight", "bias")
               if isinstance(t := getattr(record.conv, name, None), torch.Tensor)
               and type(t.data) is not torch.Tensor]
        if odd:
            raise RuntimeError(
                f"cannot unfold the folded {type(bn).__name__}: the convolution's "
                f"{', '.join(odd)}, not a plain tensor (sharded after the fold?); prepare "
                "the model in training mode to train it, or unfold before sharding "
                "(torchbridge.optimize.folding.unfold)")
    bn.__dict__.pop(_RECORD, None)
    bn.__class__ = _own_class(bn)
    bn.__dict__.pop("_torchbridge_keeps_shift", None)
    bn.__dict__[_UNFOLDED] = why
    if not isinstance(record, _FoldRecord):  # folded by an older version: nothing kept
        logger.warning("%s: folded without what unfolding needs; it runs as a BatchNorm "
                       "again with its folded (identity) statistics", type(bn).__name__)
        return False
    exact = _restore(record, bn)
    log = logger.info if exact else logger.warning
    log("%s unfolded (%s)%s", type(bn).__name__, why, "" if exact else
        ": the convolution's weight or bias changed after the fold (an in-place write, "
        "another dtype) and was divided back by the BatchNorm's scale, exact only up to "
        "rounding")
    return exact


def _restore(record: _FoldRecord, bn: nn.Module) -> bool:
    conv = record.conv
    weight, bias = _tensor(conv, "weight"), getattr(conv, "bias", None)
    with torch.no_grad():
        scale = record.scale.to(weight.device)
        per = _per_out(conv, scale)
        back = (weight / per).to(weight.dtype).contiguous()
        exact = False
        if weight.dtype == record.dtype and tuple(weight.shape) == record.shape:
            fix = record.weight_fix
            if isinstance(fix, tuple):
                where, values = fix
                back.view(-1)[where.to(weight.device, torch.int64)] = values.to(weight.device)
            else:
                back = fix.to(weight.device)
            # Only where the weight is still what the fold wrote do the fixes apply.
            exact = torch.equal(_bits((back * per).to(weight.dtype)), _bits(weight))
            if not exact:
                back = (weight / per).to(weight.dtype)
        weight.copy_(back)
        norm = {k: v.to(weight.device) for k, v in record.norm.items()}
        if record.bias is not None and isinstance(bias, torch.Tensor):
            assert record.folded_bias is not None
            if bias.dtype == record.folded_bias.dtype and torch.equal(
                    _bits(bias.detach().cpu()), _bits(record.folded_bias)):
                bias.copy_(record.bias)
            else:
                exact = False
                bias.copy_((bias - norm.get("bias", 0.0)) / scale + norm["running_mean"])
        for name, value in record.norm.items():
            current = getattr(bn, name, None)
            if isinstance(current, torch.Tensor):
                current.copy_(value)
    return exact


def _fold_pair(conv: nn.Module, bn: nn.Module) -> bool:
    """Fold one pair (as torch.nn.utils.fusion.fuse_conv_bn_weights computes it, for
    grouped ConvTranspose too); returns whether the BatchNorm keeps the shift."""
    assert isinstance(bn, _BatchNorm) and isinstance(conv, _Conv)
    assert bn.running_mean is not None and bn.running_var is not None
    with torch.no_grad():
        weight, conv_bias = conv.weight, conv.bias
        mean, var = bn.running_mean, bn.running_var
        gamma = bn.weight if bn.weight is not None else torch.ones_like(mean)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(mean)
        rsqrt = torch.rsqrt(var + bn.eps)
        scale = gamma * rsqrt
        per = _per_out(conv, scale)
        folded = (weight * per).to(weight.dtype)
        keeps_shift = conv_bias is None
        shift = ((conv_bias if conv_bias is not None else torch.zeros_like(mean)) - mean) \
            * rsqrt * gamma + beta
        shift = shift.to(conv_bias.dtype if conv_bias is not None else weight.dtype)
        record = _FoldRecord(
            conv, weight.dtype, tuple(weight.shape), _keep(scale),
            _weight_fix(weight, folded, per),
            None if conv_bias is None else _keep(conv_bias),
            None if conv_bias is None else _keep(shift),
            {name: _keep(t) for name in ("running_mean", "running_var", "weight", "bias")
             if isinstance(t := getattr(bn, name, None), torch.Tensor)})
        weight.copy_(folded)
        if conv_bias is not None:
            conv_bias.copy_(shift)
        mean.copy_(-shift if keeps_shift else torch.zeros_like(shift))
        var.fill_(1.0 - bn.eps)
        if bn.weight is not None and bn.bias is not None:
            bn.weight.fill_(1.0)
            bn.bias.zero_()
    bn.__class__ = _folded_class(type(bn))
    bn.__dict__[_RECORD] = record
    bn.__dict__.pop(_UNFOLDED, None)
    conv._register_load_state_dict_pre_hook(functools.partial(_unfold_before_load, bn))  # type: ignore[no-untyped-call,unused-ignore]
    return keeps_shift


def _loads_into(state_dict: Any, prefix: str) -> bool:
    return any(isinstance(key, str) and key.startswith(prefix) for key in state_dict)


def _unfold_before_load(bn: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
    """The conv's load_state_dict pre-hook: a state dict that loads into the conv finds
    it, and the BatchNorm folded into it, as they were before the fold. (A no-op once the
    BatchNorm is unfolded, by train(), an earlier load, or the pass undone.)"""
    if isinstance(bn, FoldedBatchNorm) and _loads_into(state_dict, prefix):
        unfold(bn, UNFOLDED_BY_LOAD)


def _weight_fix(weight: torch.Tensor, folded: torch.Tensor, per: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """What dividing the folded weight by the scale does not give back: the flat indices
    and original values of those elements, or the whole weight where that takes less."""
    original = weight.detach().contiguous()
    back = (folded / per).to(weight.dtype).contiguous()
    wrong = (_bits(back) != _bits(original)).view(-1).nonzero().view(-1)
    index_size = 4 if original.numel() < 2**31 else 8
    if wrong.numel() * (index_size + original.element_size()) >= \
            original.numel() * original.element_size():
        return _keep(original)
    where = wrong.to(torch.int32 if index_size == 4 else torch.int64)
    return _keep(where), _keep(original.view(-1)[wrong])


_folded_classes: dict[type, type] = {}


def _folded_class(cls: type) -> type:
    if issubclass(cls, FoldedBatchNorm):
        return cls
    if cls not in _folded_classes:
        _folded_classes[cls] = type(f"Folded{cls.__name__}", (FoldedBatchNorm, cls), {})
    return _folded_classes[cls]


def _foldable_norm(bn: nn.Module) -> bool:
    return (isinstance(bn, _BatchNorm) and not bn.training and bn.track_running_stats
            and bn.running_mean is not None and bn.running_var is not None
            and not isinstance(bn, FoldedBatchNorm))


def _foldable(conv: nn.Module, bn: nn.Module) -> bool:
    """A candidate pair: a conv whose output channels are the BatchNorm's features, and an
    eval-mode BatchNorm on running statistics. Whether it is folded is `refusal`'s."""
    return (isinstance(conv, _Conv) and _foldable_norm(bn)
            and conv.out_channels == getattr(bn, "num_features", None))


_TORCH_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d)
_NORM_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)
# Why a hook on the conv or the BatchNorm rules the fold out: what it would see differently.
_HOOK_TABLES = (
    ("_forward_pre_hooks", "a forward pre-hook",
     {"convolution": "may change the weight at every call (or the input)",
      "BatchNorm": "would see the folded convolution's output as the BatchNorm's input"}),
    ("_forward_hooks", "a forward hook",
     {"convolution": "would see the convolution's output with the BatchNorm folded in",
      "BatchNorm": "would see the folded convolution's output as the BatchNorm's input"}),
    ("_backward_pre_hooks", "a backward pre-hook",
     {"convolution": "would see gradients of the folded output",
      "BatchNorm": "would see gradients of an identity"}),
    ("_backward_hooks", "a backward hook",
     {"convolution": "would see gradients of the folded output",
      "BatchNorm": "would see gradients of an identity"}))


def _weight_rebuilders(module: nn.Module) -> list[str]:
    """The forward pre-hooks of torch.nn.utils that recompute a weight at every call."""
    from torch.nn.utils import prune
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    kinds = ((prune.BasePruningMethod, "torch.nn.utils.prune"),
             (WeightNorm, "torch.nn.utils.weight_norm"),
             (SpectralNorm, "torch.nn.utils.spectral_norm"))
    return [name for hook in module._forward_pre_hooks.values()
            for cls, name in kinds if isinstance(hook, cls)]


def _module_refusal(module: nn.Module, what: str) -> str | None:
    """Why this conv or BatchNorm must keep its own computation, or None."""
    if parametrize.is_parametrized(module):
        found: Any = getattr(module, "parametrizations", {})
        tensors = ", ".join(found.keys())
        kinds = ", ".join(sorted({type(p).__name__.lstrip("_")
                                  for plist in found.values() for p in plist}))
        return f"the {what}'s {tensors} is parametrized (torch.nn.utils.parametrize: " \
               f"{kinds}): recomputed at every call, it would overwrite the fold"
    rebuilders = _weight_rebuilders(module)
    if rebuilders:
        return f"the {what}'s weight is recomputed at every call by " \
               f"{', '.join(rebuilders)} (a forward pre-hook): it would overwrite the fold"
    for table, kind, sees in _HOOK_TABLES:
        if getattr(module, table, None):
            return f"the {what} has {kind}, which {sees[what]}, not what eager computes"
    for name in ("weight", "bias"):
        if getattr(module, name, None) is None and (what == "BatchNorm" or name == "bias"):
            continue
        if type(module._parameters.get(name)) is not nn.Parameter:
            return f"the {what}'s {name} is not a plain nn.Parameter " \
                   f"({type(getattr(module, name, None)).__name__}): it may be recomputed " \
                   "at every call"
    if "forward" in module.__dict__:
        return f"the {what}'s forward is replaced on the instance"
    return None


def refusal(model: nn.Module, conv: nn.Module, bn: nn.Module,
            tied: set[int] | None = None) -> str | None:
    """Why a candidate pair (see `_foldable`) is left unfolded, or None to fold it."""
    why = _module_refusal(conv, "convolution") or _module_refusal(bn, "BatchNorm")
    if why is not None:
        return why
    torch_conv = next((c for c in type(conv).__mro__ if c in _TORCH_CONVS), None)
    if torch_conv is None or type(conv).forward is not torch_conv.forward or \
            getattr(type(conv), "_conv_forward", None) is not \
            getattr(torch_conv, "_conv_forward", None):
        return f"{type(conv).__name__} overrides the forward of torch's convolution: the " \
               "fold is exact only for torch's own (a weight-standardizing conv would " \
               "undo the scale)"
    if type(bn).forward not in _NORM_FORWARDS:
        return f"{type(bn).__name__} overrides the forward of torch's BatchNorm"
    if not _tensor(conv, "weight").is_floating_point():
        return f"the convolution's weight is {_tensor(conv, 'weight').dtype}, not " \
               "floating point"
    if _shared(model, conv):
        return "the convolution is used in more than one place in the model"
    if _shared(model, bn):
        return "the BatchNorm is used in more than one place in the model"
    if tied is not None and id(conv.weight) in tied:
        return "the convolution's weight is tied to another module's"
    for module, what in ((conv, "convolution"), (bn, "BatchNorm")):
        for name in ("bias",) if module is conv else ("weight", "bias"):
            if tied is not None and getattr(module, name, None) is not None and \
                    id(getattr(module, name)) in tied:
                return f"the {what}'s {name} is tied to another module's"
    return None


def _global_hooks() -> str | None:
    module = nn.modules.module
    kinds = (("_global_forward_pre_hooks", "forward pre-hook"),
             ("_global_forward_hooks", "forward hook"),
             ("_global_backward_pre_hooks", "backward pre-hook"),
             ("_global_backward_hooks", "backward hook"))
    found = [kind for name, kind in kinds if getattr(module, name, None)]
    if not found:
        return None
    return f"a global module {found[0]} is registered (torch.nn.modules.module." \
           "register_module_*): it would see the convolutions' outputs with the " \
           "BatchNorms folded in"


def describe_left(left: list[tuple[str, str]]) -> str:
    """The pairs `fold` left, grouped by reason: "conv -> bn, ... (reason); ..."."""
    by_reason: dict[str, list[str]] = {}
    for pair, why in left:
        by_reason.setdefault(why, []).append(pair)
    parts = []
    for why, names in by_reason.items():
        parts.append(f"{shortened(names, 6)} ({why})")
    return "; ".join(parts)


def unpaired_norms(model: nn.Module, pairs: list[tuple[nn.Module, nn.Module]]) -> int:
    """How many foldable BatchNorms `pairs` leaves out: only those can a traced call still
    pair (each BatchNorm folds into one convolution at most)."""
    paired = {id(bn) for _, bn in pairs}
    return sum(1 for m in model.modules() if _foldable_norm(m) and id(m) not in paired)


def sequential_pairs(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    pairs = []
    for module in model.modules():
        if type(module).forward is not nn.Sequential.forward or \
                not isinstance(module, nn.Sequential):
            continue
        children = list(module)
        pairs += [(a, b) for a, b in itertools.pairwise(children)
                  if _foldable(a, b)]
    return pairs


class _UseCounter(TorchFunctionMode):
    """Counts, per convolution output, the torch calls that read it outside a BatchNorm's
    own forward. Only tensors in `watched` (ids of conv outputs, which the trace keeps alive
    from the moment they are made) are counted: an id is an address, and a temporary freed
    earlier may have had the same one. Counting every tensor by id once charged such a
    temporary's uses to a conv output now and then, so a pair went unfolded in one process
    and folded in the next (a ResNet's compiled graph then differed between processes, and
    the second missed the compile cache)."""

    def __init__(self, inside_bn: Callable[[], bool], watched: set[int]) -> None:
        super().__init__()
        self.uses: dict[int, int] = {}
        self.inside_bn = inside_bn
        self.watched = watched

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if not self.inside_bn() and getattr(func, "__name__", "") not in _METADATA:
            for leaf in trees.leaves((args, kwargs or {})):
                if isinstance(leaf, torch.Tensor) and id(leaf) in self.watched:
                    self.uses[id(leaf)] = self.uses.get(id(leaf), 0) + 1
        return func(*args, **(kwargs or {}))


def traced_pairs(model: nn.Module, call: Callable[[nn.Module], Any]
                 ) -> list[tuple[nn.Module, nn.Module]]:
    """Pairs found by running the model once (the caller preserves its state)."""
    convs = [m for m in model.modules() if isinstance(m, _Conv)]
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    outputs: dict[nn.Module, list[torch.Tensor]] = {}
    inputs: dict[nn.Module, list[torch.Tensor]] = {}
    active: list[nn.Module] = []
    made: set[int] = set()  # conv outputs, each alive in `outputs` until the end

    def conv_done(module: nn.Module, args: Any, out: Any) -> None:
        outputs.setdefault(module, []).append(out)
        made.add(id(out))

    def bn_starts(module: nn.Module, args: Any) -> None:
        inputs.setdefault(module, []).append(args[0])
        active.append(module)

    def bn_done(module: nn.Module, args: Any, out: Any) -> None:
        active.pop()

    handles = [conv.register_forward_hook(conv_done) for conv in convs]
    for bn in bns:
        handles += [bn.register_forward_pre_hook(bn_starts), bn.register_forward_hook(bn_done)]
    counter = _UseCounter(lambda: bool(active), made)
    try:
        with counter:
            call(model)
    finally:
        for h in handles:
            h.remove()
    by_output = {id(outs[0]): conv for conv, outs in outputs.items() if len(outs) == 1}
    pairs: list[tuple[nn.Module, nn.Module]] = []
    for norm, ins in inputs.items():
        conv = by_output.get(id(ins[0])) if len(ins) == 1 else None
        # Used once: by the BatchNorm call itself (counted as the call's argument).
        if conv is not None and counter.uses.get(id(ins[0]), 0) <= 1 and _foldable(conv, norm):
            pairs.append((conv, norm))
    return pairs


def _shared(model: nn.Module, module: nn.Module) -> bool:
    return sum(m is module for _, m in model.named_modules(remove_duplicate=False)) > 1


def fold(model: nn.Module, pairs: list[tuple[nn.Module, nn.Module]],
         left: list[tuple[str, str]] | None = None) -> int:
    """Fold each (conv, BatchNorm) pair in place; returns how many were folded. Pairs
    `refusal` rules out (convs or BatchNorms used in more than one place, tied weights,
    weights recomputed at every call, hooks, ...) are left alone, and appended to `left`
    as ("conv -> BatchNorm" by module name, why)."""
    owners: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    tied = {key for key, count in owners.items() if count > 1}
    names = {id(m): name or "(the model)" for name, m in model.named_modules()}
    global_hooks = _global_hooks()
    done = 0
    for conv, bn in dict(pairs).items():
        if not isinstance(conv, _Conv) or not isinstance(bn, _BatchNorm) or \
                isinstance(bn, FoldedBatchNorm):
            continue
        why = global_hooks or refusal(model, conv, bn, tied)
        if why is not None:
            pair = f"{names.get(id(conv), type(conv).__name__)} -> " \
                   f"{names.get(id(bn), type(bn).__name__)}"
            logger.info("conv_bn_folding: %s left unfolded: %s", pair, why)
            if left is not None:
                left.append((pair, why))
            continue
        keeps_shift = _fold_pair(conv, bn)
        bn.__dict__["_torchbridge_keeps_shift"] = keeps_shift
        done += 1
    return done
