"""Storages: which memory a tensor lives in, and how many bytes that is. The one home of the rule.

Two tensors share memory when they share a storage; a storage is counted once however many views
of it exist. :func:`storage_key` names a storage: its address for real memory, and for meta and fake
storages (which all report address 0) the storage object itself, which PyTorch keeps unique per
storage while it lives. Every byte count of ckptopt (the exact tracker, the tracer's layer
measurements and static bytes, the planner's parameter facts) goes through these functions.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["storage_key", "real_storage", "storage_identity", "tensor_key", "storage_bytes", "storage_nbytes",
           "distinct_storages"]


def storage_key(storage: torch.UntypedStorage) -> int:
    """``data_ptr`` for real memory; for meta/fake storages (which all report 0) a negative key unique
    to the storage object."""
    if storage.device.type == "meta":
        return -1 - id(storage)
    return storage.data_ptr()


def real_storage(t: torch.Tensor, allow_fake: bool = False) -> torch.UntypedStorage | None:
    """The tensor's storage, or None for sparse tensors, empty storages, wrapper subclasses
    (a DTensor: :func:`ckptopt.tracker.inner_tensors` gives the tensors that hold its memory) and,
    unless ``allow_fake``, meta/fake tensors (FakeTensor storages are on the meta device)."""
    if is_traceable_wrapper_subclass(t):
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
        return None
    if storage.nbytes() == 0 or (storage.device.type == "meta" and not allow_fake):
        return None
    return storage


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """A functorch wrapper (a ``vmap`` level's BatchedTensor, which transformers' mask functions leave
    among a capture's values) has no storage of its own: the tensor it wraps holds the memory."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def storage_identity(t: torch.Tensor) -> int:
    """The key of the storage ``t`` lives in (:func:`storage_key`), for any tensor that has one."""
    return storage_key(_unwrapped(t).untyped_storage())


def tensor_key(t: torch.Tensor, allow_fake: bool = True) -> Any:
    """The key of the storage ``t`` lives in, or None where it has no memory of its own
    (:func:`real_storage`: empty, a wrapper subclass, a fake tensor unless ``allow_fake``)."""
    s = real_storage(_unwrapped(t), allow_fake)
    return storage_key(s) if s is not None else None


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset(),
                  fake: bool = False) -> tuple[int, set[int]]:
    """Total bytes of the distinct storages of ``tensors`` (by storage key), minus ``exclude``, and their keys."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = real_storage(t, fake)
        if s is not None and storage_key(s) not in exclude:
            seen[storage_key(s)] = s.nbytes()
    return sum(seen.values()), set(seen)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's storage (of its elements when it has no usable storage)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return int(t.numel() * t.element_size())


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage (:func:`storage_identity`)."""
    seen, out = set(), []
    for t in tensors:
        key = storage_identity(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
