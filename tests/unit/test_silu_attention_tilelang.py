"""silu_attention's TileLang kernels, compile-only: lowered and compiled for sm_90a with the local nvcc.

Forward: one specialisation with every feature (causal, targets, both biases, dropout) at a padded head dim, and the
plain kernel at the widest. Backward (dk/dv, dq and, with a bias, the bias kernel): head dim 32 causal with both
biases, 64 with targets and dropout, 128 fp16 without a bias. The GPU tier checks the numbers."""

import pytest
import torch

from conftest import SM90A, requires_nvcc

kernels = pytest.importorskip(
    "runtime.accelerators.silu_attention.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

FORWARD = {
    "d24-bf16-causal-targets-pos-time-dropout": lambda: kernels.forward_entry(
        24, torch.bfloat16, True, True, True, True, True
    ),
    "d128-f16-full": lambda: kernels.forward_entry(128, torch.float16, False, False, False, False, False),
}

# (head dim, dtype, causal, targets, position bias, time bias, dropout)
BACKWARD_CASES = {
    "d32-bf16-causal-pos-time": (32, torch.bfloat16, True, False, True, True, False),
    "d64-bf16-causal-targets-dropout": (64, torch.bfloat16, True, True, False, False, True),
    "d128-f16-full": (128, torch.float16, False, False, False, False, False),
}
BACKWARD = {
    f"{name}-{kernel}": (lambda case=case, kernel=kernel: kernels.backward_entry(kernel, *case))
    for name, case in BACKWARD_CASES.items()
    # the bias kernel runs only where a bias is given
    for kernel in ("dkdv", "dq", "bias")
    if kernel != "bias" or case[4] or case[5]
}


def _compile(entry):
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    _, build = entry
    return tilelang.compile(build(device_info(None)), target=SM90A).get_kernel_source()


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORWARD))
def test_forward_compiles_for_sm90a(name):
    source = _compile(FORWARD[name]())
    assert "__global__" in source
    # sequences, heads and tokens are runtime arguments: one kernel serves every packing
    for dynamic in ("total", "heads", "n_offsets"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    if "dropout" in name:
        assert "taac_dropout_bits" in source


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(BACKWARD))
def test_backward_compiles_for_sm90a(name):
    source = _compile(BACKWARD[name]())
    assert "__global__" in source
    for dynamic in ("total", "heads", "n_offsets"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    # the forward's dropout bits and time buckets, recomputed: not stored
    assert ("taac_dropout_bits" in source) == ("dropout" in name)
    assert ("taac_time_bucket" in source) == ("time" in name)
    assert "atomic" not in source.lower(), f"{name}: the backward adds nothing atomically (deterministic)"


def test_backward_entries_differ_per_kernel_and_flags():
    keys = {entry()[0] for entry in BACKWARD.values()}
    assert len(keys) == len(BACKWARD) == 7
    key, _ = kernels.backward_entry("bias", 32, torch.bfloat16, True, False, True, True, False)
    assert key[0] == "silu_attention_bwd_bias"
    with pytest.raises(KeyError):
        kernels.backward_entry("dz", 32, torch.bfloat16, True, False, False, False, False)


def test_tilelang_backend_declares_a_backward():
    from runtime.accelerators.silu_attention import SUPPORT

    assert SUPPORT["tilelang"].backward
    assert kernels.backward.__name__ == "backward"
