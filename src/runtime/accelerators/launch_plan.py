"""A kernel launch described once, as data: what a backward runs eagerly and what a native node is built from.

A kernel module's `backward_launch(...)` returns the LaunchPlan of its backward. `backward` passes the real tensors
(the gradients it allocates) and runs it; `native_forward` passes the stand-ins of runtime.accelerators.native (GRAD,
OUTPUT, GRAD_OF[i]) where a tensor exists only at backward time, and hands it to a NativeBackward.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class LaunchPlan(NamedTuple):  # a NamedTuple: it is built per eager call, and builds in half a dataclass's time
    """kernel[grid](*args, **constexprs), then `after`.

    args: the positional arguments, the kernel's non-constexpr parameters in order (a native node passes them to the
    compiled kernel in that order); constexprs: the constexprs and launch options (num_warps).
    scratch: zero-filled buffers among args that the kernel leaves zeroed (a native node under CUDA graph capture
    takes fresh ones). after: (function, *arguments) to run after the kernel, e.g. a launch adding up partial sums
    the kernel left; () where the kernel finishes the work.
    """

    kernel: Any  # a @direct_launch Triton kernel
    grid: tuple
    args: tuple
    constexprs: dict
    scratch: tuple = ()
    after: tuple = ()

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs)
        if self.after:
            self.after[0](*self.after[1:])
