"""What the kernel backends of top_k and sample share on the host: the survivor limit, how rows are split into
segments, the rounds that merge the segments' candidates, and rows as a 2-D view. Backend-neutral: imports no kernel
library."""

from __future__ import annotations

from collections.abc import Sequence

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


def select_rounds(
    rows: int, n: int, k: int, device: torch.device, segments: int | Sequence[int] | None, multiple: int = 1
) -> list[tuple[int, int]]:
    """The select's rounds over rows of n entries, each (segments per row, segment length): the first splits the row
    (split_rows), each later one the candidates the round before left (segments * k per row, index -1 for none)
    until one segment per row is left. Each segment of a merging round holds at least max(SEGMENT_MIN, 4 k)
    candidates, so that, as k <= MAX_K, a round has at most 1/8 of the programs of the one before: one program per
    row never walks all the candidates of a long row (264 * 2048 at 16M, k = 2048, 132 SMs: 264, 33, 4, 1 programs).
    segments: None (the plan), an int (the first round's segments), or one count per round (the rule after them).
    The GPU's size decides the first round alone, so that a split forced on the CPU merges as on the GPU."""
    asked = (list(segments) if isinstance(segments, Sequence) else [segments]) or [None]
    plan = [split_rows(rows, n, k, device, asked[0], multiple)]
    while plan[-1][0] > 1:
        width = plan[-1][0] * k
        wanted = asked[len(plan)] if len(plan) < len(asked) else max(1, width // max(SEGMENT_MIN, 4 * k))
        plan.append(split_rows(rows, width, k, device, wanted, multiple))
    return plan


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [rows, n] with a unit last stride (copied only where it has another)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()
