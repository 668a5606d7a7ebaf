"""tools/host_overhead.py --step: a whole eager training step with the Triton launches stubbed, on the CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about 10 s: imports, the Trainer, the first step through Triton's (stubbed) compile
def test_step_mode_times_one_model_under_the_triton_preset(tmp_path):
    command = [
        sys.executable, str(ROOT / "tools" / "host_overhead.py"),
        "--step", "baseline", "--presets", "triton", "--repeats", "1", "--steps", "2",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tool times direct launches
    env |= {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # fallback "error": every op of the step ran its Triton path (a refusal would have failed the run)
    line = re.search(r"^baseline\s+triton\s+([\d.]+) ms/step\s+(\d+) op calls$", result.stdout, re.MULTILINE)
    assert line, result.stdout
    assert float(line[1]) > 0 and int(line[2]) > 10
