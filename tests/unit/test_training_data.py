"""Parquet data is checked when it is opened: each bad file names the file, the column and the first bad row."""

import json
import math

import pytest
import torch

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from runtime.training.parquet import ParquetPCVR, read_batch, read_spec  # noqa: E402

INTS = pa.list_(pa.int64())
SPEC = {
    "n_items": 9,
    "n_categories": 3,
    "n_actions": 3,
    "sparse_fields": {"city": 3},
    "sparse_hotness": 2,
    "n_dense": 2,
    "seq_len": 5,
}


def _columns() -> dict:
    """Three well-formed rows."""
    return {
        "label": pa.array([1.0, 0.0, 1.0], pa.float32()),
        "dense": pa.array([[0.5, 1.5], [2.0, -1.0], [0.0, 0.0]], pa.list_(pa.float32())),
        "sparse_city": pa.array([[3], [1, 2], []], INTS),
        "seq_items": pa.array([[1, 2, 3], [7], [4, 5]], INTS),
        "seq_categories": pa.array([[1, 1, 2], [3], [2, 2]], INTS),
        "seq_actions": pa.array([[1, 1, 3], [1], [2, 1]], INTS),
        "target_item": pa.array([4, 9, 1], pa.int64()),
        "target_category": pa.array([2, 3, 1], pa.int64()),
    }


def _write(path, spec: dict | None = SPEC, **changes):
    table = pa.table({**_columns(), **changes})
    if spec is not None:
        table = table.replace_schema_metadata({b"taac.spec": json.dumps(spec).encode()})
    pq.write_table(table, path)
    return path


def test_well_formed_rows_load_with_and_without_the_spec(tmp_path):
    batch = read_batch(_write(tmp_path / "t.parquet"), read_spec(tmp_path / "t.parquet"))
    assert batch.seq_items.tolist()[1] == [7, 0, 0, 0, 0] and batch.seq_lengths.tolist() == [3, 1, 2]
    # ids stored as whole floats are accepted; the inferred spec is the data's
    path = _write(
        tmp_path / "f.parquet",
        spec=None,
        seq_items=pa.array([[1.0, 2.0, 3.0], [7.0], [4.0, 5.0]], pa.list_(pa.float64())),
    )
    spec = read_spec(path)
    assert (spec.n_items, spec.seq_len, spec.n_dense, spec.sparse_hotness) == (9, 3, 2, 2)
    assert torch.equal(read_batch(path, spec).seq_items, read_batch(path, spec).seq_items.long())


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"label": pa.array([1.0, math.nan, 0.0], pa.float32())}, "column label, row 1: label nan is outside [0, 1]"),
        ({"label": pa.array([1.0, 0.0, 1.5], pa.float32())}, "column label, row 2: label 1.5 is outside [0, 1]"),
        ({"label": pa.array([1.0, None, 0.0], pa.float32())}, "column label, row 1: null; expected a value"),
        ({"label": pa.array(["1", "0", "1"])}, "column label: expected float (one value per row), got string"),
        (
            {"dense": pa.array([[0.5, 1.5], [2.0, math.inf], [0.0, 0.0]], pa.list_(pa.float32()))},
            "column dense, row 1: dense feature inf is not finite",
        ),
        (
            {"dense": pa.array([[0.5, 1.5], [2.0, -1e39], [0.0, 0.0]], pa.list_(pa.float64()))},
            "column dense, row 1: dense feature -1e+39 is beyond float32 (the model's dtype); expected |x| <= 3.4",
        ),
        (
            {"dense": pa.array([[0.5, 1.5], [2.0], [0.0, 0.0]], pa.list_(pa.float32()))},
            "column dense, row 1: 1 values; expected n_dense=2 in every row",
        ),
        ({"seq_items": pa.array([[1, 2, 3], [7], [4, -5]], INTS)}, "column seq_items, row 2: id -5 is negative"),
        (
            {"seq_items": pa.array([[1.0, 2.5, 3.0], [7.0], [4.0, 5.0]], pa.list_(pa.float64()))},
            "column seq_items, row 0: id 2.5 is not a whole number",
        ),
        (
            {"seq_items": pa.array([[1, 2, 3], [7], [4, 10]], INTS)},
            "column seq_items, row 2: id 10 is outside the vocabulary; expected 1..9",
        ),
        (
            {"seq_items": pa.array([1, 7, 4], pa.int64())},
            "column seq_items: expected list<int64> (a list per row), got int64",
        ),
        (
            {"seq_items": pa.array([["a"], ["b"], ["c"]], pa.list_(pa.string()))},
            "column seq_items: expected list<int64> (a list per row), got list<",
        ),
        (
            {"seq_items": pa.array([[1, 2, 3], [7, None], [4, 5]], INTS)},
            "column seq_items, row 1: a null inside the list",
        ),
        ({"seq_items": pa.array([[1, 2, 3], None, [4, 5]], INTS)}, "column seq_items, row 1: null; expected a value"),
        (
            {"seq_categories": pa.array([[1, 1, 2], [3], [2]], INTS)},
            "column seq_categories, row 2: 1 values for the 2 events of seq_items",
        ),
        (
            {"seq_actions": pa.array([[1, 1, 3], [], [2, 1]], INTS)},
            "column seq_actions, row 1: 0 values for the 1 events of seq_items",
        ),
        (
            {"target_category": pa.array([2, 4, 1], pa.int64())},
            "column target_category, row 1: id 4 is outside the vocabulary; expected 1..3",
        ),
        ({"target_item": pa.array([4.0, 9.0, 0.5])}, "column target_item, row 2: id 0.5 is not a whole number"),
        (
            {"sparse_city": pa.array([[3], [1, 2, 3], []], INTS)},
            "column sparse_city, row 1: 3 ids; expected at most sparse_hotness=2",
        ),
        (
            {"sparse_zip": pa.array([[1], [1], [1]], INTS)},
            "sparse columns ['sparse_city', 'sparse_zip']; the feature spec has ['sparse_city']",
        ),
    ],
)
def test_bad_columns_are_named_with_their_first_bad_row(tmp_path, changes, expected):
    path = _write(tmp_path / "t.parquet", **changes)
    with pytest.raises(ValueError) as error:
        read_batch(path, read_spec(path))
    assert str(error.value).startswith(f"{path}: {expected}"), error.value


def test_a_file_without_the_spec_is_checked_before_the_spec_is_inferred(tmp_path):
    path = _write(
        tmp_path / "t.parquet", spec=None, seq_items=pa.array([[1, 2, 3], [7], [4.5, 5]], pa.list_(pa.float64()))
    )
    with pytest.raises(ValueError, match=r"column seq_items, row 2: id 4\.5 is not a whole number"):
        read_spec(path)


@pytest.mark.parametrize(
    "metadata, expected",
    [
        (b"{not json", "is not valid JSON"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (json.dumps({k: v for k, v in SPEC.items() if k != "seq_len"}).encode(), "missing keys ['seq_len']"),
        (json.dumps({**SPEC, "n_itmes": 9}).encode(), "unknown keys ['n_itmes']"),
        (json.dumps({**SPEC, "n_items": "9"}).encode(), "n_items must be an integer >= 1, got '9'"),
        (json.dumps({**SPEC, "seq_len": 0}).encode(), "seq_len must be an integer >= 1, got 0"),
        (
            json.dumps({**SPEC, "sparse_fields": {"city": -1}}).encode(),
            "sparse_fields must map each field name to its vocabulary size",
        ),
    ],
)
def test_malformed_spec_metadata_is_named(tmp_path, metadata, expected):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table(_columns()).replace_schema_metadata({b"taac.spec": metadata}), path)
    with pytest.raises(ValueError) as error:
        read_spec(path)
    assert str(error.value).startswith(f"{path}: schema metadata taac.spec") and expected in str(error.value), (
        error.value
    )


def test_empty_missing_and_foreign_files_are_refused(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table(_columns()).slice(0, 0).replace_schema_metadata({b"taac.spec": json.dumps(SPEC).encode()}), empty
    )
    with pytest.raises(ValueError, match="empty.parquet: holds no rows"):
        read_batch(empty, read_spec(empty))
    (tmp_path / "text.parquet").write_text("label,dense\n1,0.5\n")
    with pytest.raises(ValueError, match="text.parquet: not a readable Parquet file"):
        read_spec(tmp_path / "text.parquet")
    truncated = _write(tmp_path / "cut.parquet")
    truncated.write_bytes(truncated.read_bytes()[:-40])
    with pytest.raises(ValueError, match="cut.parquet: not a readable Parquet file"):
        read_batch(truncated, read_spec(_write(tmp_path / "t.parquet")))
    _write(tmp_path / "m.parquet", spec=None)
    pq.write_table(pa.table(_columns()).drop(["seq_actions"]), tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"missing columns \['seq_actions'\]"):
        read_spec(tmp_path / "m.parquet")


@pytest.mark.parametrize("broken", ["train", "val"])
def test_both_files_are_checked_when_the_data_is_opened(tmp_path, broken):
    """Labels of either file: a NaN label used to train to a non-finite loss (train) or fail at the first validation (val)."""
    for name in ("train", "val"):
        bad = {"label": pa.array([1.0, 0.0, math.nan], pa.float32())} if name == broken else {}
        _write(tmp_path / f"{name}.parquet", **bad)
    with pytest.raises(ValueError, match=rf"{broken}\.parquet: column label, row 2: label nan is outside \[0, 1\]"):
        ParquetPCVR(tmp_path)


def test_user_ids_are_optional_and_checked(tmp_path):
    without = read_batch(_write(tmp_path / "a.parquet"), read_spec(tmp_path / "a.parquet"))
    assert without.user_id is None
    with_users = read_batch(
        _write(tmp_path / "b.parquet", user_id=pa.array([7, 0, 7], pa.int64())), read_spec(tmp_path / "b.parquet")
    )
    assert with_users.user_id.tolist() == [7, 0, 7] and with_users.slice(1, 3).user_id.tolist() == [0, 7]
    with pytest.raises(ValueError, match=r"b.parquet: column user_id, row 1: id -2 is negative"):
        read_batch(
            _write(tmp_path / "b.parquet", user_id=pa.array([7, -2, 7], pa.int64())), read_spec(tmp_path / "a.parquet")
        )
    with pytest.raises(ValueError, match=r"column user_id"):
        read_batch(_write(tmp_path / "b.parquet", user_id=pa.array(["u", "v", "w"])), read_spec(tmp_path / "a.parquet"))


def test_an_inferred_spec_meets_the_minimums_of_a_stored_one(tmp_path):
    """Columns of only 0 ids ("none") infer a vocabulary of 1, not 0; all-empty dense rows, no dense features."""
    zeros = pa.array([[0, 0, 0], [0], [0, 0]], INTS)
    path = _write(
        tmp_path / "z.parquet",
        spec=None,
        seq_actions=zeros,
        seq_categories=zeros,
        target_category=pa.array([0, 0, 0], pa.int64()),
        sparse_city=pa.array([[], [], []], INTS),
    )
    spec = read_spec(path)
    assert (spec.n_actions, spec.n_categories, spec.sparse_fields) == (1, 1, {"city": 1})
    assert read_batch(path, spec).seq_actions.sum() == 0
    path = _write(tmp_path / "d.parquet", spec=None, dense=pa.array([[], [], []], pa.list_(pa.float32())))
    spec = read_spec(path)  # no dense features: the models take none
    assert spec.n_dense == 0 and read_batch(path, spec).dense.shape == (3, 0)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"target_item": pa.array([4, 2**62, 1], pa.int64())}, f"column target_item: id {2**62} makes the inferred"),
        ({"sparse_city": pa.array([[3], [1, 2**40], []], INTS)}, f"vocabulary sparse_fields.city={2**40}, beyond"),
    ],
)
def test_an_inferred_vocabulary_too_large_to_allocate_is_named(tmp_path, changes, expected):
    path = _write(tmp_path / "t.parquet", spec=None, **changes)
    with pytest.raises(ValueError, match="beyond the largest embedding table") as error:
        read_spec(path)
    assert str(error.value).startswith(f"{path}: ") and expected in str(error.value), error.value
    stored = _write(tmp_path / "s.parquet", spec={**SPEC, "n_items": 2**62})
    with pytest.raises(ValueError, match=rf"taac\.spec: n_items={2**62} is beyond the largest embedding table"):
        read_spec(stored)


def test_a_file_without_sparse_fields_loads_and_trains(tmp_path):
    from runtime.accelerators import use_accelerators
    from runtime.models import BaselinePCVR

    columns = {name: values for name, values in _columns().items() if not name.startswith("sparse_")}
    pq.write_table(pa.table(columns), tmp_path / "s.parquet")
    spec = read_spec(tmp_path / "s.parquet")
    assert spec.sparse_fields == {}
    batch = read_batch(tmp_path / "s.parquet", spec)
    assert batch.sparse.shape[:2] == (3, 0) and batch.seq_lengths.tolist() == [3, 1, 2]
    stored = {**SPEC, "sparse_fields": {}}
    table = pa.table(columns).replace_schema_metadata({b"taac.spec": json.dumps(stored).encode()})
    pq.write_table(table, tmp_path / "m.parquet")
    batch = read_batch(tmp_path / "m.parquet", read_spec(tmp_path / "m.parquet"))
    assert batch.sparse.shape == (3, 0, 2)
    model = BaselinePCVR(read_spec(tmp_path / "m.parquet"), d_model=8, n_heads=2, n_layers=1, head_hidden=8)
    with use_accelerators(default="torch"):
        logits = model(batch)
    logits.sum().backward()
    assert logits.shape == (3,) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="model.sparse_collection: true needs sparse features"):
        BaselinePCVR(read_spec(tmp_path / "m.parquet"), d_model=8, n_heads=2, n_layers=1, head_hidden=8,
                     sparse_collection=True)  # fmt: skip
