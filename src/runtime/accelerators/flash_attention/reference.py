"""Attention in plain torch: the torch backend (SDPA) and a float64 textbook reference for tests.

Both follow the op's semantics: causal is aligned top-left as in SDPA (query i sees keys j <= i),
`key_lengths[b]` hides keys j >= key_lengths[b], a bool `attn_mask` (True = visible) combines
with both, and a query row that sees no key gives zeros (SDPA alone gives NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..packed_padding import GROUP_SCORES, Padded, packed_order, padded_groups


def visible_mask(
    batch: int,
    lq: int,
    lk: int,
    device: torch.device,
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The bool mask (True = visible) broadcastable to [B, H, Lq, Lk], or None when every key is visible."""
    mask = None
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    if key_lengths is not None:
        keys = torch.arange(lk, device=device) < key_lengths.to(device).view(batch, 1, 1, 1)
        mask = keys if mask is None else mask & keys
    if attn_mask is not None:
        if attn_mask.dim() < 2:  # [Lk] or a scalar: SDPA takes a mask with the query and key dims
            attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
        mask = attn_mask if mask is None else mask & attn_mask
    return mask


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, H, L, D], each kv head serving H // Hkv consecutive query heads (GQA)."""
    b, hkv, length, d = x.shape
    if hkv == heads:
        return x
    return x[:, :, None].expand(b, hkv, heads // hkv, length, d).reshape(b, heads, length, d)


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """The torch backend: SDPA with the combined mask; rows that see no key give zeros."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    k, v = repeat_kv(k, h), repeat_kv(v, h)
    if lk == 0:  # no key at all: every row is empty; an empty product keeps q, k and v in the graph (zero gradients)
        return q @ k.transpose(-1, -2) @ v
    if key_lengths is None and attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    mask = visible_mask(b, lq, lk, q.device, causal, key_lengths, attn_mask)
    seen = mask.any(-1, keepdim=True)
    # SDPA turns a row without a visible key into NaN, whose gradient would then spread NaN into
    # dk/dv: let such rows see every key, and zero their output afterwards.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~seen, dropout_p=dropout_p, scale=scale)
    return out.masked_fill(~seen, 0)


def attention_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Textbook attention in float64, differentiable, for tests.

    keep: an optional dropout keep mask [B, H, Lq, Lk] (True = kept); kept probabilities are
    scaled by 1 / (1 - dropout_p). The result is float64.
    """
    b, h, lq, d = q.shape
    lk = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    q, k, v = q.double(), repeat_kv(k.double(), h), repeat_kv(v.double(), h)
    scores = q @ k.transpose(-1, -2) * scale
    mask = visible_mask(b, lq, lk, q.device, causal, key_lengths, attn_mask)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach() if lk > 0 else scores.new_zeros(b, h, lq, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    probs = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    if keep is not None:
        probs = probs * keep.to(probs.device) / (1.0 - dropout_p)
    return probs @ v


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(rows of q, rows of k) of each packed sequence, as slices (reads the offsets on the host)."""
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(offsets_q) - 1):
        yield slice(offsets_q[s], offsets_q[s + 1]), slice(offsets_k[s], offsets_k[s + 1])


def _as_batch(x: torch.Tensor) -> torch.Tensor:
    """A packed sequence's rows [L, H, D] as a batch of one [1, H, L, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def flash_attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    group_scores: int = GROUP_SCORES,
) -> torch.Tensor:
    """The torch backend for packed sequences ([total_q, H, D]): equal to the op on each sequence alone. Sequences
    of similar lengths are padded to their longest and go through SDPA together, the keys past each sequence hidden
    as key_lengths hides them: one call per group of at most `group_scores` score elements (packed_padding)."""
    if torch.compiler.is_compiling():  # groups chosen by the lengths would specialise the graph on every batch
        return _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, dropout_p, scale)
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lengths_q = [b - a for a, b in zip(offsets_q, offsets_q[1:])]
    lengths_k = [b - a for a, b in zip(offsets_k, offsets_k[1:])]
    groups, outs = [], []
    for sequences in padded_groups(lengths_q, lengths_k, q.shape[1], group_scores):
        rows_q = Padded(offsets_q, lengths_q, sequences, q.device)
        rows_k = rows_q if offsets_k == offsets_q else Padded(offsets_k, lengths_k, sequences, q.device)
        q_pad, k_pad, v_pad = (rows.pad(x).transpose(1, 2) for rows, x in ((rows_q, q), (rows_k, k), (rows_k, v)))
        key_lengths = torch.tensor([lengths_k[s] for s in sequences], device=q.device)
        out = flash_attention_reference(q_pad, k_pad, v_pad, causal, key_lengths, None, dropout_p, scale)
        groups.append(rows_q)
        outs.append(out.transpose(1, 2)[rows_q.index])
    return packed_order(groups, outs) if outs else _no_sequence(q, k, v)


def _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, dropout_p, scale) -> torch.Tensor:
    """flash_attention_varlen_reference one sequence at a time (under torch.compile, where a new total then costs one
    dynamic recompile at most)."""
    outs = [
        flash_attention_reference(
            _as_batch(q[rows_q]), _as_batch(k[rows_k]), _as_batch(v[rows_k]), causal, None, None, dropout_p, scale
        )[0].transpose(0, 1)
        for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k)
    ]
    return torch.cat(outs) if outs else _no_sequence(q, k, v)


def attention_float64_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    keeps: list[torch.Tensor] | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """attention_float64 on each packed sequence alone, concatenated ([total_q, H, D] float64); keeps: an optional
    dropout keep mask [H, Lq_s, Lk_s] per sequence (dropout.varlen_keep_masks)."""
    outs = []
    for s, (rows_q, rows_k) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        keep = None if keeps is None else keeps[s].unsqueeze(0)
        out = attention_float64(
            _as_batch(q[rows_q]),
            _as_batch(k[rows_k]),
            _as_batch(v[rows_k]),
            causal,
            scale=scale,
            keep=keep,
            dropout_p=dropout_p,
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else _no_sequence(q.double(), k, v)


def _no_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The empty result of no packed sequence (q, k and v empty), with q, k and v in the graph (zero gradients, as
    the kernels give); k and v may have fewer heads than q."""
    return q * 0 + (k.sum() + v.sum()) * 0
