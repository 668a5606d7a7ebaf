"""python -m runtime.accelerators: print which backend each op takes on this machine and why, with the library
versions, the GPU, and the decisions "auto" measured on it (python -m runtime.accelerators --help)."""

import argparse

import torch

from .backends import REGISTRY
from .explain import explain


def _op(name: str) -> str:
    if name not in REGISTRY:
        raise argparse.ArgumentTypeError(f"unknown op {name!r}; expected one of {', '.join(sorted(REGISTRY))}")
    return name


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("CUDA is not available here; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"no {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.accelerators", description=__doc__.splitlines()[0])
    parser.add_argument("--op", type=_op, default=None, help="only this op (a config key, such as rms_norm)")
    parser.add_argument(
        "--device",
        type=_device,
        default=None,
        help="the device to explain for (default: the current CUDA device, else cpu)",
    )
    args = parser.parse_args(argv)
    print(explain(args.op, device=args.device))


if __name__ == "__main__":
    main()
