"""silu_attention in plain torch: one sequence at a time, CPU-safe, differentiable.

For sequence s (rows cu_seqlens[s]:cu_seqlens[s + 1]), query i and key j (local indices):

    score_ij = alpha * <q_i, k_j> + position_bias[min(|i - j|, P - 1)] + time_bias[time_bucket(|t_i - t_j|)]
    a_ij     = silu(score_ij) / max_seqlen where (i, j) is visible, else 0
    out_i    = sum_j dropout(a_ij) v_j

Half-precision inputs are computed in fp32; the result takes q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# |t_i - t_j| saturates here, so that 1 + |dt| fits in int64: a difference past int64 (timestamps of opposite signs far
# apart) takes bucket min(T - 1, 62) on every backend, the last the kernels hold
MAX_TIME_DIFFERENCE = 2**63 - 2


def time_differences(t_q: torch.Tensor, t_k: torch.Tensor) -> torch.Tensor:
    """|t_q - t_k| of int64 timestamps (broadcast), saturated at MAX_TIME_DIFFERENCE: int64 subtraction wraps past
    int64, which the signs show (t_q and t_k of opposite signs, the difference of the sign of t_k)."""
    d = t_q - t_k
    wrapped = ((t_q ^ t_k) & (t_q ^ d)) < 0
    d = d.abs()  # |-2^63| stays -2^63
    return torch.where(wrapped | (d < 0), MAX_TIME_DIFFERENCE, d.clamp_max(MAX_TIME_DIFFERENCE))


def time_buckets(dt: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """min(floor(log2(1 + dt)), n_buckets - 1) of int64 0 <= dt <= MAX_TIME_DIFFERENCE, exact (float64's log2 can be one
    off next to a power of two: corrected with integer comparisons)."""
    x = dt + 1
    b = torch.floor(torch.log2(x.double())).long().clamp(0, 61)
    one = torch.ones_like(x)
    b = b - (x < (one << b)).long() + (x >= (one << (b + 1))).long()
    return b.clamp_max(n_buckets - 1)


def visible_mask(n: int, causal: bool, n_targets: int | None, device) -> torch.Tensor:
    """[n, n] bool: query i sees key j. Causal: j <= i. The last n_targets tokens are candidates: a candidate key is
    seen by itself only."""
    i = torch.arange(n, device=device).view(-1, 1)
    j = torch.arange(n, device=device).view(1, -1)
    mask = j <= i if causal else torch.ones(n, n, dtype=torch.bool, device=device)
    if n_targets:
        mask = mask & ((j < n - n_targets) | (i == j))
    return mask


def _per_head(bias: torch.Tensor) -> torch.Tensor:
    """[P] or [H, P] as [1 or H, P]."""
    return bias.unsqueeze(0) if bias.dim() == 1 else bias


def silu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    alpha: float | None = None,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    keep: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """out [total, H, D] in q's dtype. keep: optional per-sequence dropout keep masks [H, n, n] (True = kept; kept
    weights are scaled by 1 / (1 - dropout_p)); without them dropout_p > 0 draws a mask from torch's generator."""
    d = q.shape[-1]
    alpha = d**-0.5 if alpha is None else alpha
    compute = torch.promote_types(q.dtype, torch.float32)
    offsets = cu_seqlens.tolist()
    targets = num_targets.tolist() if num_targets is not None else None
    outs = []
    for s in range(len(offsets) - 1):
        start, end = offsets[s], offsets[s + 1]
        n = end - start
        qs, ks, vs = (x[start:end].transpose(0, 1).to(compute) for x in (q, k, v))  # [H, n, D]
        scores = alpha * (qs @ ks.transpose(-1, -2))
        i = torch.arange(n, device=q.device).view(-1, 1)
        j = torch.arange(n, device=q.device).view(1, -1)
        if position_bias is not None:
            bias = _per_head(position_bias).to(compute)
            scores = scores + bias[:, (i - j).abs().clamp_max(bias.shape[-1] - 1)]
        if time_bias is not None:
            bias = _per_head(time_bias).to(compute)
            t = timestamps[start:end].long()
            scores = scores + bias[:, time_buckets(time_differences(t.view(-1, 1), t.view(1, -1)), bias.shape[-1])]
        mask = visible_mask(n, causal, targets[s] if targets is not None else None, q.device)
        weights = torch.where(mask, F.silu(scores) / max_seqlen, torch.zeros((), dtype=compute, device=q.device))
        if dropout_p > 0:
            kept = keep[s] if keep is not None else torch.rand_like(weights) >= dropout_p
            weights = weights * kept.to(q.device) / (1.0 - dropout_p)
        outs.append((weights @ vs).transpose(0, 1))
    if not outs:  # no sequence at all: an empty result that keeps q, k and v in the graph
        return q[:0] + k[:0] + v[:0]
    return torch.cat(outs).to(q.dtype)
