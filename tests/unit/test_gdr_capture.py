"""tests/gdr_capture.py, which the GPU tier's model test judges the GDR mixers' gate and output norm weight gradients
with: on a tiny GDR model on the CPU (torch backend), one captured op call and output norm call per mixer, exact in
float64, and the matched check passing for the torch backend's own bf16 autocast run."""

import copy

import pytest
import torch

from gdr_capture import (
    capture_gdr_calls,
    gate_parameter_gradients,
    matched_comparisons,
    matched_parameter_names,
    recompute_in_float64,
    recompute_norm_weight_gradient_in_float64,
)
from runtime.accelerators import use_accelerators
from runtime.accelerators.testing import assert_close
from runtime.models import GDRMixerPCVR
from runtime.training.synthetic import SyntheticPCVR

BATCH, HISTORY, LAYERS, HEADS, D_MODEL = 2, 15, 2, 2, 32


@pytest.fixture(scope="module")
def model_and_batch():
    data = SyntheticPCVR(seq_len=HISTORY, n_items=300, n_categories=8, val_size=16)
    torch.manual_seed(0)
    model = GDRMixerPCVR(data.spec, d_model=D_MODEL, n_heads=HEADS, n_layers=LAYERS, ffn_mult=2, dropout=0.0,
                         head_hidden=24)  # fmt: skip
    return model, data.train_batch(0, BATCH)


def _captured_run(model, batch, autocast):
    """(calls, {parameter name: gradient}) of the logits' sum on the torch backend."""
    with capture_gdr_calls(model) as calls:
        with use_accelerators(default="torch"), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(batch)
        grads = torch.autograd.grad(out.float().sum(), list(model.parameters()))
    return calls, dict(zip([name for name, _ in model.named_parameters()], grads))


def test_one_call_per_mixer_with_its_inputs_and_gradients(model_and_batch):
    model, batch = model_and_batch
    calls, _ = _captured_run(model, batch, autocast=True)
    assert [call.mixer for call in calls] == [f"blocks.{i}.mix.branch.layer" for i in range(LAYERS)]
    parameters = ("A_log", "dt_bias", "norm.weight")
    assert matched_parameter_names(model) == {f"{call.mixer}.{p}" for call in calls for p in parameters}
    steps, head_dim = HISTORY + 1, D_MODEL // HEADS  # the history, then the target
    for call in calls:
        assert set(call.inputs) == {"q", "k", "v", "g", "beta"}
        for name in ("q", "k", "v"):
            assert call.inputs[name].shape == (BATCH, steps, HEADS, head_dim)
            assert call.inputs[name].dtype == torch.bfloat16
        for name in ("g", "beta"):
            assert call.inputs[name].shape == (BATCH, steps, HEADS)
        assert call.o.shape == call.do.shape == (BATCH, steps, HEADS, head_dim)
        assert call.dg.shape == call.inputs["g"].shape
        norm = call.norm  # the mixer's output norm, on the op's output
        assert torch.equal(norm.x, call.o)
        assert norm.weight.shape == norm.dweight.shape == (head_dim,)
        assert norm.weight.dtype == norm.dweight.dtype == torch.float32
        assert norm.dy.shape == call.o.shape


def test_float64_recomputation_reproduces_a_float64_run(model_and_batch):
    """From a float64 run's own captured tensors the recomputation is that run's o, dg and output norm weight
    gradient, the sums of dg are its A_log and dt_bias gradients, and the norm's is its norm.weight gradient: the
    capture misses nothing."""
    model, batch = model_and_batch
    model64 = copy.deepcopy(model).double()
    calls, grads = _captured_run(model64, batch._map(lambda t: t.double() if t.is_floating_point() else t), False)
    for call in calls:
        o, dg = recompute_in_float64(call)
        assert torch.equal(o, call.o)
        assert torch.equal(dg, call.dg)
        for parameter, summed in gate_parameter_gradients(call, dg).items():
            assert_close(f"{call.mixer}.{parameter}", summed, grads[f"{call.mixer}.{parameter}"], 1e-12)
        dweight = recompute_norm_weight_gradient_in_float64(call.norm)
        assert torch.equal(dweight, call.norm.dweight)
        assert torch.equal(dweight, grads[f"{call.mixer}.norm.weight"])


def test_matched_check_passes_for_the_torch_backends_autocast_run(model_and_batch):
    model, batch = model_and_batch
    calls, _ = _captured_run(model, batch, autocast=True)
    for call in calls:
        comparisons = matched_comparisons(call)
        assert len(comparisons) == 5  # o, dg, the A_log and dt_bias gradients, and the norm weight's
        for what, value, expected, bound in comparisons:
            assert_close(what, value, expected, bound)
