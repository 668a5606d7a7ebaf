"""RMSNorm, LayerNorm and L2Norm modules over the last dimension, RMSNorm and LayerNorm also after a residual add
(AddRMSNorm, AddLayerNorm), on the backend the active accelerator config picks."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.add_norm import add_layer_norm, add_rms_norm
from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int, check_bool, check_eps
from runtime.accelerators.l2norm import l2norm
from runtime.accelerators.layer_norm import layer_norm
from runtime.accelerators.rms_norm import rms_norm


class _AffineNorm(nn.Module):
    """What the affine norms share: eps, the pinned backend, a weight of ones (and for the LayerNorms a bias of
    zeros) over the last dimension as nn.RMSNorm / nn.LayerNorm hold them (their state_dicts load unchanged).

    dim: the width of the last dimension, an int >= 1 or a one-element normalized_shape as torch's modules take it.
    Without a weight (elementwise_affine=False) the input's last dimension is still checked against it, as torch's
    modules do."""

    def __init__(
        self,
        dim: int,
        eps: float,
        elementwise_affine: bool,
        bias: bool,
        backend: Backend | None,
        device,
        dtype,
    ) -> None:
        super().__init__()
        if isinstance(dim, (tuple, list, torch.Size)):
            if len(dim) != 1:
                raise ValueError(
                    f"dim: expected the width of the last dimension (an int, or a one-element normalized_shape), got "
                    f"{tuple(dim)}: the op normalises over the last dimension only"
                )
            (dim,) = dim
        dim = as_int("dim", dim, least=1, expected="an int >= 1 (the width of the last dimension)")
        check_eps(eps)
        check_bool("elementwise_affine", elementwise_affine)
        check_bool("bias", bias)
        self.dim = dim
        self.eps = eps
        self.backend = backend
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(dim, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **factory)) if elementwise_affine and bias else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _check_width(self, x: torch.Tensor) -> None:
        """x's last dimension against dim, here rather than in the op: the op would blame the weight (or, without
        one, normalise over whatever width x has)."""
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] != self.dim:
            width = "the weight's width" if self.weight is not None else f"{type(self).__name__}(dim={self.dim})"
            raise ValueError(
                f"x: expected the last dimension of size {self.dim} ({width}), got {x.shape[-1]} "
                f"(shape {tuple(x.shape)})"
            )

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, backend={self.backend}"


class RMSNorm(_AffineNorm):
    """x * rsqrt(mean(x^2, -1) + eps) * weight. `backend` pins one backend; None follows the active config."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        elementwise_affine: bool = True,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(dim, eps, elementwise_affine, False, backend, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_width(x)
        return rms_norm(x, self.weight, self.eps, backend=self.backend)


class LayerNorm(_AffineNorm):
    """As nn.LayerNorm over the last dimension. `backend` pins one backend; None follows the active config."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        *,
        elementwise_affine: bool = True,
        bias: bool = True,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(dim, eps, elementwise_affine, bias, backend, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_width(x)
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)


class L2Norm(nn.Module):
    """x * rsqrt(sum(x^2, -1) + eps), no parameters (as the q/k normalisation of linear attention). Not F.normalize,
    which divides by max(||x||, eps). `backend` pins one backend; None follows the active config."""

    def __init__(self, eps: float = 1e-6, *, backend: Backend | None = None) -> None:
        super().__init__()
        check_eps(eps)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2norm(x, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, backend={self.backend}"


class AddRMSNorm(_AffineNorm):
    """(y, new_residual) = (rms_norm(x + residual), x + residual) in one pass; the parameters (and state_dict) of
    nn.RMSNorm over the last dimension. `backend` pins one backend; None follows the active config."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        elementwise_affine: bool = True,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(dim, eps, elementwise_affine, False, backend, device, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_width(x)
        return add_rms_norm(x, residual, self.weight, self.eps, backend=self.backend)


class AddLayerNorm(_AffineNorm):
    """(y, new_residual) = (layer_norm(x + residual), x + residual) in one pass; the parameters (and state_dict) of
    nn.LayerNorm over the last dimension. `backend` pins one backend; None follows the active config."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        *,
        elementwise_affine: bool = True,
        bias: bool = True,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(dim, eps, elementwise_affine, bias, backend, device, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_width(x)
        return add_layer_norm(x, residual, self.weight, self.bias, self.eps, backend=self.backend)
