"""The linear kernels' activation codes and the epilogue's activation, shared by the forward kernels (the portable
one in triton.py and the Hopper one in triton_persistent.py)."""

import triton
import triton.language as tl

NONE: tl.constexpr = tl.constexpr(0)
RELU: tl.constexpr = tl.constexpr(1)
GELU: tl.constexpr = tl.constexpr(2)
GELU_TANH: tl.constexpr = tl.constexpr(3)
SILU: tl.constexpr = tl.constexpr(4)
SWIGLU: tl.constexpr = tl.constexpr(5)
ACTIVATION_CODES = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "swiglu": 5}

SQRT_HALF: tl.constexpr = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI: tl.constexpr = tl.constexpr(0.3989422804014327)
TANH_C: tl.constexpr = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
TANH_A: tl.constexpr = tl.constexpr(0.044715)


@triton.jit
def _activate(z, ACT: tl.constexpr):
    if ACT == RELU:
        out = tl.maximum(z, 0.0)
    elif ACT == GELU:
        out = 0.5 * z * (1.0 + tl.math.erf(z * SQRT_HALF))
    elif ACT == GELU_TANH:  # 0.5 z (1 + tanh(u)) = z sigmoid(2u)
        out = z * tl.sigmoid((z + z * z * z * TANH_A) * (2.0 * TANH_C))
    elif ACT == SILU:
        out = z * tl.sigmoid(z)
    else:
        out = z
    return out


@triton.jit
def _derivative(z, ACT: tl.constexpr):
    """d act(z) / dz for gelu, gelu_tanh and silu."""
    if ACT == GELU:
        out = 0.5 * (1.0 + tl.math.erf(z * SQRT_HALF)) + z * INV_SQRT_2PI * tl.exp(-0.5 * z * z)
    elif ACT == GELU_TANH:
        s = tl.sigmoid((z + z * z * z * TANH_A) * (2.0 * TANH_C))
        out = s + z * s * (1.0 - s) * (2.0 * TANH_C) * (1.0 + z * z * (3.0 * TANH_A))
    else:
        s = tl.sigmoid(z)
        out = s * (1.0 + z * (1.0 - s))
    return out


@triton.jit
def _preact_gradient_tile(dy_ptr, z_ptr, y_ptr, row_offsets, cols, mask, N, ACT: tl.constexpr):
    """(d_preact, d_up) of a [rows, cols] tile in fp32, from dy [M, N] and what the forward saved: z [M, 2N] for
    swiglu (d_preact: the gate half, d_up: the up half), y for relu, else z (d_up is d_preact again)."""
    dy = tl.load(dy_ptr + row_offsets * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT == SWIGLU:
        z_ptrs = z_ptr + row_offsets * (2 * N) + cols[None, :]
        g = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(z_ptrs + N, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dz = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * g * s
    elif ACT == RELU:
        y = tl.load(y_ptr + row_offsets * N + cols[None, :], mask=mask, other=0.0)
        dz = tl.where(y > 0, dy, 0.0)
        du = dz
    else:
        z = tl.load(z_ptr + row_offsets * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dz = dy * _derivative(z, ACT)
        du = dz
    return dz, du
