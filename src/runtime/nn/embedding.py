"""Mean-pooled embedding bags (multi-hot sparse features, behaviour histories)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.embedding_bag import embedding_bag_mean


class EmbeddingBagMean(nn.Module):
    """As nn.EmbeddingBag(mode="mean"): indices [bags, hotness] (or 1-D with offsets) -> [bags, dim].

    With padding_idx, those entries are left out of each bag's mean (an all-padding bag gives zeros)
    and that row of the table starts at zero. check_indices=False skips the range check (one device
    synchronisation per call) for ids that were validated upstream.
    """

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        padding_idx: int | None = None,
        *,
        init_std: float = 0.02,
        check_indices: bool = True,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        self.padding_idx = padding_idx
        self.check_indices = check_indices
        self.backend = backend
        self.weight = nn.Parameter(torch.randn(num_embeddings, dim) * init_std)
        if padding_idx is not None:
            with torch.no_grad():
                self.weight[padding_idx].zero_()

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return embedding_bag_mean(
            self.weight, indices, offsets, self.padding_idx, check_indices=self.check_indices, backend=self.backend
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, padding_idx={self.padding_idx}, backend={self.backend}"
