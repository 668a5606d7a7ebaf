"""Short training runs on the GPU for the training tests: the small config and a few steps from a fixed seed."""

import torch
from hydra import compose, initialize_config_dir

from runtime.training import Trainer, config_dir
from runtime.training.data import build_data
from runtime.training.distributed import Run

STEPS = 12
SMALL = [
    "trainer.device=cuda", "trainer.progress=false", "trainer.steps=40", "data.batch_size=64", "data.seq_len=64",
    "data.val_size=256", "optim.warmup_steps=4",
]  # fmt: skip


def compose_small(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[*SMALL, *overrides])


def train_steps(cfg, tmp_path, name: str) -> tuple[Trainer, list[float]]:
    trainer = Trainer(cfg, tmp_path / name, Run(torch.device("cuda", torch.cuda.current_device())))
    data = build_data(cfg.data, cfg.seed)
    losses = [trainer.train_step(data.train_batch(i, cfg.data.batch_size).to("cuda"))[0] for i in range(STEPS)]
    return trainer, torch.stack(losses).float().cpu().tolist()
