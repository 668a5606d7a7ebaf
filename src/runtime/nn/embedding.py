"""Mean-pooled embedding bags (multi-hot sparse features, behaviour histories)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int, as_padding_idx
from runtime.accelerators.embedding_bag_mean import embedding_bag_collection, embedding_bag_mean
from runtime.accelerators.embedding_bag_mean.collection import is_keyed_jagged


def init_table_(weight: torch.Tensor, std: float, padding_idx: int | None) -> None:
    """A table's initial values: normal with std `std`, its padding row (where given) zero."""
    nn.init.normal_(weight, std=std)
    if padding_idx is not None:
        with torch.no_grad():
            weight[padding_idx].zero_()


def _table_size(table: str, num_embeddings, dim) -> tuple[int, int]:
    """A table's (num_embeddings, dim) as ints; table names the table in the message where there are several."""
    where = f" of {table}" if table else ""
    return (
        as_int(f"num_embeddings{where}", num_embeddings, least=0, expected="an int >= 0"),
        as_int(f"dim{where}", dim, least=0, expected="an int >= 0"),
    )


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
        num_embeddings, dim = _table_size("", num_embeddings, dim)
        self.padding_idx = as_padding_idx(padding_idx, num_embeddings)  # a negative one counts from the end
        self.init_std = init_std
        self.include_last_offset = include_last_offset
        self.sparse = sparse
        self.check_indices = check_indices
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_table_(self.weight, self.init_std, self.padding_idx)

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: None = None
    ) -> torch.Tensor:
        """per_sample_weights: None only, taken as nn.EmbeddingBag.forward takes it (a replaced bag's callers pass
        it); torch too refuses weights for mode='mean'."""
        if per_sample_weights is not None:
            raise ValueError(
                "per_sample_weights: expected None; weights are only taken by mode='sum' bags, and this is a mean"
            )
        return embedding_bag_mean(
            self.weight,
            indices,
            offsets,
            self.padding_idx,
            include_last_offset=self.include_last_offset,
            sparse=self.sparse,
            check_indices=self.check_indices,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, padding_idx={self.padding_idx}, backend={self.backend}"


class EmbeddingBagCollection(nn.Module):
    """Several named tables pooled at once (embedding_bag_collection): jagged key-major input -> [B, sum of dims].

    tables: name -> (num_embeddings, dim), in the order the input lists them; state_dict keys are
    `tables.<name>.weight`. Call with (values, offsets) in TorchRec's key-major layout, or with a
    KeyedJaggedTensor whose keys() are the table names in this order. padding_idx: a row of every table
    left out of the means (it starts at zero). device and dtype place every table, as torch's modules take them.
    """

    def __init__(
        self,
        tables: Mapping[str, tuple[int, int]],
        padding_idx: int | None = None,
        *,
        init_std: float = 0.02,
        check_indices: bool = True,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("tables: expected at least one table (name -> (num_embeddings, dim))")
        self.init_std = init_std
        self.check_indices = check_indices
        self.backend = backend
        self.tables = nn.ModuleDict()
        for name, size in tables.items():
            if not isinstance(size, (tuple, list)) or len(size) != 2:
                raise TypeError(f"tables[{name!r}]: expected a pair (num_embeddings, dim), got {size!r}")
            num_embeddings, dim = _table_size(f"tables[{name!r}]", *size)
            as_padding_idx(padding_idx, num_embeddings, f"table {name!r}")
            table = nn.Module()
            table.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))
            self.tables[name] = table
        self.padding_idx = padding_idx if padding_idx is None else int(padding_idx)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every table normal with std init_std, its padding row zero."""
        for weight in self.weights():
            init_table_(weight, self.init_std, self.padding_idx)

    @property
    def names(self) -> list[str]:
        return list(self.tables.keys())

    def weights(self) -> list[nn.Parameter]:
        return [table.weight for table in self.tables.values()]

    def forward(self, values, offsets: torch.Tensor | None = None) -> torch.Tensor:
        if is_keyed_jagged(values) and list(values.keys()) != self.names:
            raise ValueError(
                f"values: the KeyedJaggedTensor's keys {list(values.keys())} must be the tables {self.names}, in order"
            )
        return embedding_bag_collection(
            self.weights(),
            values,
            offsets,
            padding_idx=self.padding_idx,
            check_indices=self.check_indices,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{name}: {tuple(t.weight.shape)}" for name, t in self.tables.items())
        return f"{shapes}, padding_idx={self.padding_idx}, backend={self.backend}"
