"""The figures section and the plot of an op's page, from small synthetic benchmark results."""

import json

import pytest

from report_pages import assert_bad_result_keeps_page
from runtime.benchmark import report
from runtime.benchmark.comparison import compare


def _row(shape, mode, impl, kind, gpu_ms=None, eager_ms=1.0, status="ok"):
    row = {"op": "rms_norm", "shape": shape, "dtype": "bfloat16", "mode": mode, "impl": impl, "kind": kind,
           "status": status, "eager_ms": eager_ms}  # fmt: skip
    if gpu_ms is not None:
        row["gpu_ms"] = {"median": gpu_ms, "p20": gpu_ms * 0.9, "p80": gpu_ms * 1.1}
    if status != "ok":
        row["error"] = "BackendUnavailableError: tilelang is not installed"
    return row


def _result(rows, gpu="NVIDIA H200", command="taac-benchmark --operator rms_norm --json rms_norm.json"):
    env = {"commit": "abc1234", "gpu": gpu, "versions": {"torch": "2.11.0", "triton": "3.6.0", "fla": None}}
    return {
        "command": command,
        "environment": env,
        "device": "cuda",
        "copy_tbs": 4.0,
        "matmul_tflops": None,
        "rows": rows,
    }


@pytest.fixture
def results():
    first = _result(
        [
            _row("8192x128", "fwd", "triton", "backend", 0.005),
            _row("8192x128", "fwd", "tilelang", "backend", 0.004),
            _row("8192x128", "fwd", "torch", "backend", 0.001),  # the reference: never "ours", never a peer
            _row("8192x128", "fwd", "torch.compile", "peer", 0.008),
            _row("8192x128", "fwd", "liger", "peer", 0.010),
            _row("8192x128", "fwd+bwd", "triton", "backend", 0.020),
            _row("8192x128", "fwd+bwd", "tilelang", "backend", status="error"),
            _row("8192x128", "fwd+bwd", "torch.compile", "peer", 0.015),
            _row("8192x128", "fwd+bwd", "liger", "peer", 0.060),
        ]
    )
    second = _result([
        _row("131072x64", "fwd", "triton", "backend", 0.012),
        _row("131072x64", "fwd", "liger", "peer", 0.018),
        _row("131072x64", "fwd", "torch.compile", "peer", status="wrong"),
    ], command="taac-benchmark --operator rms_norm --shape 131072x64 --json b.json")  # fmt: skip
    return [first, second]


def test_comparisons_pick_the_best_of_ours_and_of_the_peers(results):
    fwd, fwd_bwd, wide = compare(results)
    assert (fwd.shape, fwd.mode, fwd.ours, fwd.peers) == (
        "8192x128",
        "fwd",
        ["triton", "tilelang"],
        ["torch.compile", "liger"],
    )
    assert fwd.best(fwd.ours) == ("tilelang", 0.004) and fwd.best(fwd.peers) == ("torch.compile", 0.008)
    assert fwd.speedup() == pytest.approx(2.0)  # the torch reference's 0.001 counts for neither side
    assert fwd_bwd.ms["tilelang"] is None and fwd_bwd.status["tilelang"] == "error"
    assert fwd_bwd.speedup() == pytest.approx(0.75)  # triton 0.020 against torch.compile 0.015: slower
    assert wide.speedup() == pytest.approx(1.5)  # a wrong peer is not timed, so liger is the best peer


def test_figures_table_has_times_ratios_and_where_it_ran(results):
    text = report.figures(results, plot_name="rms_norm.png")
    assert "Measured on NVIDIA H200; torch 2.11.0, triton 3.6.0; source abc1234." in text
    assert "    taac-benchmark --operator rms_norm --shape 131072x64 --json b.json" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| shape"))
    assert (
        header
        == "| shape | dtype | mode | triton | tilelang | torch | torch.compile (peer) | liger (peer) | ours vs best peer |"
    )
    assert (
        "| 8192x128 | bfloat16 | fwd | 0.0050 | 0.0040 | 0.0010 | 0.0080 | 0.0100 | 2.00x (tilelang vs torch.compile) |"
        in lines
    )
    assert (
        "| 8192x128 | bfloat16 | fwd+bwd | 0.0200 | error |  | 0.0150 | 0.0600 | 0.75x (triton vs torch.compile) |"
        in lines
    )
    assert "| 131072x64 | bfloat16 | fwd | 0.0120 |  |  | wrong | 0.0180 | 1.50x (triton vs liger) |" in lines
    assert lines[-1] == "![ours beside the peers](rms_norm.png)"


def test_times_without_cuda_graph_replay_are_marked():
    eager_peer = _row("256", "fwd", "torch.compile", "peer", 0.030)
    eager_peer["graph"] = False
    text = report.figures([_result([_row("256", "fwd", "triton", "backend", 0.010), eager_peer])])
    lines = text.splitlines()
    assert "| 256 | bfloat16 | fwd | 0.0100 | 0.0300 \u2020 | 3.00x (triton vs torch.compile) |" in lines
    assert "\u2020: GPU time of eager launches (the pass could not be captured in a CUDA graph)." in lines
    graphed = report.figures([_result([_row("256", "fwd", "triton", "backend", 0.010)])])
    assert "\u2020" not in graphed


def test_without_gpu_times_the_table_compares_eager_times():
    result = _result(
        [
            _row("256", "fwd", "triton", "backend", eager_ms=0.02),
            _row("256", "fwd", "torch eager", "peer", eager_ms=0.01),
        ]
    )
    text = report.figures([result])
    assert (
        "eager ms per call" in text
        and "| 256 | bfloat16 | fwd | 0.0200 | 0.0100 | 0.50x (triton vs torch eager) |" in text
    )


def test_cli_writes_the_page_section_and_a_png(results, tmp_path):
    pytest.importorskip("matplotlib")
    paths = []
    for i, result in enumerate(results):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(result))
    page = tmp_path / "docs" / "rms_norm.md"
    page.parent.mkdir()
    page.write_text(f"# rms_norm\n\nhand-written\n\n{report.BEGIN}\nold figures\n{report.END}\n\n## After\n")
    plot = tmp_path / "docs" / "rms_norm.png"
    assert report.main([*map(str, paths), "--page", str(page), "--plot", str(plot)]) == 0
    text = page.read_text()
    assert text.startswith("# rms_norm\n\nhand-written\n") and text.rstrip().endswith("## After")
    assert "old figures" not in text and "2.00x (tilelang vs torch.compile)" in text
    assert "![ours beside the peers](rms_norm.png)" in text  # relative to the page
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000


def test_plot_draws_shapes_without_a_timed_peer(tmp_path):
    pytest.importorskip("matplotlib")
    from runtime.benchmark.plot import plot_speedups

    result = _result(
        [_row("256", "fwd", "triton", "backend", 0.01), _row("256", "fwd", "liger", "peer", status="error")]
    )
    path = plot_speedups([result], tmp_path / "sub" / "op.png")
    assert path.exists() and path.stat().st_size > 0


def test_auto_rows_get_their_ratio_to_the_fastest_backend_and_a_summary():
    result = _result(
        [
            _row("8192x128", "fwd", "triton", "backend", 0.005),
            _row("8192x128", "fwd", "tilelang", "backend", 0.004),
            _row("8192x128", "fwd", "auto", "backend", 0.0041),  # took tilelang
            _row("8192x128", "fwd", "torch.compile", "peer", 0.008),
            _row("8192x128", "fwd+bwd", "triton", "backend", 0.020),
            _row("8192x128", "fwd+bwd", "tilelang", "backend", 0.016),
            _row("8192x128", "fwd+bwd", "auto", "backend", 0.020),  # took triton, 25% slower
        ]
    )
    fwd, fwd_bwd = compare([result])
    assert fwd.ours == ["triton", "tilelang"] and fwd.best(fwd.ours) == ("tilelang", 0.004)  # auto is not "ours"
    assert fwd.auto_ratio() == pytest.approx(0.004 / 0.0041) and fwd_bwd.auto_ratio() == pytest.approx(0.8)
    lines = report.figures([result]).splitlines()
    assert next(line for line in lines if line.startswith("| shape")).endswith(
        "| ours vs best peer | fastest backend / auto |"
    )
    assert "| 8192x128 | bfloat16 | fwd+bwd | 0.0200 | 0.0160 | 0.0200 |  |  | 0.80 |" in lines
    assert lines[-1] == "Auto ran within 5% of the fastest backend on 1 of 2 rows; worst: 0.80 (8192x128, fwd+bwd)."


def test_without_auto_rows_there_is_no_auto_column(results):
    assert "auto" not in report.figures(results)


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{not json", r"r\.json: not valid JSON"),
        ("[]", r"r\.json: expected a result \(a JSON object\), got list"),
        (json.dumps({"rows": []}), r"r\.json: missing keys \['command', 'environment', 'device'\]"),
        (json.dumps(_result([])), r"r\.json: holds no rows"),
        (
            json.dumps(_result([{"shape": "8x8", "mode": "fwd", "impl": "triton"}])),
            r"r\.json: row 0 lacks \['status'\]",
        ),
    ],
)
def test_a_bad_results_file_is_named_and_the_page_kept(tmp_path, content, expected):
    """An empty result used to replace the page's figures with an empty table; the others stopped with a bare
    KeyError or JSONDecodeError naming no file."""
    assert_bad_result_keeps_page(report.main, report.GENERATOR, tmp_path, content, expected)
