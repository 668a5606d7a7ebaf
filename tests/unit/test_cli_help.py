"""taac-train --help shows this project's help: its config groups and the common overrides, not Hydra's text."""

import subprocess
import sys


def test_train_help_lists_groups_and_overrides():
    done = subprocess.run(
        [sys.executable, "-m", "runtime.training", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith("taac-train: train a PCVR")
    for expected in (
        "model: baseline, gdr, hstu",
        "experiment: cpu_small",
        "accelerators.ops.flash_attention=tilelang",
    ):
        assert expected in text
    assert "Powered by Hydra" not in text
