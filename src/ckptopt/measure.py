"""Exact memory measurement of a training step and of one layer.

Three tools, all following DESIGN.md sections 2 and 3:

* :class:`StorageTracker` counts live tensor storages on any device without
  allocator statistics (the only way to get exact figures on CPU);
* :func:`measure_peak` / :func:`measure_peak_detailed` give the peak bytes of
  one training step (forward, loss, backward) of a whole model;
* :func:`measure_layer` gives the per-layer quantities of the chain cost model
  (``a, p, sin, sout, m, f, b``) for one module measured in isolation.

Notes: what "exact" means here
------------------------------
On CPU the tracker counts every storage that is alive: storages registered up
front (parameters, buffers, inputs, existing gradients) and every storage that
an ATen operator returns while the tracker is active, forward and backward
alike (the autograd engine runs a CPU graph on the calling thread, so the
dispatch mode sees the backward's operators, including the gradients that
``AccumulateGrad`` stores in ``.grad``). A storage is counted once however
many views of it exist, from the operator that creates it until the storage
object is destroyed. It counts ``nbytes`` of each storage, not what the
allocator rounds it up to, and it does **not** see scratch memory that a
kernel allocates and frees internally (im2col buffers, oneDNN workspaces,
reduction temporaries): those never leave the operator. Storages that existed
before the tracker started and were not registered are counted only from the
first operator that returns them.

On CUDA, :func:`measure_peak` uses the caching allocator's statistics instead
(``torch.cuda.max_memory_allocated``), which include kernel scratch memory and
everything else allocated on that device, and reports the reserved memory
(what ``nvidia-smi`` shows) as a separate figure.
"""

from __future__ import annotations

import gc
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "StorageTracker",
    "PeakMeasurement",
    "LayerMeasurement",
    "measure_peak",
    "measure_peak_detailed",
    "measure_layer",
]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def _tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested tuples, lists and dicts (other leaves ignored)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensor_leaves(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensor_leaves(item)


def _real_storage(t: torch.Tensor, allow_fake: bool = False) -> torch.UntypedStorage | None:
    """The tensor's storage, or None for sparse tensors, empty storages and, unless
    ``allow_fake``, meta/fake tensors (FakeTensor storages are on the meta device)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
        return None
    if storage.nbytes() == 0 or (storage.device.type == "meta" and not allow_fake):
        return None
    return storage


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _storage_key(storage: torch.UntypedStorage) -> int:
    """``data_ptr`` for real memory; for meta/fake storages (which all report 0) a
    negative key unique to the storage object."""
    if storage.device.type == "meta":
        return -1 - id(storage)
    return storage.data_ptr()


def _storage_bytes(tensors: Iterator[torch.Tensor] | Sequence[torch.Tensor], exclude: set[int] = frozenset(),
                   fake: bool = False) -> tuple[int, set[int]]:
    """Total bytes of the distinct storages of ``tensors`` (by storage key), minus ``exclude``."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = _real_storage(t, fake)
        if s is not None and _storage_key(s) not in exclude:
            seen[_storage_key(s)] = s.nbytes()
    return sum(seen.values()), set(seen)


def _release(tracker_ref: "weakref.ref[StorageTracker]", sid: int) -> None:
    # Module-level so that the finalizers do not keep the tracker alive.
    tracker = tracker_ref()
    if tracker is not None:
        tracker._release(sid)


class _TrackerMode(TorchDispatchMode):
    """The dispatch mode behind :class:`StorageTracker`: it sees every op's outputs."""

    def __init__(self, tracker: "StorageTracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._on_op(func, out)
        return out


# --------------------------------------------------------------------------
# the tracker
# --------------------------------------------------------------------------
class StorageTracker:
    """Exact count of live tensor storages, as a context manager.

    While the tracker is entered, a ``TorchDispatchMode`` sees the outputs of
    every ATen operator, forward and backward. Each output's
    ``untyped_storage()`` is recorded once (deduplicated by ``data_ptr``, so
    views are never double counted), its ``nbytes`` is added to
    :attr:`current_bytes`, and a ``weakref.finalize`` on the storage object
    subtracts it again when the storage is destroyed, wherever and whenever
    that happens (frees are tracked even after the ``with`` block, until
    :meth:`detach`). Empty storages are skipped, and meta/fake tensors unless ``fake=True``.

    Parameters
    ----------
    timeline : bool, default False
        Record ``(op_index, op_name, current_bytes)`` after every operator in
        :attr:`timeline`.
    fake : bool, default False
        Also count fake (and meta) tensors, each storage object once: run
        the same code under ``FakeTensorMode`` and the figures equal those of
        the real run, since only output storage sizes are counted. The
        tracer uses this to measure layers without allocating activations.

    Attributes
    ----------
    current_bytes : int
        Bytes of the storages alive now.
    peak_bytes : int
        The largest value ``current_bytes`` has reached (since construction
        or the last :meth:`reset_peak`), checked after every operator and
        every :meth:`register`.
    timeline : list of (int, str, int) or None
        Present when constructed with ``timeline=True``.

    Notes
    -----
    See the module docstring: scratch memory inside one kernel is invisible,
    sizes are storage ``nbytes`` (not allocator blocks), and storages created
    before the tracker must be :meth:`register`-ed to be counted from the
    start. Not reentrant: enter one tracker at a time. Thread-safe for frees
    that happen on other threads.

    Examples
    --------
    >>> import torch
    >>> lin = torch.nn.Linear(4, 3, bias=False)
    >>> x = torch.zeros(2, 4)
    >>> tracker = StorageTracker()
    >>> tracker.register(lin, x)
    >>> tracker.current_bytes  # 4*3*4 weight bytes + 2*4*4 input bytes
    80
    >>> with tracker:
    ...     y = lin(x)
    >>> tracker.current_bytes, tracker.peak_bytes  # plus the 2*3*4-byte output
    (104, 104)
    >>> del y
    >>> tracker.current_bytes
    80
    >>> tracker.detach()
    """

    def __init__(self, timeline: bool = False, fake: bool = False):
        self.fake = fake
        self.current_bytes = 0
        self.peak_bytes = 0
        self.timeline: list[tuple[int, str, int]] | None = [] if timeline else None
        self._op_index = 0
        # id(storage object) -> [data_ptr, nbytes, finalizer]; the storage object is
        # unique per StorageImpl (PyTorch preserves its PyObject), and the finalizer
        # pops the entry before the id can be reused.
        self._entries: dict[int, list] = {}
        self._ptrs: dict[int, int] = {}  # data_ptr -> id(storage object)
        self._lock = threading.RLock()
        self._mode: _TrackerMode | None = None

    # -- public -------------------------------------------------------------
    def register(self, *tensors_or_modules: Any) -> None:
        """Count storages that exist already, each once.

        Accepts tensors, modules (their parameters, buffers and the ``.grad``
        of their parameters) and tuples, lists or dicts of them; a tensor's
        own ``.grad`` is registered too. Non-tensor values inside containers
        are ignored.

        Raises
        ------
        TypeError
            For a top-level argument that is neither a tensor, a module nor a
            container.
        """
        for obj in tensors_or_modules:
            if isinstance(obj, nn.Module):
                tensors = []
                for p in obj.parameters():
                    tensors.append(p)
                    if p.grad is not None:
                        tensors.append(p.grad)
                tensors.extend(obj.buffers())
            elif isinstance(obj, (torch.Tensor, tuple, list, dict)):
                tensors = []
                for t in _tensor_leaves(obj):
                    tensors.append(t)
                    if t.is_leaf and t.grad is not None:
                        tensors.append(t.grad)
            else:
                raise TypeError(
                    "StorageTracker.register takes tensors, nn.Modules, or tuples/lists/dicts "
                    f"of tensors; got {type(obj).__name__}"
                )
            for t in tensors:
                self._add_tensor(t)

    def reset_peak(self) -> None:
        """Set :attr:`peak_bytes` to :attr:`current_bytes`."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    @property
    def storages(self) -> dict[int, int]:
        """A snapshot ``{data_ptr: nbytes}`` of the storages counted as alive."""
        with self._lock:
            return {ptr: nbytes for ptr, nbytes, _ in self._entries.values()}

    def is_tracked(self, t: torch.Tensor) -> bool:
        """Whether the storage of ``t`` is counted as alive."""
        s = _real_storage(t, self.fake)
        with self._lock:
            return s is not None and _storage_key(s) in self._ptrs

    def detach(self) -> None:
        """Stop tracking frees: detach every finalizer and forget all storages.

        Call it once the figures have been read, so that long-lived storages
        (parameters) do not carry finalizers for the rest of their life.
        """
        with self._lock:
            for _, _, fin in self._entries.values():
                fin.detach()
            self._entries.clear()
            self._ptrs.clear()
            self.current_bytes = 0

    def __enter__(self) -> "StorageTracker":
        if self._mode is not None:
            raise RuntimeError("this StorageTracker is already active; it is not reentrant")
        self._mode = _TrackerMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return (
            f"StorageTracker(current_bytes={self.current_bytes}, peak_bytes={self.peak_bytes}, "
            f"storages={len(self._entries)})"
        )

    # -- internals ----------------------------------------------------------
    def _on_op(self, func, out) -> None:
        for t in _tensor_leaves(out):
            self._add_tensor(t)
        if self.timeline is not None:
            with self._lock:
                self.timeline.append((self._op_index, str(func), self.current_bytes))
        self._op_index += 1

    def _add_tensor(self, t: torch.Tensor) -> None:
        storage = _real_storage(t, self.fake)
        if storage is None:
            return
        ptr, nbytes, sid = _storage_key(storage), storage.nbytes(), id(storage)
        with self._lock:
            entry = self._entries.get(sid)
            if entry is not None:
                if entry[0] != ptr or entry[1] != nbytes:  # resized in place (resize_, set_)
                    if self._ptrs.get(entry[0]) == sid:
                        del self._ptrs[entry[0]]
                    self.current_bytes += nbytes - entry[1]
                    entry[0], entry[1] = ptr, nbytes
                    self._ptrs.setdefault(ptr, sid)
            elif ptr in self._ptrs:
                return  # another storage object over the same memory: count it once
            else:
                fin = weakref.finalize(storage, _release, weakref.ref(self), sid)
                fin.atexit = False
                self._entries[sid] = [ptr, nbytes, fin]
                self._ptrs[ptr] = sid
                self.current_bytes += nbytes
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes

    def _release(self, sid: int) -> None:
        with self._lock:
            entry = self._entries.pop(sid, None)
            if entry is None:
                return
            if self._ptrs.get(entry[0]) == sid:
                del self._ptrs[entry[0]]
            self.current_bytes -= entry[1]


# --------------------------------------------------------------------------
# whole-step peak
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class PeakMeasurement:
    """Result of :func:`measure_peak_detailed`.

    Attributes
    ----------
    peak_bytes : int
        Peak bytes of the training step (see :func:`measure_peak`).
    reserved_bytes : int or None
        CUDA only: peak bytes reserved by the caching allocator
        (``torch.cuda.max_memory_reserved``), what ``nvidia-smi`` shows.
    device : torch.device
        The device measured.
    timeline : list of (op_index, op_name, current_bytes) or None
        CPU (tracker) only: live bytes after every operator of the step.
    """

    peak_bytes: int
    reserved_bytes: int | None
    device: torch.device
    timeline: list[tuple[int, str, int]] | None


def _normalize_device(d: torch.device) -> torch.device:
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _check_module(model: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, torch.Tensor):
            hint = " (got a tensor: pass the module, not its output)"
        elif isinstance(model, Iterator) or hasattr(model, "__next__"):
            hint = " (got an iterator: pass the module itself, not model.parameters())"
        raise TypeError(
            f"{fn} expects a torch.nn.Module as its first argument, got {type(model).__name__}{hint}. "
            "Pass the model itself, e.g. " + (f"{fn}(model, x)" if fn != "measure_layer" else f"{fn}(layer, x)")
        )


def _resolve_device(model: nn.Module, args: tuple, device: Any, fn: str) -> torch.device:
    owned = list(model.parameters()) + list(model.buffers())
    model_devs = {_normalize_device(t.device) for t in owned}
    if len(model_devs) > 1:
        raise ValueError(
            f"{fn} measures one device, but the model's parameters and buffers are on "
            f"{sorted(str(d) for d in model_devs)}; move the model to one device first"
        )
    model_dev = next(iter(model_devs)) if model_devs else None
    input_devs = {_normalize_device(t.device) for t in _tensor_leaves(args)}
    for d in sorted(input_devs, key=str):
        if model_dev is not None and d != model_dev:
            raise ValueError(
                f"the example inputs are on device {d} but the model's parameters are on device "
                f"{model_dev}; move the inputs with x.to({str(model_dev)!r}) (or the model with "
                f"model.to({str(d)!r}))"
            )
    if model_dev is None and len(input_devs) > 1:
        raise ValueError(f"the example inputs are spread over devices {sorted(map(str, input_devs))}")
    dev = model_dev or (next(iter(input_devs)) if input_devs else torch.device("cpu"))
    if device is not None:
        want = _normalize_device(torch.device(device))
        if want != dev:
            raise ValueError(
                f"device={str(want)!r} was requested but the model and inputs are on device {dev}; "
                "move them there first (measure_peak does not move tensors)"
            )
    if dev.type == "meta":
        raise ValueError(
            "the model and inputs are on the meta device, which holds no memory to measure; "
            "materialize them on a real device (e.g. model.to_empty(device='cpu'))"
        )
    return dev


def _snapshot_buffers(model: nn.Module) -> list:
    """Copies (on CPU, so they do not count on an accelerator) of every buffer."""
    snap = []
    with torch.no_grad():
        for mod in model.modules():
            for name, buf in mod._buffers.items():
                if buf is not None:
                    snap.append((mod, name, buf, buf.detach().to("cpu", copy=True)))
    return snap


def _restore_buffers(snap: list) -> None:
    with torch.no_grad():
        for mod, name, buf, copy in snap:
            if mod._buffers.get(name) is not buf:
                mod._buffers[name] = buf
            buf.copy_(copy)


@contextmanager
def _no_lasting_state(model: nn.Module, inputs: Any, dev: torch.device):
    """Clear parameter gradients and restore buffers, input grads and RNG state afterwards."""
    params = list(model.parameters())
    input_leaves = [t for t in _tensor_leaves(inputs) if t.is_leaf and t.requires_grad]
    old_input_grads = [t.grad for t in input_leaves]
    buffers = _snapshot_buffers(model)
    for p in params:
        p.grad = None
    for t in input_leaves:
        t.grad = None
    rng_devices = [dev.index] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.enable_grad():
            yield
    finally:
        for p in params:
            p.grad = None
        for t, g in zip(input_leaves, old_input_grads):
            t.grad = g
        _restore_buffers(buffers)


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().pow(2).mean()
    terms = [t.float().pow(2).mean() for t in _tensor_leaves(out) if t.requires_grad]
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    return loss


def _forward_loss(model: nn.Module, args: tuple, loss_fn: Callable | None) -> torch.Tensor:
    """Forward and loss; returns only the loss so that nothing else stays referenced."""
    out = model(*args)
    leaves = list(_tensor_leaves(out))
    if not any(t.requires_grad for t in leaves):
        if not leaves:
            raise ValueError(
                f"the model returned {type(out).__name__} with no tensors in it; measure_peak "
                "needs a tensor output (or a tuple/list/dict of tensors) to run a backward pass"
            )
        trainable = any(p.requires_grad for p in model.parameters())
        grad_inputs = any(t.requires_grad for t in _tensor_leaves(args))
        if not trainable and not grad_inputs:
            raise ValueError(
                "the model has no trainable parameters (no parameter has requires_grad=True) and no "
                "input requires grad, so a training step has no backward pass to measure; unfreeze "
                "the parameters (p.requires_grad_(True)) or pass an input that requires grad"
            )
        raise ValueError(
            "the model's output does not require grad although the model has trainable parameters "
            "or inputs: it was detached or computed under torch.no_grad() inside forward, so there "
            "is no backward pass to measure"
        )
    del leaves
    loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
    del out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        raise ValueError(f"loss_fn must return a scalar tensor, got {what}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a loss that does not require grad; compute it from the model output")
    return loss


def _train_step(model: nn.Module, args: tuple, loss_fn: Callable | None) -> None:
    loss = _forward_loss(model, args, loss_fn)
    loss.backward()
    del loss


def _with_checkpoints(model: nn.Module, args: tuple, loss_fn, checkpoints, target: nn.Module | None = None) -> nn.Module:
    """The model rewritten to checkpoint at ``checkpoints`` (a Plan or segment-start layers).

    ``target``: a copy of ``model`` (same structure, e.g. on fake tensors) to
    rewrite instead of ``model`` itself; ``model`` is what gets traced.
    """
    from .rewriter import apply_plan
    from .simulate import normalize_plan, simulate
    from .solvers import Plan
    from .tracer import trace

    tm = trace(model, args, loss_fn=loss_fn)
    if isinstance(checkpoints, Plan):
        plan = checkpoints
    else:
        cps = normalize_plan(tm.costs, checkpoints)
        plan = Plan(cps, simulate(tm.costs, cps).peak_bytes, "given", 0.0, tm.n)
    return apply_plan(model if target is None else target, tm, plan)


def _measure_fake(model: nn.Module, args: tuple, loss_fn, checkpoints=None) -> PeakMeasurement:
    """The tracker's figure for one step of a fake copy of ``model``: nothing is allocated.

    With ``checkpoints``, ``model`` is traced and the plan applied to the fake
    copy (a rewritten module is not copied: it wraps the traced graph).
    """
    from torch._dynamo.utils import deepcopy_to_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .rewriter import CheckpointedModule, apply_plan

    fm = FakeTensorMode()
    if isinstance(model, CheckpointedModule):
        # a rewritten module is not copied (deep-copying its graphs overflows the recursion
        # limit on large models): its plan is applied again to a fake copy of the original
        if checkpoints is not None:
            raise ValueError("measure_peak: the model is already rewritten (a CheckpointedModule); "
                             "pass checkpoints= with the original model, or leave it out")
        fmodel = deepcopy_to_fake_tensor(model.original, fm)
        run = apply_plan(fmodel, model.traced, model.plan)
    else:
        fmodel = deepcopy_to_fake_tensor(model, fm)
        run = fmodel if checkpoints is None else _with_checkpoints(model, args, loss_fn, checkpoints, target=fmodel)
    for prm in fmodel.parameters():
        prm.grad = None
    fargs = tuple(fm.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    tracker = StorageTracker(timeline=True, fake=True)
    try:
        with fm, torch.enable_grad():
            tracker.register(fmodel, fargs)
            with tracker:
                _train_step(run, fargs, loss_fn)
        dev = next((a.device for a in fargs if isinstance(a, torch.Tensor)), torch.device("cpu"))
        return PeakMeasurement(tracker.peak_bytes, None, dev, tracker.timeline)
    finally:
        tracker.detach()
        if run is not fmodel:
            run.remove_hooks()


def measure_plans_fake(model: nn.Module, example_inputs: Any, traced: Any, plans: Iterable[Any],
                       loss_fn: Callable | None = None) -> list[int]:
    """The measured peak of one training step of ``model`` rewritten with each plan, on one
    fake-tensor copy (nothing is allocated).

    Each figure is that of ``measure_peak(model, x, checkpoints=plan, fake=True)``; the model
    is copied once and not traced again, so many plans cost one step each.

    Parameters
    ----------
    traced : TracedModel
        ``ckptopt.trace(model, x)`` (for a node-level plan, the node trace's ``.traced``).
    plans : iterable of Plan, NodePlan or tuple of int
        A tuple is a chain plan (segment-start layers) for ``traced``.
    """
    from torch._dynamo.utils import deepcopy_to_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .rewriter import apply_plan
    from .simulate import normalize_plan, simulate
    from .solvers import Plan

    _check_module(model, "measure_plans_fake")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    fm = FakeTensorMode()
    fmodel = deepcopy_to_fake_tensor(model, fm)
    fargs = tuple(fm.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    out = []
    for plan in plans:
        if isinstance(plan, (tuple, list)):
            cps = normalize_plan(traced.costs, plan)
            plan = Plan(cps, simulate(traced.costs, cps).peak_bytes, "given", 0.0, traced.n)
        module = apply_plan(fmodel, traced, plan)
        for prm in fmodel.parameters():
            prm.grad = None
        tracker = StorageTracker(fake=True)
        try:
            with fm, torch.enable_grad():
                tracker.register(fmodel, fargs)
                with tracker:
                    _train_step(module, fargs, loss_fn)
            out.append(int(tracker.peak_bytes))
        finally:
            tracker.detach()
            module.remove_hooks()
    return out


def measure_peak_detailed(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    checkpoints: Any = None,
    device: Any = None,
    fake: bool = False,
) -> PeakMeasurement:
    """Like :func:`measure_peak`, with the reserved bytes, device and timeline.

    Returns
    -------
    PeakMeasurement
        ``reserved_bytes`` is set on CUDA only, ``timeline`` on other devices
        only (it lists the live bytes after each operator of the step).
    """
    _check_module(model, "measure_peak")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if fake:
        return _measure_fake(model, args, loss_fn, checkpoints)
    if checkpoints is not None:
        model = _with_checkpoints(model, args, loss_fn, checkpoints)
    dev = _resolve_device(model, args, device, "measure_peak")

    with _no_lasting_state(model, args, dev):
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            _train_step(model, args, loss_fn)
            torch.cuda.synchronize(dev)
            return PeakMeasurement(
                peak_bytes=int(torch.cuda.max_memory_allocated(dev)),
                reserved_bytes=int(torch.cuda.max_memory_reserved(dev)),
                device=dev,
                timeline=None,
            )
        tracker = StorageTracker(timeline=True)
        tracker.register(model, args)
        try:
            with tracker:
                _train_step(model, args, loss_fn)
            return PeakMeasurement(
                peak_bytes=tracker.peak_bytes, reserved_bytes=None, device=dev, timeline=tracker.timeline
            )
        finally:
            tracker.detach()


def measure_peak(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    checkpoints: Any = None,
    device: Any = None,
    fake: bool = False,
) -> int:
    """Peak bytes of one training step: forward, loss, backward.

    Parameters
    ----------
    model : nn.Module
        Measured in its current mode (``train()``/``eval()``).
    example_inputs : Tensor or tuple
        A tensor, or a tuple of positional arguments for ``model(*args)``
        (anything else is passed as the single argument).
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar tensor``. Default:
        ``output.float().pow(2).mean()`` for a tensor output, and the sum of
        that over the tensors that require grad in a tuple/list/dict output.
        Not ``.sum()``: its gradient is an expanded 4-byte tensor, which hides
        the output-gradient term (DESIGN.md section 2).
    checkpoints : Plan or sequence of int, optional
        Measure the model rewritten with this plan (traced first; see
        :func:`ckptopt.apply_plan`) instead of the model as it is.
    device : str or torch.device, optional
        The device to measure; it must be where the model and inputs already
        are (they are never moved). Default: inferred from them.
    fake : bool, default False
        Run the step on a fake-tensor copy of the model (``FakeTensorMode``)
        and count its storages: the same figure as the CPU tracker, for any
        batch size, without allocating activations (the copy's parameters
        are fake too). The model itself is not run.

    Returns
    -------
    int
        On CUDA, ``torch.cuda.max_memory_allocated`` over the step (after
        ``reset_peak_memory_stats``): everything allocated on the device,
        kernel scratch memory included. Elsewhere (CPU), the peak of a
        :class:`StorageTracker` with the parameters, buffers and inputs (and
        nothing else that existed before) registered as live from the start.
        The model output is not held while backward runs, as in a real
        training loop; the scalar loss is.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``.
    ValueError
        Inputs on another device than the parameters (both are named), or an
        output with nothing requiring grad (no trainable parameters, or a
        detached output), or a ``loss_fn`` that does not return a scalar.

    Notes
    -----
    The call leaves no state behind: parameter ``.grad`` s are set to None
    before the step (any existing gradients are discarded) and after it,
    buffers (BatchNorm running statistics) are restored from a CPU copy, an
    input's ``.grad`` is restored, and the RNG state is forked. The step runs
    under ``torch.enable_grad()``.

    Examples
    --------
    >>> import torch
    >>> lin = torch.nn.Linear(1000, 2000, bias=False)
    >>> x = torch.randn(10, 1000)
    >>> measure_peak(lin, x)  # W + X + grad(Y) + grad(W) + 8 (loss, its seed grad)
    16120008
    """
    return measure_peak_detailed(model, example_inputs, loss_fn, checkpoints, device, fake).peak_bytes


# --------------------------------------------------------------------------
# per-layer quantities
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerMeasurement:
    """The chain-model quantities of one layer (DESIGN.md section 3), in bytes.

    See :func:`measure_layer` for how each is computed.
    """

    a: int
    p: int
    sin: bool
    sout: bool
    m: int
    f: int
    b: int
    buffer_bytes: int = 0
    input_bytes: int = 0
    fs: int | None = None
    rg: int | None = None
    dead: bool = False
    bk: int | None = None  # b with the input held through the backward (set by the tracer)

    @property
    def saved_bytes(self) -> int:
        """|S|: bytes of the saved set (input, output and the rest), parameters excluded."""
        return self.input_bytes * self.sin + self.a * self.sout + self.m


class _FreshInput(torch.autograd.Function):
    """Hands out a tensor that requires grad, held by nothing but the caller.

    Unlike a leaf, its autograd node does not keep it alive (a leaf's
    ``AccumulateGrad`` node holds the leaf for the whole backward), it can be
    modified in place (in-place ReLU), and the input gradient is dropped as
    soon as this node receives it, as the previous layer of a chain would.
    """

    @staticmethod
    def forward(ctx, anchor, holder):
        return holder.pop()

    @staticmethod
    def backward(ctx, grad):
        return None, None


class _InjectGrad(torch.autograd.Function):
    """Ends the graph with a 0-byte tensor; backward creates the output gradient.

    Python never holds a reference to that gradient, so the engine frees it as
    soon as the layer's backward has consumed it (holding it from Python makes
    ``b`` 8-19% too high, DESIGN.md section 3).
    """

    @staticmethod
    def forward(ctx, y, record):
        ctx.template = torch.empty_like(y, device="meta")  # shape, dtype and layout; no memory
        ctx.device = y.device
        ctx.record = record
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        g = torch.ones_like(ctx.template, device=ctx.device)
        ctx.record["grad_bytes"] = g.untyped_storage().nbytes()
        return g, None


class _CastRecorder(TorchDispatchMode):
    """Records the low-precision copies of ``params`` that autocast makes (and caches)."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.params = params
        self.casts: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and any(args[0] is p for p in self.params):
            self.casts.append(out)
        return out


def _autocast_weight_casts(module: nn.Module, example_input: torch.Tensor) -> list[torch.Tensor]:
    """The weight copies autocast caches when ``module`` runs (none outside autocast).

    Under ``torch.autocast`` a cast of a parameter is cached until the
    autocast context exits, so it is static memory of the step (the tracer
    counts it once); a layer measured in isolation must not count it in its
    saved set ``m`` or its forward transient ``f``. A tracker would otherwise
    see the cached copy as new when an op first returns a view of it
    (``Linear`` saves ``weight.t()``). The cache is cleared and the layer run
    once without grad so that every cast is made, and seen, here.
    """
    if not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return []
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return []
    torch.clear_autocast_cache()
    recorder = _CastRecorder(params)
    with recorder:
        module(example_input.detach().clone())
    return recorder.casts


class _Packed:
    """What the measuring pack hook hands autograd: a weak-referenceable box, so that the
    measurement can tell which saved tensors autograd still keeps after the forward."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


def _unpack(box: _Packed) -> torch.Tensor:
    return box.t


def measure_layer(module: nn.Module, example_input: torch.Tensor, input_requires_grad: bool = True,
                  grads_exist: Iterable[torch.Tensor] = (), keep_input: bool = False,
                  leaf_input: bool = False) -> LayerMeasurement:
    """Measure the chain-model quantities of one layer in isolation.

    The module runs forward and backward once, in its current mode, on a
    fresh copy of ``example_input`` that requires grad and that nothing else
    references, under a :class:`StorageTracker` (exact live-storage counts)
    and a ``saved_tensors_hooks`` pack hook (which storages autograd saves).
    Storages are compared by ``untyped_storage().data_ptr()``. Under a
    ``FakeTensorMode`` (fake input and parameters, call inside the mode) the
    same figures come out without allocating anything; fake storages are
    compared by identity.

    Parameters
    ----------
    module : nn.Module
        One layer of a chain: one tensor in, one tensor out.
    example_input : Tensor
        Its input (copied; the original is not counted or modified).
    input_requires_grad : bool, default True
        Whether the input requires grad, as it does inside a model. Pass
        False for a first layer fed with data: then no input gradient is
        computed (it would otherwise be counted in ``b``).
    leaf_input : bool, default False
        The input is a leaf that requires grad (a model input with
        ``requires_grad=True``): its gradient is accumulated into ``.grad``
        as in the model (out of place where the layer uses it twice), not
        dropped on arrival.
    keep_input : bool, default False
        Keep the input alive through the backward, as it is inside a model
        whose previous layer saves its output (a ResNet block's input is the
        previous block's saved ReLU output): ``b`` then includes the input's
        storage at every moment the layer alone would already have freed it.
    grads_exist : iterable of Parameter, optional
        Parameters that a later layer of the model also uses (a tied or
        reused weight): their gradient from that layer is pending when this
        layer's backward runs. That is
        reproduced by a zero-valued branch whose gradient reaches them first,
        so ``b`` includes the out-of-place sum of the two contributions
        (a third tensor of the weight's size, as PyTorch 2.13's engine does).

    Returns
    -------
    LayerMeasurement
        With ``P`` the bytes of the module's distinct parameter storages,
        ``Buf`` those of its buffers, ``X`` the input's bytes, and ``S`` the
        distinct storages the pack hook saw:

        ``a``
            bytes of the output's storage.
        ``p``
            ``P`` (the parameter gradients have the same size).
        ``sout``
            the output's storage is in ``S``.
        ``sin``
            the input's storage is in ``S`` and is not also the output's
            (for an in-place layer the saved storage counts as the output).
        ``m``
            bytes of the storages in ``S`` other than the input, the output,
            parameters and buffers (statistics, dropout masks, intermediates
            of a composite module). Saved storages that existed before the
            layer ran and are none of those (autocast's cached low-precision
            copies of the weights) are left out: they are static.
        ``f``
            forward peak minus ``P + Buf + X``: what the forward adds at its
            highest point (the output, the saved extras and any transient).
        ``fs``
            the forward peak up to the moment the last tensor is saved,
            minus ``P + Buf + X``: when this layer ends a checkpointed
            segment, its recomputation stops there (0 when it saves only its
            input, which is packed before it computes).
        ``rg``
            the bytes the backward holds beyond what was live when it started
            (the output gradient included) at the moment it first reads a
            saved tensor: ops at the end of the layer that save nothing (a
            mean, a concatenation, a product with a constant) run their
            backward before that, and a recomputation that this layer's
            backward triggers starts there (``a`` when it saves nothing).
        ``dead``
            the forward packed tensors that autograd no longer keeps when it
            ends (a dead branch's): a recomputation still re-packs them, so
            one that reaches this layer runs it up to ``fs``.
        ``b``
            backward peak minus the bytes live when backward starts minus
            the output gradient. Live at the start are ``P + Buf`` and the
            saved set (the output is dropped unless saved, and so is the
            input: the fresh input is not a leaf, so no ``AccumulateGrad``
            node keeps it alive); the output gradient (``a``-sized, layout
            of the output) is created inside the backward by a custom
            autograd Function, so nothing else holds it. ``b`` therefore
            includes the input gradient, the new parameter gradients and
            the backward's transients.
        ``buffer_bytes``, ``input_bytes``
            ``Buf`` and ``X``, for reference (buffers belong to the static
            bytes K of the chain model, not to ``m``).

    Raises
    ------
    TypeError
        ``module`` is not an ``nn.Module``, ``example_input`` is not a
        tensor, or the output is not a single tensor.
    ValueError
        The input is on another device than the parameters, or the output
        does not require grad.

    Notes
    -----
    Scratch memory inside one kernel is invisible (see the module
    docstring). The call leaves no state: parameter gradients are cleared,
    buffers (BatchNorm running statistics) restored and the RNG forked.

    Examples
    --------
    >>> import torch
    >>> m = measure_layer(torch.nn.Linear(100, 200, bias=False), torch.zeros(10, 100))
    >>> m.a, m.p, m.sin, m.sout, m.m, m.f, m.b  # b = input grad + weight grad
    (8000, 80000, True, False, 0, 8000, 84000)
    """
    _check_module(module, "measure_layer")
    if not isinstance(example_input, torch.Tensor):
        raise TypeError(
            f"measure_layer takes one example input tensor, got {type(example_input).__name__}; "
            "measure_layer(layer, x) measures a layer with one tensor input and one tensor output"
        )
    fake = _is_fake(example_input)
    dev = example_input.device if fake else _resolve_device(module, (example_input,), None, "measure_layer")
    param_bytes, param_ptrs = _storage_bytes(list(module.parameters()), fake=fake)
    buffer_bytes, buffer_ptrs = _storage_bytes(list(module.buffers()), exclude=param_ptrs, fake=fake)

    with _no_lasting_state(module, (), dev):
        if not fake:  # stale fake storages are not in the new tracker: no need to collect them
            gc.collect()
        casts = _autocast_weight_casts(module, example_input)
        cast_bytes, cast_ptrs = _storage_bytes(casts, exclude=param_ptrs | buffer_ptrs, fake=fake)
        holder = [example_input.detach().clone()]
        if input_requires_grad and leaf_input:
            x = holder.pop().requires_grad_(True)
        elif input_requires_grad:
            anchor = torch.empty(0, device=dev, requires_grad=True)
            x = _FreshInput.apply(anchor, holder)
        else:  # e.g. the first layer of a model, fed with data: no input gradient is computed
            x = holder.pop()
        x_ptr = _storage_key(x.untyped_storage())
        input_bytes = x.untyped_storage().nbytes()

        # Every pack event: (a weak reference to what autograd keeps, storage key or None,
        # bytes, forward peak so far). A saved tensor counts only if autograd still keeps it
        # when the forward ends: ops whose output is never used (a dead branch) save tensors
        # that die with that output.
        packs: list[tuple] = []

        def pack(t: torch.Tensor) -> _Packed:
            s = _real_storage(t, fake)
            # only storages this layer created, or registered below (parameters, buffers,
            # input); a pre-existing one (an autocast cast-cache copy of a weight) is static
            key = _storage_key(s) if s is not None and tracker.is_tracked(t) else None
            box = _Packed(t.detach())  # detached: a saved output would otherwise keep its own graph alive
            packs.append((weakref.ref(box), key, s.nbytes() if key is not None else 0, tracker.peak_bytes))
            return box

        first_unpack: list[int] = []  # live bytes when the backward first reads a saved tensor

        def unpack(box: _Packed) -> torch.Tensor:
            if not first_unpack:
                first_unpack.append(tracker.current_bytes)
            return box.t

        grads_exist = list(grads_exist)
        pending = _storage_bytes(grads_exist, fake=fake)[0] if grads_exist else 0
        tracker = StorageTracker(fake=fake)
        tracker.register(module, x, *casts)  # cached weight casts are static, like the weights
        start = tracker.current_bytes
        try:
            with tracker:
                # forward
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    y = module(x)
                forward_peak = tracker.peak_bytes
                kept = [(key, nbytes, peak) for ref, key, nbytes, peak in packs if ref() is not None]
                dead_packs = len(kept) < len(packs)
                saved = {key: nbytes for key, nbytes, _ in kept if key is not None}
                # forward peak up to the last pack, kept or not: where a recomputation of this
                # layer, the last of its segment, stops. Non-reentrant checkpoint counts every
                # tensor its forward packed, a dead branch's too, and stops once it has re-packed
                # as many, so a dead branch after the last kept save is re-run as well.
                last_pack = packs[-1][3] if packs else None
                if not isinstance(y, torch.Tensor):
                    raise TypeError(
                        f"measure_layer needs a layer with one tensor output, got {type(y).__name__}"
                    )
                if not y.requires_grad:
                    raise ValueError(
                        "the layer's output does not require grad (it is detached, or computed under "
                        "torch.no_grad()), so it has no backward pass to measure"
                    )
                ys = _real_storage(y, fake)
                y_ptr = _storage_key(ys) if ys is not None else None
                a = ys.nbytes() if ys is not None else 0
                record: dict[str, int] = {}
                end = _InjectGrad.apply(y, record)
                if grads_exist:
                    # A later layer's gradient for these weights reaches their AccumulateGrad
                    # first and waits in the engine's input buffer; this layer's contribution
                    # is then added out of place. A zero branch created last (so its backward
                    # runs first) reproduces that; its buffered gradient is subtracted below,
                    # since the chain model counts it among the later layer's gradients.
                    end = end.sum() + sum((prm * 0).sum() for prm in grads_exist)
                held_input = x if keep_input else None
                del x, y, ys
                # backward
                backward_start = tracker.current_bytes
                tracker.reset_peak()
                end.backward(torch.empty(0, device=dev) if end.dim() else None)
                backward_peak = tracker.peak_bytes
                del end, held_input
        finally:
            tracker.detach()

    sout = y_ptr is not None and y_ptr in saved
    sin = x_ptr in saved and x_ptr != y_ptr
    other = set(saved) - param_ptrs - buffer_ptrs - cast_ptrs - {x_ptr, y_ptr}
    return LayerMeasurement(
        a=int(a),
        p=int(param_bytes),
        sin=bool(sin),
        sout=bool(sout),
        m=int(sum(saved[k] for k in other)),
        f=int(forward_peak - start),
        fs=int(last_pack - start) if last_pack is not None else 0,
        b=int(backward_peak - backward_start - record.get("grad_bytes", 0) - pending),
        rg=int(max(0, first_unpack[0] - backward_start - pending)) if first_unpack else int(a),
        dead=bool(dead_packs),
        buffer_bytes=int(buffer_bytes),
        input_bytes=int(input_bytes),
    )
