"""embedding_bag_collection's Triton kernels on CUDA: output and every table's gradient against float64 (each dtype,
odd widths, padding, skewed rows whose segments cross chunks), CUDA-graph capture, repeatable gradients,
torch.compile, the device-side index check, and the tilelang fallback reason."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import capture_graph
from runtime.accelerators import embedding_bag_collection
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
DEVICE = "cuda"


def make(dtype, rows=(1000, 37, 5000), dims=(8, 37, 200), batch=129, max_len=9, skew=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = [
        torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE).requires_grad_()
        for n, d in zip(rows, dims)
    ]
    lengths = torch.randint(0, max_len + 1, (len(rows) * batch,), generator=gen)
    values = []
    for t, n in enumerate(rows):
        count = int(lengths[t * batch : (t + 1) * batch].sum())
        if skew:  # a few hot rows take most entries: their segments span many chunks
            ids = torch.where(torch.rand(count, generator=gen) < 0.8, torch.randint(0, 3, (count,), generator=gen),
                              torch.randint(0, n, (count,), generator=gen))  # fmt: skip
        else:
            ids = torch.randint(0, n, (count,), generator=gen)
        values.append(ids)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return weights, torch.cat(values).to(DEVICE), offsets.to(DEVICE)


def reference64(weights, values, offsets, padding_idx):
    weights64 = [w.detach().double().requires_grad_() for w in weights]
    out = embedding_bag_collection(weights64, values, offsets, padding_idx=padding_idx, backend="torch")
    return weights64, out


@pytest.mark.parametrize(
    "dtype,padding_idx,skew",
    [(f32, None, False), (bf16, 2, False), (f16, -1, False), (f32, 1, True)],
    ids=["f32", "bf16-pad", "f16-pad-last", "f32-skewed"],
)
def test_matches_float64(dtype, padding_idx, skew):
    weights, values, offsets = make(dtype, skew=skew)
    out = embedding_bag_collection(weights, values, offsets, padding_idx=padding_idx, backend="triton")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, weights, grad_out)
    weights64, out64 = reference64(weights, values, offsets, padding_idx)
    grads64 = torch.autograd.grad(out64, weights64, grad_out.double())
    assert_close("out", out, out64, RTOL[dtype])
    for t, (g, g64) in enumerate(zip(grads, grads64)):
        assert g.dtype == dtype and g.shape == weights[t].shape
        assert_close(f"grad[{t}]", g, g64, gradient_tolerance(dtype))


def test_int32_indices_and_many_tables():
    weights, values, offsets = make(bf16, rows=(300,) * 26, dims=(64,) * 26, batch=37, max_len=4)
    values, offsets = values.int(), offsets.int()
    out = embedding_bag_collection(weights, values, offsets, padding_idx=0, backend="triton")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, weights, grad_out)
    weights64, out64 = reference64(weights, values, offsets, 0)
    grads64 = torch.autograd.grad(out64, weights64, grad_out.double())
    assert_close("out", out, out64, RTOL[bf16])
    for g, g64 in zip(grads, grads64):
        assert_close("grad", g, g64, gradient_tolerance(bf16))


def test_repeatable_gradients():
    weights, values, offsets = make(f32, skew=True)
    out = embedding_bag_collection(weights, values, offsets, backend="triton")
    grad_out = torch.randn_like(out)
    first = torch.autograd.grad(out, weights, grad_out, retain_graph=True)
    second = torch.autograd.grad(out, weights, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_cuda_graph_replay():
    weights, values, offsets = make(bf16)
    static_values, static_offsets = values.clone(), offsets.clone()

    def step():
        out = embedding_bag_collection(
            weights, static_values, static_offsets, padding_idx=0, check_indices=False, backend="triton"
        )
        return (out, *torch.autograd.grad(out, weights, torch.ones_like(out)))

    graph, results = capture_graph(step)
    batch = (offsets.numel() - 1) // len(weights)
    bounds = offsets.tolist()
    for t, w in enumerate(weights):  # new rows for every entry, in the captured shapes
        lo, hi = bounds[t * batch], bounds[(t + 1) * batch]
        static_values[lo:hi] = torch.randint(0, w.shape[0], (hi - lo,), device=DEVICE)
    graph.replay()
    torch.cuda.synchronize()
    expect = step()
    for got, want in zip(results, expect):
        assert torch.equal(got, want)


def test_compile_breaks_around_the_kernels():
    weights, values, offsets = make(f32)

    def fn(values, offsets):
        return embedding_bag_collection(weights, values, offsets, padding_idx=0, backend="triton").square().sum()

    compiled = torch.compile(fn)
    loss = compiled(values, offsets)
    grads = torch.autograd.grad(loss, weights)
    loss_ref = fn(values, offsets)
    grads_ref = torch.autograd.grad(loss_ref, weights)
    assert_close("loss", loss, loss_ref, RTOL[f32])
    for g, g_ref in zip(grads, grads_ref):
        assert_close("grad", g, g_ref, RTOL[f32])


def test_device_side_index_check():
    """An entry past its own table's rows trips a device assert (no host sync); it ends the CUDA context: a subprocess."""
    script = textwrap.dedent("""
        import torch
        from runtime.accelerators import embedding_bag_collection
        weights = [torch.randn(10, 8, device="cuda"), torch.randn(4, 8, device="cuda")]
        values = torch.tensor([1, 2, 3, 4], device="cuda")  # 4 is outside table 1's rows
        offsets = torch.tensor([0, 1, 2, 3, 4], device="cuda")
        embedding_bag_collection(weights, values, offsets, backend="triton")
        torch.cuda.synchronize()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "embedding_bag_collection" in output and "device-side assert" in output, output[-2000:]


def test_auto_picks_triton_and_tilelang_has_a_reason():
    from runtime.accelerators.backends import BackendUnavailableError
    from runtime.accelerators.config import use_accelerators

    weights, values, offsets = make(bf16)
    auto = embedding_bag_collection(weights, values, offsets, backend="auto")
    assert torch.equal(auto, embedding_bag_collection(weights, values, offsets, backend="triton"))
    with (
        use_accelerators(fallback="error"),
        pytest.raises(BackendUnavailableError, match="no embedding_bag_collection kernel"),
    ):
        embedding_bag_collection(weights, values, offsets, backend="tilelang")
