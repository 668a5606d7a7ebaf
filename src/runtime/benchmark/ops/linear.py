"""Benchmark cases of linear: act(x @ w^T + b).

PCVR: M = 131072 rows (a batch of 256 x 512 tokens) through MLP layers with (K, N) in (64, 256), (128, 512),
(256, 1024), (512, 2048), with gelu, and with swiglu at F = N / 2 (the same weight rows). Large: M = 8192,
K = N = 4096 with gelu. Peers: eager torch (F.linear, then the activation) and torch.compile(mode="max-autotune") of
the same function. FLOPs: 2 M N K forward (N: the weight's rows), the backward's two GEMMs twice that.
"""

from __future__ import annotations

import math

import torch

from ...accelerators.linear import linear
from ...accelerators.linear.reference import linear_reference
from ..case import Case, tensor_bytes
from ..peers import compiled_max_autotune

# name -> (M, K, weight rows, activation)
SHAPES = {
    **{
        f"pcvr-131072x{k}x{n}-gelu": (131072, k, n, "gelu")
        for k, n in ((64, 256), (128, 512), (256, 1024), (512, 2048))
    },
    **{
        f"pcvr-131072x{k}x{n}-swiglu": (131072, k, n, "swiglu")
        for k, n in ((64, 256), (128, 512), (256, 1024), (512, 2048))
    },
    "large-8192x4096x4096-gelu": (8192, 4096, 4096, "gelu"),
}


def _inputs(m: int, k: int, rows: int):
    def make(device, dtype):
        return {
            "x": torch.randn(m, k, device=device, dtype=dtype, requires_grad=True),
            "weight": (torch.randn(rows, k, device=device) / math.sqrt(k)).to(dtype).requires_grad_(),
            "bias": torch.randn(rows, device=device, dtype=dtype, requires_grad=True),
        }

    return make


def _flops(inputs, mode: str) -> float:
    m, k = inputs["x"].shape
    forward = 2.0 * m * inputs["weight"].shape[0] * k
    return forward if mode == "fwd" else 2 * forward


def _bytes(activation: str):
    def count(inputs, mode: str) -> int:
        """fwd: read x, w, b, write y and the saved pre-activation. bwd: read dy, the pre-activation, x and w, write
        dx, dw, db (d_preact's round trip between the elementwise pass and the GEMMs not counted)."""
        x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
        rows = w.shape[0]
        y = x.shape[0] * (rows // 2 if activation == "swiglu" else rows) * x.element_size()
        z = x.shape[0] * rows * x.element_size()
        if mode == "fwd":
            return tensor_bytes(x, w, b) + y + z
        return y + z + tensor_bytes(x, w) + tensor_bytes(x, w, b)

    return count


def _run(activation: str):
    return lambda backend, i: linear(i["x"], i["weight"], i["bias"], activation, backend=backend)


def _gelu(x, weight, bias):
    return linear_reference(x, weight, bias, "gelu")


def _swiglu(x, weight, bias):
    return linear_reference(x, weight, bias, "swiglu")


EAGER = {"gelu": _gelu, "swiglu": _swiglu}  # one function per activation: torch.compile caches graphs per function


def _peers(activation: str) -> dict:
    fn = EAGER[activation]
    return {
        "torch eager": lambda i: fn(i["x"], i["weight"], i["bias"]),
        "torch.compile max-autotune": lambda i: compiled_max_autotune(fn)(i["x"], i["weight"], i["bias"]),
    }


CASES = [
    Case(
        op="linear",
        shape=name,
        make_inputs=_inputs(m, k, rows),
        run=_run(activation),
        reference=lambda i, activation=activation: linear_reference(i["x"], i["weight"], i["bias"], activation),
        bytes=_bytes(activation),
        flops=_flops,
        peers=_peers(activation),
    )
    for name, (m, k, rows, activation) in SHAPES.items()
]
