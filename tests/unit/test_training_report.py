"""The training-step page's figures section and plot (runtime.training.report), from small synthetic results of
runtime.training.benchmark: the table, the merge of two files, the page section, the plot."""

import json

import pytest

from report_pages import assert_bad_result_keeps_page
from runtime.benchmark import pages
from runtime.training import report

ENV = {"torch": "2.11.0+cu130", "python": "3.12.3", "triton": "3.6.0", "tilelang": "0.1.15", "gpu": "NVIDIA H200"}


def _entry(model, preset, mode, step_ms, first_step_s=1.0, within=True, **extra):
    return {
        "model": model,
        "accelerators": preset,
        "mode": mode,
        "step_ms": step_ms,
        "samples_per_s": 256_000 / step_ms,
        "real_tokens_per_s": 40e6 / step_ms,
        "mfu": 0.04 * 2.0 / step_ms,
        "peak_memory_mib": 1000.0 + 10 * step_ms,
        "first_step_s": first_step_s,
        "loss_within_bound": within,
        "fallbacks": [],
        **extra,
    }


def _bench(**changes):
    bench = {"models": ["baseline", "tokenformer"], "presets": ["torch", "triton"], "compiled": [], "graphed": ["triton"],
             "tuned": ["torch"], "experiment_preset": None, "dry_run": False, "steps": 120, "warmup": 20,
             "loss_bound": 0.01, "overrides": ["model.dropout=0.0"], "output": "/tmp/x/training.json",
             "time_budget_s": 0.0, "profile_steps": 0}  # fmt: skip
    return {**bench, **changes}


def _first():
    """Run 1: the tokenformer tuned run skipped by the time budget."""
    return {
        "benchmark": _bench(time_budget_s=250.0),
        "environment": ENV,
        "bf16_matmul_tflops": 780.2,
        "loss_bound": 0.01,
        "skipped_after_budget": True,
        "runs": [
            _entry("baseline", "torch", "eager", 16.0),
            _entry("tokenformer", "torch", "eager", 18.0),
            _entry("baseline", "triton", "eager", 12.5, first_step_s=14.1),
            _entry("tokenformer", "triton", "eager", 12.0, within=False),
            _entry("baseline", "triton", "cuda_graph", 2.5),
            _entry("tokenformer", "triton", "cuda_graph", 2.4),
            _entry("baseline", "torch", "tuned", 2.0, first_step_s=209.8),
        ],
    }


def _second():
    """Run 2: the same torch eager setup, slower this time, and triton tuned."""
    return {
        "benchmark": _bench(models=["baseline"], presets=["torch"], graphed=[], tuned=["triton"]),
        "environment": ENV,
        "bf16_matmul_tflops": 775.8,
        "loss_bound": 0.01,
        "runs": [_entry("baseline", "torch", "eager", 20.0), _entry("baseline", "triton", "tuned", 1.6)],
    }


def _runs(*results):
    return [report.Run(i, f"r{i}.json", f"results/r{i}.json", r) for i, r in enumerate(results, 1)]


def _table_rows(text):
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| run |", "| ---"))]


def test_one_file_table_has_every_column_and_ratios_within_the_run():
    lines = report.table(_runs(_first()))
    assert lines[0] == (
        "| model | accelerators | mode | ms/step | samples/s | real tokens/s | MFU (%) | peak MiB | first step s "
        "| vs torch eager | vs fastest torch | loss within bound |"
    )
    assert lines[1] == "|" + " --- |" * 12
    # grouped by model, then mode (eager, torch.compile, CUDA graph, tuned), then preset
    assert [line.split(" | ")[1:3] for line in lines[2:]] == [
        ["torch", "eager"],
        ["triton", "eager"],
        ["triton", "CUDA graph"],
        ["torch", "tuned (max-autotune + CUDA graph)"],
        ["torch", "eager"],
        ["triton", "eager"],
        ["triton", "CUDA graph"],
    ]
    assert lines[2] == (
        "| baseline | torch | eager | 16.00 | 16,000 | 2.50M | 0.5 | 1,160 | 1.00 | 1.00x | 0.12x (tuned) | yes |"
    )
    assert lines[3] == (
        "| baseline | triton | eager | 12.50 | 20,480 | 3.20M | 0.6 | 1,125 | 14.10 | 1.28x | 0.16x (tuned) | yes |"
    )
    assert lines[4].endswith("| 2.50 | 102,400 | 16.00M | 3.2 | 1,025 | 1.00 | 6.40x | 0.80x (tuned) | yes |")
    assert lines[5].endswith("| 2.00 | 128,000 | 20.00M | 4.0 | 1,020 | 209.80 | 8.00x | 1.00x (tuned) | yes |")
    # tokenformer has no tuned torch row: its strongest torch setup is eager, and says so
    assert lines[7].endswith("| 1.50x | 1.50x (eager) | no |")
    assert lines[8].endswith("| 7.50x | 7.50x (eager) | yes |")


def test_header_names_gpu_versions_matmul_rate_bound_and_the_skipped_runs():
    text = report.figures(_runs(_first()))
    lines = text.splitlines()
    assert lines[0] == "- Measured on NVIDIA H200; torch 2.11.0+cu130, python 3.12.3, triton 3.6.0, tilelang 0.1.15."
    assert lines[1] == "- bf16 matmul rate measured by the benchmark, the denominator of MFU: 780 TFLOP/s."
    assert lines[2].startswith("- Loss bound: 0.01 (")
    assert lines[3] == (
        "- The run stopped at its time budget (`time_budget_s=250`): some planned runs were skipped "
        "(tokenformer / torch / tuned)."
    )
    assert "| run |" not in text and "Runs:" not in text  # one file: no run column, no runs line
    assert "    python -m runtime.training.benchmark steps=120 warmup=20 time_budget_s=250 " in text
    assert "mean over steps 21-120" in text


def test_command_names_the_plan_and_the_settings_that_are_not_the_default():
    first = report.command(_bench(time_budget_s=250.0, presets=["torch", "triton", "triton_unfused"]), "a.json")
    assert first == (
        'python -m runtime.training.benchmark steps=120 warmup=20 time_budget_s=250 "models=[baseline,tokenformer]" '
        '"presets=[torch,triton,triton_unfused]" "compiled=[]" "graphed=[triton]" "tuned=[torch]" output=a.json'
    )
    second = report.command(_bench(models=["baseline"], profile_steps=10, overrides=["model.dropout=0.1"]), "b.json")
    assert "time_budget_s" not in second and "profile_steps=10" in second
    assert second.endswith('"tuned=[torch]" "overrides=[model.dropout=0.1]" output=b.json')


def test_two_files_merge_with_a_run_column_and_ratios_of_each_run():
    text = report.figures(_runs(_first(), _second()))
    rows = _table_rows(text)
    header = next(line for line in text.splitlines() if line.startswith("| run |"))
    assert header.startswith("| run | model | accelerators | mode | ms/step |")
    baseline = [r for r in rows if r.startswith(("| 1 | baseline", "| 2 | baseline"))]
    assert [r.split(" | ")[0:4] for r in baseline] == [
        ["| 1", "baseline", "torch", "eager"],
        ["| 1", "baseline", "triton", "eager"],
        ["| 1", "baseline", "triton", "CUDA graph"],
        ["| 1", "baseline", "torch", "tuned (max-autotune + CUDA graph)"],
        ["| 2", "baseline", "torch", "eager"],
        ["| 2", "baseline", "triton", "tuned (max-autotune + CUDA graph)"],
    ]
    assert rows[6].startswith("| 1 | tokenformer")  # models grouped: tokenformer after both baseline runs
    # run 2's triton tuned against run 2's own torch eager (20.0 ms), never run 1's (16.0) or run 1's tuned torch
    assert baseline[5].endswith("| 1.60 | 160,000 | 25.00M | 5.0 | 1,016 | 1.00 | 12.50x | 12.50x (eager) | yes |")
    assert baseline[4].endswith("| 1.00x | 1.00x (eager) | yes |")
    assert (
        "- bf16 matmul rate measured by the benchmark, the denominator of MFU: 780 TFLOP/s (run 1), 776 TFLOP/s (run 2)."
        in text
    )
    assert "- Run 1 stopped at its time budget (`time_budget_s=250`)" in text
    runs_line = next(line for line in text.splitlines() if line.startswith("Runs: "))
    assert runs_line.startswith("Runs: 1 = [results/r1.json](results/r1.json); 2 = [results/r2.json](results/r2.json).")
    assert "not side by side" in runs_line
    assert "baseline / torch / eager: 16.00 ms in run 1, 20.00 ms in run 2." in runs_line
    assert "Run 2, [results/r2.json](results/r2.json), on the GPU machine:" in text
    assert 'python -m runtime.training.benchmark steps=120 warmup=20 "models=[baseline]" "presets=[torch]" ' in text


def _layouts():
    """baseline on both layouts (the jagged one faster, its CUDA graph left out), hstu on jagged batches only; the
    time budget cut hstu's triton run."""
    graph_reason = "the whole-step CUDA graph needs the shapes it captured (data.jagged: ...)"
    return {
        "benchmark": _bench(models=["baseline", "hstu"], graphed=["triton"], tuned=[], layouts=["padded", "jagged"]),
        "environment": ENV,
        "bf16_matmul_tflops": 780.2,
        "loss_bound": 0.01,
        "skipped_after_budget": True,
        "skipped": [
            {"model": "hstu", "layout": "padded", "accelerators": p, "mode": m, "reason": "HSTUPCVR reads jagged only"}
            for p, m in (("torch", "eager"), ("triton", "eager"), ("triton", "cuda_graph"))
        ]
        + [
            {"model": m, "layout": "jagged", "accelerators": "triton", "mode": "cuda_graph", "reason": graph_reason}
            for m in ("baseline", "hstu")
        ],
        "runs": [
            _entry("baseline", "torch", "eager", 16.0, layout="padded"),
            _entry("baseline", "torch", "eager", 8.0, layout="jagged", loss_within_bound_vs_padded=True),
            _entry("hstu", "torch", "eager", 10.0, layout="jagged"),
            _entry("baseline", "triton", "eager", 12.0, layout="padded"),
            _entry("baseline", "triton", "eager", 4.0, layout="jagged", loss_within_bound_vs_padded=False),
            _entry("baseline", "triton", "cuda_graph", 2.0, layout="padded"),
        ],
    }


def test_layouts_get_a_column_and_the_jagged_rows_their_ratio_to_padded():
    text = report.figures(_runs(_layouts()))
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    assert header.startswith("| model | accelerators | mode | layout | ms/step |")
    assert header.endswith("| loss within bound | real tokens/s vs padded | loss within bound of padded |")
    rows = _table_rows(text)[1:]
    # padded and jagged of one model, preset and mode side by side; vs torch eager within the row's layout
    assert rows[0].startswith("| baseline | torch | eager | padded | 16.00 |") and rows[0].endswith(
        "| 1.00x | 1.00x (eager) | yes |  |  |"
    )
    assert rows[1].startswith("| baseline | torch | eager | jagged | 8.00 |") and rows[1].endswith(
        "| 1.00x | 1.00x (eager) | yes | 2.00x | yes |"
    )
    assert rows[2].startswith("| baseline | triton | eager | padded | 12.00 |") and rows[2].endswith("| yes |  |  |")
    assert rows[3].startswith("| baseline | triton | eager | jagged | 4.00 |") and rows[3].endswith(
        "| 2.00x | 2.00x (eager) | yes | 3.00x | no |"
    )
    assert rows[4].startswith("| baseline | triton | CUDA graph | padded | 2.00 |") and rows[4].endswith("|  |  |")
    assert rows[5].startswith("| hstu | torch | eager | jagged | 10.00 |") and rows[5].endswith("| yes |  |  |")
    assert "- The run left out baseline / triton / CUDA graph / jagged, hstu / triton / CUDA graph / jagged: " in text
    assert "- The run left out hstu / torch / eager / padded, hstu / triton / eager / padded, " in text
    # the time budget cut only hstu's triton eager run: the left-out runs are not counted as cut
    assert "some planned runs were skipped (hstu / triton / eager / jagged)." in text
    assert '"tuned=[]" "layouts=[padded,jagged]" output=' in text
    assert "Real tokens/s vs padded: the jagged row's real tokens/s over the padded row's" in text


def test_one_layout_has_no_layout_columns():
    result = _layouts()
    result["runs"] = [e for e in result["runs"] if e["layout"] == "padded"]
    lines = report.table(_runs(result))
    assert "layout" not in lines[0] and "vs padded" not in lines[0]
    assert report.command(_bench(layouts=["default"]), "a.json").endswith('"tuned=[torch]" output=a.json')


def test_failures_and_fallbacks_are_listed():
    result = _first()
    result["runs"][2]["fallbacks"] = ["flash_attention: triton cannot run these inputs"]
    result["runs"].append(
        {"model": "baseline", "accelerators": "triton", "mode": "compile", "error": "RuntimeError: boom"}
    )
    text = report.figures(_runs(result))
    assert "| baseline | triton | torch.compile | failed |  |  |  |  |  |  |  |  |" in text
    assert "- Run 1 baseline / triton / eager: fell back to torch: flash_attention: triton cannot run" in text
    assert "- Run 1 baseline / triton / torch.compile: RuntimeError: boom" in text


def _write(tmp_path, *results):
    paths = []
    for i, result in enumerate(results, 1):
        paths.append(tmp_path / "docs" / "results" / f"run{i}.json")
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        paths[-1].write_text(json.dumps(result))
    return [str(p) for p in paths]


def test_cli_without_page_or_plot_prints_the_table(tmp_path, capsys):
    (path,) = _write(tmp_path, _second())
    assert report.main([path]) == 0
    out = capsys.readouterr().out
    assert "| baseline | triton | tuned (max-autotune + CUDA graph) | 1.60 |" in out
    assert f"output={path}" in out


def test_cli_replaces_only_the_page_section_and_writes_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    paths = _write(tmp_path, _first(), _second())
    page = tmp_path / "docs" / "training.md"
    page.write_text(
        "# Training step\n\nhand-written\n\n## Figures\n\n"
        f"{pages.begin_marker('runtime.benchmark.report')}\n| old H100 figures |\n{pages.END}\n\n## After\n\nkept\n"
    )
    plot = tmp_path / "docs" / "training.png"
    assert report.main([*paths, "--page", str(page), "--plot", str(plot)]) == 0
    text = page.read_text()
    assert text.startswith("# Training step\n\nhand-written\n\n## Figures\n\n")
    assert text.endswith(f"{pages.END}\n\n## After\n\nkept\n")
    assert "old H100 figures" not in text and text.count("<!-- results:") == 1
    assert pages.begin_marker("runtime.training.report") in text
    assert "Runs: 1 = [results/run1.json](results/run1.json); 2 = [results/run2.json](results/run2.json)." in text
    assert "![step time per preset and mode, per model](training.png)" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000


def test_update_page_appends_the_section_to_a_page_without_one(tmp_path):
    page = tmp_path / "training.md"
    page.write_text("# Training step\n\nhand-written\n")
    pages.update_page(page, "| v1 |", "runtime.training.report")
    pages.update_page(page, "| v2 |", "runtime.training.report")
    text = page.read_text()
    assert (
        text
        == f"# Training step\n\nhand-written\n\n{pages.begin_marker('runtime.training.report')}\n| v2 |\n{pages.END}\n"
    )


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{not json", r"r\.json: not valid JSON"),
        ("[]", r"r\.json: expected a result \(a JSON object\), got list"),
        (json.dumps({"environment": {}}), r"r\.json: missing keys \['runs'\]"),
    ],
)
def test_a_bad_results_file_is_named_and_the_page_kept(tmp_path, content, expected):
    assert_bad_result_keeps_page(report.main, report.GENERATOR, tmp_path, content, expected)
