"""The chunked gated delta rule's backward in TileLang (the contract of triton.chunk_backward).

The math is triton.py's ("chunked backward"). Per chunk, with S the state entering it, S' the state
leaving it, P the causal attention (Q K^T * e^(gamma_t - gamma_j))_{j <= t}, T = (I + A)^-1 and the
corrections U = u - w S:

    O = scale (diag(e^gamma) Q S + P U)        S' = e^gamma_last S + (K * e^(gamma_last - gamma))^T U

Three launches after the forward's factors (gamma, w, u, T):
  0. the forward's state walk again (tilelang.state_output_kernel, store_states, no output): the state
     entering each chunk, States[global chunk];
  1. state_grad, one program per (V block, sequence x value head), walks the chunks backwards with
     dS' in a fragment:  DStates[chunk] = dS',  dU = scale P^T dO + (K e^(gamma_last - gamma)) dS',
     dS = e^gamma_last dS' + scale (Q e^gamma)^T dO - w^T dU;  the first chunk's dS is d(initial_state);
  2. chunk_grad, one program per (chunk, value head): over V blocks the terms that need S, dS', dO, dU,
     u and v (dO S^T, U dS'^T, dw = -dU S^T, dO U^T, dT's u part, dv = beta T^T dU), then the
     intra-chunk terms of O and S', the WY factors through T (dA = -T^T dT T^T, strictly lower), the
     reverse cumulative sum dgamma -> dg and the l2norm backward of q and k.
dq/dk are written per value head (fp32) and summed over the value heads of each q/k head (GVA) in torch.

Rows of chunks past their sequence's end are zero in every shared tile, and every decay factor is
masked to the rows inside the sequence (so a strong decay cannot make 0 * inf there). The row and
column sums over [BT, BT] tiles run a thread per row on shared memory.
"""

import tilelang.language as T
import torch

from .. import buffers
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher, placeholder
from .reference import FULL_DECAY
from .tilelang_shared import (
    BT,
    L2NORM_EPS,
    Chunks,
    _contiguous,
    _sequences,
    _state_block,
    _state_threads,
    chunk_end,
    chunk_start,
    load_chunk_decay_and_w,
    load_qk_rows,
    load_state,
    state_output_entry,
    state_program,
    store_state,
)


def _grad_block(K: int, V: int) -> int:
    """V block of chunk_grad: its fp32 tiles for K=128 and BV=32 stay under sm_90's shared memory."""
    return min(V, 32 if K >= 64 else 64)


def _grad_threads(K: int) -> int:
    # three [BT, K] fp32 accumulators live across the V loop: with 4 warps at K >= 64 ptxas spills
    return 256 if K >= 64 else 128


# --------------------------------------------------------------------------- kernels


def state_grad_kernel(
    K: int, V: int, BV: int, dtype: str, has_initial: bool, final_grad: bool, l2norm: bool, varlen: bool
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
        DO: T.Tensor((R, HV, V), dtype),
        DU: T.Tensor((R, HV, V), ACCUM),
        DStates: T.Tensor((NTC, HV, K, V), ACCUM),
        DHT: T.Tensor(state_shape if final_grad else (1,), ACCUM),
        DH0: T.Tensor(state_shape if has_initial else (1,), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        First: T.Tensor((NF,), "int32"),
        scale: T.float32,
        seq_len: T.int32,
        n_seq: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_seq * HV, V // BV, threads=threads) as (bnh, bv):  # sequences x heads on x (y caps at 65535)
            dstate = T.alloc_fragment((K, BV), ACCUM)
            dstate_s = T.alloc_shared((K, BV), ACCUM)
            q_f = T.alloc_fragment((BT, K), ACCUM)
            k_f = T.alloc_fragment((BT, K), ACCUM)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            q_s = T.alloc_shared((BT, K), ACCUM)
            k_s = T.alloc_shared((BT, K), ACCUM)
            qg_s = T.alloc_shared((BT, K), ACCUM)
            kd_s = T.alloc_shared((BT, K), ACCUM)
            w_s = T.alloc_shared((BT, K), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)
            do_s = T.alloc_shared((BT, BV), ACCUM)
            attn = T.alloc_fragment((BT, BT), ACCUM)
            attn_s = T.alloc_shared((BT, BT), ACCUM)
            du_attn = T.alloc_fragment((BT, BV), ACCUM)
            du_state = T.alloc_fragment((BT, BV), ACCUM)
            du_s = T.alloc_shared((BT, BV), ACCUM)
            ds_output = T.alloc_fragment((K, BV), ACCUM)
            ds_w = T.alloc_fragment((K, BV), ACCUM)

            n, hv, h, v0, bos, eos = state_program(bnh, bv, HV, groups, BV, Cu, seq_len, varlen)
            first = First[n] if varlen else n * T.ceildiv(seq_len, BT)  # global index of the sequence's first chunk
            n_chunks = T.ceildiv(eos - bos, BT)
            load_state(dstate, DHT, n, hv, v0, final_grad)
            for step in T.serial(n_chunks):
                c = n_chunks - 1 - step
                start = bos + c * BT
                # dS' of chunk c: the gradient of the state leaving it
                for i, j in T.Parallel(K, BV):
                    DStates[first + c, hv, i, v0 + j] = dstate[i, j]
                last = load_chunk_decay_and_w(Gamma, W, gamma_s, w_s, hv, start, eos)
                for i, j in T.Parallel(BT, BV):
                    do_s[i, j] = T.if_then_else(start + i < eos, T.cast(DO[start + i, hv, v0 + j], ACCUM), 0.0)
                load_qk_rows(Q, h, start, eos, q_f, sq, rsum, l2norm)
                T.copy(q_f, q_s)
                load_qk_rows(Kx, h, start, eos, k_f, sq, rsum, l2norm)
                T.copy(k_f, k_s)
                T.copy(dstate, dstate_s)
                T.sync_threads()
                for i, j in T.Parallel(BT, K):
                    qg_s[i, j] = q_s[i, j] * (T.exp(gamma_s[i]) * scale)
                    kd_s[i, j] = T.if_then_else(start + i < eos, k_s[i, j] * T.exp(last - gamma_s[i]), 0.0)
                T.gemm(q_s, k_s, attn, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BT, BT):  # scale P
                    attn_s[i, j] = T.if_then_else(
                        (i >= j) and (start + i < eos), attn[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * scale, 0.0
                    )
                T.sync_threads()
                # dU = scale P^T dO + (K e^(gamma_last - gamma)) dS'
                T.gemm(attn_s, do_s, du_attn, transpose_A=True, clear_accum=True)
                T.gemm(kd_s, dstate_s, du_state, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    du_s[i, j] = du_attn[i, j] + du_state[i, j]
                for i, j in T.Parallel(BT, BV):
                    if start + i < eos:
                        DU[start + i, hv, v0 + j] = du_attn[i, j] + du_state[i, j]
                T.sync_threads()
                # dS = e^gamma_last dS' + scale (Q e^gamma)^T dO - w^T dU
                T.gemm(qg_s, do_s, ds_output, transpose_A=True, clear_accum=True)
                T.gemm(w_s, du_s, ds_w, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(K, BV):
                    dstate[i, j] = dstate[i, j] * T.exp(last) + ds_output[i, j] - ds_w[i, j]
                T.sync_threads()  # the next chunk overwrites the shared tiles
            if has_initial:
                store_state(DH0, dstate, n, hv, v0)

    return gdr_chunk_state_grad


def chunk_grad_kernel(K: int, V: int, BV: int, dtype: str, g_dtype: str, beta_dtype: str, l2norm: bool, varlen: bool):
    R, H, HV, NC, NT, NTC = T.dynamic("rows, heads, v_heads, n_cu, n_chunk_rows, n_chunks_total")
    threads = _grad_threads(K)

    @T.prim_func
    def gdr_chunk_grad(
        Q: T.Tensor((R, H, K), dtype),
        Kx: T.Tensor((R, H, K), dtype),
        Vx: T.Tensor((R, HV, V), dtype),
        G: T.Tensor((R, HV), g_dtype),
        Beta: T.Tensor((R, HV), beta_dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        W: T.Tensor((R, HV, K), ACCUM),
        U: T.Tensor((R, HV, V), ACCUM),
        Inverse: T.Tensor((R, HV, BT), ACCUM),
        States: T.Tensor((NTC, HV, K, V), ACCUM),
        DStates: T.Tensor((NTC, HV, K, V), ACCUM),
        DO: T.Tensor((R, HV, V), dtype),
        DU: T.Tensor((R, HV, V), ACCUM),
        DQ: T.Tensor((R, HV, K), ACCUM),
        DK: T.Tensor((R, HV, K), ACCUM),
        DV: T.Tensor((R, HV, V), dtype),
        DBeta: T.Tensor((R, HV), ACCUM),
        DG: T.Tensor((R, HV), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        Chunks: T.Tensor((NT, 2) if varlen else (1,), "int32"),
        scale: T.float32,
        seq_len: T.int32,
        n_chunks: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(NTC, HV, threads=threads) as (i_t, hv):
            q_f = T.alloc_fragment((BT, K), ACCUM)
            k_f = T.alloc_fragment((BT, K), ACCUM)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            q_s = T.alloc_shared((BT, K), ACCUM)
            k_s = T.alloc_shared((BT, K), ACCUM)
            w_s = T.alloc_shared((BT, K), ACCUM)
            inv_s = T.alloc_shared((BT, BT), ACCUM)  # T = (I + A)^-1
            gamma_s = T.alloc_shared((BT,), ACCUM)
            beta_s = T.alloc_shared((BT,), ACCUM)
            q_rstd_s = T.alloc_shared((BT,), ACCUM)
            k_rstd_s = T.alloc_shared((BT,), ACCUM)
            # the V loop's tiles and accumulators
            s_s = T.alloc_shared((K, BV), ACCUM)
            ds_s = T.alloc_shared((K, BV), ACCUM)
            do_s = T.alloc_shared((BT, BV), ACCUM)
            du_s = T.alloc_shared((BT, BV), ACCUM)
            v_s = T.alloc_shared((BT, BV), ACCUM)
            corr_s = T.alloc_shared((BT, BV), ACCUM)
            corr = T.alloc_fragment((BT, BV), ACCUM)
            dv_beta = T.alloc_fragment((BT, BV), ACCUM)  # T^T dU
            dbeta_v = T.alloc_fragment((BT, BV), ACCUM)  # sum over V blocks of (T^T dU) * v
            s_ds = T.alloc_fragment((K, BV), ACCUM)  # sum over V blocks of S * dS'
            dq = T.alloc_fragment((BT, K), ACCUM)  # dO S^T, then dq
            dk = T.alloc_fragment((BT, K), ACCUM)  # U dS'^T, then dk
            dw_neg = T.alloc_fragment((BT, K), ACCUM)  # dU S^T = -dw
            do_u = T.alloc_fragment((BT, BT), ACCUM)  # dO U^T
            du_v = T.alloc_fragment((BT, BT), ACCUM)  # dU V^T (dT's u part without beta)
            # after the V loop
            prod = T.alloc_fragment((BT, K), ACCUM)
            row_k = T.alloc_fragment((BT,), ACCUM)
            row_v = T.alloc_fragment((BT,), ACCUM)
            row_s = T.alloc_fragment((K,), ACCUM)
            s_ds_s = T.alloc_shared((K,), ACCUM)
            qk = T.alloc_fragment((BT, BT), ACCUM)
            kk = T.alloc_fragment((BT, BT), ACCUM)
            dp_s = T.alloc_shared((BT, BT), ACCUM)
            dpt_s = T.alloc_shared((BT, BT), ACCUM)  # dp transposed
            dw_s = T.alloc_shared((BT, K), ACCUM)
            kw_s = T.alloc_shared((BT, K), ACCUM)  # k beta e^gamma
            dk_w = T.alloc_fragment((BT, K), ACCUM)  # T^T dw
            dt_w = T.alloc_fragment((BT, BT), ACCUM)  # dw (k beta e^gamma)^T
            dt_s = T.alloc_shared((BT, BT), ACCUM)  # dT
            tdt = T.alloc_fragment((BT, BT), ACCUM)
            tdt_s = T.alloc_shared((BT, BT), ACCUM)  # T^T dT
            inv2_s = T.alloc_shared((BT, BT), ACCUM)  # T again, as the second gemm operand
            da = T.alloc_fragment((BT, BT), ACCUM)  # T^T dT T^T = -dA
            dkk_s = T.alloc_shared((BT, BT), ACCUM)  # dA * decay * beta_t: d(k_t.k_j)
            dkkt_s = T.alloc_shared((BT, BT), ACCUM)
            cross_s = T.alloc_shared((BT, BT), ACCUM)  # terms whose row sums minus column sums go to dgamma
            dakk_s = T.alloc_shared((BT, BT), ACCUM)  # dA * decay * kk: row sums go to dbeta
            # per row
            dbeta_v_s = T.alloc_shared((BT,), ACCUM)
            q_dq_s = T.alloc_shared((BT,), ACCUM)
            k_dk_s = T.alloc_shared((BT,), ACCUM)
            k_dkw_s = T.alloc_shared((BT,), ACCUM)
            dgamma_s = T.alloc_shared((BT,), ACCUM)

            h = hv // groups
            start = chunk_start(Cu, Chunks, i_t, seq_len, n_chunks, varlen)
            eos = chunk_end(Cu, Chunks, i_t, seq_len, n_chunks, varlen)
            last = Gamma[T.min(start + BT, eos) - 1, hv]
            for i in T.Parallel(BT):
                gamma_s[i] = T.if_then_else(start + i < eos, Gamma[start + i, hv], 0.0)
                beta_s[i] = T.if_then_else(start + i < eos, T.cast(Beta[start + i, hv], ACCUM), 0.0)
            for i, j in T.Parallel(BT, K):
                w_s[i, j] = T.if_then_else(start + i < eos, W[start + i, hv, j], 0.0)
            for i, j in T.Parallel(BT, BT):
                inv_s[i, j] = T.if_then_else(start + i < eos, Inverse[start + i, hv, j], 0.0)
                inv2_s[i, j] = T.if_then_else(start + i < eos, Inverse[start + i, hv, j], 0.0)
            load_qk_rows(Q, h, start, eos, q_f, sq, rsum, l2norm)
            if l2norm:
                for i in T.Parallel(BT):
                    q_rstd_s[i] = T.rsqrt(rsum[i] + L2NORM_EPS)
            T.copy(q_f, q_s)
            load_qk_rows(Kx, h, start, eos, k_f, sq, rsum, l2norm)
            if l2norm:
                for i in T.Parallel(BT):
                    k_rstd_s[i] = T.rsqrt(rsum[i] + L2NORM_EPS)
            T.copy(k_f, k_s)
            T.clear(dq)
            T.clear(dk)
            T.clear(dw_neg)
            T.clear(do_u)
            T.clear(du_v)
            T.clear(dbeta_v)
            T.clear(s_ds)
            T.sync_threads()

            # over V blocks: the terms that need S, dS', dO, dU, u, v
            for i_v in T.serial(V // BV):
                v0 = i_v * BV
                for i, j in T.Parallel(K, BV):
                    s_s[i, j] = States[i_t, hv, i, v0 + j]
                    ds_s[i, j] = DStates[i_t, hv, i, v0 + j]
                for i, j in T.Parallel(BT, BV):
                    do_s[i, j] = T.if_then_else(start + i < eos, T.cast(DO[start + i, hv, v0 + j], ACCUM), 0.0)
                    du_s[i, j] = T.if_then_else(start + i < eos, DU[start + i, hv, v0 + j], 0.0)
                    v_s[i, j] = T.if_then_else(start + i < eos, T.cast(Vx[start + i, hv, v0 + j], ACCUM), 0.0)
                T.sync_threads()
                T.gemm(w_s, s_s, corr, clear_accum=True)
                for i, j in T.Parallel(BT, BV):  # U = u - w S
                    corr_s[i, j] = T.if_then_else(start + i < eos, U[start + i, hv, v0 + j], 0.0) - corr[i, j]
                for i, j in T.Parallel(K, BV):
                    s_ds[i, j] += s_s[i, j] * ds_s[i, j]
                T.gemm(do_s, s_s, dq, transpose_B=True)
                T.gemm(du_s, s_s, dw_neg, transpose_B=True)
                T.gemm(du_s, v_s, du_v, transpose_B=True)
                # u = T diag(beta) V: dv = beta T^T dU
                T.gemm(inv_s, du_s, dv_beta, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    if start + i < eos:
                        DV[start + i, hv, v0 + j] = T.cast(dv_beta[i, j] * beta_s[i], dtype)
                for i, j in T.Parallel(BT, BV):
                    dbeta_v[i, j] += dv_beta[i, j] * v_s[i, j]
                T.sync_threads()
                T.gemm(corr_s, ds_s, dk, transpose_B=True)
                T.gemm(do_s, corr_s, do_u, transpose_B=True)
                T.sync_threads()  # the next V block overwrites the shared tiles

            # per row: dbeta's v part; e^gamma_last <S, dS'> (summed over K below)
            T.reduce_sum(dbeta_v, row_v, dim=1)
            T.copy(row_v, dbeta_v_s)
            T.reduce_sum(s_ds, row_s, dim=1)
            T.copy(row_s, s_ds_s)
            # O: dq = scale e^gamma dO S^T + dP K, dk = dP^T Q + ..., dP = scale (dO U^T * decay) (causal)
            for i, j in T.Parallel(BT, BT):
                dp_s[i, j] = T.if_then_else(
                    (i >= j) and (start + i < eos), do_u[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * scale, 0.0
                )
                dpt_s[j, i] = T.if_then_else(
                    (i >= j) and (start + i < eos), do_u[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * scale, 0.0
                )
            # S': dk = U dS'^T e^(gamma_last - gamma) + ...; dw = -dU S^T
            for i, j in T.Parallel(BT, K):
                dq[i, j] = dq[i, j] * (T.exp(gamma_s[i]) * scale)
                dk[i, j] = dk[i, j] * T.if_then_else(start + i < eos, T.exp(last - gamma_s[i]), 0.0)
                dw_s[i, j] = -dw_neg[i, j]
                kw_s[i, j] = k_s[i, j] * (beta_s[i] * T.exp(gamma_s[i]))
            # dgamma's terms of the inter-chunk parts (before the intra-chunk gemms join dq and dk)
            for i, j in T.Parallel(BT, K):
                prod[i, j] = q_s[i, j] * dq[i, j]
            T.reduce_sum(prod, row_k, dim=1)
            T.copy(row_k, q_dq_s)
            for i, j in T.Parallel(BT, K):
                prod[i, j] = k_s[i, j] * dk[i, j]
            T.reduce_sum(prod, row_k, dim=1)
            T.copy(row_k, k_dk_s)
            T.sync_threads()
            T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
            T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
            T.gemm(dp_s, k_s, dq)
            T.gemm(dpt_s, q_s, dk)
            # w = T diag(beta e^gamma) K: dk += beta e^gamma T^T dw, dT += dw (K beta e^gamma)^T
            T.gemm(inv_s, dw_s, dk_w, transpose_A=True, clear_accum=True)
            T.gemm(dw_s, kw_s, dt_w, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, K):
                prod[i, j] = dk_w[i, j] * k_s[i, j]
            T.reduce_sum(prod, row_k, dim=1)
            T.copy(row_k, k_dkw_s)
            for i, j in T.Parallel(BT, K):
                dk[i, j] += dk_w[i, j] * (beta_s[i] * T.exp(gamma_s[i]))
            for i, j in T.Parallel(BT, BT):
                dt_s[i, j] = du_v[i, j] * beta_s[j] + dt_w[i, j]
            T.sync_threads()
            # T = (I + A)^-1: dA = -T^T dT T^T on the strictly lower part
            T.gemm(inv_s, dt_s, tdt, transpose_A=True, clear_accum=True)
            T.copy(tdt, tdt_s)
            T.sync_threads()
            T.gemm(tdt_s, inv2_s, da, transpose_B=True, clear_accum=True)
            # A = beta_t e^(gamma_t - gamma_j) k_t.k_j (j < t)
            for i, j in T.Parallel(BT, BT):
                dkk_s[i, j] = T.if_then_else(
                    (i > j) and (start + i < eos), -da[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * beta_s[i], 0.0
                )
                dkkt_s[j, i] = T.if_then_else(
                    (i > j) and (start + i < eos), -da[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * beta_s[i], 0.0
                )
                dakk_s[i, j] = T.if_then_else(
                    (i > j) and (start + i < eos), -da[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * kk[i, j], 0.0
                )
                cross_s[i, j] = dp_s[i, j] * qk[i, j] + T.if_then_else(
                    (i > j) and (start + i < eos),
                    -da[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * kk[i, j] * beta_s[i],
                    0.0,
                )
            T.sync_threads()
            T.gemm(dkk_s, k_s, dk)
            T.gemm(dkkt_s, k_s, dk)

            # dbeta and dgamma per row (a thread per row), then dg = the reverse cumulative sum of dgamma
            for i in T.Parallel(BT):
                kdk = T.alloc_var(ACCUM)
                kdk = T.exp(gamma_s[i]) * k_dkw_s[i]
                dbeta = T.alloc_var(ACCUM)
                dbeta = dbeta_v_s[i] + kdk
                dgamma = T.alloc_var(ACCUM)
                dgamma = q_dq_s[i] - k_dk_s[i] + beta_s[i] * kdk
                for j in T.serial(BT):
                    dbeta += dakk_s[i, j]
                    dgamma += cross_s[i, j] - cross_s[j, i]
                dgamma_s[i] = T.if_then_else(start + i < eos, dgamma, 0.0)
                if start + i < eos:
                    DBeta[start + i, hv] = dbeta
            T.sync_threads()
            for i in T.Parallel(BT):
                # dgamma_last = e^gamma_last <S, dS'> + sum_t e^(gamma_last - gamma_t) k_t . (U dS'^T)_t
                # reaches every g of the chunk (gamma_last sums them all)
                total = T.alloc_var(ACCUM)
                total = 0.0
                for j in T.serial(K):
                    total += s_ds_s[j]
                total = total * T.exp(last)
                for j in T.serial(BT):
                    total += k_dk_s[j] + T.if_then_else(j >= i, dgamma_s[j], 0.0)
                if start + i < eos:  # 0 at a full decay, which gamma does not sum (reference.local_gamma)
                    DG[start + i, hv] = T.if_then_else(T.cast(G[start + i, hv], ACCUM) <= -FULL_DECAY, 0.0, total)
            # l2norm: x_n = x rstd, dx = (dx_n - x_n (dx_n . x_n)) rstd
            if l2norm:
                for i, j in T.Parallel(BT, K):
                    prod[i, j] = dq[i, j] * q_s[i, j]
                T.reduce_sum(prod, row_k, dim=1)
                for i, j in T.Parallel(BT, K):
                    dq[i, j] = (dq[i, j] - q_s[i, j] * row_k[i]) * q_rstd_s[i]
                for i, j in T.Parallel(BT, K):
                    prod[i, j] = dk[i, j] * k_s[i, j]
                T.reduce_sum(prod, row_k, dim=1)
                for i, j in T.Parallel(BT, K):
                    dk[i, j] = (dk[i, j] - k_s[i, j] * row_k[i]) * k_rstd_s[i]
            for i, j in T.Parallel(BT, K):
                if start + i < eos:
                    DQ[start + i, hv, j] = dq[i, j]
                    DK[start + i, hv, j] = dk[i, j]

    return gdr_chunk_grad


# --------------------------------------------------------------------------- entries and launcher


def state_grad_entry(K: int, V: int, dtype, has_initial: bool, final_grad: bool, l2norm: bool, varlen: bool) -> Entry:
    BV = _state_block(K, V)
    flags = (has_initial, final_grad, l2norm, varlen)
    key = ("gdr_chunk_state_grad", K, V, BV, dtype, flags)
    return key, lambda _: state_grad_kernel(K, V, BV, TL_DTYPE[dtype], *flags)


def chunk_grad_entry(K: int, V: int, dtype, g_dtype, beta_dtype, l2norm: bool, varlen: bool) -> Entry:
    BV = _grad_block(K, V)
    key = ("gdr_chunk_grad", K, V, BV, dtype, g_dtype, beta_dtype, l2norm, varlen)
    return key, lambda _: chunk_grad_kernel(
        K, V, BV, TL_DTYPE[dtype], TL_DTYPE[g_dtype], TL_DTYPE[beta_dtype], l2norm, varlen
    )


def backward_entries(
    K: int, V: int, dtype, g_dtype, beta_dtype, has_initial: bool, final_grad: bool, l2norm: bool, varlen: bool
) -> list[Entry]:
    """The kernels one backward runs beside the forward's prepare (for `precompile`)."""
    return [
        state_output_entry(K, V, dtype, has_initial, False, l2norm, varlen, write_output=False, store_states=True),
        state_grad_entry(K, V, dtype, has_initial, final_grad, l2norm, varlen),
        chunk_grad_entry(K, V, dtype, g_dtype, beta_dtype, l2norm, varlen),
    ]


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
        h0 = initial_state if has_initial else placeholder(device)
        states = buffers.empty((chunks.total, HV, K, V), dtype=torch.float32, device=device)
        entry = state_output_entry(
            K, V, q.dtype, has_initial, False, l2norm, varlen, write_output=False, store_states=True
        )
        launcher(entry, device)(
            q_rows, k_rows, gamma, w, u, placeholder(device, q.dtype), h0, placeholder(device), states,
            chunks.cu, chunks.first, float(scale), T_, n, HV // H,
        )  # fmt: skip
        dstates = buffers.empty((chunks.total, HV, K, V), dtype=torch.float32, device=device)
        du = buffers.empty((R, HV, V), dtype=torch.float32, device=device)
        launcher(state_grad_entry(K, V, q.dtype, has_initial, final_grad, l2norm, varlen), device)(
            q_rows, k_rows, gamma, w, do_rows, du, dstates,
            grad_final.to(torch.float32).contiguous() if final_grad else placeholder(device),
            dh0 if has_initial else placeholder(device), chunks.cu, chunks.first, float(scale), T_, n, HV // H,
        )  # fmt: skip
        launcher(chunk_grad_entry(K, V, q.dtype, g.dtype, beta.dtype, l2norm, varlen), device)(
            q_rows, k_rows, rows(v, HV, V), rows(g, HV), rows(beta, HV), gamma, w, u, inverse, states, dstates, do_rows, du,
            dq, dk, rows(dv, HV, V), dbeta, dg, chunks.cu, chunks.table,
            float(scale), T_, max(chunks.per_sequence, 1), HV // H,
        )  # fmt: skip
    elif has_initial:  # no step at all: the final state is the initial one
        dh0.copy_(grad_final) if final_grad else dh0.zero_()
    groups = HV // H  # GVA: a q/k head's gradient sums over its value heads
    dq = dq.view(B, T_, H, groups, K).sum(3).to(q.dtype)
    dk = dk.view(B, T_, H, groups, K).sum(3).to(k.dtype)
    dg = dg.view(B, T_, HV).to(g.dtype)
    dbeta = dbeta.view(B, T_, HV).to(beta.dtype)
    dh0 = None if dh0 is None else dh0.to(state_dtype)
    return dq, dk, dv, dg, dbeta, None, dh0, None, None, None
