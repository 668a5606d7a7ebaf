"""SwiGLU in plain torch, as eager torch computes it (in the input dtype): CPU-safe, differentiable."""

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
