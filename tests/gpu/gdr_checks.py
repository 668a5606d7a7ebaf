"""What the gated delta rule GPU tests share (test_gated_delta_rule*.py, split in four files so that the GPU tier
runs them side by side): the cases, the float64 recurrence as reference, and the two checks made per case. The
bounds are in tests/gdr_capture.py, which the CPU tier imports too."""

import functools

import torch
import torch.nn.functional as F

from gdr_capture import BOUND, GRAD_BOUND
from runtime.accelerators import use_accelerators
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from runtime.accelerators.gated_delta_rule import triton as gdr_triton
from runtime.accelerators.gated_delta_rule import triton_backward as gdr_backward
from runtime.accelerators.gated_delta_rule.reference import recurrent_gated_delta_rule_reference
from runtime.accelerators.testing import assert_close, differentiable

FUNCTIONS = {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}


def make_inputs(B, T, H, HV, K, V, dtype, state=False, sequences=None, seed=0, decay_shift=2.0):
    """log decays logsigmoid(randn + decay_shift): a larger shift decays less."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    inputs = {
        "q": randn(B, T, H, K),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, HV, V),
        "g": F.logsigmoid(randn(B, T, HV) + decay_shift),
        "beta": torch.rand(B, T, HV, generator=gen, device="cuda"),
    }
    inputs = {name: x.to(dtype) for name, x in inputs.items()}
    if state:
        inputs["initial_state"] = randn(B if sequences is None else sequences, HV, K, V)
    return inputs


def call(function, inputs, backend, **options):
    x = inputs
    return function(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"), backend=backend, **options
    )


def triton_chunk(inputs, tuning, scale=None, output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The Triton chunked kernels forward and backward with these variants (gdr_triton.Tuning), without the op's
    dispatch: (o, final state or None)."""
    run = differentiable(
        functools.partial(gdr_triton.chunk_forward, tuning=tuning),
        functools.partial(gdr_backward.chunk_backward, tuning=tuning),
        2,
    )
    x = inputs
    scale = float(x["q"].shape[-1] ** -0.5 if scale is None else scale)
    cu = None if cu_seqlens is None else cu_seqlens.to("cpu", torch.int64)
    o, final = run(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x.get("initial_state"), output_final_state,
                   use_qk_l2norm_in_kernel, cu)  # fmt: skip
    return o, (final if output_final_state else None)


def reference(inputs, **options):
    x = {name: t.detach().double() for name, t in inputs.items()}
    return recurrent_gated_delta_rule_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], options.get("scale"), x.get("initial_state"),
        options.get("output_final_state", False), options.get("use_qk_l2norm_in_kernel", False), options.get("cu_seqlens"),
    )  # fmt: skip


VARLEN = [0, 1, 64, 200, 263, 1000]  # a one-token sequence, one exactly a chunk, odd lengths
CASES = {  # name: (B, T, H, HV, K, V, dtype, state, options)
    "T63-K16-fp32": (2, 63, 2, 4, 16, 16, torch.float32, True, dict(output_final_state=True)),
    "T200-K128-bf16-l2norm-state": (2, 200, 2, 2, 128, 128, torch.bfloat16, True,
                                    dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "T1000-K64-V32-fp16-GVA": (1, 1000, 1, 4, 64, 32, torch.float16, False, dict(use_qk_l2norm_in_kernel=True)),
    "T37-K32-V128-bf16-GVA-scale": (3, 37, 2, 6, 32, 128, torch.bfloat16, True, dict(scale=0.3, output_final_state=True)),
    # the Triton reverse walk at K = 128 with V < 32: a 32-wide V block with its columns past V masked (with V = 32
    # this case made an illegal memory access while the walk held its state as one [128, 32] tile)
    "T300-K128-V16-bf16-l2norm-state": (1, 300, 2, 2, 128, 16, torch.bfloat16, True,
                                        dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    # fp32 at K = 128: the walks' IEEE launches (BV 32, 8 warps, 1 stage), covered by no other case
    "T130-K128-V64-fp32-state": (1, 130, 1, 2, 128, 64, torch.float32, True, dict(output_final_state=True)),
    "T256-K16-bf16-pcvr": (8, 256, 4, 4, 16, 16, torch.bfloat16, False, dict(use_qk_l2norm_in_kernel=True)),
    # fp16 at small K: half inputs take bf16 products, and the CPU interpreter (which truncates) put o near the bound
    "T100-K16-V32-fp16-state": (2, 100, 2, 2, 16, 32, torch.float16, True, dict(output_final_state=True)),
    "varlen-K128-bf16-GVA-state": (1, 1000, 2, 4, 128, 64, torch.bfloat16, True,
                                   dict(cu_seqlens=torch.tensor(VARLEN), use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "varlen-K64-fp32-cuda-boundaries": (1, 1000, 1, 1, 64, 64, torch.float32, True,
                                        dict(cu_seqlens="cuda", output_final_state=True)),  # boundaries given on the GPU
}  # fmt: skip


def case_options(name):
    B, T, H, HV, K, V, dtype, state, options = CASES[name]
    if options.get("cu_seqlens") == "cuda":
        options = dict(options, cu_seqlens=torch.tensor(VARLEN, device="cuda"))
    sequences = len(options["cu_seqlens"]) - 1 if "cu_seqlens" in options else None
    return (B, T, H, HV, K, V, dtype, state, sequences), options


def check_forward_matches_the_float64_recurrence(function, name, backend):
    (B, T, H, HV, K, V, dtype, state, sequences), options = case_options(name)
    inputs = make_inputs(B, T, H, HV, K, V, dtype, state, sequences)
    with use_accelerators(fallback="error"), torch.no_grad():
        o, final = call(FUNCTIONS[function], inputs, backend, **options)
    o_ref, final_ref = reference(inputs, **options)
    assert o.dtype == dtype
    assert_close("o", o, o_ref, BOUND[dtype])
    if final_ref is None:
        assert final is None
    else:
        assert final.dtype == torch.float32
        assert_close("final_state", final, final_ref, BOUND[dtype])


def check_chunked_forward_and_every_gradient(name, backend, tuning=None):
    """o, the final state and every gradient (the final state's gradient flowing back too) vs the float64 recurrence;
    with tuning (a gdr_triton.Tuning), the Triton kernels with those variants."""
    (B, T, H, HV, K, V, dtype, state, sequences), options = case_options(name)
    inputs = {n: t.requires_grad_() for n, t in make_inputs(B, T, H, HV, K, V, dtype, state, sequences).items()}
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    if tuning is not None:
        assert backend == "triton", "tuning: the Triton kernels' variants"
        o, final = triton_chunk(inputs, tuning, **options)
    else:
        with use_accelerators(fallback="error"):
            o, final = call(chunk_gated_delta_rule, inputs, backend, **options)
    o_ref, final_ref = recurrent_gated_delta_rule_reference(
        twin["q"], twin["k"], twin["v"], twin["g"], twin["beta"], options.get("scale"), twin.get("initial_state"),
        options.get("output_final_state", False), options.get("use_qk_l2norm_in_kernel", False), options.get("cu_seqlens"),
    )  # fmt: skip
    assert o.dtype == dtype
    assert_close("o", o, o_ref, BOUND[dtype])
    outputs, refs = [o], [o_ref]
    if final_ref is not None:
        assert_close("final_state", final, final_ref, BOUND[dtype])
        outputs.append(final)
        refs.append(final_ref)
    grads_out = [torch.randn_like(r) for r in refs]
    grads = torch.autograd.grad(outputs, list(inputs.values()), [g.to(o.dtype) for g, o in zip(grads_out, outputs)])
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    for n, grad, ref in zip(inputs, grads, ref_grads):
        assert grad.dtype == inputs[n].dtype
        bound = 2 * BOUND[dtype] if dtype == torch.float32 else GRAD_BOUND[f"d{n}"]
        assert_close(f"d{n}", grad, ref, bound)


HALF_CASES = [name for name, case in CASES.items() if case[6] != torch.float32]
