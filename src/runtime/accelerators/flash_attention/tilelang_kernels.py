"""The TileLang flash-attention kernel builders: forward, backward preprocess and backward (tilelang.py: what they
compute, their compile entries and entry points; tilelang_configs.py: their launch configurations per head dim;
tilelang_dropout.py: dropout inside them)."""

import math

import tilelang
import tilelang.language as T

from ..tilelang_common import program_grid, program_ids
from .tilelang_configs import DQ_SUBTILE, PREP_ROWS, BwdConfig, FwdConfig
from .tilelang_dropout import DROPOUT_PRELUDE, SEED, dropout_keep

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
ACCUM = "float32"
FAST_MATH = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def dq_first_block(q_start, sequence, block_m: int):
    """The first dq accumulator block of packed sequence `sequence` (its rows start at q_start): (q_start + sequence *
    block_m) // block_m. Sequence s + 1 starts at least ceil(length_s / block_m) blocks after sequence s, so no two
    sequences share a block; N sequences of total_q rows use fewer than ceil(total_q / block_m) + N blocks. The same
    expression for ints and torch tensors (the host) and TileLang expressions (the kernel)."""
    return (q_start + sequence * block_m) // block_m


# --------------------------------------------------------------------------- kernels


def forward_kernel(
    dim: int,
    dtype: str,
    causal: bool,
    has_lengths: bool,
    dropout: bool,
    cfg: FwdConfig,
    varlen: bool = False,
    fold: bool = False,
):
    """varlen: packed sequences. q [total_q, H, D], k/v [total_k, Hkv, D], o alike, lse [H, total_q]; B is the number
    of sequences (CuQ/CuK hold N + 1 offsets), the grid's query blocks come from QBlocks' length (a tensor of
    ceil(max_seqlen_q / block_m) elements, never read), so one compiled kernel serves every packing. Without varlen
    CuQ, CuK and QBlocks are placeholders. fold: every program on grid x (program_grid), for more than 65535 heads or
    sequences."""
    bM, bN = cfg.block_m, cfg.block_n
    B, H, Hkv, Lq, Lk, NL = T.dynamic("batch, heads, kv_heads, q_len, k_len, n_lengths")
    NC, NQB = T.dynamic("n_offsets, q_blocks")
    sq = T.dynamic("sq_b, sq_h, sq_l")
    sk = T.dynamic("sk_b, sk_h, sk_l")
    sv = T.dynamic("sv_b, sv_h, sv_l")
    if varlen:  # Lq, Lk: the packed lengths
        q_type = T.StridedTensor((Lq, H, dim), (sq[0], sq[1], 1), dtype)
        k_type = T.StridedTensor((Lk, Hkv, dim), (sk[0], sk[1], 1), dtype)
        v_type = T.StridedTensor((Lk, Hkv, dim), (sv[0], sv[1], 1), dtype)
        o_type, lse_type = T.Tensor((Lq, H, dim), dtype), T.Tensor((H, Lq), ACCUM)
        q_blocks, batch = NQB, NC - 1
    else:
        q_type = T.StridedTensor((B, H, Lq, dim), (sq[0], sq[1], sq[2], 1), dtype)
        k_type = T.StridedTensor((B, Hkv, Lk, dim), (sk[0], sk[1], sk[2], 1), dtype)
        v_type = T.StridedTensor((B, Hkv, Lk, dim), (sv[0], sv[1], sv[2], 1), dtype)
        o_type, lse_type = T.Tensor((B, H, Lq, dim), dtype), T.Tensor((B, H, Lq), ACCUM)
        q_blocks, batch = T.ceildiv(Lq, bM), B
    # a program may find no key block (key lengths, packed sequences): its loop still takes one step (see below)
    may_be_empty = has_lengths or varlen

    @T.macro
    def softmax(s, m, m_prev, rescale, row_sum, l, sl2, kv_len, q0, k0):
        """Running max m, sum l and the rescale factor updated by the scores s of the key block from k0 (queries from
        q0); s becomes its unnormalised probabilities."""
        # mask only the blocks that straddle the key length or the causal diagonal;
        # conditions stay inline: a boolean bound to a thread-dependent name breaks ThreadSync
        if k0 + bN > kv_len or (causal and k0 + bN > q0 + 1):
            for i, j in T.Parallel(bM, bN):
                if causal:
                    s[i, j] = T.if_then_else((k0 + j < kv_len) & (k0 + j <= q0 + i), s[i, j], -T.infinity(ACCUM))
                else:
                    s[i, j] = T.if_then_else(k0 + j < kv_len, s[i, j], -T.infinity(ACCUM))
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)
        for i in T.Parallel(bM):
            rescale[i] = T.exp2((m_prev[i] - m[i]) * sl2)
        for i, j in T.Parallel(bM, bN):
            s[i, j] = T.exp2(s[i, j] * sl2 - m[i] * sl2)
        T.reduce_sum(s, row_sum, dim=1)
        for i in T.Parallel(bM):
            l[i] = l[i] * rescale[i] + row_sum[i]

    @T.macro
    def to_operand(s, p, seed, bh, q0, k0, threshold, inv_keep):
        """The probabilities s in the product's dtype (dropped out where dropout is on, keys from k0) into p."""
        if dropout:
            for i, j in T.Parallel(bM, bN):
                p[i, j] = T.if_then_else(dropout_keep(seed, bh, q0, k0, i, j, threshold), s[i, j] * inv_keep, 0)
        else:
            T.copy(s, p)

    @T.prim_func
    def flash_fwd(
        Q: q_type,
        K: k_type,
        V: v_type,
        Lengths: T.Tensor((NL,), "int32"),
        O: o_type,
        LSE: lse_type,
        scale: T.float32,
        groups: T.int32,
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        inv_keep: T.float32,
        CuQ: T.Tensor((NC,), "int32"),
        CuK: T.Tensor((NC,), "int32"),
        QBlocks: T.Tensor((NQB,), "int32"),
    ):
        T.annotate_pass_configs(FAST_MATH)
        prelude = DROPOUT_PRELUDE if dropout else None
        with T.Kernel(*program_grid(q_blocks, H, batch, fold), threads=cfg.threads, prelude=prelude) as ids:
            bx, by, bz = program_ids(ids, q_blocks, H, fold)
            if cfg.min_blocks > 1:  # several programs per SM: registers capped by the compiler,
                T.annotate_min_blocks_per_sm(cfg.min_blocks)
                T.no_set_max_nreg()  # and no warpgroup register reallocation (it assumes one)
            Q_s = T.alloc_shared((bM, dim), dtype)
            K_s = T.alloc_shared((bN, dim), dtype)
            V_s = T.alloc_shared((bN, dim), dtype)
            O_s = T.alloc_shared((bM, dim), dtype)
            s = T.alloc_fragment((bM, bN), ACCUM)
            p = T.alloc_fragment((bM, bN), dtype)
            acc = T.alloc_fragment((bM, dim), ACCUM)
            m = T.alloc_fragment((bM,), ACCUM)
            m_prev = T.alloc_fragment((bM,), ACCUM)
            rescale = T.alloc_fragment((bM,), ACCUM)
            row_sum = T.alloc_fragment((bM,), ACCUM)
            l = T.alloc_fragment((bM,), ACCUM)

            if varlen:  # sequence bz: its first rows and lengths; a query block past its rows sees no key
                q_start = CuQ[bz]
                k_start = CuK[bz]
                lq = CuQ[bz + 1] - q_start
                kv_len = T.if_then_else(bx * bM < lq, CuK[bz + 1] - k_start, 0)
            else:
                kv_len = T.min(Lk, Lengths[bz]) if has_lengths else Lk
            seed = T.cast(Seed[0], "int32") if dropout else 0
            # causal: the last query of this block sees keys < (bx + 1) * bM
            n_blocks = T.ceildiv(T.min(kv_len, (bx + 1) * bM), bN) if causal else T.ceildiv(kv_len, bN)
            sl2 = scale * LOG2E  # exponentials in base 2
            # Q by TMA, waited for at its first use: in the key loop's first step. So the loop always takes a step;
            # with no step the load would still be in flight when O_s (sharing Q_s's memory) is written and at exit.
            # (Copied by threads instead, the forward with key lengths took up to 2.2x longer at head dim 64: TileLang
            # cannot vectorise a copy from a strided view, so each thread loads one element at a time.)
            if varlen:  # rows past the sequence (the next one's, or zeros past the tensor) are computed, not stored
                T.copy(Q[q_start + bx * bM : q_start + (bx + 1) * bM, by, :], Q_s)
            else:
                T.copy(Q[bz, by, bx * bM : (bx + 1) * bM, :], Q_s)
            T.fill(acc, 0)
            T.fill(l, 0)
            T.fill(m, -T.infinity(ACCUM))
            h_kv = T.truncdiv(by, groups)

            if cfg.overlap:
                T.clear(p)  # read by no product before it is written; TileLang checks
                # step k loads key block k and value block k - 1 (clamped: the first and last steps load a block
                # they do not use), issues QK^T of block k and PV of block k - 1 as one asynchronous batch each,
                # and runs block k's softmax while PV is on the tensor cores. With no key block (a length of 0) the
                # one step loads block 0 and computes nothing.
                for k in T.Pipelined(n_blocks + 1, num_stages=cfg.stages):
                    k_block = T.max(T.min(k, n_blocks - 1), 0)
                    v_block = T.max(k - 1, 0)
                    if varlen:
                        T.copy(K[k_start + k_block * bN : k_start + (k_block + 1) * bN, h_kv, :], K_s)
                        T.copy(V[k_start + v_block * bN : k_start + (v_block + 1) * bN, h_kv, :], V_s)
                    else:
                        T.copy(K[bz, h_kv, k_block * bN : (k_block + 1) * bN, :], K_s)
                        T.copy(V[bz, h_kv, v_block * bN : (v_block + 1) * bN, :], V_s)
                    # one statement, so that TileLang's warp specialisation hands K_s and V_s back to the
                    # loads after it: after the waits, not when the asynchronous products are issued
                    if k < n_blocks:
                        T.wgmma_gemm(Q_s, K_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        if k > 0:
                            T.wgmma_gemm(p, V_s, acc, policy=T.GemmWarpPolicy.FullRow)
                            T.wait_wgmma(1)  # QK^T done; PV may still run
                        else:
                            T.wait_wgmma(0)
                        softmax(s, m, m_prev, rescale, row_sum, l, sl2, kv_len, bx * bM, k * bN)
                        # p and acc are PV's operands: written only once it is done (a write while it runs
                        # makes ptxas serialise every wgmma)
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(bM, dim):
                            acc[i, j] *= rescale[i]
                        to_operand(s, p, seed, bz * H + by, bx * bM, k * bN, threshold, inv_keep)
                    elif k > 0:
                        T.wgmma_gemm(p, V_s, acc, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
            else:
                # with key lengths, a row of length 0 has no key block: its program still takes one step, which
                # loads block 0 and computes nothing, so that Q's load is waited for (see above)
                for k in T.Pipelined(T.max(n_blocks, 1) if may_be_empty else n_blocks, num_stages=cfg.stages):
                    if varlen:
                        T.copy(K[k_start + k * bN : k_start + (k + 1) * bN, h_kv, :], K_s)
                    else:
                        T.copy(K[bz, h_kv, k * bN : (k + 1) * bN, :], K_s)
                    if not may_be_empty or k < n_blocks:
                        T.gemm(Q_s, K_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        softmax(s, m, m_prev, rescale, row_sum, l, sl2, kv_len, bx * bM, k * bN)
                        to_operand(s, p, seed, bz * H + by, bx * bM, k * bN, threshold, inv_keep)
                        for i, j in T.Parallel(bM, dim):
                            acc[i, j] *= rescale[i]
                    if varlen:
                        T.copy(V[k_start + k * bN : k_start + (k + 1) * bN, h_kv, :], V_s)
                    else:
                        T.copy(V[bz, h_kv, k * bN : (k + 1) * bN, :], V_s)
                    if not may_be_empty or k < n_blocks:
                        T.gemm(p, V_s, acc, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(bM, dim):
                acc[i, j] = T.if_then_else(l[i] > 0, acc[i, j] / l[i], 0)
            T.copy(acc, O_s)
            if varlen:  # only the sequence's rows: the tile may reach into the next sequence's
                for i, j in T.Parallel(bM, dim):
                    if bx * bM + i < lq:
                        O[q_start + bx * bM + i, by, j] = O_s[i, j]
            else:
                T.copy(O_s, O[bz, by, bx * bM : (bx + 1) * bM, :])
            for i in T.Parallel(bM):
                l[i] = T.if_then_else(l[i] > 0, (T.log2(l[i]) + m[i] * sl2) * LN2, -T.infinity(ACCUM))
            if varlen:
                for i in T.Parallel(bM):
                    if bx * bM + i < lq:
                        LSE[by, q_start + bx * bM + i] = l[i]
            else:
                T.copy(l, LSE[bz, by, bx * bM : (bx + 1) * bM])

    return flash_fwd


def preprocess_kernel(dim: int, dtype: str, varlen: bool = False, fold: bool = False):
    """Per query row: delta = rowsum(o * do) and the log-sum-exp in base 2 (+inf for a row that
    sees no key), both fp32 in rows padded to 16 bytes so that the backward loads them with TMA.

    varlen: packed sequences, o/do [total_q, H, D] and lse [H, total_q] (varlen forward's); delta and the log-sum-exp
    [H, blocks * block_m] in the backward's query blocks: packed row r at Rows[r] (packed_dq_rows), so that each
    sequence's rows start at a whole block (the backward loads them by TMA, whose innermost coordinate must be 16-byte
    aligned). Without varlen Rows is a placeholder."""
    blk = PREP_ROWS
    # each row's columns in parts of at most 32 (a power of two: TileLang finds no fragment layout for 48 columns;
    # few registers at head dim 128), read into registers, not through shared memory, where a thread per row met
    # 8-way bank conflicts (94 us at 64x4x2048x48 under ncu, five times the read of o and do at full bandwidth)
    cols = math.gcd(dim, 32)
    B, H, Lq, Lqp, NR = T.dynamic("batch, heads, q_len, q_len_padded, n_rows")
    sdo = T.dynamic("sdo_b, sdo_h, sdo_l")
    # one type object per parameter: two parameters annotated with one object are bound to one buffer
    if varlen:  # Lq: the packed length; one program per block of rows of one head
        o_type = T.Tensor((Lq, H, dim), dtype)
        do_type = T.StridedTensor((Lq, H, dim), (sdo[0], sdo[1], 1), dtype)
        lse_type = T.Tensor((H, Lq), ACCUM)
        delta_type, lse2_type = T.Tensor((H, Lqp), ACCUM), T.Tensor((H, Lqp), ACCUM)
        rows_type = T.Tensor((Lq,), "int64")
        batch = 1
    else:
        o_type = T.Tensor((B, H, Lq, dim), dtype)
        do_type = T.StridedTensor((B, H, Lq, dim), (sdo[0], sdo[1], sdo[2], 1), dtype)
        lse_type = T.Tensor((B, H, Lq), ACCUM)
        delta_type, lse2_type = T.Tensor((B, H, Lqp), ACCUM), T.Tensor((B, H, Lqp), ACCUM)
        rows_type = T.Tensor((NR,), "int64")
        batch = B

    @T.prim_func
    def flash_bwd_prep(
        O: o_type,
        dO: do_type,
        LSE: lse_type,
        Delta: delta_type,
        LSE2: lse2_type,
        Rows: rows_type,
    ):
        with T.Kernel(*program_grid(T.ceildiv(Lq, blk), H, batch, fold), threads=blk) as ids:
            bx, by, bz = program_ids(ids, T.ceildiv(Lq, blk), H, fold)
            o_f = T.alloc_fragment((blk, cols), dtype)
            do_f = T.alloc_fragment((blk, cols), dtype)
            prod = T.alloc_fragment((blk, cols), ACCUM)
            delta = T.alloc_fragment((blk,), ACCUM)
            lse = T.alloc_fragment((blk,), ACCUM)
            T.clear(prod)
            for c in range(dim // cols):
                if varlen:
                    T.copy(O[bx * blk : (bx + 1) * blk, by, c * cols : (c + 1) * cols], o_f)
                    T.copy(dO[bx * blk : (bx + 1) * blk, by, c * cols : (c + 1) * cols], do_f)
                else:
                    T.copy(O[bz, by, bx * blk : (bx + 1) * blk, c * cols : (c + 1) * cols], o_f)
                    T.copy(dO[bz, by, bx * blk : (bx + 1) * blk, c * cols : (c + 1) * cols], do_f)
                for i, j in T.Parallel(blk, cols):
                    prod[i, j] += T.cast(o_f[i, j], ACCUM) * T.cast(do_f[i, j], ACCUM)
            T.reduce_sum(prod, delta, dim=1)
            if varlen:
                T.copy(LSE[by, bx * blk : (bx + 1) * blk], lse)
            else:
                T.copy(LSE[bz, by, bx * blk : (bx + 1) * blk], lse)
            for i in T.Parallel(blk):
                lse[i] = T.if_then_else(lse[i] == -T.infinity(ACCUM), T.infinity(ACCUM), lse[i] * LOG2E)
            if varlen:
                for i in T.Parallel(blk):
                    if bx * blk + i < Lq:
                        Delta[by, Rows[bx * blk + i]] = delta[i]
                        LSE2[by, Rows[bx * blk + i]] = lse[i]
            else:
                T.copy(delta, Delta[bz, by, bx * blk : (bx + 1) * blk])
                T.copy(lse, LSE2[bz, by, bx * blk : (bx + 1) * blk])

    return flash_bwd_prep


def backward_kernel(
    dim: int,
    dtype: str,
    causal: bool,
    has_lengths: bool,
    dropout: bool,
    cfg: BwdConfig,
    varlen: bool = False,
    fold: bool = False,
):
    """Per key block of one kv head: loop over its query heads and query blocks, accumulating
    dk/dv in registers (GQA sums without atomics) and adding each dq block into dQacc (fp32).

    varlen: packed sequences. q/do [total_q, H, D], k/v/dk/dv [total_k, Hkv, D], lse2/delta [H, blocks * block_m]
    (preprocess_kernel's: query block m of sequence s at block dq_first_block(CuQ[s], s, block_m) + m, so that their
    TMA loads start at a whole block); B is the number of sequences (CuQ/CuK hold N + 1 offsets), the grid's key
    blocks come from KBlocks' length (a tensor of ceil(max_seqlen_k / block_n) elements, never read), so one compiled
    kernel serves every packing. Query block m of sequence s adds into block dq_first_block(CuQ[s], s, block_m) + m of
    dQacc ("tma": [blocks * block_m, H, D], "bulk": [H, blocks, block_m * D]): no two sequences share a block. Without
    varlen CuQ, CuK and KBlocks are placeholders."""
    bN, bM = cfg.block_n, cfg.block_m
    split_k = dim * 2 not in (64, 128, 256)
    bulk = cfg.dq == "bulk"
    # dq = dS^T K: each compute warpgroup takes dq_dim / warpgroups of its columns. TileLang issues that as one wgmma
    # per 16 keys only for a multiple of 16 columns, else in pieces of 8 (head dim 48 over two warpgroups: three
    # m64n8k16, 16% slower backward), so there dq is computed on columns padded with zeros (Kt_s's extra rows).
    per_warpgroup = 16 * (cfg.threads // 128)
    dq_dim = -(-dim // per_warpgroup) * per_warpgroup
    B, H, Hkv, Lq, Lqp, Lk, NL = T.dynamic("batch, heads, kv_heads, q_len, q_len_padded, k_len, n_lengths")
    NQB, NQR = T.dynamic("q_blocks, dq_rows")
    NC, NKB = T.dynamic("n_offsets, k_blocks")
    sq = T.dynamic("sq_b, sq_h, sq_l")
    sk = T.dynamic("sk_b, sk_h, sk_l")
    sv = T.dynamic("sv_b, sv_h, sv_l")
    sdo = T.dynamic("sdo_b, sdo_h, sdo_l")
    sdq = T.dynamic("sdq_b, sdq_h, sdq_l")
    sdk = T.dynamic("sdk_b, sdk_h, sdk_l")
    sdv = T.dynamic("sdv_b, sdv_h, sdv_l")
    # bulk: one contiguous bM x dim tile per query block, in DQ_SUBTILE x DQ_SUBTILE sub-tiles (a warp's
    # accumulator fragment covers one sub-tile: conflict-free shared stores)
    sub = DQ_SUBTILE
    if varlen:  # Lq, Lk: the packed lengths
        q_type = T.StridedTensor((Lq, H, dim), (sq[0], sq[1], 1), dtype)
        k_type = T.StridedTensor((Lk, Hkv, dim), (sk[0], sk[1], 1), dtype)
        v_type = T.StridedTensor((Lk, Hkv, dim), (sv[0], sv[1], 1), dtype)
        do_type = T.StridedTensor((Lq, H, dim), (sdo[0], sdo[1], 1), dtype)
        lse2_type, delta_type = T.Tensor((H, Lqp), ACCUM), T.Tensor((H, Lqp), ACCUM)
        dk_type = T.StridedTensor((Lk, Hkv, dim), (sdk[0], sdk[1], 1), dtype)
        dv_type = T.StridedTensor((Lk, Hkv, dim), (sdv[0], sdv[1], 1), dtype)
        dq_acc_type = T.Tensor((H, NQB, bM * dim), ACCUM) if bulk else T.Tensor((NQR, H, dim), ACCUM)
        k_blocks, batch = NKB, NC - 1
    else:
        q_type = T.StridedTensor((B, H, Lq, dim), (sq[0], sq[1], sq[2], 1), dtype)
        k_type = T.StridedTensor((B, Hkv, Lk, dim), (sk[0], sk[1], sk[2], 1), dtype)
        v_type = T.StridedTensor((B, Hkv, Lk, dim), (sv[0], sv[1], sv[2], 1), dtype)
        do_type = T.StridedTensor((B, H, Lq, dim), (sdo[0], sdo[1], sdo[2], 1), dtype)
        lse2_type, delta_type = T.Tensor((B, H, Lqp), ACCUM), T.Tensor((B, H, Lqp), ACCUM)
        dk_type = T.StridedTensor((B, Hkv, Lk, dim), (sdk[0], sdk[1], sdk[2], 1), dtype)
        dv_type = T.StridedTensor((B, Hkv, Lk, dim), (sdv[0], sdv[1], sdv[2], 1), dtype)
        if bulk:
            dq_acc_type = T.Tensor((B, H, NQB, bM * dim), ACCUM)
        else:
            dq_acc_type = T.StridedTensor((B, H, Lq, dim), (sdq[0], sdq[1], sdq[2], 1), ACCUM)
        k_blocks, batch = T.ceildiv(Lk, bN), B

    @T.macro
    def probabilities(s, lse_s, kv_len, q_len, bx, mq, sl2):
        """s: the step's scores (keys from bx * bN, queries from mq * bM), then its probabilities (0 where masked:
        keys from kv_len, queries from q_len)."""
        for n, i in T.Parallel(bN, bM):
            s[n, i] = T.exp2(s[n, i] * sl2 - lse_s[i])
        if (bx + 1) * bN > kv_len or (mq + 1) * bM > q_len or (causal and (bx + 1) * bN > mq * bM + 1):
            for n, i in T.Parallel(bN, bM):
                if causal:
                    s[n, i] = T.if_then_else(
                        (bx * bN + n < kv_len) & (mq * bM + i < q_len) & (bx * bN + n <= mq * bM + i), s[n, i], 0
                    )
                else:
                    s[n, i] = T.if_then_else((bx * bN + n < kv_len) & (mq * bM + i < q_len), s[n, i], 0)

    @T.macro
    def dropped_out(s, dp, p_cast, kept, seed, bh, q0, k0, threshold, inv_keep):
        """p_cast: the (dropped out) probabilities, dV's operand; dp dropped out like them."""
        if dropout:  # the forward's mask, recomputed once per element: 1 kept, 0 dropped
            for n, i in T.Parallel(bN, bM):
                kept[n, i] = T.if_then_else(dropout_keep(seed, bh, q0, k0, i, n, threshold), 1, 0)
            for n, i in T.Parallel(bN, bM):
                p_cast[n, i] = s[n, i] * kept[n, i] * inv_keep
                dp[n, i] = dp[n, i] * kept[n, i] * inv_keep
        else:
            T.copy(s, p_cast)

    @T.macro
    def scores_grad(s, dp, ds_cast, delta_s, scale):
        """ds_cast: dS = P (dP - delta), the operand of dK and dQ."""
        for n, i in T.Parallel(bN, bM):
            ds_cast[n, i] = s[n, i] * (dp[n, i] - delta_s[i]) * scale

    @T.macro
    def add_dq(dq, dq_s, dQacc, bz, hq, mq, it, dq_block):
        """dQacc[bz, hq, query block mq] += dq (step it), as BwdConfig.dq says; varlen: into dQacc's block
        dq_block + mq of head hq."""
        if cfg.dq == "tma":
            for i, j in T.Parallel(bM, dq_dim):
                if j < dim:
                    dq_s[i, j] = dq[i, j]
            if varlen:
                T.atomic_add(dQacc[(dq_block + mq) * bM : (dq_block + mq + 1) * bM, hq, :], dq_s, use_tma=True)
            else:
                T.atomic_add(dQacc[bz, hq, mq * bM : (mq + 1) * bM, :], dq_s, use_tma=True)
        else:
            slot = it % 2
            for i, j in T.Parallel(bM, dq_dim):
                if j < dim:
                    dq_s[slot, i // sub, j // sub, i % sub, j % sub] = dq[i, j]
            if T.shuffle_elect(cfg.threads):
                T.fence_proxy_async()  # the tile's writes, visible to the bulk copy
                T.call_extern(
                    "handle",
                    "tl::tma_store_add",
                    T.access_ptr(dq_s[slot, 0, 0, 0, 0], "r", bM * dim),
                    T.access_ptr(dQacc[hq, dq_block + mq, 0] if varlen else dQacc[bz, hq, mq, 0], "w", bM * dim),
                    bM * dim * 4,
                )
                T.tma_store_arrive()
                # the previous step's reduction has read the other tile, which the next step writes
                # (after barriers the next step passes before that write)
                T.tma_store_wait(1)

    @T.prim_func
    def flash_bwd(
        Q: q_type,
        K: k_type,
        V: v_type,
        dO: do_type,
        LSE2: lse2_type,
        Delta: delta_type,
        Lengths: T.Tensor((NL,), "int32"),
        dQacc: dq_acc_type,
        dK: dk_type,
        dV: dv_type,
        scale: T.float32,
        groups: T.int32,
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        inv_keep: T.float32,
        CuQ: T.Tensor((NC,), "int32"),
        CuK: T.Tensor((NC,), "int32"),
        KBlocks: T.Tensor((NKB,), "int32"),
    ):
        T.annotate_pass_configs(FAST_MATH)
        prelude = DROPOUT_PRELUDE if dropout else None
        with T.Kernel(*program_grid(k_blocks, Hkv, batch, fold), threads=cfg.threads, prelude=prelude) as ids:
            bx, by, bz = program_ids(ids, k_blocks, Hkv, fold)
            if cfg.min_blocks > 1:  # several programs per SM: registers capped by the compiler,
                T.annotate_min_blocks_per_sm(cfg.min_blocks)
                T.no_set_max_nreg()  # and no warpgroup register reallocation (it assumes one)
            K_s = T.alloc_shared((bN, dim), dtype)
            # K is the A operand of K Q^T and the B operand of dS K; for rows of 32 or 96 bytes
            # TileLang finds no shared layout serving both, so dS K then reads a transposed copy
            Kt_s = T.alloc_shared((dq_dim, bN), dtype) if split_k else K_s
            V_s = T.alloc_shared((bN, dim), dtype)
            Q_s = T.alloc_shared((bM, dim), dtype)
            dO_s = T.alloc_shared((bM, dim), dtype)
            lse_s = T.alloc_shared((bM,), ACCUM)
            delta_s = T.alloc_shared((bM,), ACCUM)
            ds_s = T.alloc_shared((bN, bM), dtype)
            if bulk:  # two tiles: one is written while the bulk reduction of the other may still read it
                dq_s = T.alloc_shared((2, bM // sub, dim // sub, sub, sub), ACCUM)
            else:
                dq_s = T.alloc_shared((bM, dim), ACCUM)
            dk_s = T.alloc_shared((bN, dim), dtype)
            dv_s = T.alloc_shared((bN, dim), dtype)
            s = T.alloc_fragment((bN, bM), ACCUM)  # scores, then probabilities, transposed (keys x queries)
            dp = T.alloc_fragment((bN, bM), ACCUM)
            p_cast = T.alloc_fragment((bN, bM), dtype)
            kept = T.alloc_fragment((bN, bM) if dropout else (1, 1), dtype)
            ds_cast = T.alloc_fragment((bN, bM), dtype)
            dk = T.alloc_fragment((bN, dim), ACCUM)
            dv = T.alloc_fragment((bN, dim), ACCUM)
            dq = T.alloc_fragment((bM, dq_dim), ACCUM)

            if varlen:  # sequence bz: its first rows, its lengths and its first block of dQacc
                q_start = CuQ[bz]
                k_start = CuK[bz]
                q_len = CuQ[bz + 1] - q_start
                kv_len = CuK[bz + 1] - k_start
                dq_block = dq_first_block(q_start, bz, bM)
            else:
                q_len = Lq
                kv_len = T.min(Lk, Lengths[bz]) if has_lengths else Lk
                dq_block = 0
            seed = T.cast(Seed[0], "int32") if dropout else 0
            # causal: queries before this key block see none of it
            m_first = (bx * bN) // bM if causal else 0
            n_q = T.if_then_else(bx * bN < kv_len, T.max(T.ceildiv(q_len, bM) - m_first, 0), 0)
            n_steps = groups * n_q
            sl2 = scale * LOG2E  # the saved log-sum-exp is in base 2 already
            # K and V by TMA where the query loop surely takes a step: TileLang waits for these loads only at their
            # first use, in the loop's first step, so with no step they would still be in flight when dk_s/dv_s
            # (sharing K_s's memory) are written and at exit. The overlapped loop always takes one (no query block: a
            # step that only waits). Else by threads, one element at a time (see the forward's Q). The transposed
            # copy reads K from global memory for the same reason: K_s has not landed before the loop.
            by_threads = not cfg.overlap
            if varlen:  # rows past the sequence (the next one's, or zeros past the tensor) are masked, never stored
                T.copy(K[k_start + bx * bN : k_start + (bx + 1) * bN, by, :], K_s, disable_tma=by_threads)
            else:
                T.copy(K[bz, by, bx * bN : (bx + 1) * bN, :], K_s, disable_tma=by_threads)
            if split_k:  # consecutive threads take consecutive keys: strided loads, but shared stores without bank
                # conflicts (the other order, coalesced loads, was 3% slower at head dim 48)
                for j, n in T.Parallel(dq_dim, bN):
                    if varlen:
                        Kt_s[j, n] = T.if_then_else(
                            (j < dim) & (bx * bN + n < kv_len), K[k_start + bx * bN + n, by, j], 0
                        )
                    else:
                        Kt_s[j, n] = T.if_then_else((j < dim) & (bx * bN + n < Lk), K[bz, by, bx * bN + n, j], 0)
            if varlen:
                T.copy(V[k_start + bx * bN : k_start + (bx + 1) * bN, by, :], V_s, disable_tma=by_threads)
            else:
                T.copy(V[bz, by, bx * bN : (bx + 1) * bN, :], V_s, disable_tma=by_threads)
            T.clear(dk)
            T.clear(dv)
            if cfg.overlap:
                T.clear(p_cast)  # read by no product before it is written; TileLang checks
                T.clear(ds_cast)

            # the overlapped loop's one step where there is no query block loads the last query block (a valid one)
            # and computes nothing
            n_q_safe = T.max(n_q, 1) if cfg.overlap else n_q
            for it in T.Pipelined(T.max(n_steps, 1) if cfg.overlap else n_steps, num_stages=cfg.stages):
                hq = by * groups + T.truncdiv(it, n_q_safe)  # the step's query head and query block
                # varlen, a sequence without queries: block 0 (Q rows of the next sequence or past the tensor; delta
                # and lse rows of its own block, zeros)
                if varlen:
                    mq = T.max(T.min(m_first + T.truncmod(it, n_q_safe), T.ceildiv(q_len, bM) - 1), 0)
                    T.copy(Q[q_start + mq * bM : q_start + (mq + 1) * bM, hq, :], Q_s)
                    T.copy(LSE2[hq, (dq_block + mq) * bM : (dq_block + mq + 1) * bM], lse_s)
                else:
                    mq = T.min(m_first + T.truncmod(it, n_q_safe), T.ceildiv(Lq, bM) - 1)
                    T.copy(Q[bz, hq, mq * bM : (mq + 1) * bM, :], Q_s)
                    T.copy(LSE2[bz, hq, mq * bM : (mq + 1) * bM], lse_s)
                if cfg.overlap:
                    if varlen:
                        T.copy(dO[q_start + mq * bM : q_start + (mq + 1) * bM, hq, :], dO_s)
                        T.copy(Delta[hq, (dq_block + mq) * bM : (dq_block + mq + 1) * bM], delta_s)
                    else:
                        T.copy(dO[bz, hq, mq * bM : (mq + 1) * bM, :], dO_s)
                        T.copy(Delta[bz, hq, mq * bM : (mq + 1) * bM], delta_s)
                    # one statement, so that TileLang's warp specialisation hands Q_s and dO_s back to the loads
                    # after the last wait, not when dK/dV are issued
                    if it < n_steps:
                        T.wgmma_gemm(K_s, Q_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wgmma_gemm(V_s, dO_s, dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(1)  # S done; dP may still run
                        probabilities(s, lse_s, kv_len, q_len, bx, mq, sl2)
                        T.wait_wgmma(0)
                        dropped_out(s, dp, p_cast, kept, seed, bz * H + hq, mq * bM, bx * bN, threshold, inv_keep)
                        scores_grad(s, dp, ds_cast, delta_s, scale)
                        # p_cast and ds_cast are read by the products below: not written again before the
                        # last wait (a register write while a wgmma reads it makes ptxas serialise every wgmma)
                        T.wgmma_gemm(p_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)
                        T.copy(ds_cast, ds_s)
                        T.wgmma_gemm(ds_s, Kt_s, dq, transpose_A=True, transpose_B=split_k, clear_accum=True)
                        T.wgmma_gemm(ds_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(1)  # dV and dQ done: dq is added while dK runs
                        add_dq(dq, dq_s, dQacc, bz, hq, mq, it, dq_block)
                        T.wait_wgmma(0)
                else:
                    T.gemm(K_s, Q_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    probabilities(s, lse_s, kv_len, q_len, bx, mq, sl2)
                    if varlen:
                        T.copy(dO[q_start + mq * bM : q_start + (mq + 1) * bM, hq, :], dO_s)
                    else:
                        T.copy(dO[bz, hq, mq * bM : (mq + 1) * bM, :], dO_s)
                    T.gemm(V_s, dO_s, dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    dropped_out(s, dp, p_cast, kept, seed, bz * H + hq, mq * bM, bx * bN, threshold, inv_keep)
                    T.gemm(p_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)
                    if varlen:
                        T.copy(Delta[hq, (dq_block + mq) * bM : (dq_block + mq + 1) * bM], delta_s)
                    else:
                        T.copy(Delta[bz, hq, mq * bM : (mq + 1) * bM], delta_s)
                    scores_grad(s, dp, ds_cast, delta_s, scale)
                    T.gemm(ds_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(ds_cast, ds_s)
                    T.gemm(ds_s, Kt_s, dq, transpose_A=True, transpose_B=split_k, clear_accum=True)
                    add_dq(dq, dq_s, dQacc, bz, hq, mq, it, dq_block)
            if bulk and T.shuffle_elect(cfg.threads):  # dk_s/dv_s may share the tiles' memory
                T.tma_store_wait(0)
            T.copy(dk, dk_s)
            if varlen:  # only the sequence's rows: the tile may reach into the next sequence's
                for n, j in T.Parallel(bN, dim):
                    if bx * bN + n < kv_len:
                        dK[k_start + bx * bN + n, by, j] = dk_s[n, j]
            else:
                T.copy(dk_s, dK[bz, by, bx * bN : (bx + 1) * bN, :])
            T.copy(dv, dv_s)
            if varlen:
                for n, j in T.Parallel(bN, dim):
                    if bx * bN + n < kv_len:
                        dV[k_start + bx * bN + n, by, j] = dv_s[n, j]
            else:
                T.copy(dv_s, dV[bz, by, bx * bN : (bx + 1) * bN, :])

    return flash_bwd
