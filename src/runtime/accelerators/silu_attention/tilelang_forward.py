"""silu_attention's TileLang forward (see tilelang.py).

One program per (query block, head, sequence): the sequence's rows come from cu_seqlens, a block past its sequence's
end stores nothing. Q/K/V tiles are copied into shared memory by the threads, guarded per element (rows past the
sequence and head-dim columns past D read as zero: D is padded to a power of two), then per key block:

    T.gemm  s = Q K^T                      (tensor cores, fp32 accumulator fragment)
    epilogue on the fragment: s = alpha s + position_bias + time_bias; a = silu(s) / max_seqlen, zero where not
            visible (causal, targets, past the sequence) or dropped; cast to the input dtype
    T.gemm  acc += a V

The epilogue is most of the kernel's instructions, so it is kept short: the head's time-bias row and the block's
query timestamps go to shared memory once per program, and per key block its timestamps and the 2 * 64 - 1
position-bias entries its distances reach; the visibility mask runs only on key blocks that straddle the diagonal,
the sequence's end or the first candidate (elsewhere every score is visible; rows past the sequence are computed,
never stored); silu is one tanh.approx. About 27 SASS instructions a score against 151 with every bias read from
global memory, every score masked and silu by expf and a division: 2.2-3.1x faster forward. That code is
tilelang_scores.py, which the backward shares.

The biases arrive as fp32 [H, P] / [H, T] tensors (the launcher expands a shared [P] bias). Dropout draws
flash_attention's counter-based hash (its CUDA prelude) with the pair index sequence * H + head and local indices,
the Triton kernels' bits. Sequence count, lengths, heads and bias sizes are dynamic: one compiled kernel per
(head dim, dtype, flags).
"""

import tilelang.language as T
import torch

from .. import buffers
from ..flash_attention.tilelang_dropout import SEED, dropout_args
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, Unchecked, check_program_count, launcher, placeholder, program_of
from .tilelang_scores import (
    BLOCK_M,
    BLOCK_N,
    MAX_TIME_BUCKETS,
    N_DIST,
    THREADS,
    Tables,
    Visibility,
    biased_score,
    edge_tile,
    padded_dim,
    prelude,
    silu_scaled,
    stage_position_bias,
    stage_time_row,
    stage_timestamps,
    visible,
)


@T.macro
def _probabilities(p, s, tables, vis, q0, k0, scale, masked: bool):
    """p = silu(biased s) * scale in p's dtype, zero where not visible (masked) or everywhere visible."""
    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
        x = biased_score(tables, s[i, j], i, j)
        if masked:
            p[i, j] = T.if_then_else(
                visible(vis, q0, k0, i, j), T.cast(silu_scaled(x, scale), p.dtype), T.cast(0, p.dtype)
            )
        else:
            p[i, j] = T.cast(silu_scaled(x, scale), p.dtype)


def forward_kernel(dim: int, dtype: str, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool):
    bM, bN = BLOCK_M, BLOCK_N
    dp = padded_dim(dim)
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = T.dynamic(
        "total, heads, n_offsets, n_counts, pos_heads, pos_len, time_heads, time_len, n_times"
    )

    @T.prim_func
    def silu_attention_fwd(
        Q: T.Tensor((total, heads, dim), dtype),
        K: T.Tensor((total, heads, dim), dtype),
        V: T.Tensor((total, heads, dim), dtype),
        CU: T.Tensor((n_offsets,), "int32"),
        NT: T.Tensor((n_counts,), "int32"),
        PB: T.Tensor((ph, p_len), ACCUM),
        TB: T.Tensor((th, t_len), ACCUM),
        TS: T.Tensor((n_times,), "int64"),
        O: T.Tensor((total, heads, dim), dtype),
        n_blocks: T.int32,
        alpha: T.float32,
        inv_max: T.float32,
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        inv_keep: T.float32,
    ):
        with T.Kernel(n_blocks * heads * (n_offsets - 1), threads=THREADS, prelude=prelude(time, dropout)) as pid:
            bx, by, bz = program_of(pid, n_blocks, heads)
            Q_s = T.alloc_shared((bM, dp), dtype)
            K_s = T.alloc_shared((bN, dp), dtype)
            V_s = T.alloc_shared((bN, dp), dtype)
            pb_s = T.alloc_shared((N_DIST,), ACCUM)
            tb_s = T.alloc_shared((MAX_TIME_BUCKETS + 1,), ACCUM)
            tq_s = T.alloc_shared((bM,), "int64")
            tk_s = T.alloc_shared((bN,), "int64")
            s = T.alloc_fragment((bM, bN), ACCUM)
            p = T.alloc_fragment((bM, bN), dtype)
            acc = T.alloc_fragment((bM, dp), ACCUM)

            start = CU[bz]
            n = CU[bz + 1] - start
            first_target = n - NT[bz] if targets else n
            q0 = bx * bM
            seed = T.cast(Seed[0], "int32") if dropout else 0
            seen = T.min(n, q0 + bM) if causal else n
            n_key_blocks = T.if_then_else(q0 < n, T.ceildiv(seen, bN), 0)
            t_eff = T.min(t_len, MAX_TIME_BUCKETS)
            scale = inv_max * inv_keep if dropout else inv_max
            tables = Tables(pb_s, tb_s, tq_s, tk_s, alpha, t_eff, pos, time)
            vis = Visibility(n, first_target, causal, targets, dropout, seed, bz * heads + by, threshold)

            for i, d in T.Parallel(bM, dp):
                Q_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), Q[start + q0 + i, by, d], T.cast(0, dtype))
            if time:
                stage_time_row(tb_s, TB, by, t_eff)
                stage_timestamps(tq_s, TS, start, q0, n)
            T.fill(acc, 0)
            for kb in T.serial(n_key_blocks):
                k0 = kb * bN
                for j, d in T.Parallel(bN, dp):
                    K_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), K[start + k0 + j, by, d], T.cast(0, dtype))
                    V_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), V[start + k0 + j, by, d], T.cast(0, dtype))
                if pos:
                    stage_position_bias(pb_s, PB, by, q0, k0, p_len)
                if time:
                    stage_timestamps(tk_s, TS, start, k0, n)
                T.gemm(Q_s, K_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                # rows past the sequence are computed, never stored
                if edge_tile(vis, q0, k0):
                    _probabilities(p, s, tables, vis, q0, k0, scale, True)
                else:
                    _probabilities(p, s, tables, vis, q0, k0, scale, False)
                T.gemm(p, V_s, acc, policy=T.GemmWarpPolicy.FullRow)
            for i, d in T.Parallel(bM, dp):
                if (q0 + i < n) and (d < dim):
                    O[start + q0 + i, by, d] = T.cast(acc[i, d], dtype)

    return silu_attention_fwd


def forward_entry(
    dim: int, dtype: torch.dtype, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool
) -> Entry:
    key = ("silu_attention_fwd", dim, dtype, causal, targets, pos, time, dropout)
    return key, lambda _: Unchecked(forward_kernel(dim, TL_DTYPE[dtype], causal, targets, pos, time, dropout))


def _fp32_bias(bias: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """An [H, size] bias view as the contiguous fp32 tensor the kernel reads, or a [1, 1] stand-in."""
    if bias is None:
        return placeholder(device).view(1, 1)
    return bias.to(torch.float32).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def forward(
    q, k, v, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha, causal, dropout_p
):
    """o [total, H, D] in q's dtype."""
    total, h, d = q.shape
    o = buffers.empty((total, h, d), dtype=q.dtype, device=q.device)
    n = cu_seqlens.shape[0] - 1
    n_blocks = -(-max_seqlen // BLOCK_M)
    if o.numel() == 0 or n == 0 or n_blocks == 0:
        return o
    check_program_count(n_blocks * h * n, "cu_seqlens")
    device = q.device
    threshold, inv_keep = dropout_args(dropout_p)
    entry = forward_entry(d, q.dtype, bool(causal), num_targets is not None, position_bias is not None,
                          time_bias is not None, dropout_p > 0)  # fmt: skip
    launcher(entry, device)(
        _rows(q), _rows(k), _rows(v), cu_seqlens,
        num_targets if num_targets is not None else cu_seqlens,
        _fp32_bias(position_bias, device), _fp32_bias(time_bias, device),
        timestamps if timestamps is not None else placeholder(device, torch.int64),
        o, n_blocks, float(alpha), 1.0 / max_seqlen,
        seed if seed is not None else placeholder(device, torch.int64), threshold, inv_keep,
    )  # fmt: skip
    return o
