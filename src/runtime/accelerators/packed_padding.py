"""Packed (jagged) sequences as padded batches, for the torch backends: sequences of similar lengths padded to their
longest, so that one batched call serves a group instead of one call per sequence (a Python loop over a batch's
sequences took 0.34 s of a training step on an H200), within a budget of score elements per group and at most
doubling the work by padding."""

from __future__ import annotations

from collections.abc import Iterator

import torch

# the most score elements (sequences x heads x longest query x longest key) one padded group of sequences may hold
GROUP_SCORES = 1 << 25


def padded_groups(
    lengths_q: list[int], lengths_k: list[int], heads: int, budget: int = GROUP_SCORES
) -> Iterator[list[int]]:
    """The sequences in groups (lists of their indices), largest first, each group's padded score block within
    `budget` elements (a sequence larger than that alone makes a group of one) and each sequence's scores at least
    half its group's padded ones: padding at most doubles the work, in a few groups (about log2 of the largest
    sequence's score count over the smallest's)."""
    area = [lq * lk for lq, lk in zip(lengths_q, lengths_k)]
    order = sorted(range(len(lengths_q)), key=lambda s: (area[s], lengths_q[s]), reverse=True)
    group, longest_q, longest_k = [], 0, 0
    for s in order:
        grown_q, grown_k = max(longest_q, lengths_q[s]), max(longest_k, lengths_k[s])
        too_big = (len(group) + 1) * heads * grown_q * grown_k > budget
        if group and (too_big or 2 * area[s] < grown_q * grown_k):
            yield group
            group, grown_q, grown_k = [], lengths_q[s], lengths_k[s]
        group.append(s)
        longest_q, longest_k = grown_q, grown_k
    if group:
        yield group


class Padded:
    """The rows of some sequences of a packing, padded: `pad(x)` makes x [total, ...] into [n, longest, ...] (zeros
    past each sequence), and `rows` / `index` place row r of the packing at padded[index[0][r], index[1][r]]."""

    def __init__(self, offsets: list[int], lengths: list[int], sequences: list[int], device: torch.device):
        counts = [lengths[s] for s in sequences]
        self.n, self.longest = len(sequences), max(counts)
        count_t = torch.tensor(counts, device=device)
        total = sum(counts)
        sequence = torch.repeat_interleave(torch.arange(self.n, device=device), count_t, output_size=total)
        firsts = torch.tensor([offsets[s] for s in sequences], device=device)
        starts = torch.cumsum(count_t, 0) - count_t  # each sequence's first row among the group's
        position = torch.arange(total, device=device) - starts[sequence]
        self.rows = firsts[sequence] + position  # the rows of the packing, in the group's order
        self.index = (sequence, position)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(self.n, self.longest, *x.shape[1:]).index_put(self.index, x[self.rows])


def packed_order(groups: list[Padded], outs: list[torch.Tensor]) -> torch.Tensor:
    """The groups' outputs (each [rows of the group, ...] in its order) as the packing's rows, in packed order."""
    rows = torch.cat([g.rows for g in groups])
    return torch.cat(outs)[torch.argsort(rows)]
