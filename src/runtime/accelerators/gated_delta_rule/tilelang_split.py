"""The context-parallel split of long sequences for the TileLang chunked forward (split.py explains it): the segments
(split_segments, by the occupancy rule on the storing walk's own program count), the chain of the segments' maps
(segment_chain_kernel) and the split storing walk (split_walk) that replaces the whole-sequence one for bf16 inputs.

The segments are walked as sequences of their own by tilelang_shared.state_store_kernel: once with `transition` (the
maps M, [K, K] from the identity), once with store_states False (the offsets b, from a zero state), and, after the
chain has given the state entering each segment, once more from those states storing every chunk's state and
corrections as the whole-sequence walk does. The output kernel then runs unchanged."""

import tilelang.language as T
import torch

from .. import buffers
from ..backends import sm_count
from ..tilelang_common import ACCUM, Entry, launcher, placeholder
from .split import Segments, occupancy_segments, segment_length
from .tilelang_shared import (
    BT,
    OPERAND_TORCH,
    Chunks,
    _state_threads,
    _store_block,
    load_state,
    state_store_entry,
    store_state,
)
from .varlen import piece_counts


def segment_chain_kernel(K: int, V: int, BV: int, has_initial: bool, store_final: bool):
    """One program per (sequence, value head, V block) walks the sequence's segments in order, x <- M x + b from the
    initial state (or zero), storing the x each segment is entered with (fp32) and, when asked, the last x. M x is a
    product on fp32 operands (tf32 on the tensor cores): the whole state passes through it, where the walks' bf16
    operands only carry the corrections."""
    NG, HV, NS, NC, NF = T.dynamic("n_segments, v_heads, n_states, n_cu, n_first")
    threads = _state_threads(K, BV)
    state_shape = (NS, HV, K, V)

    @T.prim_func
    def gdr_segment_chain(
        Maps: T.Tensor((NG, HV, K, K), ACCUM),
        Offsets: T.Tensor((NG, HV, K, V), ACCUM),
        H0: T.Tensor(state_shape if has_initial else (1,), ACCUM),
        Entering: T.Tensor((NG, HV, K, V), ACCUM),
        HT: T.Tensor(state_shape if store_final else (1,), ACCUM),
        Cu: T.Tensor((NC,), "int32"),
        First: T.Tensor((NF,), "int32"),
        tokens: T.int32,
        n_seq: T.int32,
    ):
        with T.Kernel(n_seq * HV, V // BV, threads=threads) as (bnh, bv):  # sequences x heads on x (y caps at 65535)
            x = T.alloc_fragment((K, BV), ACCUM)
            x_t = T.alloc_shared((BV, K), ACCUM)  # x transposed: both operands of the fp32 product K-major
            m_s = T.alloc_shared((K, K), ACCUM)

            n = T.alloc_var("int32", init=bnh // HV)
            hv = T.alloc_var("int32", init=bnh % HV)
            v0 = bv * BV
            first = T.alloc_var("int32", init=First[n])
            count = T.alloc_var("int32", init=T.ceildiv(Cu[n + 1] - Cu[n], tokens))
            load_state(x, H0, n, hv, v0, has_initial)
            for s in T.serial(count):
                for i, j in T.Parallel(K, BV):
                    Entering[first + s, hv, i, v0 + j] = x[i, j]
                    x_t[j, i] = x[i, j]
                T.copy(Maps[first + s, hv, 0:K, 0:K], m_s)
                T.gemm(m_s, x_t, x, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(K, BV):
                    x[i, j] = x[i, j] + Offsets[first + s, hv, i, v0 + j]
            if store_final:
                store_state(HT, x, n, hv, v0)

    return gdr_segment_chain


def chain_entry(K: int, V: int, has_initial: bool, store_final: bool) -> Entry:
    BV = _store_block(K, V)
    key = ("gdr_segment_chain", K, V, BV, has_initial, store_final)
    return key, lambda _: segment_chain_kernel(K, V, BV, has_initial, store_final)


def split_entries(K: int, V: int, has_initial: bool, store_final: bool, l2norm: bool) -> list[Entry]:
    """The kernels of the split walk (after prepare, before the output kernel), in the order they run."""
    return [
        state_store_entry(K, K, False, True, l2norm, True, store_states=False, transition=True),
        state_store_entry(K, V, False, True, l2norm, True, store_states=False),
        chain_entry(K, V, has_initial, store_final),
        state_store_entry(K, V, True, False, l2norm, True),
    ]


def storing_walk_programs(n: int, HV: int, K: int, V: int) -> int:
    """The whole-sequence storing walk's programs: sequences x value heads x V blocks (_store_block)."""
    return n * HV * (V // _store_block(K, V))


def split_segments(
    chunks: Chunks, B: int, T_: int, n: int, HV: int, K: int, V: int, cu_seqlens, device, segment_chunks: int | None
) -> Segments | None:
    """The segments the storing walk is cut into: `segment_chunks` chunks each where given (0: none), else what the
    occupancy rule asks for its programs (sequences x value heads x V blocks of _store_block); None: walk whole."""
    programs = storing_walk_programs(n, HV, K, V)
    if chunks.total == 0 or (segment_chunks is None and occupancy_segments(programs, sm_count(device)) == 0):
        return None  # the common case decided without the host work below
    longest = chunks.per_sequence if cu_seqlens is None else int(piece_counts(cu_seqlens, BT).max())
    length = segment_length(segment_chunks, device, n, longest, chunks.total, programs)
    if length == 0:
        return None
    cu = None if cu_seqlens is None else chunks.cu
    return Segments.of(length, BT, B, T_, cu_seqlens, cu, device, torch.int32)


def split_walk(k_rows, gamma, w, u, h0, ht, states, corrections, segments: Segments, *, has_initial: bool,
               store_final: bool, l2norm: bool, seq_len: int, groups: int):  # fmt: skip
    """The storing walk over the segments: their maps and offsets, the chain (the final state into `ht` when
    store_final), then the segments from the states entering them, storing `states` and `corrections`."""
    K, (HV, V), device = k_rows.shape[-1], u.shape[1:], k_rows.device
    parts = segments.count
    maps = buffers.empty((parts, HV, K, K), dtype=torch.float32, device=device)
    offsets = buffers.empty((parts, HV, K, V), dtype=torch.float32, device=device)
    entering = buffers.empty((parts, HV, K, V), dtype=torch.float32, device=device)
    none, none_h = placeholder(device), placeholder(device, OPERAND_TORCH)
    transition, offset, chain, walk = split_entries(K, V, has_initial, store_final, l2norm)
    tables = (segments.bounds, segments.first_chunks, seq_len, parts, groups)
    launcher(transition, device)(k_rows, gamma, w, placeholder(device, u.dtype), none, maps, none_h, none_h, *tables)
    launcher(offset, device)(k_rows, gamma, w, u, none, offsets, none_h, none_h, *tables)
    launcher(chain, device)(
        maps, offsets, h0, entering, ht, segments.cu, segments.first, segments.tokens, segments.first.numel()
    )
    launcher(walk, device)(k_rows, gamma, w, u, entering, none, states, corrections, *tables)
