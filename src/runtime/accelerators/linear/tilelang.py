"""linear in TileLang: y = act(x @ w^T + b), one wgmma GEMM (T.gemm on Hopper) with the bias and activation applied to
the accumulator fragment, then the backward's elementwise pass; the two backward GEMMs run on cuBLAS (torch.matmul).

Forward: each block computes a block_m x block_n output tile, pipelining x and w tiles over K into shared memory
(T.Pipelined, T.copy); the epilogue adds the bias and applies the activation on the fp32 accumulator (T.Parallel) and
writes through shared memory. The activations, here and in the backward pass, are the Triton kernels' (PRELUDE).
For swiglu a block holds two accumulators, weight rows j (gate) and F + j (up), in two fragments (two T.gemm into
one fragment can break under Hopper warp specialisation). The row count M is dynamic; the
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
from . import constants as C
from .launch import ROW_GROUPS, as_rows
from .reference import SAVES_PREACT


def _f(value: float) -> str:
    return f"{value!r}f"


# The reciprocal and exp2 from one MUFU op each (rcp.approx.ftz, ex2.approx.ftz: about 1 and 2 ulp, denormals
# flushed), where an IEEE division and expf add range checks and a slow-path call: the GEMM epilogue is ALU-bound
# (docs/tuning/linear.md). gelu's erf comes from Abramowitz and Stegun's rational erfc (constants.py: one reciprocal,
# the exp the derivative needs anyway), and for z < 0 it forms 1 + erf(z) = erfc(-z) directly, without the
# cancellation of 1 + erf. Compiled for the CPU (tools/tilelang_on_cpu.py) the helpers take 1 / x and exp2f.
PRELUDE = f"""
__device__ __forceinline__ float taac_rcp(float x) {{
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return 1.0f / x;
#endif
}}
__device__ __forceinline__ float taac_ex2(float x) {{
#ifdef __CUDA_ARCH__
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return exp2f(x);
#endif
}}
__device__ __forceinline__ float taac_sigmoid(float x) {{ return taac_rcp(1.0f + taac_ex2(x * {_f(-C.LOG2E)})); }}
// 1 + erf(z / sqrt 2), and exp(-z^2 / 2) in *gauss
__device__ __forceinline__ float taac_gelu_parts(float z, float* gauss) {{
  float u = fabsf(z) * {_f(C.SQRT_HALF)};
  float t = taac_rcp(1.0f + {_f(C.ERFC_P)} * u);
  *gauss = taac_ex2(u * u * {_f(-C.LOG2E)});
  float erfc = t * ({_f(C.ERFC_A1)} + t * ({_f(C.ERFC_A2)} + t * ({_f(C.ERFC_A3)} + t * ({_f(C.ERFC_A4)}
               + t * {_f(C.ERFC_A5)})))) * *gauss;
  return z >= 0.0f ? 2.0f - erfc : erfc;
}}
__device__ __forceinline__ float taac_gelu(float z) {{
  float gauss;
  return 0.5f * z * taac_gelu_parts(z, &gauss);
}}
__device__ __forceinline__ float taac_dgelu(float z) {{
  float gauss;
  float one_plus_erf = taac_gelu_parts(z, &gauss);
  return 0.5f * one_plus_erf + z * {_f(C.INV_SQRT_2PI)} * gauss;
}}
"""


def _sigmoid(x):
    return T.call_pure_extern(ACCUM, "taac_sigmoid", x)


def _pow2_at_least(n: int, low: int) -> int:
    return max(low, 1 << max(0, (n - 1).bit_length()))


def forward_tiles(n: int, k: int, swiglu: bool, blocks_per_sm: int = 1) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, threads, stages) from the static sizes (M is dynamic); blocks_per_sm 2 keeps the
    tiles at 128 x 128 (3 stages: 96 KiB of shared memory) so that two blocks fit an SM."""
    block_k = min(64, _pow2_at_least(k, 16))
    stages = 3 if k > 2 * block_k else 2
    if swiglu:  # two 128 x 64 accumulators; block_n divides F, so the gate tile's store never reaches the up columns
        block_n = next(b for b in (64, 32, 16, 8) if n % b == 0)
        return 128, block_n, block_k, 256 if block_n >= 32 else 128, stages
    if n >= 256 and k >= 256 and blocks_per_sm == 1:
        return 128, 256, block_k, 256, stages
    return 128, min(128, _pow2_at_least(n, 16)), block_k, 256 if n >= 128 else 128, stages


def consumer_registers(threads: int, blocks_per_sm: int) -> int:
    """The registers a thread of the GEMM's consumer warpgroups may raise itself to (setmaxnreg) when blocks_per_sm
    blocks share an SM: a block starts with its share of the 64K registers (in steps of 8 a thread) for its threads and
    TileLang's producer warpgroup (128 threads), and the consumers can take only what the producer, cut to 24, gives
    back; asking for more would stall."""
    launched = 65536 // (blocks_per_sm * (threads + 128)) // 8 * 8
    return min(240, (launched * (threads + 128) - 24 * 128) // threads // 8 * 8)


def _activate(z, activation: str | None):
    if activation == "relu":
        return T.max(z, 0.0)
    if activation == "gelu":
        return T.call_pure_extern(ACCUM, "taac_gelu", z)
    if activation == "gelu_tanh":  # 0.5 z (1 + tanh(u)) = z sigmoid(2u)
        return z * _sigmoid((z + C.TANH_A * z * z * z) * (2.0 * C.TANH_C))
    if activation == "silu":
        return z * _sigmoid(z)
    return z


def _derivative(z, activation: str):
    if activation == "gelu":
        return T.call_pure_extern(ACCUM, "taac_dgelu", z)
    if activation == "gelu_tanh":
        s = _sigmoid((z + C.TANH_A * z * z * z) * (2.0 * C.TANH_C))
        return s + z * s * (1.0 - s) * (2.0 * C.TANH_C) * (1.0 + 3.0 * C.TANH_A * z * z)
    s = _sigmoid(z)  # silu
    return s * (1.0 + z * (1.0 - s))


# --------------------------------------------------------------------------- kernels


def forward_kernel(
    dtype: str, n: int, k: int, activation: str | None, has_bias: bool, save: bool, blocks_per_sm: int = 1
):
    """Y [M, n] (n = F for swiglu, whose W has 2n rows); Z [M, weight rows] when saved, else a 1-element placeholder.
    blocks_per_sm 2: tiles, launch bounds and register split for two blocks an SM, so that one block's epilogue can
    run beside the other's main loop."""
    M = T.dynamic("M")
    swiglu = activation == "swiglu"
    rows = 2 * n if swiglu else n
    bm, bn, bk, threads, stages = forward_tiles(n, k, swiglu, blocks_per_sm)
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
        with T.Kernel(T.ceildiv(M, bm), T.ceildiv(n, bn), threads=threads, prelude=PRELUDE) as (by, bx):
            if blocks_per_sm > 1:
                T.annotate_min_blocks_per_sm(blocks_per_sm)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(consumer_registers(threads, blocks_per_sm))
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
                    Y_s[i, j] = T.cast(acc[i, j] * _sigmoid(acc[i, j]) * acc_up[i, j], dtype)
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
        with T.Kernel(T.ceildiv(n, bn), G, threads=threads, prelude=PRELUDE) as (bx, by):
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
                        s = _sigmoid(g)
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


def default_blocks_per_sm(k: int) -> int:
    """Two blocks an SM up to K = 512 (on the H200 at M = 131072 gelu: 1.16-1.38x the one-block launch at K = 64-512,
    swiglu 1.45x at K = 256), one above (K = 4096: 0.85x); docs/tuning/linear.md."""
    return 2 if k <= 512 else 1


def forward_entry(
    dtype: torch.dtype,
    n: int,
    k: int,
    activation: str | None,
    has_bias: bool,
    save: bool,
    blocks_per_sm: int | None = None,
) -> Entry:
    """blocks_per_sm: 1 or 2 (forward_kernel); None: default_blocks_per_sm(k)."""
    blocks_per_sm = default_blocks_per_sm(k) if blocks_per_sm is None else blocks_per_sm
    name = TL_DTYPE[dtype]
    save = save and activation in SAVES_PREACT
    key = ("linear_fwd", name, n, k, activation, has_bias, save, blocks_per_sm)
    return key, lambda info: forward_kernel(name, n, k, activation, has_bias, save, blocks_per_sm)


def backward_entry(dtype: torch.dtype, n: int, activation: str, has_bias: bool) -> Entry:
    name = TL_DTYPE[dtype]
    return ("linear_bwd", name, n, activation, has_bias), lambda info: backward_kernel(name, n, activation, has_bias)


def kernel_entries(dtype, n, k, activation, has_bias, save, blocks_per_sm=None) -> list[Entry]:
    """The forward (saving the pre-activation for backward or not; arguments as forward_entry's) and the backward's
    elementwise pass."""
    entries = [forward_entry(dtype, n, k, activation, has_bias, save, blocks_per_sm)]
    return entries + ([backward_entry(dtype, n, activation, has_bias)] if activation is not None else [])


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t if t.is_contiguous() else t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _launch_forward(x, weight, bias, activation, save: bool, blocks_per_sm: int | None):
    x, weight = _contiguous(x), _contiguous(weight)
    *lead, k = x.shape
    n = weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]
    saved = save and activation in SAVES_PREACT
    y = buffers.empty((*lead, n), dtype=x.dtype, device=x.device)
    z = buffers.empty((*lead, weight.shape[0]) if saved else (0,), dtype=x.dtype, device=x.device)
    entry = forward_entry(x.dtype, n, k, activation, bias is not None, save, blocks_per_sm)
    kernel = launcher(entry, x.device)
    b = placeholder(x.device, x.dtype) if bias is None else _contiguous(bias)
    kernel(as_rows(x), weight, b, as_rows(y), as_rows(z) if saved else placeholder(x.device, x.dtype))
    return y, z


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    blocks_per_sm: int | None = None,
):
    """x [..., K], weight [N, K] (swiglu: [2F, K]), bias or None -> (y [..., N or F], z: what backward reads).
    blocks_per_sm: 1, or 2 for the launch that shares an SM between two blocks (forward_kernel); None: by K
    (default_blocks_per_sm)."""
    return _launch_forward(x, weight, bias, activation, True, blocks_per_sm)


def infer(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    blocks_per_sm: int | None = None,
):
    return _launch_forward(x, weight, bias, activation, False, blocks_per_sm)[0]


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
