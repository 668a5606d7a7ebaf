"""How an op declares its benchmark cases (one module per op under runtime.benchmark.ops)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One op at one shape preset.

    make_inputs(device, dtype) -> fresh random inputs (tensors that get gradients have requires_grad set)
    run(backend, inputs)       -> the op through the public API on that backend (no fallback): a tensor, or a tuple
                                  of tensors for an op with several outputs (each gets an incoming gradient)
    reference(inputs)          -> the float64 reference on the same inputs (for the correctness check)
    peers                      -> name -> (inputs -> output): other implementations to time beside ours;
                                  a peer whose library is missing is left out (see `peer_available`)
    bytes(inputs, mode)        -> bytes a pass must move ("fwd" or "bwd"), each tensor counted once
    flops(inputs, mode)        -> floating-point operations of a pass (for compute-bound ops), or None
    rtol                       -> dtype -> relative RMS error bound for the correctness check (outputs;
                                  gradients get twice)
    """

    op: str
    shape: str
    make_inputs: Callable[[torch.device, torch.dtype], Inputs]
    run: Callable[[str, Inputs], torch.Tensor]
    reference: Callable[[Inputs], torch.Tensor]
    bytes: Callable[[Inputs, str], int] | None = None
    flops: Callable[[Inputs, str], float] | None = None
    peers: dict[str, Callable[[Inputs], torch.Tensor]] = field(default_factory=dict)
    rtol: dict[torch.dtype, float] = field(default_factory=dict)


def cases_per_shape(shapes: dict[str, tuple], make_inputs: Callable, prefix: str = "", **fields) -> list[Case]:
    """One Case per shape preset (name -> arguments): shape = prefix + name, make_inputs = make_inputs(*arguments),
    and the other Case fields as given, the same for every preset."""
    return [
        Case(shape=prefix + name, make_inputs=make_inputs(*arguments), **fields) for name, arguments in shapes.items()
    ]


def randn_rows(rows: int, width: int, *names: str) -> Callable[[torch.device, torch.dtype], Inputs]:
    """make_inputs of an element-wise op: one standard-normal [rows, width] tensor per name, each requiring grad."""

    def make(device, dtype):
        return {name: torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True) for name in names}

    return make


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def peer_available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
