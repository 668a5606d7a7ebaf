"""The vocabulary of backend selection: backend and op names, and AcceleratorConfig (which backend each op uses, and
what happens when it cannot run). Dispatch itself is backends.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

Backend = Literal["auto", "torch", "triton", "tilelang"]
BACKENDS: tuple[str, ...] = get_args(Backend)
KERNEL_BACKENDS: tuple[str, ...] = ("triton", "tilelang")
Fallback = Literal["torch", "error"]
FALLBACKS: tuple[str, ...] = get_args(Fallback)

OP_NAMES: tuple[str, ...] = (
    "rms_norm",
    "layer_norm",
    "l2norm",
    "flash_attention",
    "gated_delta_rule",
    "bce_with_logits",
    "swiglu",
    "dropout_add",
    "embedding_bag_mean",
    "mhc",
    "add_norm",
    "activation",
    "linear",
    "silu_attention",
    "sampling",
)


@dataclass(frozen=True)
class AcceleratorConfig:
    """default: the backend of every op not in `ops`; ops: per-op overrides; fallback: "torch" or "error";
    autotune: whether "auto" on CUDA decides by measuring the kernel backends (else by the static priority list;
    the environment variable TAAC_AUTOTUNE=0 turns it off too)."""

    default: Backend = "auto"
    ops: Mapping[str, Backend] = field(default_factory=dict)
    fallback: Fallback = "torch"
    autotune: bool = True

    def __post_init__(self) -> None:
        _check_backend("default", self.default)
        if not isinstance(self.ops, Mapping):
            raise TypeError(
                f"accelerators.ops: expected a mapping of op name -> backend, got {type(self.ops).__name__} {self.ops!r}"
            )
        for op, backend in self.ops.items():
            if op not in OP_NAMES:
                raise ValueError(f"accelerators.ops: unknown op {op!r}; expected one of {', '.join(OP_NAMES)}")
            _check_backend(f"ops.{op}", backend)
        if self.fallback not in FALLBACKS:
            raise ValueError(
                f"accelerators.fallback: unknown rule {self.fallback!r}; expected one of {', '.join(FALLBACKS)}"
            )
        if not isinstance(self.autotune, bool):
            raise TypeError(f"accelerators.autotune: expected true or false, got {self.autotune!r}")
        object.__setattr__(self, "ops", dict(self.ops))

    def backend_for(self, op: str) -> Backend:
        return self.ops.get(op, self.default)

    @classmethod
    def from_mapping(cls, values: Mapping) -> "AcceleratorConfig":
        """Build from a plain or OmegaConf mapping with the keys default, ops, fallback and autotune (ops entries may
        be null)."""
        if not isinstance(values, Mapping):
            raise TypeError(
                "accelerators: expected a mapping with the keys default, ops, fallback and autotune, got "
                f"{type(values).__name__}"
            )
        unknown = set(values) - {"default", "ops", "fallback", "autotune"}
        if unknown:
            raise ValueError(f"accelerators: unknown keys {sorted(unknown)}; expected default, ops, fallback, autotune")
        ops = values.get("ops") or {}
        if not isinstance(ops, Mapping):  # AcceleratorConfig's own check, before dict() reads a list as pairs
            raise TypeError(
                f"accelerators.ops: expected a mapping of op name -> backend, got {type(ops).__name__} {ops!r}"
            )
        ops = {op: backend for op, backend in ops.items() if backend is not None}
        return cls(
            default=values.get("default", "auto"),
            ops=ops,
            fallback=values.get("fallback", "torch"),
            autotune=values.get("autotune", True),
        )


def _check_backend(where: str, backend: object) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"accelerators.{where}: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


# A plain list, not a ContextVar: torch.compile traces reads of it (and guards on them), so a
# compiled model recompiles when the active config changes. [0] is the process-wide config,
# the rest are the enclosing `use_accelerators` blocks.
_stack: list[AcceleratorConfig] = [AcceleratorConfig()]


def active_config() -> AcceleratorConfig:
    """The config of the innermost `use_accelerators` block, else the process-wide one."""
    return _stack[-1]


def set_accelerators(config: AcceleratorConfig) -> None:
    """Set the process-wide config (what training scripts do once at start)."""
    if not isinstance(config, AcceleratorConfig):
        raise TypeError(f"config: expected an AcceleratorConfig, got {type(config).__name__}")
    _stack[0] = config


@contextlib.contextmanager
def use_accelerators(
    config: AcceleratorConfig | None = None,
    *,
    default: Backend | None = None,
    ops: Mapping[str, Backend] | None = None,
    fallback: Fallback | None = None,
    autotune: bool | None = None,
) -> Iterator[AcceleratorConfig]:
    """Run a block with another config: a full `config`, or keyword changes to the active one.

    >>> with use_accelerators(default="triton", ops={"flash_attention": "tilelang"}, fallback="error"):
    ...     model(batch)
    """
    if config is not None and not isinstance(config, AcceleratorConfig):
        raise TypeError(f"config: expected an AcceleratorConfig or None, got {type(config).__name__}")
    if ops is not None and not isinstance(ops, Mapping):
        raise TypeError(f"ops: expected a mapping of op name -> backend, got {type(ops).__name__} {ops!r}")
    base = config if config is not None else active_config()
    merged = AcceleratorConfig(
        default=default if default is not None else base.default,
        ops={**base.ops, **(ops or {})},
        fallback=fallback if fallback is not None else base.fallback,
        autotune=autotune if autotune is not None else base.autotune,
    )
    _stack.append(merged)
    try:
        yield merged
    finally:
        del _stack[max(i for i, c in enumerate(_stack) if c is merged)]
