"""Gated delta rule on the GPU, the Triton kernels' context-parallel split of long sequences (with the backward's
bf16 products on and off) against the float64 recurrence with test_gated_delta_rule.py's bounds, and against the whole-sequence walk."""

import pytest
import torch

from gdr_checks import BOUND, GRAD_BOUND, make_inputs, triton_chunk
from runtime.accelerators.gated_delta_rule import triton as gdr_triton
from runtime.accelerators.gated_delta_rule.reference import recurrent_gated_delta_rule_reference
from runtime.accelerators.testing import assert_close

# --------------------------------------------------------------------------- context-parallel split (triton)

# few (sequence, value head, V block) walking programs for the SMs: the occupancy rule cuts these into segments.
# Weak decay (about e^-0.4 over a 256-step segment): with the default one a segment forgets the state it was entered
# with below fp32 rounding, and a wrong chain of the segment maps would go unseen.
SPLIT_DECAY_SHIFT = 7.0
SPLIT_CASES = {  # name: (B, T, H, HV, K, V, dtype, options)
    "T4096-K64-fp32-l2norm-state": (1, 4096, 1, 2, 64, 64, torch.float32,
                                    dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "varlen-K128-bf16-GVA-state": (1, 3000, 1, 2, 128, 128, torch.bfloat16,
                                   dict(cu_seqlens=torch.tensor([0, 37, 2100, 2100, 3000]), output_final_state=True)),
}  # fmt: skip


def _triton_outputs_and_grads(inputs, options, grads_out, half_backward, segment_chunks=None):
    """o, final state and every gradient; segment_chunks=0 forces the whole-sequence walk, None lets the rule decide."""
    tuning = gdr_triton.Tuning(half_backward=half_backward, segment_chunks=segment_chunks)
    outputs = triton_chunk(inputs, tuning, **options)
    grads = torch.autograd.grad(outputs, list(inputs.values()), [g.to(o.dtype) for g, o in zip(grads_out, outputs)])
    return [*outputs, *grads]


# the split's walks of the backward (segment offsets, then the segments again) with the bf16 products on as well
SPLIT_RUNS = [(name, False) for name in SPLIT_CASES] + [
    (name, True) for name, case in SPLIT_CASES.items() if case[6] != torch.float32
]


@pytest.mark.parametrize("name, half_backward", SPLIT_RUNS, ids=[f"{n}-half_backward-{h}" for n, h in SPLIT_RUNS])
def test_triton_split_of_long_sequences_matches_the_recurrence_and_the_whole_walk(name, half_backward):
    B, T, H, HV, K, V, dtype, options = SPLIT_CASES[name]
    cu = options.get("cu_seqlens")
    sequences = None if cu is None else len(cu) - 1
    made = make_inputs(B, T, H, HV, K, V, dtype, True, sequences, decay_shift=SPLIT_DECAY_SHIFT)
    inputs = {n: t.requires_grad_() for n, t in made.items()}
    chunks = gdr_triton.Chunks.of(inputs["v"], cu)
    assert gdr_triton.split(chunks, inputs["q"], inputs["v"], cu) is not None, "the occupancy rule should split"
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    refs = recurrent_gated_delta_rule_reference(
        twin["q"], twin["k"], twin["v"], twin["g"], twin["beta"], None, twin["initial_state"], True,
        options.get("use_qk_l2norm_in_kernel", False), cu,
    )  # fmt: skip
    grads_out = [torch.randn_like(r) for r in refs]
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    split = _triton_outputs_and_grads(inputs, options, grads_out, half_backward)
    whole = _triton_outputs_and_grads(inputs, options, grads_out, half_backward, segment_chunks=0)
    labels = ["o", "final_state"] + [f"d{n}" for n in inputs]
    for i, (label, out, out_whole, ref) in enumerate(zip(labels, split, whole, [*refs, *ref_grads])):
        bound = BOUND[dtype] if i < 2 else 2 * BOUND[dtype] if dtype == torch.float32 else GRAD_BOUND[label]
        assert_close(label, out, ref, bound)
        if dtype == torch.float32:  # IEEE dots: the split only reorders fp32 sums
            assert_close(f"{label} (split vs whole)", out, out_whole, 1e-5)
