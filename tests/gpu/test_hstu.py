"""HSTUBlock on CUDA: the triton backend against the torch backend in float64 (output and every gradient), and a few
training steps of model=hstu on jagged batches with every op on a kernel backend (no fallback)."""

import copy
import math
import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir

from runtime.accelerators import BackendFallbackWarning, use_accelerators
from runtime.nn import HSTUBlock
from runtime.training import Trainer, config_dir
from runtime.training.distributed import Run

BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _rel(out: torch.Tensor, ref: torch.Tensor, name: str) -> float:
    assert torch.isfinite(out).all(), name
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    print(f"{name}: relative RMS {err:.2e}, max abs {(out.double() - ref.double()).abs().max().item():.2e}")
    return err


def _packed(lengths: list[int], d_model: int, device):
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    timestamps = torch.cat([torch.randint(1, 100_000, (n,), device=device).cumsum(0) for n in lengths]) + 1_700_000_000
    num_targets = torch.tensor([min(1, n) for n in lengths], dtype=torch.int32, device=device)
    return torch.randn(total, d_model, device=device), cu, timestamps, num_targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 48])
def test_hstu_block_triton_matches_torch_float64(dtype, head_dim):
    lengths = [37, 1, 200, 63, 0, 129]
    x, cu, timestamps, num_targets = _packed(lengths, 96, "cuda")
    block = HSTUBlock(96, 3, head_dim, position_buckets=100, time_buckets=31, dropout=0.0, device="cuda")
    with torch.no_grad():
        for norm in (block.input_norm, block.output_norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_(std=0.1)
    reference = copy.deepcopy(block).double()
    reference.backend = "torch"
    grad = torch.randn_like(x, dtype=torch.float64)

    x_ref = x.double().requires_grad_(True)
    with use_accelerators(default="torch"):
        ref = reference(x_ref, cu, max(lengths), timestamps, num_targets)
    (ref * grad).sum().backward()

    kernel = block.to(dtype)
    kernel.backend = "triton"
    x_in = x.to(dtype).requires_grad_(True)
    # the linear kernels take bf16/fp16 only: in fp32 only silu_attention runs on a kernel, in bf16 every op does
    default = "triton" if dtype == torch.bfloat16 else "torch"
    with use_accelerators(default=default, fallback="error"):
        out = kernel(x_in, cu, max(lengths), timestamps, num_targets)
    (out.double() * grad).sum().backward()

    bound = BOUNDS[dtype]
    assert _rel(out, ref, "out") < bound
    assert _rel(x_in.grad, x_ref.grad, "dx") < 2 * bound
    for (name, p), (_, p_ref) in zip(kernel.named_parameters(), reference.named_parameters()):
        assert _rel(p.grad, p_ref.grad, f"d{name}") < 2 * bound, name


def test_hstu_trains_on_cuda_with_kernel_backends(tmp_path):
    overrides = [
        "model=hstu", "accelerators=triton", "trainer.device=cuda", "trainer.progress=false",
        "trainer.steps=30", "data.batch_size=128", "data.seq_len=256", "data.val_size=1024", "optim.warmup_steps=4",
        "optim.lr=3e-3",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    trainer = Trainer(cfg, tmp_path, Run(torch.device("cuda", torch.cuda.current_device())))
    assert trainer.data.jagged and trainer.graphed_step is None  # packed batches change shape: never graphed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BackendFallbackWarning)
        before = trainer.evaluate()
        losses = [trainer.train_step(trainer.data.train_batch(i, 128).to("cuda"))[0] for i in range(30)]
        losses = torch.stack(losses).float().cpu().tolist()
        after = trainer.evaluate()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]
    assert not [m for m in fallbacks if "silu_attention" in m], fallbacks  # the HSTU layers ran on the triton kernels
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10, losses
    assert after["val_logloss"] < before["val_logloss"], (before, after)
