"""gated_delta_rule's TileLang kernels, compile-only: lowered and compiled for sm_90a with the local nvcc.

One representative specialisation per kernel (recurrent, chunk prepare, chunk state/output); the GPU
tier checks the numbers. Also what needs no GPU: the tilelang backend's reasons and the varlen chunk table.
"""

import pytest
import torch

from conftest import SM90A, requires_nvcc

gt = pytest.importorskip(
    "runtime.accelerators.gated_delta_rule.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

from runtime.accelerators.gated_delta_rule import SPEC  # noqa: E402

# each kernel once, at widths and flags that exercise its special paths: K=V=16 (two-warp state
# gemms), varlen with l2norm, initial and final state, g in fp32 beside bf16 q/k/v
KERNELS = {
    "recurrent-K128-V64-bf16-varlen-l2norm-state": lambda: gt.recurrent_entry(
        128, 64, torch.bfloat16, torch.float32, torch.bfloat16, True, True, True, True
    ),
    "prepare-K16-V16-f16-varlen-l2norm": lambda: gt.prepare_entry(
        16, 16, torch.float16, torch.float16, torch.float16, True, True
    ),
    "state-output-K16-V16-bf16-state": lambda: gt.state_output_entry(16, 16, torch.bfloat16, True, True, False, False),
}


def compile_entry(entry):
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    key, build = entry
    return tilelang.compile(build(device_info(None)), target=SM90A)


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_compiles_for_sm90a(name):
    source = compile_entry(KERNELS[name]()).get_kernel_source()
    assert "__global__" in source
    # rows, heads and the sequence count are runtime arguments: one kernel serves every shape
    for dynamic in ("rows", "v_heads"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    if "varlen" in name:
        assert "Cu[" in source, f"{name}: the varlen boundaries should be read on the device"
    if not name.startswith("recurrent"):
        assert "mma_sync" in source, f"{name}: the chunk matmuls should use tensor cores"
    if name.startswith("state-output"):
        assert "HT[" in source or "HT +" in source, "the final state should be stored"


def _inputs(dtype, K=16, V=16):
    q = torch.randn(1, 5, 1, K).to(dtype)
    v = torch.randn(1, 5, 1, V).to(dtype)
    return dict(q=q, v=v, g=torch.randn(1, 5, 1), beta=torch.rand(1, 5, 1), initial_state=None)


def test_tilelang_reasons():
    bf16, fp32 = _inputs(torch.bfloat16), _inputs(torch.float32)
    assert SPEC.reasons("tilelang", **bf16, mode="chunk", needs_grad=False) == []
    assert SPEC.reasons("tilelang", **bf16, mode="recurrent", needs_grad=False) == []
    assert SPEC.reasons("tilelang", **fp32, mode="recurrent", needs_grad=False) == []  # exact fp32 math
    (reason,) = SPEC.reasons("tilelang", **fp32, mode="chunk", needs_grad=False)
    assert "tf32" in reason and "float32" in reason
    (reason,) = SPEC.reasons("tilelang", **bf16, mode="chunk", needs_grad=True)
    assert "tilelang chunked kernels are forward-only" in reason
    (reason,) = SPEC.reasons("tilelang", **bf16, mode="recurrent", needs_grad=True)
    assert "recurrent kernels are forward-only" in reason
    (reason,) = SPEC.reasons("tilelang", **_inputs(torch.bfloat16, K=24), mode="recurrent", needs_grad=False)
    assert "K (the q/k head dim) is 24" in reason


def test_chunk_table_numbers_chunks_sequence_by_sequence():
    cu = torch.tensor([0, 20, 63, 63, 200])  # an empty sequence, one over two chunks
    table = gt._chunk_table(cu)
    assert table.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [3, 2]]
