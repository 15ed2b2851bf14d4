"""The exact storage tracker: live tensor storages counted as they are allocated and freed.

:class:`StorageTracker` counts live tensor storages on any device without
allocator statistics (the only way to get exact figures on CPU, ``docs/design.md``
§2). The tracer measures layers with it on fake tensors; :mod:`ckptopt.measure`
measures whole training steps with it.

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

On CUDA, :func:`ckptopt.measure_peak` uses the caching allocator's statistics instead
(``torch.cuda.max_memory_allocated``), which include kernel scratch memory and
everything else allocated on that device, and reports the reserved memory
(what ``nvidia-smi`` shows) as a separate figure.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .storages import real_storage, storage_key
from .torch_utils import tensor_leaves

__all__ = ["StorageTracker", "inner_tensors"]


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold ``t``'s memory: ``t`` itself, or the inner tensors of a
    wrapper subclass (a DTensor's local shard), recursively."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # (a DTensor also names its device mesh)
                yield from inner_tensors(inner)
    else:
        yield t


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
        if self.tracker.fake:
            out = _honour_output_mask(func, args, kwargs, out)
        self.tracker._on_op(func, out)
        return out


def _honour_output_mask(func, args, kwargs, out):
    """Fake kernels of some backward ops ignore ``output_mask`` (torch 2.13:
    ``native_batch_norm_backward`` allocates the input gradient of an input that needs none);
    the real kernels return no tensor there, so neither does a fake step measured here."""
    names = [a.name for a in func._schema.arguments]
    if "output_mask" not in names or not isinstance(out, tuple):
        return out
    i = names.index("output_mask")
    mask = (kwargs or {}).get("output_mask", args[i] if i < len(args) else None)
    if mask is None:
        return out
    return tuple(None if k < len(mask) and not mask[k] else o for k, o in enumerate(out))


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
                for t in tensor_leaves(obj):
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

    def resized(self, t: torch.Tensor) -> None:
        """Re-read the size of ``t``'s storage after a resize that no operator reported
        (``untyped_storage().resize_``, as FSDP2 frees and re-allocates unsharded parameters):
        a storage resized to 0 bytes counts 0 and gives up its address."""
        for inner in inner_tensors(t):
            storage = inner.untyped_storage()
            with self._lock:
                entry = self._entries.get(id(storage))
                if entry is None:
                    if storage.nbytes():
                        self._add_tensor(inner)
                    continue
                if self._ptrs.get(entry[0]) == id(storage):
                    del self._ptrs[entry[0]]
                ptr, nbytes = (storage_key(storage), storage.nbytes()) if storage.nbytes() else (None, 0)
                self.current_bytes += nbytes - entry[1]
                entry[0], entry[1] = ptr, nbytes
                if ptr is not None:
                    self._ptrs.setdefault(ptr, id(storage))
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)

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
        s = real_storage(t, self.fake)
        with self._lock:
            return s is not None and storage_key(s) in self._ptrs

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
        for t in tensor_leaves(out):
            self._add_tensor(t)
        if self.timeline is not None:
            with self._lock:
                self.timeline.append((self._op_index, str(func), self.current_bytes))
        self._op_index += 1

    def _add_tensor(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # a DTensor: count its local shard
            for inner in inner_tensors(t):
                self._add_tensor(inner)
            return
        storage = real_storage(t, self.fake)
        if storage is None:
            return
        ptr, nbytes, sid = storage_key(storage), storage.nbytes(), id(storage)
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
            if entry[0] is not None and self._ptrs.get(entry[0]) == sid:
                del self._ptrs[entry[0]]
            self.current_bytes -= entry[1]
