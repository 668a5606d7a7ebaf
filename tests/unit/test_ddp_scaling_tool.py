"""tools/ddp_scaling.py on the CPU: torchrun with gloo on 1 and 2 processes, a tiny model, the JSON summary."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_training import TINY_SIZES

ROOT = Path(__file__).resolve().parents[2]


def load_tool():
    spec = importlib.util.spec_from_file_location("ddp_scaling", ROOT / "tools" / "ddp_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_efficiency_is_against_one_process_of_the_same_experiment():
    tool = load_tool()
    results = [
        {"experiment": "baseline", "nproc": 1, "samples_per_s": 100.0},
        {"experiment": "gdr", "nproc": 1, "samples_per_s": 40.0},
        {"experiment": "baseline", "nproc": 2, "samples_per_s": 150.0},
        {"experiment": "gdr", "nproc": 4, "samples_per_s": 120.0},
        {"experiment": "tokenformer", "nproc": 2, "samples_per_s": 90.0},  # its 1-process run failed
    ]
    tool.add_efficiency(results)
    assert [r.get("efficiency") for r in results] == [1.0, 1.0, 0.75, 0.75, None]
    text = tool.table(results)
    assert "| baseline | 2 | 150 | 0.75 |" in text and "| tokenformer | 2 | 90 | - |" in text


# on 2 processes only: the tool's 1-process runs (the reference at the same global batch, the resume on 1) run through
# the same torchrun call as a 1-process scaling run would, and the efficiency is checked above
@pytest.mark.slow
def test_scaling_summary_and_resume_checks_on_gloo(tmp_path):
    command = [
        sys.executable, str(ROOT / "tools" / "ddp_scaling.py"), "--device", "cpu", "--nproc", "2",
        "--experiment", "baseline", "--steps", "8", "--log-every", "2", "--warmup", "2", "--out", str(tmp_path), "--", *TINY_SIZES,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    summary = json.loads((tmp_path / "ddp_scaling.json").read_text())
    assert summary["all_checks_pass"] is True and "CUDA graph" in summary["note"]
    assert summary["settings"]["accelerators"] == "torch" and summary["settings"]["checkpoint_step"] == 4
    (two,) = summary["results"]
    assert (two["nproc"], two["per_process_batch"], two["global_batch"]) == (2, 32, 64) and "efficiency" not in two
    assert two["samples_per_s"] > 0 and two["timed_steps"] == 6
    versus = two["vs_one_process_same_global_batch"]
    assert versus["logged_steps"] == [2, 4, 6, 8] and 0 <= versus["max_rel_loss_diff"] < 0.5
    # on the CPU (fp32, gloo) resuming on 2 processes repeats the uninterrupted losses bit for bit, and resuming on 1
    # gives rank 0's next loss exactly (same weights, same batch)
    same, single = two["resume_same_nproc"], two["resume_on_one_process"]
    assert same["ok"] and same["bitwise"] and same["resumed_at"] == 4
    assert single["ok"] and single["first_step_bitwise"] and single["resumed_at"] == 4 and len(single["losses"]) == 4
    assert not list((tmp_path / "runs").rglob("*.pt"))  # checkpoints removed after the checks

    table = (tmp_path / "ddp_scaling.md").read_text()
    assert "| baseline | 2 |" in table and "| - |" in table and "bitwise" in table and table in result.stdout
