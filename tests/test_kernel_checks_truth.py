"""What a checked kernel's first-use check (and the contract suite) says about an
implementation must hold for every call it lets through: an implementation that writes into
its inputs or returns one is refused, under its plugin, with the caller's tensors and result
as the reference would leave them; and a call differing from a checked one only in a
non-tensor argument (is_causal, a scale) is checked too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchbridge
from kernel_declaring import RmsNormBlock, _errors_of, _row
from torchbridge.kernels import implementations
from torchbridge.testing import BackendContract


def _rms_in_place(x: torch.Tensor, weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    # "saves memory": normalises x where it is and returns it
    x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return x if weight is None else x.mul_(weight)


def _rms_returns_a_view(x: torch.Tensor, weight: torch.Tensor | None = None,
                        eps: float = 1e-6) -> torch.Tensor:
    # Right only where every row's mean square is 1 (and no weight): then x is its own
    # norm, within the tolerance, and it returns a view of x instead of a new tensor.
    return x.view(x.shape)


def _rms_right(x: torch.Tensor, weight: torch.Tensor | None = None,
               eps: float = 1e-6) -> torch.Tensor:
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (out if weight is None else out * weight.float()).to(x.dtype)


def _rms_wrong_from_130_rows(x: torch.Tensor, weight: torch.Tensor | None = None,
                             eps: float = 1e-6) -> torch.Tensor:
    out = _rms_right(x, weight, eps)
    return out * 2 if x.shape[0] >= 130 else out


def _sdpa_ignoring_is_causal_and_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       attn_mask: torch.Tensor | None = None,
                                       is_causal: bool = False, scale: float | None = None,
                                       enable_gqa: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


# --- an implementation writing into its inputs, or returning one -----------------------

@pytest.mark.parametrize("traceable", [True, False])
def test_a_kernel_writing_into_its_input_is_refused_and_the_caller_is_left_whole(
        declare: Any, traceable: bool) -> None:
    # Bug: the reference ran first, then the implementation on the same tensors, and
    # nothing looked at the tensors after: x.mul_(...) returning x passed (its output was
    # right), the caller's x was normalised behind its back, and get_kernel kept choosing
    # the kernel.
    kernel = declare("ckt_inplace", "rms_norm", "rms_in_place", _rms_in_place,
                     traceable=traceable)
    torch.manual_seed(0)
    x, w = torch.randn(4, 64) + 3, torch.randn(64)
    x0 = x.clone()
    y = kernel(x, w, 1e-6)
    assert kernel.refused is not None and "writes into its argument x" in kernel.refused
    assert torch.equal(x, x0), "the caller's x was left changed"
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(y, torchbridge.kernels.reference("rms_norm")(x0, w, 1e-6))
    # Refused under its plugin, as other first-use refusals are, and passed over from now on.
    assert any("rms_in_place" in e and "writes into its argument x" in e
               for e in _errors_of("ckt_inplace")), _errors_of("ckt_inplace")
    selected, row = _row("rms_norm", "rms_in_place")
    assert selected != "rms_in_place (plugin ckt_inplace)"
    assert row["reason"].startswith("refused") and "writes into" in row["reason"]


def test_a_kernel_returning_a_view_of_its_input_is_refused(declare: Any) -> None:
    # Its numbers match on this input (each row's mean square is 1), but the output is the
    # caller's x: writing into one writes into the other.
    kernel = declare("ckt_view", "rms_norm", "rms_view", _rms_returns_a_view, traceable=True)
    x = torch.ones(4, 64)
    x[:, ::2] = -1
    y = kernel(x, None, 1e-6)
    assert kernel.refused is not None
    assert "returns its argument x (or a view of it)" in kernel.refused
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(y, torchbridge.kernels.reference("rms_norm")(x, None, 1e-6))


def test_a_kernel_writing_into_its_input_is_refused_in_inference_mode(declare: Any) -> None:
    # Inference tensors keep no version counter: the values show the write.
    kernel = declare("ckt_inference", "rms_norm", "rms_in_place_inf", _rms_in_place,
                     traceable=True)
    with torch.inference_mode():
        x, w = torch.randn(4, 64) + 3, torch.randn(64)
        x0 = x.clone()
        y = kernel(x, w, 1e-6)
        assert kernel.refused is not None and "writes into its argument x" in kernel.refused
        assert torch.equal(x, x0)
        torch.testing.assert_close(y, torchbridge.kernels.reference("rms_norm")(x0, w, 1e-6))


def _training_step(norm: Any, x0: torch.Tensor, w0: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, x's gradient, weight's gradient) of a residual block norming an activation."""
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    h = x * 2 + 1  # an activation: in-place writes into it are allowed, and recorded
    loss = (norm(h, w, 1e-6) * 3 + h).sum()
    loss.backward()
    assert x.grad is not None and w.grad is not None
    return loss.detach(), x.grad, w.grad


def test_a_kernel_writing_into_its_input_in_training_leaves_the_gradients_right(
        declare: Any) -> None:
    # Run on the caller's activation, the write would be in autograd's record of it: the
    # residual's backward then raised (or, for a write that saves nothing, went wrong).
    kernel = declare("ckt_train", "rms_norm", "rms_in_place_train", _rms_in_place,
                     traceable=True, differentiable=True)
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 64), torch.randn(64)
    got = _training_step(kernel, x0, w0)
    assert kernel.refused is not None and "writes into its argument x" in kernel.refused
    for a, b in zip(got, _training_step(torchbridge.kernels.reference("rms_norm"), x0, w0),
                    strict=True):
        torch.testing.assert_close(a, b)


def test_a_right_kernel_in_training_passes_its_check_with_the_right_gradients(
        declare: Any) -> None:
    kernel = declare("ckt_right_train", "rms_norm", "rms_right_train", _rms_right,
                     traceable=True, differentiable=True)
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 64), torch.randn(64)
    got = _training_step(kernel, x0, w0)
    assert kernel.refused is None and kernel.checked_signatures
    for a, b in zip(got, _training_step(torchbridge.kernels.reference("rms_norm"), x0, w0),
                    strict=True):
        torch.testing.assert_close(a, b)


class _CpuContract(BackendContract):
    backend_name = "cpu"


def test_the_contract_suite_fails_a_kernel_writing_into_its_input(declare: Any) -> None:
    # Bug: the suite compared the output only, after the reference had run: an in-place
    # kernel passed.
    declare("ckt_contract", "rms_norm", "rms_in_place_contract", _rms_in_place,
            traceable=True)
    with pytest.raises(AssertionError, match=r"rms_in_place_contract .* writes into its "
                                             r"argument x"):
        _CpuContract().test_kernels_match_their_references(torchbridge.get_backend("cpu"))


def test_the_contract_suite_passes_a_right_kernel(declare: Any) -> None:
    declare("ckt_contract_right", "rms_norm", "rms_right_contract", _rms_right,
            traceable=True)
    _CpuContract().test_kernels_match_their_references(torchbridge.get_backend("cpu"))


# --- the signature holds the non-tensor arguments ---------------------------------------

def _qkv() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(1, 2, 8, 64) for _ in range(3))


@pytest.mark.parametrize("by_name", [False, True])
def test_a_call_differing_only_in_is_causal_is_checked(declare: Any, by_name: bool) -> None:
    # Bug: the signature held tensors' dtypes and shapes only (a non-tensor keyword not at
    # all): the causal call ran unchecked, wrong by 2, with the kernel still selected.
    kernel = declare("ckt_causal", "scaled_dot_product_attention", "sdpa_not_causal",
                     _sdpa_ignoring_is_causal_and_scale)
    q, k, v = _qkv()
    reference = torchbridge.kernels.reference("scaled_dot_product_attention")
    if by_name:
        kernel(q, k, v, is_causal=False)
        assert kernel.refused is None
        causal = kernel(q, k, v, is_causal=True)
    else:
        kernel(q, k, v, None, False)
        assert kernel.refused is None
        causal = kernel(q, k, v, None, True)
    assert kernel.refused is not None and "True" in kernel.refused
    torch.testing.assert_close(causal, reference(q, k, v, None, True))
    selected, row = _row("scaled_dot_product_attention", "sdpa_not_causal")
    assert selected != "sdpa_not_causal (plugin ckt_causal)" and not row["eligible"]


def test_a_call_differing_only_in_a_float_is_checked(declare: Any) -> None:
    # The kernel computes the default scale (1/sqrt(64) = 0.125) whatever it is given: right
    # for the first call, which passes it explicitly, as Hugging Face does.
    kernel = declare("ckt_scale", "scaled_dot_product_attention", "sdpa_no_scale",
                     _sdpa_ignoring_is_causal_and_scale)
    q, k, v = _qkv()
    reference = torchbridge.kernels.reference("scaled_dot_product_attention")
    kernel(q, k, v, None, False, 0.125)
    assert kernel.refused is None
    out = kernel(q, k, v, None, False, 0.3)
    assert kernel.refused is not None and "0.3" in kernel.refused
    torch.testing.assert_close(out, reference(q, k, v, None, False, 0.3))


def test_a_float_changing_on_every_call_leaves_new_shapes_checked(declare: Any) -> None:
    # Were numbers keyed by value alone, an eps changing on every call would spend every
    # check on values (a reference run each) and leave the 130-row call unchecked.
    kernel = declare("ckt_floats", "rms_norm", "rms_wrong_130", _rms_wrong_from_130_rows,
                     traceable=True)
    w = torch.randn(64)
    for i in range(2 * implementations.MAX_CHECKED_SIGNATURES):
        kernel(torch.randn(4, 64), w, 1e-6 * (i + 1))
    assert kernel.refused is None
    # The first values, then the signature with the number by type.
    assert len(kernel.checked_signatures) == implementations.MAX_NUMBER_VALUES + 1
    kernel(torch.randn(130, 64), w, 1e-6)
    assert kernel.refused is not None and "float32[130, 64]" in kernel.refused


def test_a_signature_tells_the_values_of_plain_arguments_apart() -> None:
    signature = implementations.call_signature
    assert signature((True,), {}) != signature((1,), {})  # equal, and hash alike, in Python
    assert signature((None,), {}) != signature((False,), {})
    assert signature((), {"is_causal": True}) != signature((), {"is_causal": False})
    assert signature(((1, "a"),), {}) != signature(((1, "b"),), {})
    assert signature((0.1,), {}) != signature((0.2,), {})
    assert signature((0.1,), {}, numbers=False) == signature((0.2,), {}, numbers=False)
    assert signature((0.1,), {}, numbers=False) != signature((None,), {}, numbers=False)
    assert signature((object(),), {}) == signature((object(),), {})  # by type


def _linear_scaling_its_weight(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    out = F.linear(x, weight, bias)
    weight.mul_(1.0)  # same values, but a write: the weight is larger than the output
    return out


def test_a_write_into_an_argument_too_large_to_copy_is_seen_by_its_version_counter(
        declare: Any) -> None:
    kernel = declare("ckt_weight", "linear", "linear_writes_weight", _linear_scaling_its_weight,
                     traceable=True)
    x, weight = torch.randn(1, 64), torch.randn(256, 64)  # 256 x 64 weight, 1 x 256 output
    out = kernel(x, weight)
    assert kernel.refused is not None and "writes into its argument weight" in kernel.refused
    torch.testing.assert_close(out, F.linear(x, weight))


def test_kernel_substitution_refuses_a_kernel_that_writes_into_its_input(
        declare: Any) -> None:
    # The O3 gate compared the module's output through the kernel with the reference's on
    # inputs the kernel had already scaled in place: "max rel error 0", substituted, and the
    # module then wrote into the caller's activations on every call.
    from torchbridge.optimize.pipeline import run_pipeline

    def scaled_in_place(x: torch.Tensor, weight: Any = None, eps: float = 1e-6
                        ) -> torch.Tensor:
        x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        return x if weight is None else x.mul_(weight)

    declare("writes_kernels", "rms_norm", "rms_in_place", scaled_in_place, traceable=True)

    config = torchbridge.TorchBridgeConfig(optimization={"disabled_passes": [
        "compile", "autocast", "low_precision_weights"]})
    torch.manual_seed(0)
    result = run_pipeline(torchbridge.get_backend("cpu", config), RmsNormBlock().eval(), "O3",
                          sample_input=torch.randn(8, 64))
    line = next(s for s in result.kernel_substitutions if s["module"] == "norm")
    # Passed over with the reason; another implementation (or the module's own code) runs.
    assert line.get("implementation") != "rms_in_place", line
    x = torch.randn(8, 64)
    kept = x.clone()
    result.model(x)
    assert torch.equal(x, kept)  # the caller's activations are left alone
