"""Benchmark cases of silu_attention: HSTU attention over packed sequences, causal, with position and time biases.

Shapes: 256 sequences of up to 512 tokens and 64 of up to 2048 (lengths drawn uniformly from 1 to L, mean about
L / 2), 4 heads, head dims 32 and 64. FLOPs count only the (query, key) pairs of real tokens. Peers: the same
attention on sequences padded to L ([N, H, L, L] scores, masked), eager and under torch.compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...accelerators.silu_attention import silu_attention
from ...accelerators.silu_attention.reference import silu_attention_reference, time_buckets, time_differences
from ..case import Case, tensor_bytes
from ..peers import compiled

HEADS = 4
TIME_BUCKETS = 32
# name -> (sequences N, longest L, head dim D)
SHAPES = {
    "256xL512-h4-d32": (256, 512, 32),
    "256xL512-h4-d64": (256, 512, 64),
    "64xL2048-h4-d32": (64, 2048, 32),
    "64xL2048-h4-d64": (64, 2048, 64),
}


def _inputs(n: int, longest: int, d: int):
    def make(device, dtype):
        lengths = torch.randint(1, longest + 1, (n,))
        total = int(lengths.sum())
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        inputs = {name: torch.randn(total, HEADS, d, device=device, dtype=dtype, requires_grad=True) for name in "qkv"}
        gaps = torch.randint(0, 3600, (total,)) * torch.randint(0, 2, (total,))  # seconds, some events at once
        # where each token sits in the padded [N, L] layout (the peers'), and which padded slots are real
        seq = torch.repeat_interleave(torch.arange(n), lengths)
        local = torch.arange(total) - cu[:-1].long()[seq]
        slot = torch.full((n, longest), total, dtype=torch.long)  # row `total`: a zero row appended by the peer
        slot[seq, local] = torch.arange(total)
        inputs |= {
            "position_bias": (0.1 * torch.randn(HEADS, longest, device=device)).requires_grad_(),
            "time_bias": (0.1 * torch.randn(HEADS, TIME_BUCKETS, device=device)).requires_grad_(),
            "cu_seqlens": cu.to(device),
            "timestamps": (1_700_000_000 + gaps.cumsum(0)).to(device),
            "padded_slot": slot.to(device),
            "token_slot": (seq * longest + local).to(device),
            "max_seqlen": longest,
        }
        return inputs

    return make


def _run(backend, i):
    return silu_attention(
        i["q"],
        i["k"],
        i["v"],
        i["cu_seqlens"],
        max_seqlen=i["max_seqlen"],
        position_bias=i["position_bias"],
        time_bias=i["time_bias"],
        timestamps=i["timestamps"],
        backend=backend,
    )


def _reference(i):
    return silu_attention_reference(
        i["q"],
        i["k"],
        i["v"],
        i["cu_seqlens"],
        i["max_seqlen"],
        position_bias=i["position_bias"],
        time_bias=i["time_bias"],
        timestamps=i["timestamps"],
    )


def padded_silu_attention(q, k, v, position_bias, time_bias, timestamps, padded_slot, token_slot, max_seqlen: int):
    """silu_attention (causal, [H, P] / [H, T] biases) on the sequences padded to L = padded_slot.shape[1]:
    [N, H, L, L] scores, padded keys masked; the result gathered back to [total, H, D]."""
    n, length = padded_slot.shape
    total, h, d = q.shape

    def pad(x):  # [total, ...] -> [N, L, ...] with zeros past each sequence
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[padded_slot]

    qp, kp, vp = (pad(x).transpose(1, 2) for x in (q, k, v))  # [N, H, L, D]
    scores = (qp @ kp.transpose(-1, -2)).float() * d**-0.5
    i = torch.arange(length, device=q.device)
    distance = (i.view(-1, 1) - i.view(1, -1)).abs().clamp_max(position_bias.shape[-1] - 1)
    scores = scores + position_bias[:, distance].float()
    t = pad(timestamps)
    buckets = time_buckets(time_differences(t.view(n, -1, 1), t.view(n, 1, -1)), time_bias.shape[-1])  # [N, L, L]
    scores = scores + time_bias[:, buckets].transpose(0, 1).float()
    real = padded_slot < total
    visible = (i.view(-1, 1) >= i.view(1, -1)) & real.view(n, 1, 1, length)
    weights = torch.where(visible, F.silu(scores) / max_seqlen, 0.0).to(v.dtype)
    out = (weights @ vp).transpose(1, 2).reshape(n * length, h, d)
    return out[token_slot]


def _padded(eager: bool):
    def run(i):
        fn = padded_silu_attention if eager else compiled(padded_silu_attention)
        return fn(
            i["q"],
            i["k"],
            i["v"],
            i["position_bias"],
            i["time_bias"],
            i["timestamps"],
            i["padded_slot"],
            i["token_slot"],
            i["max_seqlen"],
        )

    return run


def _visible_pairs(i) -> float:
    """Causal (query, key) pairs of real tokens, over every sequence and head."""
    lengths = (i["cu_seqlens"][1:] - i["cu_seqlens"][:-1]).long()
    return float((lengths * (lengths + 1) // 2).sum()) * i["q"].shape[1]


def _flops(i, mode: str) -> float:
    forward = 4.0 * _visible_pairs(i) * i["q"].shape[-1]  # q k^T and a v
    return forward if mode == "fwd" else 2.5 * forward  # q k^T, do v^T, dq, dk, dv


def _bytes(i, mode: str) -> int:
    """fwd: read q, k, v, the biases, timestamps and offsets, write o. bwd: read them and do, write dq, dk, dv and the
    bias gradients."""
    q, k, v = i["q"], i["k"], i["v"]
    side = tensor_bytes(i["position_bias"], i["time_bias"], i["timestamps"], i["cu_seqlens"])
    if mode == "fwd":
        return tensor_bytes(q, k, v, q) + side
    return tensor_bytes(q, k, v, q, q, k, v) + side + tensor_bytes(i["position_bias"], i["time_bias"])


CASES = [
    Case(
        op="silu_attention",
        shape=name,
        make_inputs=_inputs(*shape),
        run=_run,
        reference=_reference,
        bytes=_bytes,
        flops=_flops,
        peers={"padded torch eager": _padded(True), "padded torch.compile": _padded(False)},
    )
    for name, shape in SHAPES.items()
]
