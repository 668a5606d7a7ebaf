"""gelu and silu in Triton, fp32 math, one pass each way; backward works the derivative out again from x.

    silu:        y = x * s, s = sigmoid(x)                  dy/dx = s * (1 + x * (1 - s))
    gelu:        y = x * P, P = (1 + erf(x / sqrt 2)) / 2   dy/dx = P + x * exp(-x^2 / 2) / sqrt(2 pi)
    gelu tanh:   y = x * (1 + t) / 2, t = tanh(u), u = sqrt(2 / pi) * (x + 0.044715 x^3)
                 dy/dx = (1 + t) / 2 + x * (1 - t^2) * sqrt(2 / pi) * (1 + 3 * 0.044715 x^2) / 2

The tanh approximation is computed as (1 + t) / 2 = sigmoid(2u) and (1 - t^2) / 4 = sigmoid(2u) * sigmoid(-2u): the
same values, without the cancellation of 1 + t and 1 - t^2 where t is near -1 or 1 (a relative error of up to
1e-1 at x = -5 in fp32), and both ends saturate cleanly.

Flat arrays of n elements in blocks as swiglu's kernels (full blocks unmasked, the last one masked), with its
block size and load/store helpers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..swiglu.configs import BLOCK, WARPS
from ..swiglu.triton import load_block, store_block
from ..triton_launch import direct_launch
from . import reference as constants
from .reference import GELU, GELU_TANH, SILU

# the kernels may read module globals only as constexprs, written right of a tensor (the interpreter's
# constexpr * tensor is not a tensor)
_SILU: tl.constexpr = tl.constexpr(SILU)
_GELU: tl.constexpr = tl.constexpr(GELU)
_SQRT_HALF: tl.constexpr = tl.constexpr(constants.SQRT_HALF)
_INV_SQRT_2PI: tl.constexpr = tl.constexpr(constants.INV_SQRT_2PI)
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(constants.SQRT_2_OVER_PI)
_TANH_CUBIC: tl.constexpr = tl.constexpr(constants.TANH_CUBIC)


@triton.jit
def _tanh_argument(x):
    """2u of the tanh approximation."""
    return (x + x * x * x * _TANH_CUBIC) * _SQRT_2_OVER_PI * 2.0


@triton.jit
def _activate(x, ACT: tl.constexpr):
    if ACT == _SILU:
        return x * tl.sigmoid(x)
    elif ACT == _GELU:
        return 0.5 * x * (1.0 + tl.erf(x * _SQRT_HALF))
    else:
        return x * tl.sigmoid(_tanh_argument(x))


@triton.jit
def _derivative(x, ACT: tl.constexpr):
    if ACT == _SILU:
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    elif ACT == _GELU:
        return 0.5 * (1.0 + tl.erf(x * _SQRT_HALF)) + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    else:
        two_u = _tanh_argument(x)
        s = tl.sigmoid(two_u)
        du = (x * x * _TANH_CUBIC * 3.0 + 1.0) * _SQRT_2_OVER_PI
        s_neg = 1.0 / (1.0 + tl.exp(two_u))  # sigmoid(-2u)
        return s + 2.0 * x * s * s_neg * du


@triton.jit
def _forward_tile(x_ptr, y_ptr, offs, n, ACT: tl.constexpr, MASKED: tl.constexpr):
    store_block(y_ptr, offs, n, _activate(load_block(x_ptr, offs, n, MASKED, ""), ACT), MASKED)


@triton.jit
def _backward_tile(dy_ptr, x_ptr, dx_ptr, offs, n, ACT: tl.constexpr, MASKED: tl.constexpr):
    dy = load_block(dy_ptr, offs, n, MASKED, "")
    x = load_block(x_ptr, offs, n, MASKED, "")
    store_block(dx_ptr, offs, n, dy * _derivative(x, ACT), MASKED)


@direct_launch
@triton.jit(do_not_specialize=["n"])
def _forward_kernel(x_ptr, y_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _forward_tile(x_ptr, y_ptr, offs, n, ACT, False)
    else:
        _forward_tile(x_ptr, y_ptr, offs, n, ACT, True)


@direct_launch
@triton.jit(do_not_specialize=["n"])
def _backward_kernel(dy_ptr, x_ptr, dx_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _backward_tile(dy_ptr, x_ptr, dx_ptr, offs, n, ACT, False)
    else:
        _backward_tile(dy_ptr, x_ptr, dx_ptr, offs, n, ACT, True)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _forward(x: torch.Tensor, act: int) -> torch.Tensor:
    x = _contiguous(x)
    y = buffers.empty_like(x)
    n = x.numel()
    _forward_kernel[(cdiv(n, BLOCK),)](x, y, n, ACT=act, BLOCK=BLOCK, num_warps=WARPS)
    return y


def _backward(dy: torch.Tensor, x: torch.Tensor, act: int) -> torch.Tensor:
    dy, x = _contiguous(dy), _contiguous(x)
    dx = buffers.empty_like(x)
    n = x.numel()
    _backward_kernel[(cdiv(n, BLOCK),)](dy, x, dx, n, ACT=act, BLOCK=BLOCK, num_warps=WARPS)
    return dx


def gelu_forward(x: torch.Tensor, tanh: bool) -> torch.Tensor:
    return _forward(x, GELU_TANH if tanh else GELU)


def gelu_backward(dy: torch.Tensor, x: torch.Tensor, tanh: bool, y):
    """y is not read (None in eager calls)."""
    return _backward(dy, x, GELU_TANH if tanh else GELU), None


def silu_forward(x: torch.Tensor) -> torch.Tensor:
    return _forward(x, SILU)


def silu_backward(dy: torch.Tensor, x: torch.Tensor, y):
    """y is not read (None in eager calls)."""
    return (_backward(dy, x, SILU),)


GELU_KERNELS = KernelBackend(forward=gelu_forward, backward=gelu_backward, backward_reads="arguments")
SILU_KERNELS = KernelBackend(forward=silu_forward, backward=silu_backward, backward_reads="arguments")
