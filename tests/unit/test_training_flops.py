"""The training benchmark's matmul FLOPs (flops.py): jagged batches at their real sequence lengths, padded batches on
the padded grid (the count from the config)."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from runtime.accelerators import active_config, set_accelerators
from runtime.models import PCVRBatch
from runtime.models.inputs import offsets_of
from runtime.training import config_dir
from runtime.training.flops import batch_step_matmul_flops, sequence_lengths, step_matmul_flops
from tiny_training import TINY_SIZES

HISTORIES = [3, 5, 8]  # the jagged batch's history lengths
D, HIDDEN, LAYERS = 64, 4 * 64, 2  # the model configs' d_model, ffn_mult * d_model, n_layers
PER_TOKEN = 4 * D * D + 3 * D * HIDDEN  # qkv and out projections, SwiGLU feed-forward (multiply-adds)
GDR_PER_TOKEN = (3 + 1 + 1) * D * D + D * 2 * 4 + 3 * D * HIDDEN + 4 * (64 * 2 * 16 + 3 * 16 * 16)


def _cfg(model: str, *overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[f"model={model}", *overrides])


def _jagged_batch(lengths: list[int]) -> PCVRBatch:
    """A jagged batch with histories of the given lengths (zero ids: only the shapes matter here)."""
    b, total = len(lengths), sum(lengths)
    seq_lengths = torch.tensor(lengths)
    return PCVRBatch(
        sparse=torch.zeros(b, 1, 1, dtype=torch.long),
        dense=torch.zeros(b, 1),
        seq_items=torch.zeros(total, dtype=torch.long),
        seq_categories=torch.zeros(total, dtype=torch.long),
        seq_actions=torch.zeros(total, dtype=torch.long),
        seq_lengths=seq_lengths,
        target_item=torch.zeros(b, dtype=torch.long),
        target_category=torch.zeros(b, dtype=torch.long),
        label=torch.zeros(b),
        seq_offsets=offsets_of(seq_lengths),
        max_seqlen=max(lengths),
    )


# one step (3x the forward, 2 FLOPs per multiply-add) on HISTORIES, by hand: the baseline mixes the histories
# (3, 5, 8: 16 tokens, 9 + 25 + 64 pairs, every pair), the causal models each with its target token (4, 6, 9: 19
# tokens, 16 + 36 + 81 pairs, half of them); attention costs 2 * D per pair (scores and values), HSTU's at its
# width 4 heads x 16 = D
HAND_COUNTED = {
    "baseline": 3 * 2 * LAYERS * (16 * PER_TOKEN + (9 + 25 + 64) * 2 * D),
    "tokenformer": 3 * 2 * LAYERS * (19 * PER_TOKEN + (16 + 36 + 81) * 2 * D // 2),
    "gdr": 3 * 2 * LAYERS * 19 * GDR_PER_TOKEN,  # linear in the tokens: chunked within each sequence
    "hstu": 3 * 2 * LAYERS * (19 * 5 * D * D + (16 + 36 + 81) * 2 * D // 2),  # u, v, q, k and out; no feed-forward
}


@pytest.mark.parametrize("model", sorted(HAND_COUNTED))
def test_a_jagged_batch_counts_its_real_sequence_lengths(model):
    cfg = _cfg(model)
    batch = _jagged_batch(HISTORIES)
    extra = 0 if model == "baseline" else 1
    assert sequence_lengths(cfg, batch).tolist() == [n + extra for n in HISTORIES]
    assert batch_step_matmul_flops(cfg, batch) == HAND_COUNTED[model]
    # far below the padded grid the config describes (256 + extra tokens per history)
    assert batch_step_matmul_flops(cfg, batch) < step_matmul_flops(cfg) / 10


def _padded_grid_count(cfg) -> float:
    """The count from the config alone, as the benchmark made it before counting batches: every example of
    data.batch_size at data.seq_len (+ the causal models' target token)."""
    model, data = cfg.model, cfg.data
    d, heads, layers, hidden = model.d_model, model.n_heads, model.n_layers, model.ffn_mult * model.d_model
    kind = str(model._target_).rsplit(".", 1)[-1]
    length = data.seq_len + (0 if kind == "BaselinePCVR" else 1)
    tokens = data.batch_size * length
    ffn = 3 * d * hidden
    if kind == "GDRMixerPCVR":
        hd = d // heads
        per_token = 5 * d * d + d * 2 * heads + ffn + heads * (64 * 2 * hd + 3 * hd * hd)
    elif kind == "HSTUPCVR":
        width = heads * (model.get("head_dim") or d // heads)
        per_token = 5 * d * width + length * width
    else:
        per_token = 4 * d * d + ffn + (2 * length * d if kind == "BaselinePCVR" else length * d)
    return 3 * 2.0 * tokens * layers * per_token


@pytest.mark.parametrize("model", sorted(HAND_COUNTED))
def test_a_padded_batch_counts_the_padded_grid_as_the_config_does(model):
    """Every row at the batch's width, whatever its history's length: the padded layout computes the padding."""
    cfg = _cfg(model, "data.batch_size=3", "data.seq_len=20")
    padded = _jagged_batch(HISTORIES).padded(cfg.data.seq_len)
    assert batch_step_matmul_flops(cfg, padded) == step_matmul_flops(cfg) == _padded_grid_count(cfg)
    full = _cfg(model, "experiment=pcvr_large")  # the presets' sizes: the same count as before
    assert step_matmul_flops(full) == _padded_grid_count(full)


@pytest.fixture
def _restore_accelerators():
    saved = active_config()
    yield
    set_accelerators(saved)


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_the_benchmark_reports_the_flops_of_the_batches_it_timed(layout, tmp_path, _restore_accelerators):
    from runtime.training import benchmark

    overrides = ["accelerators=torch", "trainer.device=cpu", "trainer.progress=false", *TINY_SIZES]
    jagged = f"data.jagged={layout == 'jagged'}"
    cfg = _cfg("tokenformer", *overrides, "data.seq_len=64", "trainer.steps=4", jagged)  # histories of 16 to 64
    batches = benchmark._make_batches(cfg, 4, layout)
    result = benchmark.run_one(cfg, batches, warmup=1, run_dir=tmp_path)
    timed = [step_matmul_flops(cfg, [n + 1 for n in b.seq_lengths.tolist()]) for b in batches[1:]]
    if layout == "padded":
        assert result["matmul_flops_per_step"] == step_matmul_flops(cfg)
    else:
        assert result["matmul_flops_per_step"] == pytest.approx(sum(timed) / 3)
        assert result["matmul_flops_per_step"] < step_matmul_flops(cfg)  # the padded grid
