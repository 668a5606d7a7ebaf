"""Training: synthetic data, Parquet round trip, metrics, the loop (loss falls), exact resume, DDP on gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from runtime.accelerators import active_config, set_accelerators
from runtime.accelerators.testing import deterministic_algorithms
from runtime.models import PCVRBatch
from runtime.training import Trainer, config_dir
from runtime.training.loop import clip_grad_norm, use_cuda_graph
from runtime.training.metrics import log_loss, roc_auc
from runtime.training.synthetic import SyntheticPCVR
from tiny_training import TINY_SIZES

SRC = Path(__file__).resolve().parents[2] / "src"
# a model and data small enough for a few CPU steps; the torch backend (the interpreter would crawl)
TINY = ["accelerators=torch", "trainer.device=cpu", "trainer.progress=false", *TINY_SIZES]


@pytest.fixture(autouse=True)
def _restore_accelerators():
    """A Trainer sets the process-wide accelerator config; later test files expect the default."""
    saved = active_config()
    yield
    set_accelerators(saved)


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[*TINY, *overrides])


def _batches_equal(a: PCVRBatch, b: PCVRBatch) -> bool:
    same = lambda x, y: (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    return all(same(getattr(a, name), getattr(b, name)) for name in vars(a))


# ------------------------------------------------------------------ data


def test_synthetic_data_is_deterministic_by_seed_and_index():
    data = SyntheticPCVR(seed=3, seq_len=20, n_items=100, n_categories=6, val_size=50)
    again = SyntheticPCVR(seed=3, seq_len=20, n_items=100, n_categories=6, val_size=50)
    assert _batches_equal(data.train_batch(5, 16), again.train_batch(5, 16))
    assert _batches_equal(data.val_set(), again.val_set())
    assert not torch.equal(data.train_batch(5, 16).seq_items, data.train_batch(6, 16).seq_items)
    other = SyntheticPCVR(seed=4, seq_len=20, n_items=100, n_categories=6, val_size=50)
    assert not torch.equal(data.train_batch(5, 16).seq_items, other.train_batch(5, 16).seq_items)


def test_synthetic_batches_are_well_formed():
    data = SyntheticPCVR(seed=0, seq_len=24, n_items=100, n_categories=6, val_size=10)
    batch = data.train_batch(0, 64)
    spec = data.spec
    valid = torch.arange(24)[None] < batch.seq_lengths[:, None]
    assert ((batch.seq_items > 0) == valid).all() and ((batch.seq_actions > 0) == valid).all()
    assert batch.seq_items.max() <= spec.n_items and batch.seq_actions.max() <= spec.n_actions
    assert torch.equal(data.item_category[batch.seq_items], batch.seq_categories)  # categories agree with items
    assert torch.equal(data.item_category[batch.target_item], batch.target_category)
    assert batch.sparse.shape == (64, len(spec.sparse_fields), spec.sparse_hotness)
    assert ((batch.sparse > 0).sum(-1) >= 1).all()
    assert set(batch.label.unique().tolist()) <= {0.0, 1.0}


def test_synthetic_data_has_a_learnable_signal():
    batch, logits = SyntheticPCVR(seed=0, seq_len=64, val_size=4096).val_set_with_logits()
    assert 0.15 < batch.label.mean() < 0.6
    assert roc_auc(logits, batch.label) > 0.75  # what a perfect model would score


def test_roc_auc_and_log_loss():
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4, 0.2])
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    pairs = [(p, n) for p in scores[labels == 1] for n in scores[labels == 0]]
    brute = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert roc_auc(scores, labels) == pytest.approx(brute)
    assert roc_auc(-scores, labels) == pytest.approx(1 - brute)
    assert roc_auc(scores, torch.ones(6)) != roc_auc(scores, torch.ones(6))  # NaN: one class only
    logits = torch.randn(50)
    targets = torch.rand(50).round()
    expected = -(targets * torch.sigmoid(logits).log() + (1 - targets) * torch.sigmoid(-logits).log()).mean()
    assert log_loss(logits, targets) == pytest.approx(expected.item(), rel=1e-5)


def test_parquet_round_trip(tmp_path):
    pytest.importorskip("pyarrow")
    from runtime.training.parquet import ParquetPCVR, main

    main(
        [
            str(tmp_path),
            "--train-rows",
            "96",
            "--val-rows",
            "40",
            "--seq-len",
            "12",
            "--n-items",
            "60",
            "--n-categories",
            "5",
            "--seed",
            "2",
        ]
    )
    synthetic = SyntheticPCVR(seed=2, seq_len=12, n_items=60, n_categories=5, val_size=40)
    loaded = ParquetPCVR(tmp_path, seed=0)
    assert loaded.spec == synthetic.spec
    assert _batches_equal(loaded.val_set(), synthetic.val_set())
    assert _batches_equal(loaded.train, synthetic.train_batch(0, 4096).slice(0, 96))
    # epochs: every row once per epoch, in a seeded order
    epoch = PCVRBatch.concat([loaded.train_batch(i, 32) for i in range(3)])
    assert sorted(epoch.target_item.tolist()) == sorted(loaded.train.target_item.tolist())
    assert _batches_equal(loaded.train_batch(4, 32), ParquetPCVR(tmp_path, seed=0).train_batch(4, 32))
    assert loaded.val_set().user_id is not None  # the synthetic set's user ids travel through Parquet


def test_validation_reports_gauc_only_with_user_ids(tmp_path):
    trainer = Trainer(_compose("trainer.steps=1", "data.n_users=20"), tmp_path)
    result = trainer.evaluate()
    assert set(result) == {"step", "val_auc", "val_logloss", "val_ne", "val_calibration", "val_gauc"}
    assert 0 < result["val_gauc"] < 1 and result["val_ne"] > 0 and result["val_calibration"] > 0
    trainer.data.val_set().user_id = None
    assert "val_gauc" not in trainer.evaluate()


def test_parquet_reader_truncates_infers_and_checks(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from runtime.training.parquet import read_batch, read_spec

    table = pa.table(
        {
            "label": pa.array([1.0, 0.0], pa.float32()),
            "dense": pa.array([[0.5, 1.5], [2.0, -1.0]], pa.list_(pa.float32())),
            "sparse_city": pa.array([[3], [1, 2]], pa.list_(pa.int64())),
            "seq_items": pa.array([[1, 2, 3, 4, 5], [7]], pa.list_(pa.int64())),
            "seq_categories": pa.array([[1, 1, 2, 2, 3], [3]], pa.list_(pa.int64())),
            "seq_actions": pa.array([[1, 1, 1, 2, 3], [1]], pa.list_(pa.int64())),
            "target_item": pa.array([4, 9], pa.int64()),
            "target_category": pa.array([2, 3], pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    spec = read_spec(tmp_path / "t.parquet")  # no metadata: inferred
    assert (spec.n_items, spec.n_categories, spec.n_actions, spec.seq_len, spec.n_dense) == (9, 3, 3, 5, 2)
    assert spec.sparse_fields == {"city": 3} and spec.sparse_hotness == 2
    short = type(spec)(**{**spec.to_dict(), "seq_len": 3})
    batch = read_batch(tmp_path / "t.parquet", short)
    assert batch.seq_items.tolist() == [[3, 4, 5], [7, 0, 0]]  # the most recent events are kept
    assert batch.seq_lengths.tolist() == [3, 1]
    assert batch.sparse[:, 0].tolist() == [[3, 0], [1, 2]]
    small = type(spec)(**{**spec.to_dict(), "n_items": 8})
    with pytest.raises(ValueError, match=r"column target_item, row 1: id 9 is outside the vocabulary; expected 1\.\.8"):
        read_batch(tmp_path / "t.parquet", small)
    pq.write_table(table.drop(["seq_actions"]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"missing columns \['seq_actions'\]"):
        read_batch(tmp_path / "bad.parquet", spec)


# ------------------------------------------------------------------ the loop


@pytest.mark.parametrize("model", ["baseline", "tokenformer", "gdr"])
@pytest.mark.slow
def test_a_few_steps_lower_the_loss(model, tmp_path):
    cfg = _compose(
        f"model={model}",
        "data.batch_size=64",
        "trainer.steps=40",
        "trainer.log_every=10",
        "trainer.val_every=0",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
    )
    trainer = Trainer(cfg, tmp_path)
    before = trainer.evaluate()
    metrics = trainer.fit()
    after = metrics["validation"][-1]
    losses = metrics["losses"]
    assert len(losses) == 40 and all(map(torch.isfinite, torch.tensor(losses)))
    assert after["val_logloss"] < before["val_logloss"] - 0.03, (before, after)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10, losses
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["losses"] == losses and saved["validation"][-1]["step"] == 40
    assert (tmp_path / "checkpoints" / "step_0000040.pt").is_file()


@pytest.mark.slow
def test_compiled_baseline_on_jagged_batches_compiles_once_for_dynamic_shapes(tmp_path):
    """Each step's batch packs another number of history events (and the history mean reads them as 1-D values with
    offsets): after the first new total has made the graphs dynamic, later totals compile nothing."""
    from torch._dynamo.utils import counters

    trainer = Trainer(_compose("model=baseline", "data.jagged=true", "data.seq_len=48"), tmp_path)
    # what trainer.compile=true makes, with aot_eager for inductor (whose code generation takes minutes on this CPU):
    # the graphs are Dynamo's either way
    trainer.forward = torch.compile(trainer.model, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    batches = [trainer.data.train_batch(i, trainer.cfg.data.batch_size) for i in range(5)]
    assert len({int(b.seq_offsets[-1]) for b in batches}) == 5 and len({b.max_seqlen for b in batches}) == 1
    graphs = []
    for batch in batches:
        loss, _ = trainer.train_step(batch)
        assert torch.isfinite(loss)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[-1], f"graphs after each step: {graphs}"


def test_resume_gives_the_same_next_losses(tmp_path):
    overrides = [
        "model=tokenformer",
        "model.dropout=0.2",
        "trainer.steps=6",
        "trainer.log_every=2",
        "trainer.val_every=3",
        "trainer.checkpoint_every=3",
    ]
    straight = Trainer(_compose(*overrides), tmp_path / "straight").fit()

    Trainer(_compose(*overrides), tmp_path / "interrupted").fit(until=4)  # checkpoints at 3 and 4
    resumed = Trainer(
        _compose(*overrides, f"trainer.resume={tmp_path / 'interrupted' / 'checkpoints' / 'step_0000003.pt'}"),
        tmp_path / "resumed",
    )
    assert resumed.step == 3 and resumed.data_position == 3
    metrics = resumed.fit()
    assert metrics["losses"] == straight["losses"]  # bit for bit: model, optimizer, RNG and data position restored
    assert metrics["validation"] == straight["validation"]

    from_dir = Trainer(_compose(*overrides, f"trainer.resume={tmp_path / 'interrupted'}"), tmp_path / "again")
    assert from_dir.step == 4  # a run directory resumes from its latest checkpoint


def test_resume_on_another_world_size_only_when_allowed(tmp_path):
    from runtime.training import checkpoint

    Trainer(_compose("trainer.steps=1"), tmp_path).fit()
    path, state = checkpoint.resolve(str(tmp_path))
    state["world_size"] = 2
    checkpoint.save(path, state)
    with pytest.raises(ValueError, match="written by 2 process"):
        Trainer(_compose(f"trainer.resume={path}"), tmp_path / "next")
    # allowed: the run continues on this many processes from the checkpoint's step and data position
    allowed = _compose("trainer.steps=1", f"trainer.resume={path}", "trainer.resume_overrides=allow")
    trainer = Trainer(allowed, tmp_path / "allowed")
    assert trainer.step == 1 and trainer.data_position == 1
    assert trainer.metrics["resumes"][-1]["changes"] == {"world_size": (2, 1)}


@pytest.mark.slow
def test_ddp_with_two_gloo_processes(tmp_path):
    """torchrun, 2 CPU processes with the gloo backend, through the taac-train entry point."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "runtime.training",
        *TINY,
        "trainer.steps=4",
        "trainer.log_every=2",
        "trainer.val_every=4",
        f"hydra.run.dir={tmp_path}",
    ]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["ranks_in_sync"] is True
    assert len(metrics["losses"]) == 4 and all(map(torch.isfinite, torch.tensor(metrics["losses"])))
    assert "flash_attention: configured 'torch' -> runs torch" in result.stderr + result.stdout
    # validation: the rows predicted by both processes, gathered, give the single-process numbers on those weights
    from runtime.training import checkpoint

    single = Trainer(_compose("trainer.steps=4"), tmp_path / "single")
    single.model.load_state_dict(checkpoint.load(tmp_path / "checkpoints" / "step_0000004.pt")["model"])
    expected, got = single.evaluate(), metrics["validation"][-1]
    assert set(got) == set(expected) and "val_gauc" in got
    for key in set(expected) - {"step"}:
        assert got[key] == pytest.approx(expected[key], rel=1e-6), key


@pytest.mark.parametrize(
    "key, least", [("data.batch_size", 1), ("data.val_batch_size", 1), ("trainer.steps", 1), ("trainer.log_every", 0)]
)
def test_counts_out_of_range_are_refused_by_name(key, least, tmp_path):
    with pytest.raises(ValueError, match=f"{key}: expected an integer >= {least}, got -1"):
        Trainer(_compose(f"{key}=-1"), tmp_path)
    if least:
        with pytest.raises(ValueError, match=f"{key}: expected an integer >= {least}, got 0"):
            Trainer(_compose(f"{key}=0"), tmp_path)
    assert not tmp_path.joinpath("checkpoints").exists()


def test_deterministic_steps_repeat_to_the_bit(tmp_path):
    """trainer.deterministic sets torch's deterministic mode for the process (restored here) and two runs from one
    seed give the same losses; dropout included."""
    overrides = ["model=tokenformer", "model.dropout=0.2", "trainer.steps=4", "trainer.deterministic=true"]
    with deterministic_algorithms():  # gives back the mode the trainer sets
        torch.use_deterministic_algorithms(False)
        first = Trainer(_compose(*overrides), tmp_path / "first").fit()["losses"]
        assert torch.are_deterministic_algorithms_enabled()
        second = Trainer(_compose(*overrides), tmp_path / "second").fit()["losses"]
    assert first == second and len(first) == 4


def test_log_every_zero_logs_only_at_the_end(tmp_path):
    metrics = Trainer(
        _compose("trainer.steps=3", "trainer.log_every=0", "trainer.val_every=0", "trainer.checkpoint_every=0"),
        tmp_path,
    ).fit()
    assert [entry["step"] for entry in metrics["log"]] == [3] and len(metrics["losses"]) == 3


def test_grad_clip_null_trains_without_clipping_and_logs_the_norm(tmp_path):
    clipped = Trainer(
        _compose("trainer.steps=2", "trainer.log_every=1", "trainer.grad_clip=1e-6"), tmp_path / "clipped"
    ).fit()
    free = Trainer(
        _compose("trainer.steps=2", "trainer.log_every=1", "trainer.grad_clip=null"), tmp_path / "free"
    ).fit()
    assert clipped["log"][0]["grad_norm"] == free["log"][0]["grad_norm"] > 1e-3  # the same first step, before clipping
    assert clipped["losses"][1] != free["losses"][1]  # a clipped step moved the weights less


def test_train_step_after_validation_trains_in_training_mode(tmp_path):
    """train_step switches to training mode only when the model is not in it (a walk over every module otherwise):
    after evaluate() every module is back in training mode, and the clipped parameters are the model's."""
    trainer = Trainer(_compose("trainer.steps=2"), tmp_path)
    batch = trainer.data.train_batch(0, trainer.cfg.data.batch_size)
    trainer.train_step(batch)
    trainer.evaluate()
    assert not any(module.training for module in trainer.model.modules())
    trainer.train_step(batch)
    assert all(module.training for module in trainer.model.modules())
    assert [id(p) for p in trainer.parameters] == [id(p) for p in trainer.model.parameters()]


def test_cuda_graph_refuses_what_it_cannot_capture(tmp_path):
    with pytest.raises(
        ValueError, match="trainer.cuda_graph=true cannot run: it needs a CUDA device, the run is on cpu"
    ):
        Trainer(_compose("trainer.cuda_graph=true"), tmp_path)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        use_cuda_graph(_compose("trainer.cuda_graph=true"), torch.device("cuda"), True)
    with pytest.raises(ValueError, match="compile_mode=reduce-overhead makes CUDA graphs of its own"):
        use_cuda_graph(
            _compose("trainer.cuda_graph=true", "trainer.compile=true", "trainer.compile_mode=reduce-overhead"),
            torch.device("cuda"),
            False,
        )
    with pytest.raises(ValueError, match="trainer.cuda_graph: expected auto, true or false, got 'sometimes'"):
        Trainer(_compose("trainer.cuda_graph=sometimes"), tmp_path)
    with pytest.raises(ValueError, match="trainer.compile_mode: expected one of"):
        Trainer(_compose("trainer.compile_mode=fastest"), tmp_path)


def test_cuda_graph_auto_resolves_and_logs_why(tmp_path, caplog):
    cuda = torch.device("cuda")
    with caplog.at_level("INFO", logger="runtime.training"):
        trainer = Trainer(_compose(), tmp_path)  # the default is auto; this run is on the CPU
        assert trainer.graphed_step is None
        assert "CUDA graph: off (trainer.cuda_graph=auto): it needs a CUDA device, the run is on cpu" in caplog.text
        assert use_cuda_graph(_compose(), cuda, False)
        assert "CUDA graph: on (trainer.cuda_graph=auto)" in caplog.text
        assert not use_cuda_graph(_compose(), cuda, True)
        assert "DistributedDataParallel" in caplog.text
        assert not use_cuda_graph(_compose("trainer.compile=true"), cuda, False)
        assert "auto does not capture a compiled step" in caplog.text
        assert use_cuda_graph(
            _compose(
                "trainer.compile=true", "trainer.cuda_graph=true", "trainer.compile_mode=max-autotune-no-cudagraphs"
            ),
            cuda,
            False,
        )
        assert not use_cuda_graph(_compose("trainer.cuda_graph=false"), cuda, False)
        assert "CUDA graph: off (trainer.cuda_graph=false)" in caplog.text


def test_a_non_finite_loss_stops_the_run(tmp_path, monkeypatch):
    trainer = Trainer(_compose("trainer.steps=4", "trainer.log_every=2"), tmp_path)
    original = trainer.criterion.forward
    monkeypatch.setattr(trainer.criterion, "forward", lambda logits, targets: original(logits, targets) * float("nan"))
    with pytest.raises(
        FloatingPointError,
        match=r"non-finite training loss by step 2 .*The data passed their checks .*optim\.lr=0\.002",
    ):
        trainer.fit()
    assert json.loads((tmp_path / "metrics.json").read_text())["log"][0]["step"] == 2


def test_training_benchmark_times_and_profiles_a_run(tmp_path):
    from runtime.training import benchmark

    out = tmp_path / "bench.json"
    run_overrides = [o for o in TINY if not o.startswith(("accelerators=", "trainer.progress="))]
    results = benchmark.main([
        "models=[baseline]", "presets=[torch]", "compiled=[]", "steps=4", "warmup=1", "profile_steps=2",
        f"output={out}", "overrides=[" + ",".join(f"'{o}'" for o in run_overrides) + "]",
    ])  # fmt: skip
    (run,) = results["runs"]
    assert "error" not in run, run.get("error")
    assert run["step_ms"] > 0 and len(run["losses"]) == 4 and run["layout"] == "padded"
    profile = run["profile"]
    assert profile["steps"] == 2 and profile["wall_ms_per_step"] > 0
    assert any(op["name"].startswith("aten::") for op in profile["top_host_ops"])
    assert json.loads(out.read_text())["runs"][0]["profile"]["steps"] == 2
    assert run["triton_compiles_timed"] == 0 and run["triton_kernels_compiled_timed"] == []  # torch: none


def test_triton_compilations_records_each_compile_and_restores_the_hook():
    """The training benchmark counts the Triton compilations of its timed steps through Triton's post-compile hook
    (the interpreter compiles nothing, so the hook is called here as Triton calls it): names in order, an earlier
    hook still called, and restored after the block."""
    from types import SimpleNamespace

    from triton import knobs

    from runtime.training.profiling import triton_compilations

    seen = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kwargs: seen.append(kwargs["fn"].name)
    try:
        with triton_compilations() as compiled:
            for name in ("_linear_forward", "_fwd_kernel"):
                knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=SimpleNamespace(name=name), compile={})
        assert compiled == ["_linear_forward", "_fwd_kernel"] and seen == compiled
        knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=SimpleNamespace(name="after"), compile={})
        assert compiled == ["_linear_forward", "_fwd_kernel"] and seen[-1] == "after"
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_training_benchmark_dry_run_composes_every_variant(capsys):
    from runtime.training import benchmark

    results = benchmark.main([
        "experiment_preset=pcvr_large", "models=[tokenformer,gdr]", "presets=[torch]", "compiled=[triton]", "graphed=[]",
        "tuned=[torch,triton]", "dry_run=true", "overrides=['trainer.device=cuda']",
    ])  # fmt: skip
    plan = {run["name"]: run["overrides"] for run in results["plan"]}
    assert sorted(plan) == sorted([
        "tokenformer / torch", "gdr / torch", "tokenformer / triton / torch.compile", "gdr / triton / torch.compile",
        "tokenformer / torch / max-autotune + CUDA graph", "gdr / torch / max-autotune + CUDA graph",
        "tokenformer / triton / max-autotune + CUDA graph", "gdr / triton / max-autotune + CUDA graph",
    ])  # fmt: skip
    tuned = plan["gdr / triton / max-autotune + CUDA graph"]
    assert {
        "trainer.compile=true",
        "trainer.compile_mode=max-autotune-no-cudagraphs",
        "trainer.cuda_graph=true",
    } <= set(tuned)
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=tuned)
    assert cfg.model._target_.endswith("GDRMixerPCVR") and cfg.model.sparse_collection and cfg.data.seq_len == 1024
    assert "trainer.cuda_graph=false" in plan["gdr / torch"]
    assert "tokenformer / torch / max-autotune + CUDA graph: " in capsys.readouterr().out


def test_training_benchmark_on_cpu_leaves_graph_variants_out(capsys):
    from runtime.training import benchmark

    results = benchmark.main(["models=[baseline]", "presets=[torch]", "compiled=[]", "tuned=[torch]", "dry_run=true",
                              "overrides=['trainer.device=cpu']"])  # fmt: skip
    assert [run["name"] for run in results["plan"]] == ["baseline / torch"]
    assert "CUDA-graph variants (graphed, tuned) are left out" in capsys.readouterr().out


def _tiny_benchmark_overrides(*changes: str) -> str:
    """The `overrides` benchmark setting: the tiny CPU sizes, dropout off (then `changes`)."""
    run = [o for o in TINY if not o.startswith(("accelerators=", "trainer.progress="))]
    return "overrides=[" + ",".join(f"'{o}'" for o in [*run, "model.dropout=0.0", *changes]) + "]"


def test_training_benchmark_layouts_train_the_same_samples_packed_and_padded(tmp_path, capsys):
    from runtime.training import benchmark, report

    # histories of 16-48 events (the jagged set's shortest is 16): the padded batches hold padding
    results = benchmark.main([
        "models=[baseline,hstu]", "layouts=[padded,jagged]", "presets=[torch]", "compiled=[]", "steps=3", "warmup=1",
        f"output={tmp_path / 'bench.json'}", _tiny_benchmark_overrides("data.seq_len=48", "data.batch_size=8"),
    ])  # fmt: skip
    runs = results["runs"]
    assert [(r["model"], r["layout"], r["accelerators"], r["mode"]) for r in runs] == [
        ("baseline", "padded", "torch", "eager"),
        ("baseline", "jagged", "torch", "eager"),
        ("hstu", "jagged", "torch", "eager"),
    ]
    assert all("error" not in r for r in runs), [r.get("error") for r in runs]
    reason = "HSTUPCVR reads jagged histories only"
    assert results["skipped"] == [
        {"model": "hstu", "layout": "padded", "accelerators": "torch", "mode": "eager", "reason": reason}
    ]
    assert f"hstu (padded) / torch: skipped, {reason}" in capsys.readouterr().out
    padded, jagged, hstu = runs
    # the same samples from the same weights: the same losses, not merely the same level
    assert jagged["vs_padded_torch_eager"]["max_abs_diff_first_10"] <= 1e-4
    assert jagged["loss_within_bound_vs_padded"] and "vs_padded_torch_eager" not in padded | hstu
    # real tokens: the same unpadded count in both layouts (tokens/s x s/step), fewer than the padded batch holds
    tokens = [r["real_tokens_per_s"] * r["step_ms"] / 1000 for r in (padded, jagged)]
    assert tokens[0] == pytest.approx(tokens[1], rel=1e-9) and 8 * 16 < tokens[0] < 8 * 48
    lines = report.table([report.Run(1, "bench.json", "bench.json", results)])
    assert lines[0].startswith("| model | accelerators | mode | layout | ms/step |")
    assert lines[0].endswith("| loss within bound | real tokens/s vs padded | loss within bound of padded |")
    ratio = jagged["real_tokens_per_s"] / padded["real_tokens_per_s"]
    assert lines[2].startswith("| baseline | torch | eager | padded |") and lines[2].endswith("| yes |  |  |")
    assert lines[3].startswith("| baseline | torch | eager | jagged |") and lines[3].endswith(f"| {ratio:.2f}x | yes |")
    assert lines[4].startswith("| hstu | torch | eager | jagged |") and lines[4].endswith("| yes |  |  |")


@pytest.mark.parametrize("layouts", ["[padded,jaged]", "[default,jagged]", "[jagged,jagged]", "[]"])
def test_training_benchmark_rejects_layouts_that_do_not_exist(layouts):
    from runtime.training import benchmark

    with pytest.raises(ValueError, match=r"^layouts: expected \[default\] or some of \[padded, jagged\], each once"):
        benchmark.main([f"layouts={layouts}", "dry_run=true", "overrides=['trainer.device=cpu']"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("warmup=200", "warmup: expected an integer in [0, steps=200) (the steps after it are timed), got 200"),
        ("warmup=-1", "warmup: expected an integer in [0, steps=200) (the steps after it are timed), got -1"),
        ("steps=0", "steps: expected an integer >= 1, got 0"),
        ("profile_steps=-2", "profile_steps: expected an integer >= 0, got -2"),
        ("loss_bound=-0.1", "loss_bound: expected a value in [0, inf), got -0.1"),
        ("time_budget_s=-5", "time_budget_s: expected a value in [0, inf), got -5.0"),
    ],
)
def test_training_benchmark_refuses_counts_that_would_time_nothing_or_misjudge(override, expected):
    from runtime.training import benchmark

    with pytest.raises(ValueError) as error:
        benchmark.main([override, "dry_run=true", "overrides=['trainer.device=cpu']"])
    assert str(error.value) == expected


def test_training_benchmark_dry_run_shows_the_layouts_and_skips_graphed_jagged_runs(capsys):
    from runtime.training import benchmark

    results = benchmark.main([
        "models=[tokenformer,gdr]", "layouts=[padded,jagged]", "presets=[torch]", "compiled=[torch]",
        "graphed=[triton]", "tuned=[]", "dry_run=true", "overrides=['trainer.device=cuda']",
    ])  # fmt: skip
    plan = {run["name"]: (run["layout"], run["overrides"]) for run in results["plan"]}
    assert list(plan) == [
        "tokenformer (padded) / torch", "gdr (padded) / torch", "tokenformer (jagged) / torch",
        "tokenformer (padded) / torch / torch.compile", "gdr (padded) / torch / torch.compile",
        "tokenformer (jagged) / torch / torch.compile",
        "tokenformer (padded) / triton / CUDA graph", "gdr (padded) / triton / CUDA graph",
    ]  # fmt: skip
    assert plan["tokenformer (jagged) / torch"][0] == "jagged"
    assert "data.jagged=true" in plan["tokenformer (jagged) / torch"][1]
    assert {"data.jagged=true", "trainer.compile=true"} <= set(plan["tokenformer (jagged) / torch / torch.compile"][1])
    assert "data.jagged=false" in plan["gdr (padded) / triton / CUDA graph"][1]
    skipped = {(s["model"], s["layout"], s["mode"]): s["reason"] for s in results["skipped"]}
    assert skipped[("gdr", "jagged", "eager")] == "GDRMixerPCVR reads padded histories only"
    assert "packed batches change their token count" in skipped[("tokenformer", "jagged", "cuda_graph")]
    assert len(skipped) == 4  # gdr's three jagged runs, tokenformer's graphed jagged run
    out = capsys.readouterr().out
    assert "tokenformer (jagged) / triton / CUDA graph: skipped, the whole-step CUDA graph needs" in out
    assert "tokenformer (jagged) / torch: [jagged batches] " in out
    variants = benchmark.planned_variants(
        {"presets": ["torch"], "compiled": [], "graphed": [], "tuned": [], "layouts": ["padded", "jagged"]}, cuda=True
    )
    assert variants == [("torch", "eager", "padded"), ("torch", "eager", "jagged")]


def test_step_matmul_flops_from_the_config():
    from runtime.training.flops import step_matmul_flops

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=pcvr_large"])
    d, tokens, layers = 256, 512 * 1025, 4
    per_token = 4 * d * d + 3 * d * 4 * d + 1025 * d  # projections, SwiGLU, causal scores and values
    assert step_matmul_flops(cfg) == 3 * 2 * tokens * layers * per_token


@pytest.mark.parametrize("max_norm", [1e-3, 1e3, None])
@pytest.mark.parametrize("dtypes", ["one dtype", "mixed"])
def test_clip_grad_norm_matches_torch_bit_for_bit(max_norm, dtypes):
    """The loop's clipping (torch's foreach ops without their per-call grouping) against nn.utils.clip_grad_norm_
    (or get_total_norm without max_norm): the same norm and gradients, bit for bit; mixed dtypes take torch's."""
    torch.manual_seed(0)
    shapes = [(37, 5), (200,), (3, 4, 5), (1,)]
    kinds = [torch.float32] * 4 if dtypes == "one dtype" else [torch.float32, torch.float64] * 2
    ours = tuple(torch.randn(s, dtype=d).requires_grad_() for s, d in zip(shapes, kinds))
    theirs = tuple(p.detach().clone().requires_grad_() for p in ours)
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    ours[1].grad = None  # a parameter without a gradient is left out
    theirs[1].grad = None
    norm = clip_grad_norm(ours, max_norm)
    grads = [p.grad for p in theirs if p.grad is not None]
    expected = nn.utils.get_total_norm(grads) if max_norm is None else nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(norm, expected)
    for a, b in zip(ours, theirs):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


def _trained_rates(tmp_path, *overrides: str) -> tuple[list[float], list[float]]:
    """(the learning rate of each optimizer step, the lr of each log entry) of a short run logging every step."""
    trainer = Trainer(_compose("trainer.steps=6", "trainer.log_every=1", *overrides), tmp_path)
    used = []
    trainer.optimizer.register_step_pre_hook(lambda optimizer, *_: used.append(optimizer.param_groups[0]["lr"]))
    logged = [entry["lr"] for entry in trainer.fit()["log"]]
    return used, logged


@pytest.mark.parametrize("warmup", [0, 2])
def test_the_schedule_decays_to_min_lr_ratio_at_the_last_step(warmup, tmp_path):
    used, _ = _trained_rates(tmp_path, "optim.lr=1e-3", "optim.min_lr_ratio=0.25", f"optim.warmup_steps={warmup}")
    assert len(used) == 6
    assert used[warmup] == pytest.approx(1e-3) and used[-1] == pytest.approx(0.25e-3)
    assert all(a > b for a, b in zip(used[warmup:], used[warmup + 1 :], strict=False))


def test_each_log_entry_shows_the_learning_rate_its_step_trained_with(tmp_path):
    used, logged = _trained_rates(tmp_path, "optim.warmup_steps=2")
    assert logged == pytest.approx(used, rel=1e-12)


def test_training_benchmark_eager_runs_leave_a_compile_mode_override_to_the_compiled_ones(capsys):
    from runtime.training import benchmark
    from runtime.training.config import check_train_config

    results = benchmark.main(["models=[baseline]", "presets=[torch]", "compiled=[torch]", "dry_run=true",
                              "overrides=['trainer.device=cpu','trainer.compile_mode=max-autotune-no-cudagraphs']"])  # fmt: skip
    plan = {run["name"]: run["overrides"] for run in results["plan"]}
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        eager = check_train_config(compose("train", overrides=plan["baseline / torch"]))
        compiled = check_train_config(compose("train", overrides=plan["baseline / torch / torch.compile"]))
    assert (eager.trainer.compile, eager.trainer.compile_mode) == (False, "default")
    assert (compiled.trainer.compile, compiled.trainer.compile_mode) == (True, "max-autotune-no-cudagraphs")


def test_resume_steps_the_optimizer_as_this_run_does_not_as_the_checkpoints_run_did(tmp_path):
    """A checkpoint written by a CUDA-graphed run (capturable, fused AdamW, learning rates as device tensors, float
    step counters) resumed on the CPU, and the other way round: the optimizer keeps the options this run built it
    with (a capturable=False group cannot run in a captured step) and a float learning rate."""
    from runtime.training import checkpoint

    overrides = ["trainer.steps=4", "trainer.checkpoint_every=2", "trainer.val_every=0"]
    straight = Trainer(_compose(*overrides), tmp_path / "straight").fit()
    fresh = Trainer(_compose(*overrides), tmp_path / "fresh").optimizer
    Trainer(_compose(*overrides), tmp_path / "run").fit(until=2)
    path, state = checkpoint.resolve(str(tmp_path / "run"))
    for group in state["optimizer"]["param_groups"]:
        lr = torch.tensor(group["lr"], dtype=torch.float64)  # float64: the same rate as the straight run's
        group.update(capturable=True, fused=True, foreach=False, lr=lr)
    for param_state in state["optimizer"]["state"].values():
        param_state["step"] = param_state["step"].to(torch.float32)
    checkpoint.save(path, state)
    resumed = Trainer(_compose(*overrides, f"trainer.resume={path}"), tmp_path / "resumed")
    options = ("fused", "foreach", "capturable", "differentiable")
    for group, built in zip(resumed.optimizer.param_groups, fresh.param_groups, strict=True):
        assert {key: group[key] for key in options} == {key: built[key] for key in options}
        assert type(group["lr"]) is float
    assert resumed.fit()["losses"] == straight["losses"]

    # a capturable, tensor-rate optimizer (what a graphed run builds) loading an eager run's checkpoint
    model = torch.nn.Linear(3, 2)
    graphed = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), capturable=True)
    eager = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    eager.step()
    from runtime.training.loop import with_step_implementation

    graphed.load_state_dict(with_step_implementation(eager.state_dict(), graphed))
    assert graphed.param_groups[0]["capturable"] and graphed.state[model.weight]["step"].dtype == torch.float32


def test_training_benchmark_dry_run_checks_each_runs_config_as_the_run_would():
    from runtime.training import benchmark

    with pytest.raises(ValueError, match="trainer.grad_clip: expected a value > 0"):
        benchmark.main(["models=[baseline]", "presets=[torch]", "compiled=[]", "dry_run=true",
                        "overrides=['trainer.device=cpu','trainer.grad_clip=-1']"])  # fmt: skip


def test_step_matmul_flops_of_hstu_count_its_own_layer():
    """An HSTU layer: the u, v, q, k projection and the output one at heads * head_dim, causal pointwise attention,
    no feed-forward (model.ffn_mult is unused)."""
    from runtime.training.flops import step_matmul_flops

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=["model=hstu", "model.head_dim=24", "data.seq_len=99", "data.batch_size=8"])
    d, width, length, layers = 64, 4 * 24, 100, 2
    per_token = 4 * d * width + width * d + 2 * length * width // 2  # projections; q k^T and p v, causal
    assert step_matmul_flops(cfg) == 3 * 2 * 8 * length * layers * per_token
