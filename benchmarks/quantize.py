"""prepare_model(quantize="int8") on the small Llama of torchbridge.hf_models (hidden 256,
2 layers, vocabulary 8192, batch 4 x 128 tokens, random weights) against eager float32,
and the recipes it was weighed against. Timed round-robin in one process (each round calls
every variant once), medians; CPU only.

    python benchmarks/quantize.py [--rounds 20] [--variants eager o3 o3_int8 torchao pt2e]

Variants: eager (float32, the baseline); o3 (prepare_model O3); o3_int8 (O3 with
quantize="int8"); o3_int8_fp32 (the same without autocast: int8 matmuls, float32 for
the rest); torchao (the plain torchao recipe: quantize_ with
Int8DynamicActivationInt8WeightConfig, then torch.compile with inductor freezing);
pt2e (torchao's PT2E flow: torch.export, X86InductorQuantizer with dynamic activations,
convert_pt2e, torch.compile with freezing; the model becomes an exported GraphModule).
Put pt2e last: importing X86InductorQuantizer sets inductor's pre_grad_custom_pass for the
whole process, which variants compiled after it would be compiled with.
"""

from __future__ import annotations

import argparse
import copy
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torchbridge
from torch import nn
from torchbridge.config import TorchBridgeConfig
from torchbridge.hf_models import BATCHES, hf_reference_models
from torchbridge.optimize.measure import interleaved_latency
from torchbridge.optimize.quantize_gate import accuracy


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _torchao_recipe(model: nn.Module, call: Callable[[nn.Module], Any]) -> nn.Module:
    import torch._inductor.config as inductor_config
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    inductor_config.freezing = True
    compiled: nn.Module = torch.compile(model)  # type: ignore[assignment]
    call(compiled)
    return compiled


class _Exported(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs: Any) -> Any:
        return self.module(**kwargs, use_cache=False)


def _pt2e_recipe(model: nn.Module, sample: dict[str, Any]) -> nn.Module:
    import torch._inductor.config as inductor_config
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config(is_dynamic=True))
    # The cache (DynamicCache) is no pytree torch.export knows: exported without it.
    exported = torch.export.export(model, (), dict(sample, use_cache=False), strict=False)
    prepared = prepare_pt2e(exported.module(), quantizer)  # type: ignore[arg-type]
    prepared(**sample, use_cache=False)
    converted = convert_pt2e(prepared)
    inductor_config.freezing = True
    compiled: nn.Module = torch.compile(_Exported(converted))  # type: ignore[assignment]
    with torch.no_grad():
        compiled(**sample)
    return compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=["eager", "o3", "o3_int8", "torchao"])
    args = parser.parse_args()

    reference = next(r for r in hf_reference_models() if r.name.startswith("llama"))
    model = reference.build().eval()
    sample = reference.make_input(BATCHES["llama"][0])

    def call(m: nn.Module) -> Any:
        with torch.inference_mode():
            return _logits(m(**sample))

    backend = torchbridge.get_backend("cpu")
    variants: dict[str, nn.Module] = {}
    prepare_seconds: dict[str, float] = {}
    expected = call(model)
    for name in args.variants:
        started = time.perf_counter()
        if name == "eager":
            variants[name] = model
        elif name in ("o3", "o3_int8", "o3_int8_fp32"):
            runner = backend if name != "o3_int8_fp32" else torchbridge.get_backend(
                "cpu", config=TorchBridgeConfig(optimization={"disabled_passes": ["autocast"]}))
            result = runner.optimize(copy.deepcopy(model), "O3", sample_input=sample,
                                     quantize=None if name == "o3" else "int8")
            print(result.summary())
            variants[name] = result.model
        elif name == "torchao":
            variants[name] = _torchao_recipe(copy.deepcopy(model), call)
        elif name == "pt2e":
            variants[name] = _pt2e_recipe(copy.deepcopy(model), sample)
        else:
            parser.error(f"unknown variant {name!r}")
        prepare_seconds[name] = time.perf_counter() - started

    medians = interleaved_latency([functools.partial(call, m) for m in variants.values()],
                                  lambda: None, warmup=1, repeats=args.rounds, min_seconds=0)
    seconds = dict(zip(variants, medians, strict=True))
    base = seconds.get("eager")
    print(f"\n{torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, m in variants.items():
        median = seconds[name]
        cosine, agreement = accuracy(expected, call(m))
        speed = f"{base / median:5.2f}x" if base else "      "
        print(f"{name:10} {median * 1e3:8.2f} ms {speed}  prepare {prepare_seconds[name]:6.1f} s"
              f"  cosine {cosine:.5f}  argmax agreement {agreement or 0:.1%}")


if __name__ == "__main__":
    main()
