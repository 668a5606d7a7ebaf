"""The public functional API of taac-runtime's accelerators."""

from .activation import gelu, silu
from .add_norm import add_layer_norm, add_rms_norm
from .backends import (
    BACKENDS,
    OP_NAMES,
    Backend,
    BackendFallbackWarning,
    BackendUnavailableError,
)
from .bce_with_logits import binary_cross_entropy_with_logits
from .config import AcceleratorConfig, active_config, set_accelerators, use_accelerators
from .dropout_add import dropout_add
from .embedding_bag_mean import embedding_bag_collection, embedding_bag_mean
from .explain import explain
from .flash_attention import flash_attention
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .l2norm import l2norm
from .layer_norm import layer_norm
from .linear import linear
from .mhc import mhc_post, mhc_pre
from .rms_norm import rms_norm
from .sampling import sample, top_k
from .silu_attention import silu_attention
from .swiglu import swiglu

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
    "embedding_bag_collection",
    "embedding_bag_mean",
    "explain",
    "flash_attention",
    "fused_recurrent_gated_delta_rule",
    "l2norm",
    "layer_norm",
    "linear",
    "mhc_post",
    "mhc_pre",
    "rms_norm",
    "set_accelerators",
    "swiglu",
    "use_accelerators",
    "add_rms_norm",
    "add_layer_norm",
    "gelu",
    "silu",
    "silu_attention",
    "sample",
    "top_k",
]
