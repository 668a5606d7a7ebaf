"""The CUDA-graphed training step (trainer.cuda_graph=true) against the eager step: same losses from the
same seed and batches, the scheduler's learning rate reaching the replayed optimizer, and residual dropout
(dropout_add) staying on its kernel backend inside the graph. And trainer.deterministic: two runs, the same losses to
the bit."""

import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir

from runtime.accelerators import BackendFallbackWarning
from runtime.accelerators.testing import deterministic_algorithms
from runtime.training import Trainer, config_dir
from runtime.training.data import build_data
from runtime.training.distributed import Run

STEPS = 12
SMALL = [
    "trainer.device=cuda", "trainer.progress=false", "trainer.steps=40", "data.batch_size=64", "data.seq_len=64",
    "data.val_size=256", "optim.warmup_steps=4",
]  # fmt: skip


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[*SMALL, *overrides])


def _train(cfg, tmp_path, name: str) -> tuple[Trainer, list[float]]:
    trainer = Trainer(cfg, tmp_path / name, Run(torch.device("cuda", torch.cuda.current_device())))
    data = build_data(cfg.data, cfg.seed)
    losses = [trainer.train_step(data.train_batch(i, cfg.data.batch_size).to("cuda"))[0] for i in range(STEPS)]
    return trainer, torch.stack(losses).float().cpu().tolist()


@pytest.mark.parametrize("preset", ["torch", "triton", "tilelang"])
@pytest.mark.parametrize("model", ["baseline", "tokenformer"])
def test_graphed_steps_match_eager_steps(model, preset, tmp_path):
    overrides = [f"model={model}", f"accelerators={preset}", "model.dropout=0.0"]
    eager, eager_losses = _train(_compose(*overrides, "trainer.cuda_graph=false"), tmp_path, "eager")
    assert eager.graphed_step is None
    graphed, graphed_losses = _train(_compose(*overrides, "trainer.cuda_graph=true"), tmp_path, "graphed")
    assert graphed.graphed_step.captured
    # the first 3 steps run eagerly on a side stream; later ones replay the graph; bf16 autocast noise
    diffs = [abs(a - b) for a, b in zip(graphed_losses, eager_losses)]
    assert max(diffs) < 2e-3, f"graphed vs eager losses: {graphed_losses} vs {eager_losses}"
    lr = graphed.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(eager.optimizer.param_groups[0]["lr"], rel=1e-6)
    # every parameter the eager steps moved, the replayed optimizer moved too (AdamW's normalised steps
    # turn bf16 noise in near-zero gradients into lr-sized differences, so values are not compared)
    initial = Trainer(
        _compose(*overrides, "trainer.cuda_graph=false"), tmp_path / "initial", Run(torch.device("cuda"))
    ).model
    for (name, p), q, p0 in zip(graphed.model.named_parameters(), eager.model.parameters(), initial.parameters()):
        assert torch.equal(p, p0) == torch.equal(q, p0), (
            f"{name}: moved by eager steps {not torch.equal(q, p0)}, by graphed ones {not torch.equal(p, p0)}"
        )


def test_dropout_add_on_a_kernel_backend_stays_on_it_in_the_graph(tmp_path):
    """dropout_add's seed is a device tensor: capturing the step is no reason to fall back to torch."""
    cfg = _compose("model=baseline", "accelerators=triton", "model.dropout=0.1", "trainer.cuda_graph=true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BackendFallbackWarning)
        trainer, losses = _train(cfg, tmp_path, "dropout")
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]
    assert not [m for m in fallbacks if "dropout_add" in m], fallbacks
    assert trainer.graphed_step.captured
    assert all(map(lambda x: x == x and abs(x) < 10, losses)), losses


@pytest.mark.parametrize("model", ["baseline", "tokenformer", "gdr"])
def test_deterministic_steps_repeat_to_the_bit(model, tmp_path):
    overrides = [f"model={model}", "accelerators=auto", "model.dropout=0.1", "trainer.deterministic=true"]
    with deterministic_algorithms():  # gives back the mode the trainer sets
        _, first = _train(_compose(*overrides), tmp_path, "first")
        _, second = _train(_compose(*overrides), tmp_path, "second")
    assert first == second, f"{first} vs {second}"


def test_auto_turns_the_graph_on_and_says_so(tmp_path, caplog):
    with caplog.at_level("INFO", logger="runtime.training"):
        trainer, losses = _train(_compose("model=tokenformer", "model.dropout=0.0"), tmp_path, "auto")
    assert trainer.graphed_step is not None and trainer.graphed_step.captured
    assert "CUDA graph: on (trainer.cuda_graph=auto)" in caplog.text
    assert all(x == x for x in losses)


def test_compiled_model_captured_in_the_step_graph_matches_eager(tmp_path):
    """torch.compile (max-autotune without inductor's own graphs) inside the whole-step CUDA graph."""
    overrides = ["model=tokenformer", "accelerators=triton", "model.dropout=0.0"]
    _, eager_losses = _train(_compose(*overrides, "trainer.cuda_graph=false"), tmp_path, "eager")
    compiled = ["trainer.compile=true", "trainer.compile_mode=max-autotune-no-cudagraphs", "trainer.cuda_graph=true"]
    graphed, graphed_losses = _train(_compose(*overrides, *compiled), tmp_path, "compiled")
    assert graphed.graphed_step.captured
    diffs = [abs(a - b) for a, b in zip(graphed_losses, eager_losses)]
    assert max(diffs) < 2e-3, f"compiled+graphed vs eager losses: {graphed_losses} vs {eager_losses}"


@pytest.mark.parametrize("preset", ["pcvr_large", "pcvr_large_gdr", "pcvr_long"])
def test_presets_train_graphed_at_a_reduced_size(preset, tmp_path):
    """The presets' model and sparse path (embedding_bag_collection on triton) in a captured step."""
    shrink = [f"experiment={preset}", "data.batch_size=32", "data.seq_len=128", "data.n_items=5000", "data.sparse_vocab=10000",
              "data.val_size=256", "trainer.cuda_graph=true", "model.dropout=0.0"]  # fmt: skip
    trainer, losses = _train(_compose(*shrink), tmp_path, preset)
    assert trainer.graphed_step.captured
    assert all(x == x and abs(x) < 10 for x in losses), losses


def test_benchmark_tuned_variant_runs_and_reports(tmp_path):
    """The speed-tuned variant (max-autotune-no-cudagraphs inside the step graph) trains, reports MFU, capture time
    and tokens/s, and its losses stay within the bound of torch eager."""
    from runtime.training import benchmark

    overrides = [o for o in SMALL if not o.startswith("trainer.progress")] + ["model.dropout=0.0"]
    results = benchmark.main([
        "models=[tokenformer]", "presets=[torch]", "compiled=[]", "tuned=[torch,triton]", "steps=30", "warmup=6",
        "loss_bound=0.02", f"output={tmp_path / 'bench.json'}", "overrides=[" + ",".join(f"'{o}'" for o in overrides) + "]",
    ])  # fmt: skip
    assert results["bf16_matmul_tflops"] > 0
    runs = {run["mode"] + "/" + run["accelerators"]: run for run in results["runs"]}
    for key in ("tuned/torch", "tuned/triton"):
        run = runs[key]
        assert "error" not in run, run.get("error")
        assert run["cuda_graph_on"] and run["capture_step_s"] > 0 and 0 < run["mfu"] < 1
        assert run["real_tokens_per_s"] > 0 and run["loss_within_bound"], run["vs_torch_eager"]
