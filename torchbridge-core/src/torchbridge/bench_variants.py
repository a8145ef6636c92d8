"""What the benchmark runs, shared by the benchmark (torchbridge.bench) and its
first-call processes (torchbridge.bench_firstcall): the models of each suite, built the
same in every process, and the variants' names."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from torchbridge.models import reference_models

BATCHES = {"mlp": (32, 256), "convnet": (8, 64), "encoder": (8, 32), "decoder_lm": (4, 16)}
QUANTIZED_MODES = ("int8", "int8_weight_only", "int4_weight_only", "float8")


def parse_variant(variant: str) -> tuple[str, bool, str | None]:
    """(level, with a sample input, quantize mode) of a TorchBridge variant: "O3",
    "O3 no sample", "O3 int8". An unknown level is a ConfigurationError naming the levels;
    an unknown suffix a ValueError."""
    from torchbridge.levels import OptimizationLevel

    level_name, _, rest = variant.partition(" ")
    level = OptimizationLevel.parse(level_name).value
    if not rest:
        return level, True, None
    if rest == "no sample":
        return level, False, None
    if rest in QUANTIZED_MODES:
        return level, True, rest
    raise ValueError(f"variant {variant!r}: after the level, expected 'no sample' or a "
                     f"quantize mode ({', '.join(QUANTIZED_MODES)})")


def references(suite: str, scale: float) -> tuple[list[Any], Mapping[str, tuple[int, ...]]]:
    if suite == "hf":
        from torchbridge import hf_models

        return hf_models.hf_reference_models(scale), hf_models.BATCHES
    if suite != "reference":
        raise ValueError(f"suite {suite!r}: expected 'reference' or 'hf'")
    return reference_models(scale), BATCHES


def build(suite: str, name: str, batch: int, scale: float) -> tuple[torch.nn.Module, Any]:
    """Model `name` of `suite` and its input at `batch`: the same weights and input in
    every process (seeded), so that a second process prepares the very same model."""
    refs, _ = references(suite, scale)
    ref = next(r for r in refs if r.name == name)
    torch.manual_seed(0)
    return ref.build().eval(), ref.make_input(batch)


def quantize_argument(mode: str | None) -> Any:
    """prepare_model's quantize argument for a variant: its mode, else False (no
    quantization, whatever config optimization.quantize says: "O3" rows are unquantized)."""
    return mode if mode is not None else False


def placed(backend: Any, model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` on the backend's device, for the baselines (eager, plain
    torch.compile, eager generate()): they run where prepare_model puts the model and where
    the benchmark moves the input. (Left on the host, every baseline on a GPU failed at its
    first op: input on cuda:0, weights on the CPU; seen on an H100, 2026-11-27.) A copy,
    since Module.to moves in place and the benchmark's process goes on using the model on
    the host; a fresh process (bench_firstcall) copies too, so that its first call of
    plain compile is measured as the benchmark's own is."""
    moved: torch.nn.Module = backend.to_device(copy.deepcopy(model))
    return moved
