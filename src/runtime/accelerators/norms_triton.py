"""Launch logic shared by the Triton row-norm kernels (rms_norm, layer_norm, l2norm; the kernels: norms_kernels).

Every kernel works on tiles of `rows` rows x `block` columns (block: the width rounded up to a
power of two). Narrow rows are packed several to a tile so that small widths are not
launch-bound; wide rows take one row per tile. Forward kernels run one tile per program.
Backward kernels with a weight or bias are persistent: `backward_programs` programs stride over
the tiles, each accumulating its dweight/dbias in registers and writing one fp32 partial row.
The weight's and the bias's partials share one buffer, the weight's rows first. Those partials are
then added up in program order (deterministic: no atomic adds of values), in one of two ways:

- in the backward kernel itself, where they are few (`parameter_backward` decides): each program
  counts itself done on an int32 counter, and the one that comes last adds the partials
  (`add_partials_if_last`) and sets the counter back to zero for the next launch. Counter and
  partials are then scratch kept per device and stream (`backward_scratch`): nothing to allocate;
- else in a second launch, `sum_partials`, spread over column blocks (wide rows: one program
  adding megabytes of partials would take longer than the launch it saves); the partials are then
  one allocation per backward.

Everything derived from the width is cached, so a call costs a dict lookup plus the launch.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import buffers
from .backends import sm_count
from .launch_math import cdiv, next_power_of_2
from .norms import SCALE_ABOVE as _SCALE_ABOVE
from .norms import SQUARES_ABOVE as _SQUARES_ABOVE
from .norms import as_rows
from .triton_launch import DirectLaunch, direct_launch

# Tuned on an H100 (bf16; 32768x4096, 8192x128, 131072x64; CUDA-graph timings): 4096-element tiles
# beat 1024/2048 at narrow widths, 8 warps per 4096-wide row matched or beat 4 and 16, and 16 resident
# backward warps per SM (2 programs of 8 warps) beat 32 and 64 (LayerNorm 4096: 494 vs 515 vs 561 us).
TILE_ELEMENTS = 4096  # elements per program for narrow rows (several rows per tile)
ELEMENTS_PER_THREAD = 16  # sets the warps: enough threads that each holds ~16 elements of a tile
MAX_WARPS = 16
RESIDENT_WARPS = 16  # warps of persistent backward programs per SM
INTERPRETER_PROGRAMS = 2  # backward programs under TRITON_INTERPRET=1 (exercises the partial sums)


SCALE_ABOVE = tl.constexpr(_SCALE_ABOVE)  # see norms.SCALE_ABOVE
SQUARES_ABOVE = tl.constexpr(_SQUARES_ABOVE)


@triton.jit
def rsqrt_mean_square(x, divisor, eps):
    """rsqrt(sum(x^2) / divisor + eps) of each row of a tile, without overflow: a row whose largest |x| is m > 2^50
    takes rsqrt(sum((x / m)^2) / divisor + eps / m^2) / m. Only a tile with a row whose squares add up past
    norms.SQUARES_ABOVE (or to inf) looks for m: the others cannot have one, and take one reduction."""
    squares = tl.sum(x * x, axis=1)
    rstd = tl.rsqrt(squares / divisor + eps)
    if tl.max((squares > SQUARES_ABOVE).to(tl.int32), axis=0) > 0:  # NaN compares false
        m = tl.max(tl.abs(x), axis=1)
        inv = 1.0 / tl.where(m > SCALE_ABOVE, m, 1.0)
        scaled = x * inv[:, None]
        rstd = tl.rsqrt(tl.sum(scaled * scaled, axis=1) / divisor + eps * inv * inv) * inv
    return rstd


@triton.jit
def rms_rstd(x, N, eps):
    """rsqrt(mean(x^2) + eps) of each row of a tile (padding at zero)."""
    return rsqrt_mean_square(x, N, eps)


@triton.jit
def row_statistics(x, mask, N, eps):
    """(mean, x - mean with the padding at zero, rstd) of each row of a tile (padding at zero)."""
    mean = tl.sum(x, axis=1) / N
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = rsqrt_mean_square(centred, N, eps)
    return mean, centred, rstd


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
    return sm_count(device) * programs_per_sm


# sum_partials' kernel (one program per column block), here so that ParameterBackwardLaunch can name it
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


@dataclass(frozen=True)
class ParameterBackwardLaunch:
    """How a backward with parameter gradients launches.

    max_programs: its persistent programs at most; 0 for about what fits on the device at once.
    finish_max_steps: its last program adds the partials when that takes at most this many steps of one tile per
    parameter (each step about one L2 round trip): 16 covers widths up to 128 at the H100's 264 programs. Wider rows
    take sum_partials.
    sum_partials_kernel: the kernel sum_partials launches (tests pass one that records its launches).
    """

    max_programs: int = 0
    finish_max_steps: int = 16
    sum_partials_kernel: DirectLaunch = _sum_partials_kernel


PARAMETER_BACKWARD = ParameterBackwardLaunch()


def backward_programs(
    n_rows: int, tiles: RowTiles, device: torch.device, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD
) -> int:
    """How many persistent programs a backward with parameter gradients launches (about what fits at once)."""
    limit = launch.max_programs or _resident_programs(device, tiles.programs_per_sm)
    return max(1, min(n_tiles(n_rows, tiles), limit))


def parameter_backward(
    n_rows: int, width: int, tiles: RowTiles, device: torch.device, n_params: int, stand_in: torch.Tensor,
    launch: ParameterBackwardLaunch = PARAMETER_BACKWARD,
) -> tuple[int, bool, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(programs, finish, counter, partials) of a backward launch with n_params parameter gradients; finish: its last
    program adds the partials, else `sum_partials` must, after it. Without parameters one program per tile (counter
    and partials the stand-in, not accessed)."""
    if n_params == 0:
        return n_tiles(n_rows, tiles), False, stand_in, stand_in
    programs = backward_programs(n_rows, tiles, device, launch)
    if finishes_in_kernel(programs, tiles, launch):
        return programs, True, *backward_scratch(device, n_params * programs * width)
    return programs, False, stand_in, partials(programs, width, device, n_params)


def finishes_in_kernel(programs: int, tiles: RowTiles, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD) -> bool:
    """Whether a backward of this many programs adds its parameter partials in its last program."""
    return programs <= launch.finish_max_steps * tiles.rows


def one_launch_backward(
    n_rows: int, width: int, tiles: RowTiles, device: torch.device, n_params: int, stand_in: torch.Tensor
) -> tuple[int, bool, torch.Tensor, torch.Tensor] | None:
    """parameter_backward's launch where the backward is one launch; None, allocating nothing, where its parameter
    gradients need sum_partials after it (wide rows)."""
    if n_params and not finishes_in_kernel(backward_programs(n_rows, tiles, device), tiles):
        return None
    return parameter_backward(n_rows, width, tiles, device, n_params, stand_in)


def backward_split(
    n_rows: int, width: int, tiles: RowTiles, device: torch.device, n_params: int, stand_in: torch.Tensor,
    launch: ParameterBackwardLaunch | None,
) -> tuple[int, bool, torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """parameter_backward's launch; launch None: one_launch_backward's (a native node's: one launch or none)."""
    if launch is None:
        return one_launch_backward(n_rows, width, tiles, device, n_params, stand_in)
    return parameter_backward(n_rows, width, tiles, device, n_params, stand_in, launch)


_scratch: dict = {}


def backward_scratch(device: torch.device, n_partials: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counter, partials) for a backward that adds its partials in the kernel: an int32 counter, zero before each
    launch (the last program sets it back), and room for n_partials fp32 partial sums, read within the launch.

    One pair per device and stream, reused by every such launch on it (launches on one stream never overlap), so
    a call allocates nothing; while a CUDA graph is captured, a fresh pair per call (the counter zeroed within the
    graph), so that no two graphs, replayed on any streams, and no eager launch ever share one."""
    if device.type != "cuda":  # the interpreter: one pair per thread
        key = device, threading.get_ident()
    elif torch._C._cuda_isCurrentStreamCapturing():  # torch.cuda.is_current_stream_capturing(), one frame less
        return _new_counter(device), _new_partials(n_partials, device)
    else:
        key = device, torch._C._cuda_getCurrentRawStream(device.index)
    found = _scratch.get(key)
    if found is None or found[2] < n_partials:
        counter = _new_counter(device) if found is None else found[0]
        found = _scratch[key] = counter, _new_partials(n_partials, device), n_partials
    return found[0], found[1]


def _new_counter(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _new_partials(n_partials: int, device: torch.device) -> torch.Tensor:
    return torch.empty(n_partials, dtype=torch.float32, device=device)


@triton.jit
def add_partials_if_last(
    part_ptr, dw_ptr, db_ptr, counter_ptr, N,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Called by every program of a backward after storing its partial rows (the weight's, then the bias's): the last
    one to arrive adds all of them, in program order, into dweight / dbias and sets the counter back to zero."""
    programs = tl.num_programs(0)
    tl.debug_barrier()  # every thread's partial stores come before the count's release (one thread does the atomic)
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == programs - 1:
        tl.store(counter_ptr, 0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        pb_ptr = part_ptr + programs * N if HAS_W else part_ptr
        acc_w = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, programs, ROWS):
            parts = start + tl.arange(0, ROWS)
            offsets = parts[:, None] * N + cols[None, :]
            mask = (parts < programs)[:, None] & col_mask[None, :]
            if HAS_W:  # .cg: read from L2, where the other programs' stores went
                acc_w += tl.load(part_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_B:
                acc_b += tl.load(pb_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_W:
            tl.store(dw_ptr + cols, tl.sum(acc_w, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
        if HAS_B:
            tl.store(db_ptr + cols, tl.sum(acc_b, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


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


def sum_partials(
    partial: torch.Tensor,
    dweight: torch.Tensor | None,
    dbias: torch.Tensor | None = None,
    kernel: DirectLaunch = _sum_partials_kernel,
) -> None:
    """Reduce the partials (from `partials`) into dweight and dbias (either may be None), one launch of `kernel`."""
    rows, width = partial.shape
    n_parts = rows // ((dweight is not None) + (dbias is not None))
    columns, parts = _reduce_blocks(width)
    kernel[(cdiv(width, columns),)](
        partial,
        partial if dweight is None else dweight,
        partial if dbias is None else dbias,
        n_parts,
        width,
        HAS_W=dweight is not None,
        HAS_B=dbias is not None,
        BLOCK_P=parts,
        BLOCK_C=columns,
        num_warps=4,
    )
