"""The threshold filter of the Triton select (triton.py), its own kernel: per (row, segment) program, a lower bound of
the k-th key from group maxima, then the entries above it and the first k equal to it, in ascending index order, to a
scratch of `capacity` entries that the select reads instead of the segment (the docstring of triton.py has the
design; docs/tuning/sampling.md the figures)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_shared import _choose_digit, _keys, _load_keys, _segment


@dataclass(frozen=True)
class FilterLaunch:
    """How _filter_segment runs. step: entries per step of its two passes, and so its number of group maxima (None:
    the select's block); at least the largest k, so that the bound keeps about k entries. warps: 16 give 85
    registers per thread on sm_90 (bf16; 124 where the segment length is a multiple of 16, as at 1M-wide rows), 512
    threads an SM. stages: the load pipeline depth of its two loops (1: none); deeper keeps more loads in flight per
    thread, where the loop's block-wide sum otherwise waits on each. tiles: None, one masked tile per step; n, the
    full-tile form: n whole tiles per loop iteration read without a mask (segments a multiple of 16 entries long),
    with one block-wide test per iteration in the compaction pass, the rest in masked steps; the same entries kept.
    Why: at 1024x1M each 4096-entry step costs about one DRAM round trip per SM, so n times the bytes in flight per
    step should cut both passes, where the block-wide sum alone does not bound them (the bound pass has none)."""

    step: int | None = None
    warps: int = 16
    stages: int = 1
    tiles: int | None = None


FILTER_LAUNCH = FilterLaunch()


@triton.jit
def _register_digit(key, prefix, remaining, SHIFT: tl.constexpr):
    """The select's digit pass over a vector of keys held in registers."""
    inside = key == key
    if SHIFT < 24:
        inside = (key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8))
    hist = tl.histogram(((key >> SHIFT) & 0xFF).to(tl.int32), 256, mask=inside)
    return _choose_digit(hist, prefix, remaining, SHIFT)


@triton.jit
def _load_full_keys(x_ptr, idx_ptr, offs, LARGEST: tl.constexpr, HAS_IDX: tl.constexpr):
    """_load_keys of a tile wholly inside the row: no mask, so vector loads where the row is aligned; int32 indices
    (the scratch's type: fewer registers)."""
    x = tl.load(x_ptr + offs)
    if HAS_IDX:
        index = tl.load(idx_ptr + offs).to(tl.int32)
        valid = index >= 0
    else:
        index = offs
        valid = offs >= 0
    return _keys(x, LARGEST), x, index, valid


@triton.jit
def _kth_group_max(group_max, wanted):
    """The wanted-th largest of the group maxima (a group without an entry holds 0: it only lowers the result, and
    any result > 0 is still the key of `wanted` real entries)."""
    prefix = tl.zeros((), dtype=tl.uint32)
    remaining = wanted
    prefix, remaining = _register_digit(group_max, prefix, remaining, 24)
    prefix, remaining = _register_digit(group_max, prefix, remaining, 16)
    prefix, remaining = _register_digit(group_max, prefix, remaining, 8)
    prefix, remaining = _register_digit(group_max, prefix, remaining, 0)
    return prefix


@triton.jit
def _lower_bound(
    x_ptr, idx_ptr, n, wanted, LARGEST: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr
):
    """A key t with at least `wanted` entries of x[:n] at or above it (0 where it cannot tell): the wanted-th
    largest of the BLOCK maxima of the strided groups x[j::BLOCK], which are distinct entries."""
    group_max = tl.zeros((BLOCK,), dtype=tl.uint32)
    for step in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = step + tl.arange(0, BLOCK)
        key, x, index, valid = _load_keys(x_ptr, idx_ptr, offs, n, LARGEST, HAS_IDX)
        group_max = tl.maximum(group_max, tl.where(valid, key, 0))
    return _kth_group_max(group_max, wanted)


@triton.jit
def _tiled_lower_bound(
    x_ptr,
    idx_ptr,
    n,
    wanted,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
):
    """_lower_bound (the same groups, the same bound) over TILES whole tiles per iteration, then the rest masked."""
    group_max = tl.zeros((BLOCK,), dtype=tl.uint32)
    full = n - n % (TILES * BLOCK)
    for step in tl.range(0, full, TILES * BLOCK, num_stages=STAGES):
        for tile in tl.static_range(TILES):
            offs = step + tile * BLOCK + tl.arange(0, BLOCK)
            key, x, index, valid = _load_full_keys(x_ptr, idx_ptr, offs, LARGEST, HAS_IDX)
            group_max = tl.maximum(group_max, tl.where(valid, key, 0))
    for step in tl.range(full, n, BLOCK, num_stages=STAGES):
        offs = step + tl.arange(0, BLOCK)
        key, x, index, valid = _load_keys(x_ptr, idx_ptr, offs, n, LARGEST, HAS_IDX)
        group_max = tl.maximum(group_max, tl.where(valid, key, 0))
    return _kth_group_max(group_max, wanted)


@triton.jit
def _keep(key, x, index, above, bound, index_base, kept_x_ptr, kept_idx_ptr, capacity, wanted, count, ties):
    """One tile of the compaction: of the entries `above` (valid, key >= bound), those with key > bound and the
    equal ones while fewer than `wanted` came before, to kept[count:] below capacity -> the new (count, ties)."""
    equal = above & (key == bound)
    n_equal = tl.sum(equal.to(tl.int32), 0)
    keep = above & ((key > bound) | (ties + tl.cumsum(equal.to(tl.int32), 0) <= wanted))
    position = count + tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(kept_x_ptr + position, x, mask=keep & (position < capacity))
    tl.store(kept_idx_ptr + position, (index + index_base).to(tl.int32), mask=keep & (position < capacity))
    return count + tl.sum(keep.to(tl.int32), 0), ties + n_equal


@triton.jit
def _filter_steps(
    x_ptr,
    idx_ptr,
    start,
    n,
    index_base,
    bound,
    kept_x_ptr,
    kept_idx_ptr,
    capacity,
    wanted,
    count,
    ties,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """_filter's walk over x[start:n] in BLOCK steps (masked), from the running (count, ties); returns them."""
    for step in tl.range(start, n, BLOCK, num_stages=STAGES):
        offs = step + tl.arange(0, BLOCK)
        key, x, index, valid = _load_keys(x_ptr, idx_ptr, offs, n, LARGEST, HAS_IDX)
        above = valid & (key >= bound)
        if tl.sum(above.to(tl.int32), 0) > 0:  # most steps of a long row keep nothing: no scan, no store
            count, ties = _keep(
                key, x, index, above, bound, index_base, kept_x_ptr, kept_idx_ptr, capacity, wanted, count, ties
            )
    return count, ties


@triton.jit
def _filter(
    x_ptr,
    idx_ptr,
    n,
    index_base,
    bound,
    kept_x_ptr,
    kept_idx_ptr,
    capacity,
    wanted,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The entries of x[:n] with key > bound and the first `wanted` with key == bound, in ascending index order, to
    kept[:capacity] (index + index_base); returns how many there are (all of them counted, also past capacity).
    As bound is at most the wanted-th key, those hold the wanted best entries (ties: the lower index first)."""
    zero = tl.zeros((), dtype=tl.int32)
    count, ties = _filter_steps(
        x_ptr, idx_ptr, 0, n, index_base, bound, kept_x_ptr, kept_idx_ptr, capacity, wanted, zero, zero,
        LARGEST, HAS_IDX, BLOCK, STAGES,
    )  # fmt: skip
    return count


@triton.jit
def _tiled_filter(
    x_ptr,
    idx_ptr,
    n,
    index_base,
    bound,
    kept_x_ptr,
    kept_idx_ptr,
    capacity,
    wanted,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
):
    """_filter (the same entries kept, in the same order) over TILES whole tiles per iteration: one block-wide test
    for all of them; where one passes, each tile is read again (from the cache, so that no tile's registers are
    held over the test) and compacted as _filter does. Then the rest masked."""
    count = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    full = n - n % (TILES * BLOCK)
    for step in tl.range(0, full, TILES * BLOCK, num_stages=STAGES):
        hit = tl.zeros((BLOCK,), dtype=tl.int32)
        for tile in tl.static_range(TILES):
            offs = step + tile * BLOCK + tl.arange(0, BLOCK)
            key, x, index, valid = _load_full_keys(x_ptr, idx_ptr, offs, LARGEST, HAS_IDX)
            hit |= (valid & (key >= bound)).to(tl.int32)
        if tl.max(hit, 0) > 0:
            for tile in tl.static_range(TILES):
                offs = step + tile * BLOCK + tl.arange(0, BLOCK)
                key, x, index, valid = _load_full_keys(x_ptr, idx_ptr, offs, LARGEST, HAS_IDX)
                above = valid & (key >= bound)
                if TILES == 1:
                    worth = True  # the block-wide test above was this tile's
                else:
                    worth = tl.sum(above.to(tl.int32), 0) > 0
                if worth:
                    count, ties = _keep(
                        key, x, index, above, bound, index_base, kept_x_ptr, kept_idx_ptr, capacity, wanted, count, ties
                    )
    count, ties = _filter_steps(
        x_ptr, idx_ptr, full, n, index_base, bound, kept_x_ptr, kept_idx_ptr, capacity, wanted, count, ties,
        LARGEST, HAS_IDX, BLOCK, STAGES,
    )  # fmt: skip
    return count


@triton.jit
def _filter_segment(
    x_ptr,
    idx_ptr,
    n,
    seg_stride,
    row_stride,
    k,
    kept_x_ptr,
    kept_idx_ptr,
    kept_count_ptr,
    capacity,
    LARGEST: tl.constexpr,
    HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Program (row, segment): the entries of its segment above a lower bound of the k-th key and the first k equal
    to it, in ascending index order, to its scratch of `capacity`; kept_count[row, segment]: how many (all of them
    counted, also past capacity). Two streaming passes, apart from the select's kernel: few registers, so several
    programs share an SM and hide each other's load latency. TILES: FilterLaunch.tiles (0 for None)."""
    x_ptr, idx_ptr, n, index_base, program = _segment(x_ptr, idx_ptr, n, seg_stride, row_stride, HAS_IDX)
    wanted = tl.minimum(k, n)
    kept_x_ptr += program * capacity
    kept_idx_ptr += program * capacity
    if TILES == 0:
        bound = _lower_bound(x_ptr, idx_ptr, n, wanted, LARGEST, HAS_IDX, BLOCK, STAGES)
        count = _filter(
            x_ptr,
            idx_ptr,
            n,
            index_base,
            bound,
            kept_x_ptr,
            kept_idx_ptr,
            capacity,
            wanted,
            LARGEST,
            HAS_IDX,
            BLOCK,
            STAGES,
        )
    else:
        bound = _tiled_lower_bound(x_ptr, idx_ptr, n, wanted, LARGEST, HAS_IDX, BLOCK, TILES, STAGES)
        count = _tiled_filter(
            x_ptr,
            idx_ptr,
            n,
            index_base.to(tl.int32),  # the kept indices are int32
            bound,
            kept_x_ptr,
            kept_idx_ptr,
            capacity,
            wanted,
            LARGEST,
            HAS_IDX,
            BLOCK,
            TILES,
            STAGES,
        )
    tl.store(kept_count_ptr + program, count)


def filter_segments(segment: tuple, rows: int, segments: int, k: int, flags: dict, capacity: int, block: int, launch):
    """Launches _filter_segment over the (row, segment) programs of `segment` (x, idx, n, seg_stride, row_stride, as
    the select splits its rows) -> (kept values, kept int32 indices) [programs, capacity] and the count of each
    program's kept entries [rows, segments] (int32; more than capacity: it overflowed)."""
    x = segment[0]
    kept_x = torch.empty((rows * segments, capacity), dtype=x.dtype, device=x.device)
    kept_idx = torch.empty((rows * segments, capacity), dtype=torch.int32, device=x.device)
    kept_count = torch.empty((rows, segments), dtype=torch.int32, device=x.device)
    _filter_segment[(rows, segments)](
        *segment,
        k,
        kept_x,
        kept_idx,
        kept_count,
        capacity,
        **flags,
        BLOCK=launch.step or block,
        TILES=launch.tiles or 0,
        STAGES=launch.stages,
        num_warps=launch.warps,
    )
    return kept_x, kept_idx, kept_count
