"""Fault injection for the training loop (`pytest -m faults` selects them; they run by default): a run killed while
writing a checkpoint, corrupt or foreign checkpoints, a resumed run with another config, a full disk, broken data,
a failing final validation. Nothing already written may be lost, and every failure names what is wrong."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from runtime.accelerators import active_config, set_accelerators
from runtime.training import Trainer, checkpoint, config_dir

pytestmark = pytest.mark.faults

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = [
    "accelerators=torch", "trainer.device=cpu", "trainer.progress=false", "data.batch_size=16", "data.seq_len=8",
    "data.n_items=50", "data.n_categories=5", "data.val_size=64", "data.prefetch=0", "model.d_model=8", "model.n_heads=2",
    "model.n_layers=1", "model.ffn_mult=1", "model.head_hidden=8", "trainer.cpu_threads=1",
]  # fmt: skip
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _restore_accelerators():
    saved = active_config()
    yield
    set_accelerators(saved)


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[*TINY, *overrides])


def _trained(run_dir: Path, *overrides: str) -> dict:
    return Trainer(_compose("trainer.steps=4", "trainer.checkpoint_every=2", *overrides), run_dir).fit()


# ------------------------------------------------------------------ a killed write


KILLED_WRITER = """
import sys, time
import torch
from hydra import compose, initialize_config_dir
from runtime.training import Trainer, config_dir

real_save, calls = torch.save, []

def half_written_then_hang(state, file):
    calls.append(None)
    if len(calls) == 2:  # the second checkpoint: half of it on disk when the parent kills the process
        real_save(state, file)
        file.flush()
        file.truncate(file.tell() // 2)
        print("WRITING", flush=True)
        time.sleep(120)
    real_save(state, file)

torch.save = half_written_then_hang
with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
    cfg = compose("train", overrides=sys.argv[2:])
Trainer(cfg, sys.argv[1]).fit()
"""


def test_a_run_killed_while_writing_a_checkpoint_resumes(tmp_path):
    overrides = [*TINY, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.log_every=1"]
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_WRITER))
    run_dir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "WRITING", line + child.stderr.read()[-3000:]
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert leftovers == ["step_0000002.pt", "step_0000004.pt.tmp"], leftovers

    resumed = Trainer(_compose(*overrides[len(TINY) :], f"trainer.resume={run_dir}"), run_dir)
    assert resumed.step == 2 and not (run_dir / "checkpoints" / "step_0000004.pt.tmp").exists()
    losses = resumed.fit()["losses"]
    straight = Trainer(_compose(*overrides[len(TINY) :]), tmp_path / "straight").fit()["losses"]
    assert losses == straight and len(losses) == 4
    assert json.loads((run_dir / "metrics.json").read_text())["validation"][-1]["step"] == 4


# ------------------------------------------------------------------ broken data


def test_a_broken_validation_file_fails_before_the_first_step(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from runtime.training.parquet import main as write_parquet

    data = tmp_path / "data"
    write_parquet(
        [
            str(data),
            "--train-rows",
            "64",
            "--val-rows",
            "16",
            "--seq-len",
            "8",
            "--n-items",
            "50",
            "--n-categories",
            "5",
        ]
    )
    val = pq.read_table(data / "val.parquet")
    labels = val.column("label").to_pylist()
    labels[3] = 2.0
    pq.write_table(val.set_column(0, "label", pa.array(labels, pa.float32())), data / "val.parquet")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "runtime.training", *TINY, "data=parquet", f"data.path={data}", "trainer.steps=2",
               "trainer.val_every=0", f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert result.returncode != 0
    assert f"{data / 'val.parquet'}: column label, row 3: label 2.0 is outside [0, 1]" in result.stderr, result.stderr[
        -3000:
    ]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.json").exists()


def test_a_failing_final_validation_loses_neither_the_checkpoint_nor_the_metrics(tmp_path, monkeypatch):
    trainer = Trainer(_compose("trainer.steps=3", "trainer.val_every=0", "trainer.checkpoint_every=0"), tmp_path)

    def broken():
        raise RuntimeError("validation failed")

    monkeypatch.setattr(trainer, "evaluate", broken)
    with pytest.raises(RuntimeError, match="validation failed"):
        trainer.fit()
    assert (tmp_path / "checkpoints" / "step_0000003.pt").is_file()
    assert len(json.loads((tmp_path / "metrics.json").read_text())["losses"]) == 3
    # resuming the finished run runs only the validation that is missing
    metrics = Trainer(_compose("trainer.steps=3", f"trainer.resume={tmp_path}"), tmp_path / "again").fit()
    assert [v["step"] for v in metrics["validation"]] == [3] and len(metrics["losses"]) == 3


def test_a_finished_run_continued_for_more_steps_keeps_its_final_validation(tmp_path):
    # the final checkpoint is written before the final validation, so it does not hold that validation's result
    overrides = ["trainer.val_every=0", "trainer.checkpoint_every=0", "trainer.log_every=1"]
    finished = Trainer(_compose("trainer.steps=3", *overrides), tmp_path).fit()
    final = finished["validation"][-1]
    assert final["step"] == 3
    continued = Trainer(
        _compose("trainer.steps=5", *overrides, "trainer.resume_overrides=allow", f"trainer.resume={tmp_path}"),
        tmp_path,
    ).fit()
    assert [v["step"] for v in continued["validation"]] == [3, 5]
    assert {k: continued["validation"][0][k] for k in ("val_auc", "val_logloss")} == {
        k: final[k] for k in ("val_auc", "val_logloss")
    }
    rows = (tmp_path / "metrics.csv").read_text().splitlines()[1:]
    validated = [row.split(",")[0] for row in rows if row.split(",")[6]]  # rows with a val_auc
    assert validated == ["3", "5"], rows


# ------------------------------------------------------------------ checkpoints that cannot be resumed from


def test_a_corrupt_newest_checkpoint_names_the_previous_one_and_the_fallback_takes_it(tmp_path):
    _trained(tmp_path / "run")
    directory = tmp_path / "run" / "checkpoints"
    newest = directory / "step_0000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    with pytest.raises(ValueError) as error:
        Trainer(_compose("trainer.steps=4", f"trainer.resume={tmp_path / 'run'}"), tmp_path / "next")
    message = str(error.value)
    assert f"{newest} is not a readable checkpoint: truncated, corrupt" in message, message
    assert f"The newest valid checkpoint before it is {directory / 'step_0000002.pt'}" in message
    assert "trainer.resume_fallback=previous" in message
    resumed = Trainer(
        _compose("trainer.steps=4", f"trainer.resume={newest}", "trainer.resume_fallback=previous"), tmp_path / "next"
    )
    assert resumed.step == 2
    (directory / "step_0000002.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"none of the 1 checkpoint\(s\) before it is valid either"):
        Trainer(
            _compose("trainer.steps=4", f"trainer.resume={tmp_path / 'run'}", "trainer.resume_fallback=previous"),
            tmp_path / "next",
        )


def test_a_run_resumed_before_its_corrupt_newest_checkpoint_keeps_the_checkpoints_it_writes(tmp_path):
    # the corrupt step_4 is the newest file until the resumed run reaches step 4: pruning to keep_checkpoints=1 by
    # step number kept it and deleted the valid step_3 just written
    run_dir = tmp_path / "run"
    _trained(run_dir)
    newest = run_dir / "checkpoints" / "step_0000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    overrides = ["trainer.steps=4", f"trainer.resume={run_dir}", "trainer.resume_fallback=previous"]
    free = ["trainer.checkpoint_every=1", "trainer.keep_checkpoints=1"]
    resumed = Trainer(_compose(*overrides, *free), run_dir)
    assert resumed.step == 2
    resumed.fit(until=3)
    assert checkpoint.load(run_dir / "checkpoints" / "step_0000003.pt")["step"] == 3


def test_a_path_that_is_not_a_checkpoint_gets_a_clear_message(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    tensor = tmp_path / "weights.pt"
    torch.save(torch.zeros(3), tensor)
    partial = tmp_path / "partial.pt"
    torch.save({"model": {}, "step": 1}, partial)
    for path, expected in [
        (text, f"{text} is not a readable checkpoint: truncated, corrupt or another kind of file (UnpicklingError"),
        (tensor, f"{tensor} is not a taac-train checkpoint: it holds a Tensor"),
        (
            partial,
            f"{partial} is not a taac-train checkpoint: it holds a dict lacking ['data_position', 'world_size', 'optimizer'",
        ),
    ]:
        with pytest.raises(ValueError) as error:
            Trainer(_compose(f"trainer.resume={path}"), tmp_path / "run")
        assert str(error.value).startswith(f"trainer.resume: {expected}"), error.value
    with pytest.raises(FileNotFoundError, match="is neither a checkpoint file nor a run directory with checkpoints"):
        Trainer(_compose(f"trainer.resume={tmp_path / 'empty'}"), tmp_path / "run")


def test_leftover_partial_writes_are_removed_at_the_next_start(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    leftovers = [
        tmp_path / "checkpoints" / "step_0000100.pt.tmp",
        tmp_path / "metrics.json.tmp",
        tmp_path / "metrics.csv.tmp",
    ]
    for path in leftovers:
        path.write_bytes(b"partial")
    kept = [tmp_path / "checkpoints" / "notes.txt", tmp_path / "user.tmp"]  # not written by a run: left alone
    for path in kept:
        path.write_text("kept")
    Trainer(_compose("trainer.steps=1"), tmp_path)
    assert not any(path.exists() for path in leftovers) and all(path.exists() for path in kept)


# ------------------------------------------------------------------ a run directory that holds another run


def test_a_new_run_in_a_run_directory_with_outputs_is_refused_and_leaves_them_intact(tmp_path):
    run_dir = tmp_path / "run"
    _trained(run_dir, "trainer.log_every=1")
    written = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    assert {"metrics.json", "metrics.csv", "step_0000002.pt", "step_0000004.pt"} <= {path.name for path in written}
    for overrides in (["trainer.steps=2", "trainer.checkpoint_every=1", "seed=5"], ["trainer.steps=4"]):
        with pytest.raises(ValueError) as error:
            Trainer(_compose(*overrides), run_dir)
        message = str(error.value)
        assert f"{run_dir} already holds the outputs of a run" in message, message
        assert f"trainer.resume={run_dir}" in message and "hydra.run.dir" in message, message
    # resuming another run into it is refused too; resuming this run's own checkpoints is how it continues
    _trained(tmp_path / "other")
    with pytest.raises(ValueError, match="already holds the outputs of a run"):
        Trainer(_compose("trainer.steps=4", f"trainer.resume={tmp_path / 'other'}"), run_dir)
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == written
    resumed = Trainer(
        _compose("trainer.steps=6", "trainer.resume_overrides=allow", f"trainer.resume={run_dir}"), run_dir
    )
    assert resumed.step == 4 and len(resumed.fit()["losses"]) == 6


def test_a_run_directory_without_checkpoints_is_refused_without_suggesting_to_resume_it(tmp_path):
    # a run stopped before its first checkpoint leaves metrics.csv rows: resuming it would fail (no checkpoint)
    run_dir = tmp_path / "run"
    trainer = Trainer(_compose("trainer.steps=4", "trainer.log_every=1", "trainer.checkpoint_every=0"), run_dir)
    for _ in range(2):
        trainer.train_step(trainer.data.train_batch(trainer.data_position, 8))
        trainer.metric_logger.write(trainer.step, {"loss": 0.5})
    trainer.metric_logger.close()
    with pytest.raises(ValueError) as error:
        Trainer(_compose("trainer.steps=4"), run_dir)
    message = str(error.value)
    assert f"{run_dir} already holds the outputs of a run (metrics.csv)" in message, message
    assert "trainer.resume" not in message and "no checkpoint to resume from" in message, message
    with pytest.raises(FileNotFoundError):
        Trainer(_compose("trainer.steps=4", f"trainer.resume={run_dir}"), tmp_path / "next")


def test_resuming_an_earlier_checkpoint_into_its_own_run_directory_is_refused_and_keeps_the_later_ones(tmp_path):
    run_dir = tmp_path / "run"
    _trained(run_dir, "trainer.keep_checkpoints=0")
    directory = run_dir / "checkpoints"
    written = {path: path.read_bytes() for path in directory.iterdir()}
    earlier = directory / "step_0000002.pt"
    resume = [f"trainer.resume={earlier}", "trainer.resume_overrides=allow", "optim.lr=1e-3"]
    with pytest.raises(ValueError) as error:
        Trainer(_compose("trainer.steps=4", "trainer.checkpoint_every=1", *resume), run_dir)
    message = str(error.value)
    assert f"{run_dir} holds checkpoints after {earlier.name} (step_0000004.pt)" in message, message
    assert "hydra.run.dir" in message, message
    assert {path: path.read_bytes() for path in directory.iterdir()} == written
    # into another directory the earlier checkpoint resumes, and the run directory it came from is left as it was
    assert Trainer(_compose("trainer.steps=4", *resume), tmp_path / "branch").fit()["losses"]
    assert {path: path.read_bytes() for path in directory.iterdir()} == written


def test_resuming_a_renamed_copy_of_an_earlier_checkpoint_inside_the_run_directory_is_refused_too(tmp_path):
    """A copy named without its step (run/best.pt) is an earlier checkpoint all the same: its step comes from the file."""
    run_dir = tmp_path / "run"
    _trained(run_dir, "trainer.keep_checkpoints=0")
    directory = run_dir / "checkpoints"
    copy = run_dir / "best.pt"
    copy.write_bytes((directory / "step_0000002.pt").read_bytes())
    written = {path: path.read_bytes() for path in [*directory.iterdir(), run_dir / "metrics.json"]}
    with pytest.raises(ValueError) as error:
        Trainer(_compose("trainer.steps=4", "trainer.checkpoint_every=1", f"trainer.resume={copy}"), run_dir)
    assert f"{run_dir} holds checkpoints after best.pt (step_0000004.pt)" in str(error.value), error.value
    assert {path: path.read_bytes() for path in [*directory.iterdir(), run_dir / "metrics.json"]} == written
    (directory / "step_0000004.pt").unlink()  # with nothing later, the copy continues the run in its directory
    assert Trainer(_compose("trainer.steps=4", f"trainer.resume={copy}"), run_dir).fit()["losses"]


# ------------------------------------------------------------------ a resumed run with another config


def test_resuming_with_a_changed_config_is_refused_with_the_differences(tmp_path):
    _trained(tmp_path / "run")
    resume = f"trainer.resume={tmp_path / 'run'}"
    with pytest.raises(ValueError) as error:
        Trainer(
            _compose(
                "trainer.steps=8", "trainer.checkpoint_every=2", "optim.lr=1e-3", "seed=3", "data.batch_size=8", resume
            ),
            tmp_path / "next",
        )
    message = str(error.value)
    assert "trainer.resume: this run's config differs from that of" in message
    for line in ("optim.lr: 0.002 in the checkpoint, 0.001 now", "seed: 0 in the checkpoint, 3 now",
                 "data.batch_size: 16 in the checkpoint, 8 now", "trainer.steps: 4 in the checkpoint, 8 now"):  # fmt: skip
        assert line in message, message
    assert "trainer.resume_overrides=allow" in message
    # how the run reports and executes may change freely
    Trainer(
        _compose(
            "trainer.steps=4", "trainer.checkpoint_every=1", "trainer.log_every=3", "trainer.keep_checkpoints=5", resume
        ),
        tmp_path / "next",
    )


def test_allowed_overrides_are_applied_and_logged(tmp_path, caplog):
    _trained(tmp_path / "run")
    resume = f"trainer.resume={tmp_path / 'run'}"
    trainer = Trainer(
        _compose("trainer.steps=8", "optim.lr=1e-3", "optim.betas=[0.8,0.9]", "trainer.resume_overrides=allow", resume),
        tmp_path / "next",
    )
    assert "applied what differs from" in caplog.text and "optim.lr: 0.002 in the checkpoint, 0.001 now" in caplog.text
    expected_lr = 1e-3 * trainer.scheduler.lr_lambdas[0](trainer.step)
    for group in trainer.optimizer.param_groups:
        assert (
            group["lr"] == pytest.approx(expected_lr) and group["betas"] == (0.8, 0.9) and group["initial_lr"] == 1e-3
        )
    assert trainer.scheduler.base_lrs == [1e-3, 1e-3]
    assert trainer.metrics["resumes"][-1]["changes"]["optim.lr"] == (0.002, 0.001)
    assert len(trainer.fit()["losses"]) == 8
    with pytest.raises(
        ValueError, match=r"the weights in .* do not fit this model .*\n  model.d_model: 8 in the checkpoint, 16 now"
    ):
        Trainer(
            _compose("trainer.steps=4", "model.d_model=16", "trainer.resume_overrides=allow", resume),
            tmp_path / "other",
        )
    with pytest.raises(ValueError, match=r"trainer.steps=3: .* is at step 4 already"):
        Trainer(_compose("trainer.steps=3", "trainer.resume_overrides=allow", resume), tmp_path / "other")


# ------------------------------------------------------------------ a full disk


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_names_the_path_and_keeps_the_previous_checkpoint(tmp_path):
    trainer = Trainer(_compose("trainer.steps=4", "trainer.checkpoint_every=2", "trainer.val_every=0"), tmp_path)
    trainer.fit(until=2)
    # writes into the next checkpoint's temporary file land on /dev/full: ENOSPC
    target = checkpoint.checkpoint_path(trainer.checkpoint_dir, 4)
    (trainer.checkpoint_dir / "step_0000004.pt.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as error:
        trainer.fit()
    assert error.value.errno == errno.ENOSPC
    assert f"no space left on device while writing {target}" in str(error.value)
    assert sorted(p.name for p in trainer.checkpoint_dir.iterdir()) == ["step_0000002.pt"]
    assert checkpoint.load(trainer.checkpoint_dir / "step_0000002.pt")["step"] == 2
    (tmp_path / "metrics.json.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError, match=f"no space left on device while writing {tmp_path / 'metrics.json'}"):
        trainer.write_metrics()
    assert json.loads((tmp_path / "metrics.json").read_text())["log"]  # the previous metrics file is intact


def test_faults_run_in_the_default_selection():
    """The tier is marked for selection, not excluded: no addopts deselect it."""
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"faults:' in pyproject and "not faults" not in pyproject
