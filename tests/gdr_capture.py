"""The gated delta rule's op-level bounds (both tiers), and a model's op calls judged at matched rounding.

A GDR mixer's gate parameters (A_log, dt_bias) reach the op only through its log decays g, so their gradients are sums
over batch and time of dL/dg with heavy cancellation: against a float64 model, the bf16 rounding of the op's inputs
dominates their error, not the op. Its output norm's weight gradient, a sum over batch, time and heads, is as far
from float64 as the bf16 error of its input and output gradient makes it; the norm adds under 3e-7. Judged instead:
each op call and each output norm call of a model run, recomputed in float64 on the torch backend from that call's
own inputs and output gradient (docs/tuning/gated_delta_rule.md, "The gate gradient summed into A_log" and "The
output norm's weight gradient")."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from unittest import mock

import torch

import runtime.nn.gated_delta as gated_delta
import runtime.nn.norms as norms
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule
from runtime.accelerators.rms_norm import rms_norm
from runtime.accelerators.testing import gradient_tolerance
from runtime.nn.gated_delta import GatedDeltaRuleMixer

BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-3, torch.float16: 5e-3}
GRAD_BOUND = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dinitial_state": 8e-3, "dg": 2e-2, "dbeta": 2e-2}


@dataclass
class NormCall:
    """The rms_norm call of a mixer's output norm: its input x, weight and eps as called, and the gradients that
    reached its output (dy) and its weight (dweight) in the backward."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    dy: torch.Tensor | None = field(default=None, repr=False)
    dweight: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class GDRCall:
    """One chunk_gated_delta_rule call of a mixer: its tensor inputs and other options as called, its output o, and
    the gradients that reached o (do) and g (dg) in the backward; then the mixer's output norm call on o."""

    mixer: str
    A_log: torch.Tensor
    inputs: dict[str, torch.Tensor]
    options: dict
    o: torch.Tensor
    do: torch.Tensor | None = field(default=None, repr=False)
    dg: torch.Tensor | None = field(default=None, repr=False)
    norm: NormCall | None = None


@contextlib.contextmanager
def capture_gdr_calls(model: torch.nn.Module):
    """Yields a list that gets one GDRCall per op call made by the model's GatedDeltaRuleMixers while inside, each
    with the NormCall of the mixer's output norm that follows it."""
    names = {module: name for name, module in model.named_modules() if isinstance(module, GatedDeltaRuleMixer)}
    running, calls = [], []
    signature = inspect.signature(chunk_gated_delta_rule)

    def recording(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        o, final = chunk_gated_delta_rule(*args, **kwargs)
        mixer = running[-1]
        call = GDRCall(
            mixer=names[mixer],
            A_log=mixer.A_log.detach().clone(),
            inputs={n: x.detach().clone() for n, x in arguments.items() if isinstance(x, torch.Tensor)},
            options={n: x for n, x in arguments.items() if not isinstance(x, torch.Tensor) and n != "backend"},
            o=o.detach().clone(),
        )
        o.register_hook(lambda grad: setattr(call, "do", grad.detach().clone()))
        arguments["g"].register_hook(lambda grad: setattr(call, "dg", grad.detach().clone()))
        calls.append(call)
        return o, final

    def recording_norm(x, weight=None, eps=1e-6, *, backend=None):
        if not running or weight is not running[-1].norm.weight:  # not a mixer's output norm
            return rms_norm(x, weight, eps, backend=backend)
        call = calls[-1]
        call.norm = NormCall(x=x.detach().clone(), weight=weight.detach().clone(), eps=eps)
        weight = weight.view_as(weight)  # this call's own use of the parameter, for its own gradient
        weight.register_hook(lambda grad: setattr(call.norm, "dweight", grad.detach().clone()))
        y = rms_norm(x, weight, eps, backend=backend)
        y.register_hook(lambda grad: setattr(call.norm, "dy", grad.detach().clone()))
        return y

    def enter(module, args):
        running.append(module)

    def leave(module, args, out):
        running.pop()

    hooks = [mixer.register_forward_pre_hook(enter) for mixer in names]
    hooks += [mixer.register_forward_hook(leave) for mixer in names]
    try:
        with (
            mock.patch.object(gated_delta, "chunk_gated_delta_rule", recording),
            mock.patch.object(norms, "rms_norm", recording_norm),
        ):
            yield calls
    finally:
        for hook in hooks:
            hook.remove()


def recompute_in_float64(call: GDRCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, dg): the op on the torch backend from the call's inputs and output gradient promoted to float64."""
    inputs = {n: x.double().requires_grad_(n == "g") for n, x in call.inputs.items()}
    with torch.autocast(inputs["g"].device.type, enabled=False):
        o, _ = chunk_gated_delta_rule(**inputs, **call.options, backend="torch")
    (dg,) = torch.autograd.grad(o, inputs["g"], call.do.double())
    return o.detach(), dg


def recompute_norm_weight_gradient_in_float64(norm: NormCall) -> torch.Tensor:
    """The output norm's weight gradient on the torch backend from the call's input, weight and output gradient
    promoted to float64."""
    x, weight = norm.x.double(), norm.weight.double().requires_grad_()
    with torch.autocast(x.device.type, enabled=False):
        y = rms_norm(x, weight, norm.eps, backend="torch")
    (dweight,) = torch.autograd.grad(y, weight, norm.dy.double())
    return dweight


def gate_parameter_gradients(call: GDRCall, dg: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mixer's A_log and dt_bias gradients made of dg: per head, the sums over batch and time of dg * dg/dA_log
    (= g) and of dg * dg/ddt_bias (= -A sigmoid(a + dt_bias) = A expm1(g / A), A = exp(A_log)), in float64."""
    g, A = call.inputs["g"].double(), call.A_log.double().exp()
    dg = dg.double()
    return {"A_log": (dg * g).sum((0, 1)), "dt_bias": (dg * A * torch.expm1(g / A)).sum((0, 1))}


def matched_comparisons(call: GDRCall) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """(what, value, float64 reference, op bound) for the call's o, dg and the gate parameters' gradients made of dg,
    and its output norm's weight gradient, each reference recomputed from the call's own inputs (the bounds of q's
    dtype, and of the norm input's, the precision each op computes in)."""
    o_ref, dg_ref = recompute_in_float64(call)
    dtype = call.inputs["q"].dtype
    dg_bound = 2 * BOUND[dtype] if dtype == torch.float32 else GRAD_BOUND["dg"]
    comparisons = [(f"{call.mixer} o", call.o, o_ref, BOUND[dtype]), (f"{call.mixer} dg", call.dg, dg_ref, dg_bound)]
    sums, sums_ref = gate_parameter_gradients(call, call.dg), gate_parameter_gradients(call, dg_ref)
    for parameter in sums:
        what = f"{call.mixer}.{parameter} gradient from dg"
        comparisons.append((what, sums[parameter], sums_ref[parameter], dg_bound))
    norm = call.norm
    dweight_ref = recompute_norm_weight_gradient_in_float64(norm)
    what = f"{call.mixer}.norm.weight gradient"
    comparisons.append((what, norm.dweight, dweight_ref, gradient_tolerance(norm.x.dtype)))
    return comparisons


def matched_parameter_names(model: torch.nn.Module) -> set[str]:
    """The GDR mixers' parameters judged per call: those that reach the op only through g, and the output norm's
    weight."""
    mixers = [name for name, module in model.named_modules() if isinstance(module, GatedDeltaRuleMixer)]
    return {f"{mixer}.{parameter}" for mixer in mixers for parameter in ("A_log", "dt_bias", "norm.weight")}
