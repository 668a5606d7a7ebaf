"""Benchmark cases of flash_attention: the PCVR shapes (causal and not, with and without key_lengths)
and a large shape, beside SDPA's flash, efficient and cuDNN backends (with the equivalent mask when
key_lengths is given); packed (varlen) sequences beside SDPA on the padded batch, and beside our op on a
dense batch of the same token count (its own case, "-dense-same-tokens")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...accelerators.flash_attention import flash_attention
from ...accelerators.flash_attention.reference import attention_float64, attention_float64_varlen, visible_mask
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
        for label, backend in (
            ("flash", "FLASH_ATTENTION"),
            ("efficient", "EFFICIENT_ATTENTION"),
            ("cudnn", "CUDNN_ATTENTION"),
        )
        if not (lengths and backend == "FLASH_ATTENTION")  # the flash backend takes no mask
    }
    return Case(
        op="flash_attention",
        shape=name + ("-causal" if causal else "") + ("-lengths" if lengths else ""),
        make_inputs=_inputs(*shape, lengths),
        run=lambda backend, i: flash_attention(
            i["q"], i["k"], i["v"], causal=causal, key_lengths=i.get("key_lengths"), backend=backend
        ),
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


# --------------------------------------------------------------------------- packed (varlen) sequences

# name -> (N sequences, H, longest length L): lengths uniform in [1, L - 1] in pairs (l, L - l), so the mean is L / 2
# and the packed length N * L / 2 is the token count of the dense batch [N, H, L / 2, D] it is compared with
VARLEN_SHAPES = {"varlen-256x4x512": (256, 4, 512), "varlen-64x4x2048": (64, 4, 2048)}
VARLEN_HEAD_DIMS = (32, 64)


def _varlen_lengths(n: int, longest: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)  # the same packing for every backend and peer
    half = torch.randint(1, longest, (n // 2,), generator=generator)
    return torch.cat([half, longest - half])[torch.randperm(n, generator=generator)]


def _varlen_inputs(n: int, h: int, longest: int, d: int):
    def make(device, dtype):
        lengths = _varlen_lengths(n, longest)
        total = int(lengths.sum())
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        inputs = {name: torch.randn(total, h, d, device=device, dtype=dtype, requires_grad=True) for name in "qkv"}
        # for the SDPA peers: each packed row's row in the padded batch [N * L], and the padded batch's causal mask
        starts = torch.repeat_interleave(cu[:-1].long(), lengths)
        sequence = torch.repeat_interleave(torch.arange(n), lengths)
        inputs["rows"] = (sequence * longest + torch.arange(total) - starts).to(device)
        inputs["mask"] = visible_mask(n, longest, longest, device, True, lengths.to(device))
        inputs["cu_seqlens"] = cu.to(device)
        inputs["max_seqlen"] = int(lengths.max())  # given: no host read of the offsets per call
        return inputs

    return make


def _varlen_flops(inputs, mode: str) -> float:
    """Over real tokens: causal (query, key) pairs of each sequence, 4 * D per pair forward, backward 2.5x."""
    lengths = (inputs["cu_seqlens"][1:] - inputs["cu_seqlens"][:-1]).double()
    pairs = float((lengths * (lengths + 1) / 2).sum()) * inputs["q"].shape[1]
    forward = 4.0 * pairs * inputs["q"].shape[-1]
    return forward if mode == "fwd" else 2.5 * forward


def _run_varlen(backend, i):
    m = i["max_seqlen"]
    return flash_attention(
        i["q"],
        i["k"],
        i["v"],
        causal=True,
        cu_seqlens_q=i["cu_seqlens"],
        cu_seqlens_k=i["cu_seqlens"],
        max_seqlen_q=m,
        max_seqlen_k=m,
        backend=backend,
    )


def _sdpa_padded(backend_name: str):
    """SDPA on the padded batch [N, H, L, D] with the padding (and causal) mask: the packed rows scattered in, the
    real rows gathered out (both part of the time: what a padded batch costs for packed data)."""

    def run(inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        rows, mask = inputs["rows"], inputs["mask"]
        n, longest = mask.shape[0], mask.shape[-1]

        def pad(x):
            padded = x.new_zeros(n * longest, *x.shape[1:]).index_copy(0, rows, x)
            return padded.view(n, longest, *x.shape[1:]).transpose(1, 2)

        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            out = F.scaled_dot_product_attention(pad(inputs["q"]), pad(inputs["k"]), pad(inputs["v"]), attn_mask=mask)
        return out.transpose(1, 2).reshape(n * longest, *out.shape[1:2], out.shape[-1])[rows]

    return run


def _varlen_case(name: str, n: int, h: int, longest: int, d: int) -> Case:
    peers = {
        f"sdpa {label} (padded)": _sdpa_padded(backend)
        for label, backend in (("efficient", "EFFICIENT_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"))
    }
    return Case(
        op="flash_attention",
        shape=f"{name}x{d}-causal",
        make_inputs=_varlen_inputs(n, h, longest, d),
        run=_run_varlen,
        reference=lambda i: attention_float64_varlen(
            i["q"], i["k"], i["v"], i["cu_seqlens"], i["cu_seqlens"], causal=True
        ),
        bytes=_bytes,
        flops=_varlen_flops,
        peers=peers,
    )


for _name, (_n, _h, _longest) in VARLEN_SHAPES.items():
    for _d in VARLEN_HEAD_DIMS:
        CASES.append(_varlen_case(_name, _n, _h, _longest, _d))
        # the dense batch of the same token count: the "within 10%" comparison (TFLOP/s over real tokens)
        CASES.append(_case(f"{_name}x{_d}-dense-same-tokens", (_n, _h, _longest // 2, _d), True, False))
