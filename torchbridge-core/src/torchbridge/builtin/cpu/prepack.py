"""oneDNN weight prepacking under inductor freezing (inductor's cpp.weight_prepack).

Without it, each call of a convolution or a linear layer with weights in plain layout has
oneDNN reorder every weight into its blocked layout before computing. Prepacked at compile
time, the weights are reordered once, and inductor fuses the following pointwise ops into
the packed convolutions. Measured at O3, same process, prepacked against not (2-core AMD
EPYC family 26 without AMX, torch 2.13, 2026-11-25; calls in ms, the timing stage's
medians): ResNet-18 widths at 64x64 images 4.7-7.0 -> 2.9-3.0, the HF suite's ResNet
1.21-1.24 -> 0.86-0.90, its BERT 8.6 -> 6.7, ViT 3.5 -> 3.0, GPT-2 7.6 -> 7.1, Llama
7.4 -> 6.7; with quantize="int8" (every Linear's weight int8) no faster (Llama 3.65x ->
3.59x eager, BERT 2.80x -> 2.73x). The first call was no longer (BERT 4.8 -> 4.3 s).
(Prepacking had been off since it measured no faster on a loaded machine; on a quiet
one, one process per variant, it is.) On a 2-core Intel Xeon with AMX, 2026-11-27
(benchmarks/cpu_prepack.py, round-robin in one process, two runs), the same held: ResNet
1.94-1.99x -> 2.56-2.63x eager, BERT 2.44-2.46x -> 2.89-2.90x, ViT 1.84-1.86x ->
2.07-2.11x, GPT-2 2.28-2.31x -> 2.44-2.45x, Llama 2.39-2.49x -> 2.36-2.44x.

Prepacked weights are oneDNN tensors, for which inductor bypasses its FX graph cache, so a
second process compiled the graph again (its C++ kernels still came from the cache: ViT's
second-process first call 3.3 s cached, 4.2 s prepacked). The compile pass's backend keys
them, as every frozen weight, by their values, so the graph is cached all the same
(optimize/inductor_backend.py; on a torch whose cache is laid out otherwise it is not,
and the note says so). Quantized layers are not prepacked (torchao's
weight-pack pattern is not registered), hence the rule: prepack while float convolutions
or linear layers remain (config hardware.cpu.weight_prepack overrides it).

Inductor registers its weight-pack patterns once per process, at the first freezing
compile, and only if cpp.weight_prepack is on then; once registered they apply to every
later frozen graph whatever the setting. So a process whose first frozen graph was
compiled without prepacking would never prepack, and one whose first was compiled with it
always does. `ensure_registered` registers them when wanted and missing; `registered`
tells the report when they are there although not wanted.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

# Layers inductor prepacks: 2-d and 3-d convolutions (transposed too) and linear layers.
_PACKED_LAYERS = (nn.Linear, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def float_layers(model: nn.Module) -> int:
    """How many layers inductor would prepack: convolutions and linear layers whose weight
    is a plain float tensor (not a quantized tensor subclass such as torchao's)."""
    return sum(1 for m in model.modules() if isinstance(m, _PACKED_LAYERS)
               and type(getattr(m, "weight", None)) is nn.Parameter
               and m.weight.is_floating_point())


def decide(model: nn.Module, setting: bool | None) -> tuple[bool, str]:
    """(prepack?, why) for config hardware.cpu.weight_prepack = `setting` (None: by the
    model's layers)."""
    if setting is not None:
        return setting, f"config hardware.cpu.weight_prepack is {setting}"
    count = float_layers(model)
    if count:
        return True, f"{count} float convolution/linear layers"
    return False, "no float convolution or linear layer left to prepack (quantized weights " \
        "are not)"


def _pattern_handlers() -> set[tuple[str, str]]:
    from torch._inductor.fx_passes import freezing_patterns

    handlers = set()
    for matcher in freezing_patterns.pass_patterns:
        for entries in matcher.patterns.values():
            for entry in entries:
                handler = getattr(entry, "handler", None)
                handlers.add((getattr(handler, "__module__", ""),
                              getattr(handler, "__name__", "")))
    return handlers


def registered() -> bool | None:
    """Whether inductor's weight-pack patterns are registered in this process (None: this
    torch's inductor is laid out otherwise, so it cannot be told)."""
    try:
        from torch._inductor.fx_passes import mkldnn_fusion

        return (mkldnn_fusion.__name__, "convolution") in _pattern_handlers()
    except Exception:  # a torch whose internals differ: say unknown, never fail a pass
        return None


@functools.cache
def _register() -> None:
    from torch._inductor.fx_passes import mkldnn_fusion
    from torch._inductor.pattern_matcher import init_once_fakemode

    # In the contexts inductor's own lazy init runs them in (no tracing, fake mode).
    init_once_fakemode(lambda: mkldnn_fusion._mkldnn_weight_pack_init())()


def ensure_registered() -> str | None:
    """Register the weight-pack patterns if inductor's lazy init has run without them (with
    it still to run, it registers them itself under cpp.weight_prepack). None when done or
    not needed; else why not."""
    try:
        from torch._inductor.fx_passes import freezing_patterns

        lazy_init: Any = freezing_patterns.lazy_init  # functools.cache'd
        if not lazy_init.cache_info().currsize:
            return None  # the first freezing compile registers them, prepacking on
        if registered():
            return None
        _register()
        if not registered():
            return "inductor's weight-pack patterns did not register"
    except Exception as exc:  # internals of another torch: the compile still runs
        logger.warning("could not register inductor's weight-pack patterns: %s", exc)
        return f"inductor's weight-pack patterns could not be registered ({exc})"
    return None


def arrange(wanted: bool, why: str) -> str:
    """Makes this process's inductor prepack when `wanted` (ensure_registered), and returns
    the freezing pass's note: what it asked inductor, why, and what the patterns registered
    in this process will make of it."""
    if wanted:
        trouble = ensure_registered()
        if trouble is not None:
            return f"inference_freezing: weights not prepacked for oneDNN ({trouble})"
        from torch._inductor import config as inductor_config

        from torchbridge.optimize.inductor_backend import prepacked_graphs_cacheable

        if not getattr(inductor_config, "fx_graph_cache", True):
            cached = "inductor's FX graph cache is off in this process"
        elif prepacked_graphs_cacheable():
            cached = ("inductor's FX graph cache keeps the graph, its prepacked weights "
                      "keyed by their values (another process preparing the same model "
                      "takes it from there)")
        else:
            cached = ("on this torch, prepacked weights make inductor's FX graph cache "
                      "bypass the graph: another process compiles it again (its C++ "
                      "kernels come from the cache)")
        return f"inference_freezing: weights prepacked for oneDNN where inductor can " \
               f"({why}); {cached}"
    note = f"inference_freezing: weights not prepacked for oneDNN ({why})"
    if registered():
        note += ("; but an earlier compile in this process registered inductor's "
                 "weight-pack patterns, which apply to every frozen graph: this one's "
                 "weights may be prepacked all the same")
    return note

