"""linear's backward with the activation's derivative in the prologue of the dx GEMM (Triton).

dx = d_preact @ w, where d_preact = dy * act'(z) (for swiglu [d_gate, d_up] against the gate and up rows of w). A
program owns a block_m x block_k tile of dx and walks the weight's rows in block_n steps: it loads dy and z (y for
relu) for its rows, forms d_preact in registers, rounds it to the input dtype (as the elementwise pass stores it) and
multiplies it with the matching [block_n, block_k] tile of w. The programs of the first K block also store d_preact
(dw = d_preact^T @ x reads it, by cuBLAS) and the column sums of their rows (the dbias partials, [row blocks, N]
fp32, added up by torch). Against the elementwise pass and a cuBLAS dx GEMM this saves the GEMM's read of d_preact
and a launch; where K is wider than block_k the other K blocks form d_preact again from dy and z.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from .launch import GemmConfig, fused_dx_config
from .triton_activations import ACTIVATION_CODES, SWIGLU, _preact_gradient_tile


@triton.jit
def _times_weight(acc, dz, w_ptr, rows_of_w, ks, in_n, in_k, K):
    """acc + dz [BLOCK_M, BLOCK_N] (fp32, rounded here to w's dtype) @ w[rows_of_w, ks] ([BLOCK_N, BLOCK_K])."""
    w = tl.load(
        w_ptr + rows_of_w.to(tl.int64)[:, None] * K + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0
    )
    return tl.dot(dz.to(w_ptr.dtype.element_ty), w, acc)


@direct_launch
@triton.jit
def _linear_backward_dx(
    dy_ptr, z_ptr, y_ptr, w_ptr, dx_ptr, dz_ptr, partial_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (row block, K block): dx[rows, ks] over N in BLOCK_N steps; the first K block's programs also store
    d_preact and partial[row block, :] (N: the columns of dy, F for swiglu, whose z, d_preact and w have 2N)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_m = rows < M
    in_k = ks < K
    row_offsets = rows.to(tl.int64)[:, None]
    width = 2 * N if ACT == SWIGLU else N
    first = pid_k == 0
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        in_n = cols < N
        mask = in_m[:, None] & in_n[None, :]
        dz, du = _preact_gradient_tile(dy_ptr, z_ptr, y_ptr, row_offsets, cols, mask, N, ACT)
        acc = _times_weight(acc, dz, w_ptr, cols, ks, in_n, in_k, K)
        if ACT == SWIGLU:
            acc = _times_weight(acc, du, w_ptr, N + cols, ks, in_n, in_k, K)
        if first:
            dz_ptrs = dz_ptr + row_offsets * width + cols[None, :]
            tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
            if HAS_BIAS:
                tl.store(partial_ptr + pid_m * width + cols, tl.sum(dz, axis=0), mask=in_n)
            if ACT == SWIGLU:
                tl.store(dz_ptrs + N, du.to(dz_ptr.dtype.element_ty), mask=mask)
                if HAS_BIAS:
                    tl.store(partial_ptr + pid_m * width + N + cols, tl.sum(du, axis=0), mask=in_n)
    tl.store(
        dx_ptr + row_offsets * K + ks[None, :], acc.to(dx_ptr.dtype.element_ty), mask=in_m[:, None] & in_k[None, :]
    )


def dx_and_preact_gradient(
    dy: torch.Tensor, z: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, activation: str, with_bias: bool,
    cfg: GemmConfig | None = None,
):  # fmt: skip
    """(dx [M, K], d_preact [M, weight rows], dbias [weight rows] fp32 or None) from dy [M, N] and what the forward
    saved (z, or y for relu), in one kernel; cfg: its tiles (None: fused_dx_config)."""
    m, n = dy.shape
    k = weight.shape[1]
    width = 2 * n if activation == "swiglu" else n
    cfg = cfg or fused_dx_config(m, n, k, activation == "swiglu")
    row_blocks = cdiv(m, cfg.block_m)
    dx = buffers.empty((m, k), dtype=dy.dtype, device=dy.device)
    dz = buffers.empty((m, width), dtype=dy.dtype, device=dy.device)
    partial = buffers.empty((row_blocks, width), dtype=torch.float32, device=dy.device) if with_bias else dz
    _linear_backward_dx[(row_blocks, cdiv(k, cfg.block_k))](
        dy, z if activation != "relu" else dy, y if activation == "relu" else dy, weight, dx, dz, partial, m, n, k,
        HAS_BIAS=with_bias, ACT=ACTIVATION_CODES[activation], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return dx, dz, partial.sum(0) if with_bias else None
