"""silu_attention in Triton: a forward kernel, and a backward of three kernels: dk/dv (one program per key block),
dq (one per query block) and, where a bias is given, the bias gradients (one program per diagonal band of tiles).

Layout: q, k, v, o and their gradients [total, H, D] packed (rows strided, head dim contiguous). A program of the
forward, dq and dk/dv kernels is one (block, sequence, head) of a 1-D grid: blocks of ceil(max_seqlen / BLOCK) per
(sequence, head), the sequence's rows read from cu_seqlens; a block past its sequence's end does nothing. Tiles
are [rows, BLOCK_D] with the head dim zero-padded to a power of two (masked loads and stores). Nothing of size
L x L is stored: every backward kernel recomputes its score tiles.

Per tile (queries i, keys j of one sequence and head; fp32):
    s  = alpha * q k^T + position_bias[h, min(|i - j|, P - 1)] + time_bias[h, bucket(|t_i - t_j|)]
    a  = silu(s) / max_seqlen, zero where not visible (causal, targets, past the sequence)
    o += dropout(a) v
    ds = dropout(do v^T) * silu'(s) / max_seqlen, zero where not visible
    dq += alpha ds k,  dk += alpha ds^T q,  dv += dropout(a)^T do
with silu'(s) = sigmoid(s) (1 + s (1 - sigmoid(s))).

Bias gradients, deterministic (no atomics): the bias kernel's program for band t (the tiles whose query block is t
blocks after their key block, BLOCK_B square) walks the band and sums ds along each of the tile's 2 * BLOCK_B - 1
diagonals (signed distance i - j = t * BLOCK_B + u - (BLOCK_B - 1)), and per time bucket; it writes these partial
sums for its (sequence, head, band), and the launcher adds them over sequences and folds distances into position
buckets with torch (fixed order). Time buckets past 62 are never reached (|dt| saturates at 2^63 - 2): the kernel sums at most 63.

Dropout keeps (sequence s, head h, query i, key j) by flash_attention's counter-based hash (dropout.py) with the
pair index s * H + h and local indices: forward and backward regenerate the same bits.

The forward and the pieces every kernel shares: triton_forward.py; the backward: triton_backward.py.
"""

from __future__ import annotations

from ..kernel_backend import KernelBackend
from .triton_backward import backward, bias_gradients, fold_distances
from .triton_configs import CONFIGS_16BIT, CONFIGS_FP32, config
from .triton_forward import MAX_TIME_BUCKETS, block_d, forward

__all__ = [
    "CONFIGS_16BIT",
    "CONFIGS_FP32",
    "MAX_TIME_BUCKETS",
    "backward",
    "bias_gradients",
    "block_d",
    "config",
    "fold_distances",
    "forward",
]


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="arguments")
