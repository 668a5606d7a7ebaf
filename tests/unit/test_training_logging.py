"""The logger group (metrics.csv, tensorboard, none), a failing logger never stops training, curves.png at the end of
a run and the plot CLI that overlays runs."""

import csv
import io
import json
import logging
import sys
import types
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from runtime.accelerators import active_config, set_accelerators
from runtime.training import Trainer, config_dir
from runtime.training.cli import train
from runtime.training.loggers import CSV_COLUMNS, CsvLogger
from runtime.training.plot import main as plot_main

TINY = [
    "accelerators=torch", "trainer.device=cpu", "trainer.progress=false", "data.batch_size=16", "data.seq_len=8",
    "data.n_items=50", "data.n_categories=4", "data.val_size=64", "data.prefetch=0", "model.d_model=8", "model.n_heads=2",
    "model.n_layers=1", "model.ffn_mult=1", "model.head_hidden=8", "trainer.steps=4", "trainer.log_every=2",
    "trainer.val_every=2", "trainer.checkpoint_every=0",
]  # fmt: skip
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_accelerators():
    saved = active_config()
    yield
    set_accelerators(saved)


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[*TINY, *overrides])


def test_csv_logger_writes_every_log_step_and_validation(tmp_path):
    metrics = Trainer(_compose(), tmp_path).fit()
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert tuple(rows[0]) == CSV_COLUMNS
    logs = [r for r in rows if r["loss"]]
    validations = [r for r in rows if r["val_auc"]]
    assert [int(r["step"]) for r in logs] == [2, 4] and [int(r["step"]) for r in validations] == [2, 4]
    assert all(r["grad_norm"] and r["lr"] and r["samples_per_s"] for r in logs)
    assert all(r["val_logloss"] and r["val_ne"] and r["val_calibration"] and r["val_gauc"] for r in validations)
    assert float(logs[-1]["loss"]) == pytest.approx(metrics["log"][-1]["loss"])
    assert float(validations[-1]["val_auc"]) == pytest.approx(metrics["validation"][-1]["val_auc"])


def test_logger_none_writes_no_csv(tmp_path):
    Trainer(_compose("logger=none"), tmp_path).fit()
    assert not (tmp_path / "metrics.csv").exists() and (tmp_path / "metrics.json").exists()


def test_a_failing_logger_warns_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    calls = []

    def broken(self, step, values):
        calls.append(step)
        raise OSError("disk went away")

    monkeypatch.setattr(CsvLogger, "write", broken)
    with caplog.at_level(logging.WARNING, logger="runtime.training"):
        metrics = Trainer(_compose(), tmp_path).fit()
    assert len(metrics["losses"]) == 4 and len(metrics["validation"]) == 2
    assert calls == [2]  # disabled after the first failure
    warnings = [r.getMessage() for r in caplog.records if "logger=csv failed" in r.getMessage()]
    assert warnings == ["logger=csv failed to write (OSError: disk went away); it is disabled for the rest of the run"]


def test_tensorboard_without_the_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        ImportError, match=r"logger=tensorboard needs the tensorboard package.*taac-runtime\[tensorboard\]"
    ):
        Trainer(_compose("logger=tensorboard"), tmp_path)


def test_an_unknown_logger_is_refused_at_composition():
    with pytest.raises(Exception) as error:
        _compose("logger.kind=wandb")
    assert "Invalid value 'wandb', expected one of [csv, tensorboard, none]" in str(error.value.__cause__)
    with pytest.raises(Exception, match=r"(?s)Available options in .logger.:\s+csv\s+none\s+tensorboard"):
        _compose("logger=wandb")


def test_taac_train_writes_curves_and_the_plot_cli_overlays_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for name in ("a", "b"):
        train(_compose(f"seed={len(name)}"), tmp_path / name)
        assert (tmp_path / name / "curves.png").read_bytes().startswith(PNG)
    plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "both.png")])
    assert (tmp_path / "both.png").read_bytes().startswith(PNG) and "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plot_main([str(tmp_path / "missing")])


def test_curves_are_skipped_without_matplotlib(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.INFO, logger="runtime.training"):
        train(_compose("trainer.val_every=0"), tmp_path)
    assert not (tmp_path / "curves.png").exists()
    assert "curves.png skipped: matplotlib is not installed" in caplog.text
    assert json.loads((tmp_path / "metrics.json").read_text())["validation"]


def test_the_run_log_is_train_log():
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=TINY, return_hydra_config=True)
    assert cfg.hydra.job.name == "train"  # Hydra names the run log <job name>.log


def test_log_lines_print_above_the_progress_bar_not_through_it(monkeypatch, capsys):
    """While the bar shows on a terminal, the root logger's console handler writes through rich's redirected stream
    (the line is printed above the bar); afterwards it has its own stream back."""
    pytest.importorskip("rich")
    from runtime.training.progress import ProgressBar

    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats the captured output as a terminal
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        bar = ProgressBar(10, 0, True)
        assert handler.stream is not stream  # rich's proxy, which prints above the bar
        logging.getLogger("runtime.training").warning("a log line")
        bar.advance()
        bar.close()
        assert handler.stream is stream
    finally:
        root.removeHandler(handler)
    assert "a log line" in capsys.readouterr().out  # printed by the bar's console, not into the bar's line


def _csv_rows(path) -> list[tuple[int, str]]:
    with open(path, newline="") as file:
        return [(int(r["step"]), "log" if r["loss"] else "val") for r in csv.DictReader(file)]


def test_resuming_after_a_crash_keeps_one_row_per_step_in_metrics_csv(tmp_path, monkeypatch):
    """A run killed after logging steps beyond its last checkpoint: the resumed run logs those steps again, and
    metrics.csv keeps each once (the rows of the uninterrupted run)."""
    overrides = ("trainer.steps=6", "trainer.log_every=1", "trainer.checkpoint_every=2", "trainer.val_every=3")
    Trainer(_compose(*overrides), tmp_path / "whole").fit()
    crashed = Trainer(_compose(*overrides), tmp_path / "run")
    real_step = crashed.train_step

    def crash_at_step_4(batch):
        if crashed.step == 3:
            raise KeyboardInterrupt
        return real_step(batch)

    monkeypatch.setattr(crashed, "train_step", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        crashed.fit()
    assert _csv_rows(tmp_path / "run" / "metrics.csv")[-2:] == [(3, "log"), (3, "val")]  # past the checkpoint at 2
    Trainer(_compose(*overrides, f"trainer.resume={tmp_path / 'run'}"), tmp_path / "run").fit()
    assert _csv_rows(tmp_path / "run" / "metrics.csv") == _csv_rows(tmp_path / "whole" / "metrics.csv")


def test_resuming_into_a_new_directory_carries_the_metrics_history_into_metrics_csv(tmp_path):
    overrides = ("trainer.steps=6", "trainer.log_every=1", "trainer.checkpoint_every=3", "trainer.val_every=2")
    Trainer(_compose(*overrides), tmp_path / "whole").fit()
    Trainer(_compose(*overrides), tmp_path / "first").fit(until=3)
    resumed = Trainer(_compose(*overrides, f"trainer.resume={tmp_path / 'first'}"), tmp_path / "second").fit()
    assert _csv_rows(tmp_path / "second" / "metrics.csv") == _csv_rows(tmp_path / "whole" / "metrics.csv")
    with open(tmp_path / "second" / "metrics.csv", newline="") as file:
        logs = [r for r in csv.DictReader(file) if r["loss"]]
    assert [float(r["loss"]) for r in logs] == pytest.approx([e["loss"] for e in resumed["log"]])


class _FakeSummaryWriter:
    """torch.utils.tensorboard.SummaryWriter's calls, recorded per writer in `runs` (one events file each): the purge
    step it opened with and each (tag, step, value)."""

    runs: list[dict] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        directory = Path(log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"events.out.tfevents.{len(self.runs)}").touch()
        self.run = {"purge_step": purge_step, "scalars": []}
        self.runs.append(self.run)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run["scalars"].append((tag, step, value))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _shown_scalars(runs: list[dict]) -> list[tuple[str, int]]:
    """(tag, step) of every scalar TensorBoard shows from the writers' files in order: a writer's purge step hides
    what the earlier files hold from that step on."""
    shown = []
    for run in runs:
        if run["purge_step"] is not None:
            shown = [(tag, step) for tag, step in shown if step < run["purge_step"]]
        shown += [(tag, step) for tag, step, _ in run["scalars"]]
    return sorted(shown)


@pytest.fixture
def fake_tensorboard(monkeypatch):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = type("SummaryWriter", (_FakeSummaryWriter,), {"runs": []})
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    return module.SummaryWriter.runs


def _crash_after_step(trainer, step: int, monkeypatch) -> None:
    real_step = trainer.train_step

    def crash(batch):
        if trainer.step == step:
            raise KeyboardInterrupt
        return real_step(batch)

    monkeypatch.setattr(trainer, "train_step", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()


def test_resuming_after_a_crash_shows_each_tensorboard_step_once(tmp_path, monkeypatch, fake_tensorboard):
    overrides = ("logger=tensorboard", "trainer.steps=6", "trainer.log_every=1", "trainer.checkpoint_every=2")
    Trainer(_compose(*overrides, "trainer.val_every=3"), tmp_path / "whole").fit()
    whole = _shown_scalars(fake_tensorboard)
    fake_tensorboard.clear()
    _crash_after_step(Trainer(_compose(*overrides, "trainer.val_every=3"), tmp_path / "run"), 3, monkeypatch)
    assert max(step for _, step in _shown_scalars(fake_tensorboard)) == 3  # past the checkpoint at 2
    resume = f"trainer.resume={tmp_path / 'run'}"
    Trainer(_compose(*overrides, "trainer.val_every=3", resume), tmp_path / "run").fit()
    assert [run["purge_step"] for run in fake_tensorboard] == [None, 3]
    assert _shown_scalars(fake_tensorboard) == whole


def test_resuming_into_a_new_directory_carries_the_history_into_tensorboard(tmp_path, fake_tensorboard):
    overrides = ("logger=tensorboard", "trainer.steps=6", "trainer.log_every=1", "trainer.checkpoint_every=3")
    Trainer(_compose(*overrides), tmp_path / "whole").fit()
    whole = _shown_scalars(fake_tensorboard)
    Trainer(_compose(*overrides), tmp_path / "first").fit(until=3)
    fake_tensorboard.clear()
    Trainer(_compose(*overrides, f"trainer.resume={tmp_path / 'first'}"), tmp_path / "second").fit()
    assert [run["purge_step"] for run in fake_tensorboard] == [None]
    assert _shown_scalars(fake_tensorboard) == whole


def test_resuming_a_finished_run_validates_once_more_in_tensorboard(tmp_path, fake_tensorboard):
    """The final validation comes after the final checkpoint: resumed from it, the run validates again at its step,
    which replaces the first run's validation there and keeps its training row."""
    overrides = ("logger=tensorboard", "trainer.steps=4", "trainer.log_every=1")
    Trainer(_compose(*overrides), tmp_path / "run").fit()
    whole = _shown_scalars(fake_tensorboard)
    Trainer(_compose(*overrides, f"trainer.resume={tmp_path / 'run'}"), tmp_path / "run").fit()
    assert [run["purge_step"] for run in fake_tensorboard] == [None, 4]
    assert _shown_scalars(fake_tensorboard) == whole


def test_resumed_tensorboard_events_read_back_without_duplicates(tmp_path, monkeypatch):
    """The real SummaryWriter and TensorBoard's own reader, which applies the purge."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ("logger=tensorboard", "trainer.steps=6", "trainer.log_every=1", "trainer.checkpoint_every=2")
    _crash_after_step(Trainer(_compose(*overrides), tmp_path), 3, monkeypatch)
    Trainer(_compose(*overrides, f"trainer.resume={tmp_path}"), tmp_path).fit()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [event.step for event in events.Scalars("val/auc")] == [2, 4, 6]
    logged = json.loads((tmp_path / "metrics.json").read_text())["log"]
    assert [event.value for event in events.Scalars("train/loss")] == pytest.approx([e["loss"] for e in logged])


def test_a_run_directory_with_tensorboard_events_is_refused_to_a_new_run(tmp_path, fake_tensorboard):
    """As with metrics.csv rows: a run stopped before its first checkpoint leaves TensorBoard events, which a new run
    into the directory would mix its own into. A logger that has written nothing leaves no event file."""
    run_dir = tmp_path / "run"
    overrides = ("logger=tensorboard", "trainer.log_every=1", "trainer.checkpoint_every=0")
    trainer = Trainer(_compose(*overrides), run_dir)
    assert not (run_dir / "tensorboard").exists()
    trainer.train_step(trainer.data.train_batch(trainer.data_position, 8))
    trainer.metric_logger.write(trainer.step, {"loss": 0.5})
    trainer.metric_logger.close()
    with pytest.raises(ValueError) as error:
        Trainer(_compose(*overrides), run_dir)
    message = str(error.value)
    assert f"{run_dir} already holds the outputs of a run (tensorboard/)" in message, message
