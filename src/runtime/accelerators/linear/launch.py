"""Launch configurations of the linear kernels, chosen from (M, N, K): a small table, kept apart from the kernels.

N is the number of output columns a program's tiles cover in the weight's rows: for swiglu each program holds two
accumulators (gate rows j and up rows F + j), so its block_n counts one half and the table halves it.
The entries follow the shapes of Triton's Hopper matmul tutorial (128 x 256 x 64 tiles, 3 stages, 8 warps for large
square products) and smaller tiles where K or N is small (the PCVR MLP shapes, K 64-512): there the output write
dominates and more programs keep every SM busy. Compiled for sm_90 (tests/unit/test_triton_compile_sm90.py, Triton
3.9), 128 x 128 tiles at 4 warps spilled in the epilogue (128 accumulator registers a thread); at 8 warps none do.
128 x 256 at 8 warps spills a little in the gelu epilogue (about 260 bytes a thread); the GPU benchmark decides
whether 128 x 128 serves K = N = 4096 better.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..launch_math import cdiv

# the configs are pure functions of their arguments, asked again on every eager call
_cached = functools.lru_cache(maxsize=4096)


class GemmConfig(NamedTuple):
    """A forward GEMM's tiles and launch. The last three are the persistent kernel's only: subtile, the epilogue in
    two column halves; per_sm, programs an SM; max_registers, a register cap a thread (None: the compiler's choice),
    which two programs of 8 warps need to share an SM (at most 128)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int
    subtile: bool = False
    per_sm: int = 1
    max_registers: int | None = None


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous [..., C] tensor as its [rows, C] view (the tensor itself where it is 2-D): the kernels take rows;
    the op's forward and backward take and give any leading dimensions, so that autograd records no reshapes."""
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


def _pow2_at_least(n: int, low: int) -> int:
    return max(low, 1 << max(0, (n - 1).bit_length()))


@_cached
def forward_config(m: int, n: int, k: int, swiglu: bool = False) -> GemmConfig:
    """Tiles of the forward GEMM y[m, n] = x[m, k] @ w[n, k]^T (n: the columns of one accumulator)."""
    block_k = min(64, _pow2_at_least(k, 16))
    if swiglu:  # two accumulators per program (two 128 x 64 fp32 tiles: 64 registers each at 8 warps)
        return GemmConfig(128, min(64, _pow2_at_least(n, 16)), block_k, 8, 4 if k > 2 * block_k else 2, 8)
    if n >= 256 and k >= 256 and m >= 1024:
        return GemmConfig(128, 256, block_k, 8, 3, 8)
    if n >= 128 and m >= 128:
        return GemmConfig(128, 128, block_k, 8, 3 if k > block_k else 2, 8)
    # few rows (or narrow outputs): the weight read dominates; narrower column blocks give the SMs more programs
    block_m, block_n = min(128, _pow2_at_least(m, 16)), min(128, _pow2_at_least(n, 16))
    while block_n > 32 and cdiv(m, block_m) * cdiv(n, block_n) < MIN_PROGRAMS:
        block_n //= 2
    return GemmConfig(block_m, block_n, block_k, 4, 3 if k > 2 * block_k else 2, 8)


MIN_PROGRAMS = 128  # about one program per SM of an H100 (132) or H200 (132)


class RowsConfig(NamedTuple):
    """The backward's elementwise pass: programs of block_m x block_n tiles, each walking `steps` row tiles (its
    column partial sums of dbias cover block_m * steps rows)."""

    block_m: int
    block_n: int
    steps: int
    num_warps: int


ROW_GROUPS = 256  # at most this many partial rows of dbias to add up, and still hundreds of programs for the SMs


@dataclass(frozen=True)
class BackwardLaunch:
    """The backward's elementwise pass: row_groups, the most groups of row tiles (each writes one partial row of
    dbias) its programs split the rows into; block_m and num_warps, the row tile and warps of a program (None: the
    rule of backward_config)."""

    row_groups: int = ROW_GROUPS
    block_m: int | None = None
    num_warps: int | None = None

    def __post_init__(self):
        if self.row_groups < 1:
            raise ValueError(f"BackwardLaunch.row_groups: expected a positive count, got {self.row_groups}")
        for name in ("block_m", "num_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"BackwardLaunch.{name}: expected a power of two or None, got {value}")


BACKWARD = BackwardLaunch()


@_cached
def backward_config(m: int, n: int, launch: BackwardLaunch = BACKWARD) -> RowsConfig:
    block_n = min(128, _pow2_at_least(n, 16))
    block_m = launch.block_m or (32 if block_n >= 128 else 64)
    steps = max(1, cdiv(cdiv(m, block_m), launch.row_groups))
    return RowsConfig(block_m, block_n, steps, launch.num_warps or 4)


@_cached
def persistent_forward_config(m: int, n: int, k: int, swiglu: bool = False) -> GemmConfig:
    """Tiles of the Hopper persistent TMA forward (triton_persistent.py). Its shared memory holds num_stages x and w
    tiles plus the y (and z) tiles the epilogue stores through descriptors, so it takes 128 x 128 where the portable
    kernel takes 128 x 256. Two programs an SM at 3 stages, the epilogue in column halves and at most 128 registers
    a thread: one program's epilogue (ALU-bound with gelu) runs beside the other's main loop; on an H200 that was
    5-8% faster than one program at 4 stages with gelu at every benchmark shape (docs/tuning/linear.md)."""
    block_k = min(64, _pow2_at_least(k, 16))
    if swiglu:  # two accumulators, two w tiles a stage
        return GemmConfig(128, min(64, _pow2_at_least(n, 16)), block_k, 8, 4, 8)
    return GemmConfig(128, min(128, _pow2_at_least(n, 16)), block_k, 8, 3, 8, subtile=True, per_sm=2, max_registers=128)


def persistent_pays(m: int, n: int, k: int, swiglu: bool, sm_count: int) -> bool:
    """Whether the persistent kernel is worth taking: at least one full wave of its tiles over the SMs (with fewer,
    each program has one tile and persistence buys nothing over the portable kernel's grid). swiglu only from K = 256:
    below, the portable kernel was 7-12% faster on an H200."""
    if swiglu and k < 256:
        return False
    cfg = persistent_forward_config(m, n, k, swiglu)
    return cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n) >= sm_count > 0


def persistent_flattens(k: int, swiglu: bool) -> bool:
    """Whether the persistent kernel flattens its tile loop into the K loop (the next tile's loads in flight during
    this tile's epilogue). On an H200 flattening was 20-26% faster for gelu at every PCVR shape and for swiglu up to
    K = 256; swiglu at K = 512 ran 17% faster with nested loops."""
    return not (swiglu and k >= 512)
