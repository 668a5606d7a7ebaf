"""Manifold-constrained hyper-connections (mHC) in plain torch: the golden reference.

x has n residual streams of width C: shape [..., n, C]. Per token:
    v = flatten(x)                          (length n*C)
    h = rsqrt(mean(v^2) + eps) * (v @ phi)  (phi: [n*C, n*n + 2n], the RMSNorm weight folded in)
    H_pre  = sigmoid(alpha[0] * h[:n] + bias[:n])
    H_post = 2 * sigmoid(alpha[1] * h[n:2n] + bias[n:2n])
    H_res  = sinkhorn(alpha[2] * h[2n:] + bias[2n:], viewed n x n)
    mhc_pre  -> (h_in = sum_i H_pre[i] * x[i], H_post, H_res)
    mhc_post -> x_next[i] = sum_j H_res[i, j] * x[j] + H_post[i] * y
H_post and H_res are fp32 (small per-token coefficients; fp32 keeps H_res doubly stochastic).
"""

from __future__ import annotations

import torch

from ..checks import compute_dtype


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """exp(logits) over the last two dims, then `iters` rounds of row then column normalisation.

    Computed in the log domain (a normalisation is a logsumexp subtraction) and exponentiated once at the end: logits
    spread past exp's range would underflow whole rows or columns to zero, leaving 0 / 0 in the backward.
    """
    for _ in range(iters):
        logits = logits.log_softmax(-1).log_softmax(-2)
    return logits.exp()


def mhc_coefficients(x, phi, alpha, bias, eps: float, sinkhorn_iters: int):
    """(H_pre, H_post, H_res) in the compute dtype (fp32, or float64 for float64 inputs)."""
    n = x.shape[-2]
    dtype = compute_dtype(x)
    v = x.to(dtype).flatten(-2)
    h = torch.rsqrt(v.square().mean(-1, keepdim=True) + eps) * (v @ phi.to(dtype))
    alpha, bias = alpha.to(dtype), bias.to(dtype)
    h_pre = torch.sigmoid(alpha[0] * h[..., :n] + bias[:n])
    h_post = 2 * torch.sigmoid(alpha[1] * h[..., n : 2 * n] + bias[n : 2 * n])
    res_logits = alpha[2] * h[..., 2 * n :] + bias[2 * n :]
    # reshape, not Tensor.unflatten: Dynamo in torch 2.11 cannot trace the super() call that method is written with
    res_logits = res_logits.reshape(*res_logits.shape[:-1], n, n)
    return h_pre, h_post, sinkhorn(res_logits, sinkhorn_iters)


def mhc_pre_reference(x, phi, alpha, bias, eps: float = 1e-6, sinkhorn_iters: int = 20):
    h_pre, h_post, h_res = mhc_coefficients(x, phi, alpha, bias, eps, sinkhorn_iters)
    h_in = (h_pre.unsqueeze(-1) * x.to(h_pre.dtype)).sum(-2)
    return h_in.to(x.dtype), h_post, h_res


def mhc_post_reference(x, y, h_post, h_res):
    dtype = compute_dtype(x)
    mixed = h_res.to(dtype) @ x.to(dtype)
    return (mixed + h_post.to(dtype).unsqueeze(-1) * y.to(dtype).unsqueeze(-2)).to(x.dtype)
