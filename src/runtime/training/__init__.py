"""Training: the Hydra entry point (taac-train), synthetic and Parquet data, the loop, metrics and checkpoints."""

from .config import accelerator_config, config_dir
from .loop import Trainer

__all__ = ["Trainer", "accelerator_config", "config_dir"]
