"""The bias gradients' last step, shared by both kernel backends: the dk/dv kernels' partial sums over signed
distances (written per program, no atomics) added over sequences and key blocks and folded into position buckets with
torch, in a fixed order, so the gradients repeat bit for bit."""

from __future__ import annotations

import torch


def fold_position_parts(pos_part: torch.Tensor, causal: bool, p: int) -> torch.Tensor:
    """[H, P] fp32 from pos_part [N, H, n_blocks, n_blocks + 1, B]: key block kb's slot s holds the sums over
    distances i - j = (first + s - kb) * B + v - (B - 1), v < B, where first, the first query block of its loop, is kb
    when causal and 0 otherwise."""
    part = pos_part.sum(0)  # [H, key block, slot, v]
    h, n_blocks, _, b = part.shape
    if causal or n_blocks == 0:  # slot s: distances s * B + v - (B - 1), whatever the key block
        flat, first_d = part.sum(1).flatten(1), -(b - 1)
    else:
        # sheared so that one column holds one distance (index s - kb + n_blocks - 1), then added over key blocks
        padded = torch.nn.functional.pad(part, (0, 0, n_blocks - 1, n_blocks - 1))
        s_h, s_kb, s_slot, _ = padded.stride()
        sheared = padded.as_strided((h, n_blocks, 2 * n_blocks, b), (s_h, s_kb + s_slot, s_slot, 1))
        flat, first_d = sheared.sum(1).flatten(1), -(n_blocks - 1) * b - (b - 1)
    return fold_flat_distances(flat, first_d, p)


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
