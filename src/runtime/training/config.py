"""Structured config schemas (registered in Hydra's ConfigStore) for train.yaml and benchmark.yaml.

The accelerators group is typed with Enums built from runtime.accelerators' own lists of op names
and backends, so a misspelt op or backend fails at composition and the error lists the allowed
values. `accelerator_config` then turns the composed group into an AcceleratorConfig (its own
validation runs again there). The bounds a type cannot state (counts, ranges, d_model a multiple of
n_heads) are each schema's `__post_init__`, which `check_train_config` runs on a composed config
together with the check for keys the schema does not have (`+trainer.typo=1` adds one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path

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


class LoggerKind(Enum):
    csv = "csv"  # metrics.csv in the run directory
    tensorboard = "tensorboard"  # the extra taac-runtime[tensorboard]
    none = "none"


class DeviceChoice(Enum):
    auto = "auto"  # CUDA when available
    cpu = "cpu"
    cuda = "cuda"


class ResumeOverrides(Enum):
    refuse = "refuse"  # a resumed run whose training settings differ from the checkpoint's is refused
    allow = "allow"  # the differences are applied and logged


class ResumeFallback(Enum):
    error = "error"  # a corrupt checkpoint stops the run (the message names the newest valid one)
    previous = "previous"  # take the newest valid checkpoint before it


def _at_least(key: str, value, least) -> None:
    if value < least:
        raise ValueError(f"{key}: expected an integer >= {least}, got {value}")


def _in_range(key: str, value: float, low: float, high: float, high_open: bool = False, low_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        interval = f"{'(' if low_open else '['}{low:g}, {'inf' if math.isinf(high) else f'{high:g}'}{')' if high_open else ']'}"
        raise ValueError(f"{key}: expected a value in {interval}, got {value}")


CUDA_GRAPH_CHOICES = ("auto", "true", "false")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
COMPILE_MODES_WITH_GRAPHS = ("reduce-overhead", "max-autotune")  # inductor's own CUDA graphs


def cuda_graph_choice(value) -> str:
    """trainer.cuda_graph as "auto", "true" or "false" (YAML's true/false arrive as bools, or as "True"/"False"
    through the schema's string type)."""
    text = str(value).lower()
    if text not in CUDA_GRAPH_CHOICES:
        raise ValueError(f"trainer.cuda_graph: expected auto, true or false, got {value!r}")
    return text


@dataclass
class AcceleratorsSchema:
    default: BackendName = BackendName.auto
    # every op is a key (null: use `default`), so `accelerators.ops.<op>=<backend>` needs no `+`
    # and a misspelt op name is rejected by the Enum key type with the valid names listed
    ops: dict[OpName, BackendName | None] = field(default_factory=lambda: {op: None for op in OpName})
    fallback: FallbackRule = FallbackRule.torch
    autotune: bool = True  # "auto" on CUDA measures the kernel backends per shape class (false: static priority)


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
    sparse_tables: int = 0  # > 0: that many multi-hot sparse fields (instead of the four built-in ones)
    sparse_vocab: int = 1_000_000  # ids per generated field
    sparse_hotness: int = 4  # the largest bag of a generated field
    n_users: int = 1000  # user ids drawn per example, for GAUC
    # true: histories packed back to back with cu_seqlens (no padding), skewed-short lengths and timestamps;
    # false: padded to seq_len; null: the model's own layout (hstu: jagged, the others: padded)
    jagged: bool | None = None

    def __post_init__(self) -> None:
        for key, least in (
            ("batch_size", 1),
            ("val_batch_size", 1),
            ("prefetch", 0),
            ("seq_len", 1),
            ("n_items", 1),
            ("n_categories", 1),
            ("n_dense", 1),
            ("val_size", 1),
            ("sparse_tables", 0),
            ("sparse_vocab", 1),
            ("sparse_hotness", 1),
            ("n_users", 1),
        ):
            _at_least(f"data.{key}", getattr(self, key), least)
        if self.source is DataSource.synthetic and self.n_items < self.n_categories:
            raise ValueError(
                f"data.n_items: expected at least data.n_categories={self.n_categories} (every synthetic category "
                f"holds an item), got {self.n_items}"
            )
        if self.source is DataSource.parquet and not self.path:
            raise ValueError(
                "data.path: expected the directory of train.parquet and val.parquet for data=parquet, got "
                f"{self.path!r}"
            )


@dataclass
class ModelSchema:
    """The keyword arguments every model class takes (besides spec)."""

    _target_: str = MISSING
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    ffn_mult: int = 4
    dropout: float = 0.1
    head_hidden: int = 256
    mhc_streams: int = 0  # n > 0: n residual streams joined by mHC hyper-connections
    # true: one table per sparse field, pooled together by embedding_bag_collection; false: one shared table
    sparse_collection: bool = False
    sparse_dim: int | None = None  # the sparse tables' width (projected to d_model); null: d_model

    def __post_init__(self) -> None:
        for key, least in (
            ("n_heads", 1),
            ("d_model", 1),
            ("n_layers", 1),
            ("ffn_mult", 1),
            ("head_hidden", 1),
            ("mhc_streams", 0),
        ):
            _at_least(f"model.{key}", getattr(self, key), least)
        if self.sparse_dim is not None:
            _at_least("model.sparse_dim", self.sparse_dim, 1)
            if not self.sparse_collection:
                raise ValueError(
                    "model.sparse_dim: expected null with model.sparse_collection=false (it is the width of the "
                    "per-field tables of sparse_collection=true; the shared table is d_model wide), got "
                    f"{self.sparse_dim}"
                )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model: expected a positive multiple of model.n_heads={self.n_heads}, got {self.d_model}"
            )
        _in_range("model.dropout", self.dropout, 0.0, 1.0, high_open=True)


@dataclass
class HSTUModelSchema(ModelSchema):
    """model=hstu: the shared keys and the HSTU layer's."""

    head_dim: int | None = None  # null: d_model // n_heads
    position_buckets: int = 256  # relative position bias buckets per head (min(|i - j|, P - 1)); 0: none
    time_buckets: int = 64  # time bias buckets per head (floor(log2(1 + |t_i - t_j|)), capped); 0: none

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim is not None:
            _at_least("model.head_dim", self.head_dim, 1)
        _at_least("model.position_buckets", self.position_buckets, 0)
        _at_least("model.time_buckets", self.time_buckets, 0)
        if self.mhc_streams:
            raise ValueError(
                f"model.mhc_streams: expected 0 for model=hstu (each HSTU layer carries its own residual), got {self.mhc_streams}"
            )


PARQUET_JAGGED = (
    "data.jagged=true with data=parquet: jagged (packed) batches are not yet read from Parquet; the reader pads "
    "histories to data.seq_len. Train on Parquet with data.jagged=false and a padded model (baseline, tokenformer, gdr), "
    "or take data=synthetic for jagged batches"
)


@dataclass
class TrainerSchema:
    steps: int = 300
    log_every: int = 10  # 0: only at the end (and at checkpoints)
    val_every: int = 100  # 0: only at the end
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 2
    precision: Precision = Precision.auto
    grad_clip: float | None = 1.0  # the largest gradient norm; null: no clipping
    device: DeviceChoice = DeviceChoice.auto
    compile: bool = False  # torch.compile the model
    # torch.compile's mode: default, max-autotune-no-cudagraphs (GEMM and kernel autotuning), or with
    # cuda_graph off also reduce-overhead / max-autotune (their own CUDA graphs of the forward and backward)
    compile_mode: str = "default"
    # the whole step (forward, backward, AdamW) replayed as one CUDA graph after 3 eager steps: auto (on where it
    # can run: one CUDA device, no DDP; the log says which and why), true (an error where it cannot), false
    cuda_graph: str = "auto"
    resume: str | None = None  # a checkpoint file, or a run directory (its latest checkpoint)
    resume_overrides: ResumeOverrides = ResumeOverrides.refuse  # settings that differ from the checkpoint's
    resume_fallback: ResumeFallback = ResumeFallback.error  # when the checkpoint to resume from is corrupt
    progress: bool = True  # a rich progress bar on the main process
    cpu_threads: int | None = None  # torch.set_num_threads; null keeps torch's default
    deterministic: bool = False  # steps that repeat bit for bit: torch.use_deterministic_algorithms for the process

    def __post_init__(self) -> None:
        for key in ("steps", "keep_checkpoints"):
            _at_least(f"trainer.{key}", getattr(self, key), 1 if key == "steps" else 0)
        for key in ("log_every", "val_every", "checkpoint_every"):
            _at_least(f"trainer.{key}", getattr(self, key), 0)
        if self.cpu_threads is not None:
            _at_least("trainer.cpu_threads", self.cpu_threads, 1)
        if self.resume is not None and not self.resume.strip():
            # an empty value (`trainer.resume=$RUN` with RUN unset) would start a new run instead of resuming
            raise ValueError(
                f"trainer.resume: expected a checkpoint file or a run directory, or null for a new run; got {self.resume!r}"
            )
        self.cuda_graph = cuda_graph_choice(self.cuda_graph)
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"trainer.compile_mode: expected one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}"
            )
        if not self.compile and self.compile_mode != "default":
            raise ValueError(
                f"trainer.compile_mode={self.compile_mode} applies to a compiled model only, and trainer.compile is "
                "false: set trainer.compile=true to compile in that mode, or leave trainer.compile_mode=default"
            )
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(
                f"trainer.grad_clip: expected a value > 0, or null to switch clipping off; got {self.grad_clip}"
            )


@dataclass
class OptimSchema:
    lr: float = 2e-3
    weight_decay: float = 0.01  # on matrices only (not embeddings, norms, biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-8
    warmup_steps: int | None = None  # linear warm-up; null: a tenth of trainer.steps
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at the last step

    def __post_init__(self) -> None:
        _in_range("optim.lr", self.lr, 0.0, math.inf, low_open=True, high_open=True)
        _in_range("optim.weight_decay", self.weight_decay, 0.0, math.inf, high_open=True)
        _in_range("optim.eps", self.eps, 0.0, math.inf, low_open=True, high_open=True)
        if self.warmup_steps is not None:
            _at_least("optim.warmup_steps", self.warmup_steps, 0)
        _in_range("optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if len(self.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"optim.betas: expected two values in [0, 1), got {list(self.betas)}")


@dataclass
class LoggerSchema:
    kind: LoggerKind = LoggerKind.csv


SEED_LIMIT = 2**32  # torch.manual_seed overflows on seeds past 64 bits; the Parquet reader multiplies the seed


@dataclass
class TrainSchema:
    seed: int = 0
    data: DataSchema = field(default_factory=DataSchema)
    model: ModelSchema = MISSING  # a model config with _target_ (instantiated with spec=FeatureSpec)
    accelerators: AcceleratorsSchema = field(default_factory=AcceleratorsSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    optim: OptimSchema = field(default_factory=OptimSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)

    def __post_init__(self) -> None:
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed: expected an integer in [0, 2**32), got {self.seed}")
        warmup, steps = self.optim.warmup_steps, self.trainer.steps
        if warmup and warmup >= steps:
            raise ValueError(
                f"optim.warmup_steps: expected fewer than trainer.steps={steps} (the run would end inside its warm-up, "
                f"before the learning rate reaches optim.lr), or null for a tenth of the steps; got {warmup}"
            )


def warmup_steps(cfg) -> int:
    """optim.warmup_steps of a composed config, null resolved to a tenth of trainer.steps."""
    warmup = cfg.optim.warmup_steps
    return cfg.trainer.steps // 10 if warmup is None else warmup


@dataclass
class BenchmarkSchema:
    """Training-step benchmark: each model under each accelerators preset, from one seed."""

    models: list[str] = field(default_factory=lambda: ["baseline", "tokenformer", "gdr"])
    presets: list[str] = field(default_factory=lambda: ["torch", "triton", "tilelang"])  # accelerators/*.yaml
    compiled: list[str] = field(default_factory=lambda: ["torch", "triton"])  # presets also run under torch.compile
    graphed: list[str] = field(default_factory=list)  # presets also run with trainer.cuda_graph=true (CUDA only)
    # presets also run speed-tuned: torch.compile(mode="max-autotune-no-cudagraphs") inside the whole-step CUDA graph,
    # fused capturable AdamW (CUDA only)
    tuned: list[str] = field(default_factory=list)
    # the data layouts of each run: [default] (what data.jagged and the model say), or some of padded and jagged (each
    # planned run once per layout the model reads, on the same samples: the jagged synthetic set, packed or padded)
    layouts: list[str] = field(default_factory=lambda: ["default"])
    experiment_preset: str | None = None  # an experiment preset applied to every run (e.g. pcvr_large)
    dry_run: bool = False  # compose every run's config and print the plan; train nothing
    steps: int = 200
    warmup: int = 20  # steps left out of the timing (compilation, autotuning)
    loss_bound: float = 0.01  # max |difference of the mean loss over the last 50 steps| vs the eager torch run
    overrides: list[str] = field(default_factory=lambda: ["model.dropout=0.0"])  # train.yaml overrides for every run
    output: str = "training-benchmark.json"
    time_budget_s: float = 0.0  # > 0: start no new run after this many seconds
    profile_steps: int = 0  # > 0: after timing, profile this many steps (host vs kernel time, top kernels)

    def __post_init__(self) -> None:
        _at_least("steps", self.steps, 1)
        _at_least("profile_steps", self.profile_steps, 0)
        if not 0 <= self.warmup < self.steps:
            raise ValueError(
                f"warmup: expected an integer in [0, steps={self.steps}) (the steps after it are timed), got {self.warmup}"
            )
        _in_range("loss_bound", self.loss_bound, 0.0, math.inf, high_open=True)
        _in_range("time_budget_s", self.time_budget_s, 0.0, math.inf, high_open=True)
        named = set(self.layouts)
        if self.layouts != ["default"] and (
            not named <= {"padded", "jagged"} or len(named) < len(self.layouts) or not named
        ):
            raise ValueError(
                f"layouts: expected [default] or some of [padded, jagged], each once; got [{', '.join(self.layouts)}]"
            )


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainSchema)
    store.store(name="benchmark_schema", node=BenchmarkSchema)
    store.store(group="model", name="hstu_schema", node=HSTUModelSchema)


register_configs()


JAGGED_GRAPH_BLOCKER = "data.jagged: packed batches change their token count and max_seqlen from step to step"


def compile_mode_graph_blocker(cfg) -> str | None:
    """Why trainer.compile_mode cannot run inside the whole-step CUDA graph (None: it can)."""
    if cfg.trainer.compile and cfg.trainer.compile_mode in COMPILE_MODES_WITH_GRAPHS:
        return (
            f"trainer.compile_mode={cfg.trainer.compile_mode} makes CUDA graphs of its own, which cannot be captured "
            "inside the step's; take compile_mode=max-autotune-no-cudagraphs (or default)"
        )
    return None


def check_train_config(cfg: DictConfig) -> TrainSchema:
    """Every bound of the schema on a composed train config, and no key the schema lacks; each error names the
    key and what it expects. Returns the config as schema objects."""
    _no_unknown_keys(cfg, TrainSchema, "")
    checked = OmegaConf.to_object(cfg)
    jagged = data_jagged(cfg)
    if checked.trainer.cuda_graph == "true":  # what the config alone rules out; the trainer checks the rest
        reasons = [JAGGED_GRAPH_BLOCKER] if jagged else []
        if checked.trainer.device is DeviceChoice.cpu:
            reasons.append("it needs a CUDA device, the run is on cpu (trainer.device=cpu)")
        if blocker := compile_mode_graph_blocker(cfg):
            reasons.append(blocker)
        if reasons:
            raise ValueError(
                "trainer.cuda_graph=true cannot run: " + "; ".join(reasons) + "; set trainer.cuda_graph=false or auto"
            )
    return checked


def model_layouts(target: str) -> tuple[str, ...]:
    """The batch layouts ("padded", "jagged") the model class `target` reads, its default first; a class that does
    not say reads padded batches."""
    from hydra.utils import get_class

    return tuple(getattr(get_class(target), "layouts", ("padded",)))


def data_jagged(cfg) -> bool:
    """data.jagged resolved against the model: null takes the model's default layout; a layout the model cannot read,
    or jagged Parquet, is an error naming the setting."""
    layouts = model_layouts(cfg.model._target_)
    asked = cfg.data.jagged
    jagged = layouts[0] == "jagged" if asked is None else bool(asked)
    name = cfg.model._target_.rsplit(".", 1)[-1]
    if jagged and "jagged" not in layouts:
        raise ValueError(f"data.jagged=true: model {name} reads padded histories only; set data.jagged=false (or null)")
    if not jagged and "padded" not in layouts:
        raise ValueError(f"data.jagged=false: model {name} reads jagged histories only; set data.jagged=true (or null)")
    source = cfg.data.source.value if isinstance(cfg.data.source, DataSource) else str(cfg.data.source)
    if jagged and source == DataSource.parquet.value:
        raise ValueError(PARQUET_JAGGED)
    return jagged


def _no_unknown_keys(node: DictConfig, schema: type, prefix: str) -> None:
    names = [f.name for f in fields(schema)]
    for key in node.keys():
        if key not in names:
            where = prefix.rstrip(".") or "the config"
            raise ValueError(f"{prefix}{key}: no such key in {where}; expected one of [{', '.join(names)}]")
        child = node._get_node(key)
        kind = OmegaConf.get_type(child) if isinstance(child, DictConfig) else None
        if kind is not None and is_dataclass(kind):
            _no_unknown_keys(child, kind, f"{prefix}{key}.")


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
