"""taac-runtime: the accelerator layer of a PCVR training runtime."""

__version__ = "0.1.0"
