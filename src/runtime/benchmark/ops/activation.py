"""Benchmark cases of gelu (exact and tanh) and silu at 8192 x 4096. Peers: eager torch and torch.compile of the
same function."""

from __future__ import annotations

import torch.nn.functional as F

from ...accelerators.activation import gelu, silu
from ...accelerators.activation.reference import gelu_reference, silu_reference
from ..case import Case, randn_rows, tensor_bytes
from ..peers import compiled

SHAPES = {"8192x4096": (8192, 4096)}


def _bytes(inputs, mode: str) -> int:
    """fwd: read x, write y. bwd: read dy and x, write dx."""
    x = inputs["x"]
    return tensor_bytes(x, x) if mode == "fwd" else tensor_bytes(x, x, x)


def _gelu_tanh_reference(x):
    return gelu_reference(x, "tanh")


def _cases(op, run, reference, eager):
    return [
        Case(
            op=op,
            shape=name,
            make_inputs=randn_rows(*shape, "x"),
            bytes=_bytes,
            run=run,
            reference=lambda i: reference(i["x"]),
            peers={"torch eager": lambda i: eager(i["x"]), "torch.compile": lambda i: compiled(reference)(i["x"])},
        )
        for name, shape in SHAPES.items()
    ]


CASES = (
    _cases("gelu", lambda backend, i: gelu(i["x"], backend=backend), gelu_reference, F.gelu)
    + _cases(
        "gelu_tanh",
        lambda backend, i: gelu(i["x"], "tanh", backend=backend),
        _gelu_tanh_reference,
        lambda x: F.gelu(x, approximate="tanh"),
    )
    + _cases("silu", lambda backend, i: silu(i["x"], backend=backend), silu_reference, F.silu)
)
