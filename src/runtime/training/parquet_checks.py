"""Checks of a PCVR Parquet table before anything trains on it (the format is in runtime.training.parquet).

Each error names the file, the column and the first bad row (0-based), so a broken export is found when the
data is opened, not as a non-finite loss or an index error steps later.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.models import FeatureSpec

SCALAR_NUMBERS = ("label",)
SCALAR_IDS = ("target_item", "target_category")
OPTIONAL_IDS = ("user_id",)
ID_LISTS = ("seq_items", "seq_categories", "seq_actions")
SPEC_MINIMUM = {"n_items": 1, "n_categories": 1, "n_actions": 1, "sparse_hotness": 1, "n_dense": 0, "seq_len": 1}
VOCABULARIES = ("n_items", "n_categories", "n_actions")
# the most rows one embedding table may have: beyond it the table could not be allocated (2**31 rows of even
# 8 float32 values are 64 GiB) and the int32 offsets of the packed lookups would overflow
MAX_VOCAB = 2**31 - 1


def _pa():
    import pyarrow as pa

    return pa


def sparse_columns(table) -> list[str]:
    return [name for name in table.column_names if name.startswith("sparse_")]


def _array(table, name: str):
    column = table.column(name)
    return column.combine_chunks() if hasattr(column, "combine_chunks") else column


def _fail(path, name: str, row: int, problem: str) -> None:
    raise ValueError(f"{path}: column {name}, row {row}: {problem}")


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def _row_of(lengths: np.ndarray, value_index: int) -> int:
    """The row holding the value_index-th value of a list column's flattened values."""
    return int(np.searchsorted(np.cumsum(lengths), value_index, side="right"))


def _is_list(kind) -> bool:
    pa = _pa()
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _is_number(kind) -> bool:
    pa = _pa()
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _values(array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False).astype(np.float64)


def _check_type(path, name: str, array, is_list: bool, what: str) -> None:
    kind = array.type
    if is_list:
        if not (_is_list(kind) and _is_number(kind.value_type)):
            raise ValueError(f"{path}: column {name}: expected list<{what}> (a list per row), got {kind}")
    elif not _is_number(kind):
        raise ValueError(f"{path}: column {name}: expected {what} (one value per row), got {kind}")


def _check_nulls(path, name: str, array, is_list: bool) -> None:
    if array.null_count:
        _fail(path, name, _first(array.is_null().to_numpy(zero_copy_only=False)), "null; expected a value")
    if is_list:
        flat = array.flatten()
        if flat.null_count:
            row = _row_of(array.value_lengths().to_numpy(), _first(flat.is_null().to_numpy(zero_copy_only=False)))
            _fail(path, name, row, "a null inside the list; expected numbers only")


def _check_ids(path, name: str, values: np.ndarray, rows) -> None:
    """Whole, non-negative ids (rows(i): the row of the i-th value)."""
    bad = _first(~np.isfinite(values) | (values != np.floor(values)))
    if bad is not None:
        _fail(path, name, rows(bad), f"id {values[bad]} is not a whole number")
    bad = _first(values < 0)
    if bad is not None:
        _fail(path, name, rows(bad), f"id {values[bad]:g} is negative; expected 1-based ids (0 = none)")


def check_structure(table, path: str | Path) -> None:
    """Column presence and types, nulls, labels in [0, 1], finite dense features, whole non-negative ids,
    histories whose three lists have one length per row. Needs no feature spec."""
    required = ["label", "dense", *SCALAR_IDS, *ID_LISTS]
    missing = [name for name in required if name not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; see runtime.training.parquet for the format")
    if table.num_rows == 0:
        raise ValueError(f"{path}: holds no rows; expected at least one example")
    lists = {"dense": "float", **{name: "int64" for name in (*ID_LISTS, *sparse_columns(table))}}
    optional = [name for name in OPTIONAL_IDS if name in table.column_names]
    scalars = {"label": "float", **{name: "int64" for name in (*SCALAR_IDS, *optional)}}
    for name, what in [*lists.items(), *scalars.items()]:
        array = _array(table, name)
        _check_type(path, name, array, name in lists, what)
        _check_nulls(path, name, array, name in lists)

    labels = _values(_array(table, "label"))
    bad = _first(~((labels >= 0) & (labels <= 1)))  # NaN fails both comparisons
    if bad is not None:
        _fail(path, "label", bad, f"label {labels[bad]} is outside [0, 1]")
    dense = _array(table, "dense")
    values = _values(dense.flatten())
    bad = _first(~np.isfinite(values))
    if bad is not None:
        _fail(
            path, "dense", _row_of(dense.value_lengths().to_numpy(), bad), f"dense feature {values[bad]} is not finite"
        )
    limit = float(np.finfo(np.float32).max)  # the loader casts to float32: larger values would turn into inf
    bad = _first(np.abs(values) > limit)
    if bad is not None:
        _fail(
            path,
            "dense",
            _row_of(dense.value_lengths().to_numpy(), bad),
            f"dense feature {values[bad]:g} is beyond float32 (the model's dtype); expected |x| <= {limit:.4g}",
        )
    for name in (*SCALAR_IDS, *optional):
        _check_ids(path, name, _values(_array(table, name)), lambda i: i)
    for name in (*ID_LISTS, *sparse_columns(table)):
        array = _array(table, name)
        lengths = array.value_lengths().to_numpy()
        _check_ids(path, name, _values(array.flatten()), lambda i, lengths=lengths: _row_of(lengths, i))
    history = _array(table, "seq_items").value_lengths().to_numpy()
    for name in ID_LISTS[1:]:
        lengths = _array(table, name).value_lengths().to_numpy()
        bad = _first(lengths != history)
        if bad is not None:
            _fail(
                path,
                name,
                bad,
                f"{lengths[bad]} values for the {history[bad]} events of seq_items; expected one per event",
            )


def check_against_spec(table, path: str | Path, spec: FeatureSpec) -> None:
    """The sparse fields are the spec's, dense rows hold n_dense values, bags at most sparse_hotness ids,
    and every id is within its vocabulary. After check_structure."""
    fields = [f"sparse_{name}" for name in spec.sparse_fields]
    present = sparse_columns(table)
    if sorted(present) != sorted(fields):
        raise ValueError(f"{path}: sparse columns {sorted(present)}; the feature spec has {sorted(fields)}")
    lengths = _array(table, "dense").value_lengths().to_numpy()
    bad = _first(lengths != spec.n_dense)
    if bad is not None:
        _fail(path, "dense", bad, f"{lengths[bad]} values; expected n_dense={spec.n_dense} in every row")
    for name in fields:
        lengths = _array(table, name).value_lengths().to_numpy()
        bad = _first(lengths > spec.sparse_hotness)
        if bad is not None:
            _fail(path, name, bad, f"{lengths[bad]} ids; expected at most sparse_hotness={spec.sparse_hotness}")
    limits = {
        "seq_items": spec.n_items,
        "target_item": spec.n_items,
        "seq_categories": spec.n_categories,
        "target_category": spec.n_categories,
        "seq_actions": spec.n_actions,
    }
    limits.update({f"sparse_{name}": vocab for name, vocab in spec.sparse_fields.items()})
    for name, vocab in limits.items():
        array = _array(table, name)
        is_list = _is_list(array.type)
        values = _values(array.flatten() if is_list else array)
        bad = _first(values > vocab)
        if bad is not None:
            row = _row_of(array.value_lengths().to_numpy(), bad) if is_list else bad
            _fail(path, name, row, f"id {values[bad]:g} is outside the vocabulary; expected 1..{vocab} (0 = none)")


def parse_spec(raw: bytes, path: str | Path, key: str) -> FeatureSpec:
    """The FeatureSpec JSON of the schema metadata, every field present, of its type and in range."""
    where = f"{path}: schema metadata {key}"
    try:
        values = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(values).__name__}")
    expected = [*SPEC_MINIMUM, "sparse_fields"]
    missing = [name for name in expected if name not in values]
    unknown = sorted(set(values) - set(expected))
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}; expected the keys {expected}")
    for name, least in SPEC_MINIMUM.items():
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{where}: {name} must be an integer >= {least}, got {value!r}")
    fields = values["sparse_fields"]
    if not isinstance(fields, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in fields.values()
    ):
        raise ValueError(
            f"{where}: sparse_fields must map each field name to its vocabulary size (an integer >= 1), got {fields!r}"
        )
    sizes = {**{name: values[name] for name in VOCABULARIES}, **{f"sparse_fields.{k}": v for k, v in fields.items()}}
    for name, size in sizes.items():
        if size > MAX_VOCAB:
            raise ValueError(
                f"{where}: {name}={size} is beyond the largest embedding table ({MAX_VOCAB} rows); "
                "expected ids remapped to 1..N"
            )
    return FeatureSpec.from_dict(values)
