"""Passes the core offers on every backend. Backend plugins add, replace or veto them.

| pass | level | when |
| --- | --- | --- |
| device_placement | O0 | always |
| conv_bn_folding | O1 | eval mode, a BatchNorm fed only by a conv (nn.Sequential order or |
|  |  | one traced call on the sample input; no torch.fx); not where a weight is |
|  |  | recomputed per call or a hook would see the fold (folding.refusal) |
| channels_last | O1 | the model has Conv2d and the device runs NHWC convolutions natively; |
|  |  | feature maps come back laid out as eager's (one copy of each) |
| transformer_composite | O2 | eval mode, nn.TransformerEncoderLayer: off the fused fast path |
| autocast | O2 | the device has a native low-precision dtype (or config.precision names one), |
|  |  | the model is not float64; with int8 on a CPU without AMX, not when |
|  |  | nn.Linear is nearly all of the model's work (quantize.int8_float32_reason) |
| low_precision_weights | O3 | eval mode, after autocast: Linear/Conv/MHA parameters in its dtype |
| compile | O2 | torch.compile with inductor; options through ctx.state["compile_options"], |
|  |  | skipped when an earlier pass set ctx.state["skip_compile"] to its reason |
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchbridge import trees
from torchbridge.errors import ConfigurationError
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize import folding, inductor_backend, settings
from torchbridge.optimize.forward import (
    autocast_forward,
    autocast_when_called_alone,
    compile_state,
    compiled_forward,
    install_forward,
    outputs_cast_back,
)
from torchbridge.optimize.measure import preserved_state, sample_call
from torchbridge.optimize.passes import OptimizationPass, PassContext, PassSkipped
from torchbridge.optimize.quantize import int8_float32_reason
from torchbridge.optimize.training_weights import restore_when_training
from torchbridge.suggestions import shortened

# Devices whose convolution libraries (oneDNN, cuDNN, MIOpen) have native NHWC kernels.
CHANNELS_LAST_DEVICES = {"cpu", "cuda", "xpu"}


def _place(model: nn.Module, ctx: PassContext) -> nn.Module:
    return model.to(ctx.backend.device)


def _placed(model: nn.Module, ctx: PassContext) -> str | None:
    kind = ctx.backend.device.type
    away = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type != kind]
    return f"{', '.join(away[:3])} not on {kind}" if away else None


def _has_conv_bn(model: nn.Module) -> bool:
    mods = list(model.modules())
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in mods) and \
        any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in mods)


def _conv_bn_check(model: nn.Module, ctx: PassContext) -> str | None:
    return None if _has_conv_bn(model) else "no convolution with BatchNorm in the model"


def _fold_conv_bn(model: nn.Module, ctx: PassContext) -> nn.Module:
    pairs = folding.sequential_pairs(model)
    how = "nn.Sequential order"
    # The traced call (a forward under a TorchFunctionMode, slower than a plain one: 0.4 s
    # of the reference conv net's first call at batch 64 on a loaded 2-core EPYC) only
    # where a BatchNorm is left that the structure did not pair.
    if ctx.sample_input is not None and folding.unpaired_norms(model, pairs):
        call = sample_call(ctx.backend, ctx.sample_input)
        with preserved_state(model):
            model.eval()
            pairs += folding.traced_pairs(model, call)
        how = "one traced call on the sample input"
    left: list[tuple[str, str]] = []
    done = folding.fold(model, pairs, left)
    if not done and left:
        raise PassSkipped(f"left every conv/BatchNorm pair found (by {how}) unfolded: "
                          f"{folding.describe_left(left)}")
    if not done:
        raise PassSkipped("found no BatchNorm fed only by the convolution before it (by "
                           f"{how}; without a sample input only nn.Sequential pairs are "
                           "found)")
    unfolded = f"; left unfolded: {folding.describe_left(left)}" if left else ""
    ctx.notes.append(f"conv_bn_folding: folded {done} BatchNorm(s), found by {how}"
                     f"{unfolded}; model.train() unfolds them (training needs the "
                     "BatchNorm)")
    return model


def _channels_last_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return "no Conv2d in the model"
    if ctx.backend.device.type not in CHANNELS_LAST_DEVICES:
        return f"{ctx.backend.device.type} has no native channels_last convolutions"
    # Module.to(memory_format=channels_last) converts every 4-D and 5-D tensor, and a 5-D
    # one (a Conv3d weight) has no channels_last layout: the conversion raises.
    five_d = next((name for name, t in [*model.named_parameters(), *model.named_buffers()]
                   if t.dim() == 5), None)
    if five_d is not None:
        return f"{five_d} is 5-D (a 3-D convolution?): channels_last is for 4-D tensors"
    return None


def _channels_last(model: nn.Module, ctx: PassContext) -> nn.Module:
    converted: nn.Module = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    eager_layout_outputs(converted)
    ctx.notes.append("channels_last: feature maps the NHWC convolutions return channels_last "
                     "are copied back to contiguous (one copy of each, on every call), as "
                     "eager lays them out, unless an input is channels_last")
    return converted


def _nhwc(t: torch.Tensor) -> bool:
    """A 4-D tensor strided channels_last and not contiguous: one that view(n, -1) and the
    like refuse. A (N, C, 1, 1) or (N, 1, H, W) tensor is both, so it is never copied."""
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
        and not t.is_contiguous()


def _as_eager_lays_out(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    # A convolution returns channels_last when its input or its weight is: with contiguous
    # inputs, eager's (contiguous) weights give contiguous feature maps, the converted ones
    # channels_last. Channels_last inputs give channels_last feature maps in eager too:
    # then the outputs are left as they come. (A model that turns NHWC by itself on
    # contiguous inputs gets contiguous outputs here where eager's were channels_last:
    # the same values, a layout every view of eager's works on but NHWC-order ones.)
    if not any(_nhwc(t) and t.is_floating_point() for t in trees.tensors(out)):
        return out  # nothing to lay out: the output object itself, not rebuilt
    if any(_nhwc(t) for t in trees.tensors((args, kwargs))):
        return out
    # The cost of the drop-in: one copy of each such output, on every call (traced into
    # the compiled graph at O2/O3; where inductor lays the graph's output out otherwise,
    # the compile pass fails the output check, saying so: torch 2.9.1 did, in a process
    # that had compiled other frozen conv nets before).
    return trees.map_tensors(
        lambda t: t.contiguous() if t.is_floating_point() and _nhwc(t) else t, out)


def eager_layout_outputs(model: nn.Module) -> None:
    """The model's floating 4-D outputs come back contiguous where they are channels_last
    only because its conv weights are (the channels_last pass): user code that views them
    (`out.view(batch, -1)`) works as on the eager model. Under torch.compile (the compile
    pass compiles this forward) the copy is traced with the model. A walk that has to
    register an output type pytree does not know yet (a dataclass or dict subclass output,
    compiled at the first call: no sample input) breaks the graph there, at its end, as
    autocast's cast back does."""

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return _as_eager_lays_out(args, kwargs, inner(*args, **kwargs))
        return forward

    install_forward(model, make, eager_layout_outputs)


def _is_channels_last(model: nn.Module, ctx: PassContext) -> str | None:
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if convs and all(m.weight.is_contiguous(memory_format=torch.channels_last)
                     for m in convs):
        return None
    return "no Conv2d weight is channels_last"


def _float_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its floating parameters' (float32 if none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _autocast_check(model: nn.Module, ctx: PassContext) -> str | None:
    if torch.float64 in _float_dtypes(model):
        return "the model holds float64 weights or buffers: computing it in a 16-bit dtype " \
               "would throw away the precision it was built for (float64 kept)"
    if ctx.backend.low_precision_dtype(ctx.device_info) is None:
        return (f"{ctx.device_info.name} has no native low-precision dtype "
                f"(and config.precision is {ctx.config.precision})")
    return int8_float32_reason(model, ctx)  # last: it runs the model once


def _autocast(model: nn.Module, ctx: PassContext) -> nn.Module:
    dtype = ctx.backend.low_precision_dtype(ctx.device_info)
    assert dtype is not None
    ctx.state["autocast_dtype"] = dtype
    if ctx.config.precision != "auto":
        ctx.notes.append(_configured_precision_note(dtype, ctx))
    if dtype == torch.float16 and ctx.training:
        # fp16's narrow range underflows small gradients; bf16 has float32's range.
        ctx.notes.append("autocast: training in float16 needs loss scaling; use "
                         f"torch.amp.GradScaler({ctx.backend.device.type!r})")
    autocast_forward(model, ctx.backend.device.type, dtype, _model_dtype(model))
    return model


def _configured_precision_note(dtype: torch.dtype, ctx: PassContext) -> str:
    """What the report says when config.precision chose the dtype, not the device: the
    setting is honoured (the user asked for it), but a dtype the device's description does
    not list (bfloat16 on a V100) runs emulated or not at all, and the pass's own words
    ("the device's low-precision dtype") would say otherwise."""
    name = str(dtype).removeprefix("torch.")
    info = ctx.device_info
    note = f"autocast: computes in {name} because config.precision is {name}"
    if info.supported_dtypes and name not in info.supported_dtypes:
        own = info.preferred_low_precision_dtype or "none"
        note += (f"; {info.name} does not list {name} among its dtypes "
                 f"({', '.join(info.supported_dtypes)}; its own low-precision dtype: "
                 f"{own}), so it may run emulated and slower")
    return note


# Weights autocast would cast on every call; stored in the low-precision dtype instead.
_LOW_PRECISION_WEIGHT_MODULES = (nn.Linear, nn.modules.conv._ConvNd, nn.MultiheadAttention)


def _matmul_module(module: nn.Module) -> bool:
    """A module whose weights only feed matmuls autocast runs in low precision. Hugging
    Face's Conv1D (GPT-2's projections: torch.addmm with a transposed weight) is one, though
    not an nn.Linear: left float32, its weights were cast on every decoding step."""
    cls = type(module)
    return isinstance(module, _LOW_PRECISION_WEIGHT_MODULES) or (
        cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers."))


def _weights_check(model: nn.Module, ctx: PassContext) -> str | None:
    if "autocast_dtype" not in ctx.state:
        return "autocast did not run"
    if not any(_matmul_module(m) for m in model.modules()):
        return "no Linear, Conv or MultiheadAttention in the model"
    return None


def _low_precision_weights(model: nn.Module, ctx: PassContext) -> nn.Module:
    # Norms, embeddings and buffers stay float32: autocast runs norms in float32 anyway,
    # and an embedding gains nothing from it. A weight tied to a norm or another module
    # stays float32 too: casting a copy would untie it (50% more parameters, both in
    # checkpoints). A weight an embedding shares with Linears (an LM head tied to it) is
    # stored in `dtype` for all of them, one tensor still, the embedding's output cast
    # back: kept float32, autocast cast all of it at each uncompiled call (each decoding
    # step of generate(): 0.17 ms of a 1.3 ms step, the suite's Llama, 8192 x 256), and
    # under inference_mode the prefill's last position (hidden_states[:, -1:]) went
    # through a batched matmul copying the expanded weight (4 ms once per generate()):
    # generate() after O3 ran 0.73x-0.94x eager's tokens per second, 1.13x-1.17x now
    # (the suite's Llama and GPT-2, 2-core AMD EPYC, benchmarks/generate_variants.py).
    # The output drift did not move (max relative error 4.7e-3 and 4.9e-3 kept float32,
    # 4.5e-3 and 5.2e-3).
    dtype = ctx.state["autocast_dtype"]
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    out_dtype = _model_dtype(model)
    cast, kept, holders = 0, 0, []
    embeddings: dict[int, nn.Module] = {}  # holding a weight cast with the Linears sharing it
    # A weight computed at each call (a parametrization, weight_norm, prune) is no
    # parameter of its module: it stays in its dtype, and the report says so.
    computed = [name or type(module).__name__ for name, module in model.named_modules()
                if _matmul_module(module) and isinstance(getattr(module, "weight", None),
                                                        torch.Tensor)
                and "weight" not in module._parameters]
    restore: list[tuple[str, str, torch.dtype, torch.dtype]] = []  # training_weights.py
    for module_name, module in model.named_modules():
        if not _matmul_module(module):
            continue
        holds = False
        for param_name, param in module.named_parameters(recurse=False):
            if not param.is_floating_point() or param.dtype == dtype:
                continue
            sharing = owners[id(param)]
            if not all(_matmul_module(m) or isinstance(m, nn.Embedding) for m in sharing):
                kept += 1
                continue
            restore.append((module_name, param_name, param.dtype, dtype))
            param.data = param.data.to(dtype)  # the same Parameter: ties stay ties
            cast += 1
            holds = True
            embeddings.update((id(m), m) for m in sharing if isinstance(m, nn.Embedding))
        if holds:
            holders.append(module)
    if kept:
        ctx.notes.append(f"low_precision_weights: {kept} weight(s) shared with a norm or "
                         "another module kept in their dtype, so that they stay tied")
    if embeddings:
        names = [name or type(m).__name__ for name, m in model.named_modules()
                 if id(m) in embeddings]
        ctx.notes.append(f"low_precision_weights: {shortened(names, 3)} share(s) its weight "
                         f"with a Linear (an LM head tied to it): stored in "
                         f"{str(dtype).removeprefix('torch.')} for both, one tensor still; "
                         "the embedding's output comes back in the model's dtype")
    if computed:
        ctx.notes.append(f"low_precision_weights: {len(computed)} module(s) compute their "
                         "weight at each call (a parametrization, weight_norm or pruning), "
                         f"which stays in its dtype: {shortened(computed, 4)}")
    if not cast:
        name = str(dtype).removeprefix("torch.")
        raise PassSkipped(f"every eligible weight is in {name} already" if not kept else
                          "every eligible weight not in " + name + " already is shared "
                          "with a norm or another module")
    for module in holders:
        autocast_when_called_alone(module, ctx.backend.device.type, dtype, out_dtype)
    for module in embeddings.values():
        outputs_cast_back(module, dtype, out_dtype)
    restore_when_training(model, restore)
    return model


def _compile_check(model: nn.Module, ctx: PassContext) -> str | None:
    # An earlier pass that measured the model may have found compiling not worth its cost.
    reason: str | None = ctx.state.get("skip_compile")
    return reason


def use_cache_dir(folder: str) -> str:
    """Inductor's caches in `folder` from now on (created if missing); its absolute path."""
    path = os.path.abspath(os.path.expanduser(folder))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"config optimization.compile_cache_dir {folder!r} cannot be "
                                 f"used as a folder: {exc}") from exc
    if os.environ.get(COMPILE_CACHE_DIR_VARIABLE) != path:
        from torch._inductor.utils import clear_caches

        settings.put(settings.COMPILE_CACHE_DIR, path)
        clear_caches()  # in-memory caches keyed on the old folder
    return path


COMPILE_CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def _compile(model: nn.Module, ctx: PassContext) -> nn.Module:
    cache = ctx.config.optimization.compile_cache_dir
    if cache is not None:
        where = use_cache_dir(cache)
        ctx.notes.append(f"compile: inductor's caches in {where} (config "
                         "optimization.compile_cache_dir): another process preparing the "
                         "same model reuses what this one compiled")
    options: dict[str, Any] = dict(ctx.state.get("compile_options", {}))
    backend: str = ctx.state.get("compile_backend", "inductor")
    # torch.compile(options={"freezing": True}) compiles without freezing (seen on torch
    # 2.13: the generated code still takes every weight as an input); inductor reads
    # freezing from its global config when it compiles, so the forward sets it there
    # around its compiled calls (tests/test_passes_cpu.py checks the weights are folded).
    # Inductor settings earlier passes chose (ctx.state["inductor_config"], dotted names for
    # its sections: "cpp.weight_prepack"), and freezing, which plugins may still put among
    # the options.
    inductor_config = dict(ctx.state.get("inductor_config", {}))
    if "freezing" in options:
        inductor_config["freezing"] = options.pop("freezing")
    if backend == "inductor":  # the same compiler, with cache keys stable across processes
        compiler: Any = inductor_backend.inductor(options)
        compiled_forward(model, lambda fn: torch.compile(fn, backend=compiler),
                         inductor_config or None, options)
    else:
        compiled_forward(model, lambda fn: torch.compile(fn, backend=backend,
                                                         options=options or None),
                         inductor_config or None, options)
    when = "compiled on the sample input inside prepare_model" if ctx.sample_input is not None \
        else "the first call compiles; if that fails the model runs uncompiled, with a warning"
    when += ("; calls with other keywords or another number of positional arguments than "
             "that first call (generate()'s steps with a KV cache among them) run the "
             "forward uncompiled, logged once for each such signature")
    settings = f", inductor config {inductor_config}" if inductor_config else ""
    ctx.notes.append(f"compile: torch.compile(backend={backend!r}, options={options}"
                     f"{settings}); {when}")
    return model


def compile_ahead(ctx: PassContext) -> str | None:
    """Why the compile pass will not run, as far as a pass before it can tell (a veto or a
    failure shows only in the effect check at the end); None when it may."""
    if "compile" in ctx.config.optimization.disabled_passes:
        return "compile is disabled by config optimization.disabled_passes"
    skip: str | None = ctx.state.get("skip_compile")
    return f"compile is skipped ({skip})" if skip else None


def compiled(model: nn.Module, ctx: PassContext) -> str | None:
    """The compile pass's effect: the prepared model runs a compiled forward that has not
    failed (without a sample input, the first call compiles: a failure shows only then)."""
    state = compile_state(model)
    if state is None:
        return "the model's forward is not compiled"
    if state.error is not None:
        return f"the compiled forward failed ({type(state.error).__name__}); it runs " \
               "uncompiled"
    return None


def compiled_with(option: str, where: str = "options") -> Any:
    """The effect of a pass that sets a compile option: the compiled forward was built with
    `option` true (where: "options" of torch.compile or "inductor_config")."""
    def effect(model: nn.Module, ctx: PassContext) -> str | None:
        state = compile_state(model)
        if state is None or compiled(model, ctx) is not None:
            return f"{option} is a compile option, and the model is not compiled"
        if not getattr(state, where).get(option):
            return f"the model was compiled without {option}"
        return None
    return effect


def core_passes() -> list[OptimizationPass]:
    from torchbridge.optimize.transformer import composite_check, use_composite_path

    o0, o1, o2 = OptimizationLevel.O0, OptimizationLevel.O1, OptimizationLevel.O2
    o3 = OptimizationLevel.O3
    return [
        OptimizationPass("device_placement", "parameters and buffers on the device",
                         o0, _place, order=0, effect=_placed),
        OptimizationPass("conv_bn_folding", "folded BatchNorm into the preceding convolution",
                         o1, _fold_conv_bn, _conv_bn_check, mode="inference", order=10),
        OptimizationPass("channels_last", "converted conv weights to channels_last (NHWC); "
                         "feature maps returned contiguous, as eager returns them",
                         o1, _channels_last, _channels_last_check, order=20,
                         effect=_is_channels_last),
        OptimizationPass("transformer_composite", "TransformerEncoderLayers run ordinary "
                         "ops instead of the fused fast path that ignores CPU autocast",
                         o2, use_composite_path, composite_check, mode="inference",
                         order=40),
        OptimizationPass("autocast", "computes in the device's low-precision dtype inside "
                         "the compiled region; outputs cast back to the model's dtype",
                         o2, _autocast, _autocast_check, order=60, mutates=False),
        OptimizationPass("low_precision_weights", "Linear, Conv and attention weights and "
                         "biases stored in the autocast dtype, not cast on every call", o3,
                         _low_precision_weights, _weights_check, mode="inference",
                         order=62),
        OptimizationPass("compile", "torch.compile with inductor", o2, _compile,
                         _compile_check, order=80, mutates=False, effect=compiled,
                         settings=(settings.COMPILE_CACHE_DIR,)),
    ]
