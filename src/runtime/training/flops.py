"""Matmul FLOPs of one training step, counted from the model config (for MFU), and the measured bf16 matmul rate.

A step is forward + backward, the backward two matmuls per forward one: 3x the forward's matmul FLOPs (2 per
multiply-add). Counted: every block's projections and feed-forward (HSTU layers have none) on the padded token grid,
and the sequence mixing (attention scores and values, or the chunked gated delta rule); not counted: the per-example
head, the context projection and the target attention (one query per example), under 1% at the presets' sizes.
"""

from __future__ import annotations

import time

import torch

GDR_CHUNK = 64  # chunk_gated_delta_rule's chunk length


def _target(cfg) -> str:
    return str(cfg.model._target_).rsplit(".", 1)[-1]


def forward_matmul_flops(cfg) -> float:
    """The model's forward matmul FLOPs on one batch of cfg.data.batch_size padded histories."""
    model, data = cfg.model, cfg.data
    d, heads, layers = model.d_model, model.n_heads, model.n_layers
    hidden = model.ffn_mult * d
    head_dim = d // heads
    kind = _target(cfg)
    length = data.seq_len + (0 if kind == "BaselinePCVR" else 1)  # the causal models append the target token
    tokens = data.batch_size * length
    ffn = 3 * d * hidden  # SwiGLU: gate and up, then down (multiply-adds per token)
    if kind == "GDRMixerPCVR":
        projections = 3 * d * d + d * d + d * 2 * heads + d * d  # qkv, output gate, decay and beta, out
        # per token and head: the causal intra-chunk products (q k^T, k k^T, their products with values: about
        # chunk * (dk + dv) / 2 each, two each) and the state's reads and update (3 dk dv)
        mixing = heads * (GDR_CHUNK * 2 * head_dim + 3 * head_dim * head_dim)
        per_token = projections + ffn + mixing
        return 2.0 * tokens * layers * per_token
    if kind == "HSTUPCVR":
        # no feed-forward: u, v, q and k in one projection of heads * head_dim columns each, then out; causal
        # pointwise attention (scores and values) at that width
        width = heads * (model.get("head_dim") or head_dim)
        return 2.0 * tokens * layers * (5 * d * width + length * width)
    projections = 4 * d * d  # qkv and out
    scores = 2 * length * d  # q k^T and p v over every key (multiply-adds per query token, all heads)
    if kind != "BaselinePCVR":
        scores //= 2  # causal: half the keys on average
    return 2.0 * tokens * layers * (projections + ffn + scores)


def step_matmul_flops(cfg) -> float:
    return 3.0 * forward_matmul_flops(cfg)


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
