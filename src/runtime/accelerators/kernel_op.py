"""The bridge from an op's kernel backends to autograd (eager) and to torch.compile.

Each backend of an op declares its entry points as a KernelBackend (kernel_backend.py) at the end of its kernel
module, and the op's KernelOp takes a loader per backend, a function of the op's package that imports the declaration
and returns it: `backends={"triton": _triton_kernels, "tilelang": _tilelang_kernels}`, called on the backend's first
use so that the package imports without triton or tilelang. KernelOp reads nothing from a kernel module but that
declaration:

    forward(*args) -> tuple[Tensor, ...]
        the op's outputs first (`n_outputs` of them), then whatever backward needs
    backward(*grad_outputs, *args, *results) -> tuple
        one gradient (or None) per arg; `results` is everything forward returned
    infer(*args) -> tuple[Tensor, ...]    (optional)
        the op's outputs alone, as forward computes them: what an eager call with nothing to
        differentiate runs, so that it allocates and writes nothing for a backward that will not come
    native_forward(*args)    (optional)
        the op's outputs with the backward attached as a C++ node (runtime.accelerators.native), or None where
        that does not apply to these arguments: eager calls that need gradients try it first

Tensor arguments that no backend's backward reads (add_norm's x and residual: it reads their sum, an output) are named
in unread_args: eager calls save None in their place, so that they are not kept alive for backward (the custom ops
still save and pass them: the backward op returns a gradient for each tensor argument, shaped like it, and a None
in an argument's place would leave its fake without the shape and the tensor arguments without their order).

A backend's `backward_reads` says which of forward's results its backward reads, and so which are saved for it:
"results" (all), "saved" (not the op's outputs: an output kept for backward costs more to save and unpack than an
input; backward gets None in their place) or "arguments" (none: the backward recomputes what it needs, and gets None
for every result). Eager calls with "arguments" run `infer`, where there is one, also where gradients are needed;
the forward custom op, whose results the schema fixes, always runs forward, and its registered autograd saves and
passes what eager calls do (the backward op takes each result as `Tensor?`), so a compiled graph keeps no result
for a backward that does not read it.

Eager calls run them through an autograd.Function (one subclass per op and backend, holding both, so that
neither passes through autograd as an argument): no dispatcher in between. Under
torch.compile the same functions run as the custom ops `taac::<name>_forward` and
`taac::<name>_backward` (opaque to the compiler, with fake implementations for tracing),
so graphs hold one node per kernel launch. Backward always runs on the forward's backend.

Every tensor the custom ops return (outputs, saved results, gradients) is contiguous, whatever the layout of the
inputs: their fake implementations say so, and their real ones make it so (a kernel's results are contiguous
already; anything else is copied). The compiler checks a custom op's real strides against its fake ones, so this one
rule, applied here, keeps every op's fakes exact; an op's fake_forward gives only shapes and dtypes.

A kernel backward is not recorded by autograd: the gradients it returns under create_graph=True go through
no_double_backward, so that differentiating them again raises an error naming the op (eager and compiled paths, and
the ops' own autograd.Functions) instead of giving wrong second derivatives.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from . import native
from .kernel_backend import KernelBackend

_UNSET = object()


class KernelOp:
    """One op's kernel entry point.

    name:          the op's name in the custom ops `taac::<name>_forward` / `taac::<name>_backward` and in errors
                   (the folder's name, or `<folder>_<entry>` for a folder holding several ops: mhc_pre, mhc_post)
    args_schema:   the forward arguments in torch schema syntax, e.g. "Tensor x, Tensor? weight, float eps"
    n_outputs:     how many leading results of forward are returned to the caller
    n_saved:       how many further results forward returns for backward
    fake_forward:  (*args) -> tuple of empty tensors shaped like forward's results (for tracing)
    fake_takes_backend: fake_forward also takes the backend's name (keyword `backend`), for an op whose backends
                   save results of different dtypes
    backends:      backend name -> its loader: () -> the backend's KernelBackend, a function that imports it from the
                   kernel module (called on the backend's first use)
    unread_args:   names of tensor arguments no backend's backward reads (see the module docstring)
    check_values:  (*args) -> None, raising on argument values that tracing cannot read (the values of a tensor
                   argument): run by the forward custom op on its real arguments, so a compiled call checks what an
                   eager call checks before its launch
    in_graphs:     False for an op whose calls cannot be graph nodes (embedding_bag_mean's sparse weight gradient:
                   torch.compile does not trace sparse tensors, and a custom op's backward declares a gradient
                   shaped like its argument): no custom ops are registered (fake_forward may be None), and a call
                   under torch.compile runs eagerly outside the graph (a graph break), as the same eager call
    """

    def __init__(
        self,
        name: str,
        args_schema: str,
        n_outputs: int,
        n_saved: int,
        fake_forward: Callable | None,
        backends: dict[str, Callable[[], KernelBackend]],
        fake_takes_backend: bool = False,
        unread_args: tuple[str, ...] = (),
        check_values: Callable | None = None,
        in_graphs: bool = True,
    ) -> None:
        self.name = name
        for backend, loader in backends.items():
            if not callable(loader):  # a wrong declaration fails here, not at the first call
                raise TypeError(f"{name}: the {backend!r} backend's loader is not callable: {loader!r}")
        self.loaders = dict(backends)
        self.n_outputs = n_outputs
        self.n_saved = n_saved
        # which arguments are (optional) tensors, saved for backward, and which are plain values kept on ctx
        kinds = [argument.split()[0].startswith("Tensor") for argument in args_schema.split(",")]
        self.tensor_slots = tuple(i for i, is_tensor in enumerate(kinds) if is_tensor)
        self.value_slots = tuple(i for i, is_tensor in enumerate(kinds) if not is_tensor)
        self.n_args = len(kinds)
        self.n_tensors = len(self.tensor_slots)
        # tuple pickers (C-level, no Python loop per call): the tensor arguments, the plain values, and the
        # arguments in schema order from (tensor arguments + plain values); None where that is the order already
        self.tensors_of, self.values_of = _picker(self.tensor_slots), _picker(self.value_slots)
        names = [argument.split()[1] for argument in args_schema.split(",")]
        unknown = set(unread_args) - {names[i] for i in self.tensor_slots}
        if unknown:
            raise ValueError(f"unread_args: {sorted(unknown)} are not tensor arguments of {args_schema!r}")
        # the tensor arguments eager calls save: None in place of the unread ones
        kept = tuple(i if names[i] not in unread_args else None for i in self.tensor_slots)
        self.saved_tensors_of = self.tensors_of if not unread_args else _saving(kept, self.n_args)
        order = tuple(map((self.tensor_slots + self.value_slots).index, range(self.n_args)))
        self.in_schema_order = None if order == tuple(range(self.n_args)) else _picker(order)
        self._backends: dict[str, KernelBackend] = {}  # backend -> its loaded KernelBackend
        self._infer: dict = {}  # backend -> what eager calls with nothing to differentiate run: infer, else forward
        self._eager: dict = {}  # backend -> (the C-level apply, the _EagerFunction subclass) of eager calls
        self._native: dict = {}  # backend -> the KernelBackend's native_forward, or None (see _native_forward)
        self._outside_graphs: Callable | None = None  # in_graphs=False: __call__ under torch.compiler.disable
        self._forward_op = self._backward_op = None
        if in_graphs:
            if fake_forward is None:
                raise ValueError(f"{name}: fake_forward is required for an op whose calls are graph nodes")
            self._register_custom_ops(args_schema, fake_forward, fake_takes_backend, check_values)

    def _register_custom_ops(self, args_schema, fake_forward, fake_takes_backend, check_values) -> None:
        """The custom ops taac::<name>_forward / taac::<name>_backward, their fakes and their autograd."""
        name, n_outputs, n_saved = self.name, self.n_outputs, self.n_saved
        n_results = n_outputs + n_saved
        results = ", ".join(["Tensor"] * n_results)
        grads = ", ".join(f"Tensor grad{i}" for i in range(n_outputs))
        saved = ", ".join(f"Tensor? result{i}" for i in range(n_results))  # None: not saved (backward_reads)
        returns = "Tensor" if n_results == 1 else f"({results})"
        self._forward_op = torch.library.custom_op(
            f"taac::{name}_forward",
            _run_forward(name, self.kernels, n_results, check_values),
            mutates_args=(),
            schema=f"(str backend, {args_schema}) -> {returns}",
        )
        if fake_takes_backend:
            fake = fake_forward
        else:
            fake = lambda *args, backend: fake_forward(*args)  # noqa: E731
        self._forward_op.register_fake(
            lambda backend, *args: _unwrap_single(_contiguous_fakes(fake(*args, backend=backend)))
        )
        self._backward_op = torch.library.custom_op(
            f"taac::{name}_backward",
            _run_backward(name, self.kernels, n_outputs, n_results),
            mutates_args=(),
            schema=f"(str backend, {grads}, {args_schema}, {saved}) -> Tensor[]",
        )
        self._backward_op.register_fake(_fake_backward(n_outputs, n_results))
        self._forward_op.register_autograd(self._compiled_backward, setup_context=self._save)

    def __call__(self, backend: str, *args):
        """Run the op on `backend` ("triton" or "tilelang"), differentiably."""
        if torch.compiler.is_compiling():
            if self._forward_op is None:  # in_graphs=False
                return (self._outside_graphs or self._call_outside_graphs())(backend, *args)
            results = self._forward_op(backend, *args)
        else:
            if torch.is_grad_enabled():
                for i in self.tensor_slots:
                    arg = args[i]
                    if arg is not None and arg.requires_grad:
                        return self._apply_eagerly(backend, args)  # what the op returns
            # nothing to differentiate: skip autograd's bookkeeping, and the saved results where the backend can
            results = (self._infer.get(backend) or self._inference(backend))(*args)
        if not isinstance(results, tuple):
            return results
        return results[0] if self.n_outputs == 1 else results[: self.n_outputs]

    def _call_outside_graphs(self) -> Callable:
        """__call__ under torch.compiler.disable: the call runs eagerly, a graph break (in_graphs=False). Made on first
        use: torch.compiler.disable imports torch._dynamo, over a second at import."""
        self._outside_graphs = torch.compiler.disable(self.__call__)
        return self._outside_graphs

    def _apply_eagerly(self, backend: str, args):
        """The backend's native_forward where it has one (the backward a C++ node), else the backend's
        autograd.Function applied without its Python layer (about 2 us per call; apply_eagerly). Returns what the op
        returns."""
        native_forward = self._native.get(backend, _UNSET)
        if native_forward is _UNSET:
            native_forward = self._native_forward(backend)
        if native_forward is not None and not torch._C._are_functorch_transforms_active():
            results = native_forward(*args)
            if results is not None:
                return results
        apply, function = self._eager.get(backend) or self._eager_function(backend)
        return apply_eagerly(function, apply, args, self.tensor_slots)

    def _inference(self, backend: str) -> Callable:
        kernels = self.kernels(backend)
        found = self._infer[backend] = kernels.infer or kernels.forward
        return found

    def _native_forward(self, backend: str):
        """The backend's native_forward(*args): the op's outputs with the backward attached as a C++ node
        (runtime.accelerators.native), or None where it does not apply. None where the backend has none or native
        nodes cannot run here."""
        found = self.kernels(backend).native_forward
        if found is not None and native.reasons():
            found = None
        self._native[backend] = found
        return found

    def _eager_function(self, backend: str) -> tuple:
        kernels = self.kernels(backend)
        first_saved = kernels.first_saved(self.n_outputs, self.n_outputs + self.n_saved)
        # nothing saved from forward's results ("arguments"): infer where there is one
        run_forward = (kernels.infer or kernels.forward) if kernels.backward_reads == "arguments" else kernels.forward
        attributes = {
            "kernel_op": self,
            "backend": backend,
            "run_forward": staticmethod(run_forward),
            "run_backward": staticmethod(kernels.backward or _no_backward(self.name, backend)),
            "first_saved": first_saved,
            "unsaved": (None,) * first_saved,
        }
        function = type(f"{self.name}_forward_{backend}", (_EagerFunction,), attributes)
        found = self._eager[backend] = c_apply(function), function
        return found

    def kernels(self, backend: str) -> KernelBackend:
        """The backend's KernelBackend (its loader called on first use, then a dict lookup)."""
        kernels = self._backends.get(backend)
        if kernels is None:
            loader = self.loaders.get(backend)
            if loader is None:
                raise ValueError(f"{self.name}: no {backend!r} kernels; it has {', '.join(self.loaders)}")
            kernels = loader()
            if not isinstance(kernels, KernelBackend):
                raise TypeError(
                    f"{self.name}: the {backend!r} backend's loader returned {type(kernels).__name__}, "
                    "expected a KernelBackend"
                )
            self._backends[backend] = kernels
        return kernels

    def _save(self, ctx, inputs, output) -> None:
        """Keep what backward needs: tensors through save_for_backward, plain values on ctx; of forward's results, those
        the backend's backward reads (its backward_reads), as eager calls do."""
        backend, args = inputs[0], inputs[1:]
        ctx.backend = backend
        ctx.values = self.values_of(args)
        ctx.first_saved = self.kernels(backend).first_saved(self.n_outputs, self.n_outputs + self.n_saved)
        ctx.save_for_backward(*self.tensors_of(args), *_as_tuple(output)[ctx.first_saved :])

    def _saved(self, ctx) -> tuple[tuple, tuple]:
        """(the forward's arguments, its results, None for each one not saved) from ctx."""
        saved = ctx.saved_tensors
        results = (None,) * ctx.first_saved + saved[self.n_tensors :]
        return self.arguments(saved[: self.n_tensors], ctx.values), results

    def arguments(self, tensors: tuple, values: tuple) -> tuple:
        """The forward's arguments in schema order, from its tensor arguments and its plain values."""
        merged = tensors + values
        return merged if self.in_schema_order is None else self.in_schema_order(merged)

    def _compiled_backward(self, ctx, *grads):
        # grads are never None here: autograd materialises missing output gradients as zeros (materialize_grads)
        args, results = self._saved(ctx)
        flat = self._backward_op(ctx.backend, *grads[: self.n_outputs], *args, *results)
        return no_double_backward(self.name, ctx.backend, (None, *_unflatten_grads(args, flat)), args)


class _EagerFunction(torch.autograd.Function):
    """Subclassed per op and backend (KernelOp._eager_function), with these class attributes."""

    kernel_op: KernelOp
    backend: str
    run_forward: Callable  # the backend's forward, or its infer where backward reads only the arguments
    run_backward: Callable  # the backend's backward
    first_saved: int  # the results from this one on are saved for backward
    unsaved: tuple  # None for each result not saved, passed to backward in its place

    @staticmethod
    def forward(ctx, *args):
        function = ctx._forward_cls
        kernel_op = function.kernel_op
        results = function.run_forward(*args)
        if not isinstance(results, tuple):
            results = (results,)
        ctx.values = kernel_op.values_of(args)
        ctx.save_for_backward(*kernel_op.saved_tensors_of(args), *results[function.first_saved :])
        return results[0] if kernel_op.n_outputs == 1 else results[: kernel_op.n_outputs]

    @staticmethod
    def backward(ctx, *grads):
        # grads are never None here: autograd materialises missing output gradients as zeros (materialize_grads)
        function = ctx._forward_cls
        kernel_op = function.kernel_op
        saved = ctx.saved_tensors
        n_tensors = kernel_op.n_tensors
        args = saved[:n_tensors] + ctx.values  # as kernel_op.arguments, inline
        if kernel_op.in_schema_order is not None:
            args = kernel_op.in_schema_order(args)
        grads_in = tuple(
            function.run_backward(*grads, *args, *function.unsaved, *saved[n_tensors:])
        )  # a list would be 1
        if torch.is_grad_enabled():  # create_graph=True
            return no_double_backward(kernel_op.name, function.backend, grads_in, args)
        return grads_in


def no_double_backward(op: str, backend: str, grads: tuple, inputs: tuple) -> tuple:
    """A kernel backward's gradients (one per forward argument, None where there is none), as they are outside grad
    mode. Under it (create_graph=True) each comes out of a node that raises, naming the op, when a second backward
    reaches it: the node has an edge to each of the forward's `inputs` that requires grad, so a second backward
    towards them runs it. Autograd does not record a kernel, so without this a second derivative would miss the
    kernel's dependence on the inputs: silently absent (None, or zero with allow_unused) or wrong."""
    if not torch.is_grad_enabled():
        return grads
    present = [
        i for i, g in enumerate(grads) if isinstance(g, torch.Tensor) and (g.is_floating_point() or g.is_complex())
    ]
    if not present:
        return grads
    message = (
        f"{op}: double backward is not supported on the {backend} backend: its backward is a kernel that autograd does "
        "not record, so the gradients it returned (with create_graph=True) cannot be differentiated again; "
        "backend='torch' differentiates twice where the torch ops it calls do (torch's attention kernels and "
        "F.embedding_bag do not)"
    )
    edges = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    gradients = [grads[i] if grads[i].requires_grad else grads[i].detach().requires_grad_() for i in present]
    outputs = torch._C._functions.DelayedError(message, len(gradients) + len(edges))(*gradients, *edges)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    result = list(grads)
    for i, g in zip(present, outputs):
        result[i] = g
    return tuple(result)


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def c_apply(function: type) -> Callable:
    """What `function.apply` ends in, without its Python layer (see apply_eagerly)."""
    return super(torch.autograd.Function, function).apply


def apply_eagerly(function: type, apply: Callable, args, tensor_slots: tuple[int, ...]):
    """function.apply(*args) through `apply` (c_apply(function)) where no functorch transform is active: the Python
    layer binds default arguments (autograd.Functions here have none) and unwraps dead functorch wrappers, done
    here for the arguments at tensor_slots."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    args = list(args)
    for i in tensor_slots:
        if args[i] is not None:
            args[i] = _unwrap_if_dead(args[i])
    return apply(*args)


# helpers -------------------------------------------------------------------------------


def _no_backward(name: str, backend: str) -> Callable:
    """The backward of a forward-only backend: an input may require a gradient (a per-row temperature tensor) while
    the outputs take none (sampled ids), so the forward runs and only a backward that is asked for fails."""

    def backward(*args):
        raise RuntimeError(f"{name}: the {backend} backend has no backward (its kernels are forward-only)")

    return backward


def _picker(indices: tuple[int, ...]) -> Callable[[tuple], tuple]:
    """A tuple -> tuple(items[i] for i in indices), C-level (no Python frame): a slice where the indices follow one
    another (none, one, or tensors then values as most schemas have them), else an itemgetter of two or more."""
    if not indices:
        return operator.itemgetter(slice(0, 0))
    first, last = indices[0], indices[-1]
    if indices == tuple(range(first, last + 1)):
        return operator.itemgetter(slice(first, last + 1))
    return operator.itemgetter(*indices)


def _saving(kept: tuple[int | None, ...], n_args: int) -> Callable[[tuple], tuple]:
    """args -> tuple(args[i] or None where i is None for i in kept): the tensor arguments eager calls save, None in
    place of an unread one; C-level but for one frame (an itemgetter on the arguments and one None past them)."""
    if all(i is None for i in kept):
        nones = (None,) * len(kept)
        return lambda args: nones
    pick = _picker(tuple(n_args if i is None else i for i in kept))
    if len(kept) == 1:
        return pick
    past = (None,)
    return lambda args: pick(args + past)


def _as_tuple(results) -> tuple:
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)


def _unwrap_single(results: tuple):
    return results[0] if len(results) == 1 else results


def _contiguous_fakes(results) -> tuple:
    """The custom ops' layout rule on the fake side: each result contiguous, with the shape and dtype it was given."""
    return tuple(torch.empty_like(r, memory_format=torch.contiguous_format) for r in _as_tuple(results))


def _run_forward(name: str, kernels: Callable[[str], KernelBackend], n_results: int, check_values: Callable | None):
    def forward(backend, *args):
        if check_values is not None:
            check_values(*args)
        results = _as_tuple(kernels(backend).forward(*args))
        if len(results) != n_results:
            raise RuntimeError(f"{name}: the {backend} forward returned {len(results)} tensors, expected {n_results}")
        return _unwrap_single(tuple(r.contiguous() for r in results))  # the layout rule (module docstring)

    return forward


def _run_backward(name: str, kernels: Callable[[str], KernelBackend], n_outputs: int, n_results: int):
    def backward(backend, *flat):
        grads, rest = flat[:n_outputs], flat[n_outputs:]
        args, results = rest[: len(rest) - n_results], rest[len(rest) - n_results :]
        run_backward = kernels(backend).backward
        if run_backward is None:
            raise RuntimeError(f"{name}: the {backend} backend has no backward")
        grads_in = run_backward(*grads, *args, *results)
        # Tensor[] cannot hold None: return the gradients of the tensor arguments present.
        # A custom op's outputs may alias neither its inputs nor one another: copy a gradient passed
        # straight through (dropout_add's residual gets the incoming gradient) or sharing memory with
        # another (mhc's dalpha and dbias are slices of one sum); eager calls need no copy.
        taken = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        returned = []
        for a, g in zip(args, grads_in):
            if not isinstance(a, torch.Tensor):
                continue
            if g is None:
                g = torch.zeros_like(a, memory_format=torch.contiguous_format)
            elif g.untyped_storage().data_ptr() in taken:
                g = g.clone(memory_format=torch.contiguous_format)
            else:
                g = g.contiguous()  # the layout rule (module docstring)
            taken.add(g.untyped_storage().data_ptr())
            returned.append(g)
        return returned

    return backward


def _fake_backward(n_outputs: int, n_results: int):
    def fake(backend, *flat):
        rest = flat[n_outputs:]
        args = rest[: len(rest) - n_results]
        return [torch.empty_like(a, memory_format=torch.contiguous_format) for a in args if isinstance(a, torch.Tensor)]

    return fake


def _unflatten_grads(args, flat) -> list:
    grads, it = [], iter(flat)
    for a in args:
        grads.append(next(it) if isinstance(a, torch.Tensor) else None)
    return grads
