"""Checkpoints that resume exactly: model, optimizer, scheduler, step, data position and every RNG."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_PATTERN = re.compile(r"step_(\d+)\.pt$")


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


def save(path: Path, state: dict) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoints intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load(path: Path) -> dict:
    # our own file, holding RNG states (tuples, numpy arrays) beside the tensors
    return torch.load(path, map_location="cpu", weights_only=False)


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:07d}.pt"


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoints in a directory, oldest step first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT_PATTERN.search(p.name))]
    return [p for _, p in sorted(found)]


def resolve(resume: str) -> Path:
    """trainer.resume: a checkpoint file, or a run directory (its latest checkpoint)."""
    path = Path(resume)
    if path.is_file():
        return path
    for directory in (path / "checkpoints", path):
        found = checkpoints(directory)
        if found:
            return found[-1]
    raise FileNotFoundError(f"trainer.resume: {resume} is neither a checkpoint file nor a run directory with checkpoints")


def prune(directory: Path, keep: int) -> None:
    for old in checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink()
