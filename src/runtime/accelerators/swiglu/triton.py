"""SwiGLU in Triton: y = silu(g) * u forward, one pass each way, fp32 math.

The tensors are treated as flat arrays of n elements; each program takes BLOCK consecutive
elements. Full blocks run unmasked (16-byte vector accesses whatever n is); only the last,
partial block takes the masked path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from .configs import BLOCK, FORWARD_LOAD_POLICY, WARPS


@triton.jit
def load_block(ptr, offs, n, MASKED: tl.constexpr, POLICY: tl.constexpr):
    """The elements at offs as fp32 (masked at n when MASKED); shared with the activation kernels."""
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=0.0, eviction_policy=POLICY).to(tl.float32)
    return tl.load(ptr + offs, eviction_policy=POLICY).to(tl.float32)


@triton.jit
def store_block(ptr, offs, n, value, MASKED: tl.constexpr):
    """value as ptr's dtype at offs (masked at n when MASKED); shared with the activation kernels."""
    if MASKED:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=offs < n)
    else:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty))


@triton.jit
def _forward_tile(g_ptr, u_ptr, y_ptr, offs, n, MASKED: tl.constexpr):
    g = load_block(g_ptr, offs, n, MASKED, FORWARD_LOAD_POLICY)
    u = load_block(u_ptr, offs, n, MASKED, FORWARD_LOAD_POLICY)
    store_block(y_ptr, offs, n, g * tl.sigmoid(g) * u, MASKED)


@triton.jit
def _backward_tile(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, offs, n, MASKED: tl.constexpr):
    dy = load_block(dy_ptr, offs, n, MASKED, "")
    g = load_block(g_ptr, offs, n, MASKED, "")
    u = load_block(u_ptr, offs, n, MASKED, "")
    s = tl.sigmoid(g)
    store_block(du_ptr, offs, n, dy * g * s, MASKED)
    # d silu(g) / dg = s * (1 + g * (1 - s))
    store_block(dg_ptr, offs, n, dy * u * s * (1.0 + g * (1.0 - s)), MASKED)


@direct_launch
@triton.jit
def _swiglu_forward(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _forward_tile(g_ptr, u_ptr, y_ptr, offs, n, False)
    else:
        _forward_tile(g_ptr, u_ptr, y_ptr, offs, n, True)


@direct_launch
@triton.jit
def _swiglu_backward(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _backward_tile(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, offs, n, False)
    else:
        _backward_tile(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, offs, n, True)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def forward(gate: torch.Tensor, up: torch.Tensor, block: int = BLOCK, warps: int = WARPS) -> torch.Tensor:
    gate, up = _contiguous(gate), _contiguous(up)
    y = buffers.empty_like(gate)
    n = gate.numel()
    _swiglu_forward[(cdiv(n, block),)](gate, up, y, n, BLOCK=block, num_warps=warps)
    return y


def backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, y: torch.Tensor, block: int = BLOCK, warps: int = WARPS
):
    dy, gate, up = _contiguous(dy), _contiguous(gate), _contiguous(up)
    dgate, dup = buffers.empty_like(gate), buffers.empty_like(up)
    n = gate.numel()
    _swiglu_backward[(cdiv(n, block),)](dy, gate, up, dgate, dup, n, BLOCK=block, num_warps=warps)
    return dgate, dup


KERNELS = KernelBackend(forward=forward, backward=backward)
