"""Launch logic shared by the Triton row-norm kernels (rms_norm, layer_norm, l2norm).

Every kernel works on tiles of `rows` rows x `block` columns (block: the width rounded up to a
power of two). Narrow rows are packed several to a tile so that small widths are not
launch-bound; wide rows take one row per tile. Forward kernels run one tile per program.
Backward kernels with a weight or bias are persistent: `backward_programs` programs stride over
the tiles, each accumulating its dweight/dbias in registers and writing one fp32 partial row;
`sum_partials` then reduces those partials (no atomics). The weight's and the bias's partials share
one buffer, the weight's rows first: one allocation per backward.

Everything derived from the width is cached, so a call costs a dict lookup plus the launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import buffers
from .launch_math import cdiv, next_power_of_2
from .norms import as_rows
from .triton_launch import direct_launch

# Tuned on an H100 (bf16; 32768x4096, 8192x128, 131072x64; CUDA-graph timings): 4096-element tiles
# beat 1024/2048 at narrow widths, 8 warps per 4096-wide row matched or beat 4 and 16, and 16 resident
# backward warps per SM (2 programs of 8 warps) beat 32 and 64 (LayerNorm 4096: 494 vs 515 vs 561 us).
TILE_ELEMENTS = 4096  # elements per program for narrow rows (several rows per tile)
ELEMENTS_PER_THREAD = 16  # sets the warps: enough threads that each holds ~16 elements of a tile
MAX_WARPS = 16
RESIDENT_WARPS = 16  # warps of persistent backward programs per SM
INTERPRETER_PROGRAMS = 2  # backward programs under TRITON_INTERPRET=1 (exercises the partial sums)


class RowTiles(NamedTuple):
    block: int  # columns per tile: the width rounded up to a power of two (>= 16)
    rows: int  # rows per tile
    warps: int
    programs_per_sm: int  # resident backward programs per SM (persistent kernels)


@functools.cache
def row_tiles(width: int) -> RowTiles:
    block = max(16, next_power_of_2(width))
    rows = max(1, TILE_ELEMENTS // block)
    warps = min(MAX_WARPS, max(4, rows * block // (32 * ELEMENTS_PER_THREAD)))
    return RowTiles(block, rows, warps, max(1, RESIDENT_WARPS // warps))


def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(what the kernel reads, rows, row stride): x itself when contiguous (no view to build), else as_rows(x)."""
    width = x.shape[-1]
    if x.is_contiguous():
        return x, x.numel() // width, width
    rows = as_rows(x)
    return rows, rows.shape[0], rows.stride(0)


def n_tiles(n_rows: int, tiles: RowTiles) -> int:
    return (n_rows + tiles.rows - 1) // tiles.rows


@functools.cache
def _resident_programs(device: torch.device, programs_per_sm: int) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm


def backward_programs(n_rows: int, tiles: RowTiles, device: torch.device) -> int:
    """How many persistent programs a backward with parameter gradients launches (about what fits at once)."""
    return max(1, min(n_tiles(n_rows, tiles), _resident_programs(device, tiles.programs_per_sm)))


def partials(n_programs: int, width: int, device: torch.device, n_params: int = 1) -> torch.Tensor:
    """Per-program fp32 partial sums of n_params parameter gradients, [n_params * programs, width]: the weight's
    rows first, then the bias's."""
    return buffers.empty((n_params * n_programs, width), dtype=torch.float32, device=device)


REDUCE_TILE = 2048  # partial elements a reduce program loads per step


@functools.cache
def _reduce_blocks(width: int) -> tuple[int, int]:
    """(columns per program, partial rows per step): narrow widths still spread over a few programs."""
    columns = min(64, max(16, next_power_of_2(width) // 8))
    return columns, REDUCE_TILE // columns


@direct_launch
@triton.jit(do_not_specialize=["n_parts"])
def _sum_partials_kernel(
    part_ptr, dw_ptr, db_ptr, n_parts, N,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    pw_ptr = part_ptr
    if HAS_W:  # the bias's partial rows follow the weight's
        pb_ptr = part_ptr + n_parts * N
    else:
        pb_ptr = part_ptr
    acc_w = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        offsets = parts[:, None] * N + cols[None, :]
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        if HAS_W:
            acc_w += tl.load(pw_ptr + offsets, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(pb_ptr + offsets, mask=mask, other=0.0)
    if HAS_W:
        tl.store(dw_ptr + cols, tl.sum(acc_w, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if HAS_B:
        tl.store(db_ptr + cols, tl.sum(acc_b, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


def sum_partials(partial: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None):
    """Reduce the partials (from `partials`) to dweight (weight's dtype) and dbias (bias's dtype), one launch."""
    rows, width = partial.shape
    n_parts = rows // ((weight is not None) + (bias is not None))
    dweight = None if weight is None else buffers.empty_like(weight)
    dbias = None if bias is None else buffers.empty_like(bias)
    columns, parts = _reduce_blocks(width)
    _sum_partials_kernel[(cdiv(width, columns),)](
        partial,
        partial if dweight is None else dweight,
        partial if dbias is None else dbias,
        n_parts,
        width,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        BLOCK_P=parts,
        BLOCK_C=columns,
        num_warps=4,
    )
    return dweight, dbias
