"""silu_attention's TileLang backward: the dk/dv (with the bias-gradient sums) and dq kernel builders and their
launcher (see tilelang.py). Each kernel recomputes its score tiles with the forward's code (tilelang_scores.py: the
same guarded copies, staged biases, biased score, visibility and dropout call), then, in fp32 on the tile:

    a  = silu(s) / max_seqlen (x 1 / (1 - p) where kept), zero where not visible or dropped
    ds = (do v^T) * silu'(s) / max_seqlen (x 1 / (1 - p)), zero likewise;  silu'(s) = sig (1 + s (1 - sig))

As in the forward, the head's time-bias row goes to shared memory once per program, and the tile's timestamps and
the 2 * 64 - 1 position-bias entries its distances reach once per tile; silu and silu' come from one tanh.approx
(sig = 0.5 + 0.5 tanh(s / 2)), the same bits of a as the forward's. The visibility mask runs only on the tiles
edge_tile() names (straddling the diagonal, the sequence's end or the first candidate; every tile with dropout).
Elsewhere nothing needs hiding, including rows and columns past the sequence: their Q/K/V/dO read as zero, so
dp = dO V^T is zero there and so is ds (dq, dk, the bias sums), and a, which is not zero there, meets only zero dO
rows in dv += a dO (dk/dv) or is never formed (dq).
"""

from typing import NamedTuple

import tilelang.language as T
import torch

from .. import buffers
from ..flash_attention.tilelang_dropout import SEED, dropout_args
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, Unchecked, check_program_count, launcher, placeholder, program_of
from .bias_folds import fold_flat_distances
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
    visible,
)

# The histogram as a CUDA helper: written in TileLang, its read-modify-write of a computed shared index got a barrier
# per element (ThreadSync cannot tell that each thread keeps to its own row). Runs of equal buckets (timestamps
# rising along the sequence) are added in a register first: fewer dependent shared-memory round trips.
TIME_HISTOGRAM_PRELUDE = """
// adds the 64 entries of ds (one key's row of a tile, queries in order) into hist by time bucket, in a fixed order
template <class Grad>
__device__ __forceinline__ void taac_time_histogram_row(float* __restrict__ hist, const Grad* __restrict__ ds,
                                                        const int64_t* __restrict__ tq, int64_t tk, int n_buckets) {
  int bucket = taac_time_bucket(tq[0], tk, n_buckets);
  float run = static_cast<float>(ds[0]);
  for (int i = 1; i < 64; ++i) {
    int b = taac_time_bucket(tq[i], tk, n_buckets);
    if (b != bucket) {
      hist[bucket] += run;
      bucket = b;
      run = 0.0f;
    }
    run += static_cast<float>(ds[i]);
  }
  hist[bucket] += run;
}
"""
TIME_SLOTS = 64  # per-program time-gradient slots: buckets 0..62 (MAX_TIME_BUCKETS) and one never reached
# the bias sums: thread u < BLOCK_N walks diagonals u and u + BLOCK_N of a tile, thread BLOCK_N + r its key row r
assert THREADS == 2 * BLOCK_N and BLOCK_M == BLOCK_N
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


def query_steps(causal: bool, k0, n):
    """(first query block, number of query blocks) a dk/dv program from key k0 loops over: causal, the blocks before
    its key block see none of it; a key block past the sequence's end loops over none."""
    m_first = k0 // BLOCK_M if causal else 0
    return m_first, T.if_then_else(k0 < n, T.ceildiv(n, BLOCK_M) - m_first, 0)


class BiasSums(NamedTuple):
    """A dk/dv program's bias-gradient state: the tile's ds in shared memory ([keys, queries], rows padded to an odd
    number of words against bank conflicts), the time histogram (a row per key row), the flat outputs and this
    program's offsets into them, and per-thread registers.

    ds_s holds ds as the dk product takes it, in the inputs' dtype, added in fp32: keeping the fp32 ds of the
    epilogue for it (a fragment copied after, or stored from the epilogue) took 30-40 more registers (D=32: 161 ->
    195-204, three blocks an SM -> two). The sums then round each ds as dk's product does (bf16: 2^-9 relative)."""

    ds_s: object
    hist_s: object
    PosPart: object
    TimePart: object
    pos_row: object
    time_row: object
    lo: object
    hi: object
    carry: object
    pos: bool
    time: bool


def bias_sums(pos: bool, time: bool, PosPart, TimePart, program, n_blocks, dtype: str) -> BiasSums:
    """Allocates a program's BiasSums (inside T.Kernel); program: its index (sequence * heads + head) * n_blocks +
    key block; dtype: ds's (the inputs')."""
    return BiasSums(
        T.alloc_shared((BLOCK_N, BLOCK_M + 2), dtype),
        T.alloc_shared((BLOCK_N, TIME_SLOTS + 1), ACCUM) if time else None,
        PosPart,
        TimePart,
        T.cast(program, "int64") * ((n_blocks + 1) * BLOCK_N),
        T.cast(program, "int64") * TIME_SLOTS,
        T.alloc_local((1,), ACCUM),
        T.alloc_local((1,), ACCUM),
        T.alloc_local((1,), ACCUM),
        pos,
        time,
    )


@T.macro
def bias_sums_begin(b: BiasSums):
    b.carry[0] = 0.0
    if b.time:
        for r, c in T.Parallel(BLOCK_N, TIME_SLOTS):
            b.hist_s[r, c] = 0.0


@T.macro
def bias_sums_add_tile(b: BiasSums, tq_s, tk_s, t_eff, step):
    """Adds the tile in b.ds_s (written and synchronised by the caller), step `step` of the program's loop.

    Position: diagonal u of a [keys j, queries i] tile holds i - j = u - (BLOCK_N - 1); thread u < BLOCK_N walks
    the rows j in order, whose element in column (j + u + 1) mod BLOCK_N lies on diagonal u (where j + u + 1 wraps)
    or u + BLOCK_N (where not): 64 elements a thread. The next tile's distances start BLOCK_N further, so diagonal
    u + BLOCK_N here continues as diagonal u there: slot `step` of the program's row gets this tile's diagonal u plus
    the previous tile's u + BLOCK_N, and the last slot the last tile's upper half.
    Time: thread BLOCK_N + r adds key row r into row r of the histogram (TIME_HISTOGRAM_PRELUDE)."""
    tx = T.get_thread_binding()
    # one if-else: as two ifs, ThreadSync put a barrier between them and the halves ran one after the other
    if tx < BLOCK_N:
        if b.pos:
            b.lo[0] = 0.0
            b.hi[0] = 0.0
            for j in T.serial(BLOCK_N):
                x = T.cast(b.ds_s[j, (j + tx + 1) % BLOCK_N], ACCUM)
                wraps = j + tx + 1 >= BLOCK_N
                b.lo[0] += T.if_then_else(wraps, x, T.float32(0))
                b.hi[0] += T.if_then_else(wraps, T.float32(0), x)
            b.PosPart[b.pos_row + step * BLOCK_N + tx] = b.lo[0] + b.carry[0]
            b.carry[0] = b.hi[0]
    else:
        if b.time:
            T.call_extern(
                "handle",
                "taac_time_histogram_row",
                T.access_ptr(b.hist_s[tx - BLOCK_N, 0], "rw", TIME_SLOTS),
                T.access_ptr(b.ds_s[tx - BLOCK_N, 0], "r", BLOCK_M),
                T.access_ptr(tq_s[0], "r", BLOCK_M),
                tk_s[tx - BLOCK_N],
                t_eff,
            )
    T.sync_threads()  # ds_s and the timestamps are written again for the next tile


@T.macro
def bias_sums_end(b: BiasSums, n_steps, n_blocks):
    """Writes the program's last slots: the last tile's upper diagonals, zeros past them (a row has n_blocks + 1
    slots), and the histogram's columns added in row order."""
    tx = T.get_thread_binding()
    if b.pos:
        if tx < BLOCK_N:
            b.PosPart[b.pos_row + n_steps * BLOCK_N + tx] = b.carry[0]
            for e in T.serial(n_blocks - n_steps):
                b.PosPart[b.pos_row + (n_steps + 1 + e) * BLOCK_N + tx] = T.float32(0)
    if b.time:
        T.sync_threads()  # the histogram's clearing, where the program has no tile
        if tx < TIME_SLOTS:
            b.lo[0] = 0.0
            for r in T.serial(BLOCK_N):
                b.lo[0] += b.hist_s[r, tx]
            b.TimePart[b.time_row + tx] = b.lo[0]


def _signature():
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = T.dynamic(
        "total, heads, n_offsets, n_counts, pos_heads, pos_len, time_heads, time_len, n_times"
    )
    return total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times


def dkdv_kernel(dim: int, dtype: str, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool):
    """One program per (key block, head, sequence): loops over the query blocks that can see the key block; tiles are
    [keys, queries] so that dk += ds Q and dv += a dO take the fragments as A operands. With a bias it also writes
    the bias gradients' partial sums of its key block (flat, program by program): PosPart[program, slot, v] (n_blocks
    + 1 slots of BLOCK_N), the sum of ds over distance i - j = (q0 of the slot's step - k0) + v - (BLOCK_N - 1)
    (slot n_steps: the previous step's q0 + BLOCK_N), and TimePart[program, b], the sum of ds per time bucket b
    (bias_sums_add_tile gives the orders; no atomics)."""
    bM, bN = BLOCK_M, BLOCK_N
    dp = padded_dim(dim)
    total, heads, n_offsets, n_counts, ph, p_len, th, t_len, n_times = _signature()
    pos_part_len, time_part_len = T.dynamic("pos_part_len, time_part_len")
    bias = pos or time

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
        PosPart: T.Tensor((pos_part_len,), ACCUM),
        TimePart: T.Tensor((time_part_len,), ACCUM),
        n_blocks: T.int32,
        alpha: T.float32,
        inv_max: T.float32,
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        inv_keep: T.float32,
    ):
        code = prelude(time, dropout) + (TIME_HISTOGRAM_PRELUDE if time else "")
        with T.Kernel(n_blocks * heads * (n_offsets - 1), threads=THREADS, prelude=code) as pid:
            bx, by, bz = program_of(pid, n_blocks, heads)
            if bias:
                sums = bias_sums(pos, time, PosPart, TimePart, (bz * heads + by) * n_blocks + bx, n_blocks, dtype)
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
            m_first, n_steps = query_steps(causal, k0, n)

            for j, d in T.Parallel(bN, dp):
                K_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), K[start + k0 + j, by, d], T.cast(0, dtype))
                V_s[j, d] = T.if_then_else((k0 + j < n) and (d < dim), V[start + k0 + j, by, d], T.cast(0, dtype))
            if time:
                stage_time_row(tb_s, TB, by, t_eff)
                stage_timestamps(tk_s, TS, start, k0, n)
            T.fill(dk, 0)
            T.fill(dv, 0)
            if bias:
                bias_sums_begin(sums)
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
                if bias:
                    T.copy(ds, sums.ds_s[0:bN, 0:bM])
                    T.sync_threads()
                    bias_sums_add_tile(sums, tq_s, tk_s, t_eff, step)
            if bias:
                bias_sums_end(sums, n_steps, n_blocks)
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


# --------------------------------------------------------------------------- entries and launcher

_BUILDERS = {"dkdv": dkdv_kernel, "dq": dq_kernel}


def backward_entry(
    kernel: str, dim: int, dtype: torch.dtype, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool
) -> Entry:
    """kernel: "dkdv" or "dq"."""
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
    launched = bool(total and n and n_blocks)
    # every element is written by the dk/dv kernel; without a launch the sums below read zeros
    alloc = buffers.empty if launched else torch.zeros
    pos_part = time_part = placeholder(device)
    if position_bias is not None:
        pos_part = alloc((n, h, n_blocks, n_blocks + 1, BLOCK_N), dtype=torch.float32, device=device)
    if time_bias is not None:
        time_part = alloc((n, h, n_blocks, TIME_SLOTS), dtype=torch.float32, device=device)
    if launched:
        check_program_count(n_blocks * h * n, "cu_seqlens")
        launcher(backward_entry("dkdv", d, q.dtype, *flags), device)(
            *tensors, dk, dv, pos_part.view(-1), time_part.view(-1), n_blocks, *scalars, *dropout_launch
        )
        launcher(backward_entry("dq", d, q.dtype, *flags), device)(*tensors, dq, n_blocks, *scalars, *dropout_launch)
    dpos, dtime = reduce_bias_parts(pos_part, time_part, bool(causal), position_bias, time_bias)
    return dq, dk, dv, None, None, dpos, dtime, None, None, None, None, None, None


def reduce_bias_parts(pos_part, time_part, causal: bool, position_bias, time_bias):
    """(dposition_bias [H, P] or None, dtime_bias [H, T] or None) from the dk/dv kernel's partial sums pos_part
    [N, H, n_blocks, n_blocks + 1, BLOCK_N] and time_part [N, H, n_blocks, TIME_SLOTS] (dkdv_kernel gives their
    layout), added over sequences and key blocks and folded into buckets in a fixed order."""
    dpos = dtime = None
    if position_bias is not None:
        part = pos_part.sum(0)  # [H, key block, slot, v]
        h, n_blocks, _, b = part.shape
        if causal or n_blocks == 0:  # slot s: distances s * b + v - (b - 1), whatever the key block
            flat, first_d = part.sum(1).flatten(1), -(b - 1)
        else:
            # slot s of key block kb holds distances (s - kb) * b + v - (b - 1): sheared so that one column holds
            # one distance, index s - kb + n_blocks - 1, then added over the key blocks
            padded = torch.nn.functional.pad(part, (0, 0, n_blocks - 1, n_blocks - 1))
            s_h, s_kb, s_slot, _ = padded.stride()
            sheared = padded.as_strided((h, n_blocks, 2 * n_blocks, b), (s_h, s_kb + s_slot, s_slot, 1))
            flat, first_d = sheared.sum(1).flatten(1), -(n_blocks - 1) * b - (b - 1)
        dpos = fold_flat_distances(flat, first_d, position_bias.shape[1]).to(position_bias.dtype)
    if time_bias is not None:
        buckets = min(time_bias.shape[1], MAX_TIME_BUCKETS)
        dtime = torch.zeros(time_bias.shape, dtype=torch.float32, device=time_part.device)
        dtime[:, :buckets] = time_part.sum((0, 2))[:, :buckets]
        dtime = dtime.to(time_bias.dtype)
    return dpos, dtime
