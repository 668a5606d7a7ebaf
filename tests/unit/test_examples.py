"""Every script in examples/ runs to completion on the CPU (each checks its own result and exits non-zero if wrong)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"pcvr_model.py", "hf_style_replace.py", "training_loop.py"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.slow
def test_example_runs(script, tmp_path):
    # as a user runs them: without the Triton interpreter this test session sets (under it "auto" takes Triton on CPU)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip()
