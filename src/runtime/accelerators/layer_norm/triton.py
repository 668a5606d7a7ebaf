"""LayerNorm in Triton: y = (x - mean) * rstd * weight + bias, rstd = rsqrt(var + eps), fp32 math. The kernels:
norms_kernels' row_norm_forward and row_norm_backward with CENTRE.

Backward (xhat = (x - mean) * rstd, g = dy * weight):
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dweight = sum over rows of dy * xhat          dbias = sum over rows of dy

The backward reads the mean and rstd that a forward to be differentiated stores (fp32, one each per row; KERNELS'
backward_reads): 8 bytes a row instead of working the overflow-safe statistics out again from x. `infer`, for calls
with nothing to differentiate, stores none.

The backward's launch is described once, by `backward_launch` (a LaunchPlan): `backward` runs it, `native_forward`
hands it to the C++ node, which saves its tensors (mean and rstd among them).
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

_FLAGS = dict(CENTRE=True, L2=False)  # norms_kernels' flags of LayerNorm


def forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float):
    return _forward(x, weight, bias, eps, _stats_buffers(x))


def infer(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float):
    """y alone (no mean and rstd for a backward): two allocations fewer."""
    return _forward(x, weight, bias, eps, None)


def _stats_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd): fp32, one per row."""
    n_rows = x.numel() // x.shape[-1]
    mean = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    return mean, buffers.empty((n_rows,), dtype=torch.float32, device=x.device)


# the C++ node of the eager backward (native_forward's default; tests pass a recorder)
_NATIVE = NativeBackward("LayerNormTritonBackward", row_norm_backward)


def native_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    native: NativeBackward = _NATIVE,
):
    """forward's y, its backward attached as a C++ node (`native`) that runs backward_launch, reading x and the mean
    and rstd the forward stores (the node holds them); None, having run nothing, where it cannot be (see
    NativeBackward.plan), or where the backward takes two launches (wide rows)."""
    rows = rows_of(x)
    mean, rstd = stats = _stats_buffers(x)
    dweight, dbias = None if weight is None else GRAD_OF[1], None if bias is None else GRAD_OF[2]
    launch = backward_launch(x, weight, bias, mean, rstd, GRAD, x.shape[-1], GRAD_OF[0], dweight, dbias, None, rows)
    if launch is None:
        return None
    inputs = (x, weight, bias)
    plan = native.plan(x.dtype, inputs, launch)
    if plan is None:
        return None
    y, _, _ = _forward(x, weight, bias, eps, stats, rows=rows)  # on the rows the backward reads
    return y if native.attach(plan, y, inputs, launch) else None


def _forward(x, weight, bias, eps: float, stats: tuple[torch.Tensor, torch.Tensor] | None, rows=None):
    """(y, mean, rstd) with mean and rstd written into the given buffers (stats), or (y,) where stats is None.
    rows: rows_of(x) where the caller has it (a copy for x whose rows are not a view)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    y = buffers.empty_like(x)
    mean, rstd = (x2, x2) if stats is None else stats  # x2: stand-ins, not written
    row_norm_forward[(n_tiles(n_rows, tiles),)](
        x2, x2 if weight is None else weight.contiguous(), x2 if bias is None else bias.contiguous(), y, mean, rstd,
        n_rows, width, stride_x, eps,
        **_FLAGS, HAS_W=weight is not None, HAS_B=bias is not None, STORE_STATS=stats is not None,
        BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps,
    )  # fmt: skip
    return (y,) if stats is None else (y, mean, rstd)


def backward(dy, x, weight, bias, eps, y, mean, rstd, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD):
    """y is not read (None in eager calls); mean and rstd: forward's."""
    dy2, _, stride_dy = rows_of(dy)
    dx = buffers.empty_like(x)
    dweight = None if weight is None else buffers.empty_like(weight)
    dbias = None if bias is None else buffers.empty_like(bias)
    backward_launch(x, weight, bias, mean, rstd, dy2, stride_dy, dx, dweight, dbias, launch).run()
    return dx, dweight, dbias, None


def backward_launch(
    x, weight, bias, mean, rstd, dy, stride_dy: int, dx, dweight, dbias, launch: ParameterBackwardLaunch | None,
    rows=None,
) -> LaunchPlan | None:  # fmt: skip
    """The backward's launch, for `backward` to run and `native_forward` to hand to the C++ node. mean, rstd: the
    forward's, one per row. dy (rows of stride stride_dy), dx, dweight, dbias (None without the parameter): the
    gradients, or the node's stand-ins for them (GRAD, GRAD_OF). launch None: the default launch where it is one
    launch, else None, allocating nothing. rows: rows_of(x)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    n_params = (weight is not None) + (bias is not None)
    split = backward_split(n_rows, width, tiles, x.device, n_params, x2, launch)
    if split is None:
        return None
    programs, finish, counter, partial = split
    return LaunchPlan(
        row_norm_backward, (programs,),
        (dy, x2, x2 if weight is None else weight.contiguous(), mean, rstd, dx, partial,
         x2 if dweight is None else dweight, x2 if dbias is None else dbias, counter, n_rows, width, stride_dy,
         stride_x),
        dict(**_FLAGS, HAS_W=weight is not None, HAS_B=bias is not None, FINISH=finish,
             BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps),
        (counter, partial) if finish else (),
        (sum_partials, partial, dweight, dbias, launch.sum_partials_kernel) if n_params and not finish else (),
    )  # fmt: skip


KERNELS = KernelBackend(
    forward=forward, backward=backward, infer=infer, native_forward=native_forward, backward_reads="saved"
)
