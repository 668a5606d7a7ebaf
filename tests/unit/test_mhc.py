"""mHC: the reference against float64 math, the Triton kernels under the interpreter, errors."""

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


def pre_block_post(inputs, backend):
    """pre, a stand-in block (h_in * y), post: every output and every gradient path is used."""
    h_in, h_post, h_res = mhc_pre(inputs["x"], inputs["phi"], inputs["alpha"], inputs["bias"], backend=backend)
    return h_in, h_post, h_res, mhc_post(inputs["x"], h_in * inputs["y"], h_post, h_res, backend=backend)


def check_against_float64(inputs, backend, rtol):
    doubled = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    outs, refs = pre_block_post(inputs, backend), pre_block_post(doubled, "torch")
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
    h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, backend="torch")
    for t in range(3):
        v = x[t].flatten()
        h = (v @ phi) / torch.sqrt((v * v).mean() + 1e-6)
        pre = 1 / (1 + torch.exp(-(alpha[0] * h[:4] + bias[:4])))
        post = 2 / (1 + torch.exp(-(alpha[1] * h[4:8] + bias[4:8])))
        matrix = torch.exp(alpha[2] * h[8:] + bias[8:]).view(4, 4)
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


def test_reference_sinkhorn_keeps_an_underflowed_row_zero_as_the_kernels_do():
    # logits spread by more than exp's range: the second row and column underflow to zero. The kernels divide by
    # max(sum, 1e-30) and keep them zero; the reference divided by the zero sum and gave NaN for the whole matrix
    from runtime.accelerators.mhc.reference import sinkhorn

    logits = torch.tensor([[[0.0, -200.0], [-200.0, -400.0]]])
    out = sinkhorn(logits, 20)
    assert torch.equal(out, torch.tensor([[[1.0, 0.0], [0.0, 0.0]]]))
    torch.manual_seed(3)
    x, phi, alpha, bias = torch.randn(3, 2, 8), torch.randn(16, 8), torch.tensor([80.0, 110.0, 130.0]), torch.randn(8)
    _, _, h_res = mhc_pre(x, phi, alpha, bias, backend="torch")
    assert torch.isfinite(h_res).all()
