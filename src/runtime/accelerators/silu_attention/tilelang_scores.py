"""What silu_attention's TileLang kernels share to recompute a score tile (tilelang_forward.py describes the
epilogue): the CUDA preludes, the bias tables and timestamps staged in shared memory, the biased score, the
visibility and which tiles need it. The forward and the three backward kernels use the same code, so the backward
recomputes the forward's scores with the same instructions."""

from typing import NamedTuple

import tilelang.language as T

from ..flash_attention.tilelang_dropout import DROPOUT_PRELUDE, dropout_keep
from ..launch_math import next_power_of_2

BLOCK_M, BLOCK_N, THREADS = 64, 64, 128
assert BLOCK_M == BLOCK_N  # the causal diagonal crosses only tiles with q0 == k0 (edge_tile)
N_DIST = BLOCK_M + BLOCK_N  # distances i - j + BLOCK_N - 1 of a tile: 0 .. BLOCK_M + BLOCK_N - 2 (one slot unused)
MAX_TIME_BUCKETS = 63  # floor(log2(1 + |dt|)) <= 62 for |dt| <= 2^63 - 2, where the difference saturates


# The time bucket as a CUDA helper in the kernel's prelude: written as a TileLang expression, its repeated
# subexpressions (the int64 difference in the log2 and its corrections) left TileLang's simplifier running for minutes.
TIME_BUCKET_PRELUDE = """
// min(floor(log2(1 + |dt|)), n_buckets - 1) for int64 timestamps: |dt| exact in unsigned arithmetic (also past int64)
// and saturated at 2^63 - 2 as the reference's time_differences; 63 - clz is floor(log2) of a positive integer
__device__ __forceinline__ int taac_time_bucket(long long tq, long long tk, int n_buckets) {
  unsigned long long uq = (unsigned long long)tq, uk = (unsigned long long)tk;
  unsigned long long d = tq > tk ? uq - uk : uk - uq;
  unsigned long long x = (d < 0x7FFFFFFFFFFFFFFEull ? d : 0x7FFFFFFFFFFFFFFEull) + 1ull;
  int b = 63 - __clzll((long long)x);
  return b < n_buckets - 1 ? b : n_buckets - 1;
}
"""

# silu and silu' from one MUFU op, tanh.approx.f32 (max relative error about 2^-11, below bf16's rounding), instead
# of expf's range reduction, MUFU.EX2 and an IEEE division (MUFU.RCP, FCHK, a slow-path call). The asm is not
# volatile: where a kernel takes both of one x, the compiler keeps one tanh.
FAST_SILU_PRELUDE = """
__device__ __forceinline__ float taac_tanh_half(float x) {  // tanh(x / 2); sigmoid(x) = 0.5 + 0.5 tanh(x / 2)
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * x));
  return t;
}
__device__ __forceinline__ float taac_silu_scaled(float x, float scale) {
  float h = 0.5f * x;
  return fmaf(h, taac_tanh_half(x), h) * scale;  // x sigmoid(x) = h + h tanh(h), h = x / 2
}
__device__ __forceinline__ float taac_dsilu_scaled(float x, float scale) {
  float sig = fmaf(0.5f, taac_tanh_half(x), 0.5f);
  return sig * fmaf(x, 1.0f - sig, 1.0f) * scale;  // silu'(x) = sig (1 + x (1 - sig))
}
"""


def prelude(time: bool, dropout: bool) -> str:
    return (DROPOUT_PRELUDE if dropout else "") + (TIME_BUCKET_PRELUDE if time else "") + FAST_SILU_PRELUDE


def silu_scaled(x, scale):
    return T.call_pure_extern("float32", "taac_silu_scaled", x, scale)


def dsilu_scaled(x, scale):
    return T.call_pure_extern("float32", "taac_dsilu_scaled", x, scale)


def time_bucket(tq, tk, n_buckets):
    return T.call_pure_extern("int32", "taac_time_bucket", tq, tk, n_buckets)


def padded_dim(dim: int) -> int:
    """The head dim of the kernels' tiles: a power of two, at least 16 (the extra columns read as zero)."""
    return max(16, next_power_of_2(dim))


class Tables(NamedTuple):
    """A program's staged biases (shared buffers; pb_s holds the current tile's distances, by i - j + BLOCK_N - 1;
    tb_s the head's time-bias row; tq_s / tk_s the tile's query / key timestamps), alpha, the time buckets in use,
    and which biases there are."""

    pb_s: object
    tb_s: object
    tq_s: object
    tk_s: object
    alpha: object
    t_eff: object
    pos: bool
    time: bool


def biased_score(tables: Tables, s, i, j):
    """alpha s + position bias + time bias of element (query i, key j) of the tile (local indices)."""
    x = s * tables.alpha
    if tables.pos:
        x = x + tables.pb_s[i - j + BLOCK_N - 1]
    if tables.time:
        x = x + tables.tb_s[time_bucket(tables.tq_s[i], tables.tk_s[j], tables.t_eff)]
    return x


class Visibility(NamedTuple):
    """What decides which scores of a program's tiles count: the sequence's n tokens, its candidates from
    first_target, the flags, and dropout's seed, pair index (sequence * heads + head) and threshold."""

    n: object
    first_target: object
    causal: bool
    targets: bool
    dropout: bool
    seed: object
    bh: object
    threshold: object


def visible(vis: Visibility, q0, k0, i, j):
    """Whether query q0 + i sees key k0 + j and dropout keeps the pair: keys past the sequence hidden, causal, and
    candidates seen only by themselves."""
    qi, kj = q0 + i, k0 + j
    seen = kj < vis.n
    if vis.causal:
        seen = T.And(seen, kj <= qi)
    if vis.targets:
        seen = T.And(seen, T.Or(kj < vis.first_target, qi == kj))
    if vis.dropout:
        seen = T.And(seen, dropout_keep(vis.seed, vis.bh, q0, k0, i, j, vis.threshold))
    return seen


def edge_tile(vis: Visibility, q0, k0):
    """Whether the tile from (q0, k0) needs visible(): with dropout every tile; else where its keys straddle the
    sequence's end, the causal diagonal (BLOCK_M == BLOCK_N: only tiles with q0 == k0) or the first candidate.
    Elsewhere every score is visible."""
    if vis.dropout:
        return True
    edge = k0 + BLOCK_N > vis.n
    if vis.causal:
        edge = T.Or(edge, k0 + BLOCK_N > q0 + 1)
    if vis.targets:
        edge = T.Or(edge, k0 + BLOCK_N > vis.first_target)
    return edge


@T.macro
def stage_time_row(tb_s, TB, by, t_eff):
    """tb_s[b] = head by's time bias of bucket b (buckets past the table's end: its last)."""
    for b in T.Parallel(MAX_TIME_BUCKETS + 1):
        tb_s[b] = TB[by, T.min(b, t_eff - 1)]


@T.macro
def stage_timestamps(ts_s, TS, start, r0, n):
    """ts_s[r] = the timestamp of token r0 + r of the sequence from start (past its end: its first token's)."""
    for r in T.Parallel(ts_s.shape[0]):
        ts_s[r] = TS[start + T.if_then_else(r0 + r < n, r0 + r, 0)]


@T.macro
def stage_position_bias(pb_s, PB, by, q0, k0, p_len):
    """pb_s[u] = head by's position bias at distance |i - j| where u = i - j + BLOCK_N - 1 in the tile from (q0, k0):
    the 2 * 64 - 1 entries a tile's distances reach."""
    for u in T.Parallel(N_DIST):
        pb_s[u] = PB[by, T.min(T.abs(q0 - k0 + u - (BLOCK_N - 1)), p_len - 1)]
