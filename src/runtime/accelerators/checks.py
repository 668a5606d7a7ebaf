"""Argument checks shared by the ops: each error names the argument and what was expected."""

from __future__ import annotations

import math
import numbers

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what the ops take (the torch backend runs float64; the kernels take KERNEL_DTYPES)
FLOAT_DTYPES = (torch.float64, *KERNEL_DTYPES)


def _dtype_list(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(name: str, value, *, floating: bool = True, min_dim: int = 0) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    check_strided(name, value)
    if floating and value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating-point tensor ({_dtype_list(FLOAT_DTYPES)}), got {value.dtype}")
    if min_dim and value.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(value.shape)}")


def check_strided(name: str, value: torch.Tensor) -> None:
    """The ops read every tensor argument through its strides: a sparse (COO, CSR...) or jagged nested tensor is
    refused here, naming the argument, rather than failing inside torch."""
    if value.layout is not torch.strided:
        layout = str(value.layout).removeprefix("torch.")
        raise TypeError(f"{name}: expected a strided (dense) tensor, got layout {layout} (pass {name}.to_dense())")


def check_readable(name: str, value: torch.Tensor, why: str) -> None:
    """An argument whose values the op reads on the host (`why`: what for): a meta tensor has none, so the op cannot
    run on it (shape inference alone would need no value). Compiled calls do not read them: their fake tensors are
    on the inputs' real device."""
    if value.device.type == "meta":
        raise ValueError(f"{name}: a meta tensor has no values, and the op reads them on the host ({why})")


def check_same_device(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if value.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} like {ref_name}, got one on {value.device}")


def check_like(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor, eager: str) -> None:
    """An elementwise partner of ref: its shape, dtype and device. A dtype mix is refused, under autocast too (which
    casts neither); `eager` is the torch expression the message says would have promoted it."""
    if value.shape != ref.shape:
        raise ValueError(f"{name}: expected the shape of {ref_name} {tuple(ref.shape)}, got {tuple(value.shape)}")
    if value.dtype != ref.dtype:
        raise TypeError(
            f"{name}: expected the dtype of {ref_name} ({ref.dtype}), got {value.dtype}; cast both to one dtype first "
            f"(under autocast too: eager {eager} would give {torch.promote_types(ref.dtype, value.dtype)})"
        )
    check_same_device(name, value, ref_name, ref)


def check_feature_param(name: str, value, x: torch.Tensor) -> None:
    """A per-feature parameter (norm weight or bias): 1-D of x's last size, on x's device."""
    if value is None:
        return
    check_tensor(name, value)
    if value.dim() != 1 or value.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name}: expected shape ({x.shape[-1]},) to match the last dimension of x, got {tuple(value.shape)}"
        )
    check_same_device(name, value, "x", x)


def check_rows(name: str, x: torch.Tensor) -> None:
    """Row-wise ops need a non-empty last dimension; an empty batch is fine."""
    if x.shape[-1] == 0:
        raise ValueError(f"{name}: the last dimension (the normalised width) is empty; shape {tuple(x.shape)}")


def check_bool(name: str, value) -> None:
    """A flag: True or False. Anything else (a string, 1, None) is an error rather than read by its truth value.
    While compiling, a flag may arrive as a SymBool, which is a bool too."""
    if type(value) is not bool and not isinstance(value, torch.SymBool):
        kind = type(value).__name__
        if type(value).__module__ == "numpy":  # numpy's bool is named "bool" too: "expected a bool, got bool" misleads
            kind = f"numpy.{kind} (pass bool(value))"
        raise TypeError(f"{name}: expected a bool (True or False), got {kind} {value!r}")


def check_eps(eps) -> None:
    """eps is added to a mean or sum of squares before its rsqrt: a finite number >= 0 (a negative one gives NaN)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a float >= 0, got {type(eps).__name__}")
    if not 0.0 <= eps < math.inf:  # also rejects NaN
        raise ValueError(f"eps: expected a finite float >= 0, got {eps}")


def check_scale(scale) -> None:
    """An attention scale: None (1 / sqrt(head dim)) or a finite number > 0."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a float > 0 or None, got {type(scale).__name__}")
    if not 0.0 < scale < math.inf:  # also rejects NaN
        raise ValueError(f"scale: expected a finite float > 0 or None, got {scale}")


def as_int(name: str, value, *, least: int, expected: str):
    """An integer argument >= least: numpy's and other Integral numbers as a Python int; a Python int (or a SymInt
    while compiling) as it is. A bool, a float or anything else is a TypeError naming the argument."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
        value = int(value)
    if value < least:
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


def as_padding_idx(padding_idx, num_embeddings: int, table: str = "") -> int | None:
    """None, or a row of the table in [-num_embeddings, num_embeddings) as nn.EmbeddingBag takes it (numpy's ints too,
    not a bool: True would be read as row 1), returned in [0, num_embeddings). table names the table for the message
    where there are several."""
    if padding_idx is None:
        return None
    n = num_embeddings
    message = (
        f"padding_idx: expected None or an int in [-{n}, {n}) (num_embeddings{f' of {table}' if table else ''}), "
        f"got {type(padding_idx).__name__} {padding_idx!r}"
    )
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
        raise TypeError(message)
    if not -n <= padding_idx < n:
        raise ValueError(message)
    return int(padding_idx) % n


def as_probability(name: str, value) -> float:
    """A dropout probability: a real number (numpy's too, not a bool) in [0, 1), as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a dropout probability (a float in [0, 1)), got {type(value).__name__}")
    if not 0.0 <= value < 1.0:  # also rejects NaN
        raise ValueError(f"{name}: expected a dropout probability in [0, 1), got {value}")
    return float(value)


def as_finite_float(name: str, value) -> float:
    """A finite real number (numpy's too, not a bool) as a Python float: NaN or an infinity would turn every output
    into NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a finite float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value}")
    return float(value)


def dtype_reasons(name: str, tensor: torch.Tensor, allowed=KERNEL_DTYPES) -> list[str]:
    if tensor.dtype in allowed:
        return []
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    return [f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; the kernels take {names}"]


def size_reasons(name: str, tensor: torch.Tensor, limit: int, too_large: bool | None, most: str) -> list[str]:
    """Why kernels cannot take `tensor` for its size: more than `limit` elements (`most`: what they do with at most
    that many). too_large is that comparison as the op passes it, because the stand-ins of torch.compile's decision
    keep no such size; None (explain()): read from tensor."""
    if too_large is None:
        too_large = tensor.numel() > limit
    return [f"{name} has more than {limit} elements, the most {most}"] if too_large else []


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision inputs, the input's own dtype otherwise (float64 references stay float64)."""
    return torch.promote_types(tensor.dtype, torch.float32)
