"""tools/ddp_scaling.py on the CPU: torchrun with gloo on 1 and 2 processes, a tiny model, the JSON summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_training import TINY_SIZES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scaling_summary_and_resume_checks_on_gloo(tmp_path):
    command = [
        sys.executable, str(ROOT / "tools" / "ddp_scaling.py"), "--device", "cpu", "--nproc", "1", "2",
        "--experiment", "baseline", "--steps", "8", "--log-every", "2", "--warmup", "2", "--out", str(tmp_path), "--", *TINY_SIZES,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    summary = json.loads((tmp_path / "ddp_scaling.json").read_text())
    assert summary["all_checks_pass"] is True and "CUDA graph" in summary["note"]
    assert summary["settings"]["accelerators"] == "torch" and summary["settings"]["checkpoint_step"] == 4
    one, two = summary["results"]
    assert (one["nproc"], one["global_batch"]) == (1, 32) and (two["nproc"], two["global_batch"]) == (2, 64)
    assert one["efficiency"] == pytest.approx(1.0)
    assert two["efficiency"] == pytest.approx(two["samples_per_s"] / (2 * one["samples_per_s"]))
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
    assert "| baseline | 2 |" in table and "bitwise" in table and table in result.stdout
