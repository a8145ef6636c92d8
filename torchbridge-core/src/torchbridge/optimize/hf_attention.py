"""The module pattern for Hugging Face transformers attention modules (LlamaAttention,
MistralAttention, Qwen2Attention, GPT2Attention, BertSelfAttention, ViTSelfAttention, ...).

Such a module computes its projections, rotary embeddings and KV cache update itself and
then calls the attention function it looks up at call time:
`ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_fn)`. A
substituted module runs its own forward, code object unchanged, bound to a copy of its
module's globals in which `ALL_ATTENTION_FUNCTIONS` routes the "sdpa" function and the
model's own eager function (the default the forward passes) to the chosen implementation
of `torchbridge::scaled_dot_product_attention`. Transformers' registry, the model's config
and every module not substituted are left as they are; transformers is never imported
here: modules are recognised by structure (a `config._attn_implementation` of "sdpa" or
"eager" and a forward that reads `ALL_ATTENTION_FUNCTIONS`).

A call the op does not compute (dropout in training, attention weights asked for, a
softcap, a position bias, a paged cache, attention sinks, any keyword this module does not
know to be harmless) runs the function transformers would have run.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchbridge.optimize.kernel_patterns import LARGER_ROWS, ModulePattern, module_device

_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
_ROUTE = "_torchbridge_attention_route"  # per-call kernel for the checks, on the module
ROUTED = ("sdpa", "eager")
# Keywords transformers passes down to attention functions that change nothing they
# compute. The mask already carries the causal pattern and any sliding window, so
# `sliding_window` is harmless where the function does not name it as a parameter
# (transformers' sdpa function never does; a model's eager function may).
_HARMLESS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions",
                       "past_key_values", "past_key_value", "dropout", "scaling",
                       "is_causal"})
_WINDOW = frozenset({"sliding_window"})
# Named first in a misfit, as they are what most often changes the math.
_MATH = ("softcap", "position_bias", "cache", "s_aux", "sinks")


@dataclass
class _Route:
    """A kernel for the calls of one forward run outside a substituted module (the gate's
    runs), and why calls went to the fallback."""

    kernel: Callable[..., Any]
    calls: int = 0
    fallbacks: list[str] = field(default_factory=list)


def _weights_recorded(collector: Any) -> bool:
    """Whether transformers' output capturing (`capture_outputs`, hooks that keep each
    attention module's weights) is collecting attention weights in this call."""
    if collector is None:
        return False
    # Under compile transformers keeps the collection in a plain attribute.
    active = getattr(collector, "global_var", None) if torch.compiler.is_compiling() \
        else collector.get()
    return isinstance(active, dict) and any(str(k).endswith("attentions") for k in active)


def _contract_misfit(harmless: frozenset[str], collector: Any, module: nn.Module,
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why this attention call is not softmax(q k^T * scale + mask) v as the op computes it."""
    if args:
        return "positional arguments after the mask"
    dropout = kwargs.get("dropout", 0.0)
    if dropout:
        return f"attention dropout {dropout} in training: the op has none"
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)) or \
            _weights_recorded(collector):
        return "attention weights asked for (output_attentions): the op returns none"
    for name in _MATH:
        if kwargs.get(name) is not None:
            return f"called with {name}=: the op does not compute it"
    for name, value in kwargs.items():
        if name not in harmless and value is not None and value is not False:
            return f"called with {name}=: the op does not take it"
    scaling = kwargs.get("scaling")
    if scaling is not None and not isinstance(scaling, (int, float)):
        return "a scaling that is not a number"
    return None


def _routed_attention(fallback: Callable[..., Any], implementation: str,
                      harmless: frozenset[str], collector: Any, module: nn.Module,
                      query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    """An attention function with transformers' contract (outputs (B, S, H, D), weights)
    computing through the op where the call fits, else through `fallback`."""
    route: _Route | None = getattr(module, _ROUTE, None)
    substitution = getattr(module, "_torchbridge_substitution", None)
    kernel = route.kernel if route is not None else \
        substitution.kernel if substitution is not None else None
    reason = _contract_misfit(harmless, collector, module, args, kwargs)
    if kernel is None or reason is not None:
        if route is not None and reason is not None:
            route.fallbacks.append(reason)
        return fallback(module, query, key, value, attention_mask, *args, **kwargs)
    if route is not None:
        route.calls += 1
    q_len, k_len = query.shape[2], key.shape[2]
    is_causal = False
    if implementation == "sdpa":  # as transformers' sdpa_attention_forward decides it
        wanted = kwargs.get("is_causal")
        wanted = wanted if wanted is not None else getattr(module, "is_causal", True)
        is_causal = q_len > 1 and attention_mask is None and bool(wanted)
        if is_causal and k_len > q_len:  # causal from the top left: later keys unseen
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # As autocast calls torch's attention: q, k and v in its dtype. They may come
        # apart (rotary embeddings in float32 make q and k float32, v stays the
        # projection's bfloat16); the op has no autocast rule of its own.
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    # An eager function applies no causality of its own: the mask carries it.
    scaling = kwargs.get("scaling")
    out = kernel(query, key, value, attention_mask, is_causal,
                 None if scaling is None else float(scaling), query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


class _RoutedInterface:
    """Stands for transformers' ALL_ATTENTION_FUNCTIONS in a substituted forward's globals:
    "sdpa" (when it is transformers' own) and "eager" (the forward's default) come back
    routed through the op; everything else is the registry's answer."""

    def __init__(self, registry: Any, eager: Any) -> None:
        self.registry = registry
        self.collector = getattr(sys.modules.get("transformers.utils.output_capturing"),
                                 "_active_collector", None)
        self.sdpa = getattr(sys.modules.get("transformers.integrations.sdpa_attention"),
                            "sdpa_attention_forward", None)
        # The module's eager function, whose parameters say which keywords it reads.
        self.eager = eager
        self.eager_harmless = _HARMLESS
        if callable(eager) and not _WINDOW & set(inspect.signature(eager).parameters):
            self.eager_harmless = _HARMLESS | _WINDOW

    def _route(self, name: str, found: Callable[..., Any], default: Any) -> Any:
        if name == "sdpa" and found is self.sdpa:
            return functools.partial(_routed_attention, found, name, _HARMLESS | _WINDOW,
                                     self.collector)
        if name == "eager" and found is default:
            harmless = self.eager_harmless if found is self.eager else _HARMLESS
            return functools.partial(_routed_attention, found, name, harmless,
                                     self.collector)
        return found

    def get_interface(self, attn_implementation: str, default: Callable[..., Any]) -> Any:
        found = self.registry.get_interface(attn_implementation, default)
        return self._route(attn_implementation, found, default)

    def __getitem__(self, name: str) -> Any:
        return self._route(name, self.registry[name], None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.registry, name)

    def __contains__(self, name: object) -> bool:
        return name in self.registry


_ROUTED_FORWARDS: dict[Callable[..., Any], Callable[..., Any]] = {}


def _routed_forward(forward: types.FunctionType) -> Callable[..., Any]:
    """`forward`'s code over a copy of its globals whose ALL_ATTENTION_FUNCTIONS routes."""
    routed = _ROUTED_FORWARDS.get(forward)
    if routed is None:
        namespace = dict(forward.__globals__)
        # Without a module name dynamo reads these globals from this dict, by id, not
        # from the module the name would import (whose ALL_ATTENTION_FUNCTIONS is
        # transformers' own).
        namespace.pop("__name__", None)
        namespace[_INTERFACE] = _RoutedInterface(
            forward.__globals__[_INTERFACE], forward.__globals__.get("eager_attention_forward"))
        routed = types.FunctionType(forward.__code__, namespace, forward.__name__,
                                    forward.__defaults__, forward.__closure__)
        routed.__kwdefaults__ = forward.__kwdefaults__
        functools.update_wrapper(routed, forward, updated=())
        _ROUTED_FORWARDS[forward] = routed
    return routed


def _match(module: nn.Module) -> dict[str, Any] | None:
    config = module.__dict__.get("config")
    if getattr(config, "_attn_implementation", None) not in ROUTED:
        return None
    forward = type(module).forward
    if not isinstance(forward, types.FunctionType) or \
            _INTERFACE not in forward.__code__.co_names or \
            not callable(getattr(forward.__globals__.get(_INTERFACE), "get_interface", None)):
        return None
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int):
        return None
    return {"forward": _routed_forward(forward), "hidden": hidden,
            "parameters": _call_parameters(forward)}


def _call_parameters(forward: types.FunctionType) -> list[tuple[str, Any]] | None:
    """The positional parameters (name, default) a synthetic call fills, after the hidden
    states: up to the last one that has no default or takes the rotary embeddings. None
    when one of them is required and not one a synthetic call can give."""
    parameters = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][2:]  # self, hidden
    needed = [i for i, p in enumerate(parameters)
              if p.default is inspect.Parameter.empty or p.name == "position_embeddings"]
    chosen = parameters[:needed[-1] + 1] if needed else []
    if any(p.default is inspect.Parameter.empty and
           p.name not in ("attention_mask", "position_embeddings") for p in chosen):
        return None
    return [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in chosen]


def _forward(module: nn.Module, kernel: Callable[..., Any], facts: dict[str, Any],
             *args: Any, **kwargs: Any) -> Any:
    substitution = getattr(module, "_torchbridge_substitution", None)
    if substitution is not None and substitution.kernel is kernel:
        return facts["forward"](module, *args, **kwargs)  # reads the kernel off the module
    return _run_routed(module, _Route(kernel), facts, args, kwargs)


def _run_routed(module: nn.Module, route: _Route, facts: dict[str, Any],
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward with `route`'s kernel: the gate's runs, never compiled code."""
    outer = module.__dict__.get(_ROUTE)
    module.__dict__[_ROUTE] = route
    try:
        return facts["forward"](module, *args, **kwargs)
    finally:
        if outer is None:
            del module.__dict__[_ROUTE]
        else:
            module.__dict__[_ROUTE] = outer


def _misfit(module: nn.Module, facts: dict[str, Any], *args: Any, **kwargs: Any
            ) -> str | None:
    """Runs the captured call once with the op's reference and reports whether its
    attention call reached the op."""
    from torchbridge.kernels.ops import scaled_dot_product_attention

    route = _Route(scaled_dot_product_attention)
    with torch.no_grad():
        _run_routed(module, route, facts, args, kwargs)
    if route.fallbacks:
        return route.fallbacks[0]
    if not route.calls:
        implementation = getattr(module.__dict__.get("config"), "_attn_implementation", None)
        return (f"its forward did not call the {implementation!r} attention function (a "
                "code path of its own)")
    return None


def _is_cache(value: Any) -> bool:
    return callable(getattr(value, "update", None)) and \
        callable(getattr(value, "get_seq_length", None))


def _replay(module: nn.Module, facts: dict[str, Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # A KV cache grows on every replay; the sample run prefills an empty one, so the
    # call without it attends to the same keys.
    return (tuple(None if _is_cache(a) else a for a in args),
            {k: None if _is_cache(v) else v for k, v in kwargs.items()})


def _example_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype,
                   batch: int = 2, length: int = 8) -> tuple[Any, ...]:
    """Hidden states (batch 2, sequence 8, hidden), no mask, rotary cos/sin where the
    forward takes position embeddings, defaults between them."""
    device = module_device(module)
    hidden = torch.randn(batch, length, facts["hidden"], dtype=dtype, device=device)
    if facts["parameters"] is None:
        raise TypeError(f"{type(module).__name__}.forward needs arguments a synthetic "
                        "call cannot give")
    args: list[Any] = [hidden]
    for name, default in facts["parameters"]:
        args.append(_rotary(module, facts, dtype, device, batch, length)
                    if name == "position_embeddings" else default)
    return tuple(args)


def _larger_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype
                  ) -> tuple[Any, ...]:
    """The gate's second probe: one sequence of LARGER_ROWS tokens."""
    return _example_input(module, facts, dtype, 1, LARGER_ROWS)


def _rotary(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype,
            device: torch.device, batch: int = 2, length: int = 8
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (batch, length, rotary width) of Hugging Face's rotate_half
    convention."""
    config = module.__dict__.get("config")
    width = getattr(module, "rotary_ndims", None) or getattr(module, "head_dim", None) or \
        facts["hidden"] // int(getattr(config, "num_attention_heads", 1))
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * \
        torch.logspace(0, -4, width // 2 or 1, base=math.e, device=device)
    angles = torch.cat((angles, angles), dim=-1)[None].expand(batch, -1, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _attention_output(output: Any) -> Any:
    """The attention output without the weights (which eager returns unasked)."""
    return output[0] if isinstance(output, tuple) else output


HF_ATTENTION = ModulePattern(
    "hf_attention", "scaled_dot_product_attention", _match, _forward, _example_input,
    "Hugging Face transformers attention modules whose config uses 'sdpa' or 'eager' "
    "(calls outside the op's contract run transformers' own function)", _misfit,
    _replay, _attention_output, _larger_input)
