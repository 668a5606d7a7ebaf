"""dropout_add in Triton: out = residual + x * keep / (1 - p), the mask regenerated in backward.

The keep mask comes from Philox4x32-10 on (seed, counter): a program covers BLOCK elements as
4 chunks of Q = BLOCK / 4, and one Philox call at counter (program * Q + k) gives the random
numbers of element k of all 4 chunks. The seed is a one-element int64 tensor (drawn on the device,
so CUDA graphs replay a new draw each time) that every program loads once. Nothing is stored between
forward and backward; the backward loads the forward's seed tensor and draws the same numbers again.
`reference.triton_keep_mask` rebuilds the mask in torch.
Full blocks run unmasked (16-byte vector accesses); only the last block checks against n.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from .reference import TRITON_BLOCK, keep_threshold

BLOCK = TRITON_BLOCK  # fixed: it shapes the random stream
WARPS = 8


@triton.jit
def _keep_scales(seed, program, threshold, scale, Q: tl.constexpr):
    """For the 4 chunks of this program: scale where an element is kept, 0 where dropped."""
    counter = program * Q + tl.arange(0, Q)  # int64
    zero = tl.zeros((Q,), dtype=tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, counter.to(tl.uint32), (counter >> 32).to(tl.uint32), zero, zero)
    return (
        tl.where((r0 >> 8).to(tl.int32) >= threshold, scale, 0.0),
        tl.where((r1 >> 8).to(tl.int32) >= threshold, scale, 0.0),
        tl.where((r2 >> 8).to(tl.int32) >= threshold, scale, 0.0),
        tl.where((r3 >> 8).to(tl.int32) >= threshold, scale, 0.0),
    )


@triton.jit
def _forward_chunk(x_ptr, r_ptr, out_ptr, offs, n, keep_scale, MASKED: tl.constexpr):
    if MASKED:
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (r + x * keep_scale).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(x_ptr + offs).to(tl.float32)
        r = tl.load(r_ptr + offs).to(tl.float32)
        tl.store(out_ptr + offs, (r + x * keep_scale).to(out_ptr.dtype.element_ty))


@triton.jit
def _backward_chunk(dout_ptr, dx_ptr, offs, n, keep_scale, MASKED: tl.constexpr):
    if MASKED:
        mask = offs < n
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, (dout * keep_scale).to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        dout = tl.load(dout_ptr + offs).to(tl.float32)
        tl.store(dx_ptr + offs, (dout * keep_scale).to(dx_ptr.dtype.element_ty))


@triton.jit
def _forward_block(x_ptr, r_ptr, out_ptr, start, n, m0, m1, m2, m3, Q: tl.constexpr, MASKED: tl.constexpr):
    offs = start + tl.arange(0, Q)
    _forward_chunk(x_ptr, r_ptr, out_ptr, offs, n, m0, MASKED)
    _forward_chunk(x_ptr, r_ptr, out_ptr, offs + Q, n, m1, MASKED)
    _forward_chunk(x_ptr, r_ptr, out_ptr, offs + 2 * Q, n, m2, MASKED)
    _forward_chunk(x_ptr, r_ptr, out_ptr, offs + 3 * Q, n, m3, MASKED)


@triton.jit
def _backward_block(dout_ptr, dx_ptr, start, n, m0, m1, m2, m3, Q: tl.constexpr, MASKED: tl.constexpr):
    offs = start + tl.arange(0, Q)
    _backward_chunk(dout_ptr, dx_ptr, offs, n, m0, MASKED)
    _backward_chunk(dout_ptr, dx_ptr, offs + Q, n, m1, MASKED)
    _backward_chunk(dout_ptr, dx_ptr, offs + 2 * Q, n, m2, MASKED)
    _backward_chunk(dout_ptr, dx_ptr, offs + 3 * Q, n, m3, MASKED)


@direct_launch
@triton.jit(do_not_specialize=["n"])
def _dropout_add_forward(x_ptr, r_ptr, out_ptr, n, seed_ptr, threshold, scale, BLOCK: tl.constexpr):
    Q: tl.constexpr = BLOCK // 4
    program = tl.program_id(0).to(tl.int64)
    start = program * BLOCK
    m0, m1, m2, m3 = _keep_scales(tl.load(seed_ptr), program, threshold, scale, Q)
    if start + BLOCK <= n:
        _forward_block(x_ptr, r_ptr, out_ptr, start, n, m0, m1, m2, m3, Q, False)
    else:
        _forward_block(x_ptr, r_ptr, out_ptr, start, n, m0, m1, m2, m3, Q, True)


@direct_launch
@triton.jit(do_not_specialize=["n"])
def _dropout_add_backward(dout_ptr, dx_ptr, n, seed_ptr, threshold, scale, BLOCK: tl.constexpr):
    Q: tl.constexpr = BLOCK // 4
    program = tl.program_id(0).to(tl.int64)
    start = program * BLOCK
    m0, m1, m2, m3 = _keep_scales(tl.load(seed_ptr), program, threshold, scale, Q)
    if start + BLOCK <= n:
        _backward_block(dout_ptr, dx_ptr, start, n, m0, m1, m2, m3, Q, False)
    else:
        _backward_block(dout_ptr, dx_ptr, start, n, m0, m1, m2, m3, Q, True)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def forward(x: torch.Tensor, residual: torch.Tensor, p: float, seed: torch.Tensor, warps: int = WARPS) -> torch.Tensor:
    """seed: the one-element int64 tensor of seeds.draw_seed_tensor, on x's device."""
    x, residual = _contiguous(x), _contiguous(residual)
    out = buffers.empty_like(x)
    n = x.numel()
    grid = (cdiv(n, BLOCK),)
    _dropout_add_forward[grid](
        x, residual, out, n, seed, keep_threshold(p), 1.0 / (1.0 - p), BLOCK=BLOCK, num_warps=warps
    )
    return out


def backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    p: float,
    seed: torch.Tensor,
    out: torch.Tensor,
    warps: int = WARPS,
):
    dx = buffers.empty_like(x)
    n = x.numel()
    grid = (cdiv(n, BLOCK),)
    _dropout_add_backward[grid](
        _contiguous(dout), dx, n, seed, keep_threshold(p), 1.0 / (1.0 - p), BLOCK=BLOCK, num_warps=warps
    )
    return dx, dout, None, None  # d residual = dout


KERNELS = KernelBackend(forward=forward, backward=backward)
