"""PCVR models built only from runtime.nn: each takes a FeatureSpec and maps a PCVRBatch to logits [B]."""

from .baseline import BaselinePCVR
from .causal import CausalSequencePCVR, GDRMixerPCVR, TokenFormerPCVR
from .inputs import FeatureSpec, PCVRBatch

__all__ = ["BaselinePCVR", "CausalSequencePCVR", "FeatureSpec", "GDRMixerPCVR", "PCVRBatch", "TokenFormerPCVR"]
