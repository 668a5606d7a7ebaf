"""silu_attention in TileLang: a forward kernel, and a backward of three kernels: dk/dv (one program per key block),
dq (one per query block) and, where a bias is given, the bias gradients (one program per diagonal band of tiles).
The structure of the Triton backward (triton.py), in TileLang: every program is one (block, head, sequence) of a
3-D grid, 64 x 64 tiles, 128 threads, the head dim padded to a power of two; nothing of size L x L is stored (each
kernel recomputes its score tiles).

dq is a kernel of its own rather than atomic adds from the dk/dv kernel (as the flash-attention backward does): with
packed sequences no fp32 accumulator or reordering pass is needed, and dq repeats bit for bit.

Bias gradients, deterministic (no atomics): the bias kernel's program for band t writes per-diagonal and per-time-
bucket partial sums of ds for its (sequence, head, band), and the launcher adds them over sequences and folds
distances into position buckets with torch (fixed order), as the Triton backward does.

Dropout regenerates the forward's bits: flash_attention's counter-based hash with the pair index sequence * H + head
and local indices, which depend on neither the tile sizes nor the tile orientation.

The forward: tilelang_forward.py; the backward: tilelang_backward.py; what they share to recompute a score tile:
tilelang_scores.py.
"""

import torch

from ..kernel_backend import KernelBackend
from ..tilelang_common import Entry
from .tilelang_backward import BLOCK_B, TIME_SLOTS, backward, backward_entry
from .tilelang_forward import forward, forward_entry
from .tilelang_scores import BLOCK_M, BLOCK_N, MAX_TIME_BUCKETS, THREADS

__all__ = [
    "BLOCK_B",
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
    """The forward and backward kernels of one specialisation (the bias kernel where a bias is given)."""
    flags = (causal, targets, pos, time, dropout)
    kinds = ("dkdv", "dq", "bias") if pos or time else ("dkdv", "dq")
    return [forward_entry(dim, dtype, *flags), *(backward_entry(kind, dim, dtype, *flags) for kind in kinds)]


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="arguments")
