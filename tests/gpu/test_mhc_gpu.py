"""mHC on the GPU: both kernel backends against float64, outputs and every gradient (pre, a block, post)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_mhc import check_against_float64, extreme_inputs, make_inputs  # noqa: E402

BOUND = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
CASES = [  # (n, C, leading dims, dtype): every n, odd widths, fp32 and bf16, several leading dims
    (4, 1280, (2, 500), torch.bfloat16),
    (2, 200, (37,), torch.float32),
    (8, 64, (3, 7), torch.bfloat16),
    (4, 1000, (1,), torch.float32),
    (8, 96, (300,), torch.float32),
    # odd n: the TileLang pre kernels take 32 tokens per block there; several blocks, a partial last one
    (3, 96, (2, 45), torch.bfloat16),
    (5, 200, (77,), torch.float32),
    (5, 96, (3, 30), torch.bfloat16),
    (7, 40, (70,), torch.bfloat16),
    (1, 64, (33,), torch.float32),
]
EXTREME_CASES = [  # (n, C, leading dims, dtype, alpha_res, low_row): res logits spread past exp's fp32 range
    (4, 1280, (2, 300), torch.bfloat16, 1e3, False),
    (4, 200, (77,), torch.float32, 1e4, False),
    (3, 96, (45,), torch.float32, 1.0, True),
    (8, 64, (3, 7), torch.bfloat16, 1e4, True),
]


@pytest.fixture(scope="module", autouse=True)
def _compile_tilelang_kernels():
    """The TileLang kernels of these cases (five per case: n and C are static), compiled in parallel up front."""
    if not torch.cuda.is_available():
        return
    try:
        from runtime.accelerators.mhc import tilelang as kernels
        from runtime.accelerators.tilelang_common import precompile
    except ImportError:  # no tilelang: those cases fall back or skip on their own
        return
    device = torch.device("cuda", torch.cuda.current_device())
    entries = []
    for n, C, _, dtype, *_ in CASES + EXTREME_CASES:
        x = torch.empty(1, n, C, dtype=dtype, device=device)
        phi = torch.empty(n * C, n * n + 2 * n, dtype=dtype, device=device)
        splits = kernels._token_splits(device, n, C)
        entries += [kernels.pre_entry(x, phi), kernels.pre_backward_entry(x, phi), kernels.dphi_entry(x, phi, splits)]
        entries += [kernels.post_entry(x), kernels.post_backward_entry(x)]
    precompile(entries, device)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize(
    "n, C, lead, dtype", CASES, ids=[f"n{n}-C{c}-{'x'.join(map(str, l))}-{str(d)[6:]}" for n, c, l, d in CASES]
)
def test_mhc_matches_float64(backend, n, C, lead, dtype):
    inputs = {k: v.detach().cuda().requires_grad_() for k, v in make_inputs(n, C, lead, dtype, seed=C).items()}
    check_against_float64(inputs, backend, BOUND[dtype])


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize(
    "n, C, lead, dtype, alpha_res, low_row",
    EXTREME_CASES,
    ids=[f"n{c[0]}-C{c[1]}-{str(c[3])[6:]}-{'low-row' if c[5] else f'alpha{c[4]:g}'}" for c in EXTREME_CASES],
)
def test_mhc_at_extreme_logits_matches_float64(backend, n, C, lead, dtype, alpha_res, low_row):
    """Logits thousands apart, or a row of them 300 below the rest: exact in fp32 and bf16 (see extreme_inputs), so
    float64 sees the logits the kernels see."""
    inputs = extreme_inputs(n, C, lead, alpha_res, low_row, dtype, seed=C)
    inputs = {k: v.detach().cuda().requires_grad_() for k, v in inputs.items()}
    check_against_float64(inputs, backend, BOUND[dtype], eps=0.0)
