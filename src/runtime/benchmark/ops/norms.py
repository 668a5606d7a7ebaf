"""Benchmark cases of the three row norms: rms_norm, layer_norm, l2norm."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ...accelerators import l2norm, layer_norm, rms_norm
from ...accelerators.l2norm.reference import l2norm_reference
from ...accelerators.layer_norm.reference import layer_norm_reference
from ...accelerators.rms_norm.reference import rms_norm_reference
from ..case import cases_per_shape, peer_available, tensor_bytes
from ..peers import compiled

SHAPES = {"32768x4096": (32768, 4096), "8192x128": (8192, 128), "131072x64": (131072, 64)}


def _inputs(rows: int, width: int, weight: bool, bias: bool):
    def make(device, dtype):
        inputs = {"x": torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)}
        if weight:
            inputs["weight"] = (1 + 0.1 * torch.randn(width, device=device, dtype=dtype)).requires_grad_()
        if bias:
            inputs["bias"] = (0.1 * torch.randn(width, device=device, dtype=dtype)).requires_grad_()
        return inputs

    return make


def _bytes(inputs, mode: str) -> int:
    """fwd: read x and the parameters, write y. bwd: read x, dy and the parameters, write dx and the parameter grads."""
    x, params = inputs["x"], [inputs.get("weight"), inputs.get("bias")]
    if mode == "fwd":
        return tensor_bytes(x, x, *params)
    return tensor_bytes(x, x, x, *params, *params)


def _rms_cases():
    def liger(inputs):
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(inputs["x"], inputs["weight"], 1e-6, 0.0, "llama", False)

    peers = {
        "torch eager": lambda i: F.rms_norm(i["x"], (i["x"].shape[-1],), i["weight"], 1e-6),
        "torch.compile": lambda i: compiled(rms_norm_reference)(i["x"], i["weight"], 1e-6),
    }
    if peer_available("liger_kernel"):
        peers["liger"] = liger
    return cases_per_shape(
        SHAPES,
        partial(_inputs, weight=True, bias=False),
        op="rms_norm",
        bytes=_bytes,
        peers=peers,
        run=lambda backend, i: rms_norm(i["x"], i["weight"], 1e-6, backend=backend),
        reference=lambda i: rms_norm_reference(i["x"], i["weight"], 1e-6),
    )


def _layer_cases():
    def liger(inputs):
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return LigerLayerNormFunction.apply(inputs["x"], inputs["weight"], inputs["bias"], 1e-5)

    peers = {
        "torch eager": lambda i: F.layer_norm(i["x"], (i["x"].shape[-1],), i["weight"], i["bias"], 1e-5),
        "torch.compile": lambda i: compiled(layer_norm_reference)(i["x"], i["weight"], i["bias"], 1e-5),
    }
    if peer_available("liger_kernel"):
        peers["liger"] = liger
    return cases_per_shape(
        SHAPES,
        partial(_inputs, weight=True, bias=True),
        op="layer_norm",
        bytes=_bytes,
        peers=peers,
        run=lambda backend, i: layer_norm(i["x"], i["weight"], i["bias"], 1e-5, backend=backend),
        reference=lambda i: layer_norm_reference(i["x"], i["weight"], i["bias"], 1e-5),
    )


def _l2_cases():
    def fla(inputs):
        from fla.modules.norm.l2norm import l2norm as fla_l2norm

        return fla_l2norm(inputs["x"], 1e-6)

    peers = {
        "torch eager": lambda i: l2norm_reference(i["x"], 1e-6),
        "torch.compile": lambda i: compiled(l2norm_reference)(i["x"], 1e-6),
    }
    if peer_available("fla"):
        peers["fla"] = fla
    return cases_per_shape(
        SHAPES,
        partial(_inputs, weight=False, bias=False),
        op="l2norm",
        bytes=_bytes,
        peers=peers,
        run=lambda backend, i: l2norm(i["x"], 1e-6, backend=backend),
        reference=lambda i: l2norm_reference(i["x"], 1e-6),
    )


CASES = _rms_cases() + _layer_cases() + _l2_cases()
