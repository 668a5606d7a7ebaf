"""Gated delta rule (flash-linear-attention semantics): chunk_gated_delta_rule and fused_recurrent_gated_delta_rule.

q/k [B, T, H, K], v [B, T, HV, V] (HV a multiple of H: GVA), g (log decay) and beta [B, T, HV],
initial_state [N, HV, K, V] (fp32), cu_seqlens [N + 1] for packed sequences (then B == 1).
Both return (o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] fp32 or None); see
reference.py for the math. The two share the OpSpec "gated_delta_rule".
"""

from __future__ import annotations

import torch

from ..autocast import without_autocast
from ..backends import Backend, OpSpec, select_backend
from ..checks import (
    check_bool,
    check_readable,
    check_same_device,
    check_scale,
    check_strided,
    check_tensor,
    dtype_reasons,
)
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .reference import CHUNK_SIZE, chunk_gated_delta_rule_reference, recurrent_gated_delta_rule_reference

KERNEL_WIDTHS = (16, 32, 64, 128)


def _reasons(
    backend: str, q, v, g, beta, initial_state=None, mode: str = "chunk", needs_grad: bool = False
) -> list[str]:
    """mode ("chunk" or "recurrent") and needs_grad come from the op; explain() leaves them at the chunked op's."""
    reasons = dtype_reasons("q", q) + dtype_reasons("g", g) + dtype_reasons("beta", beta)
    if backend == "tilelang" and mode == "chunk" and q.dtype == torch.float32:
        reasons.append(
            "q has dtype float32; the tilelang chunked kernels multiply on bf16 operands and in tf32 (above the fp32 "
            "error bound): use bf16/fp16 inputs, the triton backend, or fused_recurrent_gated_delta_rule"
        )
    if initial_state is not None:
        reasons += dtype_reasons("initial_state", initial_state)
    for name, width in (("K (the q/k head dim)", q.shape[-1]), ("V (the v head dim)", v.shape[-1])):
        if width not in KERNEL_WIDTHS:
            reasons.append(f"{name} is {width}; the {backend} kernels take {', '.join(map(str, KERNEL_WIDTHS))}")
    if needs_grad and mode == "recurrent":
        reasons.append(
            "gradients are required but the recurrent kernels are forward-only (they serve decoding); "
            "train with chunk_gated_delta_rule"
        )
    return reasons


SPEC = OpSpec(name="gated_delta_rule", priority=("triton", "tilelang"), reasons=_reasons, widths=("q", "v"))

_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
    "bool output_final_state, bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens"
)


def _fake_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    n = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = (n, v.shape[2], k.shape[-1], v.shape[-1]) if output_final_state else (0,)
    return v.new_empty(v.shape, dtype=q.dtype), v.new_empty(shape, dtype=torch.float32)


def _fake_chunk_forward(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, *, backend
):
    o, final = _fake_forward(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )
    rows, HV = v.shape[0] * v.shape[1], v.shape[2]
    factors, inverse = _saved_dtypes(backend, k, v.shape[-1])
    saved = [
        ((rows, HV), torch.float32),
        ((rows, HV, k.shape[-1]), factors),
        ((rows, HV, v.shape[-1]), factors),
        ((rows, HV, CHUNK_SIZE), inverse),
    ]
    return (o, final, *(v.new_empty(shape, dtype=dtype) for shape, dtype in saved))


def _saved_dtypes(backend: str, k: torch.Tensor, V: int) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of the saved w and u, and of (I + A)^-1: the triton backend's (triton.saved_dtypes), else fp32."""
    if backend == "triton":
        from .triton import saved_dtypes

        return saved_dtypes(k, V)
    return torch.float32, torch.float32


def _check_compiled_values(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
):
    if cu_seqlens is not None:
        check_cu_seqlens_values(cu_seqlens, q.shape[1])


def _triton_chunk_kernels() -> KernelBackend:
    from .triton import CHUNK_KERNELS

    return CHUNK_KERNELS


def _tilelang_chunk_kernels() -> KernelBackend:
    from .tilelang import CHUNK_KERNELS

    return CHUNK_KERNELS


def _triton_recurrent_kernels() -> KernelBackend:
    from .triton import RECURRENT_KERNELS

    return RECURRENT_KERNELS


def _tilelang_recurrent_kernels() -> KernelBackend:
    from .tilelang import RECURRENT_KERNELS

    return RECURRENT_KERNELS


# kernel modules: chunk_forward / recurrent_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
#                                                   use_qk_l2norm_in_kernel, cu_seqlens [host, int64])
#                   -> (o [B, T, HV, V] q's dtype, final state [N, HV, K, V] fp32, or an empty tensor when not asked)
# the chunked forward also returns, for its backward, the per-chunk factors (rows of the packed [B*T] axis): the
# cumulative decay gamma [B*T, HV], w [B*T, HV, K], u [B*T, HV, V] and (I + A)^-1 [B*T, HV, 64], in fp32 but for the
# triton backend's w and u and its (I + A)^-1 where its products round them (_saved_dtypes).
# cu_seqlens reaches the kernel modules on the host (validated there); they copy it to the device.
CHUNK = KernelOp(
    "gated_delta_rule_chunk",
    _ARGS,
    n_outputs=2,
    n_saved=4,
    fake_forward=_fake_chunk_forward,
    backends={
        "triton": _triton_chunk_kernels,
        "tilelang": _tilelang_chunk_kernels,
    },
    fake_takes_backend=True,
    check_values=_check_compiled_values,
)
RECURRENT = KernelOp(
    "gated_delta_rule_recurrent",
    _ARGS,
    n_outputs=2,
    n_saved=0,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_recurrent_kernels,
        "tilelang": _tilelang_recurrent_kernels,
    },
    check_values=_check_compiled_values,
)


# --------------------------------------------------------------------------- validation


def _check_cu_seqlens(cu_seqlens, batch: int, length: int) -> torch.Tensor | None:
    """The boundaries as a host int64 tensor (one copy from the device if given there)."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}")
    check_strided("cu_seqlens", cu_seqlens)
    if (
        cu_seqlens.dim() != 1
        or cu_seqlens.is_floating_point()
        or cu_seqlens.is_complex()
        or cu_seqlens.dtype == torch.bool
    ):
        raise TypeError(
            f"cu_seqlens: expected a 1-D integer tensor, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected N + 1 >= 2 boundaries, got {cu_seqlens.numel()}")
    if batch != 1:
        raise ValueError(
            f"q: with cu_seqlens the sequences are packed along T and the batch size must be 1, got B={batch}"
        )
    check_readable("cu_seqlens", cu_seqlens, "the bounds of the sequences")
    host = cu_seqlens.detach().to("cpu", torch.int64)
    if not torch.compiler.is_compiling():  # compiled calls check the values at run time (_check_compiled_values)
        check_cu_seqlens_values(host, length)
    return host


def check_cu_seqlens_values(host: torch.Tensor, length: int) -> None:
    """The boundaries (a host int64 tensor) start at 0, end at T and do not decrease."""
    if host[0].item() != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {host[0].item()}")
    if host[-1].item() != length:
        raise ValueError(f"cu_seqlens: expected to end at T={length} (the packed length), got {host[-1].item()}")
    if (host[1:] < host[:-1]).any():
        raise ValueError(f"cu_seqlens: expected non-decreasing boundaries, got {host.tolist()}")


def _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> torch.Tensor | None:
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(name, x)
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v: expected [B, T, HV, V] = [{B}, {T}, HV, V], got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or K == 0 or V == 0:
        raise ValueError(f"q/v: expected H, K and V >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"v: the value heads HV={HV} must be a multiple of the q/k heads H={H} (GVA)")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(f"{name}: expected shape [B, T, HV] = {tuple(v.shape[:3])}, got {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q ({q.dtype}), got {x.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_same_device(name, x, "q", q)
    check_scale(scale)
    host_cu = _check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        n = B if host_cu is None else host_cu.numel() - 1
        if tuple(initial_state.shape) != (n, HV, K, V):
            where = "B" if host_cu is None else "the number of sequences in cu_seqlens"
            raise ValueError(
                f"initial_state: expected shape [N, HV, K, V] = {(n, HV, K, V)} (N = {where}), got {tuple(initial_state.shape)}"
            )
        check_same_device("initial_state", initial_state, "q", q)
    return host_cu


def _check_decays(g: torch.Tensor) -> None:
    """g > 0 (growth) is outside the chunked op's contract: rejected where the check costs no device sync (CPU
    tensors, outside compiled graphs); on a GPU the kernels compute exp of the in-chunk sums as given, exact until
    they overflow. g = -inf and any g <= -FULL_DECAY are full decays (reference.py)."""
    if g.device.type == "cpu" and not torch.compiler.is_compiling() and bool((g > 0).any()):
        step = tuple(int(i) for i in (g > 0).nonzero()[0])
        raise ValueError(
            f"g: expected log decays <= 0 (g = 0: no decay, -inf: full decay), got {g[step].item()} at {step}"
        )


def _run(
    mode,
    kernel,
    reference,
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm_in_kernel,
    cu_seqlens,
    backend,
):
    host_cu = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if mode == "chunk":
        _check_decays(g)
    check_bool("output_final_state", output_final_state)
    check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    tensors = (q, k, v, g, beta, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    key = (
        mode,
        q.dtype,
        g.dtype,
        beta.dtype,
        None if initial_state is None else initial_state.dtype,
        q.shape[-1],
        v.shape[-1],
        needs_grad,
    )
    chosen = select_backend(
        SPEC,
        backend,
        q.device,
        key,
        chunk_gated_delta_rule if mode == "chunk" else fused_recurrent_gated_delta_rule,
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        mode=mode,
        needs_grad=needs_grad,
    )
    args = (q, k, v, g, beta, scale, initial_state, bool(output_final_state), bool(use_qk_l2norm_in_kernel))
    if chosen == "torch" and host_cu is not None and torch.compiler.is_compiling():
        name = "chunk_gated_delta_rule" if mode == "chunk" else "fused_recurrent_gated_delta_rule"
        raise ValueError(
            f"{name} with cu_seqlens on the torch backend cannot be compiled into one graph: the "
            "reference loops over the sequences, reading cu_seqlens' values on the host; compile it with a kernel "
            "backend (backend='triton' or 'tilelang'), or without fullgraph=True (the call then runs eagerly)"
        )
    if chosen == "torch" or q.numel() == 0 or v.numel() == 0:
        with without_autocast(q.device.type):  # the kernels' dtypes: autocast would run the matmuls in bf16
            return reference(*args, cu_seqlens if host_cu is None else host_cu)
    o, final_state = kernel(chosen, *args, host_cu)
    if not output_final_state:
        return o, None
    # the final state does not depend on q: with only q requiring grad it requires none, as on the torch backend
    # (the kernel's autograd node marks every output differentiable)
    if not any(t is not None and t.requires_grad for t in (k, v, g, beta, initial_state)):
        final_state = final_state.detach()
    return o, final_state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over chunks of 64 steps (training): (o, final state or None)."""
    return _run(
        "chunk",
        CHUNK,
        chunk_gated_delta_rule_reference,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        cu_seqlens,
        backend,
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule step by step (decoding); the kernels are forward-only: (o, final state or None)."""
    return _run(
        "recurrent",
        RECURRENT,
        recurrent_gated_delta_rule_reference,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        cu_seqlens,
        backend,
    )


__all__ = ["CHUNK_SIZE", "SPEC", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
