"""A stable LSD radix sort of embedding-bag indices in Triton: the Triton backend's sort where it fits (`fits`).

torch.sort sorts int32 keys in four 8-bit passes (cub) whatever their range; row numbers of a 1M-row table need 20
bits. Here only the bits of num_embeddings (inclusive: the value num_embeddings is the sentinel below) are sorted,
split evenly into passes of at most RadixLaunch.digit_bits: two 10-bit passes for 1M rows, one for 1K.

Keys outside [0, num_embeddings) become the sentinel num_embeddings, which sorts last and which the gradient kernels
skip as they skip any out-of-range row: with check_indices=False such indices corrupt nothing.

The keys are cut into tiles of RadixLaunch.tile entries, one program each. Launches, P passes:

    _histogram_kernel         counts[0, tile, digit] of the first pass, from the raw int32/int64 indices (no
                              separate cast); zeroes counts[1:] for the later passes
    _scatter_kernel  x P      each program sums the pass's counts matrix [tiles, buckets] (from L2) into its keys'
                              destinations: all keys of smaller digits, then earlier tiles' keys of the same digit;
                              ranks its keys among equal digits in flat order (tl.sort of digit << log2(tile) | lane);
                              writes keys and permutation; and counts the next pass's digits per destination tile
                              (integer atomics: the counts, hence the result, do not depend on their order)

`sort(..., zero=buffer)` also zero-fills `buffer` (the dense weight gradient) in extra programs of the scatter
launches, a share per pass: the fill is bound by DRAM bandwidth and the sort by latency (a few dozen programs), so
in one launch they overlap where one after the other they would add up.

The result is deterministic and stable (equal keys keep their flat order), as torch.sort(stable=True) is: the same
keys and permutation. The permutation is int32. Every program re-reads the whole counts matrix, so the work grows
with tiles x buckets per program: `fits` keeps the sort to counts matrices of at most RadixLaunch.max_counts entries
(64 tiles of 1024 keys at 10-bit digits); the backward takes torch.sort above that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import buffers
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from .segments import INT32_MAX, Segments


@dataclass(frozen=True)
class RadixLaunch:
    """How the radix sort runs, and how its extra programs zero-fill a tensor on the way (RADIX: the launch the
    backward takes by default)."""

    digit_bits: int = 10  # the most key bits sorted per pass (the passes split the key's bits evenly)
    tile: int = 1024  # keys per program, a power of two
    num_warps: int = 8  # H100, 1M rows: 1024 keys / 8 warps 0.0356 ms (32768 keys), 4 warps 0.0454
    max_counts: int = 1 << 16  # the largest counts matrix (tiles x buckets per pass) that `fits`
    zero_block: int = 4096  # elements a fill program stores at once
    zero_steps: int = 8  # and how many times

    def __post_init__(self):
        if not 1 <= self.digit_bits <= 16:
            raise ValueError(f"RadixLaunch.digit_bits: expected 1 to 16, got {self.digit_bits}")
        if self.tile < 16 or self.tile & (self.tile - 1):
            raise ValueError(f"RadixLaunch.tile: expected a power of two >= 16, got {self.tile}")


RADIX = RadixLaunch()
COUNTS_PER_THREAD = 32  # counts entries each thread of a scatter program loads at once


def plan(num_embeddings: int, launch: RadixLaunch) -> tuple[int, int]:
    """(bits per pass, passes) for keys in [0, num_embeddings], num_embeddings being the sentinel."""
    key_bits = max(1, num_embeddings.bit_length())
    passes = cdiv(key_bits, launch.digit_bits)
    return cdiv(key_bits, passes), passes


def fits(num_keys: int, num_embeddings: int, launch: RadixLaunch | None = None) -> bool:
    """Whether the radix sort takes these keys: its counts matrix is at most launch.max_counts entries."""
    launch = launch or RADIX
    bits, _ = plan(num_embeddings, launch)
    return (
        0 < num_keys <= INT32_MAX
        and num_embeddings <= INT32_MAX
        and cdiv(num_keys, launch.tile) << bits <= launch.max_counts
    )


# --------------------------------------------------------------------------- kernels


@triton.jit
def _load_keys(keys_ptr, offs, mask, num_embeddings, RAW: tl.constexpr):
    """int32 keys at offs; RAW (the flat indices): those outside [0, num_embeddings) read as num_embeddings."""
    key = tl.load(keys_ptr + offs, mask=mask, other=0)
    if RAW:
        key = tl.where((key >= 0) & (key < num_embeddings), key, num_embeddings)
    return key.to(tl.int32)


@direct_launch
@triton.jit(do_not_specialize=["num_keys", "num_embeddings", "num_tiles", "passes"])
def _histogram_kernel(
    keys_ptr, counts_ptr, num_keys, num_embeddings, num_tiles, passes, BITS: tl.constexpr, TILE: tl.constexpr
):
    t = tl.program_id(0)
    offs = t * TILE + tl.arange(0, TILE)
    valid = offs < num_keys
    digit = _load_keys(keys_ptr, offs, valid, num_embeddings, RAW=True) & ((1 << BITS) - 1)
    bins = tl.arange(0, 1 << BITS)
    tl.store(counts_ptr + t * (1 << BITS) + bins, tl.histogram(digit, 1 << BITS, mask=valid))
    for p in range(1, passes):  # the later passes' counts, which the scatter kernels add to
        tl.store(counts_ptr + (p * num_tiles + t) * (1 << BITS) + bins, tl.zeros([1 << BITS], dtype=tl.int32))


@triton.jit
def _zero_fill(zero_ptr, zero_start, zero_end, f, ZERO_BLOCK: tl.constexpr, ZERO_STEPS: tl.constexpr):
    """Fill program f's part of zero_ptr[zero_start:zero_end]: ZERO_STEPS blocks of ZERO_BLOCK elements."""
    base = zero_start + f.to(tl.int64) * (ZERO_BLOCK * ZERO_STEPS)
    for step in tl.static_range(ZERO_STEPS):
        offs = base + step * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store(zero_ptr + offs, tl.zeros([ZERO_BLOCK], dtype=zero_ptr.dtype.element_ty), mask=offs < zero_end)


@direct_launch
@triton.jit(do_not_specialize=["num_keys", "num_embeddings", "num_tiles", "pass_index", "zero_start", "zero_end"])
def _scatter_kernel(
    keys_ptr,
    perm_ptr,
    keys_out_ptr,
    perm_out_ptr,
    counts_ptr,
    zero_ptr,
    num_keys,
    num_embeddings,
    num_tiles,
    pass_index,
    zero_start,
    zero_end,
    FIRST: tl.constexpr,
    NEXT: tl.constexpr,
    BITS: tl.constexpr,
    TILE: tl.constexpr,
    LOG_TILE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
    ZERO_STEPS: tl.constexpr,
):
    """Programs past num_tiles zero-fill their part of zero_ptr[zero_start:zero_end]; the others sort their tile."""
    t = tl.program_id(0)
    if t >= num_tiles:
        _zero_fill(zero_ptr, zero_start, zero_end, t - num_tiles, ZERO_BLOCK, ZERO_STEPS)
    else:
        _scatter_tile(
            keys_ptr,
            perm_ptr,
            keys_out_ptr,
            perm_out_ptr,
            counts_ptr,
            num_keys,
            num_embeddings,
            num_tiles,
            pass_index,
            t,
            FIRST,
            NEXT,
            BITS,
            TILE,
            LOG_TILE,
            BLOCK_T,
        )


@triton.jit
def _scatter_tile(
    keys_ptr,
    perm_ptr,
    keys_out_ptr,
    perm_out_ptr,
    counts_ptr,
    num_keys,
    num_embeddings,
    num_tiles,
    pass_index,
    t,
    FIRST: tl.constexpr,
    NEXT: tl.constexpr,
    BITS: tl.constexpr,
    TILE: tl.constexpr,
    LOG_TILE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    start = t * TILE
    i = tl.arange(0, TILE)
    bins = tl.arange(0, 1 << BITS)
    shift = pass_index * BITS
    valid = start + i < num_keys
    digit = (_load_keys(keys_ptr, start + i, valid, num_embeddings, FIRST) >> shift) & ((1 << BITS) - 1)  # (in flight
    # while the counts load)

    # where this tile's keys of each digit start: after every key of a smaller digit, and after earlier tiles' keys of
    # the same digit; less where they start in the tile's own digit-sorted order
    counts = counts_ptr + pass_index * num_tiles * (1 << BITS)
    total = tl.zeros([1 << BITS], dtype=tl.int32)
    before = tl.zeros([1 << BITS], dtype=tl.int32)
    mine = tl.zeros([1 << BITS], dtype=tl.int32)
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        c = tl.load(counts + tiles[:, None] * (1 << BITS) + bins[None, :], mask=(tiles < num_tiles)[:, None], other=0)
        total += tl.sum(c, 0)
        before += tl.sum(tl.where((tiles < t)[:, None], c, 0), 0)
        mine += tl.sum(tl.where((tiles == t)[:, None], c, 0), 0)
    delta = (tl.cumsum(total, 0) - total) + before - (tl.cumsum(mine, 0) - mine)

    # the tile's keys in (digit, flat position) order: a key's place there, less its digit's start, is its rank among
    # the tile's keys of that digit; lanes past the end get digit 1 << BITS and sort last
    pairs = tl.sort((tl.where(valid, digit, 1 << BITS) << LOG_TILE) | i)
    digit = tl.minimum(pairs >> LOG_TILE, (1 << BITS) - 1)
    src = start + (pairs & (TILE - 1))
    ok = i < num_keys - start
    dest = i + tl.gather(delta, digit, 0)

    key = _load_keys(keys_ptr, src, ok, num_embeddings, FIRST)  # a second read of the tile's keys: L1/L2 hits
    if FIRST:
        perm = src
    else:
        perm = tl.load(perm_ptr + src, mask=ok, other=0)
    tl.store(keys_out_ptr + dest, key, mask=ok)
    tl.store(perm_out_ptr + dest, perm, mask=ok)
    if NEXT:  # the next pass's counts: its digit per destination tile
        next_digit = (key >> (shift + BITS)) & ((1 << BITS) - 1)
        next_counts = counts + num_tiles * (1 << BITS)
        tl.atomic_add(next_counts + (dest // TILE) * (1 << BITS) + next_digit, 1, mask=ok, sem="relaxed")


# --------------------------------------------------------------------------- launcher


def _region(buffer: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, int]:
    """buffer[start:start + size] and where the next region starts: 128-byte aligned, as kernels key alignment."""
    return buffer[start : start + size], start + cdiv(size, 32) * 32


def sort(
    flat: torch.Tensor, num_embeddings: int, launch: RadixLaunch | None = None, zero: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, perm), both int32: flat's keys sorted stably, those outside [0, num_embeddings) as num_embeddings, and
    each sorted key's position in flat. Equal to torch.sort(mapped keys, stable=True). `zero`, a contiguous tensor on
    flat's device, is zero-filled on the way (in the scatter launches' extra programs)."""
    launch = launch or RADIX
    if zero is not None and not (zero.is_contiguous() and zero.device == flat.device):
        layout = "contiguous" if zero.is_contiguous() else "non-contiguous"
        raise ValueError(
            f"radix sort: zero must be a contiguous tensor on {flat.device}, got a {layout} one on {zero.device}"
        )
    if flat.dtype not in (torch.int32, torch.int64) or flat.dim() != 1:
        raise TypeError(f"radix sort: expected 1-D int32 or int64 indices, got {flat.dim()}-D {flat.dtype}")
    if flat.numel() > INT32_MAX or num_embeddings > INT32_MAX:
        raise ValueError(
            f"radix sort: {flat.numel()} keys over {num_embeddings} rows; it takes at most {INT32_MAX} of each"
        )
    flat = flat.contiguous()
    num_keys = flat.numel()
    bits, passes = plan(num_embeddings, launch)
    num_tiles = cdiv(num_keys, launch.tile)
    count_size = passes * num_tiles << bits
    pairs = min(passes, 2)  # the result, and the other side of the ping-pong between passes
    size = cdiv(count_size, 32) * 32 + pairs * 2 * cdiv(num_keys, 32) * 32
    buffer = buffers.empty((size,), dtype=torch.int32, device=flat.device)  # one allocation: counts, then the sides
    counts, at = _region(buffer, 0, count_size)
    sides = []
    for _ in range(pairs):
        keys, at = _region(buffer, at, num_keys)
        perm, at = _region(buffer, at, num_keys)
        sides.append((keys, perm))
    if num_keys == 0:
        if zero is not None:
            zero.zero_()
        return sides[0]

    _histogram_kernel[(num_tiles,)](
        flat,
        counts,
        num_keys,
        num_embeddings,
        num_tiles,
        passes,
        BITS=bits,
        TILE=launch.tile,
        num_warps=launch.num_warps,
    )
    fill_size = 0 if zero is None else zero.numel()
    zero = counts if zero is None else zero.view(-1)  # counts: only a pointer for the kernel, nothing is filled
    share = cdiv(fill_size, passes)  # each pass fills zero[p * share:(p + 1) * share]
    fill_programs = cdiv(share, launch.zero_block * launch.zero_steps)
    source = (flat, flat)  # the first pass reads the indices, and no permutation
    for p in range(passes):
        out = sides[(passes - 1 - p) % 2]  # the last pass writes sides[0]
        _scatter_kernel[(num_tiles + fill_programs,)](
            *source,
            *out,
            counts,
            zero,
            num_keys,
            num_embeddings,
            num_tiles,
            p,
            min(p * share, fill_size),
            min((p + 1) * share, fill_size),
            FIRST=p == 0,
            NEXT=p + 1 < passes,
            BITS=bits,
            TILE=launch.tile,
            LOG_TILE=launch.tile.bit_length() - 1,
            BLOCK_T=max(1, COUNTS_PER_THREAD * 32 * launch.num_warps >> bits),
            ZERO_BLOCK=launch.zero_block,
            ZERO_STEPS=launch.zero_steps,
            num_warps=launch.num_warps,
        )
        source = out
    return sides[0]


def sort_segments(
    flat: torch.Tensor, num_embeddings: int, launch: RadixLaunch | None = None, zero: torch.Tensor | None = None
) -> Segments:
    """The gradient's Segments from the radix sort: no `first` (the Triton kernels find segment edges from the keys);
    zero-fills `zero` on the way (see sort)."""
    keys, perm = sort(flat, num_embeddings, launch, zero)
    return Segments(keys, perm, None)
