"""Triton pieces every flash-attention kernel shares: the dropout hash, masked row loads and stores, key tiles,
the launch order of heavy-first sections and the rows of a (packed) sequence."""

from __future__ import annotations

import triton
import triton.language as tl

from . import dropout

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


_MIX_A, _MIX_B = tl.constexpr(dropout.MIX_A), tl.constexpr(dropout.MIX_B)
_PAIR_MUL = tl.constexpr(dropout.PAIR_MUL)
_QUERY_BLOCK_MUL, _KEY_BLOCK_MUL = tl.constexpr(dropout.QUERY_BLOCK_MUL), tl.constexpr(dropout.KEY_BLOCK_MUL)
_QUERY_BLOCK_SHIFT, _KEY_BLOCK_SHIFT = tl.constexpr(dropout.QUERY_BLOCK_SHIFT), tl.constexpr(dropout.KEY_BLOCK_SHIFT)
_DROP_SCALE = tl.constexpr(float(1 << dropout.BITS))


@triton.jit
def _mix32(x):
    """lowbias32 of uint32 values"""
    x ^= x >> 16
    x *= _MIX_A
    x ^= x >> 15
    x *= _MIX_B
    return x ^ (x >> 16)


# dropout.py's hash. A kernel folds the block of its program's fixed tile (queries in the forward and dq kernels,
# keys in the dk/dv ones) into the pair's key once (drop_seed = _pair_key ^ that block's term); each tile's key is
# then _mix32(drop_seed ^ the other block's term).
@triton.jit
def _pair_key(seed, bh):
    return _mix32(seed.to(tl.uint32) ^ (bh.to(tl.uint32) * _PAIR_MUL))


@triton.jit
def _query_block(start_m):
    """The key's term for the block of 2^16 queries holding query start_m"""
    return (tl.cast(start_m, tl.uint32) >> _QUERY_BLOCK_SHIFT) * _QUERY_BLOCK_MUL


@triton.jit
def _key_block(start_n):
    """The key's term for the block of 2^17 keys holding key start_n"""
    return (tl.cast(start_n, tl.uint32) >> _KEY_BLOCK_SHIFT) * _KEY_BLOCK_MUL


@triton.jit
def _keep(tile_key, offs_i, offs_j, dropout_p):
    """Dropout keep mask for queries offs_i x keys offs_j (broadcast shapes) of one tile. Keys j and j ^ 8 share
    one round (the compiler computes it once: both are in one thread). dropout_p: dropout.drop_rate's
    (dropout_p * 2^16 is the exact threshold)."""
    pair_index = (((offs_j >> 4) << 3) | (offs_j & 7)) & 0xFFFF
    h = _mix32(tile_key ^ (offs_i.to(tl.uint32) << 16) ^ pair_index.to(tl.uint32))
    bits = tl.where((offs_j & 8) != 0, h >> 16, h & 0xFFFF)
    return bits >= tl.cast(dropout_p * _DROP_SCALE, tl.uint32)


@triton.jit
def _load(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, zero outside the rows < n_rows and the head dim."""
    if CHECK_ROWS:
        if PAD_D:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if PAD_D:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _store(ptrs, value, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr):
    if PAD_D:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)


@triton.jit
def _rows_src(
    X,
    b,
    h,
    sb,
    sh,
    s_row,
    s_d,
    n_rows,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TMA: tl.constexpr,
):
    """Where _tile reads the [n_rows, HEAD_DIM] matrix of (b, h) of a [B, H, L, D] input from: a TMA descriptor of
    [BLOCK_R, BLOCK_D] tiles ending at n_rows rows and HEAD_DIM columns (the hardware zero-fills past them; the head
    dim must be contiguous), or the pointers of rows offs_r (for _tile: the tile at row 0, arange(0, BLOCK_R))."""
    base = X + b.to(tl.int64) * sb + h.to(tl.int64) * sh
    if TMA:
        return tl.make_tensor_descriptor(base, [n_rows, HEAD_DIM], [s_row, 1], [BLOCK_R, BLOCK_D])
    else:
        return base + offs_r[:, None] * s_row + offs_d[None, :] * s_d


@triton.jit
def _tile(
    src,
    start,
    s_row,
    n_rows,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Rows start + offs_r of a _rows_src source, zero past the head dim and at rows >= n_rows (pointers: where
    CHECK_ROWS; a descriptor: past the rows it was made with)."""
    if TMA:
        return src.load([start, 0])
    else:
        return _load(src + start * s_row, start + offs_r, n_rows, offs_d, HEAD_DIM, PAD_D, CHECK_ROWS)


@triton.jit
def _tile_once(
    X,
    b,
    h,
    sb,
    sh,
    s_row,
    s_d,
    start,
    n_rows,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr,
    TMA: tl.constexpr,
):
    """The tile at rows start + offs_r of a matrix a program reads one tile of: through a descriptor of its own, or
    pointers made at those rows (the pointer path's code as it was before descriptors: the same registers)."""
    if TMA:
        src = _rows_src(X, b, h, sb, sh, s_row, s_d, n_rows, offs_r, offs_d, HEAD_DIM, BLOCK_R, BLOCK_D, TMA)
        return src.load([start, 0])
    else:
        rows = start + offs_r
        src = _rows_src(X, b, h, sb, sh, s_row, s_d, n_rows, rows, offs_d, HEAD_DIM, BLOCK_R, BLOCK_D, TMA)
        return _load(src, rows, n_rows, offs_d, HEAD_DIM, PAD_D, True)


@triton.jit
def _block_and_pair(n_blocks, SECTION: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(block, pair) of this program on a grid of n_blocks x pairs programs, all on x (the launchers' grid_of: y
    caps at 65535, fewer than the (batch, head) pairs of a large batch), in the order of a (blocks, pairs) grid: the
    hardware starts programs in the order of x. SECTION 0: the launch order, block fastest. Else heavy-first (see the
    module docstring): the launch order runs through sections of SECTION pairs, and within a section through the
    block ranks, heaviest first, each across the section's pairs. HEAVY_LAST: block n_blocks - 1 is the heaviest (the
    forward's and the dq kernel's query blocks), else block 0 (the dk/dv kernel's key blocks)."""
    launched = tl.program_id(0)
    if SECTION == 0:
        block, pair = launched % n_blocks, launched // n_blocks
    else:
        first_pair = launched // (SECTION * n_blocks) * SECTION
        pairs = tl.minimum(SECTION, tl.num_programs(0) // n_blocks - first_pair)  # the last section may hold fewer
        within = launched - first_pair * n_blocks
        rank = within // pairs
        block = n_blocks - 1 - rank if HEAVY_LAST else rank
        pair = first_pair + within % pairs
    return block, pair


@triton.jit
def _sequence(CU_Q, CU_K, KL, b, LQ, LK, HAS_KL: tl.constexpr, VARLEN: tl.constexpr):
    """(query rows, visible keys, first query row, first key row) of batch row or sequence b.

    Padded batches: LQ rows, LK keys or key_lengths[b]. VARLEN (packed sequences): b is a sequence of
    cu_seqlens_q/_k, rows CU[b]:CU[b + 1] of the packed [total, heads, D] inputs (passed with a batch stride of 0,
    LQ = total_q, LK = total_k); the kernels move their row pointers to the sequence's first rows (int64 offsets)."""
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        lq = (tl.load(CU_Q + b + 1) - q_start).to(tl.int32)
        kv_len = (tl.load(CU_K + b + 1) - k_start).to(tl.int32)
    else:
        q_start = tl.full([], 0, tl.int64)
        k_start = q_start
        lq = LQ
        kv_len = LK
        if HAS_KL:
            kv_len = tl.load(KL + b)
    return lq, kv_len, q_start, k_start


@triton.jit
def _lse_row(b, h, H, LQ, q_start, VARLEN: tl.constexpr):
    """Where the lse (and delta) values of (b, h) start: [B, H, LQ] for padded batches, [H, total_q] packed."""
    if VARLEN:
        return h.to(tl.int64) * LQ + q_start
    else:
        return (b * H + h).to(tl.int64) * LQ
