"""Structured config schemas (registered in Hydra's ConfigStore) for train.yaml and benchmark.yaml.

The accelerators group is typed with Enums built from runtime.accelerators' own lists of op names
and backends, so a misspelt op or backend fails at composition and the error lists the allowed
values. `accelerator_config` then turns the composed group into an AcceleratorConfig (its own
validation runs again there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runtime.accelerators.backends import BACKENDS, FALLBACKS, OP_NAMES
from runtime.accelerators.config import AcceleratorConfig

BackendName = Enum("BackendName", {name: name for name in BACKENDS}, module=__name__)
FallbackRule = Enum("FallbackRule", {name: name for name in FALLBACKS}, module=__name__)
OpName = Enum("OpName", {name: name for name in OP_NAMES}, module=__name__)


class DataSource(Enum):
    synthetic = "synthetic"
    parquet = "parquet"


class Precision(Enum):
    auto = "auto"  # bf16 autocast on CUDA, fp32 on CPU
    bf16 = "bf16"
    fp32 = "fp32"


class DeviceChoice(Enum):
    auto = "auto"  # CUDA when available
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class AcceleratorsSchema:
    default: BackendName = BackendName.auto
    # every op is a key (null: use `default`), so `accelerators.ops.<op>=<backend>` needs no `+`
    # and a misspelt op name is rejected by the Enum key type with the valid names listed
    ops: dict[OpName, BackendName | None] = field(default_factory=lambda: {op: None for op in OpName})
    fallback: FallbackRule = FallbackRule.torch


@dataclass
class DataSchema:
    source: DataSource = DataSource.synthetic
    path: str | None = None  # parquet: a directory with train.parquet and val.parquet
    batch_size: int = 256  # per process
    val_batch_size: int = 1024
    prefetch: int = 2  # batches made ahead in a background thread (0: none)
    # synthetic only
    seq_len: int = 256
    n_items: int = 20000
    n_categories: int = 64
    n_dense: int = 8
    val_size: int = 8192


@dataclass
class TrainerSchema:
    steps: int = 300
    log_every: int = 10  # 0: only at the end (and at checkpoints)
    val_every: int = 100  # 0: only at the end
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 2
    precision: Precision = Precision.auto
    grad_clip: float = 1.0
    device: DeviceChoice = DeviceChoice.auto
    compile: bool = False  # torch.compile the model
    cuda_graph: bool = False  # capture the whole step as one CUDA graph after 3 eager steps (CUDA, one process)
    resume: str | None = None  # a checkpoint file, or a run directory (its latest checkpoint)
    progress: bool = True  # a rich progress bar on the main process
    cpu_threads: int | None = None  # torch.set_num_threads; null keeps torch's default
    deterministic: bool = False  # steps that repeat bit for bit: torch.use_deterministic_algorithms for the process


@dataclass
class OptimSchema:
    lr: float = 2e-3
    weight_decay: float = 0.01  # on matrices only (not embeddings, norms, biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-8
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at the last step


@dataclass
class TrainSchema:
    seed: int = 0
    data: DataSchema = field(default_factory=DataSchema)
    model: Any = MISSING  # a model config with _target_ (instantiated with spec=FeatureSpec)
    accelerators: AcceleratorsSchema = field(default_factory=AcceleratorsSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    optim: OptimSchema = field(default_factory=OptimSchema)


@dataclass
class BenchmarkSchema:
    """Training-step benchmark: each model under each accelerators preset, from one seed."""

    models: list[str] = field(default_factory=lambda: ["baseline", "tokenformer", "gdr"])
    presets: list[str] = field(default_factory=lambda: ["torch", "triton", "tilelang"])  # accelerators/*.yaml
    compiled: list[str] = field(default_factory=lambda: ["torch", "triton"])  # presets also run under torch.compile
    graphed: list[str] = field(default_factory=list)  # presets also run with trainer.cuda_graph=true (CUDA only)
    steps: int = 200
    warmup: int = 20  # steps left out of the timing (compilation, autotuning)
    loss_bound: float = 0.01  # max |difference of the mean loss over the last 50 steps| vs the eager torch run
    overrides: list[str] = field(default_factory=lambda: ["model.dropout=0.0"])  # train.yaml overrides for every run
    output: str = "training-benchmark.json"
    time_budget_s: float = 0.0  # > 0: start no new run after this many seconds
    profile_steps: int = 0  # > 0: after timing, profile this many steps (host vs kernel time, top kernels)


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainSchema)
    store.store(name="benchmark_schema", node=BenchmarkSchema)


register_configs()


def check_counts(cfg: DictConfig) -> None:
    """The bounds the schema's int types cannot state: each error names the key and what it expects."""
    for key, least in (
        ("data.batch_size", 1), ("data.val_batch_size", 1), ("data.prefetch", 0), ("trainer.steps", 0),
        ("trainer.log_every", 0), ("trainer.val_every", 0), ("trainer.checkpoint_every", 0),
    ):  # fmt: skip
        value = OmegaConf.select(cfg, key)
        if value < least:
            raise ValueError(f"{key}: expected an integer >= {least}, got {value}")


def accelerator_config(group: DictConfig | dict) -> AcceleratorConfig:
    """The composed `accelerators` group as an AcceleratorConfig."""
    values = OmegaConf.to_container(group, enum_to_str=True) if isinstance(group, DictConfig) else dict(group)
    return AcceleratorConfig.from_mapping(values)


def config_dir() -> str:
    """Where train.yaml lives: the top-level configs/ of a source checkout, else the copy in the wheel."""
    source = Path(__file__).resolve().parents[3] / "configs"
    if (source / "train.yaml").is_file():
        return str(source)
    return "pkg://runtime.configs"
