"""Gated delta rule on the GPU at extreme log decays, both kernel backends: g = -inf, -1e30 and -1e4 (full decays,
g <= -FULL_DECAY) and -80 (not one) at one step inside a chunk, at the first and the last step of every chunk, and over
a whole chunk (tests/unit/test_gated_delta_rule_gates.py places them the same way), against the float64 recurrence:
the output, the final state and every gradient with test_gated_delta_rule.py's bounds, and dg exactly 0 at the full
decays (the recurrence's gradient there: exp(g) = 0). The Triton kernels in fp32 (IEEE products) and bf16, the
TileLang ones in bf16 (their chunked kernels refuse fp32), packed sequences on both."""

import pytest
import torch
import torch.nn.functional as F

from gdr_checks import BOUND, GRAD_BOUND
from runtime.accelerators import use_accelerators
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule
from runtime.accelerators.gated_delta_rule.reference import FULL_DECAY, recurrent_gated_delta_rule_reference
from runtime.accelerators.testing import assert_close

EXTREMES = {"-inf": float("-inf"), "-1e30": -1e30, "-1e4": -1e4, "-80": -80.0}
# (B, T, H, HV, K, V, dtype, options): one specialisation per backend and dtype, whatever the extreme value
CASES = {
    "triton-fp32-T200-K64-GVA": ("triton", (4, 200, 1, 2, 64, 64, torch.float32), {}),
    "triton-bf16-T200-K128-l2norm": ("triton", (4, 200, 2, 2, 128, 128, torch.bfloat16),
                                     dict(use_qk_l2norm_in_kernel=True)),
    "tilelang-bf16-T200-K128-l2norm": ("tilelang", (4, 200, 2, 2, 128, 128, torch.bfloat16),
                                       dict(use_qk_l2norm_in_kernel=True)),
}  # fmt: skip
VARLEN = [0, 1, 64, 200, 263, 1000]
# the TileLang specialisations (K, V, dtype, state, final state, l2norm, varlen): test_gated_delta_rule_tilelang.py's
TILELANG_SPECS = [
    (128, 128, torch.bfloat16, True, True, True, False),
    (128, 64, torch.bfloat16, True, True, True, True),
]


@pytest.fixture(scope="module")
def tilelang_compiled():
    """The chunked TileLang kernels of the cases, forward and backward, compiled in parallel once (a disk-cache hit
    where test_gated_delta_rule_tilelang.py compiled them first)."""
    from runtime.accelerators.gated_delta_rule import tilelang as gdr_tilelang
    from runtime.accelerators.tilelang_common import precompile

    entries = []
    for K, V, dtype, state, final, l2norm, varlen in TILELANG_SPECS:
        entries += gdr_tilelang.entries(K, V, dtype, dtype, dtype, state, final, l2norm, varlen, backward=True)
    precompile(entries, torch.device("cuda"))


def place_extremes(g: torch.Tensor, value: float) -> None:
    """Batch row 0 one step inside the first chunk, row 1 the first step of every chunk, row 2 the last step of every
    chunk and of the sequence, row 3 the whole first chunk and one step after it; the last value head keeps its
    ordinary gates."""
    T = g.shape[1]
    heads = slice(0, max(g.shape[2] - 1, 1))
    g[0, 5, heads] = value
    g[1, 0::64, heads] = value
    g[2, 63::64, heads] = value
    g[2, T - 1, heads] = value
    g[3, :64, heads] = value
    g[3, 70, heads] = value


def make_inputs(B, T, H, HV, K, V, dtype, sequences=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    x = {
        "q": randn(B, T, H, K),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, HV, V),
        "g": F.logsigmoid(randn(B, T, HV) + 2.0),
        "beta": torch.rand(B, T, HV, generator=gen, device="cuda"),
    }
    x = {n: t.to(dtype) for n, t in x.items()}
    x["initial_state"] = randn(sequences or B, HV, K, V)
    return x


def check_against_the_recurrence(inputs, backend, dtype, **options):
    inputs = {n: t.requires_grad_() for n, t in inputs.items()}
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    with use_accelerators(fallback="error"):
        o, final = chunk_gated_delta_rule(
            *(inputs[n] for n in ("q", "k", "v", "g", "beta")), initial_state=inputs["initial_state"],
            output_final_state=True, backend=backend, **options,
        )  # fmt: skip
    o_ref, final_ref = recurrent_gated_delta_rule_reference(
        *(twin[n] for n in ("q", "k", "v", "g", "beta")), None, twin["initial_state"], True,
        options.get("use_qk_l2norm_in_kernel", False), options.get("cu_seqlens"),
    )  # fmt: skip
    assert_close("o", o, o_ref, BOUND[dtype])
    assert_close("final_state", final, final_ref, BOUND[dtype])
    grads_out = [torch.randn_like(r) for r in (o_ref, final_ref)]
    grads = torch.autograd.grad(
        [o, final], list(inputs.values()), [g.to(t.dtype) for g, t in zip(grads_out, (o, final))]
    )
    ref_grads = torch.autograd.grad([o_ref, final_ref], list(twin.values()), grads_out)
    for n, grad, ref in zip(inputs, grads, ref_grads):
        assert torch.isfinite(ref).all(), f"d{n}: the recurrence's gradient is not finite"
        bound = 2 * BOUND[dtype] if dtype == torch.float32 else GRAD_BOUND[f"d{n}"]
        assert_close(f"d{n}", grad, ref, bound)
    full = inputs["g"].detach() <= -FULL_DECAY
    assert (grads[3][full] == 0).all(), "dg at a full decay: the recurrence's is 0"


@pytest.mark.parametrize("value", list(EXTREMES))
@pytest.mark.parametrize("case", list(CASES))
def test_extreme_gates_follow_the_recurrence(case, value, request):
    backend, (B, T, H, HV, K, V, dtype), options = CASES[case]
    if backend == "tilelang":
        request.getfixturevalue("tilelang_compiled")
    inputs = make_inputs(B, T, H, HV, K, V, dtype)
    place_extremes(inputs["g"], EXTREMES[value])
    check_against_the_recurrence(inputs, backend, dtype, **options)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_packed_sequences_with_full_decays(backend, request):
    """-inf at a sequence's only step, a sequence's first step, the last step of a chunk, and from the middle of the
    longest sequence to its end (whole chunks and a partial one); GVA."""
    if backend == "tilelang":
        request.getfixturevalue("tilelang_compiled")
    inputs = make_inputs(1, 1000, 2, 4, 128, 64, torch.bfloat16, sequences=len(VARLEN) - 1)
    for step in (0, 64, 64 + 63, 263 + 63, *range(600, 1000)):
        inputs["g"][0, step, :3] = float("-inf")
    options = dict(cu_seqlens=torch.tensor(VARLEN), use_qk_l2norm_in_kernel=True)
    check_against_the_recurrence(inputs, backend, torch.bfloat16, **options)
