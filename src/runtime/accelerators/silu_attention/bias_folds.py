"""The bias gradients' last step, shared by both kernel backends: partial sums over signed distances (the kernels
write them, no atomics) folded into position buckets with torch, in a fixed order, so the gradients repeat bit for
bit."""

from __future__ import annotations

import torch


def fold_distances(part: torch.Tensor, block: int, first_band: int, p: int) -> torch.Tensor:
    """[H, P]: part [H, bands, 2 * block] holds sums over signed distances d = (first_band + band) * block + u -
    (block - 1); each is added to bucket min(|d|, P - 1)."""
    h, bands, _ = part.shape
    flat = part.new_zeros(h, (bands + 1) * block)  # flat[f]: distance first_band * block - (block - 1) + f
    flat[:, : bands * block] += part[..., :block].reshape(h, -1)
    flat[:, block:] += part[..., block:].reshape(h, -1)
    return fold_flat_distances(flat, first_band * block - (block - 1), p)


def fold_flat_distances(flat: torch.Tensor, first_d: int, p: int) -> torch.Tensor:
    """[H, P]: flat [H, F] holds sums over signed distances first_d + f (first_d <= 0); each is added to bucket
    min(|d|, P - 1)."""
    h = flat.shape[0]
    by_distance = flat.new_zeros(h, max(flat.shape[1] + first_d, 1 - first_d))  # by |d|
    ahead = flat[:, -first_d:]  # d >= 0
    by_distance[:, : ahead.shape[1]] += ahead
    behind = flat[:, :-first_d].flip(1)  # d = -1, -2, ...
    by_distance[:, 1 : behind.shape[1] + 1] += behind
    out = flat.new_zeros(h, p)
    kept = min(p - 1, by_distance.shape[1])
    out[:, :kept] = by_distance[:, :kept]
    out[:, p - 1] += by_distance[:, p - 1 :].sum(1)
    return out
