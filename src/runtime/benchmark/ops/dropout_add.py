"""Benchmark cases of dropout_add: residual + dropout(x, p), training, p = 0.1.

Large: 8192 x 4096 (the bandwidth target). PCVR: 65536 x 64 (batch 256 x 256 tokens, width 64).

Every implementation draws its own random mask, so a float64 reference cannot know it in
advance. Each implementation is wrapped to record the random generators' states before it
runs (not while a CUDA graph is captured); the reference restores them and runs the same
implementation once more on x = 1, residual = 0, which returns the mask it drew (times
1 / (1 - p)). The reference is then residual + x * mask / (1 - p) in float64, and its gradient
checks that the backward used the forward's mask. Recording costs a few microseconds of host
time per call, the same for every implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...accelerators.dropout_add import dropout_add
from ..case import Case, randn_rows, tensor_bytes
from ..peers import compiled

P = 0.1
SHAPES = {"8192x4096": (8192, 4096), "65536x64": (65536, 64)}

_last: dict = {}  # the implementation that ran last, the generator states before it, its inputs' dtype


def _recorded(fn):
    def run(inputs):
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            x = inputs["x"]
            cuda_state = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
            _last.update(fn=fn, cpu_state=torch.get_rng_state(), cuda_state=cuda_state, dtype=x.dtype)
        return fn(inputs)

    return run


def _mask_of_last_run(x: torch.Tensor) -> torch.Tensor:
    """The keep mask the last recorded run drew, replayed from the recorded generator states."""
    torch.set_rng_state(_last["cpu_state"])
    if _last["cuda_state"] is not None:
        torch.cuda.set_rng_state(_last["cuda_state"], x.device)
    probe = {
        "x": torch.ones(x.shape, dtype=_last["dtype"], device=x.device, requires_grad=x.requires_grad),
        "residual": torch.zeros(x.shape, dtype=_last["dtype"], device=x.device, requires_grad=x.requires_grad),
    }
    return _last["fn"](probe).detach() != 0


def _reference(inputs):
    x, residual = inputs["x"], inputs["residual"]
    keep = _mask_of_last_run(x)
    return residual + x * keep.to(x.dtype) / (1.0 - P)


def _bytes(inputs, mode: str) -> int:
    """fwd: read x and residual, write out. bwd: read dout, write dx (the residual's gradient is dout itself)."""
    x = inputs["x"]
    return tensor_bytes(x, x, x) if mode == "fwd" else tensor_bytes(x, x)


def _torch_dropout_add(x, residual):
    return residual + F.dropout(x, P, training=True)


def _ours(backend: str):
    return _recorded(lambda i: dropout_add(i["x"], i["residual"], P, backend=backend))


CASES = [
    Case(
        op="dropout_add",
        shape=name,
        make_inputs=randn_rows(*shape, "x", "residual"),
        run=lambda backend, i: _ours(backend)(i),
        reference=_reference,
        bytes=_bytes,
        peers={
            "torch eager": _recorded(lambda i: _torch_dropout_add(i["x"], i["residual"])),
            "torch.compile": _recorded(lambda i: compiled(_torch_dropout_add)(i["x"], i["residual"])),
        },
    )
    for name, shape in SHAPES.items()
]
