"""nn.Module wrappers of the accelerator ops. Each module follows the active accelerator config
(runtime.accelerators.set_accelerators / use_accelerators) unless given a `backend`. Modules with parameters take
`device=` and `dtype=` as torch's do, and those with a torch counterpart load its state_dict unchanged."""

from .activations import GELU, SiLU
from .attention import CrossAttention, MultiHeadAttention
from .blocks import GatedDeltaBlock, TransformerBlock, run_blocks
from .embedding import EmbeddingBagCollection, EmbeddingBagMean
from .feedforward import SwiGLUFeedForward
from .gated_delta import GatedDeltaRuleMixer
from .hstu import HSTUBlock
from .hyper_connections import HyperConnection, expand_streams, merge_streams
from .linear import Linear
from .loss import BCEWithLogitsLoss
from .norms import AddLayerNorm, AddRMSNorm, L2Norm, LayerNorm, RMSNorm
from .replace import OP_KINDS, ReplaceReport, replace_modules
from .residual import DropoutAdd

__all__ = [
    "BCEWithLogitsLoss",
    "CrossAttention",
    "DropoutAdd",
    "EmbeddingBagCollection",
    "EmbeddingBagMean",
    "GatedDeltaBlock",
    "GatedDeltaRuleMixer",
    "HSTUBlock",
    "HyperConnection",
    "L2Norm",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "RMSNorm",
    "SwiGLUFeedForward",
    "TransformerBlock",
    "expand_streams",
    "merge_streams",
    "AddLayerNorm",
    "AddRMSNorm",
    "GELU",
    "SiLU",
    "OP_KINDS",
    "ReplaceReport",
    "replace_modules",
    "run_blocks",
]
