"""Seeds of the kernel backends' counter-based dropout (dropout_add, flash_attention).

dropout_add takes its seed as a one-element device tensor (`draw_seed_tensor`) drawn by torch's
generator of the op's device, and its kernels load it: no device sync, torch.manual_seed repeats
a run, and on CUDA the draw is graph-safe (torch's CUDA generator advances its offset on every
replay of a captured graph, so every replay draws a new seed and so a new mask).

flash_attention's kernels still take the seed as a host integer (`draw_seed`) drawn from torch's
default (CPU) generator. A CUDA graph would bake that integer in and replay one dropout mask
forever, so while a graph is being captured dropout on a flash_attention kernel backend is a
not-supported reason (`GRAPH_CAPTURE_REASON`; the fallback rule then runs torch's dropout, which
graphs handle).
"""

from __future__ import annotations

import torch

GRAPH_CAPTURE_REASON = (
    "dropout while a CUDA graph is being captured: the kernels take a seed drawn on the host, "
    "so every replay would repeat one dropout mask"
)


def draw_seed() -> int:
    """A 31-bit seed (int32 for the kernels) from torch's default generator, as a host integer."""
    return int(torch.randint(2**31, (), dtype=torch.int64).item())


def draw_seed_tensor(device: torch.device) -> torch.Tensor:
    """A 31-bit seed as an int64 tensor of shape (1,) on `device`, drawn by that device's default generator.

    No host sync; on CUDA it is one small kernel that a CUDA graph captures and replays with a fresh
    draw each time. The value is in [0, 2^31), so kernels may read it as an int32 as well.
    """
    return torch.randint(2**31, (1,), device=device, dtype=torch.int64)


def capturing_graph(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
