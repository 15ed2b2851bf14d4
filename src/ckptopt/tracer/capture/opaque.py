"""Submodules that read a tensor's value, kept as one op measured by running them.

``torch.export`` follows a forward on fake tensors, which carry shapes but no values, so a
submodule whose forward branches on a value (LayerDrop's ``if torch.rand([]) < p``, an MoE
router's ``.tolist()``, an ``assert`` on activations) stops the whole capture. Such a
submodule becomes one op of the graph instead (:class:`OpaqueModule`, kept whole by
:mod:`.functions`), and the rest of the model is captured as usual:

* **Run time.** The op's kernel runs the submodule's own forward on the op's inputs, with the
  submodule's parameters (op inputs too) swapped in, and autograd records it as it records the
  unmodified model: the backward is the submodule's own graph, in the same backward pass as
  the rest of the model (so a checkpoint around the op recomputes it once, and hooks see plain
  autograd). The submodule's ops, random draws and saved tensors are exactly those of the
  unmodified model. An output that aliases an input is returned as a copy (an op's outputs
  alias nothing); the copy is part of what is measured.
* **Measurement.** On fake tensors the op cannot run the submodule, so it replays what the
  submodule did on the example batch, measured once on real tensors with the exact storage
  tracker (:func:`profile`): the outputs' layouts, the forward's high points before and after
  its last saved tensor, the storages its graph keeps (and which inputs and outputs it
  saves), the backward's high points before and after its outputs' gradients go, and which
  inputs got gradients. The figures hold for the example's shapes (the capture is at those
  shapes; another shape is another capture, measured on its own batch) and, where the
  submodule draws random numbers (LayerDrop), for the draws the example made. The replay's
  nodes and why they are ordered as they are: docs/design.md §11.

A submodule qualifies when every output is a tensor or None (a Python value it computed
from data would be frozen into the graph), it is called through its ``forward`` with no
symbolic value among its arguments, and its parameters are plain tensors. Its BatchNorms are
hooked by the rewriter as the FX front end's opaque layers are, so a recomputation leaves
their running statistics alone.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ...storages import storage_identity
from ...torch_utils import exception_chain, is_fake
from ..flops import add_replayed_flops, count_flops, not_counted

__all__ = ["OpaqueCall", "OpaqueModule", "NotOpaque", "opaque_modules", "culprit", "parent_of", "eligible",
           "submodule_of_op", "example_calls", "profile", "opaque_note", "starting_with", "forced"]


@dataclass
class Profile:
    """What one call of the submodule did on the example batch, in bytes above its start.

    ``forward_peak``: the forward's high point (outputs and kept storages included); ``kept``:
    sizes of the storages the forward leaves behind other than its inputs and outputs (its
    graph's saved tensors); ``saved_inputs``/``saved_outputs``: positions of the op's inputs and
    outputs its graph saves; ``backward_peak``: the backward's high point above its start (the
    kept storages counted at the start, the outputs' gradients held); ``grads_for``: the op inputs
    that got a gradient."""

    forward_peak: int
    before_pack: int  # the forward's high point up to its last saved tensor (where a recomputation stops)
    kept: list[int]
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    backward_peak: int
    backward_after: int  # the backward's high point after its outputs' gradients went (same reference)
    grads_for: tuple[int, ...]
    flops: int  # the forward's compute, counted as the tracer counts a layer's (tracer/flops.py)


@dataclass
class _Leaf:
    """How an output sits in its storage: ``group`` (outputs sharing a storage share a group),
    the group's bytes, and the view."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    offset: int
    group: int
    group_bytes: int


@dataclass(eq=False)
class OpaqueCall:
    """One call of a submodule, its non-tensor arguments fixed; the op's inputs are the call's
    tensors followed by the submodule's parameters."""

    module: nn.Module
    path: str
    in_spec: Any
    template: list  # the call's pytree leaves, tensors replaced by None
    slots: list[int]  # positions of the tensor leaves in ``template``
    shapes: list[tuple[int, ...]]  # of the call's tensors, as captured
    param_names: list[str]
    out_spec: Any
    out_slots: list[int]
    out_leaves: list[_Leaf]
    example: list[torch.Tensor] | None = None  # the call's tensors on the example batch (until profiled)
    rng: Any = None  # the random number generators' states at the example's call
    profile: Profile | None = None
    random: bool = False  # whether the example's call drew random numbers
    used: set[int] | None = None  # the outputs the model reads (they get gradients); None: all
    needs_grad: list[bool] = field(default_factory=list)  # of the call's tensors, as captured

    # -- run time -------------------------------------------------------------------------------
    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The submodule's own forward on the op's inputs, recorded by autograd as the unmodified model
        records it (the op's autograd kernel: its backward is the submodule's graph, in the same
        backward pass as the rest of the model)."""
        n = len(self.slots)
        args, kwargs = self.arguments(tensors[:n])
        out = torch.func.functional_call(self.module, dict(zip(self.param_names, tensors[n:])), tuple(args),
                                         kwargs, tie_weights=False)
        flat, spec = pytree.tree_flatten(out)
        if spec != self.out_spec:
            raise RuntimeError(f"ckptopt: the submodule {self.path}, run as one op, returned another structure "
                               "than on the example batch; plan again with this batch")
        given = {storage_identity(t) for t in tensors if t.numel()}
        return [o.clone() if o.numel() and storage_identity(o) in given else o
                for o in (flat[i] for i in self.out_slots)]

    def arguments(self, tensors: list) -> tuple[list, dict]:
        leaves = list(self.template)
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return list(args), dict(kwargs)

    def rebuild(self, outs: Any) -> Any:
        leaves: list = [None] * self.out_spec.num_leaves  # (the others are None)
        for i, t in zip(self.out_slots, outs):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.out_spec)

    # -- on fake tensors --------------------------------------------------------------------------
    @property
    def n_inputs(self) -> int:
        return len(self.slots) + len(self.param_names)

    def check(self, tensors: list[torch.Tensor]) -> None:
        for t, want in zip(tensors, self.shapes):
            if tuple(t.shape) != tuple(want):
                raise RuntimeError(f"ckptopt: the submodule {self.path}, run as one op, is called with shape "
                                   f"{tuple(t.shape)}; it was measured at {tuple(want)}")

    def replay_kept(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The storages the forward keeps, after its high point up to its last saved tensor."""
        p, device = self.profile, tensors[0].device
        _count(self)
        with not_counted():
            kept = [torch.empty(b, dtype=torch.uint8, device=device) for b in p.kept]
        _touch(p.before_pack - sum(p.kept), device)
        return kept + [tensors[i] for i in p.saved_inputs]

    def replay_outputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs, and the forward's high point after its last saved tensor."""
        device = tensors[0].device if tensors else torch.device("cpu")
        buffers: dict[int, torch.Tensor] = {}
        outs = []
        with not_counted():
            for leaf in self.out_leaves:
                if leaf.group not in buffers:
                    buffers[leaf.group] = torch.empty(leaf.group_bytes, dtype=torch.uint8, device=device)
                outs.append(_view(buffers[leaf.group], leaf))
        p = self.profile
        if p is not None:
            _touch(p.forward_peak - sum(p.kept) - sum(b.numel() for b in buffers.values()), device)
        return outs


def _view(buffer: torch.Tensor, leaf: _Leaf) -> torch.Tensor:
    size = torch.empty((), dtype=leaf.dtype).element_size()
    whole = buffer[: buffer.numel() // size * size].view(leaf.dtype)
    return whole.as_strided(leaf.shape, leaf.stride, leaf.offset)


def _touch(nbytes: int, device: torch.device) -> None:
    """Allocate ``nbytes`` and let them go (a high point the replay reaches)."""
    if nbytes > 0:
        with not_counted():
            torch.empty(nbytes, dtype=torch.uint8, device=device)


class OpaqueModule(torch.autograd.Function):
    """The class :mod:`.functions` keeps whole as one op per :class:`OpaqueCall`; the op's kernel calls
    :meth:`ckptopt_apply`. On real tensors it runs the submodule itself (:meth:`OpaqueCall.run`).
    On fake tensors it replays the call's measured memory with two nodes: :class:`_ReplayOutputs`
    saves the kept storages (so the tracer's pack hooks see them) and reaches the backward's high
    point; autograd lets its saved storages go when it returns, and only then
    :class:`_ReplayGradients` makes the input and parameter gradients, as the submodule's own
    backward freed what it saved while it made them."""

    @staticmethod
    def ckptopt_apply(call: OpaqueCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if any(is_fake(t) or t.is_meta for t in tensors):
            # the graph reaches only the inputs the example's call gave gradients (an expert no token
            # was routed to gets none, as in the model): the tracer charges gradients by what it reaches
            call.check(list(tensors))
            if call.profile is None:  # (while exporting: the outputs, needing gradients as the real ones do)
                return _Shapes.apply(call, *tensors)
            token = _ReplayGradients.apply(call, tensors[0].device, *(tensors[k] for k in call.profile.grads_for))
            link: dict[str, int] = {}  # (what the outputs' node lets go before the kept storages' node runs)
            token = _ReplayKept.apply(call, link, token, *(t.detach() for t in tensors))
            token = _ReplayBackward.apply(call, link, token)
            return _ReplayOutputs.apply(call, link, token, *(t.detach() for t in tensors))
        return tuple(call.run(list(tensors)))

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        raise RuntimeError("ckptopt: OpaqueModule is applied through its op (ckptopt_apply)")


class _Seed(torch.autograd.Function):
    """A root whose backward hands each output a gradient of ones that autograd owns (and frees once
    used), as the model's backward hands the submodule its outputs' gradients; ``freed`` is called as
    each one goes."""

    @staticmethod
    def forward(ctx: Any, freed: Any, *outs: torch.Tensor) -> torch.Tensor:
        ctx.freed, ctx.like = freed, [(o.shape, o.dtype, o.device) for o in outs]
        return torch.zeros((), device=outs[0].device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        grads = tuple(torch.ones(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)
        for g in grads:
            weakref.finalize(g.untyped_storage(), ctx.freed).atexit = False
        return (None, *grads)


def _quiet(ctx: Any, outs: list[torch.Tensor]) -> None:
    quiet = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
    if quiet:
        ctx.mark_non_differentiable(*quiet)


class _Shapes(torch.autograd.Function):
    """The outputs alone (while exporting, before the call is measured); they need gradients where an
    input does, so the submodules after this one are captured with inputs that do."""

    @staticmethod
    def forward(ctx: Any, call: OpaqueCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = call.replay_outputs(list(tensors))
        _quiet(ctx, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        raise RuntimeError("ckptopt: an opaque submodule was differentiated before it was measured")


class _ReplayGradients(torch.autograd.Function):
    """The replay's node next to the inputs that get gradients: its backward makes them."""

    @staticmethod
    def forward(ctx: Any, call: OpaqueCall, device: torch.device, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.like = tensors
        return torch.empty(0, device=device)  # (no storage: nothing to count)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        return (None, None, *(torch.empty_like(t) if need else None
                              for t, need in zip(ctx.like, ctx.needs_input_grad[2:])))


class _ReplayKept(torch.autograd.Function):
    """The storages the forward keeps, saved (the tracer's pack hooks see them); read back by its
    backward, which lets them go."""

    @staticmethod
    def forward(ctx: Any, call: OpaqueCall, link: dict, token: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.n = len(tensors)
        ctx.save_for_backward(*call.replay_kept(list(tensors)))
        return torch.empty(0, device=token.device)

    @staticmethod
    def backward(ctx: Any, token: torch.Tensor) -> tuple:
        held = ctx.saved_tensors  # (a checkpoint's recomputed copies go once read)
        del held
        return (None, None, torch.empty(0, device=token.device), *([None] * ctx.n))


class _ReplayBackward(torch.autograd.Function):
    """The submodule's backward: saves one empty tensor after the kept storages (so a recomputation
    stops here, after the submodule's last saved tensor, and reading it triggers one, as the
    submodule's first backward node does), then reaches the backward's high points, before and
    after the outputs' gradients go."""

    @staticmethod
    def forward(ctx: Any, call: OpaqueCall, link: dict, token: torch.Tensor) -> torch.Tensor:
        ctx.call, ctx.link = call, link
        ctx.save_for_backward(torch.empty(0, device=token.device))
        return torch.empty(0, device=token.device)

    @staticmethod
    def backward(ctx: Any, token: torch.Tensor) -> tuple:
        held = ctx.saved_tensors
        del held
        p = ctx.call.profile
        _touch(p.backward_peak, token.device)
        grads = ctx.link.pop("grads", ())
        given = sum(g.numel() * g.element_size() for g in grads if g is not None)
        del grads  # (gone, unless the model holds them elsewhere: a residual branch's gradient)
        _touch(p.backward_after + given, token.device)
        return None, None, torch.empty(0, device=token.device)


class _ReplayOutputs(torch.autograd.Function):
    """The outputs and the rest of the forward's high point; its backward hands the outputs'
    gradients on (held until the submodule's backward has reached its first high point)."""

    @staticmethod
    def forward(ctx: Any, call: OpaqueCall, link: dict, token: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.call, ctx.link, ctx.device = call, link, token.device
        outs = call.replay_outputs(list(tensors))
        ctx.save_for_backward(*(outs[i] for i in call.profile.saved_outputs))
        _quiet(ctx, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        held = ctx.saved_tensors
        del held
        ctx.link["grads"] = grads
        return (None, None, torch.empty(0, device=ctx.device), *([None] * ctx.call.n_inputs))


def _count(call: OpaqueCall) -> None:
    if call.profile is not None:
        add_replayed_flops(call.profile.flops)


# -- which submodule, and its example calls ---------------------------------------------------------
_forced = threading.local()


@contextmanager
def starting_with(modules: list[nn.Module]) -> Iterator[None]:
    """While active, an export capture runs ``modules`` (and their classes) as one op each from the
    start: the graph captured without them reads values that measuring on fake tensors cannot follow."""
    _forced.modules = list(modules)
    try:
        yield
    finally:
        _forced.modules = []


def forced() -> list[nn.Module]:
    return list(getattr(_forced, "modules", []))

class NotOpaque(Exception):
    """``module`` cannot be one op (the message says why)."""

    def __init__(self, why: str, module: nn.Module | None = None):
        super().__init__(why)
        self.module = module


def culprit(exc: BaseException, model: nn.Module) -> nn.Module | None:
    """The innermost submodule of ``model`` (not the model itself) whose method is on the stack of
    ``exc`` or of an exception in its chain."""
    inside = {id(m): m for m in model.modules() if m is not model}
    for e in exception_chain(exc):
        found, tb = None, e.__traceback__
        while tb is not None:
            s = tb.tb_frame.f_locals.get("self")
            if isinstance(s, nn.Module) and id(s) in inside:
                found = s
            tb = tb.tb_next
        if found is not None:
            return found
    return None


def submodule_of_op(target: Any) -> nn.Module | None:
    """The submodule an fx node target runs as one op, or None (the rewriter hooks its BatchNorms, so
    a recomputation does not update their running statistics twice)."""
    from .functions import first_argument

    call = first_argument(target)
    return call.module if isinstance(call, OpaqueCall) else None


def parent_of(module: nn.Module, model: nn.Module) -> nn.Module | None:
    """The nearest submodule of ``model`` that holds ``module`` and is called (not a ModuleList), or
    None when that is the model itself."""
    path = {m: name for name, m in model.named_modules(remove_duplicate=False)}.get(module)
    while path:
        path = path.rpartition(".")[0]
        if not path:
            return None
        parent = model.get_submodule(path)
        if type(parent).forward is not nn.Module.forward:  # (ModuleList, ModuleDict: never called)
            return parent
    return None


def eligible(module: nn.Module) -> str | None:
    """Why ``module`` cannot run as one op, or None. (Its BatchNorms may update running statistics:
    the rewriter keeps a recomputation from updating them again, :func:`submodule_of_op`.)"""
    for name, p in module.named_parameters():
        if type(p) not in (torch.Tensor, nn.Parameter):
            return f"its parameter {name} is a {type(p).__name__}"
    return None


@dataclass
class _Example:
    """One call of a submodule on the example batch."""

    args: tuple
    kwargs: dict
    out_spec: Any
    out_slots: list[int]
    out_leaves: list[_Leaf]
    rng: Any
    random: bool


def _rng_state(devices: list[int]) -> tuple:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_state(state: tuple, devices: list[int]) -> None:
    torch.set_rng_state(state[0])
    for d, s in zip(devices, state[1]):
        torch.cuda.set_rng_state(s, d)


def _cuda_devices(tensors: Any) -> list[int]:
    return sorted({t.device.index or 0 for t in pytree.tree_leaves(tensors)
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})


def _layout(outs: list[torch.Tensor], given: set[int]) -> list[_Leaf]:
    """Each output's place in memory as the op returns it: outputs sharing a storage share a group,
    and one that aliases an input is a contiguous copy (:meth:`OpaqueCall.run`)."""
    groups: dict[int, int] = {}
    leaves = []
    for o in outs:
        key = storage_identity(o) if o.numel() else None
        if key is None or key in given:
            group = -1 - len(leaves)  # a storage of its own
            nbytes = o.numel() * o.element_size()
            leaves.append(_Leaf(tuple(o.shape), o.dtype, tuple(torch.empty(o.shape).stride()), 0, group, nbytes))
            continue
        group = groups.setdefault(key, len(groups))
        leaves.append(_Leaf(tuple(o.shape), o.dtype, tuple(o.stride()), o.storage_offset(), group,
                            o.untyped_storage().nbytes()))
    return leaves


@contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """The module's buffers as they were, after running it to look (BatchNorm's running statistics
    would otherwise count the runs that planning makes)."""
    saved = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _frozen(obj: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, obj)


def example_calls(target: nn.Module, call_args: tuple, call_kwargs: dict,
                  modules: list[nn.Module]) -> dict[nn.Module, list[_Example]]:
    """Run ``target`` once on the example (no gradients, the caller's random state left as it was)
    and keep each call of ``modules``: its arguments, output and the random state it started from.

    Raises :class:`NotOpaque` when one of them returns something other than tensors or None."""
    devices = _cuda_devices((call_args, call_kwargs))
    calls: dict[nn.Module, list[_Example]] = {m: [] for m in modules}
    starts: dict[nn.Module, Any] = {}
    handles = []

    def before(module, args, kwargs):
        starts[module] = (_frozen(args), _frozen(kwargs), _rng_state(devices))

    def after(module, args, kwargs, out):
        flat, spec = pytree.tree_flatten(out)
        bad = sorted({type(x).__name__ for x in flat if x is not None and not isinstance(x, torch.Tensor)})
        if bad:
            raise NotOpaque(f"{type(module).__name__} returns {', '.join(bad)} beside tensors", module)
        a, k, rng = starts.pop(module)
        given = {storage_identity(t) for t in (*pytree.tree_leaves((args, kwargs)), *module.parameters())
                 if isinstance(t, torch.Tensor) and t.numel()}
        slots = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        layout = _layout([x for x in flat if isinstance(x, torch.Tensor)], given)
        calls[module].append(_Example(a, k, spec, slots, layout,
                                      rng, not _state_equal(_rng_state(devices), rng)))

    for m in modules:
        handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(m.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), _buffers_kept(target):
            target(*call_args, **call_kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _state_equal(a: Any, b: Any) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@contextmanager
def opaque_modules(model: nn.Module, examples: dict[nn.Module, list[_Example]]) -> Iterator[list[OpaqueCall]]:
    """While active, each call of these submodules is one :class:`OpaqueModule` op (the k-th call is
    measured on the k-th call of the example); yields the calls made, to :func:`profile` after capture."""
    made: list[OpaqueCall] = []
    paths = {m: name for name, m in model.named_modules(remove_duplicate=False)}
    counts = dict.fromkeys(examples, 0)
    had = {m: m.__dict__.get("forward") for m in examples}

    def opaque_forward(module: nn.Module):
        def forward(*args: Any, **kwargs: Any) -> Any:
            k = counts[module]
            counts[module] += 1
            seen = examples[module]
            if k >= len(seen):
                raise NotOpaque(f"{paths[module]} runs more often while capturing than on the example", module)
            example = seen[k]
            flat, spec = pytree.tree_flatten((args, kwargs))
            known, known_spec = pytree.tree_flatten((example.args, example.kwargs))
            if known_spec != spec:
                raise NotOpaque(f"{paths[module]} is called with other arguments while capturing", module)
            symbolic = [type(x).__name__ for x in flat if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))]
            if symbolic:  # (a value its caller read from a tensor: it would be frozen into the op)
                raise NotOpaque(f"{paths[module]} is called with a {symbolic[0]}", module)
            slots = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
            names = [n for n, _ in module.named_parameters()]
            call = OpaqueCall(module, paths[module], spec, [None if i in slots else x for i, x in enumerate(flat)],
                              slots, [tuple(flat[i].shape) for i in slots], names, example.out_spec,
                              example.out_slots, example.out_leaves, example=[known[i] for i in slots], rng=example.rng,
                              random=example.random, needs_grad=[flat[i].requires_grad for i in slots])
            made.append(call)
            outs = OpaqueModule.apply(call, *(flat[i] for i in slots), *(p for _, p in module.named_parameters()))
            return call.rebuild(outs)
        return forward

    def new_pass(*_: Any) -> None:  # each export attempt runs the model's forward from the start
        counts.update(dict.fromkeys(counts, 0))
        made.clear()

    for m in examples:
        m.forward = opaque_forward(m)
    handle = model.register_forward_pre_hook(new_pass)
    try:
        yield made
    finally:
        handle.remove()
        for m, f in had.items():
            if f is None:
                del m.forward
            else:
                m.forward = f


def profile(call: OpaqueCall) -> None:
    """Measure ``call`` once on its example (the exact storage tracker; the example's random state):
    sets ``call.profile`` and lets the example go."""
    from ...tracker import StorageTracker

    params = [p for _, p in call.module.named_parameters()]
    given = [t.detach().requires_grad_(need) if need else t for t, need in zip(call.example, call.needs_grad)]
    tensors = [*given, *params]
    devices = _cuda_devices(tensors)
    tracker = StorageTracker(timeline=True)
    tracker.register(tensors, call.module)
    before = set(tracker.storages)
    saved: set[int] = set()
    last_pack = [0]  # the timeline's length at the last pack

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            saved.add(storage_identity(t))
        last_pack[0] = len(tracker.timeline)
        return t

    try:
        with torch.random.fork_rng(devices=devices), _buffers_kept(call.module):
            _set_rng_state(call.rng, devices)
            start = tracker.current_bytes
            tracker.reset_peak()
            first = len(tracker.timeline)
            with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outs = call.run(tensors)
            forward_peak = tracker.peak_bytes - start
            upto = tracker.timeline[first:max(last_pack[0], first)]
            before_pack = max((b for _, _, b in upto), default=start) - start
            out_keys = {storage_identity(o) for o in outs if o.numel()}
            kept = [b for key, b in tracker.storages.items() if key not in before and key not in out_keys]
            saved_inputs = tuple(k for k, t in enumerate(tensors) if t.numel() and storage_identity(t) in saved)
            saved_outputs = tuple(k for k, o in enumerate(outs) if o.numel() and storage_identity(o) in saved)
            roots = [o for k, o in enumerate(outs) if o.requires_grad and (call.used is None or k in call.used)]
            wrt = [(k, t) for k, t in enumerate(tensors) if t.requires_grad]
            gone: list[int] = []  # the timeline's length as each output gradient goes
            seed = _Seed.apply(lambda: gone.append(len(tracker.timeline)), *roots) if roots and wrt else None
            grads = sum(o.numel() * o.element_size() for o in roots)
            del outs, roots
            start = tracker.current_bytes + grads  # (the replay's backward starts with its outputs' gradients)
            first = len(tracker.timeline)
            with tracker:
                got = (torch.autograd.grad(seed, [t for _, t in wrt], torch.ones_like(seed), allow_unused=True)
                       if seed is not None else [None] * len(wrt))
                del seed
            # the high points before and after the outputs' gradients go: a gradient the model holds
            # elsewhere too (a residual branch's) is still there after, and the replay adds it back
            cut = max(gone[-1] if gone else len(tracker.timeline), first)
            backward_peak = max((b for _, _, b in tracker.timeline[first:cut]), default=start) - start
            backward_after = max((b for _, _, b in tracker.timeline[cut:]), default=start - grads) - start
            result = [None] * len(tensors)
            for (k, _), g in zip(wrt, got):
                result[k] = g
    finally:
        tracker.detach()
    call.profile = Profile(forward_peak, max(before_pack, sum(kept)), kept, saved_inputs, saved_outputs, backward_peak,
                           backward_after, tuple(k for k, g in enumerate(result) if g is not None),
                           _example_flops(call, tensors, devices))
    call.example = None


def opaque_note(calls: list[OpaqueCall]) -> str | None:
    """A line for ``explain()`` naming the submodules run as one op, or None."""
    if not calls:
        return None
    paths = list(dict.fromkeys(c.path for c in calls))
    drawn = list(dict.fromkeys(c.path for c in calls if c.random))
    text = (f"run as one op each, measured by running them on the example batch (their forward reads a "
            f"tensor's value, which a capture on fake tensors cannot follow): {', '.join(paths)}")
    text += "; nothing inside them is checkpointed on its own"
    if drawn:
        text += (f"; {', '.join(drawn)} draw random numbers (LayerDrop): the figures hold for the draws the "
                 "example made, and a step that draws otherwise (drops another layer) peaks otherwise; to plan "
                 "inside them, turn the random skip off (config.layerdrop=0, encoder_layerdrop=0, "
                 "decoder_layerdrop=0)")
    return text


def _example_flops(call: OpaqueCall, tensors: list[torch.Tensor], devices: list[int]) -> int:
    """The call's forward FLOPs on the example (its random state again), as a layer's are counted."""
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), _buffers_kept(call.module):
        _set_rng_state(call.rng, devices)
        return count_flops(lambda: call.run(tensors))
