"""The benchmark's L2 flush kernel: reads a buffer with the evict-last hint (see timing.L2Flusher)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _read_evict_last(src, partials, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    tl.store(partials + tl.program_id(0), tl.sum(x, axis=0))  # stored, so the loads are not optimised away


class EvictLastReader:
    """Reads every element of an int32 buffer once per call, each block summed into a partial."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.partials = torch.empty(triton.cdiv(buffer.numel(), BLOCK), dtype=torch.int32, device=buffer.device)

    def __call__(self) -> None:
        _read_evict_last[(self.partials.numel(),)](self.buffer, self.partials, self.buffer.numel(), BLOCK=BLOCK)
