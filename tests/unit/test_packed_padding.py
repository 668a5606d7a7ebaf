"""packed_padding: the groups of sequences the torch backends pad together, and the padding round trip."""

import random

import pytest
import torch

from runtime.accelerators.packed_padding import Padded, packed_order, padded_groups


@pytest.mark.parametrize("budget", [1, 500, 1 << 25])
def test_groups_cover_each_sequence_once_within_the_budget_and_twice_the_work(budget):
    rng = random.Random(budget)
    lengths_q = [rng.choice([0, 1, rng.randrange(2, 300)]) for _ in range(200)]
    lengths_k = [rng.choice([0, lq, rng.randrange(1, 300)]) for lq in lengths_q]
    heads = 2
    groups = list(padded_groups(lengths_q, lengths_k, heads, budget))
    assert sorted(s for group in groups for s in group) == list(range(200))
    for group in groups:
        longest_q, longest_k = max(lengths_q[s] for s in group), max(lengths_k[s] for s in group)
        padded = longest_q * longest_k
        assert len(group) == 1 or len(group) * heads * padded <= budget
        # each sequence's scores at least half its group's padded block (zero-sized ones in groups of zero blocks)
        assert all(2 * lengths_q[s] * lengths_k[s] >= padded for s in group), group


def test_padding_round_trip_keeps_every_row_and_its_gradient():
    lengths = [3, 0, 5, 1, 4]
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x = torch.randn(sum(lengths), 2, 3, requires_grad=True)
    groups = [Padded(offsets, lengths, sequences, x.device) for sequences in ([2, 4], [0, 3], [1])]
    padded = [g.pad(x) for g in groups]
    assert padded[0].shape == (2, 5, 2, 3)
    assert torch.equal(padded[0][0], x[3:8]) and torch.equal(padded[0][1, :4], x[9:13])
    assert torch.equal(padded[0][1, 4], torch.zeros(2, 3))  # past the sequence: zeros
    back = packed_order(groups, [p[g.index] for g, p in zip(groups, padded)])
    assert torch.equal(back, x)
    (grad,) = torch.autograd.grad(back, x, torch.ones_like(back))
    assert torch.equal(grad, torch.ones_like(x))
