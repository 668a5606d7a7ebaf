"""The taac-benchmark CLI on the CPU: listing, selection errors, a dry run, a small real run and the report."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from runtime.benchmark import report
from runtime.benchmark.cli import all_cases, main
from runtime.benchmark.runner import Machine, merge_rounds


def test_every_op_module_declares_cases():
    cases = all_cases()
    for op in ("rms_norm", "layer_norm", "l2norm"):
        assert op in cases and cases[op]


def test_list_and_bad_selection(capsys):
    assert main(["--list"]) == 0
    assert "rms_norm: 32768x4096, 8192x128, 131072x64" in capsys.readouterr().out
    assert main(["--operator", "softmax"]) == 2
    assert "unknown operator 'softmax'" in capsys.readouterr().err
    assert main(["--operator", "rms_norm", "--shape", "3x3"]) == 2
    assert "unknown shape '3x3' for rms_norm" in capsys.readouterr().err
    assert main(["--operator", "rms_norm", "--backends", "torch,cuda"]) == 2
    assert main(["--operator", "rms_norm", "--device", "gpu", "--dry-run"]) == 2
    assert "unknown device 'gpu'; expected cpu, cuda or cuda:N" in capsys.readouterr().err
    assert main(["--operator", "rms_norm", "--device", "meta", "--dry-run"]) == 2
    assert "unknown device 'meta'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_an_argument_error(capsys):
    assert main(["--operator", "rms_norm", "--device", "cuda", "--shape", "8192x128", "--no-peers"]) == 2
    assert "--device cuda: CUDA is not available here" in capsys.readouterr().err


def test_operator_is_required(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "taac-benchmark: --operator is required" in err and "rms_norm: 32768x4096" in err


@pytest.fixture
def no_timing(monkeypatch):
    """Selection errors come before any measurement: measuring the machine fails the test."""

    def measure(*args, **kwargs):
        raise AssertionError("timed before the selection was checked")

    monkeypatch.setattr(Machine, "measure", measure)


@pytest.mark.parametrize("backends", [",", "", " , "])
def test_an_empty_backend_selection_is_an_error(backends, capsys, no_timing):
    assert main(["--operator", "rms_norm", "--device", "cpu", "--dtype", "float32", "--backends", backends]) == 2
    assert (
        f"--backends {backends!r} selects no backend; expected some of torch, triton, tilelang"
        in capsys.readouterr().err
    )


def test_kernel_backends_on_the_cpu_say_why_they_cannot_run(capsys, monkeypatch, no_timing):
    base = ["--operator", "rms_norm", "--device", "cpu", "--dtype", "float32", "--no-peers"]
    monkeypatch.delenv("TRITON_INTERPRET")
    assert main([*base, "--backends", "torch,triton,tilelang"]) == 2
    err = capsys.readouterr().err
    assert (
        "--device cpu cannot run triton: triton runs on the CPU only under its interpreter (set TRITON_INTERPRET=1"
        in err
    )
    assert "tilelang: tilelang compiles CUDA kernels only" in err
    assert main([*base, "--dry-run"]) == 0  # the default: the backends that run here
    assert "backends ['torch']" in capsys.readouterr().out
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main([*base, "--backends", "tilelang"]) == 2
    assert "cannot run tilelang: tilelang compiles CUDA kernels only" in capsys.readouterr().err
    assert main([*base, "--backends", "triton", "--dry-run"]) == 0
    assert main([*base, "--dry-run"]) == 0
    assert "backends ['torch', 'triton']" in capsys.readouterr().out


def test_an_unwritable_json_path_is_an_error_before_timing(tmp_path, capsys, no_timing):
    base = ["--operator", "rms_norm", "--device", "cpu", "--dtype", "float32", "--backends", "torch", "--no-peers"]
    for path in (tmp_path / "missing" / "out.json", tmp_path):
        assert main([*base, "--json", str(path)]) == 2
        assert f"--json {path}: cannot write it" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_dry_run(capsys):
    assert main(["--operator", "layer_norm", "--dry-run", "--device", "cpu"]) == 0
    assert "layer_norm 8192x128 bfloat16 fwd/fwd+bwd" in capsys.readouterr().out


def test_auto_is_a_selectable_row(capsys):
    assert main(["--operator", "layer_norm", "--dry-run", "--device", "cpu", "--backends", "torch,auto"]) == 0
    assert "backends ['torch', 'auto']" in capsys.readouterr().out
    assert main(["--operator", "layer_norm", "--dry-run", "--device", "cpu", "--backends", "fastest"]) == 2
    assert "unknown backends ['fastest']; expected torch, triton, tilelang, auto" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_run_checks_then_times_and_writes_json(tmp_path):
    path = tmp_path / "rms.json"
    command = [
        sys.executable,
        "-m",
        "runtime.benchmark",
        "--operator",
        "rms_norm",
        "--shape",
        "8192x128",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--backends",
        "torch",
        "--mode",
        "fwd+bwd",
        "--no-peers",
        "--json",
        str(path),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)
    result = json.loads(path.read_text())
    rows = {(r["impl"], r["mode"]): r for r in result["rows"]}
    assert rows[("torch", "fwd+bwd")]["status"] == "ok" and rows[("torch", "fwd+bwd")]["eager_ms"] > 0
    assert rows[("torch", "fwd+bwd")]["errors"]["dx"] < 1e-5
    page = report.markdown([result])
    assert "| 8192x128 | fwd+bwd | torch (reference) | ok |" in page
    assert "GPU ms" not in page and "TB/s" not in page  # a CPU run has no GPU time: those columns are hidden
    with open(path.with_suffix(".csv")) as f:
        header, *rows = list(csv.reader(f))
    assert header[:4] == ["op", "dtype", "shape", "mode"] and "GPU ms (p20-p80)" in header
    assert rows[0][:5] == ["rms_norm", "float32", "8192x128", "fwd+bwd", "torch (reference)"]
    assert not path.with_suffix(".png").exists()  # no peer to compare with


def test_json_gets_a_csv_and_a_plot_beside_it_when_there_are_peers(tmp_path):
    pytest.importorskip("matplotlib")
    from runtime.benchmark.cli import write_csv_and_plot

    rows = [_timed_row("triton", 1.0, 5.0), {**_timed_row("torch eager", 2.0, 4.0), "kind": "peer"}]
    result = {"environment": {"commit": "abc", "gpu": "H200", "versions": {}}, "device": "cuda", "rows": rows}
    write_csv_and_plot(result, tmp_path / "l2norm.json")
    assert (tmp_path / "l2norm.png").stat().st_size > 1000
    assert "torch eager (peer)" in (tmp_path / "l2norm.csv").read_text()


def test_update_page_replaces_only_the_generated_section(tmp_path):
    page = tmp_path / "op.md"
    page.write_text("# op\n\nhand-written text\n")
    report.update_page(page, "| table v1 |")
    report.update_page(page, "| table v2 |")
    text = page.read_text()
    assert text.startswith("# op\n\nhand-written text\n") and "| table v2 |" in text and "v1" not in text
    assert text.count(report.BEGIN) == 1


def test_a_page_whose_section_has_no_end_marker_is_left_alone(tmp_path):
    """Appending a second section there left the first opening line behind: the next update replaced everything from
    it to the new end marker, hand-written text included."""
    page = tmp_path / "op.md"
    original = f"# op\n\n{report.BEGIN}\nold table\n\n## Notes\n\nhand-written text\n"
    page.write_text(original)
    with pytest.raises(ValueError, match=rf"{page}: .*no {report.END} after it"):
        report.update_page(page, "| table v2 |")
    assert page.read_text() == original


def test_update_page_replaces_the_page_whole_or_not_at_all(tmp_path):
    """A write that fails part way (here: text that cannot be encoded) used to leave the page truncated."""
    page = tmp_path / "op.md"
    page.write_text("# op\n\nhand-written text\n")
    with pytest.raises(UnicodeEncodeError):
        report.update_page(page, "| table \ud800 |")
    assert page.read_text() == "# op\n\nhand-written text\n" and [p.name for p in tmp_path.iterdir()] == ["op.md"]


def test_table_lists_each_rows_kernels(capsys):
    row = {"op": "rms_norm", "shape": "8192x128", "dtype": "bfloat16", "mode": "fwd", "impl": "triton", "kind": "backend",
           "status": "ok", "kernels": [{"kernel": "_rms_forward_kernel", "us": 5.25, "per_call": 1.0}]}  # fmt: skip
    result = {
        "environment": {"commit": "abc", "gpu": "H100", "versions": {"torch": "2.11"}},
        "device": "cuda",
        "rows": [row],
    }
    report.print_table(result)
    out = capsys.readouterr().out
    assert "8192x128 fwd triton: kernels" in out and "5.2" in out and "_rms_forward_kernel" in out


def test_commit_label_says_when_the_tree_is_not_heads(tmp_path, monkeypatch):
    """The results' commit: HEAD's short hash, "+modified" when a tracked file differs from it (a stale .git on a
    copied tree), TAAC_COMMIT when set."""
    from runtime.benchmark import runner

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAAC_COMMIT", raising=False)
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "kernel.py").write_text("a = 1\n")
    subprocess.run([*git, "add", "kernel.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert runner._commit() == head
    (tmp_path / "kernel.py").write_text("a = 2\n")
    assert runner._commit() == f"{head}+modified"
    monkeypatch.setenv("TAAC_COMMIT", "abc1234")
    assert runner._commit() == "abc1234"


def _timed_row(impl: str, gpu_median: float, eager: float, status: str = "ok") -> dict:
    return {"op": "l2norm", "shape": "8x8", "dtype": "bfloat16", "mode": "fwd", "impl": impl, "kind": "backend",
            "status": status, "eager_ms": eager, "bytes": 2e9, "peak_mem_mb": gpu_median,
            "gpu_ms": {"median": gpu_median, "p20": gpu_median - 0.1, "p80": gpu_median + 0.1}}  # fmt: skip


def test_rounds_merge_to_the_median_round_and_keep_failures():
    machine = Machine(torch.device("cuda"), copy_tbs=2.0)
    rounds = [
        [_timed_row("triton", 1.0, 5.0), _timed_row("tilelang", 2.0, 1.0)],
        [_timed_row("triton", 3.0, 4.0), _timed_row("tilelang", 2.0, 1.0, status="wrong")],
        [_timed_row("triton", 2.0, 6.0), _timed_row("tilelang", 2.0, 1.0)],
    ]
    triton, tilelang = merge_rounds(rounds, machine)
    assert triton["gpu_ms"] == {"median": 2.0, "p20": 1.9, "p80": 2.1} and triton["eager_ms"] == 5.0
    assert triton["rounds"] == {"eager_ms": [5.0, 4.0, 6.0], "gpu_ms": [1.0, 3.0, 2.0]}
    assert triton["tbs"] == pytest.approx(1.0) and triton["frac_copy"] == pytest.approx(0.5)  # at the merged median
    assert triton["peak_mem_mb"] == 3.0
    assert tilelang["status"] == "wrong"  # never averaged away
    assert "2.0000 (1.9000-2.1000), 3 rounds 1.0000-3.0000" in report.row_cells(triton)[4]


def test_cpu_run_in_rounds(tmp_path):
    path = tmp_path / "rounds.json"
    assert main(["--operator", "rms_norm", "--shape", "8192x128", "--device", "cpu", "--dtype", "float32",
                 "--backends", "torch", "--mode", "fwd", "--no-peers", "--rounds", "2", "--json", str(path)]) == 0  # fmt: skip
    (row,) = json.loads(path.read_text())["rows"]
    assert len(row["rounds"]["eager_ms"]) == 2 and row["eager_ms"] > 0
    assert main(["--operator", "rms_norm", "--rounds", "0", "--device", "cpu"]) == 2
