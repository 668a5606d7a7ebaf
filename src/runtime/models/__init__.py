"""PCVR models built only from runtime.nn: each takes a FeatureSpec and maps a PCVRBatch to logits [B]."""

from .baseline import BaselinePCVR
from .causal import CausalSequencePCVR, GDRMixerPCVR, TokenFormerPCVR
from .hstu import HSTUPCVR
from .inputs import FeatureSpec, PCVRBatch

__all__ = [
    "BaselinePCVR",
    "CausalSequencePCVR",
    "FeatureSpec",
    "GDRMixerPCVR",
    "HSTUPCVR",
    "PCVRBatch",
    "TokenFormerPCVR",
]
