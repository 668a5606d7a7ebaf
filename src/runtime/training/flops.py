"""Matmul FLOPs of one training step (for MFU), counted from the model config and the lengths of the sequences a batch
holds, and the measured bf16 matmul rate.

A step is forward + backward, the backward two matmuls per forward one: 3x the forward's matmul FLOPs (2 per
multiply-add). Counted: every block's projections and feed-forward (HSTU layers have none), once per token the model
mixes, and the sequence mixing (attention scores and values over each sequence's own keys, or the chunked gated delta
rule); not counted: the per-example head, the context projection and the target attention (one query per example),
under 1% at the presets' sizes. The causal models (all but the baseline) append the target token to each history, so
their sequences are one token longer than the histories.

Which lengths (`sequence_lengths`): a jagged batch (packed, cu_seqlens) computes each sequence at its own length,
attention over the sum of L_i^2 (query, key) pairs, halved when causal. A padded batch computes the whole padded grid,
every row at the batch's width, padding included: the projections, feed-forward, norms and the gated delta rule run
on every padded token on every backend, and torch's attention on every (query, key) pair. The flash_attention kernels
(Triton, TileLang) skip the key blocks past each row's key length, but not the padded query rows, so on padded batches
their attention does less than the grid counted here (an upper bound for that term); the grid is what the layout asks
for, and the same count for every backend keeps the MFU of the runs comparable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

GDR_CHUNK = 64  # chunk_gated_delta_rule's chunk length


def _target(cfg) -> str:
    return str(cfg.model._target_).rsplit(".", 1)[-1]


def appended_tokens(cfg) -> int:
    """The tokens the model appends to each history: 1 (the target) for the causal models, 0 for the baseline."""
    return 0 if _target(cfg) == "BaselinePCVR" else 1


def sequence_lengths(cfg, batch) -> torch.Tensor:
    """The length of each sequence the model mixes in `batch` (int64 [B]): a jagged batch's histories at their own
    lengths, a padded batch's rows at its width (the padded grid), plus the target token the causal models append."""
    if batch.jagged:
        lengths = batch.seq_lengths.long()
    else:
        lengths = torch.full((len(batch),), batch.seq_items.shape[1], dtype=torch.int64)
    return lengths + appended_tokens(cfg)


def padded_lengths(cfg) -> torch.Tensor:
    """cfg.data.batch_size histories of cfg.data.seq_len events (the padded grid), as sequence_lengths gives them."""
    return torch.full((cfg.data.batch_size,), cfg.data.seq_len + appended_tokens(cfg), dtype=torch.int64)


def forward_matmul_flops(cfg, lengths: Sequence[int] | torch.Tensor | None = None) -> float:
    """The model's forward matmul FLOPs on sequences of the given lengths (each with the appended target token, as
    sequence_lengths gives them); None: one batch of cfg.data.batch_size padded histories (padded_lengths)."""
    lengths = torch.as_tensor(padded_lengths(cfg) if lengths is None else lengths, dtype=torch.int64)
    tokens = int(lengths.sum())  # the per-token terms
    pairs = int((lengths * lengths).sum())  # the attention terms: every (query, key) pair within a sequence
    model = cfg.model
    d, heads, layers = model.d_model, model.n_heads, model.n_layers
    hidden = model.ffn_mult * d
    head_dim = d // heads
    kind = _target(cfg)
    ffn = 3 * d * hidden  # SwiGLU: gate and up, then down (multiply-adds per token)
    if kind == "GDRMixerPCVR":
        projections = 3 * d * d + d * d + d * 2 * heads + d * d  # qkv, output gate, decay and beta, out
        # per token and head: the causal intra-chunk products (q k^T, k k^T, their products with values: about
        # chunk * (dk + dv) / 2 each, two each) and the state's reads and update (3 dk dv)
        mixing = heads * (GDR_CHUNK * 2 * head_dim + 3 * head_dim * head_dim)
        return 2.0 * layers * tokens * (projections + ffn + mixing)
    if kind == "HSTUPCVR":
        # no feed-forward: u, v, q and k in one projection of heads * head_dim columns each, then out; causal
        # pointwise attention (scores and values) at that width: 2 * width per pair, half the pairs
        width = heads * (model.get("head_dim") or head_dim)
        return 2.0 * layers * (tokens * 5 * d * width + pairs * width)
    projections = 4 * d * d  # qkv and out
    attention = 2 * d  # q k^T and p v (multiply-adds per (query, key) pair, all heads)
    if kind != "BaselinePCVR":
        attention //= 2  # causal: half the pairs
    return 2.0 * layers * (tokens * (projections + ffn) + pairs * attention)


def step_matmul_flops(cfg, lengths: Sequence[int] | torch.Tensor | None = None) -> float:
    """A training step's matmul FLOPs (forward + backward) on sequences of the given lengths (forward_matmul_flops)."""
    return 3.0 * forward_matmul_flops(cfg, lengths)


def batch_step_matmul_flops(cfg, batch) -> float:
    """A training step's matmul FLOPs on `batch`, jagged or padded (sequence_lengths)."""
    return step_matmul_flops(cfg, sequence_lengths(cfg, batch))


def measured_bf16_matmul_rate(device: torch.device, size: int = 8192, repeats: int = 20) -> float | None:
    """FLOP/s of a bf16 [size, size] @ [size, size] product on this GPU (None off CUDA): MFU's denominator."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * size**3 * repeats / (time.perf_counter() - start)
