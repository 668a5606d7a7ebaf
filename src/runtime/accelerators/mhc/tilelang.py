"""mHC pre/post in TileLang: a block of tokens per program, fp32 math, forward and backward.

The same algorithm as the Triton kernels (see triton.py): h = r * (v @ phi) is saved per token as
[tokens, M] fp32 (M = n*n + 2n); the small per-token work (sigmoids, the n x n Sinkhorn iterations
and their backward) runs in shared memory with one thread per (token, row); Sinkhorn runs in the log
domain (see reference.sinkhorn) and the backward recomputes iterate k from the res logits instead of
storing the iterates. Tokens are a dynamic dimension: one compiled kernel per (dtypes, n, C).
"""

from __future__ import annotations

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import pow2_at_least
from ..tilelang_common import ACCUM, TL_DTYPE, device_info, launcher
from .layout import allocate_pre, token_streams

BLOCK_TOKENS = 16
BLOCK_K = 64
THREADS = 128


def pre_block_tokens(n: int) -> int:
    """Tokens per block of the pre kernels: BLOCK_TOKENS, doubled for an odd n.

    Their one-thread-per-(token, row) loops over shared memory need a barrier inside the loop's
    guard `thread < tokens * n`; TileLang lowers that only when the guard is warp-uniform, i.e.
    when tokens * n is a multiple of 32."""
    return BLOCK_TOKENS if BLOCK_TOKENS * n % 32 == 0 else 32


@T.macro
def _coefficients(Hs, Alpha, Bias, h_s, pre_s, post_s, first_s, row0, tokens, n: int, M: int, MP: int, BT: int):
    """Load h for the block's tokens; H_pre and the post sigmoid; first_s = the res logits."""
    for t, m in T.Parallel(BT, MP):
        h_s[t, m] = T.if_then_else((row0 + t < tokens) and (m < M), Hs[row0 + t, m], 0.0)
    for t, i in T.Parallel(BT, n):
        pre_s[t, i] = 1.0 / (1.0 + T.exp(-(Alpha[0] * h_s[t, i] + Bias[i])))
        post_s[t, i] = 1.0 / (1.0 + T.exp(-(Alpha[1] * h_s[t, n + i] + Bias[n + i])))
    for t, e in T.Parallel(BT, n * n):
        first_s[t, e] = Alpha[2] * h_s[t, 2 * n + e] + Bias[2 * n + e]


@T.macro
def _normalise(matrix, n: int, BT: int, outer: int, inner: int):
    """Each row (outer, inner = n, 1) or column (1, n) of the log matrix minus its logsumexp, a thread per token row or
    column. (entry - peak) first: exact for the entries near the peak, the ones that decide the softmax."""
    for t, a in T.Parallel(BT, n):
        peak = T.alloc_var(ACCUM)
        total = T.alloc_var(ACCUM)
        peak = matrix[t, a * outer]
        for b in T.serial(1, n):
            peak = T.max(peak, matrix[t, a * outer + b * inner])
        total = 0.0
        for b in T.serial(n):
            total += T.exp(matrix[t, a * outer + b * inner] - peak)
        for b in T.serial(n):
            matrix[t, a * outer + b * inner] = (matrix[t, a * outer + b * inner] - peak) - T.log(total)


@T.macro
def _sinkhorn_step(matrix, n: int, BT: int):
    """One round in place in the log domain: rows to logsumexp 0, then columns. The sums stay in registers: a shared
    one, written and read back in one loop body, asks TileLang for a barrier inside the loop's guard."""
    _normalise(matrix, n, BT, n, 1)
    _normalise(matrix, n, BT, 1, n)


@T.macro
def _post_coefficients(HRes, HPost, coef, row0, tokens, n: int):
    """coef[t] = (H_res, H_post) of the block's token row0 + t, zero past the last token. (row0 and tokens come
    under their own names: TileLang renames a scalar passed to a macro after the parameter.)"""
    for t, e in T.Parallel(BLOCK_TOKENS, n * n + n):
        coef[t, e] = T.if_then_else(
            row0 + t < tokens, T.if_then_else(e < n * n, HRes[row0 + t, e], HPost[row0 + t, e - n * n]), 0.0
        )


def pre_forward_kernel(dtype: str, phi_dtype: str, n: int, C: int):
    K, M = n * C, n * n + 2 * n
    MP, BT, BK = pow2_at_least(M, 16), pre_block_tokens(n), BLOCK_K
    tokens = T.dynamic("tokens")

    @T.prim_func
    def mhc_pre_fwd(
        X: T.Tensor((tokens, K), dtype),
        Phi: T.Tensor((K, M), phi_dtype),
        Alpha: T.Tensor((3,), ACCUM),
        Bias: T.Tensor((M,), ACCUM),
        HIn: T.Tensor((tokens, C), dtype),
        HPost: T.Tensor((tokens, n), ACCUM),
        HRes: T.Tensor((tokens, n * n), ACCUM),
        Hs: T.Tensor((tokens, M), ACCUM),
        R: T.Tensor((tokens,), ACCUM),
        eps: T.float32,
        iters: T.int32,
    ):
        with T.Kernel(T.ceildiv(tokens, BT), threads=THREADS) as bx:
            x_s = T.alloc_shared((BT, BK), dtype)
            phi_s = T.alloc_shared((BK, MP), phi_dtype)
            acc = T.alloc_fragment((BT, MP), ACCUM)
            squares = T.alloc_fragment((BT, BK), ACCUM)
            total = T.alloc_fragment((BT,), ACCUM)
            h_s = T.alloc_shared((BT, MP), ACCUM)
            pre_s = T.alloc_shared((BT, n), ACCUM)
            post_s = T.alloc_shared((BT, n), ACCUM)
            matrix = T.alloc_shared((BT, n * n), ACCUM)
            out = T.alloc_fragment((BT, BK), ACCUM)
            row0 = bx * BT
            T.clear(acc)
            T.clear(squares)
            for kb in T.serial(T.ceildiv(K, BK)):
                for t, k in T.Parallel(BT, BK):
                    x_s[t, k] = T.if_then_else(
                        (row0 + t < tokens) and (kb * BK + k < K), X[row0 + t, kb * BK + k], T.cast(0, dtype)
                    )
                for k, m in T.Parallel(BK, MP):
                    phi_s[k, m] = T.if_then_else(
                        (kb * BK + k < K) and (m < M), Phi[kb * BK + k, m], T.cast(0, phi_dtype)
                    )
                for t, k in T.Parallel(BT, BK):
                    squares[t, k] += T.cast(x_s[t, k], ACCUM) * T.cast(x_s[t, k], ACCUM)
                for k in T.serial(BK):
                    for t, m in T.Parallel(BT, MP):
                        acc[t, m] += T.cast(x_s[t, k], ACCUM) * T.cast(phi_s[k, m], ACCUM)
            T.reduce_sum(squares, total, dim=1)
            for t in T.Parallel(BT):
                total[t] = T.rsqrt(total[t] / K + eps)
                if row0 + t < tokens:
                    R[row0 + t] = total[t]
            for t, m in T.Parallel(BT, MP):
                acc[t, m] = acc[t, m] * total[t]
                if (row0 + t < tokens) and (m < M):
                    Hs[row0 + t, m] = acc[t, m]
            # _coefficients reads back Hs rows that other threads of this block wrote (global memory: the
            # sync pass guards only shared buffers; today's sync there comes from h_s reusing phi_s's memory)
            T.sync_threads()
            _coefficients(Hs, Alpha, Bias, h_s, pre_s, post_s, matrix, row0, tokens, n, M, MP, BT)
            T.sync_threads()
            for it in T.serial(iters):
                _sinkhorn_step(matrix, n, BT)
            for t, i in T.Parallel(BT, n):
                if row0 + t < tokens:
                    HPost[row0 + t, i] = 2.0 * post_s[t, i]
            for t, e in T.Parallel(BT, n * n):
                if row0 + t < tokens:
                    HRes[row0 + t, e] = T.exp(matrix[t, e])
            for cb in T.serial(T.ceildiv(C, BK)):
                T.clear(out)
                for t, c in T.Parallel(BT, BK):
                    for i in T.serial(n):
                        out[t, c] += pre_s[t, i] * T.cast(
                            T.if_then_else(
                                (row0 + t < tokens) and (cb * BK + c < C), X[row0 + t, i * C + cb * BK + c], 0
                            ),
                            ACCUM,
                        )
                for t, c in T.Parallel(BT, BK):
                    if (row0 + t < tokens) and (cb * BK + c < C):
                        HIn[row0 + t, cb * BK + c] = T.cast(out[t, c], dtype)

    return mhc_pre_fwd


def pre_backward_kernel(dtype: str, phi_dtype: str, n: int, C: int):
    """dx and dg = d(v @ phi) per token; per-block partial sums of dbias (M) and dalpha (3)."""
    K, M, NN = n * C, n * n + 2 * n, n * n
    MP, BT, BK = pow2_at_least(M, 16), pre_block_tokens(n), BLOCK_K
    tokens = T.dynamic("tokens")

    @T.prim_func
    def mhc_pre_bwd(
        X: T.Tensor((tokens, K), dtype),
        Phi: T.Tensor((K, M), phi_dtype),
        Alpha: T.Tensor((3,), ACCUM),
        Bias: T.Tensor((M,), ACCUM),
        Hs: T.Tensor((tokens, M), ACCUM),
        R: T.Tensor((tokens,), ACCUM),
        DHIn: T.Tensor((tokens, C), dtype),
        DHPost: T.Tensor((tokens, n), ACCUM),
        DHRes: T.Tensor((tokens, NN), ACCUM),
        DX: T.Tensor((tokens, K), dtype),
        DG: T.Tensor((tokens, M), ACCUM),
        Partial: T.Tensor((T.ceildiv(tokens, BT), M + 3), ACCUM),
        iters: T.int32,
    ):
        with T.Kernel(T.ceildiv(tokens, BT), threads=THREADS) as bx:
            h_s = T.alloc_shared((BT, MP), ACCUM)
            pre_s = T.alloc_shared((BT, n), ACCUM)
            post_s = T.alloc_shared((BT, n), ACCUM)
            first_s = T.alloc_shared((BT, NN), ACCUM)
            iterate = T.alloc_shared((BT, NN), ACCUM)
            rows_normal = T.alloc_shared((BT, NN), ACCUM)
            result = T.alloc_shared((BT, NN), ACCUM)
            grad = T.alloc_shared((BT, NN), ACCUM)
            d_rows = T.alloc_shared((BT, NN), ACCUM)
            d_pre = T.alloc_shared((BT, n), ACCUM)
            dg_s = T.alloc_shared((BT, MP), ACCUM)
            phi_s = T.alloc_shared((BK, MP), phi_dtype)
            part = T.alloc_fragment((BT, BK), ACCUM)
            part_sum = T.alloc_fragment((BT,), ACCUM)
            scale = T.alloc_shared((BT,), ACCUM)
            out = T.alloc_fragment((BT, BK), ACCUM)
            row0 = bx * BT
            _coefficients(Hs, Alpha, Bias, h_s, pre_s, post_s, first_s, row0, tokens, n, M, MP, BT)

            # d H_pre[i] = sum_c dh_in[c] * x[i, c]
            for i in T.serial(n):
                T.clear(part)
                for cb in T.serial(T.ceildiv(C, BK)):
                    for t, c in T.Parallel(BT, BK):
                        inside = (row0 + t < tokens) and (cb * BK + c < C)
                        part[t, c] += T.if_then_else(
                            inside,
                            T.cast(DHIn[row0 + t, cb * BK + c], ACCUM)
                            * T.cast(X[row0 + t, i * C + cb * BK + c], ACCUM),
                            0.0,
                        )
                T.reduce_sum(part, part_sum, dim=1)
                for t in T.Parallel(BT):
                    d_pre[t, i] = part_sum[t]

            # back through the Sinkhorn rounds, last first, recomputing each round's input. The gradient is carried
            # with respect to the log iterates: a logsumexp subtraction's backward takes the softmax times the row
            # (column) sum of the gradient, and nothing is divided by a sum that can underflow
            for t, e in T.Parallel(BT, NN):
                grad[t, e] = T.if_then_else(row0 + t < tokens, DHRes[row0 + t, e], 0.0)
            for back in T.serial(iters):
                # copied row by row: the same threads then normalise those rows (TileLang syncs only them)
                for t, i in T.Parallel(BT, n):
                    for j in T.serial(n):
                        iterate[t, i * n + j] = first_s[t, i * n + j]
                T.sync_threads()
                for k in T.serial(iters - 1 - back):
                    _sinkhorn_step(iterate, n, BT)
                _normalise(iterate, n, BT, n, 1)
                for t, i in T.Parallel(BT, n):
                    for j in T.serial(n):
                        rows_normal[t, i * n + j] = T.exp(iterate[t, i * n + j])
                for t, j in T.Parallel(BT, n):
                    peak = T.alloc_var(ACCUM)
                    total = T.alloc_var(ACCUM)
                    peak = iterate[t, j]
                    for i in T.serial(1, n):
                        peak = T.max(peak, iterate[t, i * n + j])
                    total = 0.0
                    for i in T.serial(n):
                        total += T.exp(iterate[t, i * n + j] - peak)
                    for i in T.serial(n):
                        result[t, i * n + j] = T.exp(iterate[t, i * n + j] - peak) / total
                # through the column normalisation; on the first round back, d H_res to d log H_res first
                for t, j in T.Parallel(BT, n):
                    total = T.alloc_var(ACCUM)
                    total = 0.0
                    for i in T.serial(n):
                        e = i * n + j
                        total += T.if_then_else(back == 0, grad[t, e] * result[t, e], grad[t, e])
                    for i in T.serial(n):
                        e = i * n + j
                        d_rows[t, e] = T.if_then_else(back == 0, grad[t, e] * result[t, e], grad[t, e]) - (
                            result[t, e] * total
                        )
                for t, i in T.Parallel(BT, n):  # through the row normalisation
                    total = T.alloc_var(ACCUM)
                    total = 0.0
                    for j in T.serial(n):
                        total += d_rows[t, i * n + j]
                    for j in T.serial(n):
                        grad[t, i * n + j] = d_rows[t, i * n + j] - rows_normal[t, i * n + j] * total

            # d logits, then dg = r * alpha * d logits; dr = sum(dh * h) / r
            for t, m in T.Parallel(BT, MP):
                dg_s[t, m] = 0.0
            for t, i in T.Parallel(BT, n):
                dg_s[t, i] = d_pre[t, i] * pre_s[t, i] * (1.0 - pre_s[t, i])
                dg_s[t, n + i] = (
                    T.if_then_else(row0 + t < tokens, DHPost[row0 + t, i], 0.0)
                    * 2.0
                    * post_s[t, i]
                    * (1.0 - post_s[t, i])
                )
            for t, e in T.Parallel(BT, NN):
                dg_s[t, 2 * n + e] = grad[t, e]
            T.sync_threads()  # the loops above and below map threads differently onto dg_s
            for t, m in T.Parallel(BT, MP):
                if row0 + t >= tokens:
                    dg_s[t, m] = 0.0
            for m in T.Parallel(M):  # per-block partial sums: dbias = sum d logits
                total = T.alloc_var(ACCUM)
                total = 0.0
                for t in T.serial(BT):
                    total += dg_s[t, m]
                Partial[bx, m] = total
            for a in T.Parallel(3):  # dalpha[a] = sum over its group of d logits * h
                total = T.alloc_var(ACCUM)
                total = 0.0
                start = T.if_then_else(a == 0, 0, T.if_then_else(a == 1, n, 2 * n))
                stop = T.if_then_else(a == 0, n, T.if_then_else(a == 1, 2 * n, M))
                for t in T.serial(BT):
                    for m in T.serial(start, stop):
                        total += dg_s[t, m] * h_s[t, m]
                Partial[bx, M + a] = total
            for t in T.Parallel(BT):
                rstd = T.alloc_var(ACCUM)
                d_r = T.alloc_var(ACCUM)
                rstd = T.if_then_else(row0 + t < tokens, R[row0 + t], 1.0)
                d_r = 0.0
                for m in T.serial(M):
                    a = T.if_then_else(m < n, Alpha[0], T.if_then_else(m < 2 * n, Alpha[1], Alpha[2]))
                    dg_s[t, m] = dg_s[t, m] * a  # d h
                    d_r += dg_s[t, m] * h_s[t, m]
                    dg_s[t, m] = dg_s[t, m] * rstd  # d g
                scale[t] = -(d_r / rstd) * rstd * rstd * rstd / K
            for t, m in T.Parallel(BT, MP):
                if (row0 + t < tokens) and (m < M):
                    DG[row0 + t, m] = dg_s[t, m]

            # dx = dg @ phi^T + scale * v + H_pre[i] * dh_in
            for i in T.serial(n):
                for cb in T.serial(T.ceildiv(C, BK)):
                    for k, m in T.Parallel(BK, MP):
                        phi_s[k, m] = T.if_then_else(
                            (cb * BK + k < C) and (m < M), Phi[i * C + cb * BK + k, m], T.cast(0, phi_dtype)
                        )
                    for t, c in T.Parallel(BT, BK):
                        inside = (row0 + t < tokens) and (cb * BK + c < C)
                        out[t, c] = scale[t] * T.cast(
                            T.if_then_else(inside, X[row0 + t, i * C + cb * BK + c], 0), ACCUM
                        )
                        out[t, c] += pre_s[t, i] * T.cast(T.if_then_else(inside, DHIn[row0 + t, cb * BK + c], 0), ACCUM)
                        for m in T.serial(M):
                            out[t, c] += dg_s[t, m] * T.cast(phi_s[c, m], ACCUM)
                    for t, c in T.Parallel(BT, BK):
                        if (row0 + t < tokens) and (cb * BK + c < C):
                            DX[row0 + t, i * C + cb * BK + c] = T.cast(out[t, c], dtype)

    return mhc_pre_bwd


def dphi_kernel(dtype: str, phi_dtype: str, n: int, C: int, token_splits: int):
    """Partial dphi[s, k, m] = sum over the s-th share of tokens of v[t, k] * dg[t, m]."""
    K, M = n * C, n * n + 2 * n
    MP, BT, BK = pow2_at_least(M, 16), BLOCK_TOKENS, BLOCK_K
    tokens = T.dynamic("tokens")

    @T.prim_func
    def mhc_dphi(
        X: T.Tensor((tokens, K), dtype),
        DG: T.Tensor((tokens, M), ACCUM),
        Partial: T.Tensor((token_splits, K, M), ACCUM),
    ):
        with T.Kernel(T.ceildiv(K, BK), token_splits, threads=THREADS) as (bx, split):
            x_s = T.alloc_shared((BT, BK), dtype)
            dg_s = T.alloc_shared((BT, MP), ACCUM)
            acc = T.alloc_fragment((BK, MP), ACCUM)
            T.clear(acc)
            blocks = T.ceildiv(tokens, BT)
            for step in T.serial(T.ceildiv(blocks - split, token_splits)):
                row0 = (step * token_splits + split) * BT
                for t, k in T.Parallel(BT, BK):
                    x_s[t, k] = T.if_then_else(
                        (row0 + t < tokens) and (bx * BK + k < K), X[row0 + t, bx * BK + k], T.cast(0, dtype)
                    )
                for t, m in T.Parallel(BT, MP):
                    dg_s[t, m] = T.if_then_else((row0 + t < tokens) and (m < M), DG[row0 + t, m], 0.0)
                for t in T.serial(BT):
                    for k, m in T.Parallel(BK, MP):
                        acc[k, m] += T.cast(x_s[t, k], ACCUM) * dg_s[t, m]
            for k, m in T.Parallel(BK, MP):
                if (bx * BK + k < K) and (m < M):
                    Partial[split, bx * BK + k, m] = acc[k, m]

    return mhc_dphi


def post_forward_kernel(dtype: str, n: int, C: int):
    BT, BC = BLOCK_TOKENS, BLOCK_K
    tokens = T.dynamic("tokens")

    @T.prim_func
    def mhc_post_fwd(
        X: T.Tensor((tokens, n, C), dtype),
        Y: T.Tensor((tokens, C), dtype),
        HPost: T.Tensor((tokens, n), ACCUM),
        HRes: T.Tensor((tokens, n * n), ACCUM),
        Out: T.Tensor((tokens, n, C), dtype),
    ):
        # tokens on x: gridDim.y is capped at 65535 blocks (1M tokens, reached by batch 576 x 2048)
        with T.Kernel(T.ceildiv(tokens, BT), T.ceildiv(C, BC), threads=THREADS) as (bx, cx):
            coef = T.alloc_shared((BT, n * n + n), ACCUM)
            acc = T.alloc_fragment((BT, BC), ACCUM)
            row0, col0 = bx * BT, cx * BC
            _post_coefficients(HRes, HPost, coef, row0, tokens, n)
            for i in T.serial(n):
                for t, c in T.Parallel(BT, BC):
                    inside = (row0 + t < tokens) and (col0 + c < C)
                    acc[t, c] = coef[t, n * n + i] * T.cast(T.if_then_else(inside, Y[row0 + t, col0 + c], 0), ACCUM)
                    for j in T.serial(n):
                        acc[t, c] += coef[t, i * n + j] * T.cast(
                            T.if_then_else(inside, X[row0 + t, j, col0 + c], 0), ACCUM
                        )
                for t, c in T.Parallel(BT, BC):
                    if (row0 + t < tokens) and (col0 + c < C):
                        Out[row0 + t, i, col0 + c] = T.cast(acc[t, c], dtype)

    return mhc_post_fwd


def post_backward_kernel(dtype: str, n: int, C: int):
    """dx, dy, and per-token dH_post / dH_res (each block loops over all of C for its tokens)."""
    BT, BC = BLOCK_TOKENS, BLOCK_K
    tokens = T.dynamic("tokens")

    @T.prim_func
    def mhc_post_bwd(
        X: T.Tensor((tokens, n, C), dtype),
        Y: T.Tensor((tokens, C), dtype),
        HPost: T.Tensor((tokens, n), ACCUM),
        HRes: T.Tensor((tokens, n * n), ACCUM),
        DOut: T.Tensor((tokens, n, C), dtype),
        DX: T.Tensor((tokens, n, C), dtype),
        DY: T.Tensor((tokens, C), dtype),
        DHPost: T.Tensor((tokens, n), ACCUM),
        DHRes: T.Tensor((tokens, n * n), ACCUM),
    ):
        with T.Kernel(T.ceildiv(tokens, BT), threads=THREADS) as bx:
            coef = T.alloc_shared((BT, n * n + n), ACCUM)
            acc = T.alloc_fragment((BT, BC), ACCUM)
            part = T.alloc_fragment((BT, BC), ACCUM)
            part_sum = T.alloc_fragment((BT,), ACCUM)
            row0 = bx * BT
            _post_coefficients(HRes, HPost, coef, row0, tokens, n)
            for cb in T.serial(T.ceildiv(C, BC)):
                for t, c in T.Parallel(BT, BC):  # dy = sum_i H_post[i] * dout[i]
                    inside = (row0 + t < tokens) and (cb * BC + c < C)
                    acc[t, c] = 0.0
                    for i in T.serial(n):
                        acc[t, c] += coef[t, n * n + i] * T.cast(
                            T.if_then_else(inside, DOut[row0 + t, i, cb * BC + c], 0), ACCUM
                        )
                for t, c in T.Parallel(BT, BC):
                    if (row0 + t < tokens) and (cb * BC + c < C):
                        DY[row0 + t, cb * BC + c] = T.cast(acc[t, c], dtype)
                for j in T.serial(n):  # dx[j] = sum_i H_res[i, j] * dout[i]
                    for t, c in T.Parallel(BT, BC):
                        inside = (row0 + t < tokens) and (cb * BC + c < C)
                        acc[t, c] = 0.0
                        for i in T.serial(n):
                            acc[t, c] += coef[t, i * n + j] * T.cast(
                                T.if_then_else(inside, DOut[row0 + t, i, cb * BC + c], 0), ACCUM
                            )
                    for t, c in T.Parallel(BT, BC):
                        if (row0 + t < tokens) and (cb * BC + c < C):
                            DX[row0 + t, j, cb * BC + c] = T.cast(acc[t, c], dtype)
            # dH_post[i] = sum_c dout[i] * y ; dH_res[i, j] = sum_c dout[i] * x[j]
            for e in T.serial(n * n + n):
                T.clear(part)
                for cb in T.serial(T.ceildiv(C, BC)):
                    for t, c in T.Parallel(BT, BC):
                        inside = (row0 + t < tokens) and (cb * BC + c < C)
                        i = T.if_then_else(e < n * n, e // n, e - n * n)
                        other = T.if_then_else(e < n * n, X[row0 + t, e % n, cb * BC + c], Y[row0 + t, cb * BC + c])
                        part[t, c] += T.if_then_else(
                            inside, T.cast(DOut[row0 + t, i, cb * BC + c], ACCUM) * T.cast(other, ACCUM), 0.0
                        )
                T.reduce_sum(part, part_sum, dim=1)
                for t in T.Parallel(BT):
                    if row0 + t < tokens:
                        if e < n * n:
                            DHRes[row0 + t, e] = part_sum[t]
                        else:
                            DHPost[row0 + t, e - n * n] = part_sum[t]

    return mhc_post_bwd


# launchers ------------------------------------------------------------------------------


def _names(x: torch.Tensor, phi: torch.Tensor | None = None) -> tuple[str, ...]:
    return (TL_DTYPE[x.dtype],) + ((TL_DTYPE[phi.dtype],) if phi is not None else ())


def pre_entry(x: torch.Tensor, phi: torch.Tensor):
    n, C = x.shape[-2], x.shape[-1]
    return ("mhc_pre_fwd", x.dtype, phi.dtype, n, C), lambda _: pre_forward_kernel(*_names(x, phi), n, C)


def pre_backward_entry(x: torch.Tensor, phi: torch.Tensor):
    n, C = x.shape[-2], x.shape[-1]
    return ("mhc_pre_bwd", x.dtype, phi.dtype, n, C), lambda _: pre_backward_kernel(*_names(x, phi), n, C)


def _token_splits(device: torch.device, n: int, C: int) -> int:
    """Token shares of the dphi kernel: enough blocks (K blocks x shares) to fill the GPU twice over."""
    k_blocks = -(-n * C // BLOCK_K)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, -(-2 * device_info(index).sm_count // k_blocks))


def dphi_entry(x: torch.Tensor, phi: torch.Tensor, splits: int):
    n, C = x.shape[-2], x.shape[-1]
    return ("mhc_dphi", x.dtype, phi.dtype, n, C, splits), lambda _: dphi_kernel(*_names(x, phi), n, C, splits)


def post_entry(x: torch.Tensor):
    n, C = x.shape[-2], x.shape[-1]
    return ("mhc_post_fwd", x.dtype, n, C), lambda _: post_forward_kernel(TL_DTYPE[x.dtype], n, C)


def post_backward_entry(x: torch.Tensor):
    n, C = x.shape[-2], x.shape[-1]
    return ("mhc_post_bwd", x.dtype, n, C), lambda _: post_backward_kernel(TL_DTYPE[x.dtype], n, C)


def pre_forward(x, phi, alpha, bias, eps, sinkhorn_iters):
    n, C = x.shape[-2], x.shape[-1]
    out = allocate_pre(x)
    tokens = out.h.shape[0]
    launcher(pre_entry(x, phi), x.device)(
        out.streams,
        phi.contiguous(),
        alpha.float().contiguous(),
        bias.float().contiguous(),
        out.h_in.view(tokens, C),
        out.h_post.view(tokens, n),
        out.h_res.view(tokens, n * n),
        out.h,
        out.r,
        eps,
        sinkhorn_iters,
    )
    return out.results


def pre_backward(d_h_in, d_h_post, d_h_res, x, phi, alpha, bias, eps, sinkhorn_iters, h_in, h_post, h_res, h, r):
    n, C = x.shape[-2], x.shape[-1]
    xs = token_streams(x)
    tokens, m = xs.shape[0], n * n + 2 * n
    f32 = dict(dtype=torch.float32, device=x.device)
    dx = buffers.empty(xs.shape, dtype=x.dtype, device=x.device)
    dg = buffers.empty((tokens, m), **f32)
    partial = buffers.empty((-(-tokens // pre_block_tokens(n)), m + 3), **f32)
    launcher(pre_backward_entry(x, phi), x.device)(
        xs,
        phi.contiguous(),
        alpha.float().contiguous(),
        bias.float().contiguous(),
        h,
        r,
        d_h_in.reshape(tokens, C).to(x.dtype).contiguous(),
        d_h_post.reshape(tokens, n).float().contiguous(),
        d_h_res.reshape(tokens, n * n).float().contiguous(),
        dx,
        dg,
        partial,
        sinkhorn_iters,
    )
    splits = _token_splits(x.device, n, C)
    dphi_partial = buffers.empty((splits, n * C, m), **f32)
    launcher(dphi_entry(x, phi, splits), x.device)(xs, dg, dphi_partial)
    sums = partial.sum(0)  # fixed-order reductions of per-block partials: deterministic
    return (
        dx.view(x.shape),
        dphi_partial.sum(0).to(phi.dtype),
        sums[m:].to(alpha.dtype),
        sums[:m].to(bias.dtype),
        None,
        None,
    )


def post_forward(x, y, h_post, h_res):
    n, C = x.shape[-2], x.shape[-1]
    tokens = x.numel() // (n * C)
    out = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    launcher(post_entry(x), x.device)(
        x.reshape(tokens, n, C).contiguous(),
        y.reshape(tokens, C).to(x.dtype).contiguous(),
        h_post.reshape(tokens, n).float().contiguous(),
        h_res.reshape(tokens, n * n).float().contiguous(),
        out.view(tokens, n, C),
    )
    return out


def post_backward(d_out, x, y, h_post, h_res, out):
    n, C = x.shape[-2], x.shape[-1]
    tokens = x.numel() // (n * C)
    dx = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    dy = buffers.empty((tokens, C), dtype=x.dtype, device=x.device)
    dh_post = buffers.empty((tokens, n), dtype=torch.float32, device=x.device)
    dh_res = buffers.empty((tokens, n * n), dtype=torch.float32, device=x.device)
    launcher(post_backward_entry(x), x.device)(
        x.reshape(tokens, n, C).contiguous(),
        y.reshape(tokens, C).to(x.dtype).contiguous(),
        h_post.reshape(tokens, n).float().contiguous(),
        h_res.reshape(tokens, n * n).float().contiguous(),
        d_out.reshape(tokens, n, C).contiguous(),
        dx.view(tokens, n, C),
        dy,
        dh_post,
        dh_res,
    )
    return (
        dx,
        dy.view(y.shape).to(y.dtype),
        dh_post.view(h_post.shape).to(h_post.dtype),
        dh_res.view(h_res.shape).to(h_res.dtype),
    )


PRE_KERNELS = KernelBackend(forward=pre_forward, backward=pre_backward)
POST_KERNELS = KernelBackend(forward=post_forward, backward=post_backward)
