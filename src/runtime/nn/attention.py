"""Multi-head self- and cross-attention on `flash_attention` (key padding through key_lengths, or packed sequences
through cu_seqlens), the q/k/v and output projections on the `linear` op."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int, as_probability, check_bool
from runtime.accelerators.flash_attention import flash_attention

from .linear import Linear


def _split_heads(x: torch.Tensor, n_heads: int, name: str = "x") -> torch.Tensor:
    """[B, L, H * D] -> a [B, H, L, D] view (no copy: the op takes strided views); x is a projection of the input
    `name`, of its rank."""
    if x.dim() != 3:
        raise ValueError(
            f"{name}: expected [B, L, d_model] (packed tokens [total, d_model] take cu_seqlens), got {x.dim()}-D"
        )
    b, length, width = x.shape
    return x.view(b, length, n_heads, width // n_heads).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B, L, H * D]."""
    b, h, length, d = x.shape
    return x.transpose(1, 2).reshape(b, length, h * d)


def _packed_heads(x: torch.Tensor, n_heads: int, name: str = "x") -> torch.Tensor:
    """[total, H * D] -> a [total, H, D] view; x is a projection of the input `name`, of its rank."""
    if x.dim() != 2:
        raise ValueError(f"{name}: expected packed tokens [total, d_model] with cu_seqlens, got {x.dim()}-D")
    return x.view(x.shape[0], n_heads, x.shape[1] // n_heads)


def _check_heads(d_model: int, n_heads: int) -> int:
    """n_heads as an int (a float one was taken, and failed in forward's view)."""
    d_model = as_int("d_model", d_model, least=1, expected="an int >= 1")
    n_heads = as_int("n_heads", n_heads, least=1, expected=f"a positive divisor of d_model={d_model}")
    if d_model % n_heads != 0:
        raise ValueError(f"n_heads: expected a positive divisor of d_model={d_model}, got {n_heads}")
    return n_heads


class _TorchKeys:
    """A load_state_dict pre-hook: nn.MultiheadAttention's keys become this module's: in_proj_weight/in_proj_bias
    (q, k, v rows of E each, in that order) split over the projections in `split` (name -> rows in units of E),
    out_proj.* -> out.*. A module-level class, not a closure, so that a module holding it pickles (torch.save)."""

    def __init__(self, split: dict[str, int]) -> None:
        self.split = split

    def __call__(self, state_dict, prefix, *_) -> None:
        for kind in ("weight", "bias"):
            packed = state_dict.pop(f"{prefix}in_proj_{kind}", None)
            if packed is not None:
                parts = packed.split([packed.shape[0] // 3 * rows for rows in self.split.values()])
                state_dict.update({f"{prefix}{name}.{kind}": part for name, part in zip(self.split, parts)})
            if f"{prefix}out_proj.{kind}" in state_dict:
                state_dict[f"{prefix}out.{kind}"] = state_dict.pop(f"{prefix}out_proj.{kind}")


def _torch_keys(module: nn.Module, split: dict[str, int]) -> None:
    module._register_load_state_dict_pre_hook(_TorchKeys(split))


class MultiHeadAttention(nn.Module):
    """Self-attention over x [B, L, d_model] with one fused q/k/v projection. Loads its own state_dict or that of an
    nn.MultiheadAttention(d_model, n_heads, bias=bias) (the same math, batch first).

    causal: token i attends to tokens j <= i. key_lengths [B] (forward): tokens j >= key_lengths[b]
    are padding and are not attended to. dropout is attention dropout, active in training only.
    Packed sequences: x [total, d_model] with cu_seqlens (int32 [N + 1]) and max_seqlen (forward), each sequence
    attending within itself.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = False,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        n_heads = _check_heads(d_model, n_heads)
        check_bool("causal", causal)
        self.n_heads = n_heads
        self.causal = causal
        self.dropout = as_probability("dropout", dropout)
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.qkv = Linear(d_model, 3 * d_model, bias=bias, backend=backend, **factory)
        self.out = Linear(d_model, d_model, bias=bias, backend=backend, **factory)
        _torch_keys(self, {"qkv": 3})

    def forward(
        self,
        x: torch.Tensor,
        key_lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        if cu_seqlens is not None:
            q, k, v = (_packed_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))
            o = flash_attention(
                q,
                k,
                v,
                causal=self.causal,
                key_lengths=key_lengths,  # not taken with packed sequences: the op says so
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen,
                max_seqlen_k=max_seqlen,
                dropout_p=self.dropout if self.training else 0.0,
                backend=self.backend,
            )
            return self.out(o.flatten(1))
        q, k, v = (_split_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))
        o = flash_attention(
            q,
            k,
            v,
            causal=self.causal,
            key_lengths=key_lengths,
            max_seqlen_q=max_seqlen,  # only taken with packed sequences: the op says so
            max_seqlen_k=max_seqlen,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
        )
        return self.out(_merge_heads(o))


class CrossAttention(nn.Module):
    """Queries from x [B, Lq, d_model] attend to context [B, Lk, d_model] (e.g. a target item over a history). Loads
    its own state_dict or that of an nn.MultiheadAttention(d_model, n_heads, bias=bias) (query=x, key=value=context).
    Packed: x [N, d_model] (one query per sequence) and context [total, d_model] with context_cu_seqlens (int32
    [N + 1]) and context_max_seqlen (forward)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = False,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.n_heads = _check_heads(d_model, n_heads)
        self.dropout = as_probability("dropout", dropout)
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.q = Linear(d_model, d_model, bias=bias, backend=backend, **factory)
        self.kv = Linear(d_model, 2 * d_model, bias=bias, backend=backend, **factory)
        self.out = Linear(d_model, d_model, bias=bias, backend=backend, **factory)
        _torch_keys(self, {"q": 1, "kv": 2})

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        key_lengths: torch.Tensor | None = None,
        context_cu_seqlens: torch.Tensor | None = None,
        context_max_seqlen: int | None = None,
    ) -> torch.Tensor:
        if context_cu_seqlens is not None:
            q = _packed_heads(self.q(x), self.n_heads)
            k, v = (_packed_heads(t, self.n_heads, "context") for t in self.kv(context).chunk(2, dim=-1))
            one_each = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
            o = flash_attention(
                q,
                k,
                v,
                key_lengths=key_lengths,
                cu_seqlens_q=one_each,
                cu_seqlens_k=context_cu_seqlens,
                max_seqlen_q=1,
                max_seqlen_k=context_max_seqlen,
                dropout_p=self.dropout if self.training else 0.0,
                backend=self.backend,
            )
            return self.out(o.flatten(1))
        q = _split_heads(self.q(x), self.n_heads)
        k, v = (_split_heads(t, self.n_heads, "context") for t in self.kv(context).chunk(2, dim=-1))
        o = flash_attention(
            q,
            k,
            v,
            key_lengths=key_lengths,
            max_seqlen_k=context_max_seqlen,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
        )
        return self.out(_merge_heads(o))
