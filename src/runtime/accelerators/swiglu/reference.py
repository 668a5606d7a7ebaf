"""SwiGLU in plain torch: silu(gate) * up in fp32 math (float64 stays float64); CPU-safe, differentiable."""

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)
