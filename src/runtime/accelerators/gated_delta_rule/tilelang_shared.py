"""What the chunked gated delta rule's TileLang forward (tilelang.py) and backward (tilelang_backward.py) share: the
chunk tables (Chunks), the macros that address chunks and load states and rows, and the state-and-output kernel that
the backward runs again to recompute the states."""

from dataclasses import dataclass

import tilelang.language as T
import torch

from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher, placeholder
from .varlen import chunk_table, on_device

BT = 64  # the chunk size (reference.CHUNK_SIZE)
OPERAND = "bfloat16"  # the 16-bit operands of the forward's products (fp32 accumulation), as the Triton kernels'
OPERAND_TORCH = torch.bfloat16
L2NORM_EPS = 1e-6  # the l2norm op's default eps
CU_DTYPE = torch.int32


def _state_block(K: int, V: int) -> int:
    return min(V, 32 if K >= 64 else 64)


def _state_threads(K: int, BV: int) -> int:
    """Threads of the kernels walking a [K, BV] state: its gemm needs 16 rows x 8 columns per warp."""
    return 32 * min(4, (K // 16) * (BV // 8))


def chunk_start(Cu, Chunks, i_t, seq_len, n_chunks, varlen: bool):
    """First token of global chunk i_t (chunks are numbered sequence by sequence)."""
    if varlen:
        return Cu[Chunks[i_t, 0]] + Chunks[i_t, 1] * BT
    return (i_t // n_chunks) * seq_len + (i_t % n_chunks) * BT


def chunk_end(Cu, Chunks, i_t, seq_len, n_chunks, varlen: bool):
    """End (exclusive) of the sequence holding global chunk i_t."""
    if varlen:
        return Cu[Chunks[i_t, 0] + 1]
    return (i_t // n_chunks + 1) * seq_len


# The macros below take the kernels' TIR scalars under the scalars' own names (v_heads for HV, and n, hv,
# v0, start, eos as the kernels bind them): TileLang 0.1.15 renames a scalar passed to a macro after the
# macro's parameter, so another name would change the generated code. Buffers are passed as they are.


@T.macro
def state_program(bnh, bv, v_heads, groups, BV: int, Cu, seq_len, varlen: bool):
    """What a program of a state walk (grid: sequences x value heads on x, V blocks on y) works on: sequence
    n, value head hv and its q/k head h, the V block starting at v0, and the sequence's tokens [bos, eos)."""
    n = bnh // v_heads
    hv = bnh % v_heads
    h = hv // groups
    v0 = bv * BV
    bos = Cu[n] if varlen else n * seq_len
    eos = Cu[n + 1] if varlen else (n + 1) * seq_len
    return n, hv, h, v0, bos, eos


@T.macro
def load_state(state, Src, n, hv, v0, present: bool):
    """state = the [K, BV] slice of Src[n, hv] from column v0 when present, else zeros."""
    if present:
        for i, j in T.Parallel(state.shape[0], state.shape[1]):
            state[i, j] = Src[n, hv, i, v0 + j]
    else:
        T.clear(state)


@T.macro
def store_state(Dst, state, n, hv, v0):
    """The [K, BV] slice of Dst[n, hv] from column v0 = state."""
    for i, j in T.Parallel(state.shape[0], state.shape[1]):
        Dst[n, hv, i, v0 + j] = state[i, j]


@T.macro
def load_chunk_decay(Gamma, gamma_s, hv, start, eos):
    """gamma_s = the chunk's rows [start, start + BT) of Gamma[:, hv], zero from eos on; returns gamma at the chunk's
    last row."""
    last = Gamma[T.min(start + BT, eos) - 1, hv]
    for i in T.Parallel(BT):
        gamma_s[i] = T.if_then_else(start + i < eos, Gamma[start + i, hv], 0.0)
    return last


@T.macro
def row_rstd(x_s, sq, rsum, rstd_s):
    """rstd_s[i] = 1 / sqrt(sum_j x_s[i, j]^2 + eps) in fp32: the l2norm of rows kept as stored (x_s, 16-bit) and
    applied to the products that take them."""
    for i, j in T.Parallel(BT, x_s.shape[1]):
        sq[i, j] = T.cast(x_s[i, j], ACCUM) * T.cast(x_s[i, j], ACCUM)
    T.reduce_sum(sq, rsum, dim=1)
    for i in T.Parallel(BT):
        rstd_s[i] = T.rsqrt(rsum[i] + L2NORM_EPS)


@T.macro
def load_rstd(x_s, sq, rsum, rstd_s, l2norm: bool):
    """rstd_s = the rows' l2norm factors (row_rstd), or 1 without the l2norm."""
    if l2norm:
        row_rstd(x_s, sq, rsum, rstd_s)
    else:
        for i in T.Parallel(BT):
            rstd_s[i] = 1.0


@T.macro
def load_rows(X, x_h, hv, v0, start, eos):
    """x_h = rows [start, start + BT) of X[:, hv], columns from v0, as a 16-bit operand, zero from eos on."""
    for i, j in T.Parallel(BT, x_h.shape[1]):
        x_h[i, j] = T.cast(T.if_then_else(start + i < eos, T.cast(X[start + i, hv, v0 + j], ACCUM), 0.0), OPERAND)


def fp16_state_store_kernel(K: int, V: int, BV: int, dtype: str, has_initial: bool, store_final: bool, l2norm: bool,
                            varlen: bool, stages: int = 2):  # fmt: skip
    """The storing walk of fp16 inputs (storing_walk_entry says why they do not take state_store_kernel's): per chunk
    the state entering it, States[First[n] + c] (fixed length: n * chunks per sequence + c), and the corrections
    U = u - w S per row, both in bf16 as the products take them; the same arguments as state_store_kernel's walk.
    `stages`: the software pipeline's depth over the chunks' k loads."""
    R, H, HV, NS, NC, NTC, NF = T.dynamic("rows, heads, v_heads, n_states, n_cu, n_chunks_total, n_first")
    threads = _state_threads(K, BV)
    state_shape = (NS, HV, K, V)

    @T.prim_func
    def gdr_chunk_state_store_fp16(
        Kx: T.Tensor((R, H, K), dtype),
        Gamma: T.Tensor((R, HV), ACCUM),
        W: T.Tensor((R, HV, K), ACCUM),
        U: T.Tensor((R, HV, V), ACCUM),
        H0: T.Tensor(state_shape if has_initial else (1,), ACCUM),
        HT: T.Tensor(state_shape if store_final else (1,), ACCUM),
        States: T.Tensor((NTC, HV, K, V), OPERAND),
        Corrections: T.Tensor((R, HV, V), OPERAND),
        Cu: T.Tensor((NC,), "int32"),
        First: T.Tensor((NF,), "int32"),
        seq_len: T.int32,
        n_seq: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_seq * HV, V // BV, threads=threads) as (bnh, bv):  # sequences x heads on x (y caps at 65535)
            state = T.alloc_fragment((K, BV), ACCUM)  # fp32 across the whole walk
            state_h = T.alloc_shared((K, BV), OPERAND)  # the state entering the chunk, as the products take it
            k_s = T.alloc_shared((BT, K), OPERAND)  # k as stored (pipelined loads), rows past eos unused
            w_h = T.alloc_shared((BT, K), OPERAND)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            k_rstd_s = T.alloc_shared((BT,), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)
            corr = T.alloc_fragment((BT, BV), ACCUM)
            corr_kd_h = T.alloc_shared((BT, BV), OPERAND)  # U's rows times e^(gamma_last - gamma) rstd_k

            n, hv, h, v0, bos, eos = state_program(bnh, bv, HV, groups, BV, Cu, seq_len, varlen)
            first = First[n] if varlen else n * T.ceildiv(seq_len, BT)  # global index of the sequence's first chunk
            load_state(state, H0, n, hv, v0, has_initial)
            if not l2norm:
                for i in T.Parallel(BT):
                    k_rstd_s[i] = 1.0
            # no explicit barrier in the walk: under Hopper warp specialisation TileLang plans the producer's and the
            # consumer's barriers itself (a T.sync_threads here became a named barrier both groups share)
            for c in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=stages):
                start = bos + c * BT
                T.copy(Kx[start : start + BT, h, 0:K], k_s)
                for i, j in T.Parallel(K, BV):
                    States[first + c, hv, i, v0 + j] = T.cast(state[i, j], OPERAND)
                last = load_chunk_decay(Gamma, gamma_s, hv, start, eos)
                for i, j in T.Parallel(BT, K):
                    w_h[i, j] = T.cast(T.if_then_else(start + i < eos, W[start + i, hv, j], 0.0), OPERAND)
                T.copy(state, state_h)
                if l2norm:
                    row_rstd(k_s, sq, rsum, k_rstd_s)
                # U = u - w S; the state update takes its rows scaled (k is used as stored)
                T.gemm(w_h, state_h, corr, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    corr[i, j] = T.if_then_else(start + i < eos, U[start + i, hv, v0 + j] - corr[i, j], 0.0)
                    corr_kd_h[i, j] = T.cast(
                        corr[i, j] * T.if_then_else(start + i < eos, T.exp(last - gamma_s[i]) * k_rstd_s[i], 0.0),
                        OPERAND,
                    )
                for i, j in T.Parallel(BT, BV):
                    if start + i < eos:
                        Corrections[start + i, hv, v0 + j] = T.cast(corr[i, j], OPERAND)
                # S <- e^gamma_last S + K^T (U e^(gamma_last - gamma) rstd_k), accumulated into the fp32 state
                for i, j in T.Parallel(K, BV):
                    state[i, j] = state[i, j] * T.exp(last)
                T.gemm(k_s, corr_kd_h, state, transpose_A=True)
            if store_final:
                store_state(HT, state, n, hv, v0)

    return gdr_chunk_state_store_fp16


def fp16_state_store_entry(K: int, V: int, has_initial: bool, store_final: bool, l2norm: bool, varlen: bool) -> Entry:
    BV = _state_block(K, V)
    flags = (has_initial, store_final, l2norm, varlen)
    key = ("gdr_chunk_state_store_fp16", K, V, BV, flags)
    return key, lambda _: fp16_state_store_kernel(K, V, BV, TL_DTYPE[torch.float16], *flags)


def _store_block(K: int, V: int) -> int:
    """V block of the storing walk: 64 columns (at K = 128 its pipeline takes about 170 KB, one program an SM)."""
    return min(V, 64)


def state_store_kernel(K: int, V: int, BV: int, has_initial: bool, store_final: bool, l2norm: bool,
                       varlen: bool, stages: int = 2, store_states: bool = True,
                       transition: bool = False):  # fmt: skip
    """The walk that only stores, per chunk, the state entering it (States[global chunk]) and the corrections
    U = u - w S (both bf16), for bf16 inputs only (fp16 ones: fp16_state_store_kernel).

    For the context-parallel split (split.py) it also walks without storing them (store_states False: only the end
    state, in HT; from a zero state, the segments' offsets b) and, with `transition`, walks the linear part of the
    chunk maps instead: the state is [K, V = K] from the identity, u is taken as zero (U is not read), and the end
    state is the segment's map M.

    Every tile a chunk needs comes through the pipeline (k; w, u and gamma in fp32, by TMA where TileLang can), so
    the walk's sequential path holds no load from global memory: w is rounded to bf16 in shared memory, gamma_last
    is read from the chunk's gamma tile. The program's scalars (sequence, heads, bounds) are bound once
    (T.alloc_var): as expressions TileLang would recompute their divisions, in int64, at every access."""
    R, H, HV, NS, NC, NTC, NF = T.dynamic("rows, heads, v_heads, n_states, n_cu, n_chunks_total, n_first")
    threads = _state_threads(K, BV)
    state_shape = (NS, HV, K, V)

    @T.prim_func
    def gdr_chunk_state_store(
        Kx: T.Tensor((R, H, K), OPERAND),
        Gamma: T.Tensor((R, HV), ACCUM),
        W: T.Tensor((R, HV, K), ACCUM),
        U: T.Tensor((1,) if transition else (R, HV, V), ACCUM),
        H0: T.Tensor(state_shape if has_initial else (1,), ACCUM),
        HT: T.Tensor(state_shape if store_final else (1,), ACCUM),
        States: T.Tensor((NTC, HV, K, V) if store_states else (1,), OPERAND),
        Corrections: T.Tensor((R, HV, V) if store_states else (1,), OPERAND),
        Cu: T.Tensor((NC,), "int32"),
        First: T.Tensor((NF,), "int32"),
        seq_len: T.int32,
        n_seq: T.int32,
        groups: T.int32,
    ):
        with T.Kernel(n_seq * HV, V // BV, threads=threads) as (bnh, bv):  # sequences x heads on x (y caps at 65535)
            state = T.alloc_fragment((K, BV), ACCUM)  # fp32 across the whole walk
            state_h = T.alloc_shared((K, BV), OPERAND)  # the state entering the chunk, as the products take it
            k_s = T.alloc_shared((BT, K), OPERAND)  # pipelined: k (bf16), w and u as stored, rows past eos unused
            w_s = T.alloc_shared((BT, K), ACCUM)
            u_s = None if transition else T.alloc_shared((BT, BV), ACCUM)
            gamma_s = T.alloc_shared((BT,), ACCUM)  # pipelined: gamma, zero from eos on
            w_h = T.alloc_shared((BT, K), OPERAND)
            sq = T.alloc_fragment((BT, K), ACCUM)
            rsum = T.alloc_fragment((BT,), ACCUM)
            k_rstd_s = T.alloc_shared((BT,), ACCUM)
            corr = T.alloc_fragment((BT, BV), ACCUM)
            corr_kd_h = T.alloc_shared((BT, BV), OPERAND)  # U's rows times e^(gamma_last - gamma) rstd_k

            # the program's scalars as expressions (the gamma load needs them so: a copy whose index or mask reads a
            # T.alloc_var is not made asynchronous), and bound once for the rest
            n_, hv_, h_, v0, bos_, eos_ = state_program(bnh, bv, HV, groups, BV, Cu, seq_len, varlen)
            n = T.alloc_var("int32", init=n_)
            hv = T.alloc_var("int32", init=hv_)
            bos = T.alloc_var("int32", init=bos_)
            eos = T.alloc_var("int32", init=eos_)
            first = T.alloc_var("int32", init=First[n] if varlen else n * T.ceildiv(seq_len, BT))
            if transition:
                for i, j in T.Parallel(K, BV):
                    state[i, j] = T.if_then_else(i == v0 + j, 1.0, 0.0)
            else:
                load_state(state, H0, n, hv, v0, has_initial)
            if not l2norm:
                for i in T.Parallel(BT):
                    k_rstd_s[i] = 1.0
            for c in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=stages):
                start_ = bos_ + c * BT
                T.copy(Kx[start_ : start_ + BT, h_, 0:K], k_s)
                T.copy(W[start_ : start_ + BT, hv_, 0:K], w_s)
                if not transition:
                    T.copy(U[start_ : start_ + BT, hv_, v0 : v0 + BV], u_s)
                load_chunk_decay(Gamma, gamma_s, hv_, start_, eos_)
                start = bos + c * BT
                if store_states:
                    for i, j in T.Parallel(K, BV):
                        States[first + c, hv, i, v0 + j] = T.cast(state[i, j], OPERAND)
                T.copy(state, state_h)
                for i, j in T.Parallel(BT, K):
                    w_h[i, j] = T.cast(w_s[i, j], OPERAND)  # rows past eos: only their own rows of U, masked below
                if l2norm:
                    row_rstd(k_s, sq, rsum, k_rstd_s)
                last = gamma_s[T.min(eos - start, BT) - 1]
                # U = u - w S (u = 0 in the transition walk); the state update takes its rows scaled (k as stored)
                T.gemm(w_h, state_h, corr, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    corr[i, j] = T.if_then_else(start + i < eos, (0.0 if transition else u_s[i, j]) - corr[i, j], 0.0)
                    corr_kd_h[i, j] = T.cast(
                        corr[i, j] * T.if_then_else(start + i < eos, T.exp(last - gamma_s[i]) * k_rstd_s[i], 0.0),
                        OPERAND,
                    )
                if store_states:
                    for i, j in T.Parallel(BT, BV):
                        if start + i < eos:
                            Corrections[start + i, hv, v0 + j] = T.cast(corr[i, j], OPERAND)
                # S <- e^gamma_last S + K^T (U e^(gamma_last - gamma) rstd_k), accumulated into the fp32 state
                for i, j in T.Parallel(K, BV):
                    state[i, j] = state[i, j] * T.exp(last)
                T.gemm(k_s, corr_kd_h, state, transpose_A=True)
            if store_final:
                store_state(HT, state, n, hv, v0)

    return gdr_chunk_state_store


def state_store_entry(K: int, V: int, has_initial: bool, store_final: bool, l2norm: bool, varlen: bool,
                      stages: int = 2, *, store_states: bool = True, transition: bool = False) -> Entry:  # fmt: skip
    """The storing walk for bf16 inputs (fp16 ones take fp16_state_store_entry's: see storing_walk_entry);
    store_states False: only the end state; transition: the walk of the chunk maps' linear part (V = K, from the
    identity, only the end map)."""
    if transition and (V != K or has_initial or store_states or not store_final):
        raise ValueError(
            "state_store_entry: the transition walk takes V = K, no initial state, stores only the end map "
            f"(store_final, not store_states); got K={K}, V={V}, has_initial={has_initial}, "
            f"store_final={store_final}, store_states={store_states}"
        )
    BV = _store_block(K, V)
    flags = (has_initial, store_final, l2norm, varlen)
    key = ("gdr_chunk_state_store", K, V, BV, flags, stages, store_states, transition)
    return key, lambda _: state_store_kernel(
        K, V, BV, *flags, stages=stages, store_states=store_states, transition=transition
    )


def storing_walk_entry(
    K: int, V: int, dtype, has_initial: bool, store_final: bool, l2norm: bool, varlen: bool
) -> Entry:
    """The walk storing the state entering each chunk and U, forward and backward: state_store_kernel for bf16
    inputs; for fp16 fp16_state_store_kernel, because TileLang 0.1.15's pipelined walk that rounds fp16 k
    to bf16 in shared memory stores wrong states from the third chunk on (measured on the H200: state error 1e3
    relative at T = 1000). For bf16 the two store the same bits."""
    flags = (has_initial, store_final, l2norm, varlen)
    if dtype == OPERAND_TORCH:
        return state_store_entry(K, V, *flags)
    return fp16_state_store_entry(K, V, *flags)


def store_states(k_rows, gamma, w, u, h0, ht, states, corrections, chunks: "Chunks", T_: int, n: int,
                 flags: tuple[bool, bool, bool, bool]) -> None:  # fmt: skip
    """Launches storing_walk_entry's walk (flags: has_initial, store_final, l2norm, varlen)."""
    K, V, device = k_rows.shape[-1], u.shape[-1], k_rows.device
    walk = launcher(storing_walk_entry(K, V, k_rows.dtype, *flags), device)
    walk(
        k_rows, gamma, w, u, h0, ht, states, corrections, chunks.cu, chunks.first, T_, n, u.shape[1] // k_rows.shape[1]
    )


# --------------------------------------------------------------------------- launchers


def _contiguous(q, k, v, g, beta, initial_state):
    """The inputs as the kernels read them: contiguous, the initial state in fp32."""
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32)
    return [None if t is None else t.contiguous() for t in (q, k, v, g, beta, initial_state)]


def _sequences(v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return v.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def _device_cu(cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    if cu_seqlens is None:
        return placeholder(device, CU_DTYPE)
    return on_device(cu_seqlens, device, CU_DTYPE)


@dataclass
class Chunks:
    """How the packed token axis splits into chunks of BT, as the chunked kernels take it (forward and backward)."""

    per_sequence: int  # chunks per sequence (fixed length; 0 with cu_seqlens)
    total: int  # chunks over all sequences
    cu: torch.Tensor  # device cu_seqlens (int32), or a placeholder
    table: torch.Tensor  # device [total, 2] int32 (sequence, chunk within it) with cu_seqlens, or a placeholder
    first: torch.Tensor  # device [N] int32 global index of each sequence's first chunk, or a placeholder

    @classmethod
    def of(cls, B: int, T_: int, cu_seqlens: torch.Tensor | None, device) -> "Chunks":
        cu = _device_cu(cu_seqlens, device)
        if cu_seqlens is None:
            none = placeholder(device, torch.int32)
            return cls(-(-T_ // BT), B * -(-T_ // BT), cu, none, none)
        table, first = chunk_table(cu, cu_seqlens, BT)
        return cls(0, table.shape[0], cu, table, first)
