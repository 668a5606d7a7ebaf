"""embedding_bag_mean's kernel backends on CUDA: outputs and weight gradients (dense and sparse)
against float64, CUDA-graph capture, determinism, torch.compile, the device-side index check and the Triton
forward's block sizes that the sweep compares."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from runtime.accelerators.embedding_bag_mean import embedding_bag_mean, radix_sort, segments
from runtime.accelerators.embedding_bag_mean import triton as triton_kernels
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
BACKENDS = ["triton", "tilelang"]
# dtype -> embedding width: odd and padded widths ride along with the dtypes
DTYPES = {"f32": (f32, 37), "bf16": (bf16, 64), "f16": (f16, 200)}
PAD = 3
# widths whose TileLang gradient combine pass runs on a wider power-of-two tile (multiples of 32, no power of two)
PADDED_COMBINE = {"bf16-96": (bf16, 96), "f16-160": (f16, 160)}


@pytest.fixture(scope="module", autouse=True)
def _compile_tilelang_kernels():
    """Compile the TileLang specialisations these tests use in parallel, up front."""
    if not torch.cuda.is_available():
        return
    from runtime.accelerators.embedding_bag_mean import tilelang as kernels

    specs = [(dim, dtype, torch.int64, torch.int64) for dtype, dim in DTYPES.values()]
    specs += [
        (64, bf16, torch.int32, torch.int32),
        (64, bf16, torch.int32, torch.int64),
        (16, f32, torch.int64, torch.int64),
    ]
    specs += [(dim, dtype, torch.int64, torch.int64) for dtype, dim in PADDED_COMBINE.values()]
    kernels.precompile(specs, torch.device("cuda"))


def sample(n: int, rows: int, dist: str) -> torch.Tensor:
    """Uniform rows, or Zipf(1.1) ranks over a random permutation of the rows (a few very hot rows)."""
    if dist == "uniform":
        return torch.randint(0, rows, (n,), device="cuda")
    probs = torch.arange(1, rows + 1, device="cuda", dtype=torch.float64).pow(-1.1)
    return torch.randperm(rows, device="cuda")[torch.multinomial(probs, n, replacement=True)]


def make_bags(layout: str, num_bags: int, rows: int, dist: str, padding: bool, bag_len: int = 5):
    """(indices, offsets, bag id of every entry); ragged bags have 0..9 entries, some empty."""
    if layout == "2d":
        lengths = torch.full((num_bags,), bag_len, device="cuda")
    else:
        lengths = torch.randint(0, 10, (num_bags,), device="cuda")
        lengths[::7] = 0
    flat = sample(int(lengths.sum()), rows, dist)
    if padding:
        flat[torch.rand(flat.shape, device="cuda") < 0.25] = PAD
        if layout == "2d":
            flat[:bag_len] = PAD  # one all-padding bag
    bag_ids = torch.repeat_interleave(torch.arange(num_bags, device="cuda"), lengths)
    if layout == "2d":
        return flat.reshape(num_bags, bag_len), None, bag_ids
    offsets = torch.cumsum(lengths, 0) - lengths
    return flat, offsets, bag_ids


def mean_bags64(weight64, flat, bag_ids, num_bags, padding_idx):
    keep = flat != padding_idx if padding_idx is not None else torch.ones_like(flat, dtype=torch.bool)
    sums = weight64.new_zeros(num_bags, weight64.shape[1]).index_add(0, bag_ids[keep], weight64[flat[keep]])
    counts = weight64.new_zeros(num_bags).index_add(0, bag_ids[keep], weight64.new_ones(int(keep.sum())))
    return sums / counts.clamp(min=1)[:, None]


def triton_out_and_grad(weight, indices, offsets, pad, include_last_offset, sparse, grad_out=None, **launches):
    """(out, weight gradient, its incoming gradient) from the Triton module's functions, launched as `launches`
    (forward: a triton.ForwardLaunch, gradient: a triton.GradientLaunch); pad: the padding row or None."""
    args = (weight.detach(), indices, offsets, -1 if pad is None else pad, include_last_offset)
    out, scale, bag_of = triton_kernels.forward(*args, True, launch=launches.get("forward", triton_kernels.FORWARD))
    grad_out = torch.randn_like(out) if grad_out is None else grad_out
    gradient = launches.get("gradient", triton_kernels.GRADIENT)
    if sparse:
        grad = triton_kernels.backward_sparse(grad_out, *args, True, None, scale, bag_of, launch=gradient)[0]
    else:
        grad = triton_kernels.backward(grad_out, *args, True, out, scale, bag_of, launch=gradient)[0]
    return out, grad, grad_out


def check(backend, weight, indices, offsets, bag_ids, padding_idx, include_last_offset=False, tag="", **launches):
    """Output, dense gradient and sparse gradient against float64; `launches`: the Triton module's functions run
    with them (triton_out_and_grad) instead of the op."""
    num_bags = indices.shape[0] if offsets is None else offsets.numel() - include_last_offset
    pad = None if padding_idx is None else padding_idx % weight.shape[0]
    grads, grad_out = {}, None
    for sparse in (False, True):
        if launches:
            given = grad_out if sparse else None
            out, grads[sparse], grad_out = triton_out_and_grad(
                weight, indices, offsets, pad, include_last_offset, sparse, given, **launches
            )
            continue
        out = embedding_bag_mean(
            weight,
            indices,
            offsets,
            padding_idx,
            include_last_offset=include_last_offset,
            sparse=sparse,
            backend=backend,
        )
        if not sparse:
            grad_out = torch.randn_like(out)
        (grads[sparse],) = torch.autograd.grad(out, weight, grad_out)
    weight64 = weight.detach().double().requires_grad_()
    flat = indices.reshape(-1).long()
    out64 = mean_bags64(weight64, flat, bag_ids, num_bags, pad)
    (grad64,) = torch.autograd.grad(out64, weight64, grad_out.double())

    dtype = weight.dtype
    assert out.dtype == dtype and out.shape == out64.shape
    assert_close(f"{tag} out", out, out64, RTOL[dtype])
    assert not grads[False].is_sparse and grads[False].dtype == dtype
    assert_close(f"{tag} dense grad", grads[False], grad64, gradient_tolerance(dtype))
    sparse_grad = grads[True]
    assert sparse_grad.is_sparse and sparse_grad.is_coalesced() and sparse_grad.dtype == dtype
    rows = sparse_grad.indices()[0]
    expected_rows = torch.unique(flat[flat != pad] if pad is not None else flat)
    assert torch.equal(rows, expected_rows), (
        f"{tag}: the sparse gradient's rows are not the distinct non-padding indices"
    )
    assert_close(f"{tag} sparse grad", sparse_grad.to_dense(), grad64, gradient_tolerance(dtype))


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("padding", [True, False], ids=["pad", "nopad"])
@pytest.mark.parametrize("layout", ["2d", "offsets"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_and_gradients(backend, dtype_name, layout, padding, dist):
    dtype, dim = DTYPES[dtype_name]
    # Zipf runs enough entries that the hottest rows span many chunks of the gradient's first pass
    num_bags, rows = (1500, 4000) if dist == "zipf" else (63, 1000)
    weight = torch.randn(rows, dim, device="cuda").to(dtype).requires_grad_()
    indices, offsets, bag_ids = make_bags(layout, num_bags, rows, dist, padding)
    check(
        backend,
        weight,
        indices,
        offsets,
        bag_ids,
        PAD if padding else None,
        tag=f"{backend} {dtype_name} {layout} {dist}",
    )


@pytest.mark.parametrize("layout", ["2d", "offsets"])
@pytest.mark.parametrize("case", list(PADDED_COMBINE))
@pytest.mark.parametrize("backend", BACKENDS)
def test_widths_with_a_padded_combine_tile(backend, case, layout):
    """Zipf bags: the hottest rows' segments span many chunks, so the combine pass writes their gradient rows."""
    dtype, dim = PADDED_COMBINE[case]
    weight = torch.randn(4000, dim, device="cuda").to(dtype).requires_grad_()
    indices, offsets, bag_ids = make_bags(layout, 1500, 4000, "zipf", padding=True)
    check(backend, weight, indices, offsets, bag_ids, PAD, tag=f"{backend} {case} {layout}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_indices_and_include_last_offset(backend):
    weight = torch.randn(500, 64, device="cuda").to(bf16).requires_grad_()
    flat, offsets, bag_ids = make_bags("offsets", 37, 500, "zipf", padding=True)
    ends = torch.cat([offsets, offsets.new_tensor([flat.numel()])])
    check(
        backend, weight, flat.int(), ends.int(), bag_ids, -497, include_last_offset=True, tag=f"{backend} int32 last"
    )  # -497 is row 3
    check(backend, weight, flat.int(), offsets, bag_ids, PAD, tag=f"{backend} int32 indices, int64 offsets")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_zero_embedding_dim_gives_empty_bags(backend, sparse):
    weight = torch.randn(50, 0, device="cuda", requires_grad=True)
    for indices, offsets, bags in [
        (torch.tensor([[7, 7, 3], [1, 2, 3]], device="cuda"), None, 2),
        (torch.tensor([4, 5, 6], device="cuda"), torch.tensor([0, 1, 1], device="cuda"), 3),
    ]:
        out = embedding_bag_mean(weight, indices, offsets, sparse=sparse, backend=backend)
        assert out.shape == (bags, 0) and out.device == weight.device
        (grad,) = torch.autograd.grad(out, weight, torch.randn_like(out))
        assert grad.shape == (50, 0) and grad.is_sparse == sparse


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_one_and_empty_inputs(backend):
    weight = torch.randn(50, 16, device="cuda", requires_grad=True)
    indices = torch.tensor([[7, 7, 3, 9]], device="cuda")
    check(
        backend, weight, indices, None, torch.zeros(4, dtype=torch.long, device="cuda"), PAD, tag=f"{backend} batch 1"
    )
    for indices, offsets, bags in [
        (torch.zeros(0, 4, dtype=torch.long, device="cuda"), None, 0),
        (torch.zeros(5, 0, dtype=torch.long, device="cuda"), None, 5),
        (torch.zeros(0, dtype=torch.long, device="cuda"), torch.zeros(3, dtype=torch.long, device="cuda"), 3),
    ]:
        out = embedding_bag_mean(weight, indices, offsets, backend=backend)
        assert out.shape == (bags, 16) and (out == 0).all()
        (grad,) = torch.autograd.grad(out, weight, torch.randn_like(out))
        assert (grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_gradient_on_hot_rows(backend):
    weight = torch.randn(4000, 64, device="cuda").to(bf16).requires_grad_()
    indices, _, _ = make_bags("2d", 4000, 4000, "zipf", padding=True, bag_len=8)
    out = embedding_bag_mean(weight, indices, padding_idx=PAD, backend=backend)
    grad_out = torch.randn_like(out)
    first = torch.autograd.grad(out, weight, grad_out, retain_graph=True)[0]
    second = torch.autograd.grad(out, weight, grad_out)[0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_capture_in_a_cuda_graph(backend):
    """Captured, then replayed with new indices."""
    weight = torch.randn(1000, 64, device="cuda").to(f16).requires_grad_()
    indices, _, _ = make_bags("2d", 200, 1000, "zipf", padding=True)
    grad_out = torch.randn(200, 64, device="cuda", dtype=f16)

    def step():
        out = embedding_bag_mean(weight, indices, padding_idx=PAD, backend=backend)
        return out, torch.autograd.grad(out, weight, grad_out)[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grad = step()
    new_indices, _, bag_ids = make_bags("2d", 200, 1000, "zipf", padding=True)
    indices.copy_(new_indices)
    graph.replay()
    torch.cuda.synchronize()
    weight64 = weight.detach().double().requires_grad_()
    out64 = mean_bags64(weight64, indices.reshape(-1), bag_ids, 200, PAD)
    (grad64,) = torch.autograd.grad(out64, weight64, grad_out.double())
    assert_close(f"{backend} graph out", out, out64, RTOL[f16])
    assert_close(f"{backend} graph grad", grad, grad64, gradient_tolerance(f16))


# --------------------------------------------------------------------------- the Triton radix sort


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("layout", ["2d", "offsets"])
def test_triton_radix_sort_gradients(layout, dist, index_dtype):
    """Dense and sparse gradients with the radix sort behind them (1000 rows: one 10-bit pass; 4000: two 6-bit passes)."""
    num_bags, rows = (1500, 4000) if dist == "zipf" else (63, 1000)
    weight = torch.randn(rows, 64, device="cuda").to(bf16).requires_grad_()
    indices, offsets, bag_ids = make_bags(layout, num_bags, rows, dist, padding=True)
    indices = indices.to(index_dtype)
    # the permutation's dtype tells the sorts apart (neither gives `first` since ddd7623): int32 from the radix sort
    perm = triton_kernels.sort_for_gradient(indices.reshape(-1), rows).perm
    assert perm.dtype == torch.int32, "the radix sort did not run"
    check("triton", weight, indices, offsets, bag_ids, PAD, tag=f"triton radix {layout} {dist} {index_dtype}")


RADIX_LAUNCHES = {  # launches a sweep compared, and 4-bit digits: five passes over 1M rows
    "default": radix_sort.RadixLaunch(),
    "1024-8w": radix_sort.RadixLaunch(num_warps=8),
    "512-4w": radix_sort.RadixLaunch(tile=512),
    "2048-8w": radix_sort.RadixLaunch(tile=2048, num_warps=8),
    "7bit": radix_sort.RadixLaunch(digit_bits=7),
    "4bit-256": radix_sort.RadixLaunch(digit_bits=4, tile=256),
}


@pytest.mark.parametrize("launch", list(RADIX_LAUNCHES.values()), ids=list(RADIX_LAUNCHES))
def test_radix_sort_equals_stable_torch_sort(launch):
    """Keys and permutation equal to the torch path's at the sweep's sizes (32768 and 65536 keys over 1M rows), Zipf
    (long runs of equal keys) and uniform, int32 and int64; out-of-range keys as the sentinel num_embeddings."""
    rows = 1_000_000
    for num_keys, dist, dtype in (
        (32768, "zipf", torch.int64),
        (65536, "uniform", torch.int32),
        (5000, "uniform", torch.int64),
    ):
        flat = sample(num_keys, rows, dist).to(dtype)
        if num_keys == 5000:
            flat[::9] = torch.tensor([-1, rows, 2**31 - 1], device="cuda", dtype=dtype).repeat(1000)[
                : flat[::9].numel()
            ]
        keys, perm = radix_sort.sort(flat, rows, launch)
        mapped = torch.where((flat >= 0) & (flat < rows), flat, rows).to(torch.int32)
        expected = torch.sort(mapped, stable=True)
        assert torch.equal(keys, expected.values) and torch.equal(perm.long(), expected.indices), (
            f"{num_keys} {dist} {dtype}"
        )
        if num_keys != 5000:
            assert torch.equal(keys, segments.sort_segments(flat, rows).keys)


def test_radix_sort_backward_captures_in_a_cuda_graph():
    """The radix sort has no host sync: captured, then replayed with new indices."""
    test_forward_and_backward_capture_in_a_cuda_graph("triton")


def test_radix_and_torch_sorts_give_the_same_gradient_bits():
    weight = torch.randn(4000, 64, device="cuda").to(bf16).requires_grad_()
    indices, _, _ = make_bags("2d", 4000, 4000, "zipf", padding=True, bag_len=8)
    grads = {}
    for sort, launch in (("torch", radix_sort.RadixLaunch(max_counts=0)), ("radix", radix_sort.RadixLaunch())):
        gradient = triton_kernels.GradientLaunch(radix=launch)  # max_counts=0: the radix sort never fits, torch.sort
        ones = torch.ones(indices.shape[0], 64, device="cuda", dtype=bf16)
        _, grads[sort], _ = triton_out_and_grad(
            weight, indices, None, PAD % 4000, False, False, ones, gradient=gradient
        )
    assert torch.equal(grads["torch"], grads["radix"])


TRITON_LAUNCHES = {
    "16-bags-4-warps": triton_kernels.ForwardLaunch(block_b=16),
    "8-bags-2-warps": triton_kernels.ForwardLaunch(block_b=8, num_warps=2),
    "64-bags-8-warps": triton_kernels.ForwardLaunch(block_b=64, num_warps=8),
}


@pytest.mark.parametrize("launch", list(TRITON_LAUNCHES.values()), ids=list(TRITON_LAUNCHES))
def test_triton_forward_block_sizes(launch):
    """The forward launches a sweep compared (triton.FORWARD), fixed bags of 3 and 20."""
    weight = torch.randn(4000, 64, device="cuda").to(bf16).requires_grad_()
    for bag_len in (3, 20):
        indices, offsets, bag_ids = make_bags("2d", 300, 4000, "zipf", padding=True, bag_len=bag_len)
        check("triton", weight, indices, offsets, bag_ids, PAD, tag=f"triton {launch} bag {bag_len}", forward=launch)


def test_torch_compile_runs_the_kernels_as_custom_ops():
    weight = torch.randn(300, 64, device="cuda", requires_grad=True)
    flat, offsets, bag_ids = make_bags("offsets", 40, 300, "uniform", padding=True)

    def loss(w):
        return (embedding_bag_mean(w, flat, offsets, PAD, backend="triton") ** 2).sum()

    (compiled_grad,) = torch.autograd.grad(torch.compile(loss)(weight), weight)
    (eager_grad,) = torch.autograd.grad(loss(weight), weight)
    assert_close("compiled grad", compiled_grad, eager_grad, 1e-5)


BAD_INDEX_SCRIPT = textwrap.dedent(
    """
    import torch
    from runtime.accelerators.embedding_bag_mean import embedding_bag_mean
    weight = torch.randn(10, 16, device="cuda")
    out = embedding_bag_mean(weight, torch.tensor([[1, 10]], device="cuda"), backend="{backend}")
    torch.cuda.synchronize()
    print("NO ERROR")
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_index_is_a_device_side_assert(backend):
    """Checked in the forward kernel without a sync; a device assert ends the CUDA context, hence a subprocess."""
    script = BAD_INDEX_SCRIPT.format(backend=backend)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "NO ERROR" not in output, output[-2000:]
    assert "outside [0, num_embeddings)" in output and "device-side assert" in output, output[-2000:]
