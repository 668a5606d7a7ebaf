"""Benchmark cases of mHC: pre, an identity block, then post (x_next from x), as one pass."""

from __future__ import annotations

import torch

from ...accelerators.mhc import mhc_post, mhc_pre
from ...accelerators.mhc.reference import mhc_post_reference, mhc_pre_reference
from ..case import Case, tensor_bytes
from ..peers import compiled

SHAPES = {"16384x4x1280": (16384, 4, 1280), "16384x4x2560": (16384, 4, 2560)}


def _inputs(tokens: int, n: int, C: int):
    def make(device, dtype):
        m = n * n + 2 * n
        return {
            "x": torch.randn(tokens, n, C, device=device, dtype=dtype, requires_grad=True),
            "phi": ((n * C) ** -0.5 * torch.randn(n * C, m, device=device)).requires_grad_(),
            "alpha": torch.full((3,), 0.1, device=device, requires_grad=True),
            "bias": (0.3 * torch.randn(m, device=device)).requires_grad_(),
        }

    return make


def _pre_post_reference(x, phi, alpha, bias):
    h_in, h_post, h_res = mhc_pre_reference(x, phi, alpha, bias)
    return mhc_post_reference(x, h_in, h_post, h_res)


def _run(backend, i):
    h_in, h_post, h_res = mhc_pre(i["x"], i["phi"], i["alpha"], i["bias"], backend=backend)
    return mhc_post(i["x"], h_in, h_post, h_res, backend=backend)


def _bytes(inputs, mode: str) -> int:
    """fwd: read x and phi, write h_in and x_next. bwd: read x, phi and d x_next, write dx, d h_in and dphi."""
    x, phi = inputs["x"], inputs["phi"]
    h_in = x.numel() // x.shape[-2] * x.element_size()
    if mode == "fwd":
        return tensor_bytes(x, phi, x) + h_in
    return tensor_bytes(x, phi, x, x, phi) + h_in


CASES = [
    Case(
        op="mhc",
        shape=name,
        make_inputs=_inputs(*shape),
        run=_run,
        reference=lambda i: _pre_post_reference(i["x"], i["phi"], i["alpha"], i["bias"]),
        bytes=_bytes,
        peers={
            "torch eager": lambda i: _pre_post_reference(i["x"], i["phi"], i["alpha"], i["bias"]),
            "torch.compile": lambda i: compiled(_pre_post_reference)(i["x"], i["phi"], i["alpha"], i["bias"]),
        },
    )
    for name, shape in SHAPES.items()
]
