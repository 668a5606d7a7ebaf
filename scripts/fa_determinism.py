"""Do flash_attention's gradients repeat bit for bit? Each backend's backward runs several times on the same inputs;
the table counts the elements of dq, dk and dv that differ from the first run (GPU machine, repo root):

    bash .device/gpu python scripts/fa_determinism.py

Why it matters: under torch.use_deterministic_algorithms a differentiated call does not take a backend whose backward
is not deterministic (KernelSupport.deterministic_backward in runtime.accelerators.flash_attention).
"""

import torch

from runtime.accelerators.flash_attention import flash_attention

RUNS = 5
SHAPES = [(4, 16, 2048, 128, False), (4, 16, 2048, 128, True), (16, 16, 1024, 64, False), (64, 4, 2048, 48, False)]


def differing(backend: str, b: int, h: int, length: int, d: int, causal: bool) -> list[int]:
    """Per gradient (dq, dk, dv): the most elements any later run changed against the first."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def grads():
        return torch.autograd.grad(flash_attention(q, k, v, causal=causal, backend=backend), (q, k, v), do)

    first = grads()
    worst = [0, 0, 0]
    for _ in range(RUNS - 1):
        for i, (a, g) in enumerate(zip(first, grads())):
            worst[i] = max(worst[i], int((a != g).sum()))
    return worst


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, bf16; elements that differ from the first of {RUNS} runs (dq / dk / dv)")
    for b, h, length, d, causal in SHAPES:
        name = f"{b}x{h}x{length}x{d}" + (" causal" if causal else "")
        row = [f"{backend} {'/'.join(map(str, differing(backend, b, h, length, d, causal)))}" for backend in ("triton", "tilelang")]
        print(f"{name:22s} of {b * h * length * d:>9d}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
