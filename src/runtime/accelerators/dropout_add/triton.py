"""dropout_add in Triton: out = residual + x * keep / (1 - p), the mask regenerated in backward.

The keep mask comes from Philox4x32-10 on (seed, counter): a program covers BLOCK elements as
4 chunks of Q = BLOCK / 4, and one Philox call at counter (program * Q + k) gives the random
numbers of element k of all 4 chunks. Nothing is stored between forward and backward; the
backward draws the same numbers again. `reference.triton_keep_mask` rebuilds the mask in torch.
Full blocks run unmasked (16-byte vector accesses); only the last block checks against n. The
backward walks the blocks from the last to the first (the tail of dout is still in L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from .reference import TRITON_BLOCK, keep_threshold

BLOCK = TRITON_BLOCK  # fixed: it shapes the random stream
WARPS = 8


@triton.jit
def _keep_scales(seed, block, threshold, scale, Q: tl.constexpr):
    """For the 4 chunks of a block: scale where an element is kept, 0 where dropped."""
    # counter = block * Q + k: Q divides 2^32, so the low word never carries into the high one
    first = block * Q
    low = (first & 0xFFFFFFFF).to(tl.uint32) + tl.arange(0, Q).to(tl.uint32)
    high = tl.zeros((Q,), dtype=tl.uint32) + (first >> 32).to(tl.uint32)
    zero = tl.zeros((Q,), dtype=tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, low, high, zero, zero)
    return (
        tl.where((r0 >> 8).to(tl.int32) >= threshold, scale, 0.0),
        tl.where((r1 >> 8).to(tl.int32) >= threshold, scale, 0.0),
        tl.where((r2 >> 8).to(tl.int32) >= threshold, scale, 0.0),
        tl.where((r3 >> 8).to(tl.int32) >= threshold, scale, 0.0),
    )


@triton.jit
def _load(ptr, offs, n, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    return tl.load(ptr + offs).to(tl.float32)


@triton.jit
def _store(ptr, offs, n, value, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=offs < n)
    else:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty))


@triton.jit
def _forward_block(x_ptr, r_ptr, out_ptr, block, n, seed, threshold, scale, Q: tl.constexpr, MASKED: tl.constexpr):
    o0 = block * (4 * Q) + tl.arange(0, Q)
    o1, o2, o3 = o0 + Q, o0 + 2 * Q, o0 + 3 * Q
    # all loads first, then the random numbers: the loads are in flight while Philox runs
    x0, x1, x2, x3 = _load(x_ptr, o0, n, MASKED), _load(x_ptr, o1, n, MASKED), _load(x_ptr, o2, n, MASKED), _load(x_ptr, o3, n, MASKED)
    r0, r1, r2, r3 = _load(r_ptr, o0, n, MASKED), _load(r_ptr, o1, n, MASKED), _load(r_ptr, o2, n, MASKED), _load(r_ptr, o3, n, MASKED)
    m0, m1, m2, m3 = _keep_scales(seed, block, threshold, scale, Q)
    _store(out_ptr, o0, n, r0 + x0 * m0, MASKED)
    _store(out_ptr, o1, n, r1 + x1 * m1, MASKED)
    _store(out_ptr, o2, n, r2 + x2 * m2, MASKED)
    _store(out_ptr, o3, n, r3 + x3 * m3, MASKED)


@triton.jit
def _backward_block(dout_ptr, dx_ptr, block, n, seed, threshold, scale, Q: tl.constexpr, MASKED: tl.constexpr):
    o0 = block * (4 * Q) + tl.arange(0, Q)
    o1, o2, o3 = o0 + Q, o0 + 2 * Q, o0 + 3 * Q
    d0, d1, d2, d3 = _load(dout_ptr, o0, n, MASKED), _load(dout_ptr, o1, n, MASKED), _load(dout_ptr, o2, n, MASKED), _load(dout_ptr, o3, n, MASKED)
    m0, m1, m2, m3 = _keep_scales(seed, block, threshold, scale, Q)
    _store(dx_ptr, o0, n, d0 * m0, MASKED)
    _store(dx_ptr, o1, n, d1 * m1, MASKED)
    _store(dx_ptr, o2, n, d2 * m2, MASKED)
    _store(dx_ptr, o3, n, d3 * m3, MASKED)


@triton.jit(do_not_specialize=["seed"])
def _dropout_add_forward(x_ptr, r_ptr, out_ptr, n, seed, threshold, scale, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    if (block + 1) * BLOCK <= n:
        _forward_block(x_ptr, r_ptr, out_ptr, block, n, seed, threshold, scale, BLOCK // 4, False)
    else:
        _forward_block(x_ptr, r_ptr, out_ptr, block, n, seed, threshold, scale, BLOCK // 4, True)


@triton.jit(do_not_specialize=["seed"])
def _dropout_add_backward(dout_ptr, dx_ptr, n, seed, threshold, scale, BLOCK: tl.constexpr):
    block = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)  # last block first: the tail of dout is in L2
    if (block + 1) * BLOCK <= n:
        _backward_block(dout_ptr, dx_ptr, block, n, seed, threshold, scale, BLOCK // 4, False)
    else:
        _backward_block(dout_ptr, dx_ptr, block, n, seed, threshold, scale, BLOCK // 4, True)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def forward(x: torch.Tensor, residual: torch.Tensor, p: float, seed: int, warps: int = WARPS) -> torch.Tensor:
    x, residual = _contiguous(x), _contiguous(residual)
    out = buffers.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, BLOCK),)
    _dropout_add_forward[grid](x, residual, out, n, seed, keep_threshold(p), 1.0 / (1.0 - p), BLOCK=BLOCK, num_warps=warps)
    return out


def backward(dout: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, p: float, seed: int, out: torch.Tensor, warps: int = WARPS):
    dx = buffers.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, BLOCK),)
    _dropout_add_backward[grid](_contiguous(dout), dx, n, seed, keep_threshold(p), 1.0 / (1.0 - p), BLOCK=BLOCK, num_warps=warps)
    return dx, dout, None, None  # d residual = dout
