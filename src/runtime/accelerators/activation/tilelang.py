"""gelu and silu in TileLang, fp32 math, one pass each way; backward works the derivative out again from x (the
formulas are in activation/triton.py, the constants in
activation/reference.py).

Flat arrays of a dynamic length N, laid out as swiglu's TileLang kernels (its flat-tile helpers: register tiles of
16-byte vectors, unguarded full blocks and a guarded last block): one compiled kernel per (dtype, activation) serves
every shape.
"""

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..swiglu.tilelang import BLOCK, THREADS, flat, flat_layout, load_flat, store_flat, tile_shape
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher
from .reference import GELU, GELU_TANH, INV_SQRT_2PI, SILU, SQRT_2_OVER_PI, SQRT_HALF, TANH_CUBIC

ACTIVATIONS = {SILU: "silu", GELU: "gelu", GELU_TANH: "gelu_tanh"}


def _tanh_argument(x):
    return 2.0 * SQRT_2_OVER_PI * (x + TANH_CUBIC * x * x * x)


def _activate(x, act: int):
    if act == SILU:
        return x / (1.0 + T.exp(-x))
    if act == GELU:
        return 0.5 * x * (1.0 + T.erf(x * SQRT_HALF))
    return x / (1.0 + T.exp(-_tanh_argument(x)))  # (1 + tanh(u)) / 2 = sigmoid(2u), as the Triton kernels


def _derivative(x, act: int):
    if act == SILU:
        s = 1.0 / (1.0 + T.exp(-x))
        return s * (1.0 + x * (1.0 - s))
    if act == GELU:
        return 0.5 * (1.0 + T.erf(x * SQRT_HALF)) + x * T.exp(-0.5 * x * x) * INV_SQRT_2PI
    two_u = _tanh_argument(x)
    s, s_neg = 1.0 / (1.0 + T.exp(-two_u)), 1.0 / (1.0 + T.exp(two_u))  # (1 + t) / 2 and (1 - t) / 2
    return s + 2.0 * x * s * s_neg * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * x * x)


def forward_kernel(dtype: str, act: int, block: int = BLOCK, threads: int = THREADS):
    N = T.dynamic("N")
    rows, vec = tile_shape(dtype, block)

    @T.macro
    def activation_tile(X, Y, x, start, guarded):
        load_flat(X, x, start, N, guarded)
        for r, v in T.Parallel(rows, vec):
            x[r, v] = _activate(x[r, v], act)
        store_flat(x, Y, start, N, guarded)

    @T.prim_func
    def activation_fwd(X: T.Tensor((N,), dtype), Y: T.Tensor((N,), dtype)):
        with T.Kernel(T.ceildiv(N, block), threads=threads) as bx:
            x = T.alloc_fragment((rows, vec), ACCUM)
            T.annotate_layout({x: flat_layout(rows, vec, threads)})
            if bx * block + block <= N:
                activation_tile(X, Y, x, bx * block, False)
            else:
                activation_tile(X, Y, x, bx * block, True)

    return activation_fwd


def backward_kernel(dtype: str, act: int, block: int = BLOCK, threads: int = THREADS):
    N = T.dynamic("N")
    rows, vec = tile_shape(dtype, block)

    @T.macro
    def activation_tile(DY, X, DX, dy, x, start, guarded):
        load_flat(DY, dy, start, N, guarded)
        load_flat(X, x, start, N, guarded)
        for r, v in T.Parallel(rows, vec):
            x[r, v] = dy[r, v] * _derivative(x[r, v], act)
        store_flat(x, DX, start, N, guarded)

    @T.prim_func
    def activation_bwd(DY: T.Tensor((N,), dtype), X: T.Tensor((N,), dtype), DX: T.Tensor((N,), dtype)):
        with T.Kernel(T.ceildiv(N, block), threads=threads) as bx:
            dy = T.alloc_fragment((rows, vec), ACCUM)
            x = T.alloc_fragment((rows, vec), ACCUM)
            layout = flat_layout(rows, vec, threads)
            T.annotate_layout({dy: layout, x: layout})
            if bx * block + block <= N:
                activation_tile(DY, X, DX, dy, x, bx * block, False)
            else:
                activation_tile(DY, X, DX, dy, x, bx * block, True)

    return activation_bwd


def forward_entry(dtype: torch.dtype, act: int) -> Entry:
    name = TL_DTYPE[dtype]
    return (f"{ACTIVATIONS[act]}_fwd", name), lambda info: forward_kernel(name, act)


def backward_entry(dtype: torch.dtype, act: int) -> Entry:
    name = TL_DTYPE[dtype]
    return (f"{ACTIVATIONS[act]}_bwd", name), lambda info: backward_kernel(name, act)


def kernel_entries(dtype: torch.dtype, act: int) -> list[Entry]:
    return [forward_entry(dtype, act), backward_entry(dtype, act)]


def _forward(x: torch.Tensor, act: int) -> torch.Tensor:
    y = buffers.empty_like(x)
    launcher(forward_entry(x.dtype, act), x.device)(flat(x), y.view(-1))
    return y


def _backward(dy: torch.Tensor, x: torch.Tensor, act: int) -> torch.Tensor:
    dx = buffers.empty_like(x)
    launcher(backward_entry(x.dtype, act), x.device)(flat(dy), flat(x), dx.view(-1))
    return dx


def gelu_forward(x: torch.Tensor, tanh: bool) -> torch.Tensor:
    return _forward(x, GELU_TANH if tanh else GELU)


def gelu_backward(dy: torch.Tensor, x: torch.Tensor, tanh: bool, y):
    """y is not read (None in eager calls)."""
    return _backward(dy, x, GELU_TANH if tanh else GELU), None


def silu_forward(x: torch.Tensor) -> torch.Tensor:
    return _forward(x, SILU)


def silu_backward(dy: torch.Tensor, x: torch.Tensor, y):
    """y is not read (None in eager calls)."""
    return (_backward(dy, x, SILU),)


GELU_KERNELS = KernelBackend(forward=gelu_forward, backward=gelu_backward, backward_reads="arguments")
SILU_KERNELS = KernelBackend(forward=silu_forward, backward=silu_backward, backward_reads="arguments")
