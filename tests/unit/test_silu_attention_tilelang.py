"""silu_attention's TileLang kernels, compile-only: lowered and compiled for sm_90a with the local nvcc; and the dk/dv
kernel's bias-gradient sums run on the CPU (tools/tilelang_on_cpu.py) from given ds tiles.

Forward: one specialisation with every feature (causal, targets, both biases, dropout) at a padded head dim, and the
plain kernel at the widest. Backward (dk/dv with the bias sums, and dq): head dim 32 causal with both biases, 64 with
targets and dropout, 128 fp16 without a bias, 16 fp16 not causal with targets and a position bias, and dk/dv with
every feature at the widest. The GPU tier checks the numbers."""

import shutil
import subprocess

import pytest
import torch

from conftest import SM90A, requires_gxx, requires_nvcc

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
    # not causal: the edge tiles are the sequence's end and the candidates only
    "d16-f16-targets-pos": (16, torch.float16, False, True, True, False, False),
}
BACKWARD = {
    f"{name}-{kernel}": (lambda case=case, kernel=kernel: kernels.backward_entry(kernel, *case))
    for name, case in BACKWARD_CASES.items()
    for kernel in ("dkdv", "dq")
}
# dk/dv once more with every feature (the bias sums beside the widest tiles): not causal, targets, dropout, fp16
BACKWARD["d128-f16-full-targets-pos-time-dropout-dkdv"] = lambda: kernels.backward_entry(
    "dkdv", 128, torch.float16, False, True, True, True, True
)


def _compile(entry):
    from runtime.accelerators.tilelang_common import compile_built, device_info

    _, build = entry
    return compile_built(build(device_info(None)), SM90A).get_kernel_source()


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORWARD))
def test_forward_compiles_for_sm90a(name):
    source = _compile(FORWARD[name]())
    assert "__global__" in source
    # sequences and heads are runtime arguments (the token count only ever appeared in bounds guards): one kernel
    # serves every packing
    for dynamic in ("heads", "n_offsets"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    if "dropout" in name:
        assert "taac_dropout_bits" in source
    _assert_no_bounds_guards(name, source)


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(BACKWARD))
def test_backward_compiles_for_sm90a(name):
    source = _compile(BACKWARD[name]())
    assert "__global__" in source
    for dynamic in ("heads", "n_offsets"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    # the forward's dropout bits and time buckets, recomputed: not stored
    assert ("taac_dropout_bits" in source) == ("dropout" in name)
    assert ("taac_time_bucket" in source) == ("time" in name)
    # silu' from the forward's tanh.approx helper, not expf and a division
    assert "taac_dsilu_scaled" in source and "expf" not in source
    _assert_no_bounds_guards(name, source)


def _assert_no_bounds_guards(name, source):
    """The kernels compile without TileLang's safe-memory pass (tilelang_common.Unchecked), whose guards compare
    packed row and timestamp indices with the tensors' extents."""
    for extent in ("< total", "< n_times"):
        assert extent not in source, f"{name}: a bounds guard '{extent}' (compiled with the safe-memory pass?)"
    assert "atomic" not in source.lower(), f"{name}: the backward adds nothing atomically (deterministic)"


def test_backward_entries_differ_per_kernel_and_flags():
    keys = {entry()[0] for entry in BACKWARD.values()}
    assert len(keys) == len(BACKWARD) == 9
    key, _ = kernels.backward_entry("dkdv", 32, torch.bfloat16, True, False, True, True, False)
    assert key[0] == "silu_attention_bwd_dkdv"
    with pytest.raises(KeyError):  # the bias sums are the dk/dv kernel's: no kernel of their own
        kernels.backward_entry("bias", 32, torch.bfloat16, True, False, True, True, False)


def test_tilelang_backend_declares_a_backward():
    from runtime.accelerators.silu_attention import SUPPORT

    assert SUPPORT["tilelang"].backward
    assert kernels.backward.__name__ == "backward"


def _kernel_parts(ds, times, causal, max_seqlen, n_time_buckets):
    """The dk/dv kernel's partial sums as dkdv_kernel's docstring lays them out, computed with torch from
    per-sequence score gradients ds [H, n, n]: per key block kb, slot s of its query-block loop (first block kb when
    causal, else 0) holds the distances (q0 - k0) + v - (B - 1), v < B, of the tile (q0, k0) and of the previous
    tile's upper half; per key block, the sums per time bucket."""
    from runtime.accelerators.silu_attention.reference import time_buckets

    b = kernels.BLOCK_N
    n_blocks = -(-max_seqlen // b)
    h = ds[0].shape[0]
    pos = torch.zeros(len(ds), h, n_blocks, n_blocks + 1, b, dtype=torch.float64)
    time = torch.zeros(len(ds), h, n_blocks, kernels.TIME_SLOTS, dtype=torch.float64)
    for s, (g, t_s) in enumerate(zip(ds, times)):
        n = g.shape[-1]
        bucket = time_buckets((t_s.view(-1, 1) - t_s.view(1, -1)).abs(), min(n_time_buckets, kernels.MAX_TIME_BUCKETS))
        i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
        for kb in range(-(-n // b)):
            first = kb if causal else 0
            rows, cols = slice(first * b, n), slice(kb * b, (kb + 1) * b)
            # distance i - j as slot * B + v: its offset from the lowest distance of the loop's first tile
            offset = (i - j)[rows, cols] - (first - kb) * b + (b - 1)
            tile = g[:, rows, cols].flatten(1)
            pos[s, :, kb].view(h, -1).index_add_(1, offset.flatten(), tile)
            time[s, :, kb].index_add_(1, bucket[rows, cols].flatten(), tile)
    return pos, time


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("p_len, t_len", [(50, 5), (300, 70)])
def test_bias_parts_fold_into_the_bias_gradients(causal, p_len, t_len):
    """The host half of the bias gradients: partial sums laid out as the dk/dv kernel writes them reduce to the
    gradients summed directly per position bucket and time bucket."""
    from runtime.accelerators.silu_attention.reference import time_buckets, visible_mask
    from runtime.accelerators.silu_attention.tilelang_backward import reduce_bias_parts

    h, lengths = 2, [0, 1, 37, 130, 64]
    torch.manual_seed(0)
    ds, times = [], []
    for n in lengths:
        ds.append(torch.randn(h, n, n, dtype=torch.float64) * visible_mask(n, causal, None, "cpu"))
        times.append(1_700_000_000 + (torch.randint(0, 5000, (n,)) * torch.randint(0, 2, (n,))).cumsum(0))
    pos_part, time_part = _kernel_parts(ds, times, causal, max(lengths), t_len)
    position_bias, time_bias = torch.zeros(h, p_len, dtype=torch.float64), torch.zeros(h, t_len, dtype=torch.float64)
    dpos, dtime = reduce_bias_parts(pos_part, time_part, causal, position_bias, time_bias)

    dpos_ref, dtime_ref = torch.zeros_like(position_bias), torch.zeros_like(time_bias)
    for g, t_s in zip(ds, times):
        n = g.shape[-1]
        i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
        dpos_ref.index_add_(1, (i - j).abs().clamp_max(p_len - 1).flatten(), g.flatten(1))
        bucket = time_buckets((t_s.view(-1, 1) - t_s.view(1, -1)).abs(), t_len)
        dtime_ref.index_add_(1, bucket.flatten(), g.flatten(1))
    torch.testing.assert_close(dpos, dpos_ref)
    torch.testing.assert_close(dtime, dtime_ref)


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    "causal, pos, time, lengths, dtype",
    [(True, True, True, [0, 1, 37, 200, 130, 64], torch.bfloat16), (False, True, True, [63, 200, 5], torch.float16)],
    ids=["causal-bf16", "full-f16"],
)
def test_bias_sums_run_on_the_cpu_and_match_float64(causal, pos, time, lengths, dtype):
    """The dk/dv kernel's bias-sum code (its macros, grid and query-block loop; ds tiles given, not computed) from
    the generated CUDA run on the CPU, reduced by the launcher's host half, against float64 sums; repeatable bit for
    bit. Sequences of several key blocks, empty ones, one of 64 tokens (no partial block)."""
    from conftest import tilelang_on_cpu

    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to run the generated kernels on the CPU")
    torch.manual_seed(0)
    assert tilelang_on_cpu().silu_bias_sums_problems(causal, pos, time, lengths, dtype) == []


def test_every_kernel_is_built_unchecked():
    from runtime.accelerators.tilelang_common import Unchecked, device_info

    for entry in [*FORWARD.values(), *BACKWARD.values()]:
        _, build = entry()
        assert isinstance(build(device_info(None)), Unchecked)


@requires_gxx
def test_time_bucket_helper_saturates_as_the_reference(tmp_path):
    """The kernels' CUDA time-bucket helper, built for the host: it subtracted int64 timestamps that may wrap past
    int64 (a bucket of -1 read outside the staged table); it saturates |dt| at 2^63 - 2 as the reference does."""
    from runtime.accelerators.silu_attention.reference import time_buckets, time_differences
    from runtime.accelerators.silu_attention.tilelang_scores import TIME_BUCKET_PRELUDE

    times = [-(2**63), 2**63 - 1, 0, -1, 1, 2**62, -(2**62) - 1, 2**63 - 2, -(2**63) + 1, 7, -9]
    pairs = [(a, b) for a in times for b in times]
    rows = ", ".join(f"{{{_c_int(a)}, {_c_int(b)}}}" for a, b in pairs)
    source = f"""#include <cstdio>
#include <initializer_list>
#define __device__
#define __forceinline__ inline
#define __clzll(x) __builtin_clzll(x)
{TIME_BUCKET_PRELUDE}
int main() {{
  const long long pairs[][2] = {{{rows}}};
  for (const auto& p : pairs) for (int t : {{5, 63}}) std::printf("%d\\n", taac_time_bucket(p[0], p[1], t));
}}
"""
    (tmp_path / "bucket.cpp").write_text(source)
    subprocess.run(["g++", "-O2", "-o", str(tmp_path / "bucket"), str(tmp_path / "bucket.cpp")], check=True)
    got = [
        int(line) for line in subprocess.run([str(tmp_path / "bucket")], capture_output=True, text=True).stdout.split()
    ]
    t = torch.tensor(pairs, dtype=torch.int64)
    dt = time_differences(t[:, 0], t[:, 1])
    expected = torch.stack([time_buckets(dt, 5), time_buckets(dt, 63)], 1).flatten().tolist()
    assert got == expected


def _c_int(value: int) -> str:
    return "(-9223372036854775807LL - 1)" if value == -(2**63) else f"{value}LL"
