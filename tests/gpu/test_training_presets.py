"""The training presets and speed setups on the GPU: torch.compile inside the whole-step CUDA graph against the eager
step, the large presets' models and sparse path in a captured step at a reduced size, and the training benchmark's
speed-tuned variant."""

import pytest

from training_runs import SMALL, compose_small, train_steps


def test_compiled_model_captured_in_the_step_graph_matches_eager(tmp_path):
    """torch.compile (max-autotune without inductor's own graphs) inside the whole-step CUDA graph."""
    overrides = ["model=tokenformer", "accelerators=triton", "model.dropout=0.0"]
    _, eager_losses = train_steps(compose_small(*overrides, "trainer.cuda_graph=false"), tmp_path, "eager")
    compiled = ["trainer.compile=true", "trainer.compile_mode=max-autotune-no-cudagraphs", "trainer.cuda_graph=true"]
    graphed, graphed_losses = train_steps(compose_small(*overrides, *compiled), tmp_path, "compiled")
    assert graphed.graphed_step.captured
    diffs = [abs(a - b) for a, b in zip(graphed_losses, eager_losses)]
    assert max(diffs) < 2e-3, f"compiled+graphed vs eager losses: {graphed_losses} vs {eager_losses}"


@pytest.mark.parametrize("preset", ["pcvr_large", "pcvr_large_gdr", "pcvr_long"])
def test_presets_train_graphed_at_a_reduced_size(preset, tmp_path):
    """The presets' model and sparse path (embedding_bag_collection on triton) in a captured step."""
    shrink = [f"experiment={preset}", "data.batch_size=32", "data.seq_len=128", "data.n_items=5000", "data.sparse_vocab=10000",
              "data.val_size=256", "trainer.cuda_graph=true", "model.dropout=0.0"]  # fmt: skip
    trainer, losses = train_steps(compose_small(*shrink), tmp_path, preset)
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
