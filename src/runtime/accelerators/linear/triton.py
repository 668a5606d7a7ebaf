"""linear in Triton: y = act(x @ w^T + b), one tensor-core GEMM whose epilogue adds the bias and applies the activation.

Forward: each program computes a block_m x block_n tile of the output over K in block_k steps (tl.dot, fp32
accumulation), programs ordered in GROUP_M-row groups so that neighbouring programs share x and w tiles in L2. For
swiglu a program holds two accumulators, weight rows j (gate) and F + j (up), and writes silu(gate) * up. Plain pointer
loads: block pointers and TMA descriptors are not used so that the same kernel runs under the interpreter; on
Hopper the persistent TMA kernel of triton_persistent.py takes over where it runs and pays (_launch_forward).

What the forward writes for backward, in the input dtype (bf16/fp16), as eager torch keeps F.linear's output: the
pre-activation z = x @ w^T + b for gelu, gelu_tanh and silu (their derivatives need it; recomputing it would cost a
GEMM, writing it one output-sized store), the gate and up pre-activations [M, 2F] for swiglu (the same column order
as the weight's rows, so the backward's d_preact multiplies the weight as it is), and nothing for relu (y > 0 exactly
where z > 0: the output serves) or no activation.

Backward: one elementwise pass makes d_preact from dy and the saved pre-activation (or y for relu) and adds its
columns into per-row-group partial sums of dbias in the same pass (a [groups, N] fp32 sum left); then
dx = d_preact @ w and dw = d_preact^T @ x run as cuBLAS GEMMs (torch.matmul): the saving over eager torch is in the
fused epilogue and the single elementwise pass, not in the two backward GEMMs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import buffers
from ..backends import sm_count, triton_interpret
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
)
from .reference import SAVES_PREACT
from .triton_activations import ACTIVATION_CODES, SWIGLU, _activate, _preact_gradient_tile, _sigmoid


@direct_launch
@triton.jit(do_not_specialize=["M"])
def _linear_forward(
    x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SAVE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """y[M, N] (N = F for swiglu, whose weight has 2N rows); z: the pre-activation [M, N] ([M, 2N] for swiglu)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # rows and columns past the end load a valid row again (wrapped): only the stores are masked
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

    in_n = cols < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
        if ACT == SWIGLU:
            acc_up += tl.load(b_ptr + N + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & in_n[None, :]
    row_offsets = rows.to(tl.int64)[:, None]
    if ACT == SWIGLU:
        if SAVE:
            z_ptrs = z_ptr + row_offsets * (2 * N) + cols[None, :]
            tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
            tl.store(z_ptrs + N, acc_up.to(z_ptr.dtype.element_ty), mask=mask)
        out = acc * _sigmoid(acc, PTX) * acc_up
    else:
        if SAVE:
            tl.store(z_ptr + row_offsets * N + cols[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
        out = _activate(acc, ACT, PTX)
    tl.store(y_ptr + row_offsets * N + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@direct_launch
@triton.jit(do_not_specialize=["M", "STEPS"])
def _linear_backward_act(
    dy_ptr, z_ptr, y_ptr, dz_ptr, partial_ptr, M, N, STEPS,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PTX: tl.constexpr,
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
        dz, du = _preact_gradient_tile(dy_ptr, z_ptr, y_ptr, row_offsets, cols, mask, N, ACT, PTX)
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
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PTX=not triton_interpret(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y, z


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, **variant):
    """x [..., K] (M rows), weight [N, K] (swiglu: [2F, K]), bias [N] or None -> (y [..., N or F], z: what backward
    reads). variant: cfg and persistent, as _launch_forward takes them."""
    return _launch_forward(x, weight, bias, activation, save=True, **variant)


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
        PTX=not triton_interpret(), num_warps=cfg.num_warps,
    )  # fmt: skip
    return dz, partial.sum(0) if with_bias else None


def backward(dy, x, weight, bias, activation, y, z, launch: BackwardLaunch = BACKWARD):
    """(dx, dweight, dbias, None): d_preact from one elementwise pass, then the two backward GEMMs by cuBLAS."""
    dy, x, weight = _contiguous(dy), _contiguous(x), _contiguous(weight)
    shape = x.shape
    dy, x = as_rows(dy), as_rows(x)
    dz, dbias = preact_gradient(dy, z, y, activation, bias is not None, launch)
    dx = torch.matmul(dz, weight)
    dweight = torch.matmul(dz.t(), x)
    return dx if len(shape) == 2 else dx.view(shape), dweight, None if dbias is None else dbias.to(bias.dtype), None


KERNELS = KernelBackend(forward=forward, backward=backward, infer=infer)
