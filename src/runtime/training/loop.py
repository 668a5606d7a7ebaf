"""The training loop: AdamW, bf16 autocast on CUDA, gradient clipping, validation metrics (metrics.py),
exact-resume checkpoints, a JSON metrics file, and DistributedDataParallel under torchrun."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from runtime.accelerators import explain, set_accelerators
from runtime.nn import BCEWithLogitsLoss, EmbeddingBagCollection, EmbeddingBagMean

from . import checkpoint, resume
from .config import (
    JAGGED_GRAPH_BLOCKER,
    Precision,
    ResumeFallback,
    ResumeOverrides,
    accelerator_config,
    check_train_config,
    compile_mode_graph_blocker,
    cuda_graph_choice,
    data_jagged,
    warmup_steps,
)
from .cuda_graph import GraphedStep
from .data import batches, build_data
from .distributed import Run, broadcast_object, gather_objects, gather_rows
from .loggers import MetricLogger, has_event_files, history_rows
from .metrics import validation_metrics
from .progress import ProgressBar

logger = logging.getLogger("runtime.training")


def make_optimizer(model: nn.Module, cfg, device: torch.device, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: not embeddings, norms or biases (a parameter named *bias, such as
    HSTU's [heads, buckets] position and time bias tables, is a bias whatever its shape). capturable: for a
    CUDA-graphed step (which then needs device_learning_rates)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, EmbeddingBagMean))}
    embeddings |= {id(w) for m in model.modules() if isinstance(m, EmbeddingBagCollection) for w in m.weights()}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            matrix = param.dim() >= 2 and id(param) not in embeddings and not name.endswith("bias")
            (decay if matrix else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=device.type == "cuda", capturable=capturable
    )


def device_learning_rates(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Learning rates as device tensors, which a captured step reads and the scheduler fills in place.
    Called after the scheduler is built, so its base rates stay floats (filling a tensor from a float
    needs no sync)."""
    for group in optimizer.param_groups:
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device):
            group["lr"] = torch.tensor(float(lr), device=device)


# how the optimizer steps, not what it computes: this run's (fused on CUDA, capturable when graphed), whatever the run
# that wrote a checkpoint had (it may have run on another device, or without the CUDA graph)
STEP_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def with_step_implementation(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state_dict to load into `optimizer`, its groups taking `optimizer`'s STEP_IMPLEMENTATION options,
    and the learning rate as a float (a CUDA-graphed run saved device tensors; device_learning_rates makes them again
    where this run is graphed). Loading it then also places the step counters where this run's AdamW reads them."""
    groups = []
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=False):
        groups.append({**saved_group, **{key: group[key] for key in STEP_IMPLEMENTATION if key in group}})
        if isinstance(groups[-1]["lr"], torch.Tensor):
            groups[-1]["lr"] = float(groups[-1]["lr"])
    return {**saved, "param_groups": groups + saved["param_groups"][len(groups) :]}


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to min_ratio at the last step (step total - 1: steps count from 0)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def use_deterministic_algorithms() -> None:
    """Steps that repeat bit for bit (trainer.deterministic), for this process: torch's deterministic algorithms with
    the cuBLAS workspace setting they ask for (effective before the first CUDA product), no cuDNN autotuning. The
    accelerators follow: flash_attention then keeps differentiated calls off TileLang (see docs/DESIGN.md)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def clip_grad_norm(parameters: tuple[torch.Tensor, ...], max_norm: float | None) -> torch.Tensor:
    """nn.utils.clip_grad_norm_(parameters, max_norm) (max_norm None: get_total_norm of the gradients alone), the same
    ops in the same order, where the gradients are plain tensors of one device and dtype (its foreach path has then
    one group): without its per-call grouping, checks and a no-op `.to(device)` per gradient. Other gradients go
    through torch's."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return _torch_clip(parameters, grads, max_norm)
    first = grads[0]
    kind = (first.device, first.dtype)
    if kind[0].type not in _FOREACH_DEVICES or any(
        type(g) is not torch.Tensor or (g.device, g.dtype) != kind for g in grads
    ):
        return _torch_clip(parameters, grads, max_norm)
    with torch.no_grad():
        total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        if max_norm is not None:
            torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0))
    return total_norm


_FOREACH_DEVICES = ("cuda", "cpu")


def _torch_clip(parameters, grads, max_norm: float | None) -> torch.Tensor:
    if max_norm is None:
        return nn.utils.get_total_norm(grads)
    return nn.utils.clip_grad_norm_(parameters, max_norm)


def graph_blockers(cfg, device: torch.device, distributed: bool) -> list[str]:
    """Why the whole step cannot be one CUDA graph in this run (empty: it can). Padded batches from both data sources
    have the same shapes (fixed batch size, histories padded to data.seq_len); jagged ones do not."""
    reasons = []
    if data_jagged(cfg):
        reasons.append(JAGGED_GRAPH_BLOCKER)
    if device.type != "cuda":
        reasons.append(f"it needs a CUDA device, the run is on {device}")
    if distributed:
        reasons.append(
            "DistributedDataParallel (torchrun) is not captured (its gradient all-reduce hooks run on the host)"
        )
    if blocker := compile_mode_graph_blocker(cfg):
        reasons.append(blocker)
    return reasons


def use_cuda_graph(cfg, device: torch.device, distributed: bool) -> bool:
    """Resolve trainer.cuda_graph: true where it can run (else an error naming why), auto where it can run (the log
    says so, or why not), false off. auto leaves a compiled model eager: capture after compilation is asked for
    explicitly (trainer.cuda_graph=true)."""
    choice = cuda_graph_choice(cfg.trainer.cuda_graph)
    if choice == "false":
        logger.info("CUDA graph: off (trainer.cuda_graph=false)")
        return False
    reasons = graph_blockers(cfg, device, distributed)
    if choice == "true":
        if reasons:
            raise ValueError(
                "trainer.cuda_graph=true cannot run: " + "; ".join(reasons) + "; set trainer.cuda_graph=false or auto"
            )
    elif cfg.trainer.compile:
        reasons.append("trainer.compile=true: auto does not capture a compiled step (trainer.cuda_graph=true does)")
    if reasons:
        logger.info("CUDA graph: off (trainer.cuda_graph=auto): %s", "; ".join(reasons))
        return False
    logger.info(
        "CUDA graph: on (trainer.cuda_graph=%s): the whole step is captured after 3 eager steps and replayed", choice
    )
    return True


def _enum(kind, value):
    return value if isinstance(value, kind) else kind(str(value))


def _precision(cfg) -> Precision:
    return _enum(Precision, cfg.trainer.precision)


def _precision_name(precision: Precision, device: torch.device) -> str:
    if precision is Precision.auto:
        return "bf16" if device.type == "cuda" else "fp32"
    return precision.value


def other_run_outputs(run_dir: Path, resume: str | None) -> str | None:
    """Why a run may not write into run_dir (None: it may): the directory holds another run's checkpoints, metrics.json,
    metrics.csv rows or TensorBoard events, which this run would overwrite, prune or mix its own into. Resuming from a checkpoint inside
    run_dir continues that run there, from its newest checkpoint: the later ones of an earlier checkpoint would be
    overwritten or pruned."""
    if resume and Path(resume).resolve().is_relative_to(run_dir.resolve()):
        step = checkpoint.recorded_step(Path(resume)) if Path(resume).is_file() else None
        found = checkpoint.checkpoints(run_dir / "checkpoints")
        later = [p.name for p in found if step is not None and checkpoint.step_of(p) > step]
        if later:
            return (
                f"trainer.resume: {run_dir} holds checkpoints after {Path(resume).name} ({', '.join(later)}), which "
                "this run would overwrite or prune: resume it into another directory (hydra.run.dir=...), or resume "
                f"the newest with trainer.resume={run_dir}"
            )
        return None
    found = [path.name for path in checkpoint.checkpoints(run_dir / "checkpoints")[-1:]]
    found += [name for name in ("metrics.json",) if (run_dir / name).is_file()]
    csv = run_dir / "metrics.csv"
    if csv.is_file():
        with open(csv) as file:
            if file.readline() and file.readline():  # a row after the header
                found.append(csv.name)
    if has_event_files(run_dir / "tensorboard"):
        found.append("tensorboard/")
    if not found:
        return None
    # without a checkpoint there is nothing to resume from: only another directory (or removing the files) helps
    resumable = checkpoint.checkpoints(run_dir / "checkpoints")
    options = (
        f"continue that run with trainer.resume={run_dir}, or write this one to another directory (hydra.run.dir=...)"
        if resumable
        else "that run wrote no checkpoint to resume from: write this one to another directory (hydra.run.dir=...), "
        "or remove those files"
    )
    return (
        f"{run_dir} already holds the outputs of a run ({', '.join(found)}), which this run would overwrite or mix its "
        f"own into: {options}"
    )


class Trainer:
    """Builds data, model and optimizer from a composed train config; `fit()` trains, validates and checkpoints.

    run_dir receives metrics.json and checkpoints/ (on the main process). Every process reads its own
    batches: global batch index data_position + rank, with data_position advancing by world_size a step.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path | str, run: Run | None = None) -> None:
        check_train_config(cfg)
        self.cfg = cfg
        self.run = run or Run(torch.device("cpu"))
        self.run_dir = Path(broadcast_object(self.run, str(run_dir)))
        self.device = self.run.device
        # read once: each step reads them, and an omegaconf lookup costs tens of us of host time
        self.precision_name = _precision_name(_precision(cfg), self.device)
        self.grad_clip = cfg.trainer.grad_clip
        occupied = broadcast_object(
            self.run, other_run_outputs(self.run_dir, cfg.trainer.resume) if self.run.is_main else None
        )
        if occupied:
            raise ValueError(occupied)
        if self.run.is_main:
            checkpoint.remove_partial_writes(self.run_dir)
            checkpoint.remove_partial_writes(self.checkpoint_dir)
        if cfg.trainer.cpu_threads:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        if cfg.trainer.deterministic:
            use_deterministic_algorithms()

        self.accelerators = accelerator_config(cfg.accelerators)
        set_accelerators(self.accelerators)
        report = explain(device=self.device)
        logger.debug("%s", report)
        resolved = "\n".join(line for line in report.splitlines() if not line.startswith(" "))  # one line per op
        logger.info(
            "accelerators (precision %s; python -m runtime.accelerators tells why):\n%s", self.precision_name, resolved
        )

        torch.manual_seed(cfg.seed)  # the same initial weights on every process
        self.data = build_data(cfg.data, cfg.seed, jagged=data_jagged(cfg))
        self.model = instantiate(cfg.model, spec=self.data.spec).to(self.device)
        self.ddp = None
        if self.run.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        trained = self.ddp or self.model
        graphed = use_cuda_graph(cfg, self.device, self.run.distributed)
        self.graphed = graphed
        self.forward = trained
        if cfg.trainer.compile:
            mode = None if cfg.trainer.compile_mode == "default" else cfg.trainer.compile_mode
            self.forward = torch.compile(trained, mode=mode)
        self.criterion = BCEWithLogitsLoss()
        # what each step clears and clips (model.parameters() walks the module tree on each call)
        self.parameters = tuple(self.model.parameters())
        self.optimizer = make_optimizer(self.model, cfg.optim, self.device, capturable=graphed)
        total, warmup, min_ratio = cfg.trainer.steps, warmup_steps(cfg), cfg.optim.min_lr_ratio
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, total, warmup, min_ratio)
        )
        self.step = 0
        self.data_position = 0
        self.final_validation_due = False  # set by load()
        torch.manual_seed(cfg.seed + 1 + self.run.rank)  # dropout streams differ between processes
        self.metrics = {
            "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "device": str(self.device),
            "world_size": self.run.world_size,
            "precision": self.precision_name,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "losses": [],
            "log": [],
            "validation": [],
        }
        if cfg.trainer.resume:
            fallback = _enum(ResumeFallback, cfg.trainer.resume_fallback) is ResumeFallback.previous
            path, state = checkpoint.resolve(cfg.trainer.resume, fallback_previous=fallback)
            if self.run.is_main:
                checkpoint.remove_partial_writes(path.parent)
            self.load(path, state)
        history = history_rows(self.metrics) if cfg.trainer.resume else None
        self.metric_logger = MetricLogger(cfg.logger.kind, self.run_dir, enabled=self.run.is_main, history=history)
        self.graphed_step = None
        if graphed:
            device_learning_rates(self.optimizer, self.device)
            self.graphed_step = GraphedStep(self._optimizer_step, self.optimizer, self.device)

    # ------------------------------------------------------------------ pieces

    def autocast(self):
        if self.precision_name == "bf16":
            # autocast's cache of casted weights would outlive a captured graph's replay
            return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=not self.graphed)
        return contextlib.nullcontext()

    def train_step(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns the loss and the gradient norm (device tensors, no synchronisation)."""
        if not self.model.training:  # evaluate() leaves the model in eval mode; train() walks every module
            self.model.train()
        loss, grad_norm = (self.graphed_step or self._optimizer_step)(batch)
        self.scheduler.step()
        self.step += 1
        self.data_position += self.run.world_size
        return loss, grad_norm

    def _optimizer_step(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss, backward, clipping and the AdamW update (what a CUDA graph captures)."""
        with self.autocast():
            logits = self.forward(batch)
        loss = self.criterion(logits, batch.label)
        for param in self.parameters:  # optimizer.zero_grad(set_to_none=True) without its profiler range: ~0.1 ms
            param.grad = None
        loss.backward()
        grad_norm = clip_grad_norm(self.parameters, self.grad_clip)
        self.optimizer.step()
        return loss.detach(), grad_norm.detach()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The validation metrics over the whole validation set: each process predicts its share of the rows, the
        predictions are gathered, and every process computes the same numbers on its device."""
        self.model.eval()
        val = self.data.val_set()
        size = self.cfg.data.val_batch_size
        share = -(-len(val) // self.run.world_size)
        first, last = min(len(val), self.run.rank * share), min(len(val), (self.run.rank + 1) * share)
        logits = [torch.empty(0, device=self.device)]
        for start in range(first, last, size):
            with self.autocast():
                logits.append(self.model(val.slice(start, min(start + size, last)).to(self.device)).float())
        logits = gather_rows(self.run, torch.cat(logits), share, len(val))
        labels = val.label.to(self.device)
        users = None if val.user_id is None else val.user_id.to(self.device)
        return {"step": self.step, **validation_metrics(logits, labels, users)}

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> Path:
        rng = gather_objects(self.run, checkpoint.rng_state())  # collective: every process calls save
        path = checkpoint.checkpoint_path(self.checkpoint_dir, self.step)
        if self.run.is_main:
            state = {
                "step": self.step,
                "data_position": self.data_position,
                "world_size": self.run.world_size,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": rng,
                "metrics": self.metrics,
                "config": OmegaConf.to_yaml(self.cfg),
            }
            checkpoint.save(path, state)
            checkpoint.prune(self.checkpoint_dir, self.cfg.trainer.keep_checkpoints, self.step)
            logger.info("saved %s", path)
        return path

    def load(self, path: Path, state: dict | None = None) -> None:
        state = checkpoint.load(path) if state is None else state
        changed = resume.differences(state["config"], self.metrics["config"])
        allow = _enum(ResumeOverrides, self.cfg.trainer.resume_overrides) is ResumeOverrides.allow
        if state["world_size"] != self.run.world_size:
            if not allow:
                raise ValueError(
                    f"trainer.resume: {path} was written by {state['world_size']} process(es), this run has "
                    f"{self.run.world_size}; resume with the same number of processes, or continue on this many with "
                    "trainer.resume_overrides=allow (each process keeps data.batch_size, so the global batch changes)"
                )
            changed = {"world_size": (state["world_size"], self.run.world_size), **changed}
        if changed and not allow:
            raise ValueError(
                f"trainer.resume: this run's config differs from that of {path}:\n{resume.describe(changed)}\n"
                "resume with the checkpoint's values, or apply the changes with trainer.resume_overrides=allow"
            )
        if state["step"] > self.cfg.trainer.steps:
            raise ValueError(f"trainer.steps={self.cfg.trainer.steps}: {path} is at step {state['step']} already")
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as error:
            raise ValueError(
                f"trainer.resume: the weights in {path} do not fit this model ({str(error).splitlines()[0]} ...); "
                f"the model settings that differ cannot be applied:\n{resume.describe(changed)}"
            ) from error
        self.optimizer.load_state_dict(with_step_implementation(state["optimizer"], self.optimizer))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.data_position = state["step"], state["data_position"]
        for key in ("losses", "log", "validation"):
            self.metrics[key] = list(state["metrics"][key])
        # a run's final checkpoint is written before its final validation, which the checkpoint therefore lacks
        saved_steps = OmegaConf.select(OmegaConf.create(state["config"]), "trainer.steps")
        self.final_validation_due = self.step == saved_steps and not self._validated_now()
        self.metrics["resumes"] = [
            *state["metrics"].get("resumes", []),
            {"from": str(path), "step": self.step, "changes": changed},
        ]
        if self.run.rank < len(state["rng"]):  # a process the checkpoint has no state for keeps its fresh streams
            checkpoint.set_rng_state(state["rng"][self.run.rank])
        if changed:
            self._apply_optimizer_settings()
            logger.warning(
                "trainer.resume_overrides=allow: applied what differs from %s:\n%s", path, resume.describe(changed)
            )
        logger.info("resumed from %s at step %d", path, self.step)

    def _apply_optimizer_settings(self) -> None:
        """The optimizer and scheduler states loaded from a checkpoint carry its lr, betas, eps and weight decay:
        replaced by this run's, with the learning rate of the current step on this run's schedule."""
        optim = self.cfg.optim
        self.scheduler.base_lrs = [optim.lr for _ in self.optimizer.param_groups]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group, decay in zip(self.optimizer.param_groups, (optim.weight_decay, 0.0), strict=True):
            group.update(
                initial_lr=optim.lr, lr=optim.lr * factor, betas=tuple(optim.betas), eps=optim.eps, weight_decay=decay
            )

    def write_metrics(self) -> None:
        if self.run.is_main:
            text = json.dumps(self.metrics, indent=1).encode()
            checkpoint.write_atomically(self.run_dir / "metrics.json", lambda file: file.write(text))

    # ------------------------------------------------------------------ the loop

    def fit(self, until: int | None = None) -> dict:
        """Train to trainer.steps (or stop early at step `until`); returns the metrics."""
        tcfg = self.cfg.trainer
        # read once, not on every step (an omegaconf lookup costs tens of us)
        steps, val_every, checkpoint_every, log_every = (
            tcfg.steps,
            tcfg.val_every,
            tcfg.checkpoint_every,
            tcfg.log_every,
        )
        stop = steps if until is None else min(until, steps)
        if self.final_validation_due and not self._validated_now():
            # the resumed checkpoint ended its run: that run's final validation comes first, or a run continued for
            # more steps would drop the result the finished run wrote
            self.write_metrics()
            self._validate()
            self.write_metrics()
        indices = iter(range(self.data_position + self.run.rank, 2**62, self.run.world_size))
        stream = batches(
            self.data, indices, self.cfg.data.batch_size, self.cfg.data.prefetch, pin_memory=self.device.type == "cuda"
        )
        bar = ProgressBar(tcfg.steps, self.step, tcfg.progress and self.run.is_main)
        pending: list[torch.Tensor] = []
        window_start, window_steps = time.perf_counter(), 0
        try:
            while self.step < stop:
                batch = next(stream).to(self.device, non_blocking=True)
                loss, grad_norm = self.train_step(batch)
                pending.append(loss)
                window_steps += 1
                bar.advance()
                last = self.step == stop
                # the final validation comes after the final checkpoint and metrics are written (below)
                validate = val_every and self.step % val_every == 0 and self.step != steps
                save = (checkpoint_every and self.step % checkpoint_every == 0) or last
                if (log_every and self.step % log_every == 0) or last or save:
                    self._log(pending, window_steps, time.perf_counter() - window_start, grad_norm, bar)
                    pending.clear()
                    window_start, window_steps = time.perf_counter(), 0
                if validate:
                    self._validate()
                if save:
                    self.save()
                if validate or save:
                    self.write_metrics()
                    window_start = time.perf_counter()  # validation and checkpoints are not training time
        finally:
            bar.close()
            stream.close()
        if self.step == tcfg.steps and not self._validated_now():
            self.write_metrics()  # a resumed finished run has no final checkpoint written here
            self._validate()
        if self.run.distributed:
            self.metrics["ranks_in_sync"] = self._ranks_in_sync()
        self.write_metrics()
        return self.metrics

    def _validated_now(self) -> bool:
        """Whether the metrics hold a validation at the current step."""
        validations = self.metrics["validation"]
        return bool(validations) and validations[-1]["step"] == self.step

    def _validate(self) -> None:
        result = self.evaluate()
        self.metrics["validation"].append(result)
        self.metric_logger.write(self.step, result)
        logger.info(
            "step %d  %s",
            self.step,
            "  ".join(f"{k.removeprefix('val_')} {v:.4f}" for k, v in result.items() if k != "step"),
        )

    def _log(
        self, pending: list[torch.Tensor], steps: int, elapsed: float, grad_norm: torch.Tensor, bar: ProgressBar
    ) -> None:
        losses = torch.stack(pending).tolist()  # the one synchronisation per log window
        speed = steps * self.cfg.data.batch_size * self.run.world_size / elapsed
        self.metrics["losses"] += losses
        entry = {
            "step": self.step,
            "loss": sum(losses) / len(losses),
            "grad_norm": float(grad_norm),
            # the rate this step trained with (the scheduler has already stepped to the next one)
            "lr": self.scheduler.base_lrs[0] * self.scheduler.lr_lambdas[0](self.step - 1),
            "samples_per_s": speed,
            "step_ms": 1000 * elapsed / steps,
        }
        self.metrics["log"].append(entry)
        self.metric_logger.write(self.step, entry)
        bar.update(entry["loss"], speed)
        if not all(math.isfinite(x) for x in losses):
            self.write_metrics()
            raise FloatingPointError(
                f"non-finite training loss by step {self.step} (losses {losses}). The data passed their checks when "
                f"opened (labels in [0, 1], finite features, ids within the vocabularies), so look first at the step size "
                f"(optim.lr={self.cfg.optim.lr}, trainer.grad_clip={self.cfg.trainer.grad_clip}, trainer.precision="
                f"{self.precision_name}); to rule out a kernel, rerun with accelerators=torch (now {self.accelerators})"
            )
        logger.info(
            "step %d  loss %.4f  lr %.2e  %.0f samples/s  %.1f ms/step",
            self.step,
            entry["loss"],
            entry["lr"],
            speed,
            entry["step_ms"],
        )

    def _ranks_in_sync(self) -> bool:
        """DDP keeps the replicas equal; check it once at the end (a cheap guard against silent divergence)."""
        with torch.no_grad():
            checksum = float(sum(p.double().sum() for p in self.model.parameters()))
        sums = gather_objects(self.run, checksum)
        if len(set(sums)) != 1:
            raise RuntimeError(f"DDP replicas diverged: parameter checksums per rank {sums}")
        return True
