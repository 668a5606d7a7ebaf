"""Mean-pooled embedding bags (multi-hot sparse features, behaviour histories)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.embedding_bag import embedding_bag_mean


class EmbeddingBagMean(nn.Module):
    """As nn.EmbeddingBag(mode="mean"): indices [bags, hotness] (or 1-D with offsets) -> [bags, dim].

    With padding_idx, those entries are left out of each bag's mean (an all-padding bag gives zeros)
    and that row of the table starts at zero. include_last_offset and sparse as in nn.EmbeddingBag.
    check_indices=False skips the range check (one device synchronisation per call) for ids that were
    validated upstream.
    """

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        padding_idx: int | None = None,
        *,
        init_std: float = 0.02,
        include_last_offset: bool = False,
        sparse: bool = False,
        check_indices: bool = True,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings  # as nn.EmbeddingBag
        self.padding_idx = padding_idx
        self.init_std = init_std
        self.include_last_offset = include_last_offset
        self.sparse = sparse
        self.check_indices = check_indices
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return embedding_bag_mean(
            self.weight, indices, offsets, self.padding_idx, include_last_offset=self.include_last_offset,
            sparse=self.sparse, check_indices=self.check_indices, backend=self.backend,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, padding_idx={self.padding_idx}, backend={self.backend}"
