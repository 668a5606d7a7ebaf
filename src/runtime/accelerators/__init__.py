"""The public functional API of taac-runtime's accelerators."""

from .backends import (
    BACKENDS,
    OP_NAMES,
    Backend,
    BackendFallbackWarning,
    BackendUnavailableError,
)
from .bce import binary_cross_entropy_with_logits
from .config import AcceleratorConfig, active_config, set_accelerators, use_accelerators
from .dropout_add import dropout_add
from .embedding_bag import embedding_bag_mean
from .explain import explain
from .flash_attention import flash_attention
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .l2norm import l2norm
from .layer_norm import layer_norm
from .mhc import mhc_post, mhc_pre
from .rms_norm import rms_norm
from .swiglu import swiglu
from .silu_attention import silu_attention

__all__ = [
    "BACKENDS",
    "OP_NAMES",
    "AcceleratorConfig",
    "Backend",
    "BackendFallbackWarning",
    "BackendUnavailableError",
    "active_config",
    "binary_cross_entropy_with_logits",
    "chunk_gated_delta_rule",
    "dropout_add",
    "embedding_bag_mean",
    "explain",
    "flash_attention",
    "fused_recurrent_gated_delta_rule",
    "l2norm",
    "layer_norm",
    "mhc_post",
    "mhc_pre",
    "rms_norm",
    "set_accelerators",
    "swiglu",
    "use_accelerators",
    "silu_attention",
]
