"""The context-parallel split of long sequences, shared by the Triton (triton_shared.py) and TileLang (tilelang.py)
chunked walks: the occupancy rule (split_length) and the segments as sequences of their own (Segments).

The walks run one program per (sequence, value head, V block) through all of a sequence's chunks. When those
programs are too few to fill the GPU (few long sequences, few heads), every sequence is cut into segments of the
same number of chunks (the last may be shorter; a shorter sequence is one segment). Per chunk the state map is
affine, S' = M S + b with M = e^gamma_last I - K~^T w and b = K~^T u (K~ = K e^(gamma_last - gamma)), and so is a
segment's: its M (the walk of the linear part from the identity) and b (the walk from a zero state) are computed for
all segments in parallel, one short walk per sequence chains them into the state entering each segment
(x_{s+1} = M_s x_s + b_s), and the segments are walked again in parallel from those states. Segments are handed to
the walking kernels as sequences of their own: their boundaries as cu_seqlens, their first global chunk as the
chunk offsets. The backward's reverse walk is affine in dS' with M^T: the same three steps, the chain run backwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backends import sm_count
from ..launch_math import cdiv
from . import varlen

SPLIT_PROGRAMS_PER_SM = 2  # split to reach about this many walking programs per SM
MIN_SEGMENTS = 4  # the split walks each segment about three times: it pays from about four segments per sequence
MIN_SEGMENT_CHUNKS = 4


def occupancy_segments(programs: int, sms: int) -> int:
    """Segments per sequence that would give SPLIT_PROGRAMS_PER_SM walking programs per SM, or 0 where fewer than
    MIN_SEGMENTS (not worth a split): the first half of the rule, which needs no chunk counts."""
    segments = SPLIT_PROGRAMS_PER_SM * sms // max(programs, 1)
    return segments if segments >= MIN_SEGMENTS else 0


def split_length(sequences: int, longest: int, total: int, programs: int, sms: int) -> int:
    """The occupancy rule: chunks per segment when `programs` walking programs leave most of `sms` SMs idle, else 0.

    sequences, longest, total: the sequences, the chunks of the longest one, the chunks of all. Split when the
    segments per sequence that would give SPLIT_PROGRAMS_PER_SM programs per SM are at least MIN_SEGMENTS (on an
    H100's 132 SMs: at most 66 programs), into segments of at least MIN_SEGMENT_CHUNKS, and only when the longest
    sequence is longer than one segment. Every sequence is cut with the same length.
    """
    segments = occupancy_segments(programs, sms)
    if segments == 0:
        return 0
    # the chain walks a sequence's segments one by one, each step about a quarter of a chunk's:
    # segments of ~sqrt(chunks) / 2 balance it against the segment walks
    length = max(MIN_SEGMENT_CHUNKS, math.isqrt(longest) // 2, cdiv(total, sequences * segments))
    return length if length < longest else 0


def check_segment_chunks(segment_chunks: int | None, owner: str) -> None:
    """segment_chunks is None (the occupancy rule) or an int >= 0 (0: never split), else a ValueError."""
    valid = segment_chunks is None or (
        isinstance(segment_chunks, int) and not isinstance(segment_chunks, bool) and segment_chunks >= 0
    )
    if not valid:
        raise ValueError(f"{owner}: expected None or an int >= 0, got {segment_chunks!r}")


def segment_length(
    forced: int | None, device: torch.device, sequences: int, longest: int, total: int, programs: int
) -> int:
    """Chunks per segment, or 0 to walk every sequence whole: `forced` where given, else the occupancy rule for
    `programs` walking programs on `device` (never off CUDA)."""
    if forced is not None:
        return forced
    if device.type != "cuda" or total == 0:
        return 0
    return split_length(sequences, longest, total, programs, sm_count(device))


@dataclass
class Segments:
    """The split: segments of `length` chunks numbered sequence by sequence, as sequences of their own."""

    count: int  # segments over all sequences
    length: int  # chunks per segment
    tokens: int  # tokens per segment (length * chunk)
    bounds: torch.Tensor  # device [count + 1]: the segments' boundaries on the packed token axis
    first_chunks: torch.Tensor  # device [count] int32: global index of each segment's first chunk
    cu: torch.Tensor  # device [N + 1]: the sequences' boundaries (fixed length: every T tokens)
    first: torch.Tensor  # device [N] int32: each sequence's first segment

    @classmethod
    def of(
        cls,
        length: int,
        chunk: int,
        B: int,
        T: int,
        cu_seqlens: torch.Tensor | None,
        cu: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype = torch.int64,
    ) -> Segments:
        """Segments of `length` chunks of `chunk` tokens; cu_seqlens: the boundaries on the host (None: B sequences of
        T), cu: their device copy (None for fixed length); dtype: the boundaries' on the device."""
        if length <= 0:
            raise ValueError(f"segments: expected a length of at least one chunk, got {length}")
        cu_host = torch.arange(0, B * T + 1, T) if cu_seqlens is None else cu_seqlens
        if cu is None:
            cu = torch.arange(0, B * T + 1, T, device=device, dtype=dtype)
        cu = cu.to(dtype)
        tokens = length * chunk
        bounds, first_chunks, first = varlen.piece_bounds(cu, cu_host, tokens, chunk, dtype)
        return cls(bounds.numel() - 1, length, tokens, bounds, first_chunks, cu, first)
