"""top_k and sample in Triton: a radix select per row, no sort of the whole row.

Keys: each value as fp32, mapped to a uint32 that orders as the values do (-0.0 as +0.0, every NaN above +inf;
complemented for largest=False). A select program finds the k-th largest key of its row with four histogram passes
over 8-bit digits (each pass counts only the elements that share the digits found so far), then compacts, in
ascending index order, the elements above that key and the first ones equal to it. A sort program orders the k
survivors by (key descending, index ascending) through one 64-bit key per survivor.

The select's fast path (filter=True) touches the row only twice with cheap work before that: the element-wise maximum
of the keys over BLOCK-sized steps gives BLOCK distinct group maxima, whose k-th largest (found in registers) is a
lower bound of the k-th key; the entries above it and the first k equal to it are then compacted in index order to a
scratch of CAPACITY per program (an all-equal row keeps exactly k), and the digit passes and the compaction run over
those alone. The two passes are their own kernel (_filter_segment), light enough that 512 threads of it stream per
SM where the select's program, which the digit passes make heavy, runs one per SM. Where more than CAPACITY are kept (a large tie class above the bound) the program selects over its whole
segment as without the filter; the result is the same either way.

Where there are few rows and long ones, each row is split into segments: every segment selects its own k candidates
(padded with index -1 where it is shorter), then the same select runs in rounds over the candidates of the row
(select_plan.select_rounds: each round splits them into segments again, until one per row), which stay in ascending
index order and keep the row's indices.

sample: the top-k select and sort of the logits (the maximum top_k over the rows), then one small program per row:
softmax over its first top_k[b] survivors at its temperature, the top-p prefix, and the inverse CDF at its uniform.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import pow2_at_least
from .select_plan import as_rows, select_rounds
from .triton_filter import FILTER_LAUNCH, FilterLaunch, filter_segments
from .triton_shared import _choose_digit, _keys, _load_keys, _segment

BLOCK = 4096  # elements a select program reads per step
# entries passing the filter's bound that a select program keeps: for distinct keys about
# BLOCK * -ln(1 - k / BLOCK) pass (k for small k, 2839 at k = MAX_K = 2048), so every k fits with room for ties
CAPACITY = 4096
# the step of the select over the kept entries: about k of them, and a smaller tile holds fewer registers
KEPT_BLOCK = tl.constexpr(1024)


@triton.jit
def _digit(
    x_ptr,
    idx_ptr,
    n,
    prefix,
    remaining,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
    SHIFT: tl.constexpr,
):
    """One histogram pass over the 8-bit digit at SHIFT of the keys that share prefix's digits above it."""
    hist = tl.zeros((256,), dtype=tl.int32)
    for step in range(0, n, BLOCK):
        offs = step + tl.arange(0, BLOCK)
        key, x, index, valid = _load_keys(x_ptr, idx_ptr, offs, n, LARGEST, HAS_IDX)
        if SHIFT < 24:
            valid = valid & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist += tl.histogram(((key >> SHIFT) & 0xFF).to(tl.int32), 256, mask=valid)
    return _choose_digit(hist, prefix, remaining, SHIFT)


@triton.jit
def _select_exact(
    x_ptr,
    idx_ptr,
    n,
    index_base,
    out_x_ptr,
    out_idx_ptr,
    wanted,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The `wanted` best of x[:n] to out[:wanted] in ascending index order (index + index_base): the threshold key
    by four digit passes, then the entries above it and the first ones equal to it."""
    prefix = tl.zeros((), dtype=tl.uint32)
    remaining = wanted
    prefix, remaining = _digit(x_ptr, idx_ptr, n, prefix, remaining, LARGEST, HAS_IDX, BLOCK, 24)
    prefix, remaining = _digit(x_ptr, idx_ptr, n, prefix, remaining, LARGEST, HAS_IDX, BLOCK, 16)
    prefix, remaining = _digit(x_ptr, idx_ptr, n, prefix, remaining, LARGEST, HAS_IDX, BLOCK, 8)
    prefix, remaining = _digit(x_ptr, idx_ptr, n, prefix, remaining, LARGEST, HAS_IDX, BLOCK, 0)
    taken = tl.zeros((), dtype=tl.int32)
    tied = tl.zeros((), dtype=tl.int32)
    for step in range(0, n, BLOCK):
        offs = step + tl.arange(0, BLOCK)
        key, x, index, valid = _load_keys(x_ptr, idx_ptr, offs, n, LARGEST, HAS_IDX)
        equal = valid & (key == prefix)
        rank = tied + tl.cumsum(equal.to(tl.int32), 0)
        take = (valid & (key > prefix)) | (equal & (rank <= remaining))
        position = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_x_ptr + position, x, mask=take)
        tl.store(out_idx_ptr + position, index + index_base, mask=take)
        taken += tl.sum(take.to(tl.int32), 0)
        tied += tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _select(
    x_ptr,
    idx_ptr,
    n,
    seg_stride,
    row_stride,
    out_x_ptr,
    out_idx_ptr,
    k,
    kept_x_ptr,
    kept_idx_ptr,
    kept_count_ptr,
    capacity,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    FILTER: tl.constexpr,
    BLOCK: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """Program (row, segment): the k best entries of x[row, segment * seg_stride :][:n] (fewer where the segment is
    shorter; index -1 after them) to out[row, segment, :k], in ascending index order.

    FILTER: the exact select over the entries _filter_segment kept in the program's scratch, or over the whole
    segment where more than `capacity` were kept."""
    x_ptr, idx_ptr, n, index_base, program = _segment(x_ptr, idx_ptr, n, seg_stride, row_stride, HAS_IDX)
    out = program * k
    out_x_ptr += out
    out_idx_ptr += out
    wanted = tl.minimum(k, n)
    if FILTER:
        count = tl.load(kept_count_ptr + program)
        if count <= capacity:
            kept_x_ptr += program * capacity
            kept_idx_ptr += program * capacity
            _select_exact(kept_x_ptr, kept_idx_ptr, count, 0, out_x_ptr, out_idx_ptr, wanted, LARGEST, True, KEPT_BLOCK)
        else:
            _select_exact(x_ptr, idx_ptr, n, index_base, out_x_ptr, out_idx_ptr, wanted, LARGEST, HAS_IDX, BLOCK)
    else:
        _select_exact(x_ptr, idx_ptr, n, index_base, out_x_ptr, out_idx_ptr, wanted, LARGEST, HAS_IDX, BLOCK)
    pad = tl.arange(0, K_PAD)
    tl.store(out_idx_ptr + pad, tl.full((K_PAD,), -1, tl.int64), mask=(pad >= wanted) & (pad < k))


@triton.jit
def _sort(
    cand_x_ptr, cand_idx_ptr, x_ptr, row_stride, values_ptr, indices_ptr, k, LARGEST: tl.constexpr, K_PAD: tl.constexpr
):
    """Program row: its k candidates ordered by key descending, then index ascending; values read back from x."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, K_PAD)
    inside = offs < k
    x = tl.load(cand_x_ptr + row * k + offs, mask=inside, other=0.0)
    index = tl.load(cand_idx_ptr + row * k + offs, mask=inside, other=0)
    key = _keys(x, LARGEST).to(tl.uint64)
    packed = (key << 32) | (0xFFFFFFFF - index).to(tl.uint64)
    packed = tl.where(inside, packed, tl.zeros_like(packed))
    packed = tl.sort(packed, 0, descending=True)
    index = (0xFFFFFFFF - (packed & 0xFFFFFFFF)).to(tl.int64)
    values = tl.load(x_ptr + row * row_stride + index, mask=inside)
    tl.store(values_ptr + row * k + offs, values, mask=inside)
    tl.store(indices_ptr + row * k + offs, index, mask=inside)


@triton.jit
def _draw(
    values_ptr, indices_ptr, width, keep_k_ptr, temperature_ptr, top_p_ptr, uniforms_ptr, ids_ptr, K_PAD: tl.constexpr
):
    """Program row: its id from the first keep_k[row] sorted survivors (reference.restricted_draw, step by step)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, K_PAD)
    keep_k = tl.load(keep_k_ptr + row)
    in_k = offs < keep_k
    values = tl.load(values_ptr + row * width + offs, mask=in_k, other=0.0).to(tl.float32)
    has_nan = tl.max((in_k & (values != values)).to(tl.int32), 0) > 0
    z = tl.where(in_k, values / tl.load(temperature_ptr + row), -float("inf"))
    # the best survivor (sorted first) is -inf: all are, and softmax is 0 / 0
    undefined = has_nan | (tl.load(values_ptr + row * width).to(tl.float32) == -float("inf"))
    e = tl.exp(z - tl.max(z, 0))
    p = e / tl.sum(e, 0)
    c = tl.cumsum(p, 0)
    below = tl.sum((in_k & (c < tl.load(top_p_ptr + row))).to(tl.int32), 0)
    last = tl.minimum(below, keep_k - 1)
    mass = tl.sum(tl.where(offs == last, c, 0.0), 0)
    target = tl.load(uniforms_ptr + row) * mass
    first = tl.min(tl.where(c > target, offs, K_PAD), 0)
    pick = tl.minimum(first, last)
    picked = tl.load(indices_ptr + row * width + pick)
    tl.store(ids_ptr + row, tl.where(undefined, -1, picked))


def _warps(k_pad: int) -> int:
    return 4 if k_pad <= 256 else 8


def _select_launch(
    x: torch.Tensor,
    idx: torch.Tensor | None,
    n: int,
    segments: int,
    seg_stride: int,
    k: int,
    largest: bool,
    filter: bool,
    block: int,
    capacity: int,
    filter_launch: FilterLaunch = FILTER_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One select launch over the rows of x [R, >= n] (with idx: candidates and their indices, -1 for none), each
    split into `segments` of seg_stride entries -> (values, indices) [R, segments * k] in ascending index order
    per segment, and with filter how many entries passed the bound per (row, segment) ([R, segments] int32; more
    than capacity: that program selected over its whole segment)."""
    rows = x.shape[0]
    segment = (x, x if idx is None else idx, n, seg_stride, x.stride(0))  # what both kernels split their rows by
    flags = {"LARGEST": largest, "HAS_IDX": idx is not None}
    out_x = torch.empty((rows, segments * k), dtype=x.dtype, device=x.device)
    out_idx = torch.empty((rows, segments * k), dtype=torch.int64, device=x.device)
    if filter:
        kept_x, kept_idx, kept_count = filter_segments(
            segment, rows, segments, k, flags, capacity, block, filter_launch
        )
    else:
        kept_x, kept_idx, kept_count = x, out_idx, None
    _select[(rows, segments)](
        *segment,
        out_x,
        out_idx,
        k,
        kept_x,
        kept_idx,
        out_idx if kept_count is None else kept_count,
        capacity,
        **flags,
        FILTER=filter,
        BLOCK=block,
        K_PAD=pow2_at_least(k, 16),
        num_warps=8,
    )
    return out_x, out_idx, kept_count


def _select_sorted(
    scores: torch.Tensor,
    k: int,
    largest: bool,
    segments: int | Sequence[int] | None = None,
    block: int = BLOCK,
    filter: bool = True,
    capacity: int = CAPACITY,
    filter_launch: FilterLaunch = FILTER_LAUNCH,
):
    """scores [R, n] with a contiguous last dim -> (values [R, k] in scores' dtype, int64 indices [R, k]). segments:
    as select_rounds takes it (None: the plan for this GPU)."""
    rows, n = scores.shape
    k_pad = pow2_at_least(k, 16)
    # the full-tile filter reads aligned segments with 16-byte loads
    plan = select_rounds(rows, n, k, scores.device, segments, 1 if filter_launch.tiles is None else 16)
    launch = (filter, block, capacity, filter_launch)
    cand_x, cand_idx, width = scores, None, n
    for s, seg_stride in plan:  # the row, then its candidates until one segment per row
        cand_x, cand_idx, _ = _select_launch(cand_x, cand_idx, width, s, seg_stride, k, largest, *launch)
        width = s * k
    values = buffers.empty((rows, k), dtype=scores.dtype, device=scores.device)
    indices = buffers.empty((rows, k), dtype=torch.int64, device=scores.device)
    _sort[(rows,)](
        cand_x,
        cand_idx,
        scores,
        scores.stride(0),
        values,
        indices,
        k,
        LARGEST=largest,
        K_PAD=k_pad,
        num_warps=_warps(k_pad),
    )
    return values, indices


def top_k_forward(
    scores: torch.Tensor,
    k: int,
    largest: bool,
    segments: int | Sequence[int] | None = None,
    block: int = BLOCK,
    filter: bool = True,
    capacity: int = CAPACITY,
    filter_launch: FilterLaunch = FILTER_LAUNCH,
):
    """scores [..., n] -> (values, int64 indices) [..., k]. filter: the threshold-filter fast path of the select
    (`_select`), launched as filter_launch says; the same result either way."""
    values, indices = _select_sorted(as_rows(scores), k, largest, segments, block, filter, capacity, filter_launch)
    shape = (*scores.shape[:-1], k)
    return values.view(shape), indices.view(shape)


def sample_forward(
    logits: torch.Tensor,
    keep_k: torch.Tensor,
    max_k: int,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    segments: int | Sequence[int] | None = None,
    block: int = BLOCK,
    filter: bool = True,
    capacity: int = CAPACITY,
):
    """logits [B, V]; keep_k (int32), temperature, top_p, uniforms (fp32): [B] -> ids [B] (int64)."""
    values, indices = _select_sorted(as_rows(logits), max_k, True, segments, block, filter, capacity)
    rows = values.shape[0]
    ids = buffers.empty((rows,), dtype=torch.int64, device=logits.device)
    k_pad = pow2_at_least(max_k, 16)
    _draw[(rows,)](
        values, indices, max_k, keep_k, temperature, top_p, uniforms, ids, K_PAD=k_pad, num_warps=_warps(k_pad)
    )
    return ids


TOP_K_KERNELS = KernelBackend(forward=top_k_forward)
SAMPLE_KERNELS = KernelBackend(forward=sample_forward)
