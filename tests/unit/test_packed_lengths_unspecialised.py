"""One compiled Triton kernel serves every packing of jagged batches: the integer arguments that follow the packed
token count (row counts, element counts, row steps, block counts of the longest sequence) are left out of Triton's
specialisation, which otherwise compiles a kernel again for each new value's "== 1" and "divisible by 16" flags.
On the H200 a jagged training run compiled the linear kernels again at new token counts in 4-7 of its 100 timed
steps before their row count was left out: 2.0-2.6 s of compilation, 38.9 -> 14.4 ms a step for baseline
(docs/benchmark/training.md). The GPU tier sees the compiled kernels; this checks that the arguments stay listed."""

import pytest

from runtime.accelerators import norms_kernels
from runtime.accelerators.activation import triton as activation
from runtime.accelerators.add_norm import triton as add_norm
from runtime.accelerators.dropout_add import triton as dropout_add
from runtime.accelerators.flash_attention import triton_dkdv, triton_dq, triton_forward
from runtime.accelerators.gated_delta_rule import triton as gdr_forward
from runtime.accelerators.gated_delta_rule import triton_backward as gdr_backward
from runtime.accelerators.gated_delta_rule import triton_backward_wy as gdr_wy
from runtime.accelerators.gated_delta_rule import triton_shared as gdr_shared
from runtime.accelerators.linear import triton as linear
from runtime.accelerators.linear import triton_persistent
from runtime.accelerators.silu_attention import triton_backward as silu_backward
from runtime.accelerators.silu_attention import triton_forward as silu_forward

PACKED_LENGTH_ARGUMENTS = [
    (linear._linear_forward, {"M"}),
    (linear._linear_backward_act, {"M", "STEPS"}),
    (triton_persistent._linear_forward_persistent, {"M", "PROGRAMS"}),
    (activation._forward_kernel, {"n"}),
    (activation._backward_kernel, {"n"}),
    (dropout_add._dropout_add_forward, {"n"}),
    (dropout_add._dropout_add_backward, {"n"}),
    (norms_kernels.row_norm_forward, {"n_rows"}),
    (norms_kernels.row_norm_backward, {"n_rows"}),
    (add_norm._forward_kernel, {"n_rows"}),
    (add_norm._backward_kernel, {"n_rows"}),
    (triton_forward._fwd_kernel, {"LQ", "LK", "N_BLOCKS"}),
    (triton_dq._bwd_dq_kernel, {"LQ", "LK", "N_BLOCKS"}),
    (triton_dkdv._bwd_dkdv_kernel, {"LQ", "LK", "N_BLOCKS"}),
    (silu_forward._fwd_kernel, {"NBLOCKS"}),
    (silu_backward._bwd_dq_kernel, {"NBLOCKS"}),
    (silu_backward._bwd_dkdv_kernel, {"NBLOCKS"}),
    (gdr_forward._chunk_inverse_kernel, {"T", "N_CHUNKS"}),
    (gdr_forward._chunk_wy_kernel, {"T", "N_CHUNKS"}),
    (gdr_forward._chunk_output_kernel, {"T", "N_CHUNKS"}),
    (gdr_shared._chunk_state_kernel, {"T", "N_CHUNKS"}),
    (gdr_backward._chunk_local_grad_kernel, {"T", "N_CHUNKS"}),
    (gdr_backward._state_grad_kernel, {"T", "N_CHUNKS"}),
    (gdr_backward._chunk_grad_qk_state_kernel, {"T", "N_CHUNKS"}),
    (gdr_backward._sum_value_heads_kernel, {"ROWS"}),
    (gdr_wy._chunk_grad_wy_kernel, {"T", "N_CHUNKS"}),
    (gdr_wy._chunk_grad_wy_fused_kernel, {"T", "N_CHUNKS"}),
]


def unspecialised(launch) -> set[str]:
    """The names a kernel leaves out of Triton's integer specialisation (a @direct_launch over @triton.jit; under
    TRITON_INTERPRET=1 the decorator's arguments are kept as given)."""
    kernel = launch.kernel
    names = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
    return {kernel.arg_names[n] if isinstance(n, int) else n for n in names or ()}


@pytest.mark.parametrize(
    "launch, names",
    PACKED_LENGTH_ARGUMENTS,
    ids=[f"{k.kernel.__module__}.{k.kernel.__name__}" for k, _ in PACKED_LENGTH_ARGUMENTS],
)
def test_packed_length_arguments_are_not_specialised(launch, names):
    kernel = launch.kernel
    assert names <= set(kernel.arg_names), f"{kernel.__name__}: no argument named {names - set(kernel.arg_names)}"
    missing = names - unspecialised(launch)
    assert not missing, f"{kernel.__name__} specialises on {sorted(missing)}: a new packing would compile it again"
