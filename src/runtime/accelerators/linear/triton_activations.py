"""The linear kernels' activation codes and the epilogue's activation, shared by the forward kernels (the portable
one in triton.py and the Hopper one in triton_persistent.py), and the activations' derivatives for the backward pass.

PTX (a constexpr, True where the kernel is compiled for a GPU, False under the interpreter) takes the reciprocal and
exp2 from one MUFU instruction each (triton_mufu): the GEMM epilogue is ALU-bound (docs/tuning/linear.md)."""

import triton
import triton.language as tl

from ..triton_mufu import mufu_exp2, mufu_reciprocal
from . import constants

NONE: tl.constexpr = tl.constexpr(0)
RELU: tl.constexpr = tl.constexpr(1)
GELU: tl.constexpr = tl.constexpr(2)
GELU_TANH: tl.constexpr = tl.constexpr(3)
SILU: tl.constexpr = tl.constexpr(4)
SWIGLU: tl.constexpr = tl.constexpr(5)
ACTIVATION_CODES = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "swiglu": 5}

SQRT_HALF: tl.constexpr = tl.constexpr(constants.SQRT_HALF)
INV_SQRT_2PI: tl.constexpr = tl.constexpr(constants.INV_SQRT_2PI)
TANH_C: tl.constexpr = tl.constexpr(constants.TANH_C)
TANH_A: tl.constexpr = tl.constexpr(constants.TANH_A)
LOG2E: tl.constexpr = tl.constexpr(constants.LOG2E)
ERFC_P: tl.constexpr = tl.constexpr(constants.ERFC_P)
ERFC_A1: tl.constexpr = tl.constexpr(constants.ERFC_A1)
ERFC_A2: tl.constexpr = tl.constexpr(constants.ERFC_A2)
ERFC_A3: tl.constexpr = tl.constexpr(constants.ERFC_A3)
ERFC_A4: tl.constexpr = tl.constexpr(constants.ERFC_A4)
ERFC_A5: tl.constexpr = tl.constexpr(constants.ERFC_A5)


@triton.jit
def _sigmoid(x, PTX: tl.constexpr):
    return mufu_reciprocal(1.0 + mufu_exp2(x * -LOG2E, PTX), PTX)


@triton.jit
def _gelu_parts(z, PTX: tl.constexpr):
    """(1 + erf(z / sqrt 2), exp(-z^2 / 2)) in fp32. The erf is a rational approximation of erfc with one reciprocal
    and the exp that the derivative needs anyway: about half the instructions of libdevice's erff, which made the GEMM
    epilogue ALU-bound (docs/tuning/linear.md). Its absolute error is that of erff's formula in fp32 (about 4e-7 in
    gelu), and for z < 0 it forms 1 + erf(z) = erfc(-z) directly, without the cancellation of 1 + erf."""
    u = tl.abs(z) * SQRT_HALF
    t = mufu_reciprocal(1.0 + ERFC_P * u, PTX)
    gauss = mufu_exp2(u * u * -LOG2E, PTX)
    erfc = t * (ERFC_A1 + t * (ERFC_A2 + t * (ERFC_A3 + t * (ERFC_A4 + t * ERFC_A5)))) * gauss
    return tl.where(z >= 0, 2.0 - erfc, erfc), gauss


@triton.jit
def _activate(z, ACT: tl.constexpr, PTX: tl.constexpr):
    if ACT == RELU:
        out = tl.maximum(z, 0.0)
    elif ACT == GELU:
        one_plus_erf, _ = _gelu_parts(z, PTX)
        out = 0.5 * z * one_plus_erf
    elif ACT == GELU_TANH:  # 0.5 z (1 + tanh(u)) = z sigmoid(2u)
        out = z * _sigmoid((z + z * z * z * TANH_A) * (2.0 * TANH_C), PTX)
    elif ACT == SILU:
        out = z * _sigmoid(z, PTX)
    else:
        out = z
    return out


@triton.jit
def _derivative(z, ACT: tl.constexpr, PTX: tl.constexpr):
    """d act(z) / dz for gelu, gelu_tanh and silu."""
    if ACT == GELU:
        one_plus_erf, gauss = _gelu_parts(z, PTX)
        out = 0.5 * one_plus_erf + z * INV_SQRT_2PI * gauss
    elif ACT == GELU_TANH:
        s = _sigmoid((z + z * z * z * TANH_A) * (2.0 * TANH_C), PTX)
        out = s + z * s * (1.0 - s) * (2.0 * TANH_C) * (1.0 + z * z * (3.0 * TANH_A))
    else:
        s = _sigmoid(z, PTX)
        out = s * (1.0 + z * (1.0 - s))
    return out


@triton.jit
def _preact_gradient_tile(dy_ptr, z_ptr, y_ptr, row_offsets, cols, mask, N, ACT: tl.constexpr, PTX: tl.constexpr):
    """(d_preact, d_up) of a [rows, cols] tile in fp32, from dy [M, N] and what the forward saved: z [M, 2N] for
    swiglu (d_preact: the gate half, d_up: the up half), y for relu, else z (d_up is d_preact again)."""
    dy = tl.load(dy_ptr + row_offsets * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT == SWIGLU:
        z_ptrs = z_ptr + row_offsets * (2 * N) + cols[None, :]
        g = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(z_ptrs + N, mask=mask, other=0.0).to(tl.float32)
        s = _sigmoid(g, PTX)
        dz = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * g * s
    elif ACT == RELU:
        y = tl.load(y_ptr + row_offsets * N + cols[None, :], mask=mask, other=0.0)
        dz = tl.where(y > 0, dy, 0.0)
        du = dz
    else:
        z = tl.load(z_ptr + row_offsets * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dz = dy * _derivative(z, ACT, PTX)
        du = dz
    return dz, du
