"""What the kernel backends of top_k and sample share on the host: the survivor limit, how rows are split into
segments, and rows as a 2-D view. Backend-neutral: imports no kernel library."""

from __future__ import annotations

import torch

from ..backends import sm_count
from ..launch_math import cdiv

MAX_K = 2048  # the most survivors one sort program orders
SEGMENT_MIN = 16384  # the shortest segment a row is split into


def segments_per_row(rows: int, n: int, k: int, device: torch.device, segments: int | None) -> int:
    """Segments per row: enough programs to fill the GPU when rows are few, each segment at least SEGMENT_MIN long
    and 4 k; 1 on the CPU (the interpreter) unless asked."""
    if segments is not None:
        return max(1, min(segments, n))
    sms = sm_count(device)
    if sms == 0 or rows >= 2 * sms:
        return 1
    return max(1, min(cdiv(2 * sms, rows), n // max(SEGMENT_MIN, 4 * k)))


def split_rows(
    rows: int, n: int, k: int, device: torch.device, segments: int | None, multiple: int = 1
) -> tuple[int, int]:
    """(segments, segment length) of rows of n entries: every segment holds at least one entry, the last may be
    shorter; the length rounded up to a multiple of `multiple` (aligned segments, fewer of them where it must)."""
    seg_stride = cdiv(cdiv(n, segments_per_row(rows, n, k, device, segments)), multiple) * multiple
    return cdiv(n, seg_stride), seg_stride


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [rows, n] with a unit last stride (copied only where it has another)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()
