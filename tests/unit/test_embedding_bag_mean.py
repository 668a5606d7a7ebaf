"""embedding_bag_mean on the CPU tier: the reference and the Triton kernels (interpreter) against a
float64 textbook loop, TileLang compiled for sm_90a, dispatch and every error message."""

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import runtime
import runtime.accelerators as acc
from conftest import SM90A, requires_nvcc
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.embedding_bag_mean import _check_inputs, embedding_bag_mean, radix_sort
from runtime.accelerators.embedding_bag_mean import triton as triton_kernels
from runtime.accelerators.embedding_bag_mean.reference import embedding_bag_mean_reference
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def bags_of(indices, offsets=None, include_last_offset=False) -> list[list[int]]:
    if indices.dim() == 2:
        return indices.tolist()
    ends = offsets.tolist()[1:] + ([] if include_last_offset else [indices.numel()])
    return [indices.tolist()[s:e] for s, e in zip(offsets.tolist(), ends)]


def mean_bags64(weight, indices, offsets=None, padding_idx=None, include_last_offset=False):
    """Textbook float64: each bag's mean over its non-padding rows, zeros for an empty bag."""
    w = weight.double()
    if padding_idx is not None:
        padding_idx %= w.shape[0]
    rows = []
    for bag in bags_of(indices, offsets, include_last_offset):
        kept = [i for i in bag if i != padding_idx]
        rows.append(torch.stack([w[i] for i in kept]).mean(0) if kept else w.new_zeros(w.shape[1]))
    return torch.stack(rows) if rows else w.new_zeros(0, w.shape[1])


def table(rows, dim, dtype=f32):
    return torch.randn(rows, dim, dtype=torch.float64).to(dtype).requires_grad_()


def check(backend, weight, indices, offsets=None, padding_idx=None, include_last_offset=False, sparse=False):
    """Output and weight gradient (dense or sparse) of one backend against float64."""
    with poison_outputs():
        out = embedding_bag_mean(
            weight,
            indices,
            offsets,
            padding_idx,
            include_last_offset=include_last_offset,
            sparse=sparse,
            backend=backend,
        )
        grad_out = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, weight, grad_out)
    compare(backend, weight, indices, offsets, padding_idx, include_last_offset, sparse, out, grad, grad_out)


def run_triton(
    weight, indices, offsets=None, padding_idx=None, include_last_offset=False, sparse=False, check_indices=True,
    forward=triton_kernels.FORWARD, gradient=triton_kernels.GRADIENT,
):  # fmt: skip
    """(out, weight gradient, its incoming gradient) from the Triton module's functions, launched as `forward` and
    `gradient`."""
    padding = _check_inputs(weight, indices, offsets, padding_idx, include_last_offset, sparse, check_indices)
    args = (weight.detach(), indices, offsets, -1 if padding is None else padding, include_last_offset)
    with poison_outputs():
        out, scale, bag_of = triton_kernels.forward(*args, check_indices, launch=forward)
        grad_out = torch.randn_like(out)
        if sparse:
            grad = triton_kernels.backward_sparse(grad_out, *args, check_indices, None, scale, bag_of, launch=gradient)[
                0
            ]
        else:
            grad = triton_kernels.backward(grad_out, *args, check_indices, out, scale, bag_of, launch=gradient)[0]
    return out, grad, grad_out


def check_triton(weight, indices, offsets=None, padding_idx=None, include_last_offset=False, sparse=False, **launches):
    """check's comparisons for the Triton module's functions, launched as `launches` (run_triton's)."""
    out, grad, grad_out = run_triton(weight, indices, offsets, padding_idx, include_last_offset, sparse, **launches)
    compare("triton", weight, indices, offsets, padding_idx, include_last_offset, sparse, out, grad, grad_out)


def compare(backend, weight, indices, offsets, padding_idx, include_last_offset, sparse, out, grad, grad_out):
    """Output and weight gradient against float64."""
    weight64 = weight.detach().double().requires_grad_()
    out64 = mean_bags64(weight64, indices, offsets, padding_idx, include_last_offset)
    (grad64,) = torch.autograd.grad(out64, weight64, grad_out.double())
    assert out.dtype == weight.dtype and grad.dtype == weight.dtype
    assert grad.is_sparse == sparse
    if sparse:
        assert grad.is_coalesced() or backend == "torch"  # the kernels coalesce; torch's is not
        if padding_idx is not None:
            assert (grad._indices() != padding_idx % weight.shape[0]).all(), "the padding row is in the sparse gradient"
        grad = grad.to_dense()
    assert_close("out", out, out64, RTOL[weight.dtype])
    assert_close("grad weight", grad, grad64, gradient_tolerance(weight.dtype))


def hot_indices(n, rows, hot, copies, dtype=torch.int64):
    """n random indices of which `copies` are the row `hot`, shuffled: a segment that spans chunks."""
    indices = torch.randint(0, rows, (n,), dtype=dtype)
    indices[torch.randperm(n)[:copies]] = hot
    return indices


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("padding_idx", [None, 3, -2], ids=["nopad", "pad3", "pad-2"])
def test_reference_2d(padding_idx, sparse):
    indices = torch.randint(0, 9, (7, 5))
    indices[0] = 3  # an all-padding bag with pad3
    check("torch", table(9, 37), indices, padding_idx=padding_idx, sparse=sparse)


@pytest.mark.parametrize("include_last_offset", [False, True], ids=["offsets", "last_offset"])
def test_reference_offsets_with_empty_bags_and_int32(include_last_offset):
    indices = torch.randint(0, 20, (30,), dtype=torch.int32)
    offsets = torch.tensor([0, 0, 4, 4, 17, 29] + ([30] if include_last_offset else []), dtype=torch.int32)
    check("torch", table(20, 16), indices, offsets, padding_idx=5, include_last_offset=include_last_offset)


def test_reference_matches_torch_embedding_bag():
    weight, indices = torch.randn(11, 6), torch.randint(0, 11, (4, 3))
    torch.testing.assert_close(
        embedding_bag_mean_reference(weight, indices, None, 2),
        F.embedding_bag(indices, weight, mode="mean", padding_idx=2),
    )


# --------------------------------------------------------------------------- triton (interpreter)


@pytest.mark.parametrize(
    "sparse, radix",
    [(False, True), (False, False), (True, True)],
    ids=["dense", "dense-torch-sort-filled-first", "sparse"],
)
@pytest.mark.slow
def test_triton_2d_padding_and_a_hot_row_across_chunks(sparse, radix):
    """The dense gradient zero-filled in the radix sort's launches (by fill programs of 32 elements here, many a
    pass) or, where the radix sort does not fit (torch.sort), before the sort; poisoned buffers: a row left unfilled
    fails."""
    small_fills = radix_sort.RadixLaunch(
        zero_block=16, zero_steps=2, max_counts=radix_sort.RADIX.max_counts if radix else 0
    )
    indices = hot_indices(20 * 5, 50, hot=7, copies=70).reshape(20, 5)  # 100 entries = 4 chunks of 32
    indices[3] = 11  # an all-padding bag
    gradient = triton_kernels.GradientLaunch(radix=small_fills)
    check_triton(table(50, 37), indices, padding_idx=11, sparse=sparse, gradient=gradient)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.slow
def test_triton_offsets_empty_bags_int32_repeats(sparse):
    indices = hot_indices(75, 40, hot=2, copies=40, dtype=torch.int32)
    offsets = torch.tensor([0, 3, 3, 40, 41, 41, 75], dtype=torch.int32)
    check("triton", table(40, 20), indices, offsets, padding_idx=-1, include_last_offset=True, sparse=sparse)


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "f16"])
@pytest.mark.slow
def test_triton_half_precision(dtype):
    check("triton", table(30, 24, dtype), torch.randint(0, 30, (6, 4)), padding_idx=0)


def test_triton_batch_one_and_no_padding():
    check("triton", table(8, 3), torch.tensor([[1, 1, 5]]))


@pytest.mark.parametrize(
    "indices, offsets",
    [
        (torch.zeros(0, 4, dtype=torch.int64), None),
        (torch.zeros(3, 0, dtype=torch.int64), None),
        (torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
    ],
    ids=["no-bags", "empty-bags-2d", "no-entries"],
)
def test_triton_empty_inputs(indices, offsets):
    weight = table(5, 4)
    out = embedding_bag_mean(weight, indices, offsets, backend="triton")
    assert out.shape == (indices.shape[0] if offsets is None else 3, 4) and (out == 0).all()
    (grad,) = torch.autograd.grad(out.sum(), weight)
    assert (grad == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton", "tilelang"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_zero_embedding_dim_gives_empty_bags(backend, sparse):
    weight = torch.randn(5, 0, requires_grad=True)
    cases = [
        (torch.tensor([[0, 1], [2, 4], [3, 3]]), None, False, 3),
        (torch.tensor([0, 1, 2, 4]), torch.tensor([0, 1, 4]), True, 2),
    ]
    # the tilelang backend does not run on the CPU: it falls back, the other two must run
    with acc.use_accelerators(fallback="torch" if backend == "tilelang" else "error"), warnings.catch_warnings():
        warnings.simplefilter("ignore", acc.BackendFallbackWarning)
        for indices, offsets, last, bags in cases:
            out = embedding_bag_mean(weight, indices, offsets, include_last_offset=last, sparse=sparse, backend=backend)
            assert out.shape == (bags, 0) and out.dtype == weight.dtype
            (grad,) = torch.autograd.grad(out.sum(), weight)
            assert grad.shape == (5, 0) and grad.is_sparse == sparse
        with pytest.raises(IndexError, match="indices: 5"):
            embedding_bag_mean(weight, torch.tensor([[0, 5]]), sparse=sparse, backend=backend)


TRITON_LAUNCHES = {
    "8-bags-2-warps": triton_kernels.ForwardLaunch(block_b=8, num_warps=2),
    "64-bags-8-warps": triton_kernels.ForwardLaunch(block_b=64, num_warps=8),
}


@pytest.mark.parametrize("launch", list(TRITON_LAUNCHES.values()), ids=list(TRITON_LAUNCHES))
@pytest.mark.parametrize(
    "bag_len", [3, 20], ids=["bag3", "bag20"]
)  # one step of BLOCK_L 4; three of BLOCK_L 8, the last partial
@pytest.mark.slow
def test_triton_forward_block_sizes(launch, bag_len):
    """Other forward launches than the default (triton.FORWARD, as the sweep sets it), on odd bags: padding, an all-padding bag."""
    indices = torch.randint(0, 40, (13, bag_len))
    indices[4] = 6  # an all-padding bag
    check_triton(table(40, 37), indices, padding_idx=6, forward=launch)
    with pytest.raises(IndexError, match="outside"):
        run_triton(torch.randn(9, 4), torch.tensor([[1, 2, 3], [4, 9, 5]]), forward=launch)
    flat = torch.randint(0, 40, (30,))
    check_triton(table(40, 16), flat, torch.tensor([0, 4, 4, 29]), padding_idx=1, forward=launch)


@pytest.mark.slow
def test_triton_forward_device_assert_compiles_for_sm90(tmp_path):
    """The CUDA index check (CHECK_ASSERT, debug=True) compiled for sm_90, at the default launch and the test's
    others: exactly one assert, ours.

    debug=True also makes Triton check int32 arithmetic for overflow (one assert each): the kernel avoids that."""
    from test_triton_compile_sm90 import LaunchRecorder

    recorder = LaunchRecorder()
    weight, indices = torch.randn(1000, 64).to(bf16), torch.randint(0, 1000, (256,))
    out, scale = torch.empty(64, 64, dtype=bf16), torch.empty(64)
    launches = [triton_kernels.ForwardLaunch(), *TRITON_LAUNCHES.values()]
    for launch in launches:
        kernel = triton_kernels._forward_kernel.kernel  # the InterpretedFunction: its run() is what records
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(kernel), "run", lambda k, *a, **kw: recorder.run(k, *a, **kw, debug=True))  # as on a GPU
            cfg = triton_kernels.forward_config(64, 4, launch)
            kernel[(4, 1)](
                weight, indices, indices, out, scale, torch.empty(0, dtype=torch.int32), scale,
                64, 256, 0, 1000, 64, 4, 64, 0,
                FIXED=True, CHECK=triton_kernels.CHECK_ASSERT, BLOCK_T=256, **cfg,
            )  # fmt: skip
    recorded = [{k: v for k, v in launch.items() if k != "case"} for launch in recorder.launches.values()]
    assert len(recorded) == len(launches) and all(launch["options"]["debug"] for launch in recorded)
    (tmp_path / "launches.pkl").write_bytes(pickle.dumps(recorded))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [os.environ.get("TAAC_SM90_TRITON", ""), str(Path(runtime.__file__).parents[1])]  # as the sm_90 tier
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths + [env.get("PYTHONPATH", "")] if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-c", COUNT_ASSERTS, str(tmp_path / "launches.pkl")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = [int(line) for line in done.stdout.split()]
    assert counts == [1] * len(launches), f"__assertfail call sites per launch: {counts}"


COUNT_ASSERTS = """
import importlib, pickle, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for launch in pickle.load(open(sys.argv[1], "rb")):
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"]).kernel
    source = ASTSource(kernel, launch["signature"], launch["constexprs"], launch["attrs"])
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"]).asm["ptx"]
    print(ptx.count("call.uni __assertfail"))
"""


# --------------------------------------------------------------------------- tilelang (compile only)


@requires_nvcc
@pytest.mark.slow
def test_tilelang_kernels_compile_for_sm90a():
    tilelang = pytest.importorskip("tilelang")
    from runtime.accelerators.embedding_bag_mean import tilelang as kernels

    programs = [
        kernels.forward_program(37, "bfloat16", "int32", "int64"),  # odd width: padded columns
        kernels.forward_program(
            64, "bfloat16", "int64", "int64", kernels.ForwardLaunch(block_b=8, block_l=4, threads=64)
        ),
        kernels.chunk_program(64, "float16", "int32"),
        kernels.combine_program(128, "float32", "int32"),
    ]
    for program in programs:
        source = tilelang.compile(program, target=SM90A).get_kernel_source()
        assert "__global__" in source
    assert "device_assert" in tilelang.compile(programs[0], target=SM90A).get_kernel_source()


# --------------------------------------------------------------------------- errors and dispatch


BAD_INPUTS = [
    (torch.tensor([[1, 9]]), None, r"indices: 9 \(flat position 1\) is outside \[0, num_embeddings=9\)"),
    (torch.tensor([[1, 2], [3, -1]]), None, r"indices: -1 \(flat position 3\) is outside"),
    (
        torch.tensor([1, 2, 3]),
        torch.tensor([1, 2]),
        r"offsets: expected to start at 0 and rise to len\(indices\)=3, got \[1, 2\]",
    ),
    (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]), r"offsets: expected .* got \[0, 2, 1\]"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "indices, offsets, message",
    BAD_INPUTS,
    ids=["index too large", "negative index", "offsets[0] != 0", "decreasing offsets"],
)
def test_bad_indices_or_offsets_raise_naming_the_argument(backend, indices, offsets, message):
    with pytest.raises(IndexError, match=message):
        embedding_bag_mean(torch.randn(9, 4), indices, offsets, backend=backend)


def test_last_offset_must_end_the_indices():
    with pytest.raises(
        IndexError,
        match=r"offsets: expected to start at 0 and rise to len\(indices\)=3 at the last offset \(include_last_offset=True\), got \[0, 2\]",
    ):
        embedding_bag_mean(
            torch.randn(9, 4), torch.tensor([1, 2, 3]), torch.tensor([0, 2]), include_last_offset=True, backend="triton"
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "indices, offsets, message",
    [
        (torch.tensor([1, 2, 3]), torch.tensor([0]), r"rise to len\(indices\)=3 at the last offset .* got \[0\]"),
        (torch.tensor([], dtype=torch.int64), torch.tensor([2]), r"rise to len\(indices\)=0 at the last offset"),
        (torch.tensor([99]), torch.tensor([0]), r"indices: 99 \(flat position 0\) is outside"),
    ],
    ids=["indices past the last offset", "last offset past the indices", "index out of range"],
)
def test_one_offset_with_include_last_offset_is_no_bag_and_still_checked(backend, indices, offsets, message):
    """include_last_offset=True with one offset makes no bag: the kernels launch nothing, yet the offsets must end
    at len(indices) and every index must be in range, as on the torch backend."""
    with pytest.raises(IndexError, match=message):
        embedding_bag_mean(torch.randn(9, 4), indices, offsets, include_last_offset=True, backend=backend)


def test_unchecked_bad_indices_stay_in_bounds():
    out = embedding_bag_mean(torch.randn(9, 4), torch.tensor([[1, 90, -5]]), check_indices=False, backend="triton")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(weight=torch.randn(9)), ValueError, r"weight: expected a 2-D \[num_embeddings, embedding_dim\]"),
        (dict(weight=torch.ones(9, 4, dtype=torch.int64)), TypeError, "weight: expected a floating-point tensor"),
        (dict(indices=torch.ones(2, 2)), TypeError, "indices: expected an int32 or int64 tensor, got torch.float32"),
        (dict(indices=[1, 2]), TypeError, "indices: expected a torch.Tensor"),
        (dict(indices=torch.ones(1, 2, 2, dtype=torch.int64)), ValueError, "indices: expected a 2-D"),
        (dict(indices=torch.ones(4, dtype=torch.int64)), ValueError, "offsets: required when indices is 1-D"),
        (dict(offsets=torch.tensor([0])), ValueError, "offsets: must be None when indices is 2-D"),
        (
            dict(indices=torch.ones(4, dtype=torch.int64), offsets=torch.ones(1, 1, dtype=torch.int64)),
            ValueError,
            "offsets: expected a 1-D",
        ),
        (
            dict(indices=torch.ones(4, dtype=torch.int64), offsets=torch.tensor([0.0])),
            TypeError,
            "offsets: expected an int32 or int64",
        ),
        (
            dict(
                indices=torch.ones(4, dtype=torch.int64),
                offsets=torch.zeros(0, dtype=torch.int64),
                include_last_offset=True,
            ),
            ValueError,
            "offsets: include_last_offset=True needs at least one offset",
        ),
        (
            dict(padding_idx=9),
            ValueError,
            r"padding_idx: expected None or an int in \[-9, 9\) \(num_embeddings\), got int 9",
        ),
        (dict(padding_idx=1.0), TypeError, r"padding_idx: expected None or an int in \[-9, 9\) .*, got float 1.0"),
        (dict(sparse=1), TypeError, "sparse: expected a bool"),
        (dict(check_indices=None), TypeError, "check_indices: expected a bool"),
    ],
)
def test_argument_errors_name_the_argument(kwargs, error, message):
    args = dict(weight=torch.randn(9, 4), indices=torch.ones(2, 2, dtype=torch.int64), offsets=None)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        embedding_bag_mean(**args)


def test_strided_weight_is_a_reason_and_falls_back():
    weight = torch.randn(4, 9).t()  # column stride 9
    with pytest.warns(
        acc.BackendFallbackWarning,
        match="embedding_bag_mean: the triton backend cannot run these inputs: weight has a column stride other than 1",
    ):
        out = embedding_bag_mean(weight, torch.tensor([[1, 2]]), backend="triton")
    torch.testing.assert_close(out, F.embedding_bag(torch.tensor([[1, 2]]), weight, mode="mean"))
    with (
        acc.use_accelerators(fallback="error"),
        pytest.raises(acc.BackendUnavailableError, match="tilelang.*tensors are on cpu"),
    ):
        embedding_bag_mean(torch.randn(9, 4), torch.tensor([[1, 2]]), backend="tilelang")


def test_tilelang_width_limit_is_a_reason():
    from runtime.accelerators.embedding_bag_mean import SPEC, TILELANG_MAX_DIM

    (reason,) = SPEC.reasons("tilelang", weight=torch.randn(3, TILELANG_MAX_DIM + 32))
    assert f"embedding dim {TILELANG_MAX_DIM + 32} exceeds {TILELANG_MAX_DIM}" in reason
    assert SPEC.reasons("tilelang", weight=torch.randn(3, TILELANG_MAX_DIM)) == []
    assert SPEC.reasons("triton", weight=torch.randn(3, TILELANG_MAX_DIM + 32)) == []


def test_float64_weight_runs_the_reference_under_auto():
    weight = torch.randn(9, 4, dtype=torch.float64)
    torch.testing.assert_close(
        embedding_bag_mean(weight, torch.tensor([[1, 2]])), F.embedding_bag(torch.tensor([[1, 2]]), weight, mode="mean")
    )
