"""linear's Hopper forward (the Triton persistent kernel) in its default launch and a few others, beside torch eager
(`F.linear`, then the activation), every activation, bf16, in one run; and GELU / SwiGLU forward + backward through
the op beside eager autograd. Writes the JSON that docs/benchmark/linear.md quotes.

    python tools/linear_launches.py --json docs/benchmark/results/linear-forward-activations.json   (GPU machine)
"""

import argparse
import functools
import json

import torch
import torch.nn.functional as F

import runtime.accelerators as acc
from runtime.accelerators.linear import triton_persistent
from runtime.accelerators.linear.launch import GemmConfig, persistent_forward_config
from runtime.benchmark.timing import gpu_time_ms

SHAPES = [(131072, 256, 1024), (131072, 512, 2048), (131072, 128, 512), (8192, 4096, 4096)]  # M, K, N (F for swiglu)
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu", "swiglu")
SAVING = ("gelu", "silu", "swiglu")  # also timed saving the pre-activation (the training forward)
# launches besides the default (gelu only, except the first): name -> config
OTHERS = {
    "1 program an SM, 4 stages": GemmConfig(128, 128, 64, 8, 4, 8),
    "2 programs an SM, 3 stages, whole epilogue": GemmConfig(128, 128, 64, 8, 3, 8, False, 2, 128),
    "2 programs an SM, 2 stages": GemmConfig(128, 128, 64, 8, 2, 8, True, 2, 128),
    "1 program an SM, 4 stages, epilogue in halves": GemmConfig(128, 128, 64, 8, 4, 8, True, 1, None),
}


def eager(x, w, b, activation):
    z = F.linear(x, w, b)
    if activation == "swiglu":
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation is None:
        return z
    return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[
        activation
    ](z)


def _triton_linear(x, w, b, activation):
    return acc.linear(x, w, b, activation, backend="triton")


def _backward(fn, x, w, b, activation, dy) -> None:
    fn(x, w, b, activation).backward(dy)


def micros(fn, device) -> float:
    return gpu_time_ms(fn, device)[0]["median"] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for m, k, n in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        for activation in ACTIVATIONS:
            swiglu = activation == "swiglu"
            w = torch.randn(2 * n if swiglu else n, k, device=device, dtype=torch.bfloat16) / k**0.5
            b = torch.randn(w.shape[0], device=device, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            z = torch.empty(m, w.shape[0], device=device, dtype=torch.bfloat16)
            expected = eager(x.float(), w.float(), b.float(), activation)
            eager_us = micros(functools.partial(eager, x, w, b, activation), device)
            launches = {"default": persistent_forward_config(m, n, k, swiglu)}
            if not swiglu:
                launches |= OTHERS if activation == "gelu" else dict(list(OTHERS.items())[:1])
            for name, cfg in launches.items():
                saving = (False, True) if activation in SAVING and name in list(launches)[:2] else (False,)
                for saved in saving:
                    out = z if saved else z[:0]
                    launch = functools.partial(triton_persistent.launch, x, w, b, y, out, activation, saved, cfg)
                    launch()
                    diff = (y.float() - expected).abs().max().item()
                    row = dict(shape=f"{m}x{k}x{n}", launch=name, activation=activation or "none", saves_preact=saved)
                    rows.append(row | dict(median_us=micros(launch, device), eager_us=eager_us, max_abs_diff=diff))
                    print(rows[-1], flush=True)
            if activation in ("gelu", "swiglu") and m == 131072 and k <= 512:
                xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
                dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
                ours = micros(functools.partial(_backward, _triton_linear, xg, wg, bg, activation, dy), device)
                theirs = micros(functools.partial(_backward, eager, xg, wg, bg, activation, dy), device)
                row = dict(shape=f"{m}x{k}x{n}", launch="forward + backward through the op", activation=activation)
                rows.append(row | dict(saves_preact=True, median_us=ours, eager_us=theirs, max_abs_diff=None))
                print(rows[-1], flush=True)
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
