"""Benchmark cases of the sampling ops (forward only: run with --mode fwd).

top_k: B=1, V=16M, k=100 (one long row: the split path) and B=1024, V=1M, k=64 (many rows). Peer: torch.topk (its
values are checked; its order among equal values is its own, so its indices are not).
sample: B=256, V=1M and B=32, V=150k, top_k=50, top_p=0.9. Every implementation draws its uniforms from a generator
seeded the same way on each call, so the reference check compares ids. Peer: the torch path of LLM serving code
without a fused kernel: a full stable sort of the row, top-k cut, softmax, cumsum, top-p mask, then the draw by
inversion (searchsorted) at the same uniform per row; torch.multinomial would draw from other random numbers and
could not be checked against the reference. flashinfer's sampling kernels are not installed on the GPU machine.
Bytes: the logits read once, the outputs written.
"""

from __future__ import annotations

import torch

from ...accelerators.sampling import sample, top_k
from ..case import Case, tensor_bytes

TOP_K_SHAPES = {"1x16M-k100": (1, 2**24, 100), "1024x1M-k64": (1024, 2**20, 64)}
SAMPLE_SHAPES = {"256x1M-k50-p0.9": (256, 2**20), "32x150k-k50-p0.9": (32, 150000)}
SEED = 1234


def _scores(rows: int, width: int, name: str):
    def make(device, dtype):
        return {name: torch.randn(rows, width, device=device, dtype=dtype) * 3}

    return make


def _top_k_bytes(k: int):
    def count(inputs, mode: str) -> int:
        x = inputs["scores"]
        return tensor_bytes(x) + x.shape[0] * k * (x.element_size() + 8)

    return count


def _sample_bytes(inputs, mode: str) -> int:
    x = inputs["logits"]
    return tensor_bytes(x) + x.shape[0] * 8


def _generator(logits: torch.Tensor) -> torch.Generator:
    return torch.Generator(logits.device).manual_seed(SEED)


def _sample(backend: str, inputs) -> torch.Tensor:
    logits = inputs["logits"]
    return sample(logits, top_k=50, top_p=0.9, generator=_generator(logits), backend=backend)


def torch_sort_path(logits: torch.Tensor, k: int = 50, p: float = 0.9) -> torch.Tensor:
    """The unfused torch path: sort the whole row, cut to k, softmax, cumsum, top-p, inverse CDF."""
    uniforms = torch.rand(logits.shape[0], generator=_generator(logits), device=logits.device)
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(values[:, :k].float(), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    last = (cdf < p).sum(-1, keepdim=True).clamp_max(k - 1)
    cdf = torch.where(torch.arange(k, device=cdf.device) <= last, cdf, cdf.gather(-1, last))
    pick = torch.searchsorted(cdf, uniforms[:, None] * cdf.gather(-1, last), right=True).clamp_max(last)
    return ids.gather(-1, pick).squeeze(-1)


CASES = [
    Case(
        op="sampling",
        shape=f"top_k-{name}",
        make_inputs=_scores(rows, width, "scores"),
        run=lambda backend, i, k=k: top_k(i["scores"], k, backend=backend),
        reference=lambda i, k=k: top_k(i["scores"], k, backend="torch"),
        bytes=_top_k_bytes(k),
        peers={"torch.topk": lambda i, k=k: torch.topk(i["scores"], k).values},
    )
    for name, (rows, width, k) in TOP_K_SHAPES.items()
] + [
    Case(
        op="sampling",
        shape=f"sample-{name}",
        make_inputs=_scores(rows, width, "logits"),
        run=_sample,
        reference=lambda i: _sample("torch", i),
        bytes=_sample_bytes,
        peers={"torch sort+cumsum": lambda i: torch_sort_path(i["logits"])},
    )
    for name, (rows, width) in SAMPLE_SHAPES.items()
]
