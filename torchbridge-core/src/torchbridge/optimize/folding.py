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
prepared model therefore computes the same in the unprepared class. A state dict loaded
into the prepared model makes the folded BatchNorms BatchNorms again (FoldedBatchNorm.
_load_from_state_dict): right for a checkpoint of either.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_weights
from torch.overrides import TorchFunctionMode

from torchbridge import trees

logger = logging.getLogger(__name__)

_Conv = nn.modules.conv._ConvNd
_BatchNorm = nn.modules.batchnorm._BatchNorm
# Reading a tensor's metadata is not a use of its values.
_METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "stride",
             "is_contiguous", "element_size", "data_ptr"}


class FoldedBatchNorm:
    """Mixed into a folded BatchNorm's class: its forward is the identity, or subtracts the
    running mean where that holds the conv's shift."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        mean = getattr(self, "running_mean", None)
        if not getattr(self, "_torchbridge_keeps_shift", False) or mean is None:
            return input
        shifted: torch.Tensor = input - mean.view([1, -1] + [1] * (input.dim() - 2))
        return shifted

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # load_state_dict puts a BatchNorm's own statistics back, and the conv before it
        # gets its weights from the same dict: unfolded ones from the model as built,
        # whose BatchNorm must then run (it was ignored: outputs off by 0.36 on a small
        # conv net, the report still saying drift 1.5e-7), or folded ones from a prepared
        # model, whose BatchNorm state is the identity (or the conv's shift) and computes
        # the same as a BatchNorm. Either way the module is a BatchNorm again.
        own: Any = next(c for c in type(self).__mro__[1:]
                        if not issubclass(c, FoldedBatchNorm))
        self.__class__ = own
        self.__dict__.pop("_torchbridge_keeps_shift", None)
        logger.info("a state dict was loaded into the folded %s %s: it runs as a BatchNorm "
                    "again (prepare the model again to fold it)", own.__name__,
                    prefix.rstrip(".") or "(the model)")
        own._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)


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
    return (isinstance(conv, _Conv) and _foldable_norm(bn)
            and conv.weight.shape[0] == bn.num_features)


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


def fold(model: nn.Module, pairs: list[tuple[nn.Module, nn.Module]]) -> int:
    """Fold each (conv, BatchNorm) pair in place; returns how many were folded. Convs or
    BatchNorms used in more than one place, or whose weights are tied, are left alone."""
    owners: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    tied = {key for key, count in owners.items() if count > 1}
    done = 0
    for conv, bn in dict(pairs).items():
        if _shared(model, conv) or _shared(model, bn) or id(conv.weight) in tied:
            continue
        if not isinstance(conv, _Conv) or not isinstance(bn, _BatchNorm):
            continue
        assert bn.running_mean is not None and bn.running_var is not None
        with torch.no_grad():
            weight, bias = fuse_conv_bn_weights(
                conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight,
                bn.bias, transpose=isinstance(conv, nn.modules.conv._ConvTransposeNd))
            conv.weight.copy_(weight)
            keeps_shift = conv.bias is None
            if conv.bias is not None:
                conv.bias.copy_(bias)
            bn.running_mean.copy_(-bias if keeps_shift else torch.zeros_like(bias))
            bn.running_var.fill_(1.0 - bn.eps)
            if bn.weight is not None and bn.bias is not None:
                bn.weight.fill_(1.0)
                bn.bias.zero_()
        bn.__class__ = _folded_class(type(bn))
        bn.__dict__["_torchbridge_keeps_shift"] = keeps_shift
        done += 1
    return done
