"""Seeds of the kernel backends' counter-based dropout (dropout_add, flash_attention).

Both ops take their seed as a one-element device tensor (`draw_seed_tensor`) drawn by torch's
generator of the op's device, and their kernels load it: no device sync, torch.manual_seed repeats
a run, and on CUDA the draw is graph-safe (torch's CUDA generator advances its offset on every
replay of a captured graph, so every replay draws a new seed and so a new mask). Backward reuses
the forward's seed tensor (an argument of the op, saved for backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def draw_seed_tensor(device: torch.device) -> torch.Tensor:
    """A 31-bit seed as an int64 tensor of shape (1,) on `device`, drawn by that device's default generator.

    No host sync; on CUDA it is one small kernel that a CUDA graph captures and replays with a fresh
    draw each time. The value is in [0, 2^31), so kernels may read it as an int32 as well.
    """
    return torch.randint(2**31, (1,), device=device, dtype=torch.int64)


@contextlib.contextmanager
def saved_seeds() -> Iterator[list[torch.Tensor]]:
    """The seed tensors of the kernel calls made inside, in order (through autograd's saved-tensor hooks).

    A kernel call that autograd records (an input requires grad) saves its seed tensor for backward;
    this list holds those very tensors, so after a CUDA graph replay they hold that replay's draws.
    """
    seeds: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.int64 and t.shape == (1,):
            seeds.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seeds
