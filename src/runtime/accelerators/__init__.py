"""The public functional API of taac-runtime's accelerators."""

from .backends import (
    BACKENDS,
    OP_NAMES,
    Backend,
    BackendFallbackWarning,
    BackendUnavailableError,
)
from .config import AcceleratorConfig, active_config, set_accelerators, use_accelerators
from .explain import explain
from .l2norm import l2norm
from .layer_norm import layer_norm
from .rms_norm import rms_norm

__all__ = [
    "BACKENDS",
    "OP_NAMES",
    "AcceleratorConfig",
    "Backend",
    "BackendFallbackWarning",
    "BackendUnavailableError",
    "active_config",
    "explain",
    "l2norm",
    "layer_norm",
    "rms_norm",
    "set_accelerators",
    "use_accelerators",
]
