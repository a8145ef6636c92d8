"""Quantization of the Linear layers through torchao (pip install torchbridge-core[quantize]).

| pass | level | when |
| --- | --- | --- |
| quantize | O0 | eval mode, prepare_model(quantize=...) or config optimization.quantize, a |
|  |  | sample input, torchao, a device that runs the mode (quantize_gate.unsupported) |

The level does not gate it: quantize= is asked for explicitly. Its output_check (the
accuracy gate, quantize_gate.AccuracyGate) replaces the level's tolerance for the rest of
the run; a model that fails it is rolled back with the figures in the report. torchao is
imported inside the pass only: get_backend() never pays for it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, cast

import torch
from torch import nn

from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.measure import preserved_state, sample_call
from torchbridge.optimize.passes import OptimizationPass, PassContext, PassSkipped
from torchbridge.optimize.quantize_gate import AccuracyGate, QuantizationReport, unsupported
from torchbridge.optimize.report import QUANTIZE_NOT_ASKED, QUANTIZE_PASS
from torchbridge.optimize.run import skip_reason
from torchbridge.suggestions import shortened

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install torchbridge-core[quantize]"


def _torchao_missing() -> str | None:
    try:
        import torchao.quantization  # noqa: F401
    except ImportError as exc:
        return f"needs torchao ({INSTALL_HINT}): {exc}"
    return None


def _check(model: nn.Module, ctx: PassContext) -> str | None:
    mode = ctx.quantize
    if mode is None:
        return QUANTIZE_NOT_ASKED
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return f"{mode}: no nn.Linear in the model"
    why = unsupported(mode, ctx.device_info, ctx.backend.device.type)
    if why is not None:
        return f"{mode}: {why}"
    if ctx.sample_input is None:
        # The gate is what keeps a quantization that ruins the model from being returned:
        # without an input to run, nothing would be checked.
        return f"{mode}: needs sample_input to check the quantized model's accuracy"
    missing = _torchao_missing()
    return None if missing is None else f"{mode}: {missing}"


# With int8 on a CPU the autocast pass (order 60, before this one) decides whether the rest
# of the model computes in float32 or bfloat16: the int8 GEMMs run faster on float32
# activations, everything else faster in bfloat16, so it depends on how much of the model
# the quantized Linears are. Measured at O3 (python benchmarks/int8_autocast.py: eager and
# both forms round-robin in one process; 2-core AMD EPYC, avx512_bf16 + VNNI, no AMX;
# torch 2.13, torchao 0.18, 2026-11-24 11:16), with nn.Linear's share of the FLOPs
# FlopCounterMode counts on the sample:
#   Llama (share 1.00) 2.79x eager with float32 activations, 2.69x with bfloat16;
#   BERT (1.00) 1.92x against 1.76x; ViT (0.96) 1.90x against 1.68x;
#   GPT-2 (0.57: its Conv1D projections are not nn.Linear, torchao leaves them in float)
#   1.73x against 2.25x; ResNet-18-like (0.00: one Linear after the convolutions) 1.49x
#   against 2.05x. (A run with float32 for the ResNet once timed as fast as O0, and O0
#   was returned.)
# On a CPU with AMX (an Intel Xeon, family 6 model 167, 2 cores, 2026-11-27 17:41 and
# 18:04, two runs of the same command) bfloat16 won for every model, the share
# notwithstanding: Llama 2.32x/2.25x eager with float32 activations against 2.43x/2.30x
# with bfloat16, BERT 1.83x/1.81x against 1.98x/1.98x, ViT 1.39x/1.42x against
# 1.45x/1.45x, GPT-2 1.73x/1.61x against 2.83x/2.55x, ResNet-18-like 1.55x/1.56x against
# 2.20x/2.22x. There AMX tiles make bfloat16 matmuls (attention's among them) cheap, so
# the threshold applies only without them.
INT8_FLOAT32_MIN_LINEAR_SHARE = 0.9


def linear_flop_share(model: nn.Module, ctx: PassContext) -> float | None:
    """nn.Linear's share of the matmul and convolution FLOPs of one call on the sample
    input (torch's FlopCounterMode; attention kernels it has no formula for are not
    counted). None without a sample input, or when the call fails."""
    from torch.utils.flop_counter import FlopCounterMode

    if ctx.sample_input is None:
        return None
    linear = 0

    def count(module: nn.Linear, args: tuple[Any, ...], out: Any) -> None:
        nonlocal linear
        if args and isinstance(args[0], torch.Tensor):
            linear += 2 * args[0].numel() * module.out_features

    hooks = [m.register_forward_hook(count) for m in model.modules()
             if isinstance(m, nn.Linear)]
    call = sample_call(ctx.backend, ctx.sample_input)
    try:
        with preserved_state(model), FlopCounterMode(display=False) as counter:
            model.eval()
            call(model)
    except Exception as exc:  # the run's own checks report a model that fails
        logger.debug("quantize: counting FLOPs failed: %s", exc)
        return None
    finally:
        for hook in hooks:
            hook.remove()
    total = counter.get_total_flops()
    return min(1.0, linear / total) if total else None


def int8_float32_reason(model: nn.Module, ctx: PassContext) -> str | None:
    """Why the autocast pass leaves the model in float32: int8 will quantize it on a CPU
    without AMX and its nn.Linear layers do nearly all its work. None otherwise (a note
    then says why autocast runs beside int8)."""
    if ctx.quantize != "int8" or ctx.backend.device.type != "cpu":
        return None
    if skip_reason(_quantize_pass(), "core", model, ctx) is not None:
        return None  # the quantize pass will not run: nothing is faster in float32
    if ctx.device_info.extra.get("bf16_unit") == "amx_bf16":
        note = ("autocast: kept with quantize='int8': this CPU computes bf16 matmuls on AMX "
                "tiles, where the model runs faster in bf16 around the int8 GEMMs than in "
                "float32, whatever share of its work nn.Linear does")
        if note not in ctx.notes:
            ctx.notes.append(note)
        return None
    share = linear_flop_share(model, ctx)
    if share is None:
        return None
    if share >= INT8_FLOAT32_MIN_LINEAR_SHARE:
        return (f"quantize='int8' on a CPU, and nn.Linear does {share:.0%} of the model's "
                "matmul FLOPs on the sample input: the int8 GEMMs take float32 activations "
                "(faster here than bf16 around them)")
    note = (f"autocast: kept with quantize='int8': nn.Linear does only {share:.0%} of the "
            "model's matmul FLOPs on the sample input, and the rest runs faster in bf16")
    if note not in ctx.notes:
        ctx.notes.append(note)
    return None


def _torchao_config(mode: str, ctx: PassContext) -> Any:
    """torchao's config for `mode` on this device. set_inductor_config=False everywhere:
    torchao would otherwise set inductor's process-wide config behind the pipeline's
    back; the options it recommends go to the compile pass instead (_compile_options)."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )

    if mode == "int8":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if mode == "int8_weight_only":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if mode == "int4_weight_only":
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        # The default packing (plain) needs the mslk package; tinygemm's tile packing is
        # torch's own kernel on NVIDIA and ROCm (ntile 16 there), plain_int32 is XPU's.
        if ctx.backend.device.type == "xpu":
            return Int4WeightOnlyConfig(int4_packing_format=Int4PackingFormat.PLAIN_INT32,
                                        set_inductor_config=False)
        ntile = 16 if ctx.device_info.vendor == "AMD" else 8
        return Int4WeightOnlyConfig(int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
                                    int4_tile_packed_ntile=ntile, set_inductor_config=False)
    # float8: e4m3 for activations and weights, the device's variant (fnuz on MI300).
    fp8 = ctx.device_info.extra.get("fp8_dtype")
    dtype = getattr(torch, fp8) if isinstance(fp8, str) and hasattr(torch, fp8) else \
        torch.float8_e4m3fn
    return Float8DynamicActivationFloat8WeightConfig(activation_dtype=dtype, weight_dtype=dtype,
                                                     set_inductor_config=False)


def _compile_options(ctx: PassContext) -> None:
    """On GPUs, the inductor options torchao recommends for quantized models (its
    recommended_inductor_config_setter, minus the cache), as options of the compile pass.
    Not on CPU: they tune Triton kernels, which inductor does not generate there."""
    if ctx.backend.device.type == "cpu":
        return
    options = ctx.state.setdefault("compile_options", {})
    options.update({"coordinate_descent_tuning": True,
                    "coordinate_descent_check_all_directions": True,
                    "force_fuse_int_mm_with_mul": True})


def _quantized(module: nn.Module) -> bool:
    from torchao.utils import TorchAOBaseTensor

    return isinstance(getattr(module, "weight", None), TorchAOBaseTensor)


def _quantize_each(linears: list[tuple[str, nn.Linear]], config: Any,
                   weight_dtype: torch.dtype | None = None) -> tuple[list[str], list[str]]:
    """quantize_ one Linear at a time, each then called on a one-row input: a layer that
    torchao refuses (it raised on an nn.Linear(1, 16)) or whose forward its weight tensor
    cannot serve (a subclass computing `x @ self.weight.T`: no permute for Int8Tensor)
    keeps its float weight, instead of the whole model losing quantization over one
    layer. `weight_dtype`: the float dtype torchao takes the weights in (int4: bf16),
    set on each layer first, and put back on a refused one. Returns the quantized layers'
    names, and the others' with the error."""
    from torchao.quantization import quantize_

    done: list[str] = []
    refused: list[str] = []
    # Linears tied to one weight get one quantized weight: quantized one layer at a time,
    # each would hold a copy of its own (two tensors in memory and in the state_dict).
    quantized_for: dict[int, nn.Module] = {}
    for name, m in linears:
        weight, values = m.weight, m.weight.data
        first = quantized_for.get(id(weight))
        if first is not None and _quantized(first):
            m.register_parameter("weight", cast(nn.Parameter, first.weight))
            done.append(name)
            continue
        try:
            if weight_dtype is not None and weight.dtype not in (torch.bfloat16,
                                                                   torch.float16):
                weight.data = values.to(weight_dtype)
            quantize_(m, config)
            if _quantized(m):
                with torch.no_grad():  # forward, not the module: its hooks see no probe
                    m.forward(torch.zeros(1, m.in_features, dtype=weight.dtype,
                                          device=weight.device))
                done.append(name)
                quantized_for[id(weight)] = m
        except Exception as exc:
            # The Parameter object it had, with its values, registered again.
            weight.data = values
            m.register_parameter("weight", cast(nn.Parameter, weight))
            refused.append(f"{name or type(m).__name__} ({type(exc).__name__}: "
                           f"{str(exc)[:120]})")
    return done, refused


def _quantize(model: nn.Module, ctx: PassContext, gate: AccuracyGate) -> nn.Module:
    mode = ctx.quantize
    assert mode is not None
    config = _torchao_config(mode, ctx)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    # A weight computed at each call (pruning's mask, weight_norm, a parametrization) is no
    # Parameter of the layer: torchao's quantized weight would be overwritten, or refused.
    computed = [name or type(m).__name__ for name, m in linears
                if not isinstance(m._parameters.get("weight"), nn.Parameter)]
    linears = [(name, m) for name, m in linears
               if isinstance(m._parameters.get("weight"), nn.Parameter)]
    if computed and not linears:
        raise PassSkipped(f"{mode}: every nn.Linear computes its weight at each call "
                          f"(pruning, weight_norm or a parametrization): {shortened(computed, 3)}")
    tied = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)}
    untied = [name for name, m in linears if id(m.weight) in tied]
    # int4's kernels take bf16 weights (and cast activations).
    done, refused = _quantize_each(
        linears, config, torch.bfloat16 if mode == "int4_weight_only" else None)
    if not done:
        raise PassSkipped(f"{mode}: torchao quantized none of the {len(linears)} nn.Linear "
                          "layers (shapes it does not take, or Linears it leaves alone)"
                          + (f"; it raised on {'; '.join(refused[:3])}" if refused else ""))
    _compile_options(ctx)
    report = QuantizationReport(
        mode, f"torchao {type(config).__name__} on {len(done)} of {len(linears)} Linear "
        "layers", ctx.config.optimization.quantize_min_cosine,
        ctx.config.optimization.quantize_min_argmax_agreement)
    gate.report = report
    ctx.state["quantization"] = report
    logger.info("quantize: %s, %s", mode, report.method)
    left = len(linears) - len(done) - len(refused)
    if left:
        ctx.notes.append(f"quantize: {left} Linear layer(s) left unquantized by torchao "
                         "(shapes its kernels do not take)")
    if refused:
        ctx.notes.append(f"quantize: {len(refused)} Linear layer(s) kept in float, torchao "
                         f"failed on them: {shortened(refused, 3, '; ')}")
    if computed:
        ctx.notes.append(f"quantize: {len(computed)} Linear layer(s) kept in float, their "
                         "weight computed at each call (pruning, weight_norm or a "
                         f"parametrization): {shortened(computed, 3)}")
    if untied := [n for n in untied if n in done]:
        ctx.notes.append(f"quantize: {', '.join(untied)} shared its weight with an "
                         "embedding: the Linear now holds a quantized copy, the embedding "
                         "keeps the float weight")
    return model


# Order 64: after autocast (60) and low_precision_weights (62), before kernel_substitution
# (70) and compile (80). After low_precision_weights because that pass would cast a
# quantized weight back to a float dtype; before compile, which traces the quantized
# Linears (int8 matmuls, aten._int_mm, with the scales fused around them).
# Measured on this 2-core EPYC (avx512_vnni, avx512_bf16, no AMX), Llama of hf_models
# (hidden 256, 2 layers, vocabulary 8192), batch 4 x 128, round-robin in one process on
# a machine loaded by other jobs (load 9, so every time is ~10x a quiet run's; the
# ratios are what the comparison rests on), torch 2.13, torchao 0.18:
#   eager float32 1.00x; torch.compile float32 1.17x (first call 45 s);
#   quantize_ + compile with freezing (torchao's recipe) 1.15x: inductor's own int8
#   pattern misses torchao's u8s8 form, its matmuls stay unfused;
#   the same with torchao's patterns registered: float32 activations 2.25x (first call
#   36 s), bfloat16 activations 2.04x (48 s); with max_autotune (CPP int8 GEMM
#   template, picked for every qlinear) 2.23x but a 93 s first call (2x compile's):
#   not used; PT2E X86InductorQuantizer, dynamic: 2.07x, cosine 0.99907 against
#   0.99968, and the model becomes an exported GraphModule (no generate, no cache: HF's
#   DynamicCache output cannot be exported): quantize_ it is.
# Measured again on a quiet machine (load 0.7-1.0, 2026-11-24), O3 with freezing and
# without weight prepacking (cpp.weight_prepack off since the compile cache work), eager
# and O3 int8 round-robin in one process per variant: without torchao's weight-pack
# pattern, Llama 2.78x eager, BERT 2.09x, ViT 1.90x, GPT-2 1.79x, ResNet-18-like 1.41x;
# with it registered 2.70x, 1.96x, 1.69x, 1.75x, 1.40x. So the pattern is not
# registered: the _int_mm graphs are as fast or faster, and they are cacheable (a second
# process hit inductor's FX graph cache, 10.9 s against 32.5 s), where the pattern's
# prepacked int8 weights (mkldnn tensors) are not picklable.
# Float32 activations beat bfloat16 here for models whose work is in their Linears, so
# with int8 on a CPU without AMX the autocast pass skips itself for those
# (int8_float32_reason; low_precision_weights follows). The weight-pack pattern measured
# again on the AMX Xeon (2026-11-27, float32 activations, ad hoc): Llama 6.99 ms with it
# against 6.58 without, BERT 9.40 against 9.32, ViT 5.28 against 5.21; still not used.
QUANTIZE_ORDER = 64


def _quantize_pass() -> OptimizationPass:
    gate = AccuracyGate()
    return OptimizationPass(
        QUANTIZE_PASS, "Linear layers quantized through torchao (the mode and the accuracy "
        "figures: the report's quantization)", OptimizationLevel.O0,
        functools.partial(_quantize, gate=gate), _check, mode="inference",
        order=QUANTIZE_ORDER, output_check=gate)


def quantize_passes() -> list[OptimizationPass]:
    """The quantize pass, with its own gate (one per run: the gate holds the run's
    figures)."""
    return [_quantize_pass()]
