"""linear in Triton: y = act(x @ w^T + b), one tensor-core GEMM whose epilogue adds the bias and applies the activation.

Forward: each program computes a block_m x block_n tile of the output over K in block_k steps (tl.dot, fp32
accumulation), programs ordered in GROUP_M-row groups so that neighbouring programs share x and w tiles in L2. For
swiglu a program holds two accumulators, weight rows j (gate) and F + j (up), and writes silu(gate) * up. Plain pointer
loads: block pointers and TMA descriptors are not used so that the same kernel runs under the interpreter; on
Hopper the persistent TMA kernel of triton_persistent.py takes over where it runs and pays (_launch_forward).

What the forward writes for backward, in the input dtype (bf16/fp16), as eager torch keeps F.linear's output: for
K > launch.RECOMPUTE_MAX_K the pre-activation z = x @ w^T + b for gelu, gelu_tanh and silu (their derivatives need
it), the gate and up pre-activations [M, 2F] for swiglu (the same column order as the weight's rows, so the
backward's d_preact multiplies the weight as it is); for smaller K no z (launch.recomputes_preact: the GEMM
recomputing it costs less than writing and reading it back); nothing for relu (y > 0 exactly where z > 0: the output
serves) or no activation.

Backward: d_preact comes from one elementwise pass over dy and the saved pre-activation (or y for relu), or, where
the forward saved no z, from a kernel that recomputes z with the forward's GEMM (_preact_tile, the same grouped
tiles) and forms d_preact in its epilogue. Either adds d_preact's columns into partial sums of dbias in the same
kernel (one partial row per row group or row tile, added up by torch: a fixed order); then dx = d_preact @ w and
dw = d_preact^T @ x run as cuBLAS GEMMs (torch.matmul): the saving over eager torch is in the fused epilogues, not
in the two backward GEMMs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import buffers
from ..backends import sm_count
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from . import triton_persistent
from .launch import (
    BACKWARD,
    BackwardLaunch,
    GemmConfig,
    as_rows,
    backward_config,
    forward_config,
    persistent_pays,
    recompute_config,
    recomputes_preact,
)
from .reference import SAVES_PREACT
from .triton_activations import ACTIVATION_CODES, SWIGLU, _activate, _preact_gradient, _preact_gradient_tile


@triton.jit
def _grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program's output tile: programs ordered in GROUP_M-row groups, so that neighbouring
    programs share x and w tiles in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _preact_tile(
    x_ptr, w_ptr, b_ptr, rows, cols, M, N, K,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """(z, z_up): the fp32 pre-activation x[rows] @ w[cols]^T + b[cols] of a [BLOCK_M, BLOCK_N] tile, over K in
    BLOCK_K steps; z_up: swiglu's up rows (N + cols), zeros for the other activations. Rows and columns past the
    ends load a valid row again (wrapped): the caller masks its stores."""
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * K + ks[None, :]
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[None, :] * K + ks[:, None]  # a [BLOCK_K, BLOCK_N] tile of w^T
    up_offset = N.to(tl.int64) * K  # swiglu: the up rows start N rows further
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            in_k = ks < K - k0
            a = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        if ACT == SWIGLU:
            if EVEN_K:
                b_up = tl.load(w_ptrs + up_offset)
            else:
                b_up = tl.load(w_ptrs + up_offset, mask=in_k[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        in_n = cols < N
        acc += tl.load(b_ptr + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
        if ACT == SWIGLU:
            acc_up += tl.load(b_ptr + N + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
    return acc, acc_up


@direct_launch
@triton.jit
def _linear_forward(
    x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SAVE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """y[M, N] (N = F for swiglu, whose weight has 2N rows); z: the pre-activation [M, N] ([M, 2N] for swiglu)."""
    pid_m, pid_n = _grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc, acc_up = _preact_tile(
        x_ptr, w_ptr, b_ptr, rows, cols, M, N, K, HAS_BIAS, ACT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K
    )
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    row_offsets = rows.to(tl.int64)[:, None]
    if ACT == SWIGLU:
        if SAVE:
            z_ptrs = z_ptr + row_offsets * (2 * N) + cols[None, :]
            tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
            tl.store(z_ptrs + N, acc_up.to(z_ptr.dtype.element_ty), mask=mask)
        out = acc * tl.sigmoid(acc) * acc_up
    else:
        if SAVE:
            tl.store(z_ptr + row_offsets * N + cols[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
        out = _activate(acc, ACT)
    tl.store(y_ptr + row_offsets * N + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@direct_launch
@triton.jit
def _linear_backward_recompute(
    x_ptr, w_ptr, b_ptr, dy_ptr, dz_ptr, partial_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """dz = dy * act'(z) with z recomputed tile by tile by the forward's GEMM (the forward saved none); the tile's
    column sums of dz into partial[pid_m, :] (each element written by one program: a fixed order of sums). N: the columns of dy
    (F for swiglu, whose dz has 2N: the gate gradient, then the up one). Rows past M (x's rows wrapped, dy's loaded
    as zeros) add zeros."""
    pid_m, pid_n = _grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    z, z_up = _preact_tile(x_ptr, w_ptr, b_ptr, rows, cols, M, N, K, HAS_BIAS, ACT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    in_n = cols < N
    mask = (rows < M)[:, None] & in_n[None, :]
    row_offsets = rows.to(tl.int64)[:, None]
    dy = tl.load(dy_ptr + row_offsets * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dz, du = _preact_gradient(dy, z, z_up, ACT)
    width = 2 * N if ACT == SWIGLU else N
    dz_ptrs = dz_ptr + row_offsets * width + cols[None, :]
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
    if ACT == SWIGLU:
        tl.store(dz_ptrs + N, du.to(dz_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(partial_ptr + pid_m * width + cols, tl.sum(dz, axis=0), mask=in_n)
        if ACT == SWIGLU:
            tl.store(partial_ptr + pid_m * width + N + cols, tl.sum(du, axis=0), mask=in_n)


@direct_launch
@triton.jit
def _linear_backward_act(
    dy_ptr, z_ptr, y_ptr, dz_ptr, partial_ptr, M, N, STEPS,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dz = dy * act'(z) over STEPS row tiles of BLOCK_M rows, column sums of dz into partial[program row, :].
    N: the columns of dy (F for swiglu, whose z and dz have 2N). The sums accumulate tile by tile in a [BLOCK_M,
    BLOCK_N] fp32 block and fold over rows once at the end: a fold per tile put a cross-warp reduction (shared
    memory and barriers) between every tile's loads and the next's."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    col_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    col_sum_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(STEPS):
        rows = (pid_m * STEPS + step) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & in_n[None, :]
        row_offsets = rows.to(tl.int64)[:, None]
        dz, du = _preact_gradient_tile(dy_ptr, z_ptr, y_ptr, row_offsets, cols, mask, N, ACT)
        dz_ptrs = dz_ptr + row_offsets * (2 * N if ACT == SWIGLU else N) + cols[None, :]
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            col_sum += dz
        if ACT == SWIGLU:
            tl.store(dz_ptrs + N, du.to(dz_ptr.dtype.element_ty), mask=mask)
            if HAS_BIAS:
                col_sum_up += du
    if HAS_BIAS:
        width = 2 * N if ACT == SWIGLU else N
        tl.store(partial_ptr + pid_m * width + cols, tl.sum(col_sum, axis=0), mask=in_n)
        if ACT == SWIGLU:
            tl.store(partial_ptr + pid_m * width + N + cols, tl.sum(col_sum_up, axis=0), mask=in_n)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _launch_forward(x, weight, bias, activation, save: bool, cfg: GemmConfig | None = None, persistent=None):
    """persistent: None picks the Hopper persistent TMA kernel where it runs (triton_persistent.hopper_ready) and pays
    (launch.persistent_pays); True/False force it on (tests: the interpreter runs it too) or off. cfg: the variant's
    tiles, its table's by default."""
    x, weight = _contiguous(x), _contiguous(weight)
    *lead, k = x.shape
    m = math.prod(lead)
    swiglu = activation == "swiglu"
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = buffers.empty((*lead, n), dtype=x.dtype, device=x.device)
    saved = save and activation in SAVES_PREACT
    z = buffers.empty((*lead, weight.shape[0]) if saved else (0,), dtype=x.dtype, device=x.device)
    if persistent is None:
        persistent = triton_persistent.hopper_ready(x, weight) and persistent_pays(m, n, k, swiglu, sm_count(x.device))
    if persistent:
        triton_persistent.launch(x, weight, bias if bias is None else _contiguous(bias), y, z, activation, saved, cfg)
        return y, z
    cfg = cfg or forward_config(m, n, k, swiglu)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _linear_forward[grid](
        x, weight, x if bias is None else _contiguous(bias), y, z, m, n, k,
        HAS_BIAS=bias is not None, ACT=ACTIVATION_CODES[activation], SAVE=saved, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y, z


def forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    recompute: bool | None = None, **variant,
):  # fmt: skip
    """x [..., K] (M rows), weight [N, K] (swiglu: [2F, K]), bias [N] or None -> (y [..., N or F], z: what backward
    reads). recompute: save no z, backward recomputes it (None: launch.recomputes_preact's rule; True/False force
    either path). variant: cfg and persistent, as _launch_forward takes them."""
    if recompute is None:
        recompute = recomputes_preact(x.shape[-1], activation)
    return _launch_forward(x, weight, bias, activation, save=not recompute, **variant)


def infer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, **variant):
    return _launch_forward(x, weight, bias, activation, save=False, **variant)[0]


def preact_gradient(
    dy: torch.Tensor, z: torch.Tensor, y: torch.Tensor, activation: str | None, with_bias: bool,
    launch: BackwardLaunch = BACKWARD,
):  # fmt: skip
    """(d_preact [M, weight rows], dbias [weight rows] fp32 or None) from the output gradient."""
    if activation is None:
        return dy, dy.sum(0, dtype=torch.float32) if with_bias else None
    m, n = dy.shape
    width = 2 * n if activation == "swiglu" else n
    cfg = backward_config(m, n, launch)
    groups = cdiv(m, cfg.block_m * cfg.steps)
    dz = buffers.empty((m, width), dtype=dy.dtype, device=dy.device)
    partial = buffers.empty((groups, width), dtype=torch.float32, device=dy.device) if with_bias else dz
    _linear_backward_act[(groups, cdiv(n, cfg.block_n))](
        dy, z if activation != "relu" else dy, y if activation == "relu" else dy, dz, partial, m, n, cfg.steps,
        HAS_BIAS=with_bias, ACT=ACTIVATION_CODES[activation], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return dz, partial.sum(0) if with_bias else None


def recomputed_preact_gradient(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias, activation: str):
    """preact_gradient's results where the forward saved no z: one kernel recomputes it from x, weight and bias (the
    forward's GEMM) and forms d_preact and the dbias partials (a [row tiles, weight rows] fp32 sum left) in its
    epilogue. dy, x: [M, F or N] and [M, K] rows, contiguous."""
    m, n = dy.shape
    k = x.shape[1]
    width = weight.shape[0]
    cfg = recompute_config(m, n, k, activation == "swiglu")
    num_m = cdiv(m, cfg.block_m)
    dz = buffers.empty((m, width), dtype=dy.dtype, device=dy.device)
    with_bias = bias is not None
    partial = buffers.empty((num_m, width), dtype=torch.float32, device=dy.device) if with_bias else dz
    _linear_backward_recompute[(num_m * cdiv(n, cfg.block_n),)](
        x, weight, _contiguous(bias) if with_bias else x, dy, dz, partial, m, n, k,
        HAS_BIAS=with_bias, ACT=ACTIVATION_CODES[activation], EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return dz, partial.sum(0) if with_bias else None


def backward(dy, x, weight, bias, activation, y, z, launch: BackwardLaunch = BACKWARD):
    """(dx, dweight, dbias, None): d_preact from one elementwise pass over the saved z, or from the kernel that
    recomputes z where the forward saved none (the rule, or forward's recompute=), then the two backward GEMMs by
    cuBLAS."""
    dy, x, weight = _contiguous(dy), _contiguous(x), _contiguous(weight)
    shape = x.shape
    dy, x = as_rows(dy), as_rows(x)
    if activation in SAVES_PREACT and not z.numel() and dy.numel():
        dz, dbias = recomputed_preact_gradient(dy, x, weight, bias, activation)
    else:
        dz, dbias = preact_gradient(dy, z, y, activation, bias is not None, launch)
    dx = torch.matmul(dz, weight)
    dweight = torch.matmul(dz.t(), x)
    return dx if len(shape) == 2 else dx.view(shape), dweight, None if dbias is None else dbias.to(bias.dtype), None


KERNELS = KernelBackend(forward=forward, backward=backward, infer=infer)
