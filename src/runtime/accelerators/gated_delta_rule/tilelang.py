"""Gated delta rule in TileLang: the fused recurrent kernel (forward) and the chunked kernels (forward and backward).

The module contract is triton.py's: `recurrent_forward` and `chunk_forward` take (q, k, v, g, beta,
scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens [host int64]) and return
(o, final state or an empty tensor) and, for the chunked form, also gamma, w, u and (I + A)^-1 (fp32,
rows of the packed [B*T] axis). `chunk_backward` (tilelang_backward.py, on the helpers of tilelang_shared.py) returns
triton.chunk_backward's gradients; the recurrent kernel is forward-only (requiring gradients through it
is a not-supported reason).

All state math is fp32. Tokens are rows of the packed [B*T] axis; sequence n is [bos, eos)
(fixed length: bos = n*T; varlen: cu_seqlens[n], cu_seqlens[n+1]). Value head hv reads q/k head
hv // (HV // H). Rows, heads, sequences and lengths are dynamic: a kernel is compiled per (dtypes,
K, V, flags).

Recurrent: one program per (V block, sequence x value head) keeps its [K, BV] state slice in a
fragment and walks the steps; q/k are normalised in fp32 as they are loaded when asked.

Chunked (chunks of BT = 64 steps; see reference.py for the math):
  1. prepare, one program per (chunk, value head), one warpgroup: gamma = cumsum(g) (full decays counted apart),
     k k^T on k as stored (bf16/fp16 operands, fp32 accumulation: exact products; the l2norm's rsqrt factors
     and beta e^(gamma_t - gamma_j) scale the result), A strictly lower. (I + A)^-1 by forward substitution in fp32,
     a thread per column holding it in registers (reference.unit_lower_inverse_by_columns): no barrier and no
     shared-memory round trip between rows. w = (I + A)^-1 diag(beta e^gamma rstd) K and u = (I + A)^-1 diag(beta) V
     on bf16 operands (the inverse and the scaled rows rounded to bf16, as the Triton kernel's HALF_WY products), each
     stored before the next product so that their accumulators are not live together.
  2. the storing walk (tilelang_shared.state_store_kernel), one program per (V block of 64, sequence x value head):
     walks the chunks (T.Pipelined, warp-specialised by TileLang: k, w and u by TMA and gamma by cp.async a chunk
     ahead) with the [K, BV] state in an fp32 fragment across the walk; per chunk it stores the state entering it
     (bf16, States[global chunk]) and U = u - w S (bf16), then S <- e^gamma_last S + K^T (U e^(gamma_last - gamma)
     rstd_k), every product on bf16 operands (w rounded in shared memory) accumulated in fp32, the update
     straight into the state's fragment. No load from global memory on the walk's sequential path. The backward runs
     it again (tilelang_shared.store_states). fp16 inputs take fp16_state_store_kernel's walk instead.
  3. output, one program per (chunk, value head), all chunks in parallel: O = scale (diag(e^gamma rstd_q) Q S + P U)
     with P = (Q K^T rstd_q rstd_k e^(gamma_t - gamma_j))_{j<=t}, from the stored S and U (q, k, S and U by TMA on
     one barrier), the whole value width per program (Q K^T once per chunk), Q S on q as stored with its rows scaled
     in fp32. (The walk computing O itself, five products per chunk on its sequential path instead of two, was
     slower on the GPU: docs/tuning/gated_delta_rule.md.)
The chunked forward's kernels bind their scalars (sequence, heads, chunk bounds) once with T.alloc_var: as
expressions of the block index TileLang inlines them at every access, each division by a dynamic size a call of a
64-bit division routine.
gamma, w, u and (I + A)^-1 stay fp32 in memory (the backward's contract). The products' 16-bit operands make fp32
inputs a not-supported reason of the chunked kernels; fp32 inputs get the recurrent kernel's exact fp32 math or
the other backends.
"""

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher, placeholder, precompile
from .reference import FULL_DECAY
from .split import check_segment_chunks
from .tilelang_backward import backward_entries, chunk_backward  # noqa: F401  (chunk_backward: this backend's entry)
from .tilelang_shared import (
    BT,
    L2NORM_EPS,
    OPERAND,
    OPERAND_TORCH,
    Chunks,
    _contiguous,
    _device_cu,
    _sequences,
    _state_block,
    chunk_end,
    chunk_start,
    load_chunk_decay,
    load_rstd,
    load_state,
    row_rstd,
    state_program,
    store_state,
    store_states,
    storing_walk_entry,
)
from .tilelang_split import split_entries, split_segments, split_walk


def _threads(elements: int) -> int:
    """Threads for a [K, BV] state of `elements` fp32 values: about 8 per thread, 32 to 128."""
    return max(32, min(128, elements // 8))


# --------------------------------------------------------------------------- recurrent


def recurrent_kernel(K: int, V: int, BV: int, dtype: str, g_dtype: str, beta_dtype: str,
                     has_initial: bool, store_final: bool, l2norm: bool, varlen: bool):  # fmt: skip
    R, H, HV, NS, NC = T.dynamic("rows, heads, v_heads, n_states, n_cu")
    threads = _threads(K * BV)
    state_shape = (NS, HV, K, V)

    @T.prim_func
    def gdr_recurrent_fwd(
        Q: T.Tensor((R, H, K), dtype),
        Kx: T.Tensor((R, H, K), dtype),
        Vx: T.Tensor((R, HV, V), dtype),
        G: T.Tensor((R, HV), g_dtype),
        Beta: T.Tensor((R, HV), beta_dtype),
        O: T.Tensor((R, HV, V), dtype),
        H0: T.Tensor(state_shape if has_initial else (1,), ACCUM),
        HT: T.Tensor(state_shape if store_final else (1,), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        scale: T.float32,
        seq_len: T.int32,
        n_seq: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_seq * HV, V // BV, threads=threads) as (bnh, bv):  # sequences x heads on x (y caps at 65535)
            state = T.alloc_fragment((K, BV), ACCUM)
            prod = T.alloc_fragment((K, BV), ACCUM)
            col = T.alloc_fragment((BV,), ACCUM)
            q_s = T.alloc_shared((K,), ACCUM)
            k_s = T.alloc_shared((K,), ACCUM)
            v_s = T.alloc_shared((BV,), ACCUM)
            corr_s = T.alloc_shared((BV,), ACCUM)
            norms = T.alloc_fragment((2, K), ACCUM)
            rstd = T.alloc_fragment((2,), ACCUM)
            rstd_s = T.alloc_shared((2,), ACCUM)

            n, hv, h, v0, bos, eos = state_program(bnh, bv, HV, groups, BV, Cu, seq_len, varlen)
            load_state(state, H0, n, hv, v0, has_initial)
            for t in T.serial(eos - bos):
                row = bos + t
                for i in T.Parallel(K):
                    q_s[i] = T.cast(Q[row, h, i], ACCUM)
                    k_s[i] = T.cast(Kx[row, h, i], ACCUM)
                for j in T.Parallel(BV):
                    v_s[j] = T.cast(Vx[row, hv, v0 + j], ACCUM)
                if l2norm:
                    T.sync_threads()
                    for r, i in T.Parallel(2, K):
                        norms[r, i] = T.if_then_else(r == 0, q_s[i] * q_s[i], k_s[i] * k_s[i])
                    T.reduce_sum(norms, rstd, dim=1)
                    for r in T.Parallel(2):
                        rstd_s[r] = T.rsqrt(rstd[r] + L2NORM_EPS)
                    T.sync_threads()
                    for i in T.Parallel(K):
                        q_s[i] = q_s[i] * rstd_s[0]
                        k_s[i] = k_s[i] * rstd_s[1]
                T.sync_threads()
                decay = T.exp(T.cast(G[row, hv], ACCUM))
                b = T.cast(Beta[row, hv], ACCUM)
                for i, j in T.Parallel(K, BV):
                    state[i, j] = state[i, j] * decay
                    prod[i, j] = state[i, j] * k_s[i]
                T.reduce_sum(prod, col, dim=0)
                for j in T.Parallel(BV):
                    corr_s[j] = b * (v_s[j] - col[j])
                T.sync_threads()
                for i, j in T.Parallel(K, BV):
                    state[i, j] = state[i, j] + k_s[i] * corr_s[j]
                    prod[i, j] = state[i, j] * q_s[i]
                T.reduce_sum(prod, col, dim=0)
                for j in T.Parallel(BV):
                    O[row, hv, v0 + j] = T.cast(col[j] * scale, dtype)
                T.sync_threads()  # q_s/k_s/v_s are overwritten by the next step
            if store_final:
                store_state(HT, state, n, hv, v0)

    return gdr_recurrent_fwd


def recurrent_entry(
    K: int, V: int, dtype, g_dtype, beta_dtype, has_initial: bool, store_final: bool, l2norm: bool, varlen: bool
) -> Entry:
    BV = _state_block(K, V)
    flags = (has_initial, store_final, l2norm, varlen)
    key = ("gdr_recurrent_fwd", K, V, BV, dtype, g_dtype, beta_dtype, flags)
    return key, lambda _: recurrent_kernel(K, V, BV, TL_DTYPE[dtype], TL_DTYPE[g_dtype], TL_DTYPE[beta_dtype], *flags)


# --------------------------------------------------------------------------- chunked


def prepare_kernel(K: int, V: int, dtype: str, g_dtype: str, beta_dtype: str, l2norm: bool, varlen: bool):
    R, H, HV, NC, NT = T.dynamic("rows, heads, v_heads, n_cu, n_chunk_rows")
    threads = 128

    @T.prim_func
    def gdr_chunk_prepare(
        Kx: T.Tensor((R, H, K), dtype),
        Vx: T.Tensor((R, HV, V), dtype),
        G: T.Tensor((R, HV), g_dtype),
        Beta: T.Tensor((R, HV), beta_dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        W: T.Tensor((R, HV, K), ACCUM),
        U: T.Tensor((R, HV, V), ACCUM),
        Inverse: T.Tensor((R, HV, BT), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        Chunks: T.Tensor((NT, 2) if varlen else (1,), "int32"),
        seq_len: T.int32,
        n_chunks: T.int32,
        n_total: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_total, HV, threads=threads) as (i_t, hv):
            k_s = T.alloc_shared((BT, K), dtype)  # k as stored: k k^T on it is exact up to fp32 accumulation
            v_s = T.alloc_shared((BT, V), dtype)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            rstd_s = T.alloc_shared((BT,), ACCUM)
            g_s = T.alloc_shared((BT,), ACCUM)
            fulls_s = T.alloc_shared((BT,), ACCUM)  # 1 at a full decay, then their count
            beta_s = T.alloc_shared((BT,), ACCUM)
            kk = T.alloc_fragment((BT, BT), ACCUM)
            a_s = T.alloc_shared((BT, BT), ACCUM)  # A (strictly lower), then (I + A)^-1
            column = T.alloc_local((BT,), ACCUM)  # one column of (I + A)^-1 per thread
            partial = T.alloc_local((4,), ACCUM)  # four independent sums: a shorter dependent chain per row
            inv_h = T.alloc_shared((BT, BT), OPERAND)
            kb_h = T.alloc_shared((BT, K), OPERAND)
            vb_h = T.alloc_shared((BT, V), OPERAND)
            w_f = T.alloc_fragment((BT, K), ACCUM)
            u_f = T.alloc_fragment((BT, V), ACCUM)

            tx = T.get_thread_binding()
            h = T.alloc_var("int32", init=hv // groups)  # bound once (see the module's docstring)
            start = T.alloc_var("int32", init=chunk_start(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            eos = T.alloc_var("int32", init=chunk_end(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            # rows past eos: another sequence's or zeros, masked below; v is loaded now so that its latency overlaps k's
            T.copy(Kx[start : start + BT, h, 0:K], k_s)
            T.copy(Vx[start : start + BT, hv, 0:V], v_s)
            for i in T.Parallel(BT):
                # a full decay (reference.local_gamma) is not summed in gamma but counted (G read only inside)
                g_s[i] = T.if_then_else(start + i < eos, T.cast(G[start + i, hv], ACCUM), 0.0)
                fulls_s[i] = T.if_then_else(g_s[i] <= -FULL_DECAY, 1.0, 0.0)
                g_s[i] = T.if_then_else(g_s[i] <= -FULL_DECAY, 0.0, g_s[i])
                beta_s[i] = T.if_then_else(start + i < eos, T.cast(Beta[start + i, hv], ACCUM), 0.0)
            T.sync_threads()
            T.cumsum(g_s, dim=0)
            T.cumsum(fulls_s, dim=0)
            T.sync_threads()
            for i in T.Parallel(BT):
                g_s[i] = g_s[i] - FULL_DECAY * fulls_s[i]  # gamma, the sum rounded once
            if l2norm:
                row_rstd(k_s, sq, rsum, rstd_s)
            else:
                for i in T.Parallel(BT):
                    rstd_s[i] = 1.0
            T.sync_threads()
            for i in T.Parallel(BT):
                if start + i < eos:
                    Gamma[start + i, hv] = g_s[i]
            # A = beta_t rstd_t rstd_j e^(gamma_t - gamma_j) k_t.k_j (j < t), the l2norm applied after the product
            T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                a_s[i, j] = T.if_then_else(
                    (i > j) and (start + i < eos),
                    beta_s[i] * rstd_s[i] * rstd_s[j] * T.exp(g_s[i] - g_s[j]) * kk[i, j],
                    0.0,
                )
            # the 16-bit operands of w = (I + A)^-1 diag(beta e^gamma rstd) K and u = (I + A)^-1 diag(beta) V
            for i, j in T.Parallel(BT, K):
                kb_h[i, j] = T.cast(
                    T.if_then_else(
                        start + i < eos, T.cast(k_s[i, j], ACCUM) * (beta_s[i] * rstd_s[i] * T.exp(g_s[i])), 0.0
                    ),
                    OPERAND,
                )
            for i, j in T.Parallel(BT, V):
                vb_h[i, j] = T.cast(T.if_then_else(start + i < eos, T.cast(v_s[i, j], ACCUM) * beta_s[i], 0.0), OPERAND)
            T.sync_threads()
            # (I + A)^-1 by forward substitution in fp32, a thread per column: X[i, j] = [i = j] - sum_{m<i} A[i, m]
            # X[m, j] needs only the thread's own column (in registers) and rows of A (the same for every thread)
            if tx < BT:
                T.clear(column)
                for i in T.unroll(BT):
                    T.clear(partial)
                    for m in T.unroll(i):
                        partial[m % 4] = partial[m % 4] - a_s[i, m] * column[m]
                    column[i] = T.if_then_else(i == tx, 1.0, 0.0) + (
                        (partial[0] + partial[1]) + (partial[2] + partial[3])
                    )
            T.sync_threads()
            if tx < BT:  # A is no longer read: its buffer takes the inverse in fp32, stored below by whole rows
                for i in T.unroll(BT):
                    a_s[i, tx] = column[i]
                    inv_h[i, tx] = T.cast(column[i], OPERAND)
            T.sync_threads()
            for i, j in T.Parallel(BT, BT):
                if start + i < eos:
                    Inverse[start + i, hv, j] = a_s[i, j]
            T.gemm(inv_h, kb_h, w_f, clear_accum=True)
            for i, j in T.Parallel(BT, K):
                if start + i < eos:
                    W[start + i, hv, j] = w_f[i, j]
            T.gemm(inv_h, vb_h, u_f, clear_accum=True)
            for i, j in T.Parallel(BT, V):
                if start + i < eos:
                    U[start + i, hv, j] = u_f[i, j]

    return gdr_chunk_prepare


def prepare_entry(K: int, V: int, dtype, g_dtype, beta_dtype, l2norm: bool, varlen: bool) -> Entry:
    key = ("gdr_chunk_prepare", K, V, dtype, g_dtype, beta_dtype, l2norm, varlen)
    return key, lambda _: prepare_kernel(K, V, TL_DTYPE[dtype], TL_DTYPE[g_dtype], TL_DTYPE[beta_dtype], l2norm, varlen)


def output_kernel(K: int, V: int, dtype: str, l2norm: bool, varlen: bool):
    """O of every chunk in parallel from the state entering it and its corrections U, both stored bf16 by the state
    walk: O = scale (diag(e^gamma rstd_q) Q S + P U), P = (Q K^T rstd_q rstd_k e^(gamma_t - gamma_j))_{j<=t}. One
    program per (chunk, value head) takes the whole value width: Q K^T once per chunk, a [64, V <= 128] fp32
    accumulator in one warpgroup (64 registers per thread at V = 128). Q S takes q as stored and its rows are scaled
    in fp32 after the product (one rounding fewer than scaling q's rows before the product)."""
    R, H, HV, NC, NT, NTC = T.dynamic("rows, heads, v_heads, n_cu, n_chunk_rows, n_chunks_total")

    @T.prim_func
    def gdr_chunk_output(
        Q: T.Tensor((R, H, K), dtype),
        Kx: T.Tensor((R, H, K), dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        States: T.Tensor((NTC, HV, K, V), OPERAND),
        Corrections: T.Tensor((R, HV, V), OPERAND),
        O: T.Tensor((R, HV, V), dtype),
        Cu: T.Tensor((NC,), "int32"),
        Chunks: T.Tensor((NT, 2) if varlen else (1,), "int32"),
        scale: T.float32,
        seq_len: T.int32,
        n_chunks: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(NTC, HV, threads=128) as (i_t, hv):
            q_s = T.alloc_shared((BT, K), dtype)  # q and k as stored, rows past eos masked in P and in O
            k_s = T.alloc_shared((BT, K), dtype)
            q_h = q_s if dtype == OPERAND else T.alloc_shared((BT, K), OPERAND)  # fp16 q and k rounded to bf16
            k_h = k_s if dtype == OPERAND else T.alloc_shared((BT, K), OPERAND)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            q_rstd_s = T.alloc_shared((BT,), ACCUM)
            k_rstd_s = T.alloc_shared((BT,), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)
            state_h = T.alloc_shared((K, V), OPERAND)
            corr_h = T.alloc_shared((BT, V), OPERAND)  # rows past eos: another sequence's, P is zero there
            attn = T.alloc_fragment((BT, BT), ACCUM)
            attn_h = T.alloc_shared((BT, BT), OPERAND)
            out = T.alloc_fragment((BT, V), ACCUM)
            loaded = T.alloc_barrier(128)

            # bound once: as expressions TileLang would recompute their divisions, in int64, at every access
            h = T.alloc_var("int32", init=hv // groups)
            start = T.alloc_var("int32", init=chunk_start(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            eos = T.alloc_var("int32", init=chunk_end(Cu, Chunks, i_t, seq_len, n_chunks, varlen))
            # the four tiles by TMA on one barrier, waited on once (T.copy would load them one after the other)
            T.tma_copy(Q[start : start + BT, h, 0:K], q_s, barrier=loaded)
            T.tma_copy(Kx[start : start + BT, h, 0:K], k_s, barrier=loaded)
            T.tma_copy(States[i_t, hv, 0:K, 0:V], state_h, barrier=loaded)
            T.tma_copy(Corrections[start : start + BT, hv, 0:V], corr_h, barrier=loaded)
            T.mbarrier_arrive(loaded)
            load_chunk_decay(Gamma, gamma_s, hv, start, eos)
            T.mbarrier_wait_parity(loaded, 0)
            load_rstd(q_s, sq, rsum, q_rstd_s, l2norm)
            load_rstd(k_s, sq, rsum, k_rstd_s, l2norm)
            if dtype != OPERAND:
                T.copy(q_s, q_h)
                T.copy(k_s, k_h)
            T.gemm(q_h, k_h, attn, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                attn_h[i, j] = T.cast(
                    T.if_then_else(
                        (i >= j) and (start + i < eos),
                        attn[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * (q_rstd_s[i] * k_rstd_s[j]),
                        0.0,
                    ),
                    OPERAND,
                )
            T.gemm(q_h, state_h, out, clear_accum=True)
            for i, j in T.Parallel(BT, V):
                out[i, j] = out[i, j] * (T.exp(gamma_s[i]) * q_rstd_s[i])
            T.gemm(attn_h, corr_h, out)
            for i, j in T.Parallel(BT, V):
                if start + i < eos:
                    O[start + i, hv, j] = T.cast(out[i, j] * scale, dtype)

    return gdr_chunk_output


def output_entry(K: int, V: int, dtype, l2norm: bool, varlen: bool) -> Entry:
    key = ("gdr_chunk_output", K, V, dtype, l2norm, varlen)
    return key, lambda _: output_kernel(K, V, TL_DTYPE[dtype], l2norm, varlen)


def _final_state(output_final_state: bool, n: int, HV: int, K: int, V: int, device) -> torch.Tensor:
    shape = (n, HV, K, V) if output_final_state else (0,)
    return buffers.empty(shape, dtype=torch.float32, device=device)


def recurrent_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    B, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    n = _sequences(v, cu_seqlens)
    device = q.device
    o = buffers.empty(v.shape, dtype=q.dtype, device=device)
    final = _final_state(output_final_state, n, HV, K, V, device)
    if n == 0 or q.numel() == 0:
        if output_final_state:
            final.copy_(initial_state) if initial_state is not None else final.zero_()
        return o, final
    entry = recurrent_entry(
        K, V, q.dtype, g.dtype, beta.dtype, initial_state is not None, bool(output_final_state),
        bool(use_qk_l2norm_in_kernel), cu_seqlens is not None,
    )  # fmt: skip
    launcher(entry, device)(
        q.view(B * T_, H, K), k.view(B * T_, H, K), v.view(B * T_, HV, V), g.view(B * T_, HV), beta.view(B * T_, HV),
        o.view(B * T_, HV, V), placeholder(device) if initial_state is None else initial_state,
        final if output_final_state else placeholder(device), _device_cu(cu_seqlens, device),
        float(scale), T_, n, HV // H,
    )  # fmt: skip
    return o, final


def recurrent_backward(*_):
    # unreachable: requiring gradients is a not-supported reason of the recurrent kernels
    raise RuntimeError("gated_delta_rule: the recurrent TileLang kernels are forward-only")


def chunk_forward(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, *,
    segment_chunks: int | None = None,
):  # fmt: skip
    """(o, final state, and the per-chunk factors gamma, w, u, (I + A)^-1, all fp32, as triton.chunk_forward).

    Three stages: prepare the chunks' factors, walk the sequences storing the state entering each chunk and the
    corrections (bf16), then every chunk's output in parallel from them. segment_chunks: the context-parallel split
    of bf16 inputs' storing walk (tilelang_split.py), chunks per segment; None: the occupancy rule decides, 0: never
    split. fp16 inputs walk whole sequences."""
    check_segment_chunks(segment_chunks, "chunk_forward: segment_chunks")
    if segment_chunks and q.dtype != OPERAND_TORCH:
        raise ValueError(
            f"chunk_forward: segment_chunks={segment_chunks} splits the storing walk of bf16 inputs only; got "
            f"{q.dtype} inputs"
        )
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    B, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    R, n, device = B * T_, _sequences(v, cu_seqlens), q.device
    factors = _chunk_factors(R, HV, K, V, device)
    o = buffers.empty(v.shape, dtype=q.dtype, device=device)
    final = _final_state(output_final_state, n, HV, K, V, device)
    if n == 0 or q.numel() == 0:
        if output_final_state:
            final.copy_(initial_state) if initial_state is not None else final.zero_()
        return o, final, *factors
    chunks = Chunks.of(B, T_, cu_seqlens, device)
    l2norm, varlen = bool(use_qk_l2norm_in_kernel), cu_seqlens is not None
    rows = lambda x, *tail: x.view(R, *tail)  # noqa: E731
    q_rows, k_rows, o_rows = rows(q, H, K), rows(k, H, K), rows(o, HV, V)
    flags = (initial_state is not None, bool(output_final_state), l2norm, varlen)
    h0 = placeholder(device) if initial_state is None else initial_state
    ht = final if output_final_state else placeholder(device)
    if chunks.total == 0:  # the walk only passes the initial state through to the final one
        _walk(k_rows, *factors[:3], h0, ht, None, None, chunks, segment_chunks, B, T_, n, flags, cu_seqlens)
        return o, final, *factors
    _prepare(k_rows, rows(v, HV, V), rows(g, HV), rows(beta, HV), factors, chunks, T_, HV // H, l2norm, varlen)
    states = buffers.empty((chunks.total, HV, K, V), dtype=OPERAND_TORCH, device=device)
    corrections = buffers.empty((R, HV, V), dtype=OPERAND_TORCH, device=device)
    _walk(k_rows, *factors[:3], h0, ht, states, corrections, chunks, segment_chunks, B, T_, n, flags, cu_seqlens)
    _output(q_rows, k_rows, factors[0], states, corrections, o_rows, chunks, scale, T_, HV // H, l2norm, varlen)
    return o, final, *factors


def _chunk_factors(R: int, HV: int, K: int, V: int, device) -> tuple[torch.Tensor, ...]:
    """(gamma, w, u, (I + A)^-1) per row, fp32: the prepare stage's results, which the backward reads."""
    return tuple(
        buffers.empty(shape, dtype=torch.float32, device=device)
        for shape in ((R, HV), (R, HV, K), (R, HV, V), (R, HV, BT))
    )


def _prepare(k_rows, v_rows, g_rows, beta_rows, factors, chunks: Chunks, T_: int, groups: int, l2norm: bool,
             varlen: bool) -> None:  # fmt: skip
    """The chunks' factors: the cumulative decay gamma, the WY factors w and u, and (I + A)^-1."""
    K, V = k_rows.shape[-1], v_rows.shape[-1]
    prepare = launcher(prepare_entry(K, V, k_rows.dtype, g_rows.dtype, beta_rows.dtype, l2norm, varlen), k_rows.device)
    prepare(
        k_rows, v_rows, g_rows, beta_rows, *factors, chunks.cu, chunks.table, T_, max(chunks.per_sequence, 1),
        chunks.total, groups,
    )  # fmt: skip


def _walk(k_rows, gamma, w, u, h0, ht, states, corrections, chunks: Chunks, segment_chunks, B: int, T_: int, n: int,
          flags: tuple[bool, bool, bool, bool], cu_seqlens) -> None:  # fmt: skip
    """The storing walk: the state entering each chunk into `states` and the corrections into `corrections` (None
    where there are no chunks: only the final state), bf16 long sequences split by the occupancy rule."""
    device = k_rows.device
    HV, K, V = u.shape[1], k_rows.shape[-1], u.shape[-1]
    segments = None
    if states is not None and k_rows.dtype == OPERAND_TORCH:
        segments = split_segments(chunks, B, T_, n, HV, K, V, cu_seqlens, device, segment_chunks)
    if segments is not None:
        split_walk(k_rows, gamma, w, u, h0, ht, states, corrections, segments, has_initial=flags[0],
                   store_final=flags[1], l2norm=flags[2], seq_len=T_, groups=HV // k_rows.shape[1])  # fmt: skip
        return
    unused = placeholder(device, OPERAND_TORCH)
    store_states(k_rows, gamma, w, u, h0, ht, unused if states is None else states,
                 unused if corrections is None else corrections, chunks, T_, n, flags)  # fmt: skip


def _output(q_rows, k_rows, gamma, states, corrections, o_rows, chunks: Chunks, scale: float, T_: int, groups: int,
            l2norm: bool, varlen: bool) -> None:  # fmt: skip
    """Every chunk's output in parallel from the stored states and corrections."""
    K, V = k_rows.shape[-1], o_rows.shape[-1]
    launcher(output_entry(K, V, q_rows.dtype, l2norm, varlen), q_rows.device)(
        q_rows, k_rows, gamma, states, corrections, o_rows, chunks.cu, chunks.table, float(scale), T_,
        max(chunks.per_sequence, 1), groups,
    )  # fmt: skip


def entries(K: int, V: int, dtype, g_dtype, beta_dtype, has_initial: bool, store_final: bool, l2norm: bool,
            varlen: bool, backward: bool = False) -> list[Entry]:  # fmt: skip
    """The kernels one specialisation runs, recurrent and chunked, and with `backward` the chunked backward's
    (for `precompile`)."""
    flags = (has_initial, store_final, l2norm, varlen)
    forward = [
        recurrent_entry(K, V, dtype, g_dtype, beta_dtype, *flags),
        prepare_entry(K, V, dtype, g_dtype, beta_dtype, l2norm, varlen),
        storing_walk_entry(K, V, dtype, *flags),
        output_entry(K, V, dtype, l2norm, varlen),
    ]
    if dtype == OPERAND_TORCH:  # the context-parallel split's walks, where the occupancy rule cuts sequences
        forward += split_entries(K, V, has_initial, store_final, l2norm)
    if not backward:
        return forward
    return forward + backward_entries(K, V, dtype, g_dtype, beta_dtype, *flags)


def warm_up(specs, device: torch.device) -> None:
    """Compile the kernels of (K, V, dtype, g_dtype, beta_dtype, has_initial, store_final, l2norm, varlen[, backward])
    specs."""
    precompile([e for spec in specs for e in entries(*spec)], device)


CHUNK_KERNELS = KernelBackend(forward=chunk_forward, backward=chunk_backward)
RECURRENT_KERNELS = KernelBackend(forward=recurrent_forward, backward=recurrent_backward)
