"""silu_attention in TileLang: a forward kernel, and a backward of two kernels: dk/dv (one program per key block,
which also sums the bias gradients) and dq (one per query block). Every program is one (block, head, sequence) of a
3-D grid, 64 x 64 tiles, 128 threads, the head dim padded to a power of two; no score is stored (each kernel
recomputes its score tiles).

dq is a kernel of its own rather than atomic adds from the dk/dv kernel (as the flash-attention backward does): with
packed sequences no fp32 accumulator or reordering pass is needed, and dq repeats bit for bit.

Bias gradients, deterministic (no atomics), without a pass of their own: each dk/dv program already forms ds for
every score of its key block; it sums ds per signed distance of each tile it visits and per time bucket, through
shared memory in fixed orders, into its own rows of two partial buffers. The launcher adds those over sequences and
key blocks and folds distances into position buckets with torch (fixed order). The position partials take
n_blocks + 1 slots of 64 fp32 per key block: N * H * n_blocks * (n_blocks + 1) * 256 bytes (69 MB at 64 sequences,
4 heads, max_seqlen 2048).

Dropout regenerates the forward's bits: flash_attention's counter-based hash with the pair index sequence * H + head
and local indices, which depend on neither the tile sizes nor the tile orientation.

The forward: tilelang_forward.py; the backward: tilelang_backward.py; what they share to recompute a score tile:
tilelang_scores.py.
"""

import torch

from ..kernel_backend import KernelBackend
from ..tilelang_common import Entry
from .tilelang_backward import TIME_SLOTS, backward, backward_entry
from .tilelang_forward import forward, forward_entry
from .tilelang_scores import BLOCK_M, BLOCK_N, MAX_TIME_BUCKETS, THREADS

__all__ = [
    "BLOCK_M",
    "BLOCK_N",
    "MAX_TIME_BUCKETS",
    "THREADS",
    "TIME_SLOTS",
    "backward",
    "backward_entry",
    "forward",
    "forward_entry",
    "kernel_entries",
]


def kernel_entries(
    dim: int, dtype: torch.dtype, causal: bool, targets: bool, pos: bool, time: bool, dropout: bool
) -> list[Entry]:
    """The forward and backward kernels of one specialisation."""
    flags = (causal, targets, pos, time, dropout)
    return [forward_entry(dim, dtype, *flags), *(backward_entry(kind, dim, dtype, *flags) for kind in ("dkdv", "dq"))]


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="arguments")
