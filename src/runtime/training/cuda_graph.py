"""The whole training step (forward, loss, backward, clipping, optimizer) as one CUDA graph.

At PCVR sizes a step is hundreds of small kernels and the host, not the GPU, sets the pace: a
replayed graph launches them all for the cost of one call. The first `warmup` steps run eagerly
(on a side stream, as CUDA graph capture wants: lazy initialisations and allocator warm-up happen
outside the capture); the next one is captured with static batch buffers, and every later step
copies its batch into those buffers and replays.

What a graph needs from the step: the same shapes every step, no host synchronisation, device
tensors for everything that changes between steps (the learning rate is a tensor the scheduler
fills in place, the optimizer is capturable), and random numbers from torch's CUDA generator
(dropout_add's kernels take a seed tensor drawn by it, so they run in the graph with a new mask per
replay; flash_attention's dropout draws its seed on the host, so under capture the fallback rule
sends attention dropout to torch: see that backend's reasons).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

Step = Callable[[object], tuple[torch.Tensor, torch.Tensor]]


class GraphedStep:
    """Calls `step(batch) -> (loss, grad_norm)` eagerly `warmup` times, then as a replayed CUDA graph.

    `batch` is a dataclass of tensors (PCVRBatch); every batch must have the shapes and dtypes of the
    one captured. The learning rates of `optimizer` must be device tensors, updated in place.
    Returns fresh (loss, grad_norm) tensors on every call (the graph's own outputs are overwritten
    by the next replay).
    """

    def __init__(self, step: Step, optimizer: torch.optim.Optimizer, device: torch.device, warmup: int = 3) -> None:
        self.step = step
        self.optimizer = optimizer
        self.device = device
        self.warmup = warmup
        self.eager_calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batch = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.learning_rates = [group["lr"] for group in optimizer.param_groups]
        for i, lr in enumerate(self.learning_rates):
            if not (isinstance(lr, torch.Tensor) and lr.device == device):
                raise ValueError(
                    f"optimizer.param_groups[{i}]['lr']: expected a tensor on {device} for a CUDA graph, got {lr!r}"
                )

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is None and self.eager_calls < self.warmup:
            self.eager_calls += 1
            return self._eager(batch)
        if self.graph is None:
            self._capture(batch)
        self._check_learning_rates()
        self._load(batch)
        self.graph.replay()
        loss, grad_norm = self.outputs
        return loss.clone(), grad_norm.clone()

    def _eager(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            outputs = self.step(batch)
        main.wait_stream(side)
        return outputs

    def _capture(self, batch) -> None:
        self.static_batch = batch._map(lambda t: t.to(self.device, copy=True))
        self.optimizer.zero_grad(set_to_none=True)  # gradients are then allocated inside the graph's memory pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = self.step(self.static_batch)
        self.graph = graph

    def _load(self, batch) -> None:
        for field in dataclasses.fields(batch):
            source, target = getattr(batch, field.name), getattr(self.static_batch, field.name)
            if source is None and target is None:
                continue
            if source is None or target is None or source.shape != target.shape or source.dtype != target.dtype:
                raise ValueError(
                    f"batch.{field.name}: a CUDA-graphed step needs the shape and dtype it was captured with, "
                    f"{_described(target)}; got {_described(source)}"
                )
            target.copy_(source, non_blocking=True)

    def _check_learning_rates(self) -> None:
        """The graph reads the learning-rate tensors it was captured with: a scheduler that replaced
        them (instead of filling them in place) would freeze the rate without a word."""
        for i, (group, lr) in enumerate(zip(self.optimizer.param_groups, self.learning_rates)):
            if group["lr"] is not lr:
                raise RuntimeError(
                    f"optimizer.param_groups[{i}]['lr'] was replaced after the step was captured; "
                    "a CUDA-graphed step needs the learning rate updated in place (tensor.fill_)"
                )


def _described(t: torch.Tensor | None) -> str:
    return "no tensor" if t is None else f"{tuple(t.shape)} {t.dtype}"
