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
never stored); silu is one tanh.approx (FAST_SILU_PRELUDE). About 27 SASS instructions a score against 151 with
every bias read from global memory, every score masked and silu by expf and a division: 2.2-3.1x faster forward.

The biases arrive as fp32 [H, P] / [H, T] tensors (the launcher expands a shared [P] bias). Dropout draws
flash_attention's counter-based hash (its CUDA prelude) with the pair index sequence * H + head and local indices,
the Triton kernels' bits. Sequence count, lengths, heads and bias sizes are dynamic: one compiled kernel per
(head dim, dtype, flags).
"""

import tilelang.language as T
import torch

from .. import buffers
from ..flash_attention.tilelang_dropout import DROPOUT_PRELUDE, SEED, dropout_args, dropout_keep
from ..launch_math import next_power_of_2
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, Unchecked, check_program_count, launcher, placeholder, program_of

BLOCK_M, BLOCK_N, THREADS = 64, 64, 128
MAX_TIME_BUCKETS = 63  # floor(log2(1 + |dt|)) <= 62 for |dt| < 2^63 - 1


# The time bucket as a CUDA helper in the kernel's prelude: written as a TileLang expression, its repeated
# subexpressions (the int64 difference in the log2 and its corrections) left TileLang's simplifier running for minutes.
TIME_BUCKET_PRELUDE = """
// min(floor(log2(1 + |dt|)), n_buckets - 1) for int64 timestamps: 63 - clz is floor(log2) of a positive integer
__device__ __forceinline__ int taac_time_bucket(long long tq, long long tk, int n_buckets) {
  unsigned long long x = (unsigned long long)(tq > tk ? tq - tk : tk - tq) + 1ull;
  int b = 63 - __clzll((long long)x);
  return b < n_buckets - 1 ? b : n_buckets - 1;
}
"""


def _time_bucket(tq, tk, n_buckets):
    return T.call_pure_extern("int32", "taac_time_bucket", tq, tk, n_buckets)


# silu(x) * scale with one MUFU op (tanh.approx.f32, max relative error about 2^-11, below bf16's
# rounding) instead of expf's range reduction, MUFU.EX2, an IEEE division (MUFU.RCP, FCHK, a slow-path call)
FAST_SILU_PRELUDE = """
__device__ __forceinline__ float taac_silu_scaled(float x, float scale) {
  float h = 0.5f * x, t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(h));
  return fmaf(h, t, h) * scale;  // x * sigmoid(x) = h + h tanh(h), h = x / 2
}
"""


def _silu_scaled(x, scale):
    return T.call_pure_extern("float32", "taac_silu_scaled", x, scale)


def _biased(score, alpha, i, j, pb_s, tb_s, tq_s, tk_s, t_eff, pos: bool, time: bool):
    """alpha * score plus the biases of a tile's query i and key j, from the shared-memory tables (pb_s by
    i - j + BLOCK_N - 1)."""
    x = score * alpha
    if pos:
        x = x + pb_s[i - j + BLOCK_N - 1]
    if time:
        x = x + tb_s[_time_bucket(tq_s[i], tk_s[j], t_eff)]
    return x


def padded_dim(dim: int) -> int:
    """The head dim of the kernels' tiles: a power of two, at least 16 (the extra columns read as zero)."""
    return max(16, next_power_of_2(dim))


def forward_kernel(dim: int, dtype: str, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool):
    bM, bN = BLOCK_M, BLOCK_N
    assert bM == bN  # the causal diagonal lies in the last key block only
    dp = padded_dim(dim)
    n_dist = bM + bN  # distances i - j + bN - 1 of a tile: 0 .. bM + bN - 2 (one slot unused)
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = T.dynamic(
        "total, heads, n_offsets, n_counts, pos_heads, pos_len, time_heads, time_len, n_times"
    )

    prelude = (DROPOUT_PRELUDE if dropout else "") + (TIME_BUCKET_PRELUDE if time else "") + FAST_SILU_PRELUDE

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
        with T.Kernel(n_blocks * heads * (n_offsets - 1), threads=THREADS, prelude=prelude) as pid:
            bx, by, bz = program_of(pid, n_blocks, heads)
            Q_s = T.alloc_shared((bM, dp), dtype)
            K_s = T.alloc_shared((bN, dp), dtype)
            V_s = T.alloc_shared((bN, dp), dtype)
            pb_s = T.alloc_shared((n_dist,), ACCUM)  # this key block's position bias by i - j + bN - 1
            tb_s = T.alloc_shared((MAX_TIME_BUCKETS + 1,), ACCUM)  # the head's time-bias row
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

            for i, d in T.Parallel(bM, dp):
                Q_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), Q[start + q0 + i, by, d], T.cast(0, dtype))
            if time:
                for b in T.Parallel(MAX_TIME_BUCKETS + 1):
                    tb_s[b] = TB[by, T.min(b, t_eff - 1)]
                for i in T.Parallel(bM):
                    tq_s[i] = TS[start + T.if_then_else(q0 + i < n, q0 + i, 0)]
            T.fill(acc, 0)
            for kb in T.serial(n_key_blocks):
                k0 = kb * bN
                for j, d in T.Parallel(bN, dp):
                    K_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), K[start + k0 + j, by, d], T.cast(0, dtype))
                    V_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), V[start + k0 + j, by, d], T.cast(0, dtype))
                if pos:
                    for u in T.Parallel(n_dist):
                        pb_s[u] = PB[by, T.min(T.abs(q0 - k0 + u - (bN - 1)), p_len - 1)]
                if time:
                    for j in T.Parallel(bN):
                        tk_s[j] = TS[start + T.if_then_else(k0 + j < n, k0 + j, 0)]
                T.gemm(Q_s, K_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                # conditions inline (flash_attention's forward: a thread-dependent boolean name breaks ThreadSync)
                if dropout or (k0 + bN > n) or (causal and k0 + bN > q0 + 1) or (targets and k0 + bN > first_target):
                    for i, j in T.Parallel(bM, bN):
                        x = _biased(s[i, j], alpha, i, j, pb_s, tb_s, tq_s, tk_s, t_eff, pos, time)
                        visible = k0 + j < n
                        if causal:
                            visible = visible and (k0 + j <= q0 + i)
                        if targets:
                            visible = visible and ((k0 + j < first_target) or (q0 + i == k0 + j))
                        if dropout:
                            visible = visible and dropout_keep(seed, bz * heads + by, q0, k0, i, j, threshold)
                        p[i, j] = T.if_then_else(visible, T.cast(_silu_scaled(x, scale), dtype), T.cast(0, dtype))
                else:  # every score visible (rows past the sequence are never stored)
                    for i, j in T.Parallel(bM, bN):
                        x = _biased(s[i, j], alpha, i, j, pb_s, tb_s, tq_s, tk_s, t_eff, pos, time)
                        p[i, j] = T.cast(_silu_scaled(x, scale), dtype)
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
