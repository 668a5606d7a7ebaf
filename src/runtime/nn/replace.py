"""replace_modules: swap the torch modules of an existing model for the runtime.nn modules that compute the same thing
on the accelerator ops, in place, keeping every parameter (the same Parameter objects: state_dict, dtype, device and
an optimizer built before stay valid)."""

from __future__ import annotations

import copy
import numbers
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from runtime.accelerators.config import BACKENDS
from runtime.accelerators.testing import RTOL, relative_rms_error

from .activations import GELU, SiLU
from .embedding import EmbeddingBagMean
from .linear import Linear
from .norms import LayerNorm, RMSNorm

# op kinds `ops=` selects from (the accelerator op each replacement runs on)
OP_KINDS = ("linear", "layer_norm", "rms_norm", "embedding_bag_mean", "activation")
_FUSABLE = {nn.ReLU: "relu", nn.SiLU: "silu", nn.GELU: None}  # GELU: "gelu" or "gelu_tanh" by its approximation


class Replaced(NamedTuple):
    name: str
    old: type
    new: type


class Left(NamedTuple):
    name: str
    cls: type
    reason: str


def _class_name(cls: type) -> str:
    module = cls.__module__
    if module.startswith("torch.nn."):
        return f"nn.{cls.__qualname__}"
    if module.startswith("runtime.nn."):
        return f"runtime.nn.{cls.__qualname__}"
    return f"{module}.{cls.__qualname__}"


@dataclass
class ReplaceReport:
    """What replace_modules swapped (qualified name, old class, new class) and what it left, with the reason."""

    replaced: list[Replaced] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} module(s)" + (":" if self.replaced else "")]
        width = max((len(r.name) for r in self.replaced), default=0)
        lines += [
            f"  {r.name or '(root)':<{width}}  {_class_name(r.old)} -> {_class_name(r.new)}" for r in self.replaced
        ]
        if self.left:
            lines.append(f"left {len(self.left)} module(s):")
            lines += [f"  {entry.name or '(root)'}  {_class_name(entry.cls)}: {entry.reason}" for entry in self.left]
        return "\n".join(lines)


def _check_ops(ops: Iterable[str] | None) -> frozenset[str]:
    if ops is None:
        return frozenset(OP_KINDS)
    if isinstance(ops, str):
        ops = [ops]
    chosen = frozenset(ops)
    unknown = sorted(chosen - set(OP_KINDS))
    if unknown:
        raise ValueError(f"ops: unknown op kind(s) {unknown}; expected a subset of {list(OP_KINDS)}")
    return chosen


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def _last_dim(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 1:
        return f"normalized_shape={tuple(shape)}: the runtime op normalises over the last dimension only"
    return None


def _take_parameters(new: nn.Module, old: nn.Module, names: Iterable[str]) -> nn.Module:
    """The old module's Parameter objects (or None) in place of the new module's."""
    for name in names:
        setattr(new, name, getattr(old, name))
    new.train(old.training)
    return new


def _factory(module: nn.Module) -> dict:
    """Build a replacement on the meta device: its own initial weights are thrown away for the old module's."""
    return {"device": "meta", "dtype": next(iter(module.parameters()), torch.empty(0)).dtype}


# each converter: module -> (new module, None) or (None, reason), for a module of exactly its class


def _linear(module: nn.Linear, backend, activation: str | None = None):
    new = Linear(
        module.in_features,
        module.out_features,
        module.bias is not None,
        activation,
        **_factory(module),
        backend=backend,
    )
    return _take_parameters(new, module, ("weight", "bias")), None


def _layer_norm(module: nn.LayerNorm, backend):
    reason = _last_dim(module.normalized_shape)
    if reason:
        return None, reason
    affine = module.elementwise_affine
    new = LayerNorm(
        module.normalized_shape[0],
        module.eps,
        elementwise_affine=affine,
        bias=module.bias is not None,
        backend=backend,
        **_factory(module),
    )
    return _take_parameters(new, module, ("weight", "bias")), None


def _rms_norm(module: nn.RMSNorm, backend):
    reason = _last_dim(module.normalized_shape)
    if reason:
        return None, reason
    if module.eps is None:
        return None, "eps=None (the input dtype's machine epsilon): the runtime op takes a fixed eps; set one"
    new = RMSNorm(
        module.normalized_shape[0],
        module.eps,
        elementwise_affine=module.elementwise_affine,
        backend=backend,
        **_factory(module),
    )
    return _take_parameters(new, module, ("weight",)), None


def _embedding_bag(module: nn.EmbeddingBag, backend):
    if module.mode != "mean":
        return None, f"mode={module.mode!r}: only mode='mean' has a runtime op"
    if module.max_norm is not None:
        return None, f"max_norm={module.max_norm}: renormalising rows is not supported by the runtime op"
    if module.scale_grad_by_freq:
        return None, "scale_grad_by_freq=True is not supported by the runtime op"
    n, dim = module.weight.shape
    new = EmbeddingBagMean(
        n,
        dim,
        module.padding_idx,
        include_last_offset=module.include_last_offset,
        sparse=module.sparse,
        backend=backend,
        **_factory(module),
    )
    return _take_parameters(new, module, ("weight",)), None


def _gelu(module: nn.GELU, backend):
    return GELU(module.approximate, backend=backend), None


def _silu(module: nn.SiLU, backend):
    return SiLU(backend=backend), None


# exact classes only: a subclass may override forward
_CONVERTERS = {
    nn.Linear: ("linear", _linear),
    nn.LayerNorm: ("layer_norm", _layer_norm),
    nn.RMSNorm: ("rms_norm", _rms_norm),
    nn.EmbeddingBag: ("embedding_bag_mean", _embedding_bag),
    nn.GELU: ("activation", _gelu),
    nn.SiLU: ("activation", _silu),
}


# ------------------------------------------------------------------ RMSNorm classes of other libraries


def _rms_norm_like(module: nn.Module) -> bool:
    """A class named like an RMSNorm (e.g. HuggingFace's LlamaRMSNorm) with a weight and an eps attribute."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
    )


def _foreign_rms_norm(module: nn.Module, backend):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        return None, f"its eps attribute is {eps!r}, not a number"
    weight = module.weight
    if weight.dim() != 1:
        return None, f"its weight has shape {tuple(weight.shape)}, expected one value per feature"
    if set(module.state_dict()) != {"weight"} or any(True for _ in module.children()):
        return None, f"its state ({sorted(module.state_dict())}) or submodules differ from RMSNorm's single weight"
    if weight.device.type == "meta":
        return None, "its weight is on the meta device: the output check needs real values"
    new = _take_parameters(
        RMSNorm(weight.shape[0], float(eps), backend=backend, **_factory(module)), module, ("weight",)
    )
    problem = _same_output(module, new, weight)
    return (None, problem) if problem else (new, None)


def _same_output(module: nn.Module, new: RMSNorm, weight: torch.Tensor) -> str | None:
    """Run a copy of the module and the replacement (torch backend: the formula, not a kernel, is in question) on a
    random input with a random weight; None when they agree within the dtype's bound."""
    probe = copy.deepcopy(module)
    ours = copy.deepcopy(new)
    ours.backend = "torch"
    generator = torch.Generator(device=weight.device).manual_seed(0)
    factory = {"device": weight.device, "dtype": weight.dtype, "generator": generator}
    x = torch.randn(3, 5, weight.shape[0], **factory)
    with torch.no_grad():
        random_weight = torch.rand(weight.shape, **factory) + 0.5  # not ones: a (1 + weight) variant must show
        probe.weight.copy_(random_weight)
        ours.weight.copy_(random_weight)
        try:
            expected = probe(x)
        except Exception as error:  # noqa: BLE001 - any failure means the structure is not the one assumed
            return f"calling it on a [3, 5, {weight.shape[0]}] input failed ({type(error).__name__}: {error})"
        got = ours(x)
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return "its output is not a tensor of the input's shape"
    # float64 gets fp32's bound: such classes commonly normalise in fp32 whatever the input dtype
    bound = RTOL.get(weight.dtype, RTOL[torch.float32])
    error = relative_rms_error(got, expected.to(got.dtype))
    if not error <= bound:
        return f"its output differs from rms_norm's on a random input (relative RMS error {error:.2e} > {bound:.0e})"
    return None


# ------------------------------------------------------------------ the walk


def _uses(model: nn.Module) -> Counter:
    """How many places (qualified names) hold each module instance."""
    return Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))


def _fusions(model: nn.Module, uses: Counter, backend, report: ReplaceReport) -> dict[int, nn.Module]:
    """Linear followed by a ReLU/GELU/SiLU inside a plain nn.Sequential -> Linear with that activation (the
    activation module becomes nn.Identity), where neither module is used elsewhere or hooked."""
    swaps: dict[int, nn.Module] = {}
    for prefix, seq in model.named_modules():
        if type(seq) is not nn.Sequential or _has_hooks(seq):
            continue
        children = list(seq._modules.items())
        for (name, first), (_, act) in zip(children, children[1:]):
            if type(first) is not nn.Linear or type(act) not in _FUSABLE or id(first) in swaps or id(act) in swaps:
                continue
            where = f"{prefix}.{name}" if prefix else name
            if uses[id(first)] > 1 or uses[id(act)] > 1:
                report.left.append(
                    Left(where, nn.Linear, "not fused with the next activation: one of them is also used elsewhere")
                )
                continue
            if _has_hooks(first) or _has_hooks(act):
                continue  # left with its reason by the per-module pass
            activation = _FUSABLE[type(act)] or ("gelu_tanh" if act.approximate == "tanh" else "gelu")
            swaps[id(first)], _ = _linear(first, backend, activation)
            swaps[id(act)] = nn.Identity()
    return swaps


def replace_modules(model: nn.Module, *, ops: Iterable[str] | None = None, backend: str | None = None) -> ReplaceReport:
    """Swap, in place, the modules of `model` that runtime.nn has an equivalent for, keeping their parameters.

    Replaced: nn.Linear (-> runtime.nn.Linear; fused with a following nn.ReLU / nn.GELU / nn.SiLU inside a plain
    nn.Sequential, the activation then becoming nn.Identity), nn.LayerNorm and nn.RMSNorm over the last dimension,
    nn.EmbeddingBag(mode="mean"), nn.GELU, nn.SiLU, and RMSNorm classes of other libraries (a class name ending in
    "RMSNorm" with a `weight` and a `variance_epsilon` or `eps` attribute, e.g. HuggingFace's LlamaRMSNorm) after a
    check on a copy that the replacement gives the same output on a random input. Only those exact torch classes:
    a subclass may compute something else and is left with a reason, as is a module with hooks.

    ops: the op kinds to replace, a subset of OP_KINDS (None: all). backend: the backend the replacements pin
    (None: they follow the active accelerator config). Returns a ReplaceReport; print it for a summary.
    """
    chosen = _check_ops(ops)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected None or one of {', '.join(BACKENDS)}, got {backend!r}")
    report = ReplaceReport()
    uses = _uses(model)
    swaps = _fusions(model, uses, backend, report) if "linear" in chosen else {}
    reasons: dict[int, str] = {}
    for name, module in model.named_modules():
        if id(module) in swaps or type(module).__module__.startswith("runtime.nn."):
            continue
        kind, convert = _CONVERTERS.get(type(module), (None, None))
        if convert is None:
            base = next((cls for cls in _CONVERTERS if isinstance(module, cls)), None)
            if base is not None and _CONVERTERS[base][0] in chosen:
                reasons[id(module)] = f"a subclass of {_class_name(base)}: its forward may differ, so it is kept"
            elif "rms_norm" in chosen and _rms_norm_like(module):
                kind, convert = "rms_norm", _foreign_rms_norm
        if convert is None or kind not in chosen:
            if id(module) in reasons:
                report.left.append(Left(name, type(module), reasons[id(module)]))
            continue
        if not name:
            report.left.append(
                Left(name, type(module), "the model itself cannot be swapped in place; use the runtime.nn module")
            )
            continue
        if _has_hooks(module):
            report.left.append(
                Left(name, type(module), "it has forward or backward hooks, which a new module would not carry")
            )
            continue
        new, reason = convert(module, backend)
        if new is None:
            report.left.append(Left(name, type(module), reason))
        else:
            swaps[id(module)] = new
    # every place that holds a swapped instance gets the same new one
    places = list(model.named_modules(remove_duplicate=False))
    order = {name: i for i, (name, _) in enumerate(places)}
    for name, module in places:
        for child_name, child in list(module._modules.items()):
            if child is not None and id(child) in swaps:
                path = f"{name}.{child_name}" if name else child_name
                new = swaps[id(child)]
                setattr(module, child_name, new)
                report.replaced.append(Replaced(path, type(child), type(new)))
    report.replaced.sort(key=lambda entry: order[entry.name])
    return report
