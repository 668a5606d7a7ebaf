"""Manifold-constrained hyper-connections (mHC): a sub-block on n residual streams instead of one."""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int
from runtime.accelerators.mhc import mhc_post, mhc_pre


class HyperConnection(nn.Module):
    """x [..., n, C] -> mhc_post(x, block(h_in), H_post, H_res) with (h_in, H_post, H_res) = mhc_pre(x).

    Replaces `x + block(x)`: the block reads a learned mix of the streams and writes into all of them,
    while a doubly stochastic H_res mixes the streams themselves. Initialised near a plain residual:
    H_pre averages the streams, H_post = 1, H_res close to the identity, small gates alpha.
    """

    def __init__(
        self,
        block: nn.Module,
        streams: int,
        width: int,
        *,
        sinkhorn_iters: int = 20,
        eps: float = 1e-6,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        streams = as_int("streams", streams, least=1, expected="an int >= 1 (the number of residual streams)")
        width = as_int("width", width, least=1, expected="an int >= 1 (the width C of each stream)")
        self.block, self.streams, self.sinkhorn_iters, self.eps, self.backend = (
            block,
            streams,
            sinkhorn_iters,
            eps,
            backend,
        )
        m = streams * streams + 2 * streams
        factory = {"device": device, "dtype": dtype}
        self.phi = nn.Parameter(torch.empty(streams * width, m, **factory))
        self.alpha = nn.Parameter(torch.empty(3, **factory))
        self.bias = nn.Parameter(torch.empty(m, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """phi, alpha and bias (the block resets its own): near a plain residual."""
        n = self.streams
        with torch.no_grad():
            self.phi.normal_(std=self.phi.shape[0] ** -0.5)
            self.alpha.fill_(0.01)
            pre = torch.full((n,), -math.log(n - 1) if n > 1 else 4.0)  # sigmoid = 1/n
            post = torch.zeros(n)  # 2 * sigmoid(0) = 1
            res = 4.0 * torch.eye(n)  # Sinkhorn of exp(4 I): mostly the identity
            self.bias.copy_(torch.cat([pre, post, res.flatten()]))

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        h_in, h_post, h_res = mhc_pre(
            x, self.phi, self.alpha, self.bias, self.eps, self.sinkhorn_iters, backend=self.backend
        )
        y = self.block(h_in, *args, **kwargs)
        return mhc_post(x, y.to(x.dtype), h_post, h_res, backend=self.backend)


def expand_streams(x: torch.Tensor, streams: int) -> torch.Tensor:
    """[..., C] -> [..., n, C]: every stream starts as a copy of the input."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], streams, x.shape[-1]).contiguous()


def merge_streams(x: torch.Tensor) -> torch.Tensor:
    """[..., n, C] -> [..., C]: the mean of the streams."""
    return x.mean(-2)
