"""The row norms in textbook float64 math, for the tests of both tiers."""

import torch

DEFAULT_EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5, "l2norm": 1e-6}  # the ops' defaults


def reference64(op, x, weight=None, bias=None, eps=None):
    """rms_norm, layer_norm or l2norm of the rows of x (float64 in, float64 out); eps: the op's default if None."""
    eps = DEFAULT_EPS[op] if eps is None else eps
    if op == "rms_norm":
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    elif op == "l2norm":
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
    else:
        centred = x - x.mean(-1, keepdim=True)
        y = centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y
