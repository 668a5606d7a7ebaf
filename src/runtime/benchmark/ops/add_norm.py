"""Benchmark cases of add_rms_norm and add_layer_norm: (norm(x + residual), x + residual).

Large: 32768 x 4096 (a transformer's hidden stream). PCVR: 131072 x 256. Peers: eager torch and torch.compile of the
unfused reference (the add, then the norm). Both outputs get an incoming gradient in fwd+bwd.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ...accelerators.add_norm import add_layer_norm, add_rms_norm
from ...accelerators.add_norm.reference import add_layer_norm_reference, add_rms_norm_reference
from ..case import cases_per_shape, tensor_bytes
from ..peers import compiled

SHAPES = {"32768x4096": (32768, 4096), "131072x256": (131072, 256)}


def _inputs(rows: int, width: int, bias: bool):
    def make(device, dtype):
        inputs = {
            "x": torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True),
            "residual": torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True),
            "weight": (1 + 0.1 * torch.randn(width, device=device, dtype=dtype)).requires_grad_(),
        }
        if bias:
            inputs["bias"] = (0.1 * torch.randn(width, device=device, dtype=dtype)).requires_grad_()
        return inputs

    return make


def _bytes(inputs, mode: str) -> int:
    """fwd: read x, residual and the parameters, write y and the sum. bwd: read the sum, dy, dsum and the
    parameters, write dx, dresidual and the parameter grads (the per-row statistics are negligible)."""
    x, params = inputs["x"], [inputs["weight"], inputs.get("bias")]
    if mode == "fwd":
        return tensor_bytes(x, x, x, x, *params)
    return tensor_bytes(x, x, x, x, x, *params, *params)


def _eager_rms(i):
    total = i["x"] + i["residual"]
    return F.rms_norm(total, (total.shape[-1],), i["weight"], 1e-6), total


def _eager_layer(i):
    total = i["x"] + i["residual"]
    return F.layer_norm(total, (total.shape[-1],), i["weight"], i["bias"], 1e-5), total


RMS_CASES = cases_per_shape(
    SHAPES,
    partial(_inputs, bias=False),
    op="add_rms_norm",
    bytes=_bytes,
    peers={
        "torch eager": _eager_rms,
        "torch.compile": lambda i: compiled(add_rms_norm_reference)(i["x"], i["residual"], i["weight"], 1e-6),
    },
    run=lambda backend, i: add_rms_norm(i["x"], i["residual"], i["weight"], 1e-6, backend=backend),
    reference=lambda i: add_rms_norm_reference(i["x"], i["residual"], i["weight"], 1e-6),
)

LAYER_CASES = cases_per_shape(
    SHAPES,
    partial(_inputs, bias=True),
    op="add_layer_norm",
    bytes=_bytes,
    peers={
        "torch eager": _eager_layer,
        "torch.compile": lambda i: compiled(add_layer_norm_reference)(
            i["x"], i["residual"], i["weight"], i["bias"], 1e-5
        ),
    },
    run=lambda backend, i: add_layer_norm(i["x"], i["residual"], i["weight"], i["bias"], 1e-5, backend=backend),
    reference=lambda i: add_layer_norm_reference(i["x"], i["residual"], i["weight"], i["bias"], 1e-5),
)

CASES = RMS_CASES + LAYER_CASES
