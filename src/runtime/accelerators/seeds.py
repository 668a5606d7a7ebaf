"""Seeds of the kernel backends' counter-based dropout (flash_attention, dropout_add).

The kernels take the seed as a host integer drawn from torch's default (CPU) generator: no device
sync, and torch.manual_seed repeats a run. A CUDA graph would bake that integer in and replay one
dropout mask forever, so while a graph is being captured dropout on a kernel backend is a
not-supported reason (the fallback rule then runs torch's dropout, which graphs handle).
"""

from __future__ import annotations

import torch

GRAPH_CAPTURE_REASON = (
    "dropout while a CUDA graph is being captured: the kernels take a seed drawn on the host, "
    "so every replay would repeat one dropout mask"
)


def draw_seed() -> int:
    """A 31-bit seed (int32 for the kernels) from torch's default generator."""
    return int(torch.randint(2**31, (), dtype=torch.int64).item())


def capturing_graph(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
