"""python -m runtime.accelerators: print which backend each op takes on this machine and why, with the library
versions, the GPU, and the decisions "auto" measured on it (python -m runtime.accelerators --help)."""

import argparse

from .explain import explain


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.accelerators", description=__doc__.splitlines()[0])
    parser.add_argument("--op", default=None, help="only this op (a config key, such as rms_norm)")
    parser.add_argument(
        "--device", default=None, help="the device to explain for (default: the current CUDA device, else cpu)"
    )
    args = parser.parse_args(argv)
    print(explain(args.op, device=args.device))


if __name__ == "__main__":
    main()
