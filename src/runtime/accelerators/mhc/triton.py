"""mHC pre/post in Triton: fp32 math, forward and backward.

Forward and post backward: a block of tokens per program. Pre backward: d H_pre per token block, then the
per-token gates (a thread per token's n x n matrix), then dx and dphi on a (stream, C block) x token-share grid.

Layout: x is viewed as [tokens, n*C] (stream i of token t at x[t, i*C:(i+1)*C]); h, the normalised
projection, is kept per token as [tokens, M] fp32 with M = n*n + 2n (pre | post | res, row-major).
The forward saves h and r = rsqrt(mean(v^2) + eps); the backward recomputes the coefficients from h
and the Sinkhorn iterates from the res logits (O(iters^2) tiny steps instead of stored iterates).
Sinkhorn runs in the log domain (see reference.sinkhorn): finite for any finite logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import buffers
from ..backends import triton_interpret
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv, pow2_at_least
from ..triton_launch import direct_launch
from ..triton_mufu import mufu_log
from .layout import allocate_pre, token_streams

BLOCK_TOKENS = 16
BLOCK_K = 64


@dataclass(frozen=True)
class PreBackwardLaunch:
    """The pre backward's dx kernel: about dx_programs programs in all (the share of tokens per program shrinks until
    the grid is that big; 1024 is about 8 per SM of an H100)."""

    dx_programs: int = 1024


PRE_BACKWARD = PreBackwardLaunch()


@triton.jit
def _gates(h, bias, alpha, rows, row_mask, M, n: tl.constexpr, NP: tl.constexpr):
    """H_pre [BT, NP], the post sigmoid [BT, NP] and the res logits [BT, NP, NP] (-inf off the n x n block)."""
    i = tl.arange(0, NP)
    j = tl.arange(0, NP)
    i_mask = i < n
    mask2 = row_mask[:, None] & i_mask[None, :]
    base = h + rows[:, None] * M
    a0 = tl.load(alpha)
    a1 = tl.load(alpha + 1)
    a2 = tl.load(alpha + 2)
    pre_logit = (
        a0 * tl.load(base + i[None, :], mask=mask2, other=0.0) + tl.load(bias + i, mask=i_mask, other=0.0)[None, :]
    )
    post_logit = (
        a1 * tl.load(base + n + i[None, :], mask=mask2, other=0.0)
        + tl.load(bias + n + i, mask=i_mask, other=0.0)[None, :]
    )
    res_index = 2 * n + i[:, None] * n + j[None, :]
    valid = (i[:, None] < n) & (j[None, :] < n)
    mask3 = row_mask[:, None, None] & valid[None, :, :]
    res_logit = a2 * tl.load(h + rows[:, None, None] * M + res_index[None, :, :], mask=mask3, other=0.0)
    res_logit += tl.load(bias + res_index, mask=valid, other=0.0)[None, :, :]
    res_logit = tl.where(valid[None, :, :], res_logit, float("-inf"))
    return tl.sigmoid(pre_logit), tl.sigmoid(post_logit), res_logit


@triton.jit
def _normalise(logits, AXIS: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, PTX: tl.constexpr):
    """logits [BT, NP, NP] minus their logsumexp along AXIS, and its exp (the softmax): -inf and 0 off the n x n
    block, where a row or column of padding alone gives NaN."""
    i = tl.arange(0, NP)
    valid = ((i[:, None] < n) & (i[None, :] < n))[None, :, :]
    peak = tl.expand_dims(tl.max(logits, AXIS), AXIS)
    scaled = tl.exp(logits - peak)
    total = tl.expand_dims(tl.sum(scaled, AXIS), AXIS)
    # (logits - peak) first: exact for the entries near the peak, the ones that decide the softmax
    normal = tl.where(valid, (logits - peak) - mufu_log(total, PTX), float("-inf"))
    return normal, tl.where(valid, scaled * (1.0 / total), 0.0)


@triton.jit
def _sinkhorn_step(logits, n: tl.constexpr, NP: tl.constexpr, PTX: tl.constexpr):
    """One Sinkhorn iteration in the log domain: rows, then columns, to logsumexp 0."""
    logits, _ = _normalise(logits, 2, n, NP, PTX)
    logits, _ = _normalise(logits, 1, n, NP, PTX)
    return logits


@triton.jit
def _column(values, index, NP: tl.constexpr):
    """values[:, index] of a [BT, NP] tensor (index a runtime scalar)."""
    return tl.sum(tl.where(tl.arange(0, NP)[None, :] == index, values, 0.0), 1)


@direct_launch
@triton.jit
def _pre_forward_kernel(
    x,
    phi,
    alpha,
    bias,
    h_in,
    h_post,
    h_res,
    h,
    r,
    tokens,
    C,
    eps,
    iters,
    n: tl.constexpr,
    NP: tl.constexpr,
    MP: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    PTX: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_mask = rows < tokens
    rows = rows.to(tl.int64)  # token offsets times n*C pass 2^31 at a million tokens
    K = n * C
    M = n * n + 2 * n
    cols = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    squares = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_mask = ks < K
        v = tl.load(x + rows[:, None] * K + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(
            tl.float32
        )
        weights = tl.load(
            phi + ks[:, None] * M + cols[None, :], mask=k_mask[:, None] & (cols < M)[None, :], other=0.0
        ).to(tl.float32)
        squares += tl.sum(v * v, 1)
        acc = tl.dot(v, weights, acc, input_precision=PRECISION)
    rstd = tl.rsqrt(squares / K + eps)
    tl.store(r + rows, rstd, mask=row_mask)
    tl.store(h + rows[:, None] * M + cols[None, :], acc * rstd[:, None], mask=row_mask[:, None] & (cols < M)[None, :])
    tl.debug_barrier()  # the coefficients below read back h written by other threads of this program

    pre, post_sigmoid, logits = _gates(h, bias, alpha, rows, row_mask, M, n, NP)
    for _ in range(iters):
        logits = _sinkhorn_step(logits, n, NP, PTX)
    i = tl.arange(0, NP)
    tl.store(h_post + rows[:, None] * n + i[None, :], 2 * post_sigmoid, mask=row_mask[:, None] & (i < n)[None, :])
    res_index = i[:, None] * n + i[None, :]
    valid = (i[:, None] < n) & (i[None, :] < n)
    tl.store(
        h_res + rows[:, None, None] * (n * n) + res_index[None, :, :],
        tl.exp(logits),
        mask=row_mask[:, None, None] & valid[None, :, :],
    )

    for c0 in range(0, C, BK):
        cs = c0 + tl.arange(0, BK)
        c_mask = cs < C
        out = tl.zeros([BT, BK], dtype=tl.float32)
        for stream in tl.static_range(n):
            xs = tl.load(
                x + rows[:, None] * K + stream * C + cs[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0
            )
            out += _column(pre, stream, NP)[:, None] * xs.to(tl.float32)
        tl.store(
            h_in + rows[:, None] * C + cs[None, :],
            out.to(h_in.dtype.element_ty),
            mask=row_mask[:, None] & c_mask[None, :],
        )


@direct_launch
@triton.jit
def _pre_backward_dpre_kernel(
    x,
    dh_in,
    d_pre,
    tokens,
    C,
    n: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """d H_pre[t, i] = sum_c dh_in[t, c] * x[t, i, c] [tokens, n] fp32: products add up elementwise over the C loop,
    reduced once at the end."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_mask = rows < tokens
    rows = rows.to(tl.int64)  # token offsets times n*C pass 2^31 at a million tokens
    i = tl.arange(0, NP)
    mask2 = row_mask[:, None] & (i < n)[None, :]
    products = tl.zeros([BT, NP, BC], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cs = c0 + tl.arange(0, BC)
        c_mask = cs < C
        grad = tl.load(dh_in + rows[:, None] * C + cs[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        streams = tl.load(
            x + rows[:, None, None] * (n * C) + i[None, :, None] * C + cs[None, None, :],
            mask=mask2[:, :, None] & c_mask[None, None, :],
            other=0.0,
        )
        products += grad.to(tl.float32)[:, None, :] * streams.to(tl.float32)
    tl.store(d_pre + rows[:, None] * n + i[None, :], tl.sum(products, 2), mask=mask2)


@direct_launch
@triton.jit
def _pre_backward_gates_kernel(
    alpha,
    bias,
    h,
    r,
    d_pre,
    dh_post,
    dh_res,
    dg,
    pre_out,
    scale_out,
    partials,
    tokens,
    K,
    iters,
    n: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    PTX: tl.constexpr,
):
    """The per-token part from d H_pre, d H_post and d H_res: dg = d(v @ phi) [tokens, M], H_pre [tokens, n] and
    scale [tokens] (the rstd term of dx) for the dx kernel, and per-program partial sums [programs, M + 3] of dbias
    (M) and dalpha (3). BT is large enough that the [BT, NP, NP] tiles spread tokens over all warps: the Sinkhorn
    sums then stay inside a warp."""
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    row_mask = rows < tokens
    rows = rows.to(tl.int64)
    M = n * n + 2 * n
    i = tl.arange(0, NP)
    i_mask = i < n
    mask2 = row_mask[:, None] & i_mask[None, :]
    valid = (i[:, None] < n) & (i[None, :] < n)
    mask3 = row_mask[:, None, None] & valid[None, :, :]

    # back through the sigmoids and the Sinkhorn iterations (recomputing iterate k from the first)
    pre, post_sigmoid, first = _gates(h, bias, alpha, rows, row_mask, M, n, NP)
    d_pre_logit = tl.where(
        mask2, tl.load(d_pre + rows[:, None] * n + i[None, :], mask=mask2, other=0.0) * pre * (1 - pre), 0.0
    )
    d_post = tl.load(dh_post + rows[:, None] * n + i[None, :], mask=mask2, other=0.0).to(tl.float32)
    d_post_logit = tl.where(mask2, d_post * 2 * post_sigmoid * (1 - post_sigmoid), 0.0)
    res_index = i[:, None] * n + i[None, :]
    grad_matrix = tl.load(dh_res + rows[:, None, None] * (n * n) + res_index[None, :, :], mask=mask3, other=0.0).to(
        tl.float32
    )
    # the gradient is carried with respect to the log iterates: a logsumexp subtraction's backward takes the softmax
    # times the row (column) sum of the gradient, and nothing is divided by a sum that can underflow
    for back in range(iters):
        iterate = first
        for _ in range(iters - 1 - back):
            iterate = _sinkhorn_step(iterate, n, NP, PTX)
        rows_log, rows_normal = _normalise(iterate, 2, n, NP, PTX)
        _, result = _normalise(rows_log, 1, n, NP, PTX)
        grad_matrix = tl.where(back == 0, grad_matrix * result, grad_matrix)  # d H_res to d log H_res
        grad_matrix -= result * tl.sum(grad_matrix, 1)[:, None, :]
        grad_matrix -= rows_normal * tl.sum(grad_matrix, 2)[:, :, None]
    d_res_logit = tl.where(mask3, grad_matrix, 0.0)

    # d h = alpha * d logits; partial sums for dbias (d logits) and dalpha (d logits * h)
    base = h + rows[:, None] * M
    h_pre = tl.load(base + i[None, :], mask=mask2, other=0.0)
    h_post_raw = tl.load(base + n + i[None, :], mask=mask2, other=0.0)
    h_res_raw = tl.load(h + rows[:, None, None] * M + 2 * n + res_index[None, :, :], mask=mask3, other=0.0)
    part = partials + pid * (M + 3)
    tl.store(part + i, tl.sum(d_pre_logit, 0), mask=i_mask)
    tl.store(part + n + i, tl.sum(d_post_logit, 0), mask=i_mask)
    tl.store(part + 2 * n + res_index, tl.sum(d_res_logit, 0), mask=valid)
    tl.store(part + M, tl.sum(tl.sum(d_pre_logit * h_pre, 1), 0))
    tl.store(part + M + 1, tl.sum(tl.sum(d_post_logit * h_post_raw, 1), 0))
    tl.store(part + M + 2, tl.sum(tl.sum(tl.sum(d_res_logit * h_res_raw, 2), 1), 0))

    # h = r * g with g = v @ phi: dg = r * dh, dr = sum(dh * g) = sum(dh * h) / r, dr/dv = -r^3 v / K
    a0 = tl.load(alpha)
    a1 = tl.load(alpha + 1)
    a2 = tl.load(alpha + 2)
    rstd = tl.load(r + rows, mask=row_mask, other=1.0)
    d_r = (
        tl.sum(d_pre_logit * a0 * h_pre, 1)
        + tl.sum(d_post_logit * a1 * h_post_raw, 1)
        + tl.sum(tl.sum(d_res_logit * a2 * h_res_raw, 2), 1)
    ) / rstd
    tl.store(scale_out + rows, -d_r * rstd * rstd * rstd / K, mask=row_mask)
    tl.store(pre_out + rows[:, None] * n + i[None, :], pre, mask=mask2)
    grow = dg + rows[:, None] * M
    tl.store(grow + i[None, :], rstd[:, None] * a0 * d_pre_logit, mask=mask2)
    tl.store(grow + n + i[None, :], rstd[:, None] * a1 * d_post_logit, mask=mask2)
    tl.store(
        dg + rows[:, None, None] * M + 2 * n + res_index[None, :, :], rstd[:, None, None] * a2 * d_res_logit, mask=mask3
    )


@direct_launch
@triton.jit
def _pre_backward_dx_kernel(
    x,
    phi,
    dh_in,
    dg,
    pre,
    scale,
    dx,
    dphi_part,
    tokens,
    C,
    blocks_per_split,
    n: tl.constexpr,
    MP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """For one (stream, C block) of K and one share of the tokens: dx = dg @ phi^T + scale * v + H_pre[i] * dh_in,
    and the share's dphi[k, m] = sum_t v[t, k] * dg[t, m] (partial sums; the launcher adds the shares in order)."""
    stream = tl.program_id(0) % n  # streams vary fastest: the programs that read the same dh_in block run together
    cs = (tl.program_id(0) // n) * BC + tl.arange(0, BC)
    split = tl.program_id(1)
    c_mask = cs < C
    K = n * C
    M = n * n + 2 * n
    ks = stream * C + cs
    cols = tl.arange(0, MP)
    col_mask = cols < M
    weights_t = tl.load(phi + ks[None, :] * M + cols[:, None], mask=col_mask[:, None] & c_mask[None, :], other=0.0).to(
        tl.float32
    )
    acc = tl.zeros([BC, MP], dtype=tl.float32)
    first = split * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(tokens, BT))):
        rows = block * BT + tl.arange(0, BT)
        row_mask = rows < tokens
        rows = rows.to(tl.int64)  # token offsets times n*C pass 2^31 at a million tokens
        mask = row_mask[:, None] & c_mask[None, :]
        d_g = tl.load(dg + rows[:, None] * M + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        v = tl.load(x + rows[:, None] * K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(dh_in + rows[:, None] * C + cs[None, :], mask=mask, other=0.0).to(tl.float32)
        pre_i = tl.load(pre + rows * n + stream, mask=row_mask, other=0.0)
        scale_t = tl.load(scale + rows, mask=row_mask, other=0.0)
        out = tl.dot(d_g, weights_t, input_precision=PRECISION) + scale_t[:, None] * v + pre_i[:, None] * grad
        tl.store(dx + rows[:, None] * K + ks[None, :], out.to(dx.dtype.element_ty), mask=mask)
        acc = tl.dot(tl.trans(v), d_g, acc, input_precision=PRECISION)
    part = dphi_part + split.to(tl.int64) * K * M
    tl.store(part + ks[:, None] * M + cols[None, :], acc, mask=c_mask[:, None] & col_mask[None, :])


@direct_launch
@triton.jit
def _post_forward_kernel(
    x, y, h_post, h_res, out, tokens, C, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_mask = rows < tokens
    rows = rows.to(tl.int64)  # token offsets times n*C pass 2^31 at a million tokens
    i = tl.arange(0, NP)
    mask2 = row_mask[:, None] & (i < n)[None, :]
    post = tl.load(h_post + rows[:, None] * n + i[None, :], mask=mask2, other=0.0).to(tl.float32)
    for c0 in range(0, C, BC):
        cs = c0 + tl.arange(0, BC)
        cmask = row_mask[:, None] & (cs < C)[None, :]
        ys = tl.load(y + rows[:, None] * C + cs[None, :], mask=cmask, other=0.0).to(tl.float32)
        acc = post[:, :, None] * ys[:, None, :]
        for stream in tl.static_range(n):
            column = tl.load(h_res + rows[:, None] * (n * n) + i[None, :] * n + stream, mask=mask2, other=0.0).to(
                tl.float32
            )
            xs = tl.load(x + rows[:, None] * (n * C) + stream * C + cs[None, :], mask=cmask, other=0.0).to(tl.float32)
            acc += column[:, :, None] * xs[:, None, :]
        pointers = out + rows[:, None, None] * (n * C) + i[None, :, None] * C + cs[None, None, :]
        tl.store(pointers, acc.to(out.dtype.element_ty), mask=mask2[:, :, None] & (cs < C)[None, None, :])


@direct_launch
@triton.jit
def _post_backward_kernel(
    x,
    y,
    h_post,
    h_res,
    d_out,
    dx,
    dy,
    dh_post,
    dh_res,
    tokens,
    C,
    n: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_mask = rows < tokens
    rows = rows.to(tl.int64)  # token offsets times n*C pass 2^31 at a million tokens
    i = tl.arange(0, NP)
    mask2 = row_mask[:, None] & (i < n)[None, :]
    valid = (i[:, None] < n) & (i[None, :] < n)
    post = tl.load(h_post + rows[:, None] * n + i[None, :], mask=mask2, other=0.0).to(tl.float32)
    d_post = tl.zeros([BT, NP], dtype=tl.float32)
    d_res = tl.zeros([BT, NP, NP], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cs = c0 + tl.arange(0, BC)
        cmask = row_mask[:, None] & (cs < C)[None, :]
        grad = tl.load(
            d_out + rows[:, None, None] * (n * C) + i[None, :, None] * C + cs[None, None, :],
            mask=mask2[:, :, None] & (cs < C)[None, None, :],
            other=0.0,
        ).to(tl.float32)
        ys = tl.load(y + rows[:, None] * C + cs[None, :], mask=cmask, other=0.0).to(tl.float32)
        d_post += tl.sum(grad * ys[:, None, :], 2)
        tl.store(
            dy + rows[:, None] * C + cs[None, :], tl.sum(post[:, :, None] * grad, 1).to(dy.dtype.element_ty), mask=cmask
        )
        for stream in tl.static_range(n):
            column = tl.load(h_res + rows[:, None] * (n * n) + i[None, :] * n + stream, mask=mask2, other=0.0).to(
                tl.float32
            )
            xs = tl.load(x + rows[:, None] * (n * C) + stream * C + cs[None, :], mask=cmask, other=0.0).to(tl.float32)
            d_res += tl.where(i[None, None, :] == stream, tl.sum(grad * xs[:, None, :], 2)[:, :, None], 0.0)
            d_x = tl.sum(column[:, :, None] * grad, 1)
            tl.store(dx + rows[:, None] * (n * C) + stream * C + cs[None, :], d_x.to(dx.dtype.element_ty), mask=cmask)
    tl.store(dh_post + rows[:, None] * n + i[None, :], d_post.to(dh_post.dtype.element_ty), mask=mask2)
    res_pointers = dh_res + rows[:, None, None] * (n * n) + (i[:, None] * n + i[None, :])[None, :, :]
    tl.store(res_pointers, d_res.to(dh_res.dtype.element_ty), mask=row_mask[:, None, None] & valid[None, :, :])


# launchers ------------------------------------------------------------------------------


def _precision(x: torch.Tensor) -> str:
    # fp32 inputs need IEEE dots for their 1e-4 bound; half inputs are exact in tf32
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _wide_block(n: int, C: int) -> int:
    """C columns per step of a [BLOCK_TOKENS, NP, BC] tile of 4096 elements: wide enough that the columns, not the
    streams, take a warp's lanes (the warps then split the tokens, and no sum crosses warps). A quarter of that
    when C is not a multiple of 16: loads then go element by element, each with its own 64-bit address."""
    return (4096 if C % 16 == 0 else 1024) // (BLOCK_TOKENS * pow2_at_least(n, 2))


def _dx_blocks(n: int, C: int) -> tuple[int, int]:
    """(tokens per step, C columns per program) of the dx kernel: 64 x 64; 32 columns where the [BT, MP] dg tile is
    wide (n = 8: MP = 128); 32 x 32 where the loads go element by element (C not a multiple of 16)."""
    columns = 64 if n * n + 2 * n <= 32 else 32
    return (64, columns) if C % 16 == 0 else (32, 32)


def _post_block(n: int) -> int:
    return max(16, 1024 // (BLOCK_TOKENS * pow2_at_least(n)))


def pre_forward(x, phi, alpha, bias, eps, sinkhorn_iters):
    n, C = x.shape[-2], x.shape[-1]
    out = allocate_pre(x)
    tokens, m = out.h.shape
    _pre_forward_kernel[(cdiv(tokens, BLOCK_TOKENS),)](
        out.streams,
        phi.contiguous(),
        alpha.float().contiguous(),
        bias.float().contiguous(),
        out.h_in,
        out.h_post,
        out.h_res,
        out.h,
        out.r,
        tokens,
        C,
        eps,
        sinkhorn_iters,
        n=n,
        NP=pow2_at_least(n, 2),
        MP=pow2_at_least(m, 16),
        BT=BLOCK_TOKENS,
        BK=BLOCK_K,
        PRECISION=_precision(x),
        PTX=not triton_interpret(),
    )
    return out.results


def _gates_block(n: int) -> int:
    """Tokens per program of the gates kernel: enough to spread the tokens of its [BT, NP, NP] tiles over all four
    warps (a thread then holds a token's whole matrix; at n = 8, half of each row, two lanes sharing a token)."""
    return 128 if n <= 4 else 64


def dx_splits(tokens: int, n: int, C: int, launch: PreBackwardLaunch = PRE_BACKWARD) -> tuple[int, int]:
    """(token shares, token blocks per share) of the dx kernel: about launch.dx_programs programs in all, fixed by the
    shape alone, so that dphi adds the same partial sums in the same order on any GPU."""
    block_tokens, block_c = _dx_blocks(n, C)
    blocks = cdiv(tokens, block_tokens)
    per_share = cdiv(blocks, max(1, min(blocks, cdiv(launch.dx_programs, n * cdiv(C, block_c)))))
    return cdiv(blocks, per_share), per_share


def pre_backward(
    d_h_in, d_h_post, d_h_res, x, phi, alpha, bias, eps, sinkhorn_iters, h_in, h_post, h_res, h, r,
    launch: PreBackwardLaunch = PRE_BACKWARD,
):  # fmt: skip
    n, C = x.shape[-2], x.shape[-1]
    xs = token_streams(x)
    tokens, m = xs.shape[0], n * n + 2 * n
    f32 = dict(dtype=torch.float32, device=x.device)
    d_h_in = d_h_in.reshape(tokens, C).contiguous()
    d_pre = buffers.empty((tokens, n), **f32)
    _pre_backward_dpre_kernel[(cdiv(tokens, BLOCK_TOKENS),)](
        xs,
        d_h_in,
        d_pre,
        tokens,
        C,
        n=n,
        NP=pow2_at_least(n, 2),
        BT=BLOCK_TOKENS,
        BC=_wide_block(n, C),
    )
    block_tokens = _gates_block(n)
    programs = cdiv(tokens, block_tokens)
    dg = buffers.empty((tokens, m), **f32)
    pre = buffers.empty((tokens, n), **f32)
    scale = buffers.empty((tokens,), **f32)
    partials = buffers.empty((programs, m + 3), **f32)
    _pre_backward_gates_kernel[(programs,)](
        alpha.float().contiguous(),
        bias.float().contiguous(),
        h,
        r,
        d_pre,
        d_h_post.reshape(tokens, n).contiguous(),
        d_h_res.reshape(tokens, n * n).contiguous(),
        dg,
        pre,
        scale,
        partials,
        tokens,
        n * C,
        sinkhorn_iters,
        n=n,
        NP=pow2_at_least(n, 2),
        BT=block_tokens,
        PTX=not triton_interpret(),
    )
    splits, per_split = dx_splits(tokens, n, C, launch)
    dx = buffers.empty(xs.shape, dtype=x.dtype, device=x.device)
    dphi_part = buffers.empty((splits, n * C, m), **f32)
    block_tokens, block_c = _dx_blocks(n, C)
    _pre_backward_dx_kernel[(n * cdiv(C, block_c), splits)](
        xs,
        phi.contiguous(),
        d_h_in,
        dg,
        pre,
        scale,
        dx,
        dphi_part,
        tokens,
        C,
        per_split,
        n=n,
        MP=pow2_at_least(m, 16),
        BT=block_tokens,
        BC=block_c,
        PRECISION=_precision(x),
    )
    sums = partials.sum(0)  # fixed-order reductions of per-program partials: deterministic
    dphi = dphi_part.sum(0).to(phi.dtype)
    return dx.view(x.shape), dphi, sums[m:].to(alpha.dtype), sums[:m].to(bias.dtype), None, None


def post_forward(x, y, h_post, h_res):
    n, C = x.shape[-2], x.shape[-1]
    tokens = x.numel() // (n * C)
    out = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    _post_forward_kernel[(cdiv(tokens, BLOCK_TOKENS),)](
        x.contiguous(),
        y.contiguous(),
        h_post.contiguous(),
        h_res.contiguous(),
        out,
        tokens,
        C,
        n=n,
        NP=pow2_at_least(n, 2),
        BT=BLOCK_TOKENS,
        BC=_post_block(n),
    )
    return out


def post_backward(d_out, x, y, h_post, h_res, out):
    n, C = x.shape[-2], x.shape[-1]
    tokens = x.numel() // (n * C)
    dx = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    dy = buffers.empty(y.shape, dtype=y.dtype, device=y.device)
    dh_post = buffers.empty(h_post.shape, dtype=h_post.dtype, device=x.device)
    dh_res = buffers.empty(h_res.shape, dtype=h_res.dtype, device=x.device)
    _post_backward_kernel[(cdiv(tokens, BLOCK_TOKENS),)](
        x.contiguous(),
        y.contiguous(),
        h_post.contiguous(),
        h_res.contiguous(),
        d_out.contiguous(),
        dx,
        dy,
        dh_post,
        dh_res,
        tokens,
        C,
        n=n,
        NP=pow2_at_least(n, 2),
        BT=BLOCK_TOKENS,
        BC=_wide_block(n, C),
    )
    return dx, dy, dh_post, dh_res


PRE_KERNELS = KernelBackend(forward=pre_forward, backward=pre_backward)
POST_KERNELS = KernelBackend(forward=post_forward, backward=post_backward)
