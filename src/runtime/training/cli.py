"""taac-train: the Hydra entry point (`taac-train key=value ...`, or `python -m runtime.training ...`)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from . import distributed
from .config import check_train_config, config_dir
from .loop import Trainer

logger = logging.getLogger("runtime.training")


def write_curves(metrics: dict, run_dir: Path) -> Path | None:
    """curves.png beside metrics.json; skipped with a log line without matplotlib (the extra taac-runtime[plot])."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.info("curves.png skipped: matplotlib is not installed (pip install 'taac-runtime[plot]')")
        return None
    from .plot import plot_runs

    path = plot_runs({str(run_dir): metrics}, run_dir / "curves.png")
    logger.info("curves in %s", path)
    return path


def train(cfg: DictConfig, run_dir: Path) -> dict:
    check_train_config(cfg)  # before any process group, data or model
    run = distributed.setup(cfg.trainer.device)
    if not run.is_main:
        logging.getLogger("runtime").setLevel(logging.WARNING)
    finished = False
    try:
        trainer = Trainer(cfg, run_dir, run)
        metrics = trainer.fit()
        trainer.metric_logger.close()
        # DDP's reducer holds the process group: freed now, the group's worker threads are joined when
        # teardown destroys it, instead of at interpreter exit (where a joinable thread aborts the process)
        del trainer
        gc.collect()
        final = metrics["validation"][-1] if metrics["validation"] else {}
        if run.is_main:
            logger.info(
                "done: %s; metrics in %s",
                ", ".join(f"{k} {v:.4f}" for k, v in final.items() if k != "step"),
                Path(run_dir) / "metrics.json",
            )
            write_curves(metrics, Path(run_dir))
        finished = True
        return metrics
    finally:
        distributed.teardown(run, finished)


@hydra.main(config_path=config_dir(), config_name="train", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    train(cfg, Path(HydraConfig.get().runtime.output_dir))


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
