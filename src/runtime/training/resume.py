"""What a resumed run may change from its checkpoint's config, and the message when it changes more."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

# where and how the run executes and reports, not what it trains: these may differ from the checkpoint's
FREE_KEYS = (
    "trainer.resume",
    "trainer.resume_overrides",
    "trainer.resume_fallback",
    "trainer.progress",
    "trainer.log_every",
    "trainer.val_every",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.cpu_threads",
    "trainer.device",
    "trainer.compile",
    "trainer.compile_mode",
    "trainer.cuda_graph",
    "trainer.deterministic",
    "data.prefetch",
    "data.val_batch_size",
    "accelerators",
    "logger",
)


def _flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(values, dict):
        flat: dict[str, Any] = {}
        for key, value in values.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): values}


def _free(key: str) -> bool:
    return any(key == free or key.startswith(free + ".") for free in FREE_KEYS)


def differences(saved_yaml: str, current: dict) -> dict[str, tuple[Any, Any]]:
    """{key: (checkpoint's value, this run's value)} for every training setting that differs."""
    saved = _flatten(OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True))
    now = _flatten(current)
    missing = object()
    changed = {}
    for key in sorted(set(saved) | set(now)):
        before, after = saved.get(key, missing), now.get(key, missing)
        if not _free(key) and before != after:
            changed[key] = (None if before is missing else before, None if after is missing else after)
    return changed


def describe(changed: dict[str, tuple[Any, Any]]) -> str:
    return "\n".join(
        f"  {key}: {before!r} in the checkpoint, {after!r} now" for key, (before, after) in changed.items()
    )
