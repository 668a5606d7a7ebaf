"""silu_attention in Triton: a forward kernel, and a backward of two kernels: dk/dv (one program per key block, which
also sums the bias gradients) and dq (one per query block).

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

Bias gradients, deterministic (no atomics), without a pass of their own: each dk/dv program forms ds for every score
of its key block; it sums ds along each tile's diagonals (signed distances) and per time bucket and writes these
partial sums into its own rows, and the launcher adds them over sequences and key blocks and folds distances into
position buckets with torch (fixed order; bias_folds.py, shared with the TileLang backend). Time buckets past 62 are
never reached (|dt| < 2^63 - 1): the kernel sums at most 63.

Dropout keeps (sequence s, head h, query i, key j) by flash_attention's counter-based hash (dropout.py) with the
pair index s * H + h and local indices: forward and backward regenerate the same bits.

The forward and the pieces every kernel shares: triton_forward.py; the backward: triton_backward.py.
"""

from __future__ import annotations

from ..kernel_backend import KernelBackend
from .triton_backward import backward
from .triton_configs import CONFIGS_16BIT, CONFIGS_FP32, config
from .triton_forward import MAX_TIME_BUCKETS, block_d, forward

__all__ = [
    "CONFIGS_16BIT",
    "CONFIGS_FP32",
    "MAX_TIME_BUCKETS",
    "backward",
    "block_d",
    "config",
    "forward",
]


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="arguments")
