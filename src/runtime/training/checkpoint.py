"""Checkpoints that resume exactly: model, optimizer, scheduler, step, data position and every RNG."""

from __future__ import annotations

import errno
import logging
import random
import re
from pathlib import Path

import numpy as np
import torch

from runtime import files

CHECKPOINT_PATTERN = re.compile(r"step_(\d+)\.pt$")
PARTIAL_PATTERN = re.compile(r"step_\d+\.pt\.tmp|metrics\.(json|csv)\.tmp")
REQUIRED_KEYS = ("step", "data_position", "world_size", "model", "optimizer", "scheduler", "rng", "metrics", "config")
logger = logging.getLogger("runtime.training")


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointError(ValueError):
    """A file that cannot be resumed from: truncated, corrupt, or not a checkpoint at all."""


def write_atomically(path: Path, write) -> None:
    """files.write_atomically (a crash mid-write leaves a *.tmp that remove_partial_writes deletes at the next start);
    a full disk is an OSError that names the path and what to do."""
    try:
        files.write_atomically(path, write)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"no space left on device while writing {path}; free some space (or point "
                "hydra.run.dir elsewhere) and resume from the last checkpoint",
                str(path),
            ) from error
        raise


def save(path: Path, state: dict) -> None:
    write_atomically(path, lambda file: torch.save(state, file))


def load(path: Path) -> dict:
    """A checkpoint's state; CheckpointError when the file is unreadable or not a checkpoint."""
    try:
        # our own file, holding RNG states (tuples, numpy arrays) beside the tensors
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated or foreign files fail in many ways (pickle, zip, EOF, ...)
        raise CheckpointError(
            f"{path} is not a readable checkpoint: truncated, corrupt or another kind of file ({type(error).__name__}: {error})"
        ) from error
    missing = [key for key in REQUIRED_KEYS if key not in state] if isinstance(state, dict) else list(REQUIRED_KEYS)
    if missing:
        held = f"a dict lacking {missing}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise CheckpointError(f"{path} is not a taac-train checkpoint: it holds {held}")
    return state


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:07d}.pt"


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoints in a directory, oldest step first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT_PATTERN.search(p.name))]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    return int(CHECKPOINT_PATTERN.search(path.name).group(1))


def recorded_step(path: Path) -> int | None:
    """The step of the checkpoint file at path: from its name where it is step_N.pt, else from the file (memory-mapped:
    only the step is read); None when the file cannot be read (resolve() then names the problem)."""
    named = CHECKPOINT_PATTERN.fullmatch(path.name)
    if named:
        return int(named.group(1))
    try:
        return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["step"])
    except Exception:  # truncated or foreign files fail in many ways
        return None


def _candidates(resume: str) -> list[Path]:
    """trainer.resume as checkpoints to try, newest first: the file itself and the older ones beside it, or
    a run directory's checkpoints."""
    path = Path(resume)
    if path.is_file():
        match = CHECKPOINT_PATTERN.search(path.name)
        older = [p for p in checkpoints(path.parent) if match and step_of(p) < int(match.group(1))]
        return [path, *reversed(older)]
    for directory in (path / "checkpoints", path):
        found = checkpoints(directory)
        if found:
            return list(reversed(found))
    raise FileNotFoundError(
        f"trainer.resume: {resume} is neither a checkpoint file nor a run directory with checkpoints"
    )


def resolve(resume: str, fallback_previous: bool = False) -> tuple[Path, dict]:
    """trainer.resume (a checkpoint file, or a run directory: its latest checkpoint) as (path, state). When that
    checkpoint is unreadable the error names the newest valid one before it; fallback_previous takes that one."""
    newest, *older = _candidates(resume)
    try:
        return newest, load(newest)
    except CheckpointError as error:
        problem = error
    for path in older:
        try:
            state = load(path)
        except CheckpointError:
            continue
        if fallback_previous:
            logger.warning("trainer.resume: %s; resuming from the previous valid checkpoint %s", problem, path)
            return path, state
        raise CheckpointError(
            f"trainer.resume: {problem}. The newest valid checkpoint before it is {path}: resume from it with "
            f"trainer.resume={path}, or let the run take it with trainer.resume_fallback=previous"
        ) from problem
    if older:
        raise CheckpointError(
            f"trainer.resume: {problem}; none of the {len(older)} checkpoint(s) before it is valid either"
        ) from problem
    raise CheckpointError(f"trainer.resume: {problem}") from problem


def remove_partial_writes(directory: Path) -> None:
    """Delete what a killed write left behind: step_N.pt.tmp, metrics.json.tmp and metrics.csv.tmp, never renamed
    into place (other *.tmp files are not ours and stay)."""
    if directory.is_dir():
        for leftover in sorted(p for p in directory.iterdir() if PARTIAL_PATTERN.fullmatch(p.name)):
            logger.warning("removing %s, left by an interrupted write", leftover)
            leftover.unlink(missing_ok=True)


def prune(directory: Path, keep: int, step: int) -> None:
    """Keep the newest `keep` checkpoints up to `step` (the one just written). Later ones, left by a run resumed
    from before its corrupt newest checkpoint, are not counted: they would push out the checkpoints it writes."""
    if keep > 0:
        for old in [p for p in checkpoints(directory) if step_of(p) <= step][:-keep]:
            old.unlink()
