"""The chunked gated delta rule's backward in TileLang (the contract of triton.chunk_backward).

The math is triton.py's ("chunked backward") and the stages are triton_backward.py's. Per chunk, with S the state
entering it, S' the state leaving it, P the causal attention (Q K^T * e^(gamma_t - gamma_j))_{j <= t},
T = (I + A)^-1 and the corrections U = u - w S (q and k l2-normalised when asked: Q, K below are the normalised
rows; the kernels take the raw rows as stored and fold the rsqrt factors into the other operand):

    O = scale (diag(e^gamma) Q S + P U)        S' = e^gamma_last S + (K * e^(gamma_last - gamma))^T U

Five launches after the forward's factors (gamma, w, u, T):
  0. the forward's storing walk again (tilelang_shared.store_states): the state entering each chunk, States[global
     chunk], and U per row, both bf16;
  1. local_grad, one program per (chunk, value head): dU_local = scale P^T dO over V blocks (stored bf16 where dU
     goes), and the walk's row factors scale e^gamma rstd_q and e^(gamma_last - gamma) rstd_k;
  2. state_grad, one program per (V block, sequence x value head), walks the chunks backwards (T.Pipelined: q, k,
     dO, dU_local and w (fp32) by TMA, the factors and gamma by cp.async, all a chunk ahead in the producer warps; no
     global load on the consumer's path) with dS' in an fp32 fragment: DStates[chunk] = dS' (bf16),
     dU = dU_local + K~ dS', dS = e^gamma_last dS' + Q~^T dO - w^T dU (K~, Q~: the rows times the factors); the first
     chunk's dS is d(initial_state);
  3. grad_qk, one program per (chunk, value head): over V blocks the products with the states, dO S^T, U dS'^T,
     dw = -dU S^T, dO U^T and <S, dS'>; then dq (final, with the l2norm backward), the output's and S''s parts of
     dk and dgamma (fp32, for step 4) and dw (bf16);
  4. grad_wy, one program per (chunk, value head): dv = beta T^T dU and dA = -T^T (dU U^T) (T dT^T = dU U^T, see
     triton_backward_wy.py) over V blocks, then dk and dbeta through w = T diag(beta e^gamma) K and through A, the
     l2norm backward of k and dg, the reverse cumulative sum of dgamma within the chunk (0 at a full decay).
Every product takes bf16 operands (the stored tensors as they are, computed ones rounded; fp16 q/k rounded, as the
forward's) and accumulates in fp32 (wgmma on sm_90a), at every K: the Triton backward's HALF products, which it runs
at K = 128 (reference.chunked_backward_stages mirrors the roundings: about 3e-3 from float64 at every K of the GPU
cases). Row and column sums are fragment reductions; the loads of the V loops of steps 3 and 4 are cp.async (TMA
would warp-specialise them and halve the registers of step 3's three [BT, K] accumulators), the loads before them
issued together.
dq/dk are written per value head (fp32) and summed over the value heads of each q/k head (GVA) in torch.

Rows of chunks past their sequence's end are masked in every operand that a product sums over, and every decay
factor is a select on the rows inside the sequence (so a strong decay cannot make 0 * inf there).
"""

import tilelang.language as T
import torch

from .. import buffers
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher, placeholder
from .reference import FULL_DECAY
from .tilelang_shared import (
    BT,
    OPERAND,
    OPERAND_TORCH,
    Chunks,
    _contiguous,
    _sequences,
    _state_block,
    _state_threads,
    chunk_end,
    chunk_start,
    load_chunk_decay,
    load_rows,
    load_rstd,
    load_state,
    state_program,
    store_state,
    store_states,
    storing_walk_entry,
)


def _walk_stages(K: int, dtype) -> int:
    """Pipeline depth of the reverse walk's loads (q, k, dO, dU, w of a chunk): two stages but at K = 128, where they
    take 132 KB of shared memory against 75 KB (one block an SM: the B4-T4096-H16 walk's 256 programs would run in
    two waves), and for
    fp16 inputs, whose q/k loads convert (no TMA; two stages of them failed to lower in TileLang 0.1.15)."""
    return 1 if K >= 128 or dtype != torch.bfloat16 else 2


def _value_block(K: int, V: int) -> int:
    """V block of grad_wy: 32 at K = 128, where 64 takes 132 KB of shared memory (one block an SM instead of two)."""
    return min(V, 32 if K >= 128 else 64)


def _qk_value_block(V: int) -> int:
    """V block of grad_qk: 64, as wide as its registers allow (221 at K = 128, no spills): at V = 128 its two
    pipeline stages put every load of the V loop in flight at once, and half the barriers and product waits of
    blocks of 32. Its three [BT, K] fp32 accumulators keep it at one block an SM at K = 128 either way."""
    return min(V, 64)


def _grad_threads(K: int) -> int:
    # [BT, K] fp32 accumulators live across the V loop: 8 warps from K = 64, as the Triton kernels'
    return 256 if K >= 64 else 128


# --------------------------------------------------------------------------- kernels


def local_grad_kernel(K: int, V: int, BV: int, dtype: str, l2norm: bool, varlen: bool):
    R, H, HV, NC, NT = T.dynamic("rows, heads, v_heads, n_cu, n_chunk_rows")

    @T.prim_func
    def gdr_chunk_local_grad(
        Q: T.Tensor((R, H, K), dtype),
        Kx: T.Tensor((R, H, K), dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        DO: T.Tensor((R, HV, V), dtype),
        DU: T.Tensor((R, HV, V), OPERAND),
        QFactor: T.Tensor((R, HV), ACCUM),
        KFactor: T.Tensor((R, HV), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        Chunks: T.Tensor((NT, 2) if varlen else (1,), "int32"),
        scale: T.float32,
        seq_len: T.int32,
        n_chunks: T.int32,
        n_total: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_total, HV, threads=128) as (i_t, hv):
            q_s = T.alloc_shared((BT, K), OPERAND)
            k_s = T.alloc_shared((BT, K), OPERAND)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            q_rstd_s = T.alloc_shared((BT,), ACCUM)
            k_rstd_s = T.alloc_shared((BT,), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)
            attn_t = T.alloc_fragment((BT, BT), ACCUM)
            attn_t_h = T.alloc_shared((BT, BT), OPERAND)  # scale P^T
            do_h = T.alloc_shared((BT, BV), OPERAND)
            du = T.alloc_fragment((BT, BV), ACCUM)

            # bound once: as expressions TileLang would recompute their divisions, in int64, at every access
            h = T.alloc_var("int32", init=hv // groups)
            start = T.alloc_var("int32", init=chunk_start(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            eos = T.alloc_var("int32", init=chunk_end(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            T.copy(Q[start : start + BT, h, 0:K], q_s)  # rows past eos: masked in P^T below
            T.copy(Kx[start : start + BT, h, 0:K], k_s)
            last = load_chunk_decay(Gamma, gamma_s, hv, start, eos)
            load_rstd(q_s, sq, rsum, q_rstd_s, l2norm)
            load_rstd(k_s, sq, rsum, k_rstd_s, l2norm)
            for i in T.Parallel(BT):
                if start + i < eos:
                    QFactor[start + i, hv] = scale * T.exp(gamma_s[i]) * q_rstd_s[i]
                    KFactor[start + i, hv] = T.exp(last - gamma_s[i]) * k_rstd_s[i]
            # P^T[j, t] = k_j . q_t e^(gamma_t - gamma_j) for key j <= query t
            T.gemm(k_s, q_s, attn_t, transpose_B=True, clear_accum=True)
            for j, i in T.Parallel(BT, BT):
                attn_t_h[j, i] = T.cast(
                    T.if_then_else(
                        (i >= j) and (start + i < eos),
                        attn_t[j, i] * T.exp(gamma_s[i] - gamma_s[j]) * (scale * q_rstd_s[i] * k_rstd_s[j]),
                        0.0,
                    ),
                    OPERAND,
                )
            for i_v in T.Pipelined(V // BV, num_stages=2):
                v0 = i_v * BV
                load_rows(DO, do_h, hv, v0, start, eos)
                T.gemm(attn_t_h, do_h, du, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    if start + i < eos:
                        DU[start + i, hv, v0 + j] = T.cast(du[i, j], OPERAND)

    return gdr_chunk_local_grad


def state_grad_kernel(
    K: int, V: int, BV: int, dtype: str, has_initial: bool, final_grad: bool, varlen: bool, stages: int
):
    R, H, HV, NS, NC, NTC, NF = T.dynamic("rows, heads, v_heads, n_states, n_cu, n_chunks_total, n_first")
    threads = _state_threads(K, BV)
    state_shape = (NS, HV, K, V)

    @T.prim_func
    def gdr_chunk_state_grad(
        Q: T.Tensor((R, H, K), dtype),
        Kx: T.Tensor((R, H, K), dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        W: T.Tensor((R, HV, K), ACCUM),
        QFactor: T.Tensor((R, HV), ACCUM),
        KFactor: T.Tensor((R, HV), ACCUM),
        DO: T.Tensor((R, HV, V), dtype),
        DU: T.Tensor((R, HV, V), OPERAND),
        DStates: T.Tensor((NTC, HV, K, V), OPERAND),
        DHT: T.Tensor(state_shape if final_grad else (1,), ACCUM),
        DH0: T.Tensor(state_shape if has_initial else (1,), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        First: T.Tensor((NF,), "int32"),
        seq_len: T.int32,
        n_seq: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_seq * HV, V // BV, threads=threads) as (bnh, bv):  # sequences x heads on x (y caps at 65535)
            dstate = T.alloc_fragment((K, BV), ACCUM)  # dS', fp32 across the whole walk
            dstate_h = T.alloc_shared((K, BV), OPERAND)
            q_s = T.alloc_shared((BT, K), OPERAND)  # q and k as stored (pipelined loads), rows past eos unused
            k_s = T.alloc_shared((BT, K), OPERAND)
            w_s = T.alloc_shared((BT, K), ACCUM)  # w as stored (pipelined loads), rows past eos unused
            w_h = T.alloc_shared((BT, K), OPERAND)
            q_factor_s = T.alloc_shared((BT,), ACCUM)
            k_factor_s = T.alloc_shared((BT,), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)
            do_s = T.alloc_shared((BT, BV), dtype)  # dO and dU_local as stored (pipelined loads), rows past eos unused
            du_s = T.alloc_shared((BT, BV), OPERAND)
            du = T.alloc_fragment((BT, BV), ACCUM)
            du_neg_h = T.alloc_shared((BT, BV), OPERAND)  # -dU
            do_q_h = T.alloc_shared((BT, BV), OPERAND)  # diag(q factor) dO

            n, hv, h, v0, bos, eos = state_program(bnh, bv, HV, groups, BV, Cu, seq_len, varlen)
            first = First[n] if varlen else n * T.ceildiv(seq_len, BT)  # global index of the sequence's first chunk
            n_chunks = T.ceildiv(eos - bos, BT)
            load_state(dstate, DHT, n, hv, v0, final_grad)
            # no explicit barrier in the walk (as the forward's: TileLang plans the pipeline's barriers)
            for step in T.Pipelined(n_chunks, num_stages=stages):
                c = n_chunks - 1 - step
                start = bos + c * BT
                T.copy(Q[start : start + BT, h, 0:K], q_s)
                T.copy(Kx[start : start + BT, h, 0:K], k_s)
                T.copy(DO[start : start + BT, hv, v0 : v0 + BV], do_s)
                T.copy(DU[start : start + BT, hv, v0 : v0 + BV], du_s)  # rows of chunk c: written back below
                T.copy(W[start : start + BT, hv, 0:K], w_s)  # rows past eos: dU is zero there
                # the row vectors by cp.async: TileLang 0.1.15 lets the producer refill them once the first TMA tile
                # above (q's, or dO's where fp16 q and k convert) is released, so each read comes before its last use
                for i in T.Parallel(BT):
                    q_factor_s[i] = T.if_then_else(start + i < eos, QFactor[start + i, hv], 0.0)
                    k_factor_s[i] = T.if_then_else(start + i < eos, KFactor[start + i, hv], 0.0)
                    gamma_s[i] = T.if_then_else(start + i < eos, Gamma[start + i, hv], 0.0)
                # w rounded to bf16 here, not in its load: a tile the producer writes is released before the last
                # product that reads it (TileLang 0.1.15), and w^T dU is the walk's last product
                T.copy(w_s, w_h)
                last = gamma_s[T.min(BT, eos - start) - 1]
                for i, j in T.Parallel(K, BV):  # dS' of chunk c: the gradient of the state leaving it
                    DStates[first + c, hv, i, v0 + j] = T.cast(dstate[i, j], OPERAND)
                T.copy(dstate, dstate_h)
                # dU = dU_local + diag(k factor) K dS'
                T.gemm(k_s, dstate_h, du, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    du[i, j] = T.if_then_else(
                        start + i < eos, T.cast(du_s[i, j], ACCUM) + du[i, j] * k_factor_s[i], 0.0
                    )
                    du_neg_h[i, j] = T.cast(-du[i, j], OPERAND)
                    do_q_h[i, j] = T.cast(
                        T.if_then_else(start + i < eos, T.cast(do_s[i, j], ACCUM) * q_factor_s[i], 0.0), OPERAND
                    )
                for i, j in T.Parallel(BT, BV):
                    if start + i < eos:
                        DU[start + i, hv, v0 + j] = T.cast(du[i, j], OPERAND)
                # dS = e^gamma_last dS' + Q~^T dO - w^T dU, accumulated into the fp32 fragment
                for i, j in T.Parallel(K, BV):
                    dstate[i, j] = dstate[i, j] * T.exp(last)
                T.gemm(q_s, do_q_h, dstate, transpose_A=True)
                T.gemm(w_h, du_neg_h, dstate, transpose_A=True)
            if has_initial:
                store_state(DH0, dstate, n, hv, v0)

    return gdr_chunk_state_grad


def grad_qk_kernel(K: int, V: int, BV: int, dtype: str, l2norm: bool, varlen: bool):
    R, H, HV, NC, NT, NTC = T.dynamic("rows, heads, v_heads, n_cu, n_chunk_rows, n_chunks_total")

    @T.prim_func
    def gdr_chunk_grad_qk(
        Q: T.Tensor((R, H, K), dtype),
        Kx: T.Tensor((R, H, K), dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        States: T.Tensor((NTC, HV, K, V), OPERAND),
        DStates: T.Tensor((NTC, HV, K, V), OPERAND),
        Corrections: T.Tensor((R, HV, V), OPERAND),
        DO: T.Tensor((R, HV, V), dtype),
        DU: T.Tensor((R, HV, V), OPERAND),
        DQ: T.Tensor((R, HV, K), ACCUM),
        DKPart: T.Tensor((R, HV, K), ACCUM),
        DW: T.Tensor((R, HV, K), OPERAND),
        DGamma: T.Tensor((R, HV), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        Chunks: T.Tensor((NT, 2) if varlen else (1,), "int32"),
        scale: T.float32,
        seq_len: T.int32,
        n_chunks: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(NTC, HV, threads=_grad_threads(K)) as (i_t, hv):
            q_s = T.alloc_shared((BT, K), OPERAND)
            k_s = T.alloc_shared((BT, K), OPERAND)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            q_rstd_s = T.alloc_shared((BT,), ACCUM)
            k_rstd_s = T.alloc_shared((BT,), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)
            # the V loop's tiles and accumulators
            s_h = T.alloc_shared((K, BV), OPERAND)
            ds_h = T.alloc_shared((K, BV), OPERAND)
            do_h = T.alloc_shared((BT, BV), OPERAND)
            du_h = T.alloc_shared((BT, BV), OPERAND)
            u_h = T.alloc_shared((BT, BV), OPERAND)
            s_ds = T.alloc_fragment((K, BV), ACCUM)  # sum over V blocks of S * dS'
            dq = T.alloc_fragment((BT, K), ACCUM)  # dO S^T, then dq
            dk = T.alloc_fragment((BT, K), ACCUM)  # U dS'^T, then the part of dk from O and S'
            dw_neg = T.alloc_fragment((BT, K), ACCUM)  # dU S^T = -dw
            dp = T.alloc_fragment((BT, BT), ACCUM)  # dO U^T, then dP
            # after the V loop
            qk = T.alloc_fragment((BT, BT), ACCUM)
            dp_k_h = T.alloc_shared((BT, BT), OPERAND)  # dP diag(rstd_k)
            dp_q_h = T.alloc_shared((BT, BT), OPERAND)  # diag(rstd_q) dP
            prod = T.alloc_fragment((BT, K), ACCUM)
            row = T.alloc_fragment((BT,), ACCUM)
            column = T.alloc_fragment((BT,), ACCUM)
            row_s = T.alloc_fragment((K,), ACCUM)
            k_term = T.alloc_fragment((BT,), ACCUM)
            total = T.alloc_fragment((1,), ACCUM)
            totals_s = T.alloc_shared((2,), ACCUM)  # <S, dS'> and the sum of the k terms
            m_rows_s = T.alloc_shared((BT,), ACCUM)
            m_cols_s = T.alloc_shared((BT,), ACCUM)
            q_dq_s = T.alloc_shared((BT,), ACCUM)
            k_term_s = T.alloc_shared((BT,), ACCUM)

            # bound once: as expressions TileLang would recompute their divisions, in int64, at every access
            h = T.alloc_var("int32", init=hv // groups)
            start = T.alloc_var("int32", init=chunk_start(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            eos = T.alloc_var("int32", init=chunk_end(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            T.copy(Q[start : start + BT, h, 0:K], q_s)  # rows past eos: masked in every sum over rows below
            T.copy(Kx[start : start + BT, h, 0:K], k_s)
            last = load_chunk_decay(Gamma, gamma_s, hv, start, eos)
            load_rstd(q_s, sq, rsum, q_rstd_s, l2norm)
            load_rstd(k_s, sq, rsum, k_rstd_s, l2norm)
            T.clear(dq)
            T.clear(dk)
            T.clear(dw_neg)
            T.clear(dp)
            T.clear(s_ds)
            for i_v in T.Pipelined(V // BV, num_stages=2):
                v0 = i_v * BV
                # cp.async, not TMA: TMA would warp-specialise the loop, halving the registers of the accumulators.
                # Rows past eos are not masked: every product here is per row of dO, dU, U or masked by dP's select
                T.copy(States[i_t, hv, 0:K, v0 : v0 + BV], s_h, disable_tma=True)
                T.copy(DStates[i_t, hv, 0:K, v0 : v0 + BV], ds_h, disable_tma=True)
                T.copy(DU[start : start + BT, hv, v0 : v0 + BV], du_h, disable_tma=True)
                T.copy(Corrections[start : start + BT, hv, v0 : v0 + BV], u_h, disable_tma=True)
                if dtype == OPERAND:
                    T.copy(DO[start : start + BT, hv, v0 : v0 + BV], do_h, disable_tma=True)
                else:
                    load_rows(DO, do_h, hv, v0, start, eos)
                for i, j in T.Parallel(K, BV):
                    s_ds[i, j] += T.cast(s_h[i, j], ACCUM) * T.cast(ds_h[i, j], ACCUM)
                T.gemm(do_h, s_h, dq, transpose_B=True)
                T.gemm(u_h, ds_h, dk, transpose_B=True)
                T.gemm(du_h, s_h, dw_neg, transpose_B=True)
                T.gemm(do_h, u_h, dp, transpose_B=True)
            for i, j in T.Parallel(BT, K):
                if start + i < eos:
                    DW[start + i, hv, j] = T.cast(-dw_neg[i, j], OPERAND)
            T.reduce_sum(s_ds, row_s, dim=1)
            T.reduce_sum(row_s, total, dim=0)
            T.copy(total, totals_s[0:1])
            # O: dP = scale (dO U^T * decay) (causal); dgamma gets the row minus the column sums of dP * (Q K^T)
            for i, j in T.Parallel(BT, BT):
                dp[i, j] = T.if_then_else(
                    (i >= j) and (start + i < eos), dp[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * scale, 0.0
                )
                dp_k_h[i, j] = T.cast(dp[i, j] * k_rstd_s[j], OPERAND)
                dp_q_h[i, j] = T.cast(dp[i, j] * q_rstd_s[i], OPERAND)
            T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                qk[i, j] = dp[i, j] * qk[i, j] * (q_rstd_s[i] * k_rstd_s[j])
            T.reduce_sum(qk, row, dim=1)
            T.copy(row, m_rows_s)
            T.reduce_sum(qk, column, dim=0)
            T.copy(column, m_cols_s)
            # per row: q . dO S^T (dgamma through diag(e^gamma)), k . U dS'^T (through e^(gamma_last - gamma))
            for i, j in T.Parallel(BT, K):
                prod[i, j] = dq[i, j] * T.cast(q_s[i, j], ACCUM)
            T.reduce_sum(prod, row, dim=1)
            T.copy(row, q_dq_s)
            for i, j in T.Parallel(BT, K):
                prod[i, j] = dk[i, j] * T.cast(k_s[i, j], ACCUM)
            T.reduce_sum(prod, row, dim=1)
            for i in T.Parallel(BT):
                k_term[i] = T.if_then_else(start + i < eos, T.exp(last - gamma_s[i]) * k_rstd_s[i] * row[i], 0.0)
            T.copy(k_term, k_term_s)
            T.reduce_sum(k_term, total, dim=0)
            T.copy(total, totals_s[1:2])
            # dq = scale e^gamma dO S^T + dP K, dk = e^(gamma_last - gamma) U dS'^T + dP^T Q (normalised rows)
            for i, j in T.Parallel(BT, K):
                dq[i, j] = dq[i, j] * (scale * T.exp(gamma_s[i]))
                dk[i, j] = dk[i, j] * T.if_then_else(start + i < eos, T.exp(last - gamma_s[i]), 0.0)
            T.gemm(dp_k_h, k_s, dq)
            T.gemm(dp_q_h, q_s, dk, transpose_A=True)
            if l2norm:  # x_n = x rstd: dx = (dx_n - x_n (dx_n . x_n)) rstd
                for i, j in T.Parallel(BT, K):
                    prod[i, j] = dq[i, j] * T.cast(q_s[i, j], ACCUM)
                T.reduce_sum(prod, row, dim=1)
                for i, j in T.Parallel(BT, K):
                    dq[i, j] = (dq[i, j] - T.cast(q_s[i, j], ACCUM) * (q_rstd_s[i] * q_rstd_s[i] * row[i])) * q_rstd_s[
                        i
                    ]
            for i, j in T.Parallel(BT, K):
                if start + i < eos:
                    DQ[start + i, hv, j] = dq[i, j]
                    DKPart[start + i, hv, j] = dk[i, j]
            # dgamma_last = e^gamma_last <S, dS'> + sum_t e^(gamma_last - gamma_t) k_t . (U dS'^T)_t, on the last row
            # (the reverse cumulative sum takes it to every g of the chunk)
            for i in T.Parallel(BT):
                to_last = T.if_then_else(i == T.min(BT, eos - start) - 1, totals_s[0] * T.exp(last) + totals_s[1], 0.0)
                if start + i < eos:
                    DGamma[start + i, hv] = (
                        scale * T.exp(gamma_s[i]) * q_rstd_s[i] * q_dq_s[i]
                        + m_rows_s[i]
                        - m_cols_s[i]
                        - k_term_s[i]
                        + to_last
                    )

    return gdr_chunk_grad_qk


def grad_wy_kernel(K: int, V: int, BV: int, dtype: str, g_dtype: str, beta_dtype: str, l2norm: bool, varlen: bool):
    R, H, HV, NC, NT = T.dynamic("rows, heads, v_heads, n_cu, n_chunk_rows")

    @T.prim_func
    def gdr_chunk_grad_wy(
        Kx: T.Tensor((R, H, K), dtype),
        Vx: T.Tensor((R, HV, V), dtype),
        G: T.Tensor((R, HV), g_dtype),
        Beta: T.Tensor((R, HV), beta_dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        Inverse: T.Tensor((R, HV, BT), ACCUM),
        Corrections: T.Tensor((R, HV, V), OPERAND),
        DU: T.Tensor((R, HV, V), OPERAND),
        DW: T.Tensor((R, HV, K), OPERAND),
        DKPart: T.Tensor((R, HV, K), ACCUM),
        DGamma: T.Tensor((R, HV), ACCUM),
        DK: T.Tensor((R, HV, K), ACCUM),
        DV: T.Tensor((R, HV, V), dtype),
        DBeta: T.Tensor((R, HV), ACCUM),
        DG: T.Tensor((R, HV), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        Chunks: T.Tensor((NT, 2) if varlen else (1,), "int32"),
        seq_len: T.int32,
        n_chunks: T.int32,
        n_total: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_total, HV, threads=_grad_threads(K)) as (i_t, hv):
            k_s = T.alloc_shared((BT, K), OPERAND)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            k_rstd_s = T.alloc_shared((BT,), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)
            beta_s = T.alloc_shared((BT,), ACCUM)
            inv_h = T.alloc_shared((BT, BT), OPERAND)  # T = (I + A)^-1
            dk_part_s = T.alloc_shared((BT, K), ACCUM)
            # the V loop
            du_h = T.alloc_shared((BT, BV), OPERAND)  # dU as dU U^T's first operand
            du_t = T.alloc_shared((BV, BT), OPERAND)  # dU^T: T^T dU's second operand, K-major (N-major failed at BV 16)
            u_h = T.alloc_shared((BT, BV), OPERAND)
            v_s = T.alloc_shared((BT, BV), dtype)
            du_u = T.alloc_fragment((BT, BT), ACCUM)  # dU U^T = dT T^T
            dv_beta = T.alloc_fragment((BT, BV), ACCUM)  # T^T dU
            prod_v = T.alloc_fragment((BT, BV), ACCUM)  # (T^T dU) * v summed over the V blocks
            dbeta_v = T.alloc_fragment((BT,), ACCUM)
            # through A and w
            du_u_h = T.alloc_shared((BT, BT), OPERAND)
            da = T.alloc_fragment((BT, BT), ACCUM)
            da_s = T.alloc_shared((BT, BT), ACCUM)  # dA~ = dA * decay, strictly lower
            kk = T.alloc_fragment((BT, BT), ACCUM)
            dkk_h = T.alloc_shared((BT, BT), OPERAND)
            dw_h = T.alloc_shared((BT, K), OPERAND)
            dk_w = T.alloc_fragment((BT, K), ACCUM)  # T^T dw
            dk = T.alloc_fragment((BT, K), ACCUM)
            prod = T.alloc_fragment((BT, K), ACCUM)
            row = T.alloc_fragment((BT,), ACCUM)
            column = T.alloc_fragment((BT,), ACCUM)
            dbeta_v_s = T.alloc_shared((BT,), ACCUM)
            k_dkw_s = T.alloc_shared((BT,), ACCUM)
            a_rows_s = T.alloc_shared((BT,), ACCUM)
            a_cols_s = T.alloc_shared((BT,), ACCUM)
            dgamma_s = T.alloc_shared((BT,), ACCUM)

            # bound once: as expressions TileLang would recompute their divisions, in int64, at every access
            h = T.alloc_var("int32", init=hv // groups)
            start = T.alloc_var("int32", init=chunk_start(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            eos = T.alloc_var("int32", init=chunk_end(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            # every load that waits on no other first, so that their latencies overlap. Rows past eos are another
            # sequence's or zeros: masked (a select: 0 * inf would be NaN) where a product sums over rows, else they
            # only reach rows that are not stored
            T.copy(Kx[start : start + BT, h, 0:K], k_s)
            load_rows(DW, dw_h, hv, 0, start, eos)
            T.copy(DKPart[start : start + BT, hv, 0:K], dk_part_s)
            load_rows(Inverse, inv_h, hv, 0, start, eos)
            load_chunk_decay(Gamma, gamma_s, hv, start, eos)
            for i in T.Parallel(BT):
                beta_s[i] = T.if_then_else(start + i < eos, T.cast(Beta[start + i, hv], ACCUM), 0.0)
            load_rstd(k_s, sq, rsum, k_rstd_s, l2norm)
            T.clear(du_u)
            T.clear(prod_v)
            # u = T diag(beta) V: dv = beta T^T dU; dbeta's part from v
            for i_v in T.Pipelined(V // BV, num_stages=2):
                v0 = i_v * BV
                T.copy(DU[start : start + BT, hv, v0 : v0 + BV], du_h, disable_tma=True)
                T.copy(Corrections[start : start + BT, hv, v0 : v0 + BV], u_h, disable_tma=True)
                T.copy(Vx[start : start + BT, hv, v0 : v0 + BV], v_s, disable_tma=True)
                for i, j in T.Parallel(BT, BV):
                    du_t[j, i] = T.if_then_else(start + i < eos, du_h[i, j], T.cast(0.0, OPERAND))
                T.gemm(du_h, u_h, du_u, transpose_B=True)
                T.gemm(inv_h, du_t, dv_beta, transpose_A=True, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    if start + i < eos:
                        DV[start + i, hv, v0 + j] = T.cast(dv_beta[i, j] * beta_s[i], dtype)
                for i, j in T.Parallel(BT, BV):
                    prod_v[i, j] += dv_beta[i, j] * T.cast(v_s[i, j], ACCUM)
            T.reduce_sum(prod_v, dbeta_v, dim=1)
            T.copy(dbeta_v, dbeta_v_s)
            # T = (I + A)^-1: dA = -T^T dT T^T = -T^T (dU U^T), strictly lower; dA~ = dA * e^(gamma_t - gamma_j)
            for i, j in T.Parallel(BT, BT):  # dU and U unmasked in the V loop
                du_u_h[i, j] = T.cast(T.if_then_else((start + i < eos) and (start + j < eos), du_u[i, j], 0.0), OPERAND)
            T.gemm(inv_h, du_u_h, da, transpose_A=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                da_s[i, j] = T.if_then_else(
                    (i > j) and (start + i < eos), -da[i, j] * T.exp(gamma_s[i] - gamma_s[j]), 0.0
                )
            # w = T diag(beta e^gamma) K: dk += diag(beta e^gamma) T^T dw, dbeta += e^gamma (T^T dw) . k
            T.gemm(inv_h, dw_h, dk_w, transpose_A=True, clear_accum=True)
            for i, j in T.Parallel(BT, K):
                prod[i, j] = dk_w[i, j] * T.cast(k_s[i, j], ACCUM)
            T.reduce_sum(prod, row, dim=1)
            T.copy(row, k_dkw_s)
            # A = beta_t e^(gamma_t - gamma_j) k_t . k_j (j < t): dbeta += rows of dA~ * KK^T; dgamma += beta (rows)
            # - (columns of beta dA~ * KK^T)
            T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                kk[i, j] = da_s[i, j] * kk[i, j] * (k_rstd_s[i] * k_rstd_s[j])
            T.reduce_sum(kk, row, dim=1)
            T.copy(row, a_rows_s)
            for i, j in T.Parallel(BT, BT):
                kk[i, j] = kk[i, j] * beta_s[i]
            T.reduce_sum(kk, column, dim=0)
            T.copy(column, a_cols_s)
            # dk += (diag(beta) dA~ + dA~^T diag(beta)) K (normalised rows: K = diag(rstd) K_raw)
            for i, j in T.Parallel(BT, BT):
                dkk_h[i, j] = T.cast((da_s[i, j] * beta_s[i] + da_s[j, i] * beta_s[j]) * k_rstd_s[j], OPERAND)
            for i, j in T.Parallel(BT, K):
                dk[i, j] = dk_part_s[i, j] + dk_w[i, j] * (beta_s[i] * T.exp(gamma_s[i]))
            T.gemm(dkk_h, k_s, dk)
            if l2norm:  # x_n = x rstd: dx = (dx_n - x_n (dx_n . x_n)) rstd
                for i, j in T.Parallel(BT, K):
                    prod[i, j] = dk[i, j] * T.cast(k_s[i, j], ACCUM)
                T.reduce_sum(prod, row, dim=1)
                for i, j in T.Parallel(BT, K):
                    dk[i, j] = (dk[i, j] - T.cast(k_s[i, j], ACCUM) * (k_rstd_s[i] * k_rstd_s[i] * row[i])) * k_rstd_s[
                        i
                    ]
            for i, j in T.Parallel(BT, K):
                if start + i < eos:
                    DK[start + i, hv, j] = dk[i, j]
            for i in T.Parallel(BT):
                k_dkw = T.alloc_var(ACCUM)
                k_dkw = T.exp(gamma_s[i]) * k_rstd_s[i] * k_dkw_s[i]
                if start + i < eos:
                    DBeta[start + i, hv] = dbeta_v_s[i] + k_dkw + a_rows_s[i]
                dgamma_s[i] = T.if_then_else(
                    start + i < eos,
                    DGamma[start + i, hv] + beta_s[i] * (k_dkw + a_rows_s[i]) - a_cols_s[i],
                    0.0,
                )
            # dg = the reverse cumulative sum of dgamma within the chunk
            T.sync_threads()
            T.cumsum(dgamma_s, dim=0, reverse=True)
            T.sync_threads()
            for i in T.Parallel(BT):
                if start + i < eos:  # 0 at a full decay, which gamma does not sum (reference.local_gamma)
                    DG[start + i, hv] = T.if_then_else(T.cast(G[start + i, hv], ACCUM) <= -FULL_DECAY, 0.0, dgamma_s[i])

    return gdr_chunk_grad_wy


# --------------------------------------------------------------------------- entries and launcher


def local_grad_entry(K: int, V: int, dtype, l2norm: bool, varlen: bool) -> Entry:
    BV = min(V, 64)
    key = ("gdr_chunk_local_grad", K, V, BV, dtype, l2norm, varlen)
    return key, lambda _: local_grad_kernel(K, V, BV, TL_DTYPE[dtype], l2norm, varlen)


def state_grad_entry(K: int, V: int, dtype, has_initial: bool, final_grad: bool, varlen: bool) -> Entry:
    BV, stages = _state_block(K, V), _walk_stages(K, dtype)
    flags = (has_initial, final_grad, varlen)
    key = ("gdr_chunk_state_grad", K, V, BV, dtype, flags, stages)
    return key, lambda _: state_grad_kernel(K, V, BV, TL_DTYPE[dtype], *flags, stages)


def grad_qk_entry(K: int, V: int, dtype, l2norm: bool, varlen: bool) -> Entry:
    BV = _qk_value_block(V)
    key = ("gdr_chunk_grad_qk", K, V, BV, dtype, l2norm, varlen)
    return key, lambda _: grad_qk_kernel(K, V, BV, TL_DTYPE[dtype], l2norm, varlen)


def grad_wy_entry(K: int, V: int, dtype, g_dtype, beta_dtype, l2norm: bool, varlen: bool) -> Entry:
    BV = _value_block(K, V)
    key = ("gdr_chunk_grad_wy", K, V, BV, dtype, g_dtype, beta_dtype, l2norm, varlen)
    return key, lambda _: grad_wy_kernel(
        K, V, BV, TL_DTYPE[dtype], TL_DTYPE[g_dtype], TL_DTYPE[beta_dtype], l2norm, varlen
    )


def backward_entries(
    K: int, V: int, dtype, g_dtype, beta_dtype, has_initial: bool, final_grad: bool, l2norm: bool, varlen: bool
) -> list[Entry]:
    """The kernels one backward runs beside the forward's prepare (for `precompile`)."""
    return [
        storing_walk_entry(K, V, dtype, has_initial, False, l2norm, varlen),
        local_grad_entry(K, V, dtype, l2norm, varlen),
        state_grad_entry(K, V, dtype, has_initial, final_grad, varlen),
        grad_qk_entry(K, V, dtype, l2norm, varlen),
        grad_wy_entry(K, V, dtype, g_dtype, beta_dtype, l2norm, varlen),
    ]


def _per_qk_head(x: torch.Tensor, B: int, T_: int, H: int, dtype) -> torch.Tensor:
    """[B * T, HV, K] fp32 per value head -> [B, T, H, K] in dtype: GVA sums a q/k head's value heads (one pass over
    the fp32 buffer without GVA: no sum over a single value head)."""
    groups, K = x.shape[1] // H, x.shape[2]
    x = x.view(B, T_, H, groups, K)
    return (x[:, :, :, 0] if groups == 1 else x.sum(3)).to(dtype)


def chunk_backward(
    grad_o, grad_final, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
    o, final, gamma, w, u, inverse,
):  # fmt: skip
    """(dq, dk, dv, dg, dbeta, None, d(initial_state), None, None, None), as triton.chunk_backward."""
    state_dtype = None if initial_state is None else initial_state.dtype
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    grad_o = grad_o.contiguous()
    B, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    R, n, device = B * T_, _sequences(v, cu_seqlens), q.device
    l2norm, varlen, has_initial = bool(use_qk_l2norm_in_kernel), cu_seqlens is not None, initial_state is not None
    final_grad = bool(output_final_state) and grad_final.numel() > 0
    dq = buffers.empty((R, HV, K), dtype=torch.float32, device=device)
    dk = buffers.empty((R, HV, K), dtype=torch.float32, device=device)
    dv = buffers.empty(v.shape, dtype=v.dtype, device=device)
    dbeta = buffers.empty((R, HV), dtype=torch.float32, device=device)
    dg = buffers.empty((R, HV), dtype=torch.float32, device=device)
    dh0 = buffers.empty((n, HV, K, V), dtype=torch.float32, device=device) if has_initial else None
    chunks = Chunks.of(B, T_, cu_seqlens, device)
    if n > 0 and chunks.total > 0:
        rows = lambda x, *tail: x.view(R, *tail)  # noqa: E731
        q_rows, k_rows, do_rows = rows(q, H, K), rows(k, H, K), rows(grad_o, HV, V)
        per_chunk = (chunks.cu, chunks.table, float(scale), T_, max(chunks.per_sequence, 1))
        h0 = initial_state if has_initial else placeholder(device)
        states = buffers.empty((chunks.total, HV, K, V), dtype=OPERAND_TORCH, device=device)
        corrections = buffers.empty((R, HV, V), dtype=OPERAND_TORCH, device=device)
        walk_flags = (has_initial, False, l2norm, varlen)
        store_states(k_rows, gamma, w, u, h0, placeholder(device), states, corrections, chunks, T_, n, walk_flags)
        du = buffers.empty((R, HV, V), dtype=OPERAND_TORCH, device=device)  # dU_local, then dU
        q_factor = buffers.empty((R, HV), dtype=torch.float32, device=device)
        k_factor = buffers.empty((R, HV), dtype=torch.float32, device=device)
        launcher(local_grad_entry(K, V, q.dtype, l2norm, varlen), device)(
            q_rows, k_rows, gamma, do_rows, du, q_factor, k_factor, *per_chunk, chunks.total, HV // H
        )
        dstates = buffers.empty((chunks.total, HV, K, V), dtype=OPERAND_TORCH, device=device)
        launcher(state_grad_entry(K, V, q.dtype, has_initial, final_grad, varlen), device)(
            q_rows, k_rows, gamma, w, q_factor, k_factor, do_rows, du, dstates,
            grad_final.to(torch.float32).contiguous() if final_grad else placeholder(device),
            dh0 if has_initial else placeholder(device), chunks.cu, chunks.first, T_, n, HV // H,
        )  # fmt: skip
        dk_part = buffers.empty((R, HV, K), dtype=torch.float32, device=device)
        dw = buffers.empty((R, HV, K), dtype=OPERAND_TORCH, device=device)
        d_gamma = buffers.empty((R, HV), dtype=torch.float32, device=device)
        launcher(grad_qk_entry(K, V, q.dtype, l2norm, varlen), device)(
            q_rows, k_rows, gamma, states, dstates, corrections, do_rows, du, dq, dk_part, dw, d_gamma,
            *per_chunk, HV // H,
        )  # fmt: skip
        launcher(grad_wy_entry(K, V, q.dtype, g.dtype, beta.dtype, l2norm, varlen), device)(
            k_rows, rows(v, HV, V), rows(g, HV), rows(beta, HV), gamma, inverse, corrections, du, dw, dk_part,
            d_gamma, dk, rows(dv, HV, V), dbeta, dg, chunks.cu, chunks.table, T_, max(chunks.per_sequence, 1),
            chunks.total, HV // H,
        )  # fmt: skip
    elif has_initial:  # no step at all: the final state is the initial one
        dh0.copy_(grad_final) if final_grad else dh0.zero_()
    dq, dk = _per_qk_head(dq, B, T_, H, q.dtype), _per_qk_head(dk, B, T_, H, k.dtype)
    dg = dg.view(B, T_, HV).to(g.dtype)
    dbeta = dbeta.view(B, T_, HV).to(beta.dtype)
    dh0 = None if dh0 is None else dh0.to(state_dtype)
    return dq, dk, dv, dg, dbeta, None, dh0, None, None, None
