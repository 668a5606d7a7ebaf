"""silu_attention's TileLang backward: the dk/dv, dq and bias-gradient kernel builders and their launcher (see
tilelang.py). Each kernel recomputes its score tiles with the forward's code (tilelang_scores.py: the same guarded
copies, staged biases, biased score, visibility and dropout call), then, in fp32 on the tile:

    a  = silu(s) / max_seqlen (x 1 / (1 - p) where kept), zero where not visible or dropped
    ds = (do v^T) * silu'(s) / max_seqlen (x 1 / (1 - p)), zero likewise;  silu'(s) = sig (1 + s (1 - sig))

As in the forward, the head's time-bias row goes to shared memory once per program, and the tile's timestamps and
the 2 * 64 - 1 position-bias entries its distances reach once per tile (the bias kernel's band has one distance
table for all its tiles); silu and silu' come from one tanh.approx (sig = 0.5 + 0.5 tanh(s / 2)), the same bits of
a as the forward's. The visibility mask runs only on the tiles edge_tile() names (straddling the diagonal, the
sequence's end or the first candidate; every tile with dropout). Elsewhere nothing needs hiding, including rows and
columns past the sequence: their Q/K/V/dO read as zero, so dp = dO V^T is zero there and so is ds (dq, dk, the bias
sums), and a, which is not zero there, meets only zero dO rows in dv += a dO (dk/dv) or is never formed (dq, bias).
"""

import tilelang.language as T
import torch

from .. import buffers
from ..flash_attention.tilelang_dropout import SEED, dropout_args
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, Unchecked, check_program_count, launcher, placeholder, program_of
from .bias_folds import fold_distances
from .tilelang_forward import _fp32_bias, _rows
from .tilelang_scores import (
    BLOCK_M,
    BLOCK_N,
    MAX_TIME_BUCKETS,
    N_DIST,
    THREADS,
    Tables,
    Visibility,
    biased_score,
    dsilu_scaled,
    edge_tile,
    padded_dim,
    prelude,
    silu_scaled,
    stage_position_bias,
    stage_time_row,
    stage_timestamps,
    time_bucket,
    visible,
)

BLOCK_B = 64  # the bias kernel's square tiles: 2 * BLOCK_B diagonal slots, one per thread
TIME_SLOTS = 64  # per-band time-gradient slots: buckets 0..62 (MAX_TIME_BUCKETS) and one never reached
# the bias kernel's tiles index the staged position bias as the others' do (tilelang_scores.N_DIST)
assert THREADS == 2 * BLOCK_B and BLOCK_B == BLOCK_M == BLOCK_N
assert TIME_SLOTS <= THREADS and MAX_TIME_BUCKETS < TIME_SLOTS


@T.macro
def _score_grads(ds, s, dp, tables, vis, q0, k0, scale, masked: bool):
    """ds = dp * silu'(biased s) * scale in ds's dtype on [queries i, keys j] tiles, zero where not visible (masked)
    or everywhere visible."""
    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
        x = biased_score(tables, s[i, j], i, j)
        if masked:
            ds[i, j] = T.if_then_else(
                visible(vis, q0, k0, i, j), T.cast(dp[i, j] * dsilu_scaled(x, scale), ds.dtype), T.cast(0, ds.dtype)
            )
        else:
            ds[i, j] = T.cast(dp[i, j] * dsilu_scaled(x, scale), ds.dtype)


@T.macro
def _score_grads_transposed(a, ds, s, dp, tables, vis, q0, k0, scale, masked: bool):
    """a = silu(biased s) * scale and ds as _score_grads on [keys j, queries i] tiles."""
    for j, i in T.Parallel(BLOCK_N, BLOCK_M):
        x = biased_score(tables, s[j, i], i, j)
        if masked:  # a tanh under each condition (edge tiles only): one for both took 28 more registers
            seen = visible(vis, q0, k0, i, j)
            a[j, i] = T.if_then_else(seen, T.cast(silu_scaled(x, scale), a.dtype), T.cast(0, a.dtype))
            ds[j, i] = T.if_then_else(seen, T.cast(dp[j, i] * dsilu_scaled(x, scale), ds.dtype), T.cast(0, ds.dtype))
        else:
            a[j, i] = T.cast(silu_scaled(x, scale), a.dtype)
            ds[j, i] = T.cast(dp[j, i] * dsilu_scaled(x, scale), ds.dtype)


def _signature():
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = T.dynamic(
        "total, heads, n_offsets, n_counts, pos_heads, pos_len, time_heads, time_len, n_times"
    )
    return total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times


def dkdv_kernel(dim: int, dtype: str, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool):
    """One program per (key block, head, sequence): loops over the query blocks that can see the key block; tiles are
    [keys, queries] so that dk += ds Q and dv += a dO take the fragments as A operands."""
    bM, bN = BLOCK_M, BLOCK_N
    dp = padded_dim(dim)
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = _signature()

    @T.prim_func
    def silu_attention_bwd_dkdv(
        Q: T.Tensor((total, heads, dim), dtype),
        K: T.Tensor((total, heads, dim), dtype),
        V: T.Tensor((total, heads, dim), dtype),
        dO: T.Tensor((total, heads, dim), dtype),
        CU: T.Tensor((n_offsets,), "int32"),
        NT: T.Tensor((n_counts,), "int32"),
        PB: T.Tensor((ph, p_len), ACCUM),
        TB: T.Tensor((th, t_len), ACCUM),
        TS: T.Tensor((n_times,), "int64"),
        dK: T.Tensor((total, heads, dim), dtype),
        dV: T.Tensor((total, heads, dim), dtype),
        n_blocks: T.int32,
        alpha: T.float32,
        inv_max: T.float32,
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        inv_keep: T.float32,
    ):
        with T.Kernel(n_blocks * heads * (n_offsets - 1), threads=THREADS, prelude=prelude(time, dropout)) as pid:
            bx, by, bz = program_of(pid, n_blocks, heads)
            K_s = T.alloc_shared((bN, dp), dtype)
            V_s = T.alloc_shared((bN, dp), dtype)
            Q_s = T.alloc_shared((bM, dp), dtype)
            dO_s = T.alloc_shared((bM, dp), dtype)
            pb_s = T.alloc_shared((N_DIST,), ACCUM)
            tb_s = T.alloc_shared((MAX_TIME_BUCKETS + 1,), ACCUM)
            tq_s = T.alloc_shared((bM,), "int64")
            tk_s = T.alloc_shared((bN,), "int64")
            s = T.alloc_fragment((bN, bM), ACCUM)  # scores, transposed: keys x queries
            dpt = T.alloc_fragment((bN, bM), ACCUM)  # V dO^T
            a = T.alloc_fragment((bN, bM), dtype)
            ds = T.alloc_fragment((bN, bM), dtype)
            dk = T.alloc_fragment((bN, dp), ACCUM)
            dv = T.alloc_fragment((bN, dp), ACCUM)

            start = CU[bz]
            n = CU[bz + 1] - start
            first_target = n - NT[bz] if targets else n
            k0 = bx * bN
            seed = T.cast(Seed[0], "int32") if dropout else 0
            t_eff = T.min(t_len, MAX_TIME_BUCKETS)
            scale = inv_max * inv_keep if dropout else inv_max
            tables = Tables(pb_s, tb_s, tq_s, tk_s, alpha, t_eff, pos, time)
            vis = Visibility(n, first_target, causal, targets, dropout, seed, bz * heads + by, threshold)
            # causal: query blocks before this key block see none of it; a block past the sequence's end loops none
            m_first = k0 // bM if causal else 0
            n_steps = T.if_then_else(k0 < n, T.ceildiv(n, bM) - m_first, 0)

            for j, d in T.Parallel(bN, dp):
                K_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), K[start + k0 + j, by, d], T.cast(0, dtype))
                V_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), V[start + k0 + j, by, d], T.cast(0, dtype))
            if time:
                stage_time_row(tb_s, TB, by, t_eff)
                stage_timestamps(tk_s, TS, start, k0, n)
            T.fill(dk, 0)
            T.fill(dv, 0)
            for step in T.serial(n_steps):
                q0 = (m_first + step) * bM
                for i, d in T.Parallel(bM, dp):
                    Q_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), Q[start + q0 + i, by, d], T.cast(0, dtype))
                    dO_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), dO[start + q0 + i, by, d], T.cast(0, dtype))
                if pos:
                    stage_position_bias(pb_s, PB, by, q0, k0, p_len)
                if time:
                    stage_timestamps(tq_s, TS, start, q0, n)
                T.gemm(K_s, Q_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(V_s, dO_s, dpt, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                # query rows past the sequence: dO and Q read as zero, so a dO and ds Q add nothing
                if edge_tile(vis, q0, k0):
                    _score_grads_transposed(a, ds, s, dpt, tables, vis, q0, k0, scale, True)
                else:
                    _score_grads_transposed(a, ds, s, dpt, tables, vis, q0, k0, scale, False)
                T.gemm(a, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(ds, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)
            for j, d in T.Parallel(bN, dp):
                if (k0 + j < n) and (d < dim):
                    dK[start + k0 + j, by, d] = T.cast(dk[j, d] * alpha, dtype)
                    dV[start + k0 + j, by, d] = T.cast(dv[j, d], dtype)

    return silu_attention_bwd_dkdv


def dq_kernel(dim: int, dtype: str, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool):
    """One program per (query block, head, sequence), the forward's grid: loops over the key blocks it sees."""
    bM, bN = BLOCK_M, BLOCK_N
    dp = padded_dim(dim)
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = _signature()

    @T.prim_func
    def silu_attention_bwd_dq(
        Q: T.Tensor((total, heads, dim), dtype),
        K: T.Tensor((total, heads, dim), dtype),
        V: T.Tensor((total, heads, dim), dtype),
        dO: T.Tensor((total, heads, dim), dtype),
        CU: T.Tensor((n_offsets,), "int32"),
        NT: T.Tensor((n_counts,), "int32"),
        PB: T.Tensor((ph, p_len), ACCUM),
        TB: T.Tensor((th, t_len), ACCUM),
        TS: T.Tensor((n_times,), "int64"),
        dQ: T.Tensor((total, heads, dim), dtype),
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
            dO_s = T.alloc_shared((bM, dp), dtype)
            K_s = T.alloc_shared((bN, dp), dtype)
            V_s = T.alloc_shared((bN, dp), dtype)
            pb_s = T.alloc_shared((N_DIST,), ACCUM)
            tb_s = T.alloc_shared((MAX_TIME_BUCKETS + 1,), ACCUM)
            tq_s = T.alloc_shared((bM,), "int64")
            tk_s = T.alloc_shared((bN,), "int64")
            s = T.alloc_fragment((bM, bN), ACCUM)
            dpm = T.alloc_fragment((bM, bN), ACCUM)  # dO V^T
            ds = T.alloc_fragment((bM, bN), dtype)
            dq = T.alloc_fragment((bM, dp), ACCUM)

            start = CU[bz]
            n = CU[bz + 1] - start
            first_target = n - NT[bz] if targets else n
            q0 = bx * bM
            seed = T.cast(Seed[0], "int32") if dropout else 0
            t_eff = T.min(t_len, MAX_TIME_BUCKETS)
            scale = inv_max * inv_keep if dropout else inv_max
            tables = Tables(pb_s, tb_s, tq_s, tk_s, alpha, t_eff, pos, time)
            vis = Visibility(n, first_target, causal, targets, dropout, seed, bz * heads + by, threshold)
            seen = T.min(n, q0 + bM) if causal else n
            n_key_blocks = T.if_then_else(q0 < n, T.ceildiv(seen, bN), 0)

            for i, d in T.Parallel(bM, dp):
                Q_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), Q[start + q0 + i, by, d], T.cast(0, dtype))
                dO_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), dO[start + q0 + i, by, d], T.cast(0, dtype))
            if time:
                stage_time_row(tb_s, TB, by, t_eff)
                stage_timestamps(tq_s, TS, start, q0, n)
            T.fill(dq, 0)
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
                T.gemm(dO_s, V_s, dpm, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                # query rows past the sequence are never stored
                if edge_tile(vis, q0, k0):
                    _score_grads(ds, s, dpm, tables, vis, q0, k0, scale, True)
                else:
                    _score_grads(ds, s, dpm, tables, vis, q0, k0, scale, False)
                T.gemm(ds, K_s, dq, policy=T.GemmWarpPolicy.FullRow)
            for i, d in T.Parallel(bM, dp):
                if (q0 + i < n) and (d < dim):
                    dQ[start + q0 + i, by, d] = T.cast(dq[i, d] * alpha, dtype)

    return silu_attention_bwd_dq


def bias_kernel(dim: int, dtype: str, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool):
    """One program per (band, head, sequence), as the Triton bias kernel: band t holds the tiles (query block mb, key
    block mb - t), t = band (causal) or band - (n_blocks - 1). Writes PosPart[sequence, head, band, u], the sum of ds
    over the band's diagonals i - j = t * BLOCK_B + u - (BLOCK_B - 1) (thread u walks diagonal u, in row order), and
    TimePart[sequence, head, band, b], the sum of ds per time bucket b (thread r adds row r's elements in column
    order into its own row of a shared histogram; thread b then adds bucket b's column in row order): fixed orders,
    no atomics."""
    bB = BLOCK_B
    dp = padded_dim(dim)
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = _signature()
    n_seqs, n_bands = T.dynamic("n_seqs, n_bands")

    @T.prim_func
    def silu_attention_bwd_bias(
        Q: T.Tensor((total, heads, dim), dtype),
        K: T.Tensor((total, heads, dim), dtype),
        V: T.Tensor((total, heads, dim), dtype),
        dO: T.Tensor((total, heads, dim), dtype),
        CU: T.Tensor((n_offsets,), "int32"),
        NT: T.Tensor((n_counts,), "int32"),
        PB: T.Tensor((ph, p_len), ACCUM),
        TB: T.Tensor((th, t_len), ACCUM),
        TS: T.Tensor((n_times,), "int64"),
        PosPart: T.Tensor((n_seqs, heads, n_bands, 2 * bB), ACCUM),
        TimePart: T.Tensor((n_seqs, heads, n_bands, TIME_SLOTS), ACCUM),
        n_blocks: T.int32,
        alpha: T.float32,
        inv_max: T.float32,
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        inv_keep: T.float32,
    ):
        with T.Kernel(n_bands * heads * (n_offsets - 1), threads=THREADS, prelude=prelude(time, dropout)) as pid:
            bx, by, bz = program_of(pid, n_bands, heads)
            Q_s = T.alloc_shared((bB, dp), dtype)
            dO_s = T.alloc_shared((bB, dp), dtype)
            K_s = T.alloc_shared((bB, dp), dtype)
            V_s = T.alloc_shared((bB, dp), dtype)
            # rows padded by one column: a thread per row (histogram) or per diagonal reads without bank conflicts
            ds_s = T.alloc_shared((bB, bB + 1), ACCUM)
            # the epilogue writes a fragment, copied to ds_s after: written there directly, next to the staged tables'
            # reads, it took a barrier per element (ThreadSync sees one shared buffer)
            ds = T.alloc_fragment((bB, bB), ACCUM)
            hist_s = T.alloc_shared((bB, TIME_SLOTS + 1), ACCUM)
            pb_s = T.alloc_shared((N_DIST,), ACCUM)
            tb_s = T.alloc_shared((MAX_TIME_BUCKETS + 1,), ACCUM)
            tq_s = T.alloc_shared((bB,), "int64")
            tk_s = T.alloc_shared((bB,), "int64")
            s = T.alloc_fragment((bB, bB), ACCUM)
            dpm = T.alloc_fragment((bB, bB), ACCUM)
            acc = T.alloc_local((1,), ACCUM)  # this thread's diagonal (position) or bucket (time)
            tq = T.alloc_local((1,), "int64")

            tx = T.get_thread_binding()
            start = CU[bz]
            n = CU[bz + 1] - start
            first_target = n - NT[bz] if targets else n
            seed = T.cast(Seed[0], "int32") if dropout else 0
            t = bx if causal else bx - (n_blocks - 1)
            seq_blocks = T.ceildiv(n, bB)
            mb_first = T.max(t, 0)
            n_tiles = T.max(seq_blocks + T.min(t, 0) - mb_first, 0)
            t_eff = T.min(t_len, MAX_TIME_BUCKETS)
            scale = inv_max * inv_keep if dropout else inv_max
            tables = Tables(pb_s, tb_s, tq_s, tk_s, alpha, t_eff, pos, time)
            vis = Visibility(n, first_target, causal, targets, dropout, seed, bz * heads + by, threshold)

            if pos:  # every tile of the band has q0 - k0 = t * bB: one table of distances
                stage_position_bias(pb_s, PB, by, t * bB, 0, p_len)
            if time:
                stage_time_row(tb_s, TB, by, t_eff)
            acc[0] = 0.0
            if time:
                for r, b in T.Parallel(bB, TIME_SLOTS):
                    hist_s[r, b] = 0.0
            for step in T.serial(n_tiles):
                q0 = (mb_first + step) * bB
                k0 = q0 - t * bB
                for i, d in T.Parallel(bB, dp):
                    Q_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), Q[start + q0 + i, by, d], T.cast(0, dtype))
                    dO_s[i, d] = T.if_then_else((q0 + i < n) and (d < dim), dO[start + q0 + i, by, d], T.cast(0, dtype))
                for j, d in T.Parallel(bB, dp):
                    K_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), K[start + k0 + j, by, d], T.cast(0, dtype))
                    V_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), V[start + k0 + j, by, d], T.cast(0, dtype))
                if time:
                    stage_timestamps(tq_s, TS, start, q0, n)
                    stage_timestamps(tk_s, TS, start, k0, n)
                T.gemm(Q_s, K_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(dO_s, V_s, dpm, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                # every element is summed: past the sequence dO or V reads as zero, so dp and ds are zero there
                if edge_tile(vis, q0, k0):
                    _score_grads(ds, s, dpm, tables, vis, q0, k0, scale, True)
                else:
                    _score_grads(ds, s, dpm, tables, vis, q0, k0, scale, False)
                T.copy(ds, ds_s[0:bB, 0:bB])
                T.sync_threads()
                if pos:  # thread u: diagonal u, element (r, r - u + bB - 1) of each row r that holds one
                    for r in T.serial(bB):
                        if (r - tx + bB - 1 >= 0) and (r - tx + bB - 1 < bB):
                            acc[0] += ds_s[r, r - tx + bB - 1]
                if time:  # thread r < bB: row r into its histogram row
                    if tx < bB:
                        tq[0] = tq_s[tx]
                        for c in T.serial(bB):
                            hist_s[tx, time_bucket(tq[0], tk_s[c], t_eff)] += ds_s[tx, c]
                T.sync_threads()  # ds_s, tq_s and tk_s are written again by the next tile
            if pos:
                PosPart[bz, by, bx, tx] = acc[0]
            if time:
                T.sync_threads()  # the histogram's clearing, where the band holds no tile
                if tx < TIME_SLOTS:
                    acc[0] = 0.0
                    for r in T.serial(bB):
                        acc[0] += hist_s[r, tx]
                    TimePart[bz, by, bx, tx] = acc[0]

    return silu_attention_bwd_bias


# --------------------------------------------------------------------------- entries and launcher

_BUILDERS = {"dkdv": dkdv_kernel, "dq": dq_kernel, "bias": bias_kernel}


def backward_entry(
    kernel: str, dim: int, dtype: torch.dtype, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool
) -> Entry:
    """kernel: "dkdv", "dq" or "bias"."""
    key = (f"silu_attention_bwd_{kernel}", dim, dtype, causal, targets, pos, time, dropout)
    build = _BUILDERS[kernel]
    return key, lambda _: Unchecked(build(dim, TL_DTYPE[dtype], causal, targets, pos, time, dropout))


def backward(do, q, k, v, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha,
             causal, dropout_p, o=None):  # fmt: skip
    """(dq, dk, dv, None, None, dposition_bias [H, P], dtime_bias [H, T], None x 6), in the inputs' dtypes."""
    total, h, d = q.shape
    device = q.device
    dq, dk, dv = (buffers.empty((total, h, d), dtype=x.dtype, device=device) for x in (q, k, v))
    n = cu_seqlens.shape[0] - 1
    n_blocks = -(-max_seqlen // BLOCK_M)
    flags = (bool(causal), num_targets is not None, position_bias is not None, time_bias is not None, dropout_p > 0)
    threshold, inv_keep = dropout_args(dropout_p)
    tensors = (
        _rows(q), _rows(k), _rows(v), _rows(do), cu_seqlens,
        num_targets if num_targets is not None else cu_seqlens,
        _fp32_bias(position_bias, device), _fp32_bias(time_bias, device),
        timestamps if timestamps is not None else placeholder(device, torch.int64),
    )  # fmt: skip
    scalars = (float(alpha), 1.0 / max_seqlen if max_seqlen else 0.0)
    dropout_launch = (seed if seed is not None else placeholder(device, torch.int64), threshold, inv_keep)
    dpos = dtime = None
    if total and n and n_blocks:
        check_program_count(n_blocks * h * n, "cu_seqlens")
        launcher(backward_entry("dkdv", d, q.dtype, *flags), device)(
            *tensors, dk, dv, n_blocks, *scalars, *dropout_launch
        )
        launcher(backward_entry("dq", d, q.dtype, *flags), device)(*tensors, dq, n_blocks, *scalars, *dropout_launch)
    if position_bias is not None or time_bias is not None:
        dpos, dtime = _bias_gradients(
            tensors, scalars, dropout_launch, flags, position_bias, time_bias, max_seqlen, n, h
        )
    return dq, dk, dv, None, None, dpos, dtime, None, None, None, None, None, None


def _bias_gradients(tensors, scalars, dropout_launch, flags, position_bias, time_bias, max_seqlen, n, h):
    """(dposition_bias [H, P] or None, dtime_bias [H, T] or None): the bias kernel's partial sums, added over the
    sequences and folded into buckets in a fixed order (as the Triton backward does)."""
    q = tensors[0]
    causal = flags[0]
    n_blocks = -(-max_seqlen // BLOCK_B)
    n_bands = n_blocks if causal else max(2 * n_blocks - 1, 0)
    # zeros: with no band (no token) the sums below still read these
    pos_part = torch.zeros((n, h, n_bands, 2 * BLOCK_B), dtype=torch.float32, device=q.device)
    time_part = torch.zeros((n, h, n_bands, TIME_SLOTS), dtype=torch.float32, device=q.device)
    if q.shape[0] and n and n_bands:
        check_program_count(n_bands * h * n, "cu_seqlens")
        launcher(backward_entry("bias", q.shape[2], q.dtype, *flags), q.device)(
            *tensors, pos_part, time_part, n_blocks, *scalars, *dropout_launch
        )
    return reduce_bias_parts(pos_part, time_part, causal, position_bias, time_bias)


def reduce_bias_parts(pos_part, time_part, causal: bool, position_bias, time_bias):
    """(dposition_bias [H, P] or None, dtime_bias [H, T] or None) from the bias kernel's partial sums pos_part
    [N, H, bands, 2 * BLOCK_B] and time_part [N, H, bands, TIME_SLOTS] (its docstring gives their layout)."""
    dpos = dtime = None
    if position_bias is not None:
        n_bands = pos_part.shape[2]
        first_band = 0 if causal else -(n_bands // 2)  # non-causal: bands t = -(n_blocks - 1) .. n_blocks - 1
        dpos = fold_distances(pos_part.sum(0), BLOCK_B, first_band, position_bias.shape[1]).to(position_bias.dtype)
    if time_bias is not None:
        buckets = min(time_bias.shape[1], MAX_TIME_BUCKETS)
        dtime = torch.zeros(time_bias.shape, dtype=torch.float32, device=time_part.device)
        dtime[:, :buckets] = time_part.sum((0, 2))[:, :buckets]
        dtime = dtime.to(time_bias.dtype)
    return dpos, dtime
