"""The CUDA-graphed training step (trainer.cuda_graph=true) against the eager step: same losses from the
same seed and batches, the scheduler's learning rate reaching the replayed optimizer, and residual dropout
(dropout_add) staying on its kernel backend inside the graph. And trainer.deterministic: two runs, the same losses to
the bit."""

import warnings

import pytest
import torch

from runtime.accelerators import BackendFallbackWarning
from runtime.accelerators.testing import deterministic_algorithms
from runtime.training import Trainer
from runtime.training.distributed import Run
from training_runs import compose_small, train_steps


@pytest.mark.parametrize("preset", ["torch", "triton", "tilelang"])
@pytest.mark.parametrize("model", ["baseline", "tokenformer"])
def test_graphed_steps_match_eager_steps(model, preset, tmp_path):
    overrides = [f"model={model}", f"accelerators={preset}", "model.dropout=0.0"]
    eager, eager_losses = train_steps(compose_small(*overrides, "trainer.cuda_graph=false"), tmp_path, "eager")
    assert eager.graphed_step is None
    graphed, graphed_losses = train_steps(compose_small(*overrides, "trainer.cuda_graph=true"), tmp_path, "graphed")
    assert graphed.graphed_step.captured
    # the first 3 steps run eagerly on a side stream; later ones replay the graph; bf16 autocast noise
    diffs = [abs(a - b) for a, b in zip(graphed_losses, eager_losses)]
    assert max(diffs) < 2e-3, f"graphed vs eager losses: {graphed_losses} vs {eager_losses}"
    lr = graphed.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(eager.optimizer.param_groups[0]["lr"], rel=1e-6)
    # every parameter the eager steps moved, the replayed optimizer moved too (AdamW's normalised steps
    # turn bf16 noise in near-zero gradients into lr-sized differences, so values are not compared)
    initial = Trainer(
        compose_small(*overrides, "trainer.cuda_graph=false"), tmp_path / "initial", Run(torch.device("cuda"))
    ).model
    for (name, p), q, p0 in zip(graphed.model.named_parameters(), eager.model.parameters(), initial.parameters()):
        assert torch.equal(p, p0) == torch.equal(q, p0), (
            f"{name}: moved by eager steps {not torch.equal(q, p0)}, by graphed ones {not torch.equal(p, p0)}"
        )


def test_dropout_add_on_a_kernel_backend_stays_on_it_in_the_graph(tmp_path):
    """dropout_add's seed is a device tensor: capturing the step is no reason to fall back to torch."""
    cfg = compose_small("model=baseline", "accelerators=triton", "model.dropout=0.1", "trainer.cuda_graph=true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BackendFallbackWarning)
        trainer, losses = train_steps(cfg, tmp_path, "dropout")
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]
    assert not [m for m in fallbacks if "dropout_add" in m], fallbacks
    assert trainer.graphed_step.captured
    assert all(map(lambda x: x == x and abs(x) < 10, losses)), losses


@pytest.mark.parametrize("model", ["baseline", "tokenformer", "gdr"])
def test_deterministic_steps_repeat_to_the_bit(model, tmp_path):
    overrides = [f"model={model}", "accelerators=auto", "model.dropout=0.1", "trainer.deterministic=true"]
    with deterministic_algorithms():  # gives back the mode the trainer sets
        _, first = train_steps(compose_small(*overrides), tmp_path, "first")
        _, second = train_steps(compose_small(*overrides), tmp_path, "second")
    assert first == second, f"{first} vs {second}"


def test_auto_turns_the_graph_on_and_says_so(tmp_path, caplog):
    with caplog.at_level("INFO", logger="runtime.training"):
        trainer, losses = train_steps(compose_small("model=tokenformer", "model.dropout=0.0"), tmp_path, "auto")
    assert trainer.graphed_step is not None and trainer.graphed_step.captured
    assert "CUDA graph: on (trainer.cuda_graph=auto)" in caplog.text
    assert all(x == x for x in losses)
