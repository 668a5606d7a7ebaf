"""L2Norm in Triton: y = x * rstd, rstd = rsqrt(sum(x^2) + eps), fp32 math. The kernels: norms_kernels'
row_norm_forward and row_norm_backward with L2 (no parameters).

Backward: dx = rstd * (dy - y * sum(dy * y)), from the output y (= x * rstd) that forward wrote, not from x, as
fla's backward kernel does. The bytes are the same; y was written last, so where backward follows forward closely
(the benchmark's forward+backward) more of it is still in L2, and backward visits the row tiles in reverse to start
on the rows still there. For 16-bit inputs dx then carries y's rounding (relative 2^-9 at bf16), far inside the
gradient bounds. No parameters, so backward runs one tile per program like forward.

The backward's launch is described once, by `backward_launch` (a LaunchPlan): `backward` runs it, `native_forward`
hands it to the C++ node.
"""

from __future__ import annotations

import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_plan import LaunchPlan
from ..native import GRAD, GRAD_OF, OUTPUT, NativeBackward
from ..norms_kernels import row_norm_backward, row_norm_forward
from ..norms_triton import n_tiles, row_tiles, rows_of

_FLAGS = dict(CENTRE=False, L2=True, HAS_W=False, HAS_B=False)  # norms_kernels' flags of L2Norm


def forward(x: torch.Tensor, eps: float):
    return _forward(x, eps, _rstd_buffer(x))


def infer(x: torch.Tensor, eps: float):
    """Forward without autograd: rstd is neither allocated nor written."""
    return _forward(x, eps, None)


def _rstd_buffer(x: torch.Tensor) -> torch.Tensor:
    return buffers.empty((x.numel() // x.shape[-1],), dtype=torch.float32, device=x.device)


# the C++ node of the eager backward (native_forward's default; tests pass a recorder)
_NATIVE = NativeBackward("L2NormTritonBackward", row_norm_backward)


def native_forward(x: torch.Tensor, eps: float, *, native: NativeBackward = _NATIVE):
    """forward's y, its backward attached as a C++ node (`native`) that runs backward_launch, reading y and rstd;
    None, having run nothing, where it cannot be (see NativeBackward.plan)."""
    width = x.shape[-1]
    rstd = _rstd_buffer(x)
    launch = backward_launch(x, rstd, GRAD, width, OUTPUT, width, GRAD_OF[0])
    inputs = (x,)
    plan = native.plan(x.dtype, inputs, launch)
    if plan is None:
        return None
    y, _ = _forward(x, eps, rstd)
    return y if native.attach(plan, y, inputs, launch) else None


def _forward(x: torch.Tensor, eps: float, rstd: torch.Tensor | None):
    """(y, rstd) with rstd written into the given buffer, or (y,) where it is None."""
    x2, n_rows, stride_x = rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    y = buffers.empty_like(x)
    row_norm_forward[(n_tiles(n_rows, tiles),)](
        x2, None, None, y, None, x2 if rstd is None else rstd, n_rows, width, stride_x, eps,
        **_FLAGS, STORE_STATS=rstd is not None, BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps,
    )  # fmt: skip
    return (y,) if rstd is None else (y, rstd)


def backward(dy, x, eps, y, rstd):
    (dy2, _, stride_dy), (y2, _, stride_y) = rows_of(dy), rows_of(y)
    dx = buffers.empty_like(x)
    backward_launch(x, rstd, dy2, stride_dy, y2, stride_y, dx).run()
    return dx, None


def backward_launch(x, rstd, dy, stride_dy: int, y, stride_y: int, dx) -> LaunchPlan:
    """The backward's launch, for `backward` to run and `native_forward` to hand to the C++ node. dy and y (rows of
    stride stride_dy and stride_y), dx: the output's gradient, the output and the input's gradient, or the node's
    stand-ins for them (GRAD, OUTPUT, GRAD_OF)."""
    width = x.shape[-1]
    n_rows, tiles = x.numel() // width, row_tiles(width)
    return LaunchPlan(
        row_norm_backward,
        (n_tiles(n_rows, tiles),),
        (dy, y, None, None, rstd, dx, None, None, None, None, n_rows, width, stride_dy, stride_y),
        dict(**_FLAGS, FINISH=False, BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps),
    )


KERNELS = KernelBackend(forward=forward, backward=backward, infer=infer, native_forward=native_forward)
