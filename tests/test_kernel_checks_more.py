"""The first-use check behind "every kernel is checked before it runs in your model", on
what it missed: modules substituted by prepare_model ran their kernel unchecked on every
input the gate had not probed (another batch size, a mask); a call's signature did not
hold the tensors' layout or device (a kernel reading memory as if contiguous passed on a
contiguous call and ran wrong on a transposed one); an empty batch crashed the caller of a
right kernel; the kind of output was compared leaf by leaf only (a tuple for a tensor, a
tensor on another device); and a `declines` that raised reached the caller."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchbridge
from kernel_declaring import _errors_of, _row
from torch import nn
from torchbridge import KernelImplementation
from torchbridge.kernels import implementations
from torchbridge.optimize.pipeline import run_pipeline
from torchbridge.plugins import plugin_records

RMS_NORM = torchbridge.kernels.reference("rms_norm")
NO_COMPILE = {"disabled_passes": ["compile", "autocast", "low_precision_weights"]}


def _rms_right(x: torch.Tensor, weight: torch.Tensor | None = None,
               eps: float = 1e-6) -> torch.Tensor:
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (out if weight is None else out * weight.float()).to(x.dtype)


def _rms_wrong_at_batch_1(x: torch.Tensor, weight: torch.Tensor | None = None,
                          eps: float = 1e-6) -> torch.Tensor:
    out = _rms_right(x, weight, eps)
    return out * 1.5 if x.shape[0] == 1 else out


def _rms_reading_memory_as_contiguous(x: torch.Tensor, weight: torch.Tensor | None = None,
                                      eps: float = 1e-6) -> torch.Tensor:
    # What a pointer kernel that ignores strides computes: x's storage read row by row.
    flat = torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())
    return _rms_right(flat, weight, eps)


def _rms_mishandling_a_broadcast_weight(x: torch.Tensor, weight: torch.Tensor | None = None,
                                        eps: float = 1e-6) -> torch.Tensor:
    if weight is not None and weight.stride(-1) == 0:  # "assumes a dense weight"
        weight = torch.zeros_like(weight)
    return _rms_right(x, weight, eps)


def _sdpa_ignoring_the_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                            scale: float | None = None, enable_gqa: bool = False
                            ) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def _prepare(model: nn.Module, sample: Any, **options: Any) -> Any:
    config = torchbridge.TorchBridgeConfig(optimization=NO_COMPILE)
    return run_pipeline(torchbridge.get_backend("cpu", config), model, "O3",
                        sample_input=sample, **options)


def _line(result: Any, module: str) -> dict[str, Any]:
    return next(s for s in result.kernel_substitutions if s["module"] == module)


# --- 1. substituted modules: each new call signature is checked, as get_kernel's are --------

class _TwoNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(64, eps=1e-6), nn.RMSNorm(64, eps=1e-6)
        self.proj = nn.Linear(64, 64)
        with torch.no_grad():
            self.norm1.weight.uniform_(0.5, 1.5)
            self.norm2.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(x + self.proj(self.norm1(x)))


def test_a_substituted_kernel_wrong_at_another_batch_size_is_refused_there(
        declare: Any) -> None:
    # Bug: the substituted modules called the kernel unchecked (choice.bound: checked
    # False). The gate checked the sample's batch of 4; at batch 1 the kernel ran wrong
    # (drift 0.8 in the report's scenario) while the report said "max rel error 0".
    declare("kcm_batch", "rms_norm", "rms_wrong_at_1", _rms_wrong_at_batch_1,
            traceable=True, differentiable=True)
    torch.manual_seed(0)
    model = _TwoNorms().eval()
    result = _prepare(model, torch.randn(4, 8, 64))
    assert _line(result, "norm1")["status"] == "substituted", result.kernel_substitutions
    prepared = result.model
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x))
    # Identical modules share one checked kernel: one check per signature, not per layer.
    sub1, sub2 = (m._torchbridge_substitution for m in (prepared.norm1, prepared.norm2))
    assert sub1.kernel is sub2.kernel and sub1.kernel.checked
    assert sub1.kernel.refused is not None and "float32[1, 8, 64]" in sub1.kernel.refused
    # Refused as get_kernel's check refuses: the plugin's error, passed over from now on.
    assert any("rms_wrong_at_1" in e and "differs from the reference" in e
               for e in _errors_of("kcm_batch")), _errors_of("kcm_batch")
    selected, row = _row("rms_norm", "rms_wrong_at_1")
    assert selected != "rms_wrong_at_1 (plugin kcm_batch)" and not row["eligible"]
    # The report read after says what happened, not "substituted".
    for module in ("norm1", "norm2"):
        line = _line(result, module)
        assert line["status"] == "refused", line
        assert "differs from the reference" in line["detail"], line
    summary = result.summary()
    assert "kernel: norm1 (rms_norm): refused: rms_wrong_at_1 (plugin kcm_batch)" in summary
    # Steady state: the model keeps matching at the size the gate checked, too.
    x4 = torch.randn(4, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(prepared(x4), model(x4))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = self.attn(x, x, x, need_weights=False, attn_mask=mask)
        return out


def test_a_substituted_attention_kernel_ignoring_the_mask_is_refused_at_the_masked_call(
        declare: Any) -> None:
    # The sample carries no mask, so the gate never saw one; a causal mask at run time ran
    # through the kernel, which ignored it (drift 1.56 in the report's scenario).
    declare("kcm_mask", "scaled_dot_product_attention", "sdpa_no_mask",
            _sdpa_ignoring_the_mask, traceable=True, differentiable=True)
    torch.manual_seed(0)
    model = _Attention().eval()
    result = _prepare(model, torch.randn(2, 8, 64))
    assert _line(result, "attn")["status"] == "substituted", result.kernel_substitutions
    causal = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(result.model(x, causal), model(x, causal))
    line = _line(result, "attn")
    assert line["status"] == "refused" and "bool[" in line["detail"], line


# --- 2. the signature holds the layout and the device -----------------------------------------

@pytest.mark.parametrize("traceable", [True, False])
def test_a_transposed_input_of_a_checked_shape_is_checked(declare: Any,
                                                          traceable: bool) -> None:
    # Bug: a tensor was keyed by dtype and shape: the transposed (4, 64) call counted as
    # checked by the contiguous one and ran wrong by 4.72, the kernel still selected.
    kernel = declare("kcm_layout", "rms_norm", "rms_as_contiguous",
                     _rms_reading_memory_as_contiguous, traceable=traceable)
    torch.manual_seed(0)
    w = torch.randn(64)
    kernel(torch.randn(4, 64), w, 1e-6)
    assert kernel.refused is None
    xt = torch.randn(64, 4).t()
    torch.testing.assert_close(kernel(xt, w, 1e-6), RMS_NORM(xt, w, 1e-6))
    assert kernel.refused is not None and "float32[4, 64] transposed" in kernel.refused
    assert torchbridge.get_kernel("rms_norm", "cpu").label != \
        "rms_as_contiguous (plugin kcm_layout)"


def test_an_expanded_weight_of_a_checked_shape_is_checked(declare: Any) -> None:
    kernel = declare("kcm_expanded", "rms_norm", "rms_dense_weight_only",
                     _rms_mishandling_a_broadcast_weight, traceable=True)
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    kernel(x, torch.randn(64), 1e-6)
    assert kernel.refused is None
    w = torch.tensor(0.7).expand(64)  # stride 0
    torch.testing.assert_close(kernel(x, w, 1e-6), RMS_NORM(x, w, 1e-6))
    assert kernel.refused is not None and "float32[64] expanded" in kernel.refused


def test_a_signature_tells_layouts_and_devices_apart_by_class() -> None:
    def key(t: torch.Tensor) -> Any:
        return implementations.call_signature((t,), {})

    base = torch.randn(8, 16)
    assert key(base) == key(torch.randn(8, 16))  # values are not in it
    others = [base.t().contiguous().t(),            # transposed
              torch.randn(8, 32)[:, :16],            # rows apart
              torch.randn(16).expand(8, 16),         # a broadcast
              torch.randn(9, 16)[1:],                # past its storage's start
              torch.empty(8, 16, device="meta")]     # another device
    keys = [key(t) for t in (base, *others)]
    assert len(set(keys)) == len(keys), keys
    # Classes, not strides: two transposed tensors of the same shape share a signature.
    assert key(torch.randn(16, 8).t()) == key(torch.randn(16, 8).t())
    nchw = torch.randn(2, 3, 4, 5)
    assert key(nchw) != key(nchw.contiguous(memory_format=torch.channels_last))
    # The class in the signature is the one reasons name (they once disagreed: a size-1
    # dimension's zero stride read as a broadcast in one, not in the other).
    odd = torch.randn(6).as_strided((2, 1, 3), (1, 0, 2))
    assert implementations.layout_class(odd) == "transposed"
    assert "transposed" in key(odd)[0]


def test_a_substituted_module_checks_a_transposed_input(declare: Any) -> None:
    declare("kcm_layout_sub", "rms_norm", "rms_as_contiguous_sub",
            _rms_reading_memory_as_contiguous, traceable=True, differentiable=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(64, eps=1e-6)).eval()
    result = _prepare(model, torch.randn(4, 8, 64))
    assert _line(result, "0")["status"] == "substituted", result.kernel_substitutions
    x = torch.randn(8, 4, 64).transpose(0, 1)
    with torch.no_grad():
        torch.testing.assert_close(result.model(x), model(x))
    assert _line(result, "0")["status"] == "refused"


# --- 3. an empty batch --------------------------------------------------------------------------

@pytest.mark.parametrize("traceable", [True, False])
def test_a_right_kernel_on_an_empty_batch_answers_it(declare: Any, traceable: bool) -> None:
    # Bug: comparing took max() of the empty reference outside the check's try: the
    # caller got "max(): Expected reduction dim to be specified".
    kernel = declare("kcm_empty", "rms_norm", "rms_right_empty", _rms_right,
                     traceable=traceable)
    x, w = torch.randn(0, 64), torch.randn(64)
    out = kernel(x, w, 1e-6)
    assert out.shape == (0, 64) and kernel.refused is None
    assert implementations.relative_error(torch.empty(0, 3), torch.empty(0, 3)) == 0.0
    assert implementations.relative_error(torch.empty(0, 3), torch.empty(0, 4)) == \
        float("inf")


# --- 5. the kind of output: device, structure, short reasons ----------------------------------

@pytest.mark.parametrize("traceable", [True, False])
def test_a_kernel_returning_a_tensor_on_another_device_is_refused(declare: Any,
                                                                  traceable: bool) -> None:
    # Bug: compared by dtype and shape only; subtracting the outputs then raised "Tensor on
    # device cpu is not on the expected device meta!" to the caller, the kernel kept.
    kernel = declare("kcm_meta", "rms_norm", "rms_on_meta",
                     lambda x, w=None, eps=1e-6: torch.empty(x.shape, dtype=x.dtype,
                                                             device="meta"),
                     traceable=traceable)
    x, w = torch.randn(4, 64), torch.randn(64)
    out = kernel(x, w, 1e-6)
    torch.testing.assert_close(out, RMS_NORM(x, w, 1e-6))
    assert kernel.refused is not None
    assert "returns a tensor on meta where the reference returns one on cpu" in kernel.refused


@pytest.mark.parametrize("traceable", [True, False])
def test_a_kernel_returning_a_tuple_for_a_tensor_is_refused_and_named_briefly(
        declare: Any, traceable: bool) -> None:
    # Bug: traceable, its (out,) passed (one leaf, same dtype and shape) and the caller got
    # a tuple; opaque, the reason was torch's "Unable to cast (tensor([[...", 2,748
    # characters of values, in the refusal and in doctor.
    kernel = declare("kcm_tuple", "rms_norm", "rms_in_a_tuple",
                     lambda x, w=None, eps=1e-6: (_rms_right(x, w, eps),),
                     traceable=traceable)
    x, w = torch.randn(4, 64), torch.randn(64)
    out = kernel(x, w, 1e-6)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, RMS_NORM(x, w, 1e-6))
    assert kernel.refused is not None
    assert "returns a tuple of 1 where the reference returns a tensor" in kernel.refused
    assert len(kernel.refused) < 400 and "tensor(" not in kernel.refused
    assert all(len(e) < 500 for e in _errors_of("kcm_tuple")), _errors_of("kcm_tuple")


def test_a_structure_mismatch_is_named() -> None:
    t = torch.ones(2)
    mismatch = implementations.output_mismatch
    assert mismatch((t,), t) == "returns a tuple of 1 where the reference returns a tensor"
    assert mismatch([t, t], (t, t)) == \
        "returns a list of 2 where the reference returns a tuple of 2"
    assert mismatch((t, t), (t, t)) is None
    assert mismatch(t.to("meta"), t) == \
        "returns a tensor on meta where the reference returns one on cpu"


# --- 6. a declines that raises ----------------------------------------------------------------

def _declines_wide(x: torch.Tensor, weight: Any = None, eps: float = 1e-6) -> str | None:
    if x.shape[-1] > 100:
        raise ValueError("boom in declines")
    return None


@pytest.mark.parametrize("traceable", [True, False])
def test_a_declines_that_raises_refuses_the_kernel_and_the_call_gets_the_reference(
        declare: Any, traceable: bool) -> None:
    # Bug: decline_reason ran outside any try: the ValueError reached the caller, the
    # plugin was not blamed, and the kernel stayed selected.
    kernel = declare("kcm_declines", "rms_norm", "rms_declines_raises", _rms_right,
                     traceable=traceable, declines=_declines_wide)
    kernel(torch.randn(2, 64), torch.randn(64), 1e-6)
    assert kernel.refused is None
    x, w = torch.randn(2, 128), torch.randn(128)
    torch.testing.assert_close(kernel(x, w, 1e-6), RMS_NORM(x, w, 1e-6))
    assert kernel.refused is not None
    assert "its declines raised ValueError: boom in declines" in kernel.refused
    assert any("its declines raised ValueError" in e for e in _errors_of("kcm_declines"))
    selected, row = _row("rms_norm", "rms_declines_raises")
    assert selected != "rms_declines_raises (plugin kcm_declines)" and not row["eligible"]
    # Unchecked, the call runs the reference instead of raising.
    unchecked = implementations.bind(
        KernelImplementation("rms_norm", "rms_declines_raises", _rms_right,
                             traceable=traceable, declines=_declines_wide),
        "kcm_declines", "rms_norm")
    torch.testing.assert_close(unchecked(x, w, 1e-6), RMS_NORM(x, w, 1e-6))


def test_a_declines_that_raises_in_the_substitution_gate_keeps_the_module(
        declare: Any) -> None:
    # Bug: the gate called decline_reason outside its try: the pass failed as a whole
    # ("failed kernel_substitution: ValueError: boom in declines").
    declare("kcm_declines_gate", "rms_norm", "rms_declines_gate", _rms_right,
            traceable=True, differentiable=True, declines=_declines_wide)
    model = nn.Sequential(nn.RMSNorm(128, eps=1e-6)).eval()
    result = _prepare(model, torch.randn(4, 128))
    record = next(p for p in result.passes if p.name == "kernel_substitution")
    assert record.status != "failed", record
    line = _line(result, "0")
    assert line.get("implementation") != "rms_declines_gate", line  # the next one, or none
    assert any(r.startswith("rms_declines_gate (plugin kcm_declines_gate): its declines "
                            "raised ValueError: boom") for r in line["rejected"]), line


# --- 10. the report after timing, when nothing was substituted ----------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-9
        return self.now


def test_a_kernel_substitution_that_substituted_nothing_is_not_undone_after_timing(
        declare: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # With measure=True, the gate refused the (slower) kernel: nothing was substituted,
    # and the pass said so ("no effect"). The timing then kept O0 and the report said
    # "kernel_substitution: undone after timing" and "undone: kernel_substitution".
    from torchbridge.optimize import kernel_substitution

    clock = _Clock()
    monkeypatch.setattr(kernel_substitution, "clock", clock.perf_counter)

    def slow(x: torch.Tensor, weight: Any = None, eps: float = 1e-6) -> torch.Tensor:
        clock.now += 1e-3
        return _rms_right(x, weight, eps)

    declare("kcm_slow", "rms_norm", "rms_slow", slow, traceable=True, differentiable=True)
    if any(r.name == "example" for r in plugin_records()):  # its rms_norm serves cpu too
        torchbridge.unregister_plugin("example")  # (reload_plugins loads it back)
    model = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64, eps=1e-6)).eval()

    def time_call(label: str, fn: Any) -> float:
        fn()
        return {"O0": 1.0, "prepared": 2.0, "uncompiled": 2.0}[label]

    result = _prepare(model, torch.randn(4, 64), measure=True, timer=time_call)
    assert _line(result, "1")["status"] == "kept"
    record = next(p for p in result.passes if p.name == "kernel_substitution")
    assert "undone after timing" not in record.detail, record
    assert not any("undone: kernel_substitution" in n for n in result.notes), result.notes
