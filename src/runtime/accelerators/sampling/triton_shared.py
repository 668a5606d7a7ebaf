"""What the Triton select (triton.py) and its threshold filter (triton_filter.py) share: the uint32 keys that order as
the values do, a tile of them loaded from a row, the choice of one 8-bit digit of the k-th key from a histogram, and
the part of a row a (row, segment) program works on."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keys(x, LARGEST: tl.constexpr):
    x = x.to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    key = tl.where(x != x, 0xFFFFFFFF, key)
    if not LARGEST:
        key = ~key
    return key


@triton.jit
def _load_keys(x_ptr, idx_ptr, offs, n, LARGEST: tl.constexpr, HAS_IDX: tl.constexpr):
    """(keys, values, indices, valid) at offs of a row of n entries; without HAS_IDX the index is the offset."""
    valid = offs < n
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    if HAS_IDX:
        index = tl.load(idx_ptr + offs, mask=valid, other=-1).to(tl.int64)
        valid = valid & (index >= 0)
    else:
        index = offs.to(tl.int64)
    return _keys(x, LARGEST), x, index, valid


@triton.jit
def _choose_digit(hist, prefix, remaining, SHIFT: tl.constexpr):
    """From the histogram of the digit at SHIFT: prefix with the threshold's digit set, and how many entries equal
    to the threshold so far are still wanted."""
    bins = tl.arange(0, 256)
    # at_least[d]: entries whose digit is >= d; the threshold's digit is the largest d with enough of them
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    digit = tl.max(tl.where(at_least >= remaining, bins, 0), 0)
    remaining -= tl.sum(tl.where(bins > digit, hist, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), remaining


@triton.jit
def _segment(x_ptr, idx_ptr, n, seg_stride, row_stride, HAS_IDX: tl.constexpr):
    """What program (row, segment) of a select works on: its segment's x and idx pointers, its length, the index of
    its first entry (0 with idx: the indices are read), and the program's number (row-major)."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    start = segment.to(tl.int64) * seg_stride
    n = tl.minimum(n - start, seg_stride).to(tl.int32)
    x_ptr += row * row_stride + start
    if HAS_IDX:
        idx_ptr += row * row_stride + start
        index_base = tl.zeros((), dtype=tl.int64)
    else:
        index_base = start
    return x_ptr, idx_ptr, n, index_base, row * tl.num_programs(1) + segment
