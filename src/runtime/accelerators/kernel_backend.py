"""KernelBackend: one backend's entry points for one op, declared as objects at the end of its kernel module.

A kernel module ends with its declaration (`KERNELS = KernelBackend(forward=forward, backward=backward, ...)`; a
module serving several ops, such as mhc's pre and post, declares one per op under explicit names), and the op's
KernelOp takes, per backend, a function of its package that imports that declaration and returns it:

    def _triton_kernels() -> KernelBackend:
        from .triton import KERNELS

        return KERNELS

KernelOp calls it on the backend's first use, so the package imports without triton or tilelang and imports no
kernel module before a call needs it; a reader (and a static tool) follows the import to the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

BackwardReads = Literal["results", "saved", "arguments"]
BACKWARD_READS: tuple[str, ...] = ("results", "saved", "arguments")


@dataclass(frozen=True)
class KernelBackend:
    """One backend's entry points for one op (KernelOp's module docstring gives their calling convention).

    forward:        (*args) -> the op's outputs, then the results saved for backward
    backward:       (*grad_outputs, *args, *results) -> one gradient (or None) per argument; None for an op this
                    backend never differentiates (its op's reasons send calls needing gradients elsewhere)
    infer:          (*args) -> the op's outputs alone, as forward computes them; None where forward is what runs
    native_forward: (*args) -> the op's outputs with backward attached as a C++ node (runtime.accelerators.native),
                    or None (at call time) where that does not apply to these arguments; None where there is none
    backward_reads: what of forward's results backward reads, which eager calls save for it:
                    "results":   all of them (the default);
                    "saved":     those after the op's outputs: the outputs are not saved and backward gets None for
                                 each of them;
                    "arguments": none (backward recomputes what it needs from the arguments): eager calls run infer
                                 where there is one, also where gradients are needed, save the arguments alone, and
                                 backward gets None for every result.
                    The custom ops (torch.compile) always run forward (their schema fixes its results), and save
                    and pass its results as eager calls do: None for each one backward does not read.
    """

    forward: Callable
    backward: Callable | None = None
    infer: Callable | None = None
    native_forward: Callable | None = None
    backward_reads: BackwardReads = "results"

    def __post_init__(self) -> None:
        if not callable(self.forward):
            raise TypeError(f"KernelBackend.forward: expected a callable, got {self.forward!r}")
        for field in ("backward", "infer", "native_forward"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise TypeError(f"KernelBackend.{field}: expected a callable or None, got {value!r}")
        if self.backward_reads not in BACKWARD_READS:
            raise ValueError(
                f"KernelBackend.backward_reads: expected one of {', '.join(map(repr, BACKWARD_READS))}, "
                f"got {self.backward_reads!r}"
            )
        if self.native_forward is not None and self.backward is None:
            raise ValueError("KernelBackend.native_forward: a backend without a backward has no native backward node")

    def first_saved(self, n_outputs: int, n_results: int) -> int:
        """The index of the first of forward's n_results results that eager calls save for backward."""
        return {"results": 0, "saved": n_outputs, "arguments": n_results}[self.backward_reads]
