"""Every Triton kernel, forward and backward, against a float64 reference computed from the
same (already rounded) inputs, in float32, float16 and bfloat16: hidden sizes that are not
powers of two, one row and many, non-contiguous inputs. And each problem function: a call the
kernel cannot take is declined with the reason."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from torchbridge.errors import KernelError
from torchbridge.kernels.triton import (
    TRITON_KERNELS,
    add_rms_norm_backward,
    add_rms_norm_forward,
    add_rms_norm_problem,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_problem,
    rotary_backward,
    rotary_forward,
    rotary_problem,
    silu_mul_backward,
    silu_mul_forward,
    silu_mul_problem,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the reference's largest magnitude: one output rounding plus float32 noise.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype, (actual.dtype, dtype)
    assert actual.shape == expected.shape
    scale = max(expected.abs().max().item(), 1.0)
    error = (actual.double().cpu() - expected.cpu()).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"max error {error:.3g} (scale {scale:.3g})"


def make(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a tensor whose rows are strided (every other column of a wider one)."""
    wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    view = wide[..., ::2]
    assert not view.is_contiguous()
    return view


# -- rms_norm -------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                       ) -> torch.Tensor:
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


ROW_SHAPES = [(1, 8), (3, 7), (2, 5, 100), (17, 257)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_forward_and_backward_match_the_reference(
        device: str, dtype: torch.dtype, shape: tuple[int, ...], with_weight: bool) -> None:
    eps = 1e-5
    x = make(shape, dtype, device, 0)
    weight = make(shape[-1:], dtype, device, 1) if with_weight else None
    grad_y = make(shape, dtype, device, 2)

    y, rstd = rms_norm_forward(x, weight, eps)
    assert_close(y, rms_norm_reference(x, weight, eps), dtype)
    assert rstd.dtype == torch.float32 and rstd.shape == shape[:-1]
    expected_rstd = torch.rsqrt(x.double().pow(2).mean(-1) + eps)
    torch.testing.assert_close(rstd.double().cpu(), expected_rstd.cpu(), rtol=1e-5, atol=0)

    x64 = x.double().cpu().requires_grad_()
    w64 = None if weight is None else weight.double().cpu().requires_grad_()
    inputs = [x64] if w64 is None else [x64, w64]
    expected = torch.autograd.grad(rms_norm_reference(x64, w64, eps), inputs,
                                   grad_y.double().cpu())
    grad_x, grad_weight = rms_norm_backward(grad_y, x, weight, rstd)
    assert_close(grad_x, expected[0], dtype)
    if weight is None:
        assert grad_weight is None
    else:
        assert grad_weight is not None
        assert_close(grad_weight, expected[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_takes_strided_rows_and_a_weight_of_another_dtype(
        device: str, dtype: torch.dtype) -> None:
    x = noncontiguous(make((4, 3, 48), dtype, device, 3))
    weight = make((48,), torch.float32, device, 4)
    grad_y = noncontiguous(make((4, 3, 48), dtype, device, 5))
    y, rstd = rms_norm_forward(x, weight, 1e-6)
    assert_close(y, rms_norm_reference(x, weight, 1e-6), dtype)
    x64 = x.double().cpu().requires_grad_()
    w64 = weight.double().cpu().requires_grad_()
    expected = torch.autograd.grad(rms_norm_reference(x64, w64, 1e-6), [x64, w64],
                                   grad_y.double().cpu())
    grad_x, grad_weight = rms_norm_backward(grad_y, x, weight, rstd)
    assert_close(grad_x, expected[0], dtype)
    assert grad_weight is not None
    assert_close(grad_weight, expected[1], torch.float32)


def test_rms_norm_backward_spreads_many_rows_over_few_programs(device: str) -> None:
    """More rows than programs: each program loops over its share and the partial grad_weight
    rows are summed; a lost or doubled row shows in grad_weight."""
    x = make((300, 24), torch.float32, device, 6)
    weight = make((24,), torch.float32, device, 7)
    grad_y = make((300, 24), torch.float32, device, 8)
    _, rstd = rms_norm_forward(x, weight, 1e-6)
    x64 = x.double().cpu().requires_grad_()
    w64 = weight.double().cpu().requires_grad_()
    expected = torch.autograd.grad(rms_norm_reference(x64, w64, 1e-6), [x64, w64],
                                   grad_y.double().cpu())
    grad_x, grad_weight = rms_norm_backward(grad_y, x, weight, rstd)
    assert_close(grad_x, expected[0], torch.float32)
    assert grad_weight is not None
    assert_close(grad_weight, expected[1], torch.float32)


def test_rms_norm_of_no_rows_is_empty(device: str) -> None:
    y, rstd = rms_norm_forward(torch.empty((0, 16), device=device), None, 1e-6)
    assert y.shape == (0, 16) and rstd.shape == (0,)


# -- add_rms_norm ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 7), (2, 5, 100)])
def test_add_rms_norm_returns_the_norm_and_the_residual_sum(
        device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = make(shape, dtype, device, 10)
    residual = noncontiguous(make(shape, dtype, device, 11))
    weight = make(shape[-1:], dtype, device, 12)
    y, total = add_rms_norm_forward(x, residual, weight, 1e-6)
    # The sum is the one an unfused model carries on, rounded once to dtype: bit for bit when
    # compiled. Triton's interpreter truncates float32 to bfloat16 instead of rounding
    # (runtime/interpreter.py, cast_impl), which can cost one bfloat16 ulp (2^-7 relative).
    expected_total = (x.double() + residual.double()).to(dtype)
    assert total.dtype == dtype
    if device == "cpu" and dtype == torch.bfloat16:
        ulp = 2.0 ** -7 * expected_total.double().abs()
        assert ((total.double() - expected_total.double()).abs() <= ulp).all()
    else:
        assert torch.equal(total.cpu(), expected_total.cpu())
    # ...and the norm is computed from that rounded sum.
    assert_close(y, rms_norm_reference(expected_total, weight, 1e-6), dtype)

    # Backward, from the returned sum: x and residual get the same gradient, the norm's
    # gradient plus what reached the sum directly (the next layer's residual stream).
    grad_y = make(shape, dtype, device, 13)
    grad_sum = noncontiguous(make(shape, dtype, device, 14))
    x64 = x.double().cpu().requires_grad_()
    r64 = residual.double().cpu().requires_grad_()
    w64 = weight.double().cpu().requires_grad_()
    s64 = x64 + r64
    expected = torch.autograd.grad(
        (rms_norm_reference(s64, w64, 1e-6), s64), [x64, r64, w64],
        (grad_y.double().cpu(), grad_sum.double().cpu()))
    grad_input, grad_weight = add_rms_norm_backward(grad_y, grad_sum, total, weight, 1e-6)
    assert_close(grad_input, expected[0], dtype)
    assert grad_weight is not None
    assert_close(grad_weight, expected[2], dtype)


# -- silu_mul -------------------------------------------------------------------------------

def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 1000), (2, 3, 37)])
def test_silu_mul_forward_and_backward_match_the_reference(
        device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gate = make(shape, dtype, device, 20) * 3  # reach both tails of the sigmoid
    up = noncontiguous(make(shape, dtype, device, 21))
    grad = make(shape, dtype, device, 22)
    assert_close(silu_mul_forward(gate, up), silu_mul_reference(gate, up), dtype)

    g64 = gate.double().cpu().requires_grad_()
    u64 = up.double().cpu().requires_grad_()
    expected = torch.autograd.grad(silu_mul_reference(g64, u64), [g64, u64],
                                   grad.double().cpu())
    grad_gate, grad_up = silu_mul_backward(grad, gate, up)
    assert_close(grad_gate, expected[0], dtype)
    assert_close(grad_up, expected[1], dtype)


# -- rotary embedding -----------------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb with the tables broadcast over heads."""
    def over_heads(table: torch.Tensor) -> torch.Tensor:
        table = table.double()
        return table.unsqueeze(-3) if table.dim() < 4 else table
    return x.double() * over_heads(cos) + rotate_half(x.double()) * over_heads(sin)


def hf_tables(batch: int, seq: int, dim: int, dtype: torch.dtype, device: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as HF's LlamaRotaryEmbedding builds them: both halves equal."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim))
    positions = torch.arange(seq).double()[None, :] + torch.arange(batch).double()[:, None]
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def random_tables(shape: tuple[int, ...], dtype: torch.dtype, device: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables whose halves differ, where the backward is not rotary(g, cos, -sin)."""
    return make(shape, dtype, device, 30), make(shape, dtype, device, 31)


TABLE_SHAPES = {"(B, S, D)": lambda b, s, d: (b, s, d), "(1, S, D)": lambda b, s, d: (1, s, d),
                "(S, D)": lambda b, s, d: (s, d), "(B, 1, S, D)": lambda b, s, d: (b, 1, s, d)}


def check_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
                 ) -> None:
    assert_close(rotary_forward(x, cos, sin), rotary_reference(x, cos, sin), dtype)
    grad = make(tuple(x.shape), dtype, str(x.device), 32)
    x64 = x.double().cpu().requires_grad_()
    (expected,) = torch.autograd.grad(rotary_reference(x64, cos.cpu(), sin.cpu()), [x64],
                                      grad.double().cpu())
    assert_close(rotary_backward(grad, cos, sin), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_shape", list(TABLE_SHAPES))
@pytest.mark.parametrize("head_dim", [6, 16])
def test_rotary_forward_and_backward_match_the_reference(
        device: str, dtype: torch.dtype, table_shape: str, head_dim: int) -> None:
    batch, heads, seq = 2, 3, 5
    x = make((batch, heads, seq, head_dim), dtype, device, 33)
    cos, sin = random_tables(TABLE_SHAPES[table_shape](batch, seq, head_dim), dtype, device)
    check_rotary(x, cos, sin, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_hf_layout_transposed_queries_with_hf_tables(
        device: str, dtype: torch.dtype) -> None:
    """HF makes q as (B, S, H, D) and transposes it to (B, H, S, D): strided, no copy. 20
    heads take two head blocks."""
    batch, seq, heads, dim = 2, 7, 20, 32
    x = make((batch, seq, heads, dim), dtype, device, 34).transpose(1, 2)
    assert not x.is_contiguous()
    cos, sin = hf_tables(batch, seq, dim, dtype, device)
    check_rotary(x, cos, sin, dtype)


def test_rotary_backward_is_not_rotary_with_negated_sin(device: str) -> None:
    """Guards the derivation: with tables whose halves differ, the shortcut is wrong, so the
    reference comparison above can tell the two apart."""
    x = make((1, 2, 3, 8), torch.float32, device, 35)
    cos, sin = random_tables((3, 8), torch.float32, device)
    assert not torch.allclose(rotary_backward(x, cos, sin), rotary_forward(x, cos, -sin))


def test_rotary_accepts_float32_tables_for_half_inputs(device: str) -> None:
    x = make((1, 2, 4, 16), torch.bfloat16, device, 36)
    cos, sin = hf_tables(1, 4, 16, torch.float32, device)
    check_rotary(x, cos, sin, torch.bfloat16)


# -- problem functions ----------------------------------------------------------------------

def declined(problem: str | None, *words: str) -> None:
    assert problem is not None, "the call was accepted"
    for word in words:
        assert word in problem, problem


def test_each_op_declines_what_it_cannot_take_and_says_why(device: str) -> None:
    x = torch.ones((2, 8), device=device)
    declined(rms_norm_problem(x.long()), "torch.int64")
    declined(rms_norm_problem(x, torch.ones(7, device=device)), "weight", "(7,)", "(8,)")
    declined(rms_norm_problem(torch.ones((), device=device)), "scalar")
    wide = torch.empty((1, 70000), device=device)
    declined(rms_norm_problem(wide), "70000", "65536")
    declined(add_rms_norm_problem(x, torch.ones((1, 8), device=device)), "(2, 8)", "(1, 8)")
    declined(add_rms_norm_problem(x, x.half()), "dtype")
    declined(silu_mul_problem(x, torch.ones((2, 1), device=device)), "(2, 8)", "(2, 1)")
    declined(silu_mul_problem(x, x.double()), "dtype")
    declined(silu_mul_problem(x.double(), x.double()), "torch.float64")

    q = torch.ones((2, 3, 5, 8), device=device)
    assert rotary_problem(q, torch.ones((5, 8), device=device),
                          torch.ones((5, 8), device=device)) is None
    declined(rotary_problem(q[0], torch.ones((5, 8)), torch.ones((5, 8))), "(3, 5, 8)")
    declined(rotary_problem(q[..., :7], torch.ones((5, 7)), torch.ones((5, 7))), "odd")
    declined(rotary_problem(q, torch.ones((5, 8)), torch.ones((4, 8))), "cos", "sin")
    declined(rotary_problem(q, torch.ones((3, 5, 8)), torch.ones((3, 5, 8))),
             "does not broadcast")
    declined(rotary_problem(q, torch.ones((2, 3, 5, 8)), torch.ones((2, 3, 5, 8))),
             "singleton head dim")


def test_a_declined_call_raises_with_the_reason(device: str) -> None:
    with pytest.raises(KernelError, match="gate has shape"):
        silu_mul_forward(torch.ones(3, device=device), torch.ones(4, device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter case")
def test_cpu_tensors_are_declined_without_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    declined(rms_norm_problem(torch.ones(2, 8)), "TRITON_INTERPRET=1")


def test_the_registry_names_every_op_with_its_functions() -> None:
    expected: dict[str, tuple[Callable[..., object], object, object]] = {
        "rms_norm": (rms_norm_forward, rms_norm_backward, rms_norm_problem),
        "silu_mul": (silu_mul_forward, silu_mul_backward, silu_mul_problem),
        "rotary_embedding": (rotary_forward, rotary_backward, rotary_problem),
        "add_rms_norm": (add_rms_norm_forward, add_rms_norm_backward, add_rms_norm_problem),
    }
    assert set(TRITON_KERNELS) == set(expected)
    for name, (forward, backward, problem) in expected.items():
        op = TRITON_KERNELS[name]
        assert (op.forward, op.backward, op.problem) == (forward, backward, problem)
        assert op.kernels and {spec.kernel for spec in op.aot_specs()} == set(op.kernels)
