"""The process's place in a torchrun job (or a single process), and the device it trains on."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import DeviceChoice


@dataclass(frozen=True)
class Run:
    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _device_choice(choice) -> DeviceChoice:
    return choice if isinstance(choice, DeviceChoice) else DeviceChoice(str(choice))


def setup(device: DeviceChoice | str = DeviceChoice.auto) -> Run:
    """Join the torchrun job given by RANK/WORLD_SIZE/LOCAL_RANK (NCCL on CUDA, gloo on CPU) or run alone."""
    choice = _device_choice(device)
    if choice is DeviceChoice.cuda and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda, but torch sees no CUDA device; use trainer.device=cpu or auto")
    use_cuda = choice is DeviceChoice.cuda or (choice is DeviceChoice.auto and torch.cuda.is_available())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Run(torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Run(device, rank, world_size)


def teardown(run: Run, finished: bool) -> None:
    """Ends the process group. After a finished run every process first waits for the others: a gloo peer
    that tears its connections down while another process still works in its own transport threads has
    made that process abort at exit ("terminate called without an active exception"). Callers free what
    still holds the group (a DistributedDataParallel module) before, so that destroying it really ends it."""
    if run.distributed and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def broadcast_object(run: Run, value):
    """The main process's value, on every process."""
    if not run.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(run: Run, value) -> list:
    if not run.distributed:
        return [value]
    out = [None] * run.world_size
    dist.all_gather_object(out, value)
    return out


def gather_rows(run: Run, rows: torch.Tensor, share: int, total: int) -> torch.Tensor:
    """The [total] rows that the processes hold in rank order, each `share` long (the last ones may be shorter),
    on every process (one all_gather of tensors padded to `share`)."""
    if not run.distributed:
        return rows
    padded = rows.new_zeros(share)
    padded[: rows.numel()] = rows
    parts = [torch.empty_like(padded) for _ in range(run.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)[:total]
