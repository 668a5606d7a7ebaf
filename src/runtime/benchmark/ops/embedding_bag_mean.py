"""Benchmark cases of embedding_bag_mean: the PCVR pooling shapes.

A 1M-row table, 8192 fixed-size bags of 4 or 8 indices, 25% of the entries padding, the rest
uniform or Zipf(1.1) over the rows (a few very hot rows); widths 64 and 128. The peer is
torch's own F.embedding_bag (the "torch" backend adds the device-side index check to it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...accelerators.embedding_bag_mean import embedding_bag_mean
from ...accelerators.embedding_bag_mean.reference import embedding_bag_mean_reference
from ..case import Case, tensor_bytes

VOCAB = 1_000_000
BAGS = 8192
PADDING_FRACTION = 0.25
PAD = 0  # padding_idx
ZIPF_S = 1.1


def sample_rows(n: int, rows: int, dist: str, device, generator: torch.Generator) -> torch.Tensor:
    """n row numbers: uniform, or Zipf(ZIPF_S) ranks mapped through a random permutation of the rows."""
    if dist == "uniform":
        return torch.randint(0, rows, (n,), device=device, generator=generator)
    probs = torch.arange(1, rows + 1, device=device, dtype=torch.float64).pow_(-ZIPF_S)
    ranks = torch.multinomial(probs, n, replacement=True, generator=generator)
    return torch.randperm(rows, device=device, generator=generator)[ranks]


def make_bags(device, bag: int, dist: str, bags: int = BAGS, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """[bags, bag] int64 indices, PADDING_FRACTION of them PAD."""
    generator = torch.Generator(device).manual_seed(seed)
    indices = sample_rows(bags * bag, vocab, dist, device, generator)
    padding = torch.rand(indices.shape, device=device, generator=generator) < PADDING_FRACTION
    return indices.masked_fill_(padding, PAD).reshape(bags, bag)


def _inputs(dim: int, bag: int, dist: str):
    def make(device, dtype):
        weight = torch.randn(VOCAB, dim, device=device, dtype=dtype).requires_grad_()
        return {"weight": weight, "indices": make_bags(device, bag, dist)}

    return make


def _bytes(inputs, mode: str) -> int:
    """fwd: read the indices and the rows of the non-padding entries, write the output.
    bwd: read the indices and the output gradient, write the dense [vocab, dim] weight gradient."""
    weight, indices = inputs["weight"], inputs["indices"]
    out_bytes = indices.shape[0] * weight.shape[1] * weight.element_size()
    if mode == "fwd":
        rows = int((indices != PAD).sum()) * weight.shape[1] * weight.element_size()
        return tensor_bytes(indices) + rows + out_bytes
    return tensor_bytes(indices, weight) + out_bytes


def _cases():
    peers = {"F.embedding_bag": lambda i: F.embedding_bag(i["indices"], i["weight"], mode="mean", padding_idx=PAD)}
    cases = []
    for dim in (64, 128):
        for bag in (4, 8):
            for dist in ("uniform", "zipf"):
                cases.append(
                    Case(
                        op="embedding_bag_mean",
                        shape=f"1Mx{dim}-B{BAGS}-bag{bag}-{dist}",
                        make_inputs=_inputs(dim, bag, dist),
                        run=lambda backend, i: embedding_bag_mean(
                            i["weight"], i["indices"], padding_idx=PAD, backend=backend
                        ),
                        reference=lambda i: embedding_bag_mean_reference(i["weight"], i["indices"], None, PAD),
                        bytes=_bytes,
                        peers=peers,
                    )
                )
    return cases


CASES = _cases()
