"""Benchmark cases of the gated delta rule: the chunked op (training) and the recurrent op (decoding).

All with l2norm of q/k in the kernel, as fla is measured. The chunked cases run in both modes
(fwd, and fwd+bwd through the chunked backward of each kernel backend: dq, dk, dv, dg, dbeta); the recurrent kernels are
forward-only, so their fwd+bwd rows report that reason instead of a time. The correctness check uses the
chunked reference in float64 (equal to the recurrence to float64 rounding, see the unit tests; the
step-by-step recurrence would keep a state per token for autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...accelerators.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from ...accelerators.gated_delta_rule.reference import chunk_gated_delta_rule_reference
from ..case import cases_per_shape, peer_available, tensor_bytes

# name: (B, T, H, HV, K, V, packed): packed = one sequence given through cu_seqlens (B = 1)
SHAPES = {
    "B4-T4096-H16-D128": (4, 4096, 16, 16, 128, 128, False),
    "packed32768-H16-HV32-D128": (1, 32768, 16, 32, 128, 128, True),
    "B256-T256-H4-D16": (256, 256, 4, 4, 16, 16, False),
}
RECURRENT_SHAPES = {"B4-T4096-H16-D128": SHAPES["B4-T4096-H16-D128"], "B256-T256-H4-D16": SHAPES["B256-T256-H4-D16"]}
RTOL = {torch.bfloat16: 5e-3, torch.float16: 5e-3, torch.float32: 1e-4}
NAMES = ("q", "k", "v", "g", "beta")


def _inputs(B, T, H, HV, K, V, packed):
    def make(device, dtype):
        inputs = {
            "q": torch.randn(B, T, H, K, device=device, dtype=dtype),
            "k": torch.randn(B, T, H, K, device=device, dtype=dtype),
            "v": torch.randn(B, T, HV, V, device=device, dtype=dtype),
            "g": F.logsigmoid(torch.randn(B, T, HV, device=device) + 2.0).to(dtype),
            "beta": torch.rand(B, T, HV, device=device, dtype=dtype),
        }
        inputs = {name: x.requires_grad_() for name, x in inputs.items()}
        if packed:  # on the device for fla, on the host for ours (validated there without a sync)
            inputs["cu_seqlens"] = torch.tensor([0, T], device=device, dtype=torch.long)
            inputs["cu_seqlens_host"] = torch.tensor([0, T], dtype=torch.long)
        return inputs

    return make


def _args(i):
    return tuple(i[n] for n in NAMES)


def _run(function):
    def run(backend, i):
        return function(*_args(i), use_qk_l2norm_in_kernel=True, cu_seqlens=i.get("cu_seqlens_host"), backend=backend)[
            0
        ]

    return run


def _reference(i):
    return chunk_gated_delta_rule_reference(
        *_args(i), use_qk_l2norm_in_kernel=True, cu_seqlens=i.get("cu_seqlens_host")
    )[0]


def _bytes(inputs, mode: str) -> int:
    """fwd: read q, k, v, g, beta, write o. bwd: read them and do, write their five gradients."""
    tensors = [inputs[n] for n in NAMES]
    o = inputs["v"]
    if mode == "fwd":
        return tensor_bytes(*tensors, o)
    return 2 * tensor_bytes(*tensors) + tensor_bytes(o)


def _fla_chunk(i):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    return fla_chunk(*_args(i), use_qk_l2norm_in_kernel=True, cu_seqlens=i.get("cu_seqlens"))[0]


def _fla_recurrent(i):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    q, k, v, g, beta = _args(i)
    return fla_recurrent(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=i.get("cu_seqlens"))[0]


def _cases():
    fla = peer_available("fla")
    common = dict(op="gated_delta_rule", reference=_reference, bytes=_bytes, rtol=RTOL)
    chunk = cases_per_shape(
        SHAPES,
        _inputs,
        "chunk-",
        run=_run(chunk_gated_delta_rule),
        peers={"fla chunk": _fla_chunk} if fla else {},
        **common,
    )
    recurrent = cases_per_shape(
        RECURRENT_SHAPES,
        _inputs,
        "recurrent-",
        run=_run(fused_recurrent_gated_delta_rule),
        peers={"fla fused_recurrent": _fla_recurrent} if fla else {},
        **common,
    )
    return chunk + recurrent


CASES = _cases()
