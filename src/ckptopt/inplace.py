"""Checkpointing attached to the model itself, for models that tools inspect by type.

HuggingFace's ``Trainer`` reads ``model.forward``'s signature to drop unused batch columns,
checks ``isinstance(model, PreTrainedModel)`` before ``save_pretrained``, and PEFT, accelerate
and TRL look for the model's own attributes. A wrapper module satisfies none of that, so for
such models :func:`ckptopt.optimize_checkpoints` attaches the plan to the model object instead
(:func:`attach`): the model's class is swapped for a subclass of it (same name, same module)
whose ``forward`` runs the :class:`~ckptopt.rewriter.CheckpointedModule`. Everything else is the
model's own: its signature, ``config``, ``save_pretrained``, ``state_dict``, ``isinstance``.

The plan lives in a registry keyed by the model object, not in its ``__dict__``: a deep copy of
an attached model (a reference copy, an EMA) is a plain model again, running its own forward
on its own parameters. :func:`detach` swaps the class back.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

from .rewriter import CheckpointedModule
from .torch_utils import inspected_by_type

__all__ = ["attach", "detach", "attached", "inspected_by_type", "planning", "planning_now"]

_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, CheckpointedModule]" = weakref.WeakKeyDictionary()
_PLANNING: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models being planned: their own forward runs
_SUBCLASSES: dict[type, type] = {}



@contextmanager
def planning(model: nn.Module):
    """While planning another call structure of an attached model (from inside its forward), the
    model runs its own forward: the capture and the side-effect check see the model, not the plan."""
    _PLANNING.add(model)
    try:
        yield
    finally:
        _PLANNING.discard(model)


def planning_now(model: Any) -> bool:
    try:
        return model in _PLANNING
    except TypeError:
        return False


def attached(model: Any) -> CheckpointedModule | None:
    """The :class:`CheckpointedModule` attached to ``model``, or None."""
    try:
        return _ATTACHED.get(model)
    except TypeError:  # not weak-referenceable
        return None


def attach(model: nn.Module, module: CheckpointedModule) -> nn.Module:
    """Make ``model`` itself run ``module``'s plan (see the module docstring); returns ``model``."""
    if module.original is not model:
        raise ValueError("attach: the CheckpointedModule was made for another model")
    base = _base_class(model)
    object.__setattr__(module, "_original_forward", functools.partial(base.forward, model))
    _ATTACHED[model] = module
    model.__class__ = _subclass(base)
    return model


def detach(model: nn.Module) -> nn.Module:
    """Undo :func:`attach`: the model runs its own forward again (BatchNorm hooks removed)."""
    module = _ATTACHED.pop(model, None)
    if module is not None:
        module.remove_hooks()
    model.__class__ = _base_class(model)
    return model


def _base_class(model: nn.Module) -> type:
    cls = type(model)
    return cls.__dict__.get("_ckptopt_base", cls)


def _subclass(base: type) -> type:
    if base in _SUBCLASSES:
        return _SUBCLASSES[base]

    @functools.wraps(base.forward)
    def forward(self, *args, **kwargs):
        module = _ATTACHED.get(self)
        if module is None or self in _PLANNING:  # a deep copy (a plain model), or being planned
            return base.forward(self, *args, **kwargs)
        return module(*args, **kwargs)

    def _refuse(name: str):
        def method(self, *args, **kwargs):
            if _ATTACHED.get(self) is None:
                return getattr(base, name)(self, *args, **kwargs)
            warnings.warn(f"ckptopt: {type(self).__name__} is already checkpointed by ckptopt's plan; "
                          f"{name}() is ignored (checkpointing twice would recompute twice). Call "
                          "ckptopt.detach(model) first to use the library's own checkpointing.", stacklevel=2)
            return None
        method.__name__ = name
        return method

    def _get(name: str, doc: str):
        def getter(self):
            module = _ATTACHED.get(self)
            if module is None:
                raise AttributeError(f"{type(self).__name__} has no ckptopt plan attached")
            return getattr(module, name)
        return property(getter, doc=doc)

    ns: dict[str, Any] = {
        "forward": forward,
        "_ckptopt_base": base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "ckptopt": property(lambda self: _ATTACHED.get(self), doc="The attached CheckpointedModule."),
        "plan": _get("plan", "The checkpoint plan."),
        "traced": _get("traced", "The traced model the plan was made from."),
        "predicted_peak_bytes": _get("predicted_peak_bytes", "The plan's predicted peak."),
        "baseline_peak_bytes": _get("baseline_peak_bytes", "The predicted peak without checkpointing."),
        "explain": _get("explain", "A readable account of the plan."),
        "predicted_peak_for": _get("predicted_peak_for", "The plan's peak at another batch's shapes."),
        "remove_hooks": _get("remove_hooks", "Remove the BatchNorm hooks."),
        "original": property(lambda self: self, doc="The model itself (the plan is attached to it)."),
    }
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        if hasattr(base, name):
            ns[name] = _refuse(name)
    sub = type(base.__name__, (base,), ns)
    _SUBCLASSES[base] = sub
    return sub
