"""Benchmark cases of flash_attention: the PCVR shapes (causal and not, with and without key_lengths)
and a large shape, beside SDPA's flash, efficient and cuDNN backends (with the equivalent mask when
key_lengths is given)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...accelerators.flash_attention import flash_attention
from ...accelerators.flash_attention.reference import attention_float64, visible_mask
from ..case import Case, tensor_bytes

# name -> (B, H, L, D)
SHAPES = {
    "pcvr-256x4x256x16": (256, 4, 256, 16),
    "pcvr-128x8x1024x32": (128, 8, 1024, 32),
    "pcvr-64x4x2048x48": (64, 4, 2048, 48),
    "large-4x16x4096x128": (4, 16, 4096, 128),
}


def _inputs(b: int, h: int, length: int, d: int, lengths: bool):
    def make(device, dtype):
        inputs = {name: torch.randn(b, h, length, d, device=device, dtype=dtype, requires_grad=True) for name in "qkv"}
        if lengths:  # key padding: between half and all of the keys are real
            inputs["key_lengths"] = torch.randint(length // 2, length + 1, (b,), device=device)
        return inputs

    return make


def _visible_pairs(inputs, causal: bool) -> float:
    """(query, key) pairs that attention computes, summed over batch and heads."""
    q, k = inputs["q"], inputs["k"]
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    lengths = inputs.get("key_lengths")
    per_row = [lk] * b if lengths is None else lengths.tolist()
    pairs = 0
    for n in per_row:
        if causal:  # query i sees min(i + 1, n) keys
            full = min(lq, n)
            pairs += full * (full + 1) // 2 + (lq - full) * n
        else:
            pairs += lq * n
    return float(pairs * h)


def _flops(causal: bool):
    def flops(inputs, mode: str) -> float:
        forward = 4.0 * _visible_pairs(inputs, causal) * inputs["q"].shape[-1]
        return forward if mode == "fwd" else 2.5 * forward  # backward counted as 2.5x forward

    return flops


def _bytes(inputs, mode: str) -> int:
    """fwd: read q, k, v, write o (and the fp32 lse). bwd: read q, k, v, o, do, lse, write dq, dk, dv."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    lse = q.numel() // q.shape[-1] * 4
    if mode == "fwd":
        return tensor_bytes(q, k, v, q) + lse
    return tensor_bytes(q, k, v, q, q) + lse + tensor_bytes(q, k, v)


def _sdpa(backend_name: str, causal: bool):
    def run(inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        lengths = inputs.get("key_lengths")
        mask = None
        if lengths is not None:
            mask = visible_mask(q.shape[0], q.shape[2], k.shape[2], q.device, causal, lengths)
        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)

    return run


def _case(name: str, shape, causal: bool, lengths: bool) -> Case:
    peers = {
        f"sdpa {label}": _sdpa(backend, causal)
        for label, backend in (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"))
        if not (lengths and backend == "FLASH_ATTENTION")  # the flash backend takes no mask
    }
    return Case(
        op="flash_attention",
        shape=name + ("-causal" if causal else "") + ("-lengths" if lengths else ""),
        make_inputs=_inputs(*shape, lengths),
        run=lambda backend, i: flash_attention(i["q"], i["k"], i["v"], causal=causal, key_lengths=i.get("key_lengths"), backend=backend),
        reference=lambda i: attention_float64(i["q"], i["k"], i["v"], causal=causal, key_lengths=i.get("key_lengths")),
        bytes=_bytes,
        flops=_flops(causal),
        peers=peers,
    )


CASES = [
    _case(name, shape, causal, lengths)
    for name, shape in SHAPES.items()
    for causal in (False, True)
    for lengths in ((False, True) if name.startswith("pcvr") else (False,))
]
