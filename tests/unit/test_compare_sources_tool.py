"""tools/compare_sources.py: the table it writes from two trees' benchmark JSON, and the tree it puts on PYTHONPATH."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("compare_sources", ROOT / "tools" / "compare_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _json(path: Path, times: dict[str, float]) -> Path:
    rows = [
        {"op": "rms_norm", "shape": "8192x128", "mode": "fwd", "impl": impl, "status": "ok", "gpu_ms": {"median": t}}
        for impl, t in times.items()
    ]
    rows.append({"op": "rms_norm", "shape": "8192x128", "mode": "fwd", "impl": "tilelang", "status": "skipped"})
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_the_table_pairs_rows_and_flags_only_slowdowns_past_three_percent(tmp_path):
    tool = _tool()
    before = _json(tmp_path / "before.json", {"triton": 0.100, "torch": 1.0})
    after = _json(tmp_path / "after.json", {"triton": 0.102, "torch": 1.2})
    lines = tool.comparison_table([(before, after), (before, None)]).splitlines()
    assert len(lines) == 4  # header, rule, two paired rows; the skipped row and the missing run give none
    assert "| rms_norm | 8192x128 | fwd | torch | 1.0000 | 1.2000 | 0.833 **slower** |" in lines
    assert "| rms_norm | 8192x128 | fwd | triton | 0.1000 | 0.1020 | 0.980 |" in lines


def test_the_compared_tree_replaces_the_package_on_the_path(tmp_path, monkeypatch):
    tool = _tool()
    (tmp_path / "mine" / "runtime").mkdir(parents=True)
    (tmp_path / "site").mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'mine'}:{tmp_path / 'site'}")
    paths = tool._environment(tmp_path / "other")["PYTHONPATH"].split(":")
    assert paths == [str((tmp_path / "other").resolve()), str(tmp_path / "site")]


def test_cases_dealt_to_gpus_keep_their_order_in_the_table(tmp_path, monkeypatch):
    """--gpus 2: case i runs both trees on GPU i % 2; the table lists the cases in the order given."""
    tool = _tool()
    runs = []

    def fake_run_case(tree, label, case, mode, out, timeout, gpu=None):
        runs.append((case, label, gpu))
        shape = case.partition(":")[2]
        path = out / f"{label}--{shape}.json"
        rows = [{"op": "rms_norm", "shape": shape, "mode": "fwd", "impl": "triton", "status": "ok",
                 "gpu_ms": {"median": 0.1}}]  # fmt: skip
        path.write_text(json.dumps({"rows": rows}))
        return path

    monkeypatch.setattr(tool, "run_case", fake_run_case)
    cases = [f"rms_norm:{shape}" for shape in ("a", "b", "c")]
    argv = ["compare_sources.py", "--before", "x", "--after", "y", "--out", str(tmp_path), "--gpus", "2", "--cases"]
    monkeypatch.setattr("sys.argv", argv + cases)
    tool.main()
    assert sorted(runs) == sorted((c, label, i % 2) for i, c in enumerate(cases) for label in ("before", "after"))
    table = (tmp_path / "comparison.md").read_text().splitlines()[2:]
    assert [line.split(" | ")[1] for line in table] == ["a", "b", "c"]
