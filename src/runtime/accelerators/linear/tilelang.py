"""linear in TileLang: y = act(x @ w^T + b), one wgmma GEMM (T.gemm on Hopper) with the bias and activation applied to
the accumulator fragment, then the backward's elementwise pass; the two backward GEMMs run on cuBLAS (torch.matmul).

Forward: each block computes a block_m x block_n output tile, pipelining x and w tiles over K into shared memory
(T.Pipelined, T.copy); the epilogue adds the bias and applies the activation on the fp32 accumulator (T.Parallel) and
writes through shared memory. For swiglu a block holds two accumulators, weight rows j (gate) and F + j (up), in two
fragments (two T.gemm into one fragment can break under Hopper warp specialisation). The row count M is dynamic; the
compile cache is keyed by (dtype, N, K, activation, bias, whether the pre-activation is saved).

What is saved for backward is what the Triton module saves (see its docstring): the pre-activation in the input dtype
for gelu, gelu_tanh and silu, the gate and up pre-activations [M, 2F] for swiglu, nothing for relu (y > 0 where z > 0)
or no activation.

Backward: one elementwise kernel makes d_preact from dy and the saved pre-activation (or y) and the column sums of
each group of rows (the dbias partials, [groups, N] fp32, added up by torch); dx = d_preact @ w and dw = d_preact^T @ x
by cuBLAS.
"""

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher, placeholder
from .launch import ROW_GROUPS, as_rows
from .reference import SAVES_PREACT

SQRT_HALF = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
TANH_C = 0.7978845608028654  # sqrt(2 / pi)
TANH_A = 0.044715


def _pow2_at_least(n: int, low: int) -> int:
    return max(low, 1 << max(0, (n - 1).bit_length()))


def forward_tiles(n: int, k: int, swiglu: bool) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, threads, stages) from the static sizes (M is dynamic)."""
    block_k = min(64, _pow2_at_least(k, 16))
    stages = 3 if k > 2 * block_k else 2
    if swiglu:  # two 128 x 64 accumulators; block_n divides F, so the gate tile's store never reaches the up columns
        block_n = next(b for b in (64, 32, 16, 8) if n % b == 0)
        return 128, block_n, block_k, 256 if block_n >= 32 else 128, stages
    if n >= 256 and k >= 256:
        return 128, 256, block_k, 256, stages
    return 128, min(128, _pow2_at_least(n, 16)), block_k, 256 if n >= 128 else 128, stages


def _activate(z, activation: str | None):
    if activation == "relu":
        return T.max(z, 0.0)
    if activation == "gelu":
        return 0.5 * z * (1.0 + T.erf(z * SQRT_HALF))
    if activation == "gelu_tanh":  # 0.5 z (1 + tanh(u)) = z sigmoid(2u)
        return z / (1.0 + T.exp(-2.0 * TANH_C * (z + TANH_A * z * z * z)))
    if activation == "silu":
        return z / (1.0 + T.exp(-z))
    return z


def _derivative(z, activation: str):
    if activation == "gelu":
        return 0.5 * (1.0 + T.erf(z * SQRT_HALF)) + z * INV_SQRT_2PI * T.exp(-0.5 * z * z)
    if activation == "gelu_tanh":
        s = 1.0 / (1.0 + T.exp(-2.0 * TANH_C * (z + TANH_A * z * z * z)))
        return s + z * s * (1.0 - s) * (2.0 * TANH_C) * (1.0 + 3.0 * TANH_A * z * z)
    s = 1.0 / (1.0 + T.exp(-z))  # silu
    return s * (1.0 + z * (1.0 - s))


# --------------------------------------------------------------------------- kernels


def forward_kernel(dtype: str, n: int, k: int, activation: str | None, has_bias: bool, save: bool):
    """Y [M, n] (n = F for swiglu, whose W has 2n rows); Z [M, weight rows] when saved, else a 1-element placeholder."""
    M = T.dynamic("M")
    swiglu = activation == "swiglu"
    rows = 2 * n if swiglu else n
    bm, bn, bk, threads, stages = forward_tiles(n, k, swiglu)
    z_shape = (M, rows) if save else (1,)

    @T.prim_func
    def linear_fwd(
        X: T.Tensor((M, k), dtype),
        W: T.Tensor((rows, k), dtype),
        Bias: T.Tensor((rows,) if has_bias else (1,), dtype),
        Y: T.Tensor((M, n), dtype),
        Z: T.Tensor(z_shape, dtype),
    ):
        # row blocks on x (gridDim.y caps at 65535 blocks: 8.4M rows); the column swizzle on this grid visits the
        # tiles in the order the row swizzle did on the (column blocks, row blocks) grid
        with T.Kernel(T.ceildiv(M, bm), T.ceildiv(n, bn), threads=threads) as (by, bx):
            X_s = T.alloc_shared((bm, bk), dtype)
            W_s = T.alloc_shared((bn, bk), dtype)
            W_up_s = T.alloc_shared((bn, bk) if swiglu else (1,), dtype)
            acc = T.alloc_fragment((bm, bn), ACCUM)
            acc_up = T.alloc_fragment((bm, bn) if swiglu else (1,), ACCUM)
            Y_s = T.alloc_shared((bm, bn), dtype)
            T.use_swizzle(panel_size=8, order="column")
            T.clear(acc)
            if swiglu:
                T.clear(acc_up)
            for kk in T.Pipelined(T.ceildiv(k, bk), num_stages=stages):
                T.copy(X[by * bm, kk * bk], X_s)
                T.copy(W[bx * bn, kk * bk], W_s)
                T.gemm(X_s, W_s, acc, transpose_B=True)
                if swiglu:
                    T.copy(W[n + bx * bn, kk * bk], W_up_s)
                    T.gemm(X_s, W_up_s, acc_up, transpose_B=True)
            if has_bias:
                for i, j in T.Parallel(bm, bn):
                    acc[i, j] += T.if_then_else(bx * bn + j < n, T.cast(Bias[bx * bn + j], ACCUM), 0.0)
                if swiglu:
                    for i, j in T.Parallel(bm, bn):
                        acc_up[i, j] += T.if_then_else(bx * bn + j < n, T.cast(Bias[n + bx * bn + j], ACCUM), 0.0)
            if save:
                T.copy(acc, Y_s)
                T.copy(Y_s, Z[by * bm, bx * bn])
                if swiglu:
                    T.copy(acc_up, Y_s)
                    T.copy(Y_s, Z[by * bm, n + bx * bn])
            for i, j in T.Parallel(bm, bn):
                if swiglu:
                    Y_s[i, j] = T.cast(acc[i, j] / (1.0 + T.exp(-acc[i, j])) * acc_up[i, j], dtype)
                else:
                    Y_s[i, j] = T.cast(_activate(acc[i, j], activation), dtype)
            T.copy(Y_s, Y[by * bm, bx * bn])

    return linear_fwd


def backward_tiles(n: int) -> tuple[int, int, int]:
    """(block_m, block_n, threads) of the elementwise backward."""
    bn = min(128, _pow2_at_least(n, 16))
    return (32 if bn >= 128 else 64), bn, 128


def _row_tile_layout(bm: int, bn: int, threads: int) -> T.Fragment:
    """A [bm, bn] fp32 tile with 8 consecutive columns a thread (16-byte loads of 2-byte inputs), the tile's rows
    dealt to the thread groups in turn. Given explicitly: the dbias reducer alone would give each thread whole
    columns, and 2-byte loads."""
    vec = 8
    groups_per_row = bn // vec
    rows_a_pass = threads // groups_per_row
    return T.Fragment(
        (bm, bn),
        forward_thread_fn=lambda i, j: (i % rows_a_pass) * groups_per_row + j // vec,
        forward_index_fn=lambda i, j: (i // rows_a_pass) * vec + j % vec,
    )


def backward_kernel(dtype: str, n: int, activation: str, has_bias: bool):
    """DZ [M, width] = DY [M, n] * act'(Z) (relu: from Y); Partial [G, width] fp32: the column sums of DZ over the
    rows of each of G row groups. width = 2n for swiglu (gate columns, then up), else n."""
    M, G = T.dynamic("M, G")
    swiglu = activation == "swiglu"
    width = 2 * n if swiglu else n
    bm, bn, threads = backward_tiles(n)
    z_shape = (1,) if activation == "relu" else (M, width)
    y_shape = (M, n) if activation == "relu" else (1,)

    @T.prim_func
    def linear_bwd(
        DY: T.Tensor((M, n), dtype),
        Z: T.Tensor(z_shape, dtype),
        Y: T.Tensor(y_shape, dtype),
        DZ: T.Tensor((M, width), dtype),
        Partial: T.Tensor((G, width) if has_bias else (G,), ACCUM),  # without a bias: unread, it gives G
    ):
        with T.Kernel(T.ceildiv(n, bn), G, threads=threads) as (bx, by):
            dz = T.alloc_fragment((bm, bn), ACCUM)
            du = T.alloc_fragment((bm, bn) if swiglu else (1,), ACCUM)
            tile_layout = _row_tile_layout(bm, bn, threads)
            T.annotate_layout({dz: tile_layout, **({du: tile_layout} if swiglu else {})})
            # the dbias sums are reducers: each thread adds its elements over the whole row walk and the threads
            # combine once at the end (a reduction per row tile put shared memory and barriers between tiles)
            if has_bias:
                acc = T.alloc_reducer((bn,), ACCUM, op="sum")
                T.reducer_init(acc)
                total = T.alloc_fragment((bn,), ACCUM)
            if has_bias and swiglu:
                acc_up = T.alloc_reducer((bn,), ACCUM, op="sum")
                T.reducer_init(acc_up)
            # bound once: as an expression TileLang would recompute its division by G, in int64, at every use
            steps = T.alloc_var("int32", init=T.ceildiv(T.ceildiv(M, bm), G))
            for step in T.serial(steps):
                r0 = (by * steps + step) * bm
                for i, j in T.Parallel(bm, bn):
                    inside = (r0 + i < M) and (bx * bn + j < n)
                    dy = T.if_then_else(inside, T.cast(DY[r0 + i, bx * bn + j], ACCUM), 0.0)
                    if swiglu:
                        g = T.if_then_else(inside, T.cast(Z[r0 + i, bx * bn + j], ACCUM), 0.0)
                        u = T.if_then_else(inside, T.cast(Z[r0 + i, n + bx * bn + j], ACCUM), 0.0)
                        s = 1.0 / (1.0 + T.exp(-g))
                        dz[i, j] = dy * u * s * (1.0 + g * (1.0 - s))
                        du[i, j] = dy * g * s
                    elif activation == "relu":
                        y = T.if_then_else(inside, T.cast(Y[r0 + i, bx * bn + j], ACCUM), 0.0)
                        dz[i, j] = T.if_then_else(y > 0.0, dy, 0.0)
                    else:
                        z = T.if_then_else(inside, T.cast(Z[r0 + i, bx * bn + j], ACCUM), 0.0)
                        dz[i, j] = dy * _derivative(z, activation)
                if has_bias:  # a loop of its own: an update beside the loads keeps them from vectorizing
                    for i, j in T.Parallel(bm, bn):
                        T.reducer_update(acc[j], dz[i, j])
                        if swiglu:
                            T.reducer_update(acc_up[j], du[i, j])
                for i, j in T.Parallel(bm, bn):
                    if (r0 + i < M) and (bx * bn + j < n):
                        DZ[r0 + i, bx * bn + j] = T.cast(dz[i, j], dtype)
                        if swiglu:
                            DZ[r0 + i, n + bx * bn + j] = T.cast(du[i, j], dtype)
            if has_bias:
                T.finalize_reducer(acc, total)
                for j in T.Parallel(bn):
                    if bx * bn + j < n:
                        Partial[by, bx * bn + j] = total[j]
                if swiglu:
                    T.finalize_reducer(acc_up, total)
                    for j in T.Parallel(bn):
                        if bx * bn + j < n:
                            Partial[by, n + bx * bn + j] = total[j]

    return linear_bwd


# --------------------------------------------------------------------------- entries and launchers


def forward_entry(dtype: torch.dtype, n: int, k: int, activation: str | None, has_bias: bool, save: bool) -> Entry:
    name = TL_DTYPE[dtype]
    save = save and activation in SAVES_PREACT
    key = ("linear_fwd", name, n, k, activation, has_bias, save)
    return key, lambda info: forward_kernel(name, n, k, activation, has_bias, save)


def backward_entry(dtype: torch.dtype, n: int, activation: str, has_bias: bool) -> Entry:
    name = TL_DTYPE[dtype]
    return ("linear_bwd", name, n, activation, has_bias), lambda info: backward_kernel(name, n, activation, has_bias)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t if t.is_contiguous() else t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _launch_forward(x, weight, bias, activation, save: bool):
    x, weight = _contiguous(x), _contiguous(weight)
    *lead, k = x.shape
    n = weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]
    saved = save and activation in SAVES_PREACT
    y = buffers.empty((*lead, n), dtype=x.dtype, device=x.device)
    z = buffers.empty((*lead, weight.shape[0]) if saved else (0,), dtype=x.dtype, device=x.device)
    kernel = launcher(forward_entry(x.dtype, n, k, activation, bias is not None, save), x.device)
    b = placeholder(x.device, x.dtype) if bias is None else _contiguous(bias)
    kernel(as_rows(x), weight, b, as_rows(y), as_rows(z) if saved else placeholder(x.device, x.dtype))
    return y, z


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    """x [..., K], weight [N, K] (swiglu: [2F, K]), bias or None -> (y [..., N or F], z: what backward reads)."""
    return _launch_forward(x, weight, bias, activation, save=True)


def infer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    return _launch_forward(x, weight, bias, activation, save=False)[0]


def preact_gradient(
    dy: torch.Tensor, z: torch.Tensor, y: torch.Tensor, activation: str | None, with_bias: bool, launch=launcher
):
    """(d_preact [M, weight rows], dbias [weight rows] fp32 or None). launch(entry, device): the kernel's entry point
    (tools/tilelang_on_cpu.py passes one that runs the generated code on the CPU)."""
    if activation is None:
        return dy, dy.sum(0, dtype=torch.float32) if with_bias else None
    m, n = dy.shape
    width = 2 * n if activation == "swiglu" else n
    bm, _, _ = backward_tiles(n)
    groups = min(cdiv(m, bm), ROW_GROUPS)
    dz = buffers.empty((m, width), dtype=dy.dtype, device=dy.device)
    partial = buffers.empty((groups, width) if with_bias else (groups,), dtype=torch.float32, device=dy.device)
    other = placeholder(dy.device, dy.dtype)
    kernel = launch(backward_entry(dy.dtype, n, activation, with_bias), dy.device)
    kernel(dy, other if activation == "relu" else z, y if activation == "relu" else other, dz, partial)
    return dz, partial.sum(0) if with_bias else None


def backward(dy, x, weight, bias, activation, y, z):
    """(dx, dweight, dbias, None): d_preact from one elementwise kernel, then the two backward GEMMs by cuBLAS."""
    dy, x, weight = _contiguous(dy), _contiguous(x), _contiguous(weight)
    shape = x.shape
    dy, x = as_rows(dy), as_rows(x)
    dz, dbias = preact_gradient(dy, as_rows(z) if z.numel() else z, as_rows(y), activation, bias is not None)
    dx = torch.matmul(dz, weight)
    dweight = torch.matmul(dz.t(), x)
    return dx if len(shape) == 2 else dx.view(shape), dweight, None if dbias is None else dbias.to(bias.dtype), None


KERNELS = KernelBackend(forward=forward, backward=backward, infer=infer)
