"""top_k and sample in plain torch: CPU-safe, the semantics every backend follows.

top_k orders by value (NaN above +inf, as torch.topk; -0.0 equal to +0.0), then by ascending index among equal
values, so its result is exact and unique. It selects on integer keys that order as the floats do: torch.topk on
them picks the right k-th key, and the elements tied with it are then taken by lowest index.

sample draws from the top_k survivors of the raw logits (the same set whatever the temperature), in that order:
softmax(values / temperature), the top-p prefix, then the inverse CDF at one uniform per row.
"""

from __future__ import annotations

import torch

_KEY_DTYPES = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def sortable_keys(x: torch.Tensor, largest: bool = True) -> torch.Tensor:
    """Signed integers of x's width that order as (x, NaN highest) do, or the reverse when not largest (NaN lowest
    then, as torch.topk(largest=False) never prefers NaN). -0.0 and +0.0 get one key, every NaN another."""
    key_dtype = _KEY_DTYPES[x.dtype]
    info = torch.iinfo(key_dtype)
    bits = torch.where(x == 0, torch.zeros_like(x), x).view(key_dtype)
    keys = torch.where(bits < 0, bits ^ info.max, bits)  # negative floats: flip the magnitude bits
    keys = torch.where(torch.isnan(x), torch.full_like(keys, info.max), keys)
    if not largest:
        keys = torch.where(torch.isnan(x), torch.full_like(keys, info.min), -1 - keys)  # ~keys, NaN last
    return keys


def top_k_reference(scores: torch.Tensor, k: int, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of the k best of the last dim, best first, ties by ascending index."""
    keys = sortable_keys(scores.detach(), largest)
    kth = torch.topk(keys, k, dim=-1, largest=True, sorted=True).values[..., -1:]
    above = keys > kth
    tied = keys == kth
    wanted = k - above.sum(-1, keepdim=True)  # >= 1 tied elements per row
    take = above | (tied & (tied.cumsum(-1) <= wanted))
    # exactly k taken per row: each goes to its rank among the taken (ascending index), the others to a spare slot k.
    # No nonzero: its output size depends on the values (a host sync; a meta tensor has none)
    slot = torch.where(take, take.cumsum(-1) - 1, k)
    positions = torch.arange(keys.shape[-1], device=keys.device).expand_as(slot)
    chosen = slot.new_zeros(*slot.shape[:-1], k + 1).scatter_(-1, slot, positions)[..., :k]
    order = torch.sort(keys.gather(-1, chosen), dim=-1, descending=True, stable=True).indices
    indices = chosen.gather(-1, order)
    return scores.gather(-1, indices), indices


def restricted_draw(
    values: torch.Tensor,
    indices: torch.Tensor,
    keep_k: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One id per row from sorted candidates (values [B, K] best first, their ids): the first keep_k[b] of them,
    softmax(values / temperature[b]) over those, restricted to the prefix up to and including the first position
    whose cumulative probability reaches top_p[b], renormalised, inverted at uniforms[b] in [0, 1): the first kept
    position whose cumulative probability exceeds uniforms[b] times the kept mass. A row with a NaN among its first
    keep_k candidates, or whose candidates are all -inf, gives -1. The kernels compute the same steps in the same
    order."""
    compute = torch.promote_types(values.dtype, torch.float32)
    width = values.shape[-1]
    positions = torch.arange(width, device=values.device)
    in_k = positions < keep_k[:, None]
    z = values.to(compute) / temperature[:, None].to(compute)
    z = torch.where(in_k, z, torch.full_like(z, -torch.inf))
    p = torch.softmax(z, dim=-1)
    c = torch.cumsum(p, dim=-1)  # non-decreasing: the positions below top_p are a prefix
    below = (in_k & (c < top_p[:, None].to(compute))).sum(-1, keepdim=True)
    last = torch.minimum(below, keep_k[:, None].to(below.dtype) - 1)  # the position that crosses top_p is kept
    mass = c.gather(-1, last)
    target = uniforms[:, None].to(compute) * mass
    first = torch.where(c > target, positions, width).amin(-1, keepdim=True)
    pick = torch.minimum(first, last)  # past the last kept only when rounding puts the target at the mass
    ids = indices.gather(-1, pick).squeeze(-1)
    undefined = (torch.isnan(values) & in_k).any(-1) | (values[:, 0] == -torch.inf)  # the best is -inf: all are
    return torch.where(undefined, torch.full_like(ids, -1), ids)


def sample_reference(
    logits: torch.Tensor,
    keep_k: torch.Tensor,
    max_k: int,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; keep_k [B] (V where no top_k was given), max_k = its maximum; the other arguments [B]."""
    values, indices = top_k_reference(logits.detach(), max_k, largest=True)
    return restricted_draw(values, indices, keep_k, temperature, top_p, uniforms)
