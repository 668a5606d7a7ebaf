"""Gated delta rule at extreme log decays: g = -inf (a full decay, what logsigmoid of a very negative gate gives in
fp32), huge finite ones (-1e30, -1e4: full decays too, g <= -FULL_DECAY) and a strong one that is not (-80), at one
step inside a chunk, at the first and at the last step of a chunk, and over whole chunks. The chunked torch backend
and the Triton kernels (under the interpreter) against the float64 step-by-step recurrence: the output, the final
state and every gradient. The recurrence's autograd gives dg = exp(g) (...) = 0 at a full decay: finite everywhere,
so every gradient is compared whole, and dg must be exactly 0 there. The TileLang kernels that changed are compiled
for sm_90a here; the GPU tier (tests/gpu/test_gated_delta_rule_gates.py) checks their numbers."""

import pytest
import torch
import torch.nn.functional as F

from conftest import SM90A, requires_nvcc
from runtime.accelerators import use_accelerators
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule
from runtime.accelerators.gated_delta_rule.reference import (
    FULL_DECAY,
    local_gamma,
    recurrent_gated_delta_rule_reference,
)
from runtime.accelerators.testing import assert_close

BOUND, GRAD_BOUND = 1e-4, 2e-4  # fp32 (DESIGN.md: gradients at most twice the output's)
EXTREMES = {"-inf": float("-inf"), "-1e30": -1e30, "-1e4": -1e4, "-80": -80.0}


def place_extremes(g: torch.Tensor, value: float) -> None:
    """g [B >= 4, T, HV]: batch row 0 one step inside the first chunk, row 1 the first step of every chunk, row 2 the
    last step of every chunk (and the sequence's last), row 3 the whole first chunk and one step after it; the last
    value head keeps its ordinary gates when HV > 1 (nothing may leak across heads)."""
    T = g.shape[1]
    heads = slice(0, max(g.shape[2] - 1, 1))
    g[0, min(5, T - 1), heads] = value
    g[1, 0::64, heads] = value
    g[2, 63::64, heads] = value
    g[2, T - 1, heads] = value
    g[3, : min(64, T), heads] = value
    g[3, min(70, T - 1), heads] = value


def gate_inputs(B, T, H, HV, K, V, value=None, sequences=None, seed=0):
    """Fresh random fp32 inputs with an initial state (for `sequences` packed ones where given), the extremes placed
    where `value` is given."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    x = {
        "q": randn(B, T, H, K),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, HV, V),
        "g": F.logsigmoid(randn(B, T, HV) + 2.0),
        "beta": torch.rand(B, T, HV, generator=gen),
        "initial_state": randn(sequences or B, HV, K, V),
    }
    if value is not None:
        place_extremes(x["g"], value)
    return x


def check_against_the_recurrence(inputs, backend, **options):
    """o, the final state and every gradient (random output gradients on both) against the float64 recurrence."""
    inputs = {n: t.requires_grad_() for n, t in inputs.items()}
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    with use_accelerators(fallback="error"), poison_outputs():
        o, final = chunk_gated_delta_rule(
            *(inputs[n] for n in ("q", "k", "v", "g", "beta")), initial_state=inputs["initial_state"],
            output_final_state=True, backend=backend, **options,
        )  # fmt: skip
    o_ref, final_ref = recurrent_gated_delta_rule_reference(
        *(twin[n] for n in ("q", "k", "v", "g", "beta")), options.get("scale"), twin["initial_state"], True,
        options.get("use_qk_l2norm_in_kernel", False), options.get("cu_seqlens"),
    )  # fmt: skip
    assert_close("o", o, o_ref, BOUND)
    assert_close("final_state", final, final_ref, BOUND)
    gen = torch.Generator().manual_seed(1)
    grads_out = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in (o_ref, final_ref)]
    with poison_outputs():
        grads = torch.autograd.grad([o, final], list(inputs.values()), [g.float() for g in grads_out])
    ref_grads = torch.autograd.grad([o_ref, final_ref], list(twin.values()), grads_out)
    for n, grad, ref in zip(inputs, grads, ref_grads):
        assert torch.isfinite(ref).all(), f"d{n}: the recurrence's gradient is not finite"
        assert_close(f"d{n}", grad, ref, GRAD_BOUND)
    full = inputs["g"].detach() <= -FULL_DECAY
    assert (grads[3][full] == 0).all(), "dg at a full decay: the recurrence's is 0"


SHAPES = {  # (B, T, H, HV, K, V)
    "T63-K16-H1": (4, 63, 1, 1, 16, 16),
    "T64-K32-H2": (4, 64, 2, 2, 32, 32),
    "T65-K16-V32-GVA": (4, 65, 1, 2, 16, 32),
}


@pytest.mark.parametrize("value", list(EXTREMES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_chunked_backend_follows_the_recurrence(shape, value):
    check_against_the_recurrence(gate_inputs(*SHAPES[shape], EXTREMES[value]), "torch")


@pytest.mark.parametrize("value", list(EXTREMES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.slow
def test_triton_kernels_follow_the_recurrence(shape, value):
    check_against_the_recurrence(gate_inputs(*SHAPES[shape], EXTREMES[value]), "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_full_decays_with_l2norm(backend):
    """Packed sequences (one of them empty): -inf at the first step of the first sequence (the row the torch backend
    pads the others with) and of another, at the last step of a chunk and over a whole chunk of the longest
    sequence, with the l2norm in the kernel."""
    cu = torch.tensor([0, 20, 20, 63, 200])
    x = gate_inputs(1, 200, 1, 2, 16, 16, sequences=4)
    for step in (
        0,
        20,
        62,
        63 + 63,
        *range(63 + 64, 200),
    ):  # the last sequence: a chunk ends at 126, then -inf to its end
        x["g"][0, step, 0] = float("-inf")
    check_against_the_recurrence(x, backend, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


def test_gamma_of_ordinary_gates_is_the_plain_cumulative_sum():
    """Without a full decay the chunk's gamma is cumsum(g) bit for bit (the common case is unchanged)."""
    g = F.logsigmoid(torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) - 3.0) * 10
    assert torch.equal(local_gamma(g), g.cumsum(-1))


def test_a_full_decay_does_not_cancel_the_small_gates_after_it():
    """After a full decay, differences of gamma are the sums of the g's between them up to one rounding at the size of
    FULL_DECAY (a cumulative sum through -1e30 would have lost them)."""
    g = torch.full((64,), -1e-3)
    g[3] = -1e30
    gamma = local_gamma(g)
    assert gamma[3] - gamma[2] <= -FULL_DECAY + 1e-3
    torch.testing.assert_close(gamma[63] - gamma[4], torch.tensor(-59e-3), rtol=0, atol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_growth_is_rejected_on_cpu_tensors(backend):
    x = gate_inputs(4, 8, 1, 1, 16, 16)
    x["g"][2, 3, 0] = 0.5
    with pytest.raises(ValueError, match=r"g: expected log decays <= 0.*0\.5 at \(2, 3, 0\)"):
        chunk_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta")), backend=backend)


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["prepare-bf16-g-fp32", "prepare-f16-varlen", "grad-wy-K16-varlen-l2norm"])
def test_tilelang_gate_kernels_compile_for_sm90a(kernel):
    """The TileLang kernels that read g for the full decays (the prepare's gamma, the chunked backward's dg)."""
    gt = pytest.importorskip("runtime.accelerators.gated_delta_rule.tilelang", exc_type=ImportError)
    gb = pytest.importorskip("runtime.accelerators.gated_delta_rule.tilelang_backward", exc_type=ImportError)
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    entries = {
        "prepare-bf16-g-fp32": lambda: gt.prepare_entry(
            32, 32, torch.bfloat16, torch.float32, torch.bfloat16, False, False
        ),
        "prepare-f16-varlen": lambda: gt.prepare_entry(16, 16, torch.float16, torch.float16, torch.float16, True, True),
        "grad-wy-K16-varlen-l2norm": lambda: gb.grad_wy_entry(
            16, 16, torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True
        ),
    }
    _, build = entries[kernel]()
    source = tilelang.compile(build(device_info(None)), target=SM90A).get_kernel_source()
    assert f"{-FULL_DECAY:e}" in source, "the full-decay threshold is not in the kernel"  # as a /*-1.280000e+02*/ note
