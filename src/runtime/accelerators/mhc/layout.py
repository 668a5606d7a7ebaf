"""What the mHC kernel modules share: the token-major views of the inputs and the pre op's outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import buffers


@dataclass
class PreOutputs:
    """Streams as [tokens, n*C] and the outputs of mhc_pre (h and r are what backward reads)."""

    streams: torch.Tensor  # x as a contiguous [tokens, n*C]
    h_in: torch.Tensor  # [..., C] in x's dtype
    h_post: torch.Tensor  # [..., n] fp32
    h_res: torch.Tensor  # [..., n, n] fp32
    h: torch.Tensor  # [tokens, n*n + 2n] fp32: r * (v @ phi)
    r: torch.Tensor  # [tokens] fp32: rsqrt(mean(v^2) + eps)

    @property
    def results(self) -> tuple[torch.Tensor, ...]:
        return self.h_in, self.h_post, self.h_res, self.h, self.r


def token_streams(x: torch.Tensor) -> torch.Tensor:
    """x [..., n, C] as a contiguous [tokens, n*C] (a view when x already is contiguous)."""
    return x.reshape(-1, x.shape[-2] * x.shape[-1]).contiguous()


def allocate_pre(x: torch.Tensor) -> PreOutputs:
    n, width = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    streams = token_streams(x)
    f32 = dict(dtype=torch.float32, device=x.device)
    return PreOutputs(
        streams=streams,
        h_in=buffers.empty((*lead, width), dtype=x.dtype, device=x.device),
        h_post=buffers.empty((*lead, n), **f32),
        h_res=buffers.empty((*lead, n, n), **f32),
        h=buffers.empty((streams.shape[0], n * n + 2 * n), **f32),
        r=buffers.empty((streams.shape[0],), **f32),
    )
