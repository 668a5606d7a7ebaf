"""RMSNorm in Triton: y = x * rstd * weight, rstd = rsqrt(mean(x^2) + eps), fp32 math. The kernels: norms_kernels'
row_norm_forward and row_norm_backward, without CENTRE, L2 and HAS_B.

Backward (xhat = x * rstd, g = dy * weight):
    dx = rstd * (g - xhat * mean(g * xhat))     dweight = sum over rows of dy * xhat

The backward reads the rstd that a forward to be differentiated stores (fp32, one per row; KERNELS' backward_reads):
4 bytes a row instead of working the overflow-safe rstd out again from x. `infer`, for calls with nothing to
differentiate, stores none.

The backward's launch is described once, by `backward_launch` (a LaunchPlan): `backward` runs it, `native_forward`
hands it to the C++ node, which saves its tensors (rstd among them).
"""

from __future__ import annotations

import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_plan import LaunchPlan
from ..native import GRAD, GRAD_OF, NativeBackward
from ..norms_kernels import row_norm_backward, row_norm_forward
from ..norms_triton import (
    PARAMETER_BACKWARD,
    ParameterBackwardLaunch,
    backward_split,
    n_tiles,
    row_tiles,
    rows_of,
    sum_partials,
)

_FLAGS = dict(CENTRE=False, L2=False, HAS_B=False)  # norms_kernels' flags of RMSNorm


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    return _forward(x, weight, eps, _rstd_buffer(x))


def infer(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """y alone (no rstd for a backward): one allocation fewer."""
    return _forward(x, weight, eps, None)


def _rstd_buffer(x: torch.Tensor) -> torch.Tensor:
    return buffers.empty((x.numel() // x.shape[-1],), dtype=torch.float32, device=x.device)


# the C++ node of the eager backward (native_forward's default; tests pass a recorder)
_NATIVE = NativeBackward("RmsNormTritonBackward", row_norm_backward)


def native_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, native: NativeBackward = _NATIVE):
    """forward's y, its backward attached as a C++ node (`native`) that runs backward_launch, reading x and the rstd
    the forward stores (the node holds both); None, having run nothing, where it cannot be (see NativeBackward.plan),
    or where the backward takes two launches (wide rows)."""
    rows = rows_of(x)
    rstd = _rstd_buffer(x)
    dweight = None if weight is None else GRAD_OF[1]
    launch = backward_launch(x, weight, rstd, GRAD, x.shape[-1], GRAD_OF[0], dweight, None, rows)
    if launch is None:
        return None
    inputs = (x, weight)
    plan = native.plan(x.dtype, inputs, launch)
    if plan is None:
        return None
    y, _ = _forward(x, weight, eps, rstd, rows=rows)  # on the rows the backward reads
    return y if native.attach(plan, y, inputs, launch) else None


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, rstd: torch.Tensor | None, rows=None):
    """(y, rstd) with rstd written into the given buffer, or (y,) where it is None. rows: rows_of(x) where the caller
    has it (a copy for x whose rows are not a view)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    y = buffers.empty_like(x)
    row_norm_forward[(n_tiles(n_rows, tiles),)](
        x2, x2 if weight is None else weight.contiguous(), None, y, None, x2 if rstd is None else rstd,
        n_rows, width, stride_x, eps,
        **_FLAGS, HAS_W=weight is not None, STORE_STATS=rstd is not None,
        BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps,
    )  # fmt: skip
    return (y,) if rstd is None else (y, rstd)


def backward(dy, x, weight, eps, y, rstd, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD):
    """y is not read (None in eager calls); rstd: forward's."""
    dy2, _, stride_dy = rows_of(dy)
    dx = buffers.empty_like(x)
    dweight = None if weight is None else buffers.empty_like(weight)
    backward_launch(x, weight, rstd, dy2, stride_dy, dx, dweight, launch).run()
    return dx, dweight, None


def backward_launch(
    x, weight, rstd, dy, stride_dy: int, dx, dweight, launch: ParameterBackwardLaunch | None, rows=None
) -> LaunchPlan | None:
    """The backward's launch, for `backward` to run and `native_forward` to hand to the C++ node. rstd: the forward's,
    one per row. dy (rows of stride stride_dy), dx, dweight (None without a weight): the gradients, or the node's
    stand-ins for them (GRAD, GRAD_OF). launch None: the default launch where it is one launch, else None, allocating
    nothing. rows: rows_of(x)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    n_params = int(weight is not None)
    split = backward_split(n_rows, width, tiles, x.device, n_params, x2, launch)
    if split is None:
        return None
    programs, finish, counter, partial = split
    return LaunchPlan(
        row_norm_backward, (programs,),
        (dy, x2, x2 if weight is None else weight.contiguous(), None, rstd, dx, partial,
         x2 if dweight is None else dweight, None, counter, n_rows, width, stride_dy, stride_x),
        dict(**_FLAGS, HAS_W=weight is not None, FINISH=finish,
             BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps),
        (counter, partial) if finish else (),
        (sum_partials, partial, dweight, None, launch.sum_partials_kernel) if n_params and not finish else (),
    )  # fmt: skip


KERNELS = KernelBackend(
    forward=forward, backward=backward, infer=infer, native_forward=native_forward, backward_reads="saved"
)
