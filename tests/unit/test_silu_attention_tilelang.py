"""silu_attention's TileLang forward, compile-only: lowered and compiled for sm_90a with the local nvcc.

One specialisation with every feature (causal, targets, both biases, dropout) at a padded head dim, and the plain
kernel at the widest; the GPU tier checks the numbers."""

import pytest
import torch

from conftest import SM90A, requires_nvcc

kernels = pytest.importorskip(
    "runtime.accelerators.silu_attention.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

KERNELS = {
    "d24-bf16-causal-targets-pos-time-dropout": lambda: kernels.forward_entry(
        24, torch.bfloat16, True, True, True, True, True
    ),
    "d128-f16-full": lambda: kernels.forward_entry(128, torch.float16, False, False, False, False, False),
}


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNELS))
def test_forward_compiles_for_sm90a(name):
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    _, build = KERNELS[name]()
    source = tilelang.compile(build(device_info(None)), target=SM90A).get_kernel_source()
    assert "__global__" in source
    # sequences, heads and tokens are runtime arguments: one kernel serves every packing
    for dynamic in ("total", "heads", "n_offsets"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    if "dropout" in name:
        assert "taac_dropout_bits" in source
