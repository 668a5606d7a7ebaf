"""What the chunked gated delta rule's Triton forward (triton.py) and backward (triton_backward.py,
triton_backward_wy.py) share: the dtype and chunk-addressing helpers, the chunk tables (Chunks), the kernels' variants
(Tuning), the state walk that both run (walk_states), the Triton side of the context-parallel split of long sequences
(split, and the chain of the segments; split.py has the rest) and the pieces of the backward's kernels."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import buffers
from ..backends import sm_count, triton_interpret
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from . import varlen
from .reference import FULL_DECAY
from .split import Segments, check_segment_chunks, segment_length

BT = 64  # the chunk size (reference.CHUNK_SIZE)
BT_ = tl.constexpr(BT)
FULL_DECAY_ = tl.constexpr(FULL_DECAY)  # g <= -FULL_DECAY: a full decay (reference.local_gamma)
L2NORM_EPS = tl.constexpr(1e-6)  # the l2norm op's default eps


def _precision(q: torch.Tensor) -> str:
    # fp32 inputs need IEEE dots for the 1e-4 bound; tf32 keeps more mantissa than the half inputs have
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _half_dots(q: torch.Tensor) -> bool:
    """Whether the state walk and the output take their products on 16-bit operands with fp32 accumulation, as fla
    does (_storage_dot's HALF): for half inputs, whose w, u, states and corrections are stored in 16 bits anyway (see
    Tuning.storage_dtype)."""
    return q.dtype != torch.float32


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_HALF_TYPES = {dtype: name for name, dtype in HALF_DTYPES.items()}


def half_type(dtype: torch.dtype) -> str:
    """The HALF constexpr of products whose operands are stored in `dtype`: "bf16", "fp16", or "" (fp32: products on
    fp32 operands at PRECISION)."""
    return _HALF_TYPES.get(dtype, "")


def half_storage(half: str) -> torch.dtype:
    """The dtype of tensors that only products with this HALF read: its 16-bit type, else fp32."""
    return HALF_DTYPES.get(half, torch.float32)


# The interpreter's bf16 dots are wrong (it multiplies the bits as integers): under it, _half_dot takes the same
# rounded operands in an exact fp32 dot. Its fp32 -> bf16 conversion truncates where the GPU rounds to nearest:
# _to_half rounds on the bits there (stores into bf16 tensors still truncate under the interpreter).
# Read at import, so that the sm_90 compile tier (a process without TRITON_INTERPRET) builds the GPU's path.
_EMULATE_HALF_DOTS = tl.constexpr(triton_interpret())


@triton.jit
def _full_decays(b_g):
    """Which of these log decays (fp32) are full decays, as 1.0 / 0.0, and the rest with the full ones as 0."""
    full = b_g <= -FULL_DECAY_
    return tl.where(full, 1.0, 0.0), tl.where(full, 0.0, b_g)


@triton.jit
def _store_dg(dg_out, g, d_gamma, rows, row_mask, i_hv, HV: tl.constexpr):
    """dg from dgamma on one chunk's rows: gamma sums the chunk's g but the full decays (reference.local_gamma), so
    dg_s = sum_{t >= s} dgamma_t, and 0 at a full decay (as exp(g) = 0 gives the recurrence)."""
    d_gamma = tl.where(row_mask, d_gamma, 0.0)
    dg = tl.sum(d_gamma, 0) - tl.cumsum(d_gamma, 0) + d_gamma
    b_g = tl.load(g + rows * HV + i_hv, mask=row_mask, other=0.0).to(tl.float32)
    dg = tl.where(b_g <= -FULL_DECAY_, 0.0, dg)
    tl.store(dg_out + rows * HV + i_hv, dg.to(dg_out.dtype.element_ty), mask=row_mask)


@triton.jit
def _to_half(x, DTYPE: tl.constexpr):
    """x in the 16-bit DTYPE, rounded to nearest (even) as the GPU converts."""
    if _EMULATE_HALF_DOTS and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low 16 bits are zero
    else:
        return x.to(DTYPE)


@triton.jit
def _half_dot(a, b, DTYPE: tl.constexpr, acc=None):
    """a @ b (+ acc) in fp32 on operands rounded to the 16-bit DTYPE (under the interpreter: in an exact fp32 dot)."""
    if _EMULATE_HALF_DOTS:
        return tl.dot(_to_half(a, DTYPE).to(tl.float32), _to_half(b, DTYPE).to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DTYPE), b.to(DTYPE), acc)


@triton.jit
def _storage_dot(a, b, PRECISION: tl.constexpr, HALF: tl.constexpr, acc=None):
    """a @ b (+ acc) in fp32: with HALF ("bf16" or "fp16") on operands of that type (tensor cores at twice the tf32
    rate, half the registers), else on fp32 operands at PRECISION."""
    if HALF == "fp16":
        return _half_dot(a, b, tl.float16, acc)
    elif HALF == "bf16":
        return _half_dot(a, b, tl.bfloat16, acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


def _final_state(output_final_state: bool, n: int, HV: int, K: int, V: int, device) -> torch.Tensor:
    shape = (n, HV, K, V) if output_final_state else (0,)
    return buffers.empty(shape, dtype=torch.float32, device=device)


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


@triton.jit
def _bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """[bos, eos) of sequence i_n on the packed token axis (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


# --------------------------------------------------------------------------- chunked


@triton.jit
def _first_chunk(chunk_offsets, i_n, N_CHUNKS, IS_VARLEN: tl.constexpr):
    """Global index (int64) of sequence i_n's first chunk: chunks are numbered sequence by sequence."""
    if IS_VARLEN:
        return tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        return i_n.to(tl.int64) * N_CHUNKS


@triton.jit
def _chunk_start(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN: tl.constexpr):
    """(the first packed row of global chunk i_t, the end of its sequence), int64."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_t)
        i_c = tl.load(chunk_indices + 2 * i_t + 1)
    else:
        i_n = i_t // N_CHUNKS
        i_c = i_t % N_CHUNKS
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    return bos + i_c.to(tl.int64) * BT_, eos


@triton.jit
def _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN: tl.constexpr):
    """(the BT packed rows of global chunk i_t, which of them lie inside its sequence, its last row)."""
    start, eos = _chunk_start(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    rows = start + tl.arange(0, BT_)
    return rows, rows < eos, tl.minimum(start + BT_, eos) - 1


@triton.jit
def _chunk_last(gamma_in, start, bos, eos, i_hv, HV: tl.constexpr):
    """gamma on the last row of the chunk at `start` (0 for a chunk outside [bos, eos), which loads nothing): the walks
    load it a chunk ahead by hand, as Triton 3.6 does not pipeline this scalar load with the tiles."""
    inside = (start >= bos) & (start < eos)
    return tl.load(gamma_in + (tl.minimum(start + BT_, eos) - 1) * HV + i_hv, mask=inside, other=0.0)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_state_kernel(
    k, k_factor, gamma_in, w_in, u_in, h0, ht, states, corrections_out, cu_seqlens, chunk_offsets, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, STORE_STATES: tl.constexpr, TRANSITION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    # TRANSITION: walk the linear part of the chunk maps instead (V = K, no u): from the identity, the product M.
    # k's rows enter only the products, with their factors e^(gamma_last - gamma) rstd precomputed (k_factor): no
    # [BT, K] math on the sequential path, and the tiles can go from memory to the products as loaded
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on x: grid y caps at 65535
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    state_offsets = i_nh.to(tl.int64) * K * V + cols_k[:, None] * V + cols_v[None, :]
    if USE_INITIAL_STATE:
        state = tl.load(h0 + state_offsets).to(tl.float32)
    elif TRANSITION:
        state = tl.where(cols_k[:, None] == cols_v[None, :], 1.0, 0.0)
    else:
        state = tl.zeros([K, BV], dtype=tl.float32)
    # the state entering each chunk, at the chunk's global index (chunk_offsets[n] + c), and the corrections
    first_chunk = _first_chunk(chunk_offsets, i_n, N_CHUNKS, IS_VARLEN)
    r = tl.arange(0, BT_)
    # Triton pipelines the tile loads (cp.async, num_stages - 1 chunks ahead) but not this scalar: it is loaded one
    # chunk ahead by hand, raw (e^ where it is used, after the products). Loading u and k's factors ahead by hand
    # as well kept Triton from pipelining them (sm_90 SASS)
    last = _chunk_last(gamma_in, bos, bos, eos, i_hv, HV)
    for start in range(bos, eos, BT_):
        next_last = _chunk_last(gamma_in, start + BT_, bos, eos, i_hv, HV)
        if STORE_STATES:
            chunk = first_chunk + (start - bos) // BT_
            tl.store(
                states + (chunk * HV + i_hv) * K * V + cols_k[:, None] * V + cols_v[None, :],
                state.to(states.dtype.element_ty),
            )
        rows = start + r
        row_mask = rows < eos
        k_rows = _walk_operand(k, rows, row_mask, i_h, H, K, HALF)
        b_w = _walk_operand(w_in, rows, row_mask, i_hv, HV, K, HALF)
        # K~^T U with K~ = diag(e^(gamma_last - gamma) rstd) K_raw: the row factors scale U's [BT, BV] rows
        to_end = tl.load(k_factor + rows * HV + i_hv, mask=row_mask, other=0.0)
        if TRANSITION:
            corrections = -tl.dot(b_w, state, input_precision=PRECISION)
            scaled = corrections * to_end[:, None]
            state = state * tl.exp(last) + tl.dot(tl.trans(k_rows), scaled, input_precision=PRECISION)
        else:
            b_u = tl.load(u_in + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], mask=row_mask[:, None], other=0.0)
            corrections = b_u.to(tl.float32) - _storage_dot(b_w, state, PRECISION, HALF)
            if STORE_STATES:
                stored = corrections.to(corrections_out.dtype.element_ty)
                tl.store(
                    corrections_out + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], stored, mask=row_mask[:, None]
                )
            state = state * tl.exp(last) + _storage_dot(
                tl.trans(k_rows), corrections * to_end[:, None], PRECISION, HALF
            )
        last = next_last
    if STORE_FINAL_STATE:
        tl.store(ht + state_offsets, state)


def _state_stages(q: torch.Tensor, K: int, programs: int | None) -> int:
    """Pipeline stages of a walk's chunk loop; `programs`: the grid's size where more stages may pay (None: never)."""
    if q.dtype == torch.float32:  # fp32 at K=128 with 2 stages would need ~165 KB of shared memory
        return 1 if K == 128 else 2
    # A grid of at most one program per SM loses no occupancy to the deeper pipeline's shared memory. H100, forward
    # + backward: packed 32768 (128 programs) 11.63 -> 10.95 ms with 4 stages; B4-T4096-H16-D128 (256
    # programs, two a SM at 2 stages) 2.316 -> 2.373 with 4.
    return 4 if programs is not None and programs <= sm_count(q.device) else 2


@triton.jit
def _as_operand(x, HALF: tl.constexpr):
    """A loaded tile as a product operand of _storage_dot: as loaded with HALF (bf16 tiles go to the product
    unconverted), else in fp32."""
    if HALF == "bf16" or HALF == "fp16":
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _walk_operand(x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, HALF: tl.constexpr):
    """A chunk's rows of q, k (heads H) or w (heads HV) as stored (0 past the end): a product operand of the state
    walks (_as_operand), or with HALF off ("" or False) in fp32 for math on them."""
    return _walk_operand_columns(x, rows, row_mask, i_h, H, K, 0, K, HALF)


@triton.jit
def _walk_operand_columns(
    x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, first: tl.constexpr, BK: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """_walk_operand's columns [first, first + BK)."""
    columns = first + tl.arange(0, BK)
    raw = tl.load(x + (rows[:, None] * H + i_h) * K + columns[None, :], mask=row_mask[:, None], other=0.0)
    return _as_operand(raw, HALF)


@triton.jit
def _load_qk(x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr):
    """Rows of q or k in fp32, l2-normalised when asked with the l2norm op's math (x rsqrt(sum(x^2) + eps)),
    and the rsqrt factor of each row (1 without L2NORM)."""
    raw = _walk_operand(x, rows, row_mask, i_h, H, K, False)
    if L2NORM:
        rstd = tl.rsqrt(tl.sum(raw * raw, 1) + L2NORM_EPS)
    else:
        rstd = tl.full([BT_], 1.0, tl.float32)
    return raw * rstd[:, None], rstd


@dataclass
class Chunks:
    """How the packed token axis splits into chunks of BT (shared by the forward and backward launchers)."""

    n: int  # sequences
    per_sequence: int  # chunks per sequence (fixed length; 0 with cu_seqlens)
    total: int  # chunks over all sequences
    longest: int  # chunks of the longest sequence
    cu: torch.Tensor | None  # device cu_seqlens (int64)
    indices: torch.Tensor | None  # device [total, 2] int32: (sequence, chunk within it)
    offsets: torch.Tensor | None  # device [N] int32: global index of each sequence's first chunk

    @classmethod
    def of(cls, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> "Chunks":
        B, T = v.shape[:2]
        if cu_seqlens is None:
            per_sequence = cdiv(T, BT)
            return cls(B, per_sequence, B * per_sequence, per_sequence, None, None, None)
        cu = varlen.on_device(cu_seqlens, v.device)
        indices, offsets = varlen.chunk_table(cu, cu_seqlens, BT)
        longest = int(varlen.piece_counts(cu_seqlens, BT).max())
        return cls(cu_seqlens.numel() - 1, 0, indices.shape[0], longest, cu, indices, offsets)


@dataclass(frozen=True)
class Tuning:
    """Variants of the chunked kernels, for tests and sweeps; the defaults are what the op runs. The forward and its
    backward must take the same (the forward stores (I + A)^-1 in the dtype the backward's step 5 reads).

    grad_wy: how the backward runs its step 5 (triton_backward): "single" (_chunk_grad_wy_kernel, tf32 products) or
        "fused" (_chunk_grad_wy_fused_kernel); None: "fused" at K = 128 and "single" below, as the H100 timings chose.
    half_backward: the backward's products on bf16 operands (fp32 accumulation) for half inputs, in every kernel but
        the single step-5 kernel (on bf16 operands it faulted on the H100 at K = 16 and 32) and the fused one at K = 16
        (half_step5); None: where step 5 runs fused, where it pays (docs/tuning/gated_delta_rule.md has the timings
        and the errors against float64).
    segment_chunks: chunks per segment of the context-parallel split (0: never split); None: the occupancy rule
        (split.split_length) decides.
    fp16_storage: for fp16 inputs, the stored factors, states and corrections and the products' operands in fp16, as
        fla keeps them (the default); False keeps them in bf16, which took fp16 outputs past the 5e-3 bound at weak
        decay on the H200 and was no faster (docs/tuning/gated_delta_rule.md).
    """

    grad_wy: str | None = None
    half_backward: bool | None = None
    segment_chunks: int | None = None
    fp16_storage: bool = True

    def __post_init__(self) -> None:
        if self.grad_wy not in (None, "single", "fused"):
            raise ValueError(f"Tuning.grad_wy: expected None, 'single' or 'fused', got {self.grad_wy!r}")
        check_segment_chunks(self.segment_chunks, "Tuning.segment_chunks")

    def step5(self, K: int) -> str:
        """The backward's step-5 kernel at this K: "single" or "fused"."""
        return self.grad_wy or ("fused" if K == 128 else "single")

    def storage_dtype(self, q: torch.Tensor) -> torch.dtype:
        """The dtype of the per-token factors w and u and of the stored states and corrections: 16 bits for half
        inputs (they are the kernels' largest traffic; the math stays fp32 but for the products of the state walk and
        the output, on operands of that type (_half_dots), and the recurrence itself keeps fp32 in registers): bf16,
        or fp16 for fp16 inputs with fp16_storage; fp32 for fp32 inputs (1e-4 bound)."""
        if q.dtype == torch.float32:
            return torch.float32
        return torch.float16 if self.fp16_storage and q.dtype == torch.float16 else torch.bfloat16

    def half(self, q: torch.Tensor) -> str:
        """The HALF constexpr of the backward's kernels but step 5's (half_step5) for these inputs (half inputs only,
        _half_dots): the storage type, or "" for fp32 products."""
        on = self.step5(q.shape[-1]) == "fused" if self.half_backward is None else self.half_backward
        return half_type(self.storage_dtype(q)) if on and _half_dots(q) else ""

    def half_step5(self, q: torch.Tensor) -> str:
        """The HALF constexpr of the backward's step-5 kernel: the single kernel never takes it; the fused one as the
        other kernels (half), but not at K = 16, where Triton 3.6's sm_90 program for it (one block of k's columns)
        was wrong on the H200 with bf16 products while the interpreter's agreed with float64; the fused kernel only
        tied the single one there (docs/tuning/gated_delta_rule.md)."""
        K = q.shape[-1]
        return self.half(q) if self.step5(K) == "fused" and K > 16 else ""

    def half_inverse(self, k: torch.Tensor) -> bool:
        """Whether step 5 takes T = (I + A)^-1 only in products that round it to 16 bits (the fused kernel with HALF,
        half_step5), so that prepare may store it so (_inverse_dtype). Both step-5 kernels take T in either dtype."""
        return bool(self.half_step5(k))


DEFAULT_TUNING = Tuning()


def _state_block(K: int, V: int) -> int:
    return min(V, 32 if K == 128 else 64)  # the [K, BV] state stays in registers


def _walk(
    k, k_factor, gamma, w, u, chunks: Chunks, *, h0=None, ht=None, states=None, corrections=None, transition=False
):
    """One _chunk_state_kernel launch over the sequences of `chunks`: what it stores is what is given
    (states and corrections together)."""
    B, T, H, K = k.shape
    HV = gamma.shape[1]
    V = K if transition else u.shape[-1]
    options = dict(BV=_state_block(K, V), num_warps=4)
    grid = (chunks.n * HV, cdiv(V, options["BV"]))
    options.setdefault("num_stages", _state_stages(k, K, None if transition else grid[0] * grid[1]))
    _chunk_state_kernel[grid](
        k, k_factor, gamma, w, u, h0, ht, states, corrections, chunks.cu, chunks.offsets, T, chunks.per_sequence,
        H=H, HV=HV, K=K, V=V, USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None,
        IS_VARLEN=chunks.cu is not None, PRECISION=_precision(k), STORE_STATES=states is not None,
        TRANSITION=transition, HALF="" if transition else half_type(u.dtype), **options,
    )  # fmt: skip


def _state_buffer(n: int, HV: int, K: int, V: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return buffers.empty((n, HV, K, V), dtype=dtype, device=device)


def walk_states(
    k, v, k_factor, gamma, w, u, initial_state, output_final_state, chunks: Chunks, segments: "Segments | None"
):
    """The inter-chunk recurrence, k_factor the walks' row factors of k (prepare): (final state, the state entering
    each chunk [total, HV, K, V], the corrections U = u - w S [B*T, HV, V] (both in u's dtype, the storage dtype), and
    with segments their maps M [segments, HV, K, K] for the backward, else None)."""
    K, (HV, V), device = k.shape[-1], v.shape[2:], k.device
    final = _final_state(output_final_state, chunks.n, HV, K, V, device)
    states = _state_buffer(chunks.total, HV, K, V, device, u.dtype)
    corrections = buffers.empty(u.shape, dtype=u.dtype, device=device)
    walk = functools.partial(_walk, k, k_factor, gamma, w, u)
    if segments is None:
        walk(chunks, h0=initial_state, ht=final if output_final_state else None, states=states, corrections=corrections)
        return final, states, corrections, None
    # each segment maps the state entering it to S -> M S + b: M and b (from a zero state) in parallel,
    # then the states entering the segments in order (cheap), then the segments again from those
    parts = segment_chunks(segments, chunks.total)
    maps, offsets = _state_buffer(parts.n, HV, K, K, device), _state_buffer(parts.n, HV, K, V, device)
    walk(parts, ht=maps, transition=True)
    walk(parts, ht=offsets)
    entering = _state_buffer(parts.n, HV, K, V, device)
    _combine(segments, maps, offsets, initial_state, entering, final if output_final_state else None, _precision(k))
    walk(parts, h0=entering, states=states, corrections=corrections)
    return final, states, corrections, maps


# --------------------------------------------------------------------------- context-parallel split
# split.py explains it (and holds the occupancy rule and the segment tables both backends use); here the Triton
# walks' program count that the rule weighs, and the chain of the segments (_segment_combine_kernel).


def split(
    chunks: Chunks, q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, forced: int | None = None
) -> Segments | None:
    """The split the occupancy asks for, or `forced` chunks per segment (Tuning.segment_chunks; None: the rule),
    or None to walk every sequence whole; cu_seqlens on the host, as the launchers get it."""
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    programs = chunks.n * HV * cdiv(V, _state_block(K, V))
    length = segment_length(forced, v.device, chunks.n, chunks.longest, chunks.total, programs)
    if length == 0 or chunks.total == 0:
        return None
    B, T = v.shape[:2]
    return Segments.of(length, BT, B, T, cu_seqlens, chunks.cu, v.device)


def segment_chunks(segments: Segments, total: int) -> Chunks:
    """The segments as the walking kernels take sequences (`total`: the chunks over all sequences)."""
    return Chunks(segments.count, 0, total, segments.length, segments.bounds, None, segments.first_chunks)


@direct_launch
@triton.jit(do_not_specialize=["SEGMENT"])
def _segment_combine_kernel(
    maps, offsets, start, through, end, cu_seqlens, first_segment, SEGMENT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_START: tl.constexpr, STORE_END: tl.constexpr, REVERSE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Chains the segments of a sequence: x -> M x + b through them in order (REVERSE: x -> M^T x + b from the
    last one), storing the x each segment is entered with, then the x at the end."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on x: grid y caps at 65535
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    n_segments = (eos - bos + SEGMENT - 1) // SEGMENT
    first = tl.load(first_segment + i_n).to(tl.int64)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    block = cols_k[:, None] * V + cols_v[None, :]
    if REVERSE:
        map_block = cols_k[None, :] * K + cols_k[:, None]  # M^T
    else:
        map_block = cols_k[:, None] * K + cols_k[None, :]
    if USE_START:
        x = tl.load(start + i_nh.to(tl.int64) * K * V + block).to(tl.float32)
    else:
        x = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(0, n_segments):
        if REVERSE:
            segment = first + n_segments - 1 - i
        else:
            segment = first + i
        base = segment * HV + i_hv
        tl.store(through + base * K * V + block, x)
        m = tl.load(maps + base * K * K + map_block)
        x = tl.dot(m, x, input_precision=PRECISION) + tl.load(offsets + base * K * V + block)
    if STORE_END:
        tl.store(end + i_nh.to(tl.int64) * K * V + block, x)


def _combine(segments: Segments, maps, offsets, start, through, end, precision: str, reverse: bool = False):
    """Launches _segment_combine_kernel: `start`/`end` per sequence [N, HV, K, V] or None, the rest per segment."""
    HV, K, V = offsets.shape[1:]
    BV = _state_block(K, V)
    _segment_combine_kernel[(segments.first.numel() * HV, cdiv(V, BV))](
        maps, offsets, start, through, end, segments.cu, segments.first, segments.tokens,
        HV=HV, K=K, V=V, BV=BV, USE_START=start is not None, STORE_END=end is not None, REVERSE=reverse,
        PRECISION=precision, num_warps=4, num_stages=2,  # K=128 with 3 stages needs ~224 KB of shared memory
    )  # fmt: skip


# --------------------------------------------------------------------------- pieces of the backward's kernels


@triton.jit
def _dot_qk(a, b, input_dtype: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr):
    """a b^T of two [BT, K] q/k tiles. For half inputs with 16-bit operands, which hold tf32's 10-bit mantissa:
    the loaded values exactly in their own dtype, l2-normalised ones (|x| <= 1) in fp16. Kept in fp32, these
    operands made Triton 3.6 ask for more shared memory than sm_90 has at K = 128 (264 KB at BV = 16)."""
    if PRECISION == "ieee":
        return tl.dot(a, tl.trans(b), input_precision=PRECISION)
    dtype: tl.constexpr = tl.float16 if L2NORM else input_dtype
    return _half_dot(a, tl.trans(b), dtype)


@triton.jit
def _operand(x, HALF: tl.constexpr):
    """x that only enters products (_storage_dot): kept in HALF's 16-bit type, as the products round it (half the
    registers of fp32), else in fp32."""
    if HALF == "fp16":
        return _to_half(x, tl.float16)
    elif HALF == "bf16":
        return _to_half(x, tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _chunk_program(
    gamma_in, cu_seqlens, chunk_indices, T, N_CHUNKS, H: tl.constexpr, HV: tl.constexpr, IS_VARLEN: tl.constexpr
):
    """A (chunk, value head) program's chunk, value head, q/k head, rows (_chunk_rows) and gamma on them."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    rows, row_mask, last_row = _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    gamma = tl.load(gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0)
    return i_t, i_hv, i_hv // (HV // H), rows, row_mask, last_row, gamma
