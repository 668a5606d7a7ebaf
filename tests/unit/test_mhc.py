"""mHC: the reference against float64 math, the Triton kernels under the interpreter, errors."""

import shutil

import pytest
import torch

from runtime.accelerators.mhc import mhc_post, mhc_pre
from runtime.accelerators.testing import assert_close


def make_inputs(n, C, lead, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(dtype).requires_grad_()

    return {
        "x": randn(*lead, n, C),
        "phi": randn(n * C, m, scale=(n * C) ** -0.5),
        "alpha": (torch.tensor([0.8, 1.1, 1.3]) + 0.1 * torch.randn(3, generator=generator)).to(dtype).requires_grad_(),
        "bias": randn(m, scale=0.3),
        "y": randn(*lead, C),
    }


def extreme_inputs(n, C, lead, alpha_res, low_row=False, dtype=torch.float32, seed=0):
    """Inputs whose res logits spread past exp's fp32 range (alpha_res ~ 1e3: thousands; low_row: the first row of
    logits 300 below the rest) and are exact in fp32 and bf16: streams of +-1 (rstd 1 with eps = 0), phi and bias
    in multiples of 1/64, so that v @ phi, alpha * h and the logits round nowhere. Float64 then sees the logits the
    kernels see: at alpha 1e4 a rounding of 1e-7 in h would move a logit by 1e-3, near a tie the gradients as much.
    Use with eps = 0."""
    generator = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    bias = torch.round(16 * torch.randn(m, generator=generator)) / 64
    if low_row:
        bias[2 * n : 3 * n] -= 300
    values = {
        "x": (2 * torch.randint(0, 2, (*lead, n, C), generator=generator) - 1).float(),
        "phi": torch.round(64 * torch.randn(n * C, m, generator=generator) / (n * C) ** 0.5) / 64,
        "alpha": torch.tensor([0.75, 1.25, alpha_res]),
        "bias": bias,
        "y": torch.randn(*lead, C, generator=generator),
    }
    return {name: value.to(dtype).requires_grad_() for name, value in values.items()}


def pre_block_post(inputs, backend, eps=1e-6):
    """pre, a stand-in block (h_in * y), post: every output and every gradient path is used."""
    x, phi, alpha, bias = (inputs[k] for k in ("x", "phi", "alpha", "bias"))
    h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, eps, backend=backend)
    return h_in, h_post, h_res, mhc_post(inputs["x"], h_in * inputs["y"], h_post, h_res, backend=backend)


def check_against_float64(inputs, backend, rtol, eps=1e-6):
    doubled = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    outs, refs = pre_block_post(inputs, backend, eps), pre_block_post(doubled, "torch", eps)
    for name, out, ref in zip(("h_in", "H_post", "H_res", "x_next"), outs, refs):
        assert_close(name, out, ref, rtol)
    grads_out = [torch.randn_like(r) for r in refs]
    grads = torch.autograd.grad(outs, list(inputs.values()), [g.to(o.dtype) for g, o in zip(grads_out, outs)])
    ref_grads = torch.autograd.grad(refs, list(doubled.values()), grads_out)
    for name, grad, ref in zip(inputs, grads, ref_grads):
        assert grad.dtype == inputs[name].dtype
        assert_close(f"d{name}", grad, ref, 2 * rtol)


def test_reference_matches_the_definition_in_float64():
    inputs = {k: v.detach().double() for k, v in make_inputs(4, 24, (3,)).items()}
    x, phi, alpha, bias = inputs["x"], inputs["phi"], inputs["alpha"], inputs["bias"]
    bias[8:12] -= 300  # the first row of H_res's logits (the log-domain Sinkhorn equals the textbook one)
    h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, backend="torch")
    for t in range(3):
        v = x[t].flatten()
        h = (v @ phi) / torch.sqrt((v * v).mean() + 1e-6)
        pre = 1 / (1 + torch.exp(-(alpha[0] * h[:4] + bias[:4])))
        post = 2 / (1 + torch.exp(-(alpha[1] * h[4:8] + bias[4:8])))
        matrix = torch.exp(alpha[2] * h[8:] + bias[8:]).view(4, 4)
        assert matrix[0].max() < 1e-100  # far below fp32's range, inside float64's
        for _ in range(20):
            matrix = matrix / matrix.sum(1, keepdim=True)
            matrix = matrix / matrix.sum(0, keepdim=True)
        torch.testing.assert_close(h_in[t], (pre[:, None] * x[t]).sum(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h_post[t], post, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h_res[t], matrix, rtol=1e-12, atol=1e-12)
    y = torch.randn(3, 24, dtype=torch.float64)
    expected = torch.stack([h_res[t] @ x[t] + h_post[t][:, None] * y[t] for t in range(3)])
    torch.testing.assert_close(mhc_post(x, y, h_post, h_res, backend="torch"), expected)
    torch.testing.assert_close(
        mhc_post(x, y, H_post=h_post, H_res=h_res, backend="torch"), expected
    )  # DESIGN.md's names


@pytest.mark.parametrize("n", [2, 4, 8])
def test_h_res_is_doubly_stochastic(n):
    # gates as mHC initialises them (small alpha): 20 Sinkhorn rounds converge to 1e-3. Near-permutation
    # logits (alpha ~ 1 with these inputs) converge more slowly: rows then miss by up to ~2e-3.
    inputs = {k: v.detach() for k, v in make_inputs(n, 64, (50,), seed=n).items()}
    alpha = torch.full((3,), 0.1)
    _, _, matrix = mhc_pre(inputs["x"], inputs["phi"], alpha, inputs["bias"], sinkhorn_iters=20, backend="torch")
    assert (matrix.sum(-1) - 1).abs().max() < 1e-3 and (matrix.sum(-2) - 1).abs().max() < 1e-3
    assert (matrix >= 0).all()


@pytest.mark.parametrize(
    "n, C, lead", [(4, 40, (3,)), (2, 24, (2, 3)), (8, 16, (5,))], ids=["n4-C40", "n2-C24-2d", "n8-C16"]
)
def test_triton_matches_float64_reference(n, C, lead):
    check_against_float64(make_inputs(n, C, lead), "triton", 1e-4)


def test_torch_backend_under_autocast_computes_in_the_inputs_dtype():
    """autocast does not lower the op's float32 math, as it does not the kernels' (v @ phi and H_res @ x ran in
    bfloat16: errors of 1e-3 in the outputs and gradients)."""
    inputs = make_inputs(4, 40, (3,))
    doubled = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = pre_block_post(inputs, "torch")
    refs = pre_block_post(doubled, "torch")
    for name, out, ref in zip(("h_in", "H_post", "H_res", "x_next"), outs, refs):
        assert out.dtype == torch.float32
        assert_close(name, out, ref, 1e-5)
    grads = torch.autograd.grad(
        outs, list(inputs.values()), [torch.ones_like(o) for o in outs]
    )  # backward: no autocast
    ref_grads = torch.autograd.grad(refs, list(doubled.values()), [torch.ones_like(r) for r in refs])
    for name, grad, ref in zip(inputs, grads, ref_grads):
        assert_close(f"d{name}", grad, ref, 2e-5)


@pytest.mark.parametrize("programs, shares", [(40, (4, 3)), (1024, (10, 1))], ids=["uneven-shares", "a-block-a-share"])
@pytest.mark.slow
def test_triton_backward_over_token_shares(programs, shares):
    """300 tokens: several programs of every backward kernel, partial last blocks, C = 72 (whole and partial C
    blocks); the dx kernel's 10 token blocks in shares of 3, 3, 3 and 1 (dphi adds four partial sums) or one each."""
    from runtime.accelerators.mhc import triton as kernels

    launch = kernels.PreBackwardLaunch(dx_programs=programs)
    assert kernels.dx_splits(300, 4, 72, launch) == shares
    inputs = make_inputs(4, 72, (3, 100), seed=1)
    names = ("x", "phi", "alpha", "bias")
    args = (*[inputs[k].detach() for k in names], 1e-6, 20)  # mhc_pre's default eps and sinkhorn_iters
    results = kernels.pre_forward(*args)
    doubled = [inputs[k].detach().double().requires_grad_() for k in names]
    refs = mhc_pre(*doubled, backend="torch")
    for name, out, ref in zip(("h_in", "H_post", "H_res"), results, refs):
        assert_close(name, out, ref, 1e-4)
    grads_out = [torch.randn_like(r) for r in refs]
    incoming = [g.to(o.dtype) for g, o in zip(grads_out, results)]
    grads = kernels.pre_backward(*incoming, *args, *results, launch=launch)[:4]
    ref_grads = torch.autograd.grad(refs, doubled, grads_out)
    for name, grad, ref in zip(names, grads, ref_grads):
        assert grad.dtype == inputs[name].dtype
        assert_close(f"d{name}", grad, ref, 2e-4)


def test_triton_under_torch_compile():
    """The kernels run as custom ops, whose outputs may not alias one another: dalpha and dbias (fp32) are
    slices of one sum in the kernel modules."""
    inputs = make_inputs(4, 8, (2, 3))
    compiled = torch.compile(lambda inputs: pre_block_post(inputs, "triton"), backend="aot_eager", fullgraph=True)
    outs, eager = compiled(inputs), pre_block_post(inputs, "triton")
    grads = torch.autograd.grad([o.sum() for o in outs], list(inputs.values()))
    eager_grads = torch.autograd.grad([o.sum() for o in eager], list(inputs.values()))
    for name, out, expected in zip(
        ("h_in", "H_post", "H_res", "x_next", *inputs), (*outs, *grads), (*eager, *eager_grads)
    ):
        assert_close(name, out, expected, 1e-5)


def test_errors_name_the_argument():
    inputs = make_inputs(4, 8, (2,))
    x, phi, alpha, bias, y = (inputs[k].detach() for k in ("x", "phi", "alpha", "bias", "y"))
    with pytest.raises(ValueError, match=r"phi: expected shape \(32, 24\), got \(32, 20\)"):
        mhc_pre(x, phi[:, :20], alpha, bias)
    with pytest.raises(ValueError, match=r"alpha: expected shape \(3,\)"):
        mhc_pre(x, phi, alpha[:2], bias)
    with pytest.raises(ValueError, match=r"bias: expected shape \(24,\)"):
        mhc_pre(x, phi, alpha, bias[:5])
    with pytest.raises(ValueError, match="sinkhorn_iters: expected an integer >= 1, got 0"):
        mhc_pre(x, phi, alpha, bias, sinkhorn_iters=0)
    with pytest.raises(TypeError, match="sinkhorn_iters: expected an integer >= 1, got bool True"):
        mhc_pre(x, phi, alpha, bias, sinkhorn_iters=True)
    with pytest.raises(ValueError, match="x: expected at least 2 dimension"):
        mhc_pre(x[0, 0], phi, alpha, bias)
    h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, backend="torch")
    with pytest.raises(ValueError, match=r"H_post: expected shape \(2, 4\), got \(2, 2\)"):
        mhc_post(x, y, h_post[:, :2], h_res)
    with pytest.raises(ValueError, match=r"H_res: expected shape \(2, 4, 4\)"):
        mhc_post(x, y, h_post, h_res[:, :2, :2])
    with pytest.raises(ValueError, match=r"y: expected shape \(2, 8\)"):
        mhc_post(x, y[:, :4], h_post, h_res)
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        mhc_post(x.long(), y, h_post, h_res)


@pytest.mark.slow
def test_tilelang_kernels_compile_for_sm90a():
    from conftest import NVCC, SM90A

    if NVCC is None:
        pytest.skip("nvcc is not on PATH: TileLang kernels cannot be compiled here")
    tilelang = pytest.importorskip("tilelang")
    from runtime.accelerators.mhc import tilelang as kernels

    builders = [
        kernels.pre_forward_kernel("bfloat16", "float32", 4, 200),
        kernels.pre_backward_kernel("bfloat16", "float32", 4, 200),
        kernels.dphi_kernel("bfloat16", "float32", 4, 200, 3),
        kernels.post_forward_kernel("bfloat16", 4, 200),
        kernels.post_backward_kernel("bfloat16", 4, 200),
    ]
    compiled = tilelang.par_compile(builders, target=SM90A)
    for kernel in compiled:
        assert "__global__" in kernel.get_kernel_source()
    # token blocks run on grid x: gridDim.y stops at 65535 blocks, 1M tokens (batch 576 x 2048 is more)
    post_forward = compiled[3].get_kernel_source()
    assert (
        f"blockIdx.y) * {kernels.BLOCK_TOKENS})" not in post_forward
        and f"blockIdx.x) * {kernels.BLOCK_TOKENS})" in post_forward
    )


def test_reference_sinkhorn_restores_rows_and_columns_that_underflow_exp():
    # logits spread by more than exp's fp32 range: exp(logits) is the rank-one exp(-200 i) exp(-200 j), which one
    # round scales to 1/2 everywhere; in fp32 its second row and column would underflow to zero
    from runtime.accelerators.mhc.reference import sinkhorn

    logits = torch.tensor([[[0.0, -200.0], [-200.0, -400.0]]])
    assert torch.equal(sinkhorn(logits, 20), torch.full((1, 2, 2), 0.5))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_stay_finite_when_logits_spread_past_exp_range(backend):
    # alpha 1e3 on ordinary inputs: logits thousands apart, whole rows and columns of exp(logits) zero in fp32
    torch.manual_seed(0)
    n, C = 4, 64
    x = torch.randn(8, n, C, requires_grad=True)
    phi = (torch.randn(n * C, n * n + 2 * n) * 0.5).requires_grad_()
    alpha = torch.tensor([1.0, 1.0, 1000.0], requires_grad=True)
    bias = torch.zeros(n * n + 2 * n, requires_grad=True)
    h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, backend=backend)
    assert torch.allclose(h_res.sum(-2), torch.ones(8, n))
    (h_in.sum() + h_post.sum() + (h_res * torch.randn_like(h_res)).sum()).backward()
    for name, value in (("x", x), ("phi", phi), ("alpha", alpha), ("bias", bias)):
        assert torch.isfinite(value.grad).all(), f"d{name} is not finite"


EXTREME = [(1e3, False), (1e4, False), (1.0, True)]
EXTREME_IDS = ["alpha1e3", "alpha1e4", "low-row"]


@pytest.mark.parametrize("alpha_res, low_row", EXTREME, ids=EXTREME_IDS)
def test_reference_at_extreme_logits_matches_float64(alpha_res, low_row):
    check_against_float64(extreme_inputs(4, 40, (3, 5), alpha_res, low_row), "torch", 1e-4, eps=0.0)


@pytest.mark.parametrize(
    "n, C, lead, alpha_res, low_row",
    [(4, 40, (3,), *case) for case in EXTREME] + [(3, 24, (5,), 1e4, False), (8, 16, (5,), 1.0, True)],
    ids=[f"n4-{name}" for name in EXTREME_IDS] + ["n3-alpha1e4", "n8-low-row"],
)
def test_triton_at_extreme_logits_matches_float64(n, C, lead, alpha_res, low_row):
    check_against_float64(extreme_inputs(n, C, lead, alpha_res, low_row), "triton", 1e-4, eps=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("alpha_res, low_row", EXTREME, ids=EXTREME_IDS)
def test_tilelang_at_extreme_logits_runs_on_the_cpu_and_matches_float64(alpha_res, low_row):
    """mhc_pre's forward, backward and dphi kernels from their generated CUDA run on the CPU (tools/tilelang_on_cpu.py);
    n = 3: 32 tokens a block, 40 tokens (a partial second block). (conftest imported here: the GPU tier imports this
    module beside its own conftest.)"""
    from conftest import NVCC, tilelang_on_cpu

    if NVCC is None or shutil.which("g++") is None:
        pytest.skip("nvcc and g++ are needed to run the generated kernels on the CPU")
    pytest.importorskip("tilelang")
    inputs = extreme_inputs(3, 24, (40,), alpha_res, low_row)
    x, phi, alpha, bias = (inputs[k].detach() for k in ("x", "phi", "alpha", "bias"))
    assert tilelang_on_cpu().mhc_pre_problems(x, phi, alpha, bias, eps=0.0) == []
