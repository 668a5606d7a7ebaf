"""PCVR examples in Parquet: the format, a writer (the synthetic set) and a loader.

One row per example, in `<dir>/train.parquet` and `<dir>/val.parquet`:

    label            float      1.0 converted, 0.0 not
    dense            list<float>       n_dense values (the same count in every row)
    sparse_<field>   list<int64>       one column per sparse field: that field's ids (1-based), 0 to n of them
    seq_items        list<int64>       the behaviour history, oldest first, item ids (1-based)
    seq_categories   list<int64>       the category of each history event (same length as seq_items)
    seq_actions      list<int64>       the action of each history event: 1 click, 2 cart, 3 purchase...
    target_item      int64             the candidate item
    target_category  int64             its category
    user_id          int64             optional: the user (>= 0); validation then reports GAUC

The schema metadata key `taac.spec` holds the FeatureSpec as JSON (vocabulary sizes, hotness,
seq_len); without it the loader infers the vocabularies from the largest ids and takes seq_len and
hotness from the longest lists. Histories longer than seq_len keep their most recent events. Both
files are checked when opened (runtime.training.parquet_checks); an error names the file, the
column and the first bad row.
Run `python -m runtime.training.parquet OUT_DIR` to write the synthetic set in this format.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from runtime.models import FeatureSpec, PCVRBatch

from .parquet_checks import MAX_VOCAB, check_against_spec, check_structure, parse_spec

SPEC_KEY = b"taac.spec"
SEQUENCE_COLUMNS = ("seq_items", "seq_categories", "seq_actions")


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as error:  # pragma: no cover - pyarrow is a dependency; this guards partial installs
        raise ImportError(
            f"reading and writing Parquet needs pyarrow ({error}); install it with `pip install pyarrow`"
        ) from None
    return pa, pq


# ------------------------------------------------------------------ writing


def _list_column(rows: torch.Tensor, lengths: torch.Tensor):
    """A list<int64> Arrow column from a padded [N, W] tensor and per-row lengths (entries beyond are dropped)."""
    pa, _ = _pyarrow()
    keep = torch.arange(rows.shape[1])[None] < lengths[:, None]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return pa.ListArray.from_arrays(
        pa.array(offsets.numpy().astype(np.int32)), pa.array(rows[keep].numpy().astype(np.int64))
    )


def batch_to_table(batch: PCVRBatch, spec: FeatureSpec):
    pa, _ = _pyarrow()
    n = len(batch)
    columns = {"label": pa.array(batch.label.numpy().astype(np.float32))}
    columns["dense"] = pa.ListArray.from_arrays(
        pa.array((torch.arange(n + 1) * spec.n_dense).numpy().astype(np.int32)),
        pa.array(batch.dense.numpy().reshape(-1).astype(np.float32)),
    )
    for f, name in enumerate(spec.sparse_fields):
        ids = batch.sparse[:, f]
        # bags are stored packed: the non-zero ids of each row
        order = torch.argsort((ids == 0).to(torch.int8), dim=1, stable=True)
        packed = torch.gather(ids, 1, order)
        columns[f"sparse_{name}"] = _list_column(packed, (ids > 0).sum(1))
    for name in SEQUENCE_COLUMNS:
        columns[name] = _list_column(getattr(batch, name), batch.seq_lengths)
    columns["target_item"] = pa.array(batch.target_item.numpy().astype(np.int64))
    columns["target_category"] = pa.array(batch.target_category.numpy().astype(np.int64))
    if batch.user_id is not None:
        columns["user_id"] = pa.array(batch.user_id.numpy().astype(np.int64))
    table = pa.table(columns)
    return table.replace_schema_metadata({SPEC_KEY: json.dumps(spec.to_dict()).encode()})


def write_synthetic(out_dir: str | Path, train_rows: int, data, chunk_rows: int = 4096) -> None:
    """Write `train_rows` training examples of a SyntheticPCVR (in its batch order) and its validation set."""
    _, pq = _pyarrow()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(out / "train.parquet", batch_to_table(data.train_batch(0, 1), data.spec).schema) as writer:
        for index, start in enumerate(range(0, train_rows, chunk_rows)):
            rows = min(chunk_rows, train_rows - start)
            writer.write_table(batch_to_table(data.train_batch(index, chunk_rows).slice(0, rows), data.spec))
    pq.write_table(batch_to_table(data.val_set(), data.spec), out / "val.parquet")


# ------------------------------------------------------------------ reading


def _padded(column, width: int, keep_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A list column as a zero-padded [N, width] int64 tensor (left-aligned) and the kept lengths."""
    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    offsets = column.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    values = column.flatten().to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(values)) - np.repeat(offsets[:-1], lengths)
    dropped = np.maximum(lengths - width, 0)  # too long: drop the oldest (keep_last) or the tail
    if keep_last:
        position = position - np.repeat(dropped, lengths)
    keep = (position >= 0) & (position < width)
    out = np.zeros((len(lengths), width), dtype=np.int64)
    out[rows[keep], position[keep]] = values[keep]
    return torch.from_numpy(out), torch.from_numpy(np.minimum(lengths, width))


def _infer_spec(table, path: str | Path) -> FeatureSpec:
    """The spec of a table without `taac.spec`: vocabularies from the largest ids (at least 1: a column of only
    0 ids, "none", still gets a table), seq_len and hotness from the longest lists, n_dense from the dense rows (0
    where they are empty)."""

    def max_id(name: str) -> int:
        values = table.column(name)
        values = values.combine_chunks().flatten() if "list" in str(values.type) else values
        return int(values.to_numpy().max()) if len(values) else 0

    def longest(name: str) -> int:
        lengths = table.column(name).combine_chunks().value_lengths().to_numpy()
        return int(lengths.max()) if len(lengths) else 0

    def vocabulary(key: str, *columns: str) -> int:
        largest = {name: max_id(name) for name in columns}
        column = max(largest, key=largest.get)
        if largest[column] > MAX_VOCAB:
            raise ValueError(
                f"{path}: column {column}: id {largest[column]} makes the inferred vocabulary {key}={largest[column]}, "
                f"beyond the largest embedding table ({MAX_VOCAB} rows); expected ids remapped to 1..N "
                f"(or the spec in the schema metadata {SPEC_KEY.decode()})"
            )
        return max(1, largest[column])

    fields = [c for c in table.column_names if c.startswith("sparse_")]
    return FeatureSpec(
        n_items=vocabulary("n_items", "seq_items", "target_item"),
        n_categories=vocabulary("n_categories", "seq_categories", "target_category"),
        n_actions=vocabulary("n_actions", "seq_actions"),
        sparse_fields={
            c.removeprefix("sparse_"): vocabulary(f"sparse_fields.{c.removeprefix('sparse_')}", c) for c in fields
        },
        sparse_hotness=max(1, *(longest(c) for c in fields)) if fields else 1,
        n_dense=longest("dense"),  # 0: no dense features (the models take none)
        seq_len=max(1, longest("seq_items")),
    )


def _read(path: str | Path, schema_only: bool = False):
    """The table (or only its schema) of a Parquet file; a file that is not Parquet gets a message naming it."""
    pa, pq = _pyarrow()
    try:
        return pq.read_schema(path) if schema_only else pq.read_table(path)
    except (OSError, pa.lib.ArrowException) as error:
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None


def _spec(schema, path: str | Path, table=None) -> FeatureSpec:
    metadata = schema.metadata or {}
    if SPEC_KEY in metadata:
        return parse_spec(metadata[SPEC_KEY], path, SPEC_KEY.decode())
    table = _read(path) if table is None else table
    check_structure(table, path)  # the inference reads the ids
    return _infer_spec(table, path)


def read_spec(path: str | Path) -> FeatureSpec:
    """The FeatureSpec stored in a Parquet file (else inferred from its contents)."""
    return _spec(_read(path, schema_only=True), path)


def read_batch(path: str | Path, spec: FeatureSpec, table=None) -> PCVRBatch:
    """A whole Parquet file as one PCVRBatch, padded to the spec's widths, after checking every column
    (parquet_checks: types, nulls, labels, finite dense features, ids within the spec's vocabularies)."""
    table = _read(path) if table is None else table
    check_structure(table, path)
    check_against_spec(table, path, spec)
    n = table.num_rows
    column = table.column("dense").combine_chunks()
    dense = torch.from_numpy(column.flatten().to_numpy().astype(np.float32)).view(n, spec.n_dense)
    fields = [_padded(table.column(f"sparse_{f}"), spec.sparse_hotness, keep_last=False)[0] for f in spec.sparse_fields]
    sparse = torch.stack(fields, dim=1) if fields else torch.zeros(n, 0, spec.sparse_hotness, dtype=torch.long)
    seq = {name: _padded(table.column(name), spec.seq_len, keep_last=True) for name in SEQUENCE_COLUMNS}
    return PCVRBatch(
        sparse=sparse,
        dense=dense,
        seq_items=seq["seq_items"][0],
        seq_categories=seq["seq_categories"][0],
        seq_actions=seq["seq_actions"][0],
        seq_lengths=seq["seq_items"][1],
        target_item=torch.from_numpy(table.column("target_item").to_numpy().astype(np.int64)),
        target_category=torch.from_numpy(table.column("target_category").to_numpy().astype(np.int64)),
        label=torch.from_numpy(table.column("label").to_numpy().astype(np.float32)),
        user_id=torch.from_numpy(table.column("user_id").to_numpy().astype(np.int64))
        if "user_id" in table.column_names
        else None,
    )


class ParquetPCVR:
    """train_batch(index, batch_size): epoch-wise shuffled rows of train.parquet (seeded; the last partial
    batch of an epoch is dropped); val_set(): all of val.parquet."""

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        directory = Path(path)
        for name in ("train.parquet", "val.parquet"):
            if not (directory / name).is_file():
                raise FileNotFoundError(
                    f"data.path: expected {directory / name} (write one with `python -m runtime.training.parquet {directory}`)"
                )
        self.seed = seed
        table = _read(directory / "train.parquet")
        self.spec = _spec(table.schema, directory / "train.parquet", table)
        self.train = read_batch(directory / "train.parquet", self.spec, table)
        del table
        # read and checked now: a broken validation set stops the run before its first step
        self.val = read_batch(directory / "val.parquet", self.spec)
        self._epoch: tuple[int, torch.Tensor] | None = None

    def train_batch(self, index: int, batch_size: int) -> PCVRBatch:
        per_epoch = len(self.train) // batch_size
        if per_epoch == 0:
            raise ValueError(f"data.batch_size={batch_size} exceeds the {len(self.train)} training rows")
        epoch, position = divmod(index, per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(len(self.train), generator=gen))
        rows = self._epoch[1][position * batch_size : (position + 1) * batch_size]
        return self.train.rows(rows)

    def val_set(self) -> PCVRBatch:
        return self.val


def main(argv: list[str] | None = None) -> None:
    from .synthetic import SyntheticPCVR

    parser = argparse.ArgumentParser(
        description="Write the synthetic PCVR data set as Parquet (train.parquet, val.parquet)."
    )
    parser.add_argument("out_dir")
    parser.add_argument("--train-rows", type=int, default=65536)
    parser.add_argument("--val-rows", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--n-items", type=int, default=20000)
    parser.add_argument("--n-categories", type=int, default=64)
    args = parser.parse_args(argv)
    data = SyntheticPCVR(
        seed=args.seed,
        seq_len=args.seq_len,
        n_items=args.n_items,
        n_categories=args.n_categories,
        val_size=args.val_rows,
    )
    write_synthetic(args.out_dir, args.train_rows, data)
    print(f"wrote {args.train_rows} training and {args.val_rows} validation rows to {args.out_dir}")


if __name__ == "__main__":
    main()
