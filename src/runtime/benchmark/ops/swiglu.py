"""Benchmark cases of swiglu: silu(gate) * up.

Large: 8192 x 4096 (the bandwidth target). PCVR: 131072 x 256 (an MLP of a PCVR model).
Peers: torch eager, torch.compile and liger-kernel's SiLUMul (whose backward writes the
gradients over gate and up in place: the timed inputs change from call to call).
"""

from __future__ import annotations

import torch.nn.functional as F

from ...accelerators.swiglu import swiglu
from ...accelerators.swiglu.reference import swiglu_reference
from ..case import Case, peer_available, randn_rows, tensor_bytes
from ..peers import compiled

SHAPES = {"8192x4096": (8192, 4096), "131072x256": (131072, 256)}


def _bytes(inputs, mode: str) -> int:
    """fwd: read gate and up, write y. bwd: read dy, gate and up, write dgate and dup."""
    g = inputs["gate"]
    return tensor_bytes(g, g, g) if mode == "fwd" else tensor_bytes(g, g, g, g, g)


def _liger(inputs):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(inputs["gate"], inputs["up"])


def _peers() -> dict:
    peers = {
        "torch eager": lambda i: F.silu(i["gate"]) * i["up"],
        "torch.compile": lambda i: compiled(swiglu_reference)(i["gate"], i["up"]),
    }
    if peer_available("liger_kernel"):
        peers["liger"] = _liger
    return peers


CASES = [
    Case(
        op="swiglu",
        shape=name,
        make_inputs=randn_rows(*shape, "gate", "up"),
        run=lambda backend, i: swiglu(i["gate"], i["up"], backend=backend),
        reference=lambda i: swiglu_reference(i["gate"], i["up"]),
        bytes=_bytes,
        peers=_peers(),
    )
    for name, shape in SHAPES.items()
]
