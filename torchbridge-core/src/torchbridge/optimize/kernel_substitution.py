"""The kernel substitution pass: modules that compute an op run the chosen implementation.

A `ModulePattern` recognises a module by structure (an RMSNorm: one weight and an epsilon;
a SwiGLU MLP: gate, up and down projections and an activation) and says how its forward
calls the op. For each module that matches:

1. The module's real inputs are captured from one run of the sample input (no sample: a
   synthetic input of its width in the dtype it will see).
2. The pattern's forward with the op's reference must reproduce the module's own output
   within the dtype's tolerance; otherwise the module is not what the pattern thinks
   (LayerNorm without bias, Gemma's (1 + weight) RMSNorm) and stays as it is.
3. Each eligible implementation, in preference order, is run on the same inputs and must
   match the reference within the tolerance (and its gradients, when the model trains);
   with `measure=True` it must not be slower than the module. The first that passes is
   used; a mismatch is reported with its figure and the next one is tried.
4. The module's class becomes a subclass of its own whose forward calls the
   implementation: the module object, its parameters (tied ones stay tied), state_dict
   keys, attributes and hooks are kept; isinstance still holds.

With no eligible implementation a module is left alone: the model's own code is the
reference, and torch.compile can fuse it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchbridge.kernels.choice import Candidate, choose
from torchbridge.kernels.implementations import TOLERANCES, BoundKernel, bind
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.plugins import get_plugin_host

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModulePattern:
    """A kind of module the substitution pass can make call op `op`.

    match(module) -> facts | None: the facts the forward needs (e.g. the epsilon), None
        when the module is not of this kind. Structure only; the numbers are checked after.
    forward(module, kernel, facts, *args, **kwargs): the module's forward calling
        `kernel(...)` with the op's arguments.
    example_input(module, facts, dtype) -> args: a small synthetic input of the module's
        width, for models prepared without a sample input.
    misfit(module, facts, *args) -> reason | None: why a call (the captured one) would not
        reach the op (the forward then runs the module's own code); such a module is kept.
    """

    name: str
    op: str
    match: Callable[[nn.Module], dict[str, Any] | None]
    forward: Callable[..., Any]
    example_input: Callable[[nn.Module, dict[str, Any], torch.dtype], tuple[Any, ...]]
    description: str = ""
    misfit: Callable[..., str | None] | None = None


# --- rms_norm --------------------------------------------------------------------------

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _rms_norm_match(module: nn.Module) -> dict[str, Any] | None:
    if next(module.children(), None) is not None or list(module.buffers(recurse=False)):
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight"}:
        return None
    weight = params.get("weight")
    eps_name = next((n for n in _EPS_NAMES if n in vars(module)), None)
    if eps_name is None:
        return None
    eps = getattr(module, eps_name)
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
        return None
    if weight is not None:
        if weight.dim() != 1:
            return None
        hidden = weight.shape[0]
    else:
        shape = getattr(module, "normalized_shape", None)
        if not isinstance(shape, (tuple, list)) or len(shape) != 1:
            return None
        hidden = int(shape[0])
    return {"eps": eps, "hidden": hidden, "promotes": _promotes(module, weight, hidden)}


def _promotes(module: nn.Module, weight: torch.Tensor | None, hidden: int) -> bool:
    """Whether the module returns promote(input, weight) dtype (Hugging Face multiplies by
    the weight after casting back) rather than the input's dtype, from one tiny run."""
    if weight is None or not weight.is_floating_point():
        return False
    other = torch.bfloat16 if weight.dtype == torch.float32 else torch.float32
    try:
        with torch.no_grad():
            out = module(torch.ones(1, hidden, dtype=other, device=weight.device))
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.dtype != other


def _rms_norm_forward(module: nn.Module, kernel: Callable[..., Any], facts: dict[str, Any],
                      x: torch.Tensor) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    eps = facts["eps"] if facts["eps"] is not None else torch.finfo(x.dtype).eps
    out: torch.Tensor = kernel(x, weight, float(eps))
    if facts["promotes"] and weight is not None and weight.dtype != x.dtype:
        out = out.to(torch.promote_types(x.dtype, weight.dtype))
    return out


def _rms_norm_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype
                    ) -> tuple[Any, ...]:
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return (torch.randn(2, 8, facts["hidden"], dtype=dtype, device=device),)


RMS_NORM = ModulePattern("rms_norm", "rms_norm", _rms_norm_match, _rms_norm_forward,
                         _rms_norm_input, "nn.RMSNorm and Hugging Face-style RMSNorm "
                         "(a weight and an epsilon)")


# --- SwiGLU MLP --------------------------------------------------------------------------

_SWIGLU_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"),
                 ("gate", "up", "down"))
_ACTIVATION_NAMES = ("act_fn", "act", "activation", "activation_fn")


def _swiglu_match(module: nn.Module) -> dict[str, Any] | None:
    children = dict(module.named_children())
    for gate, up, down in _SWIGLU_NAMES:
        linears = [children.get(n) for n in (gate, up, down)]
        if not all(isinstance(m, nn.Linear) for m in linears):
            continue
        g, u, d = linears
        assert isinstance(g, nn.Linear) and isinstance(u, nn.Linear) and isinstance(d, nn.Linear)
        if g.in_features != u.in_features or g.out_features != u.out_features or \
                d.in_features != g.out_features:
            continue
        activation = next((getattr(module, n) for n in _ACTIVATION_NAMES
                           if callable(getattr(module, n, None))), None)
        others = set(children) - {gate, up, down} - set(_ACTIVATION_NAMES)
        if activation is None or others or list(module.parameters(recurse=False)):
            continue
        return {"gate": gate, "up": up, "down": down, "hidden": g.in_features}
    return None


def _swiglu_forward(module: nn.Module, kernel: Callable[..., Any], facts: dict[str, Any],
                    x: torch.Tensor) -> torch.Tensor:
    gate = getattr(module, facts["gate"])(x)
    up = getattr(module, facts["up"])(x)
    out: torch.Tensor = getattr(module, facts["down"])(kernel(gate, up))
    return out


SWIGLU = ModulePattern("swiglu_mlp", "silu_mul", _swiglu_match, _swiglu_forward,
                       _rms_norm_input, "MLPs computing down(silu(gate(x)) * up(x)) "
                       "(gate_proj/up_proj/down_proj, w1/w3/w2)")

# --- attention: nn.MultiheadAttention -----------------------------------------------------

def _mha_match(module: nn.Module) -> dict[str, Any] | None:
    if not isinstance(module, nn.MultiheadAttention) or not module._qkv_same_embed_dim or \
            module.bias_k is not None or module.add_zero_attn:
        return None
    return {"hidden": module.embed_dim}


def _as_sdpa_mask(attn_mask: torch.Tensor | None, batch: int, heads: int, q_len: int,
                  k_len: int) -> torch.Tensor | None:
    """MultiheadAttention's mask ((L, S) or (B*H, L, S); bool True = may NOT attend, float
    added) as SDPA's (bool True = may attend, float added), broadcast to (B, H, L, S)."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 3:
        attn_mask = attn_mask.view(batch, heads, q_len, k_len)
    return ~attn_mask if attn_mask.dtype == torch.bool else attn_mask


def _mha_misfit(module: nn.Module, facts: dict[str, Any], query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> str | None:
    if need_weights:
        return "called with need_weights=True: the op returns no attention weights"
    if key_padding_mask is not None:
        return "called with a key_padding_mask"
    if module.training and float(getattr(module, "dropout", 0.0) or 0.0):
        return "attention dropout in training: the op has none"
    if is_causal and attn_mask is None:
        return "is_causal without a mask (MultiheadAttention refuses that)"
    if query.dim() != 3:
        return "unbatched input"
    return None


def _mha_forward(module: nn.Module, kernel: Callable[..., Any], facts: dict[str, Any],
                 query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                 attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                 is_causal: bool = False) -> Any:
    """The op where its contract fits (see _mha_misfit); otherwise MultiheadAttention's own."""
    assert isinstance(module, nn.MultiheadAttention)
    if _mha_misfit(module, facts, query, key, value, key_padding_mask, need_weights,
                   attn_mask, average_attn_weights, is_causal) is not None:
        return nn.MultiheadAttention.forward(module, query, key, value, key_padding_mask,
                                             need_weights, attn_mask, average_attn_weights,
                                             is_causal)
    if not module.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    batch, q_len, embed = query.shape
    k_len, heads = key.shape[1], module.num_heads
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q = b_k = b_v = None
    if module.in_proj_bias is not None:
        b_q, b_k, b_v = module.in_proj_bias.chunk(3)

    def split(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, length: int
              ) -> torch.Tensor:
        return F.linear(x, w, b).view(batch, length, heads, embed // heads).transpose(1, 2)

    out = kernel(split(query, w_q, b_q, q_len), split(key, w_k, b_k, k_len),
                 split(value, w_v, b_v, k_len),
                 _as_sdpa_mask(attn_mask, batch, heads, q_len, k_len), False, None, False)
    out = module.out_proj(out.transpose(1, 2).reshape(batch, q_len, embed))
    return (out if module.batch_first else out.transpose(0, 1)), None


def _mha_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype
               ) -> tuple[Any, ...]:
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    x = torch.randn(2, 8, facts["hidden"], dtype=dtype, device=device)
    if not getattr(module, "batch_first", False):
        x = x.transpose(0, 1)
    return (x, x, x, None, False)  # need_weights=False: what a transformer layer passes


MULTIHEAD_ATTENTION = ModulePattern(
    "multihead_attention", "scaled_dot_product_attention", _mha_match, _mha_forward,
    _mha_input, "nn.MultiheadAttention called without asking for attention weights (as "
    "nn.TransformerEncoderLayer and DecoderLayer call it)", _mha_misfit)

BUILTIN_PATTERNS = (RMS_NORM, SWIGLU, MULTIHEAD_ATTENTION)


# --- the substituted module ------------------------------------------------------------

@dataclass
class Substitution:
    pattern: ModulePattern
    kernel: BoundKernel
    facts: dict[str, Any]


_SUBCLASSES: dict[type, type] = {}


def _substituted_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    sub: Substitution = self._torchbridge_substitution  # type: ignore[assignment]
    return sub.pattern.forward(self, sub.kernel, sub.facts, *args, **kwargs)


def substituted_class(cls: type) -> type:
    """A subclass of `cls` whose forward calls the substitution's kernel; same name, so
    code that matches module classes by name (Hugging Face's no-split lists) still does."""
    if getattr(cls, "_torchbridge_substituted", False):
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "forward": _substituted_forward, "_torchbridge_substituted": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__qualname__} running a TorchBridge kernel (see "
                       "module._torchbridge_substitution)."})
        _SUBCLASSES[cls] = sub
    return sub


def substitute(module: nn.Module, pattern: ModulePattern, kernel: BoundKernel,
               facts: dict[str, Any]) -> None:
    module.__class__ = substituted_class(type(module))
    module._torchbridge_substitution = Substitution(pattern, kernel, facts)  # type: ignore[assignment]


# --- checking numbers --------------------------------------------------------------------

def relative_error(candidate: Any, reference: Any) -> float:
    """max |candidate - reference| / max |reference| over every tensor output; inf when the
    structure, shapes or dtypes differ."""
    cands, refs = torch.utils._pytree.tree_leaves(candidate), torch.utils._pytree.tree_leaves(
        reference)
    if len(cands) != len(refs):
        return float("inf")
    worst = 0.0
    for c, r in zip(cands, refs, strict=True):
        if not isinstance(r, torch.Tensor):
            continue
        if not isinstance(c, torch.Tensor) or c.shape != r.shape or c.dtype != r.dtype:
            return float("inf")
        if not r.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(c, r) else float("inf"))
            continue
        scale = r.detach().abs().max().float().item() or 1.0
        diff = (c.detach().float() - r.detach().float()).abs().max().item()
        worst = max(worst, diff / scale if diff == diff else float("inf"))
    return worst


def _tolerance(dtype: torch.dtype, ctx: PassContext) -> float:
    """The dtype's tolerance, or the autocast dtype's when the model computes in it."""
    tol = TOLERANCES.get(dtype, 1e-4)
    autocast: torch.dtype | None = ctx.state.get("autocast_dtype")
    return max(tol, TOLERANCES.get(autocast, tol)) if autocast is not None else tol


def _gradients(run: Callable[..., Any], args: tuple[Any, ...], module: nn.Module,
               grad_seed: int) -> list[torch.Tensor | None]:
    inputs = [a.detach().clone().requires_grad_(True)
              if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    out = run(*inputs)
    outs = [o for o in torch.utils._pytree.tree_leaves(out)
            if isinstance(o, torch.Tensor) and o.requires_grad]
    generator = torch.Generator(device="cpu").manual_seed(grad_seed)
    grads_out = [torch.randn(o.shape, generator=generator).to(o) for o in outs]
    wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad] + \
        [p for p in module.parameters() if p.requires_grad]
    return list(torch.autograd.grad(outs, wrt, grads_out, allow_unused=True))


def _seconds(run: Callable[[], Any], repeats: int = 20) -> float:
    run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats


@dataclass
class _Verdict:
    ok: bool
    detail: str


@dataclass
class _Gate:
    """Checks candidates on one model's modules; verdicts are shared between modules with
    the same inputs' shapes and dtypes (thirty identical decoder layers are one check)."""

    ctx: PassContext
    measure: bool
    verdicts: dict[tuple[Any, ...], _Verdict] = field(default_factory=dict)

    def _autocast(self) -> Any:
        dtype = self.ctx.state.get("autocast_dtype")
        if dtype is None:
            return torch.autocast(self.ctx.backend.device.type, enabled=False)
        return torch.autocast(self.ctx.backend.device.type, dtype=dtype)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with torch.random.fork_rng(devices=[]), self._autocast():
            torch.manual_seed(0)
            return fn(*args)

    def check(self, module: nn.Module, pattern: ModulePattern, facts: dict[str, Any],
              candidate: Candidate, args: tuple[Any, ...], reference_out: Any) -> _Verdict:
        key = (id(candidate.implementation), pattern.name, self.ctx.training,
               tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a)
                     for a in args))
        known = self.verdicts.get(key)
        if known is None:
            known = self.verdicts[key] = self._check(module, pattern, facts, candidate, args,
                                                     reference_out)
        return known

    def _check(self, module: nn.Module, pattern: ModulePattern, facts: dict[str, Any],
               candidate: Candidate, args: tuple[Any, ...], reference_out: Any) -> _Verdict:
        impl = candidate.implementation
        kernel = bind(impl, candidate.provider, pattern.op)
        reference = bind(None, None, pattern.op)
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)
                      and a.is_floating_point()), torch.float32)
        tol = _tolerance(dtype, self.ctx)
        try:
            with torch.no_grad():
                out = self.run(pattern.forward, module, kernel, facts, *args)
            error = relative_error(out, reference_out)
            if not error <= tol:
                return _Verdict(False, f"differs from the reference by {error:.3g} "
                                       f"(tolerance {tol:g} in {dtype})")
            if self.ctx.training:
                theirs = self.run(_gradients, lambda *a: pattern.forward(
                    module, kernel, facts, *a), args, module, 0)
                ours = self.run(_gradients, lambda *a: pattern.forward(
                    module, reference, facts, *a), args, module, 0)
                error = relative_error(theirs, ours)
                if not error <= tol:
                    return _Verdict(False, f"gradients differ from the reference's by "
                                           f"{error:.3g} (tolerance {tol:g} in {dtype})")
            if self.measure:
                with torch.no_grad():
                    fast = _seconds(lambda: self.run(pattern.forward, module, kernel, facts,
                                                     *args))
                    slow = _seconds(lambda: self.run(module.forward, *args))
                if fast > slow:
                    return _Verdict(False, f"slower than the module's own code ({fast * 1e6:.0f}"
                                           f" us vs {slow * 1e6:.0f} us)")
                return _Verdict(True, f"max rel error {error:.2g}, {slow / fast:.2f}x the "
                                      "module's own code")
        except Exception as exc:
            return _Verdict(False, f"raised {type(exc).__name__}: {exc}")
        return _Verdict(True, f"max rel error {error:.2g}")


# --- the pass ------------------------------------------------------------------------------

def _pattern_problem(result: object) -> str | None:
    if not isinstance(result, (list, tuple)) or not all(
            isinstance(p, ModulePattern) for p in result):
        return f"returned {result!r:.60}, expected a list of ModulePattern"
    return None


def module_patterns(ctx: PassContext) -> list[tuple[str, ModulePattern]]:
    """Plugins' patterns first (tryfirst plugins before vendor plugins), then the core's."""
    host = get_plugin_host()
    found: list[tuple[str, ModulePattern]] = []
    for plugin, patterns in host.call_each("torchbridge_module_patterns",
                                           check=_pattern_problem, backend=ctx.backend):
        found.extend((plugin, p) for p in patterns)
    found.extend(("torchbridge", p) for p in BUILTIN_PATTERNS)
    return found


def _matches(model: nn.Module, ctx: PassContext
             ) -> list[tuple[str, nn.Module, ModulePattern, dict[str, Any]]]:
    patterns = module_patterns(ctx)
    found = []
    for name, module in model.named_modules():
        if getattr(type(module), "_torchbridge_substituted", False):
            continue
        for plugin, pattern in patterns:
            try:
                facts = pattern.match(module)
            except Exception as exc:
                get_plugin_host().record_hook_error(plugin, "torchbridge_module_patterns",
                                                    f"pattern {pattern.name}: {exc}")
                continue
            if facts is not None:
                found.append((name or "(model)", module, pattern, facts))
                break
    return found


def _capture_inputs(model: nn.Module, modules: list[nn.Module], ctx: PassContext,
                    gate: _Gate, ran: set[int]) -> dict[int, tuple[Any, ...]]:
    """Each module's positional inputs from one run of the sample input, in eval mode (no
    running statistic moves), RNG forked; the model's modes are restored after."""
    from torchbridge.optimize.measure import call_args

    captured: dict[int, tuple[Any, ...]] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ran.add(id(module))
        if kwargs:  # keywords become positions where the forward's signature allows
            try:
                bound = inspect.signature(module.forward).bind(*args, **kwargs)
            except TypeError:
                return
            if bound.kwargs:
                return  # keyword-only arguments: checked on synthetic inputs instead
            args = bound.args
        if args:
            captured.setdefault(id(module), tuple(
                a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            gate.run(model, *call_args(ctx.backend, ctx.sample_input))
    except Exception as exc:
        ctx.notes.append(f"kernel_substitution: the sample input did not run ({exc}); "
                         "checked on synthetic inputs")
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes.items():
            m.training = training
    return captured


def _input_dtype(module: nn.Module, ctx: PassContext) -> torch.dtype:
    autocast: torch.dtype | None = ctx.state.get("autocast_dtype")
    if autocast is not None:
        return autocast
    return next((p.dtype for p in module.parameters() if p.is_floating_point()),
                torch.float32)


def _substitute_kernels(model: nn.Module, ctx: PassContext) -> nn.Module:
    matches = _matches(model, ctx)
    gate = _Gate(ctx, measure=bool(ctx.state.get("measure")) and ctx.sample_input is not None)
    ran: set[int] = set()
    captured = _capture_inputs(model, [m for _, m, _, _ in matches], ctx, gate, ran) \
        if ctx.sample_input is not None else {}
    records: list[dict[str, Any]] = ctx.state.setdefault("kernel_substitutions", [])
    info = ctx.device_info
    for name, module, pattern, facts in matches:
        record: dict[str, Any] = {"module": name, "pattern": pattern.name, "op": pattern.op}
        records.append(record)
        if ran and id(module) not in ran:
            record.update(status="kept", detail="not called when the model ran the sample "
                          "input (another code path computes it)")
            continue
        args = captured.get(id(module)) or pattern.example_input(
            module, facts, _input_dtype(module, ctx))
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)
                      and a.is_floating_point()), None)
        misfit = pattern.misfit(module, facts, *args) if pattern.misfit else None
        if misfit is not None:
            record.update(status="kept", detail=f"the op's contract does not fit: {misfit}")
            continue
        with torch.no_grad():
            own = gate.run(module, *args)
            reference_out = gate.run(pattern.forward, module, bind(None, None, pattern.op),
                                     facts, *args)
        error = relative_error(reference_out, own)
        tol = _tolerance(dtype or torch.float32, ctx)
        if not error <= tol:
            record.update(status="kept", detail=f"not a {pattern.name}: its output differs "
                          f"from the {pattern.op} formula by {error:.3g}")
            continue
        choice = choose(pattern.op, ctx.backend, dtype=dtype, training=ctx.training, info=info)
        rejected = choice.reasons()
        for candidate in choice.eligible:
            verdict = gate.check(module, pattern, facts, candidate, args, reference_out)
            label = f"{candidate.implementation.name} (plugin {candidate.provider})"
            if not verdict.ok:
                rejected.append(f"{label}: {verdict.detail}")
                logger.warning("kernel %s refused for %s: %s", label, name, verdict.detail)
                continue
            substitute(module, pattern, choice.bound(candidate), facts)
            record.update(status="substituted", implementation=candidate.implementation.name,
                          plugin=candidate.provider, detail=verdict.detail)
            break
        else:
            record.update(status="kept", detail="the module's own code runs: " + (
                "; ".join(rejected) if rejected else "no implementation for this backend"))
        record["rejected"] = rejected
    return model


def _check(model: nn.Module, ctx: PassContext) -> str | None:
    if not ctx.config.kernel.enabled:
        return "config kernel.enabled is False"
    if not ctx.config.kernel.substitute:
        return "config kernel.substitute is False"
    matched_ops = sorted({pattern.op for _, _, pattern, _ in _matches(model, ctx)})
    if not matched_ops:
        return "no module matches a kernel pattern"
    served = [op for op in matched_ops if choose(op, ctx.backend, training=ctx.training,
                                                 info=ctx.device_info).eligible]
    if not served:
        return (f"no kernel implementation serves {', '.join(matched_ops)} on "
                f"{ctx.backend.name} (see `torchbridge kernels`)")
    return None


def kernel_substitution_pass() -> OptimizationPass:
    from torchbridge.levels import OptimizationLevel

    return OptimizationPass(
        "kernel_substitution", "modules that compute a TorchBridge op call the chosen "
        "implementation, after checking its numbers on the model's shapes",
        OptimizationLevel.O3, _substitute_kernels, _check, order=70)
