"""silu_attention in plain torch: groups of sequences padded together (one at a time under torch.compile), CPU-safe,
differentiable.

For sequence s (rows cu_seqlens[s]:cu_seqlens[s + 1]), query i and key j (local indices):

    score_ij = alpha * <q_i, k_j> + position_bias[min(|i - j|, P - 1)] + time_bias[time_bucket(|t_i - t_j|)]
    a_ij     = silu(score_ij) / max_seqlen where (i, j) is visible, else 0
    out_i    = sum_j dropout(a_ij) v_j

Half-precision inputs are computed in fp32; the result takes q's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..packed_padding import GROUP_SCORES, Padded, packed_order, padded_groups

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


def _visible(i: torch.Tensor, j: torch.Tensor, n, n_targets, causal: bool) -> torch.Tensor:
    """Query i sees key j of a sequence of n tokens whose last n_targets are candidates (n and n_targets: ints, or
    tensors that broadcast with i and j; n_targets None or 0: no candidates). Both within the sequence; causal:
    j <= i; a candidate key is seen by itself only."""
    mask = (i < n) & (j < n)
    if causal:
        mask = mask & (j <= i)
    if n_targets is not None:
        mask = mask & ((j < n - n_targets) | (i == j))
    return mask


def visible_mask(n: int, causal: bool, n_targets: int | None, device) -> torch.Tensor:
    """[n, n] bool: query i sees key j (_visible) in one sequence of n tokens."""
    i = torch.arange(n, device=device)
    return _visible(i.view(-1, 1), i.view(1, -1), n, n_targets or None, causal)


def _per_head(bias: torch.Tensor) -> torch.Tensor:
    """[P] or [H, P] as [1 or H, P]."""
    return bias.unsqueeze(0) if bias.dim() == 1 else bias


def _scores(qs, ks, alpha, position_bias, time_bias, t) -> torch.Tensor:
    """alpha <q_i, k_j> plus the biases, [n, H, L, L], of padded sequences qs, ks [n, H, L, D] with timestamps t
    [n, L] (None without a time bias)."""
    scores = alpha * (qs @ ks.transpose(-1, -2))
    if position_bias is not None:
        bias = _per_head(position_bias).to(scores.dtype)
        i = torch.arange(qs.shape[2], device=qs.device)
        scores = scores + bias[:, (i.view(-1, 1) - i.view(1, -1)).abs().clamp_max(bias.shape[-1] - 1)]
    if time_bias is not None:
        bias = _per_head(time_bias).to(scores.dtype)
        buckets = time_buckets(time_differences(t[:, :, None], t[:, None, :]), bias.shape[-1])
        scores = scores + bias[:, buckets].transpose(0, 1)
    return scores


def _attend(scores, mask, vs, max_seqlen: int, dropout_p: float, kept) -> torch.Tensor:
    """sum_j dropout(silu(score_ij) / max_seqlen where visible) v_j, [n, H, L, D]; kept: the keep mask or None (drawn
    from torch's generator)."""
    weights = torch.where(mask, F.silu(scores) / max_seqlen, torch.zeros((), dtype=scores.dtype, device=vs.device))
    if dropout_p > 0:
        kept = torch.rand_like(weights) >= dropout_p if kept is None else kept.to(vs.device)
        weights = weights * kept / (1.0 - dropout_p)
    return weights @ vs


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
    group_scores: int = GROUP_SCORES,
) -> torch.Tensor:
    """out [total, H, D] in q's dtype. keep: optional per-sequence dropout keep masks [H, n, n] (True = kept; kept
    weights are scaled by 1 / (1 - dropout_p)); without them dropout_p > 0 draws a mask from torch's generator.
    Sequences of similar lengths are padded to their longest and computed together, at most `group_scores` score
    elements a group (packed_padding); under torch.compile one sequence at a time, so that a new packing costs one
    dynamic recompile at most."""
    alpha = q.shape[-1] ** -0.5 if alpha is None else alpha
    dtype, compute = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v = (x.to(compute) for x in (q, k, v))
    offsets = cu_seqlens.tolist()
    targets = num_targets.tolist() if num_targets is not None else None
    terms = _Terms(alpha, causal, position_bias, time_bias, timestamps, max_seqlen, dropout_p, keep)
    if torch.compiler.is_compiling():
        out = _per_sequence(q, k, v, offsets, targets, terms)
    else:
        out = _grouped(q, k, v, offsets, targets, terms, group_scores)
    if out is None:  # no sequence at all: an empty result that keeps q, k and v in the graph
        out = q[:0] + k[:0] + v[:0]
    return out.to(dtype)


class _Terms(NamedTuple):
    """The arguments of silu_attention_reference that both ways of walking the sequences pass on as they are."""

    alpha: float
    causal: bool
    position_bias: torch.Tensor | None
    time_bias: torch.Tensor | None
    timestamps: torch.Tensor | None
    max_seqlen: int
    dropout_p: float
    keep: list[torch.Tensor] | None


def _per_sequence(q, k, v, offsets, targets, terms: _Terms):
    outs = []
    for s in range(len(offsets) - 1):
        start, end = offsets[s], offsets[s + 1]
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
        t = terms.timestamps[start:end].long().unsqueeze(0) if terms.time_bias is not None else None
        scores = _scores(qs, ks, terms.alpha, terms.position_bias, terms.time_bias, t)
        mask = visible_mask(end - start, terms.causal, targets[s] if targets is not None else None, q.device)
        kept = terms.keep[s].unsqueeze(0) if terms.keep is not None else None
        outs.append(_attend(scores, mask, vs, terms.max_seqlen, terms.dropout_p, kept)[0].transpose(0, 1))
    return torch.cat(outs) if outs else None


def _grouped(q, k, v, offsets, targets, terms: _Terms, group_scores: int):
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    groups, outs = [], []
    for sequences in padded_groups(lengths, lengths, q.shape[1], group_scores):
        rows = Padded(offsets, lengths, sequences, q.device)
        qs, ks, vs = (rows.pad(x).transpose(1, 2) for x in (q, k, v))  # [n, H, L, D]
        t = rows.pad(terms.timestamps.long()) if terms.time_bias is not None else None
        scores = _scores(qs, ks, terms.alpha, terms.position_bias, terms.time_bias, t)
        i = torch.arange(rows.longest, device=q.device)
        n = torch.tensor([lengths[s] for s in sequences], device=q.device).view(-1, 1, 1)
        n_targets = torch.tensor([targets[s] for s in sequences], device=q.device).view(-1, 1, 1) if targets else None
        mask = _visible(i.view(1, -1, 1), i.view(1, 1, -1), n, n_targets, terms.causal).unsqueeze(1)
        kept = _padded_keep([terms.keep[s] for s in sequences], rows.longest) if terms.keep is not None else None
        groups.append(rows)
        outs.append(_attend(scores, mask, vs, terms.max_seqlen, terms.dropout_p, kept).transpose(1, 2)[rows.index])
    return packed_order(groups, outs) if outs else None


def _padded_keep(keeps: list[torch.Tensor], longest: int) -> torch.Tensor:
    """Per-sequence keep masks [H, n, n] as one [N, H, longest, longest] (False past each sequence)."""
    padded = torch.zeros(len(keeps), keeps[0].shape[0], longest, longest, dtype=torch.bool, device=keeps[0].device)
    for s, kept in enumerate(keeps):
        n = kept.shape[-1]
        padded[s, :, :n, :n] = kept
    return padded
