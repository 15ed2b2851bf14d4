"""What the optimizer adds to a training step: its state and the step's temporaries (no torch).

The formulas (measured with :class:`ckptopt.tracker.StorageTracker` on torch 2.13,
default constructor arguments) are the table of :mod:`ckptopt.planning`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..costs import ChainCosts

__all__ = ["OPTIMIZERS", "IMPLS", "OptimizerMemory", "check_optimizer", "default_impl", "optimizer_memory",
           "step_peak", "accumulating_costs", "step_allocations"]

OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw")
IMPLS = ("for-loop", "foreach")
ADAM_COUNTER_BYTES = 4  # Adam's float32 `step` tensor per parameter


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer adds to a training step, in bytes.

    Attributes
    ----------
    name : str
        One of :data:`OPTIMIZERS`.
    impl : str
        ``"for-loop"`` (PyTorch's default on CPU) or ``"foreach"`` (its default on CUDA).
    state_bytes : int
        Optimizer state held for the whole step (momentum, Adam's averages and counters).
    step_transient_bytes : int
        The temporaries of ``optimizer.step()`` above the state, gradients and parameters.
    """

    name: str
    impl: str
    state_bytes: int
    step_transient_bytes: int


def check_optimizer(optimizer: str) -> str:
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    return optimizer.lower()


def default_impl(device: str) -> str:
    """PyTorch's default optimizer implementation on ``device``: foreach on CUDA, a for-loop elsewhere."""
    return "foreach" if str(device).startswith("cuda") else "for-loop"


def optimizer_memory(param_sizes: Sequence[int], optimizer: str = "adam", impl: str | None = None,
                     device: str = "cpu") -> OptimizerMemory:
    """State and step transient of ``optimizer`` for parameters of the given sizes.

    Parameters
    ----------
    param_sizes : sequence of int
        Bytes of each trainable parameter tensor, in the optimizer's order
        (``model.parameters()``).
    optimizer : str
        ``none``, ``sgd`` (momentum 0), ``sgd-momentum``, ``adam`` or ``adamw``,
        with PyTorch's default constructor arguments otherwise.
    impl : str, optional
        ``for-loop`` or ``foreach``; default: PyTorch's default on ``device``.
    device : str, default "cpu"
        Where the step runs; on CUDA Adam's step counters stay on the CPU.

    Returns
    -------
    OptimizerMemory

    Notes
    -----
    The formulas are the module's note; they are what
    :class:`ckptopt.StorageTracker` measured on torch 2.13.

    Examples
    --------
    >>> om = optimizer_memory([400, 40, 4000], "adam")
    >>> om.state_bytes, om.step_transient_bytes  # 2 * 4440 + 3 * 4; 2 * 4000 + 40
    (8892, 8040)
    >>> optimizer_memory([400, 40, 4000], "adam", impl="foreach").step_transient_bytes
    4440
    """
    name = check_optimizer(optimizer)
    impl = impl or default_impl(device)
    if impl not in IMPLS:
        raise ValueError(f"unknown optimizer implementation {impl!r}; use 'for-loop' or 'foreach'")
    sizes = [int(s) for s in param_sizes]
    total = sum(sizes)
    if name in ("none", "sgd"):
        return OptimizerMemory(name, impl, 0, 0)
    if name == "sgd-momentum":
        return OptimizerMemory(name, impl, total, 0)
    counters = 0 if str(device).startswith("cuda") else ADAM_COUNTER_BYTES * len(sizes)
    if impl == "foreach":
        transient = total
    else:
        transient = max((2 * s + (sizes[i - 1] if i else 0) for i, s in enumerate(sizes)), default=0)
    return OptimizerMemory(name, impl, 2 * total + counters, transient)


def step_peak(costs: ChainCosts, grad_bytes: int, opt: OptimizerMemory) -> int:
    """Peak of ``optimizer.step()``: static + gradients + the loss scalar + state + transient.

    0 for ``optimizer="none"`` (no step is run).
    """
    if opt.name == "none":
        return 0
    return costs.static + int(grad_bytes) + int(costs.a[-1]) + opt.state_bytes + opt.step_transient_bytes


def accumulating_costs(costs: ChainCosts) -> ChainCosts:
    """The cost model of a micro-batch run while every gradient is already allocated.

    The per-layer parameter bytes ``p`` (whose gradients the simulator adds as
    backward reaches them) become static bytes: micro-batches 2..k of a
    gradient-accumulation loop hold all gradients from their first operator on.
    """
    d = costs.to_dict()
    layers = d["layers"]
    d["static"] = int(d["static"]) + int(sum(layers["p"]))
    layers["p"] = [0] * len(layers["p"])
    return ChainCosts.from_dict(d)


def step_allocations(param_sizes: Sequence[int], optimizer: str, impl: str, first: bool,
                     tag: object = None) -> list[tuple[str, object, int]]:
    """The device allocations and frees of one ``optimizer.step()`` on CUDA, in order: ``("alloc", key,
    bytes)`` and ``("free", key, 0)``, for the parameters (with gradients) of the given sizes in the
    optimizer's order. ``first``: the step that creates the state (kept: never freed); ``tag`` makes the
    temporaries' keys unique per step.

    The rules of ``torch/optim`` (default arguments), checked by replaying them with the step against
    allocator histories recorded on an H200 (``benchmarks/allocator_replay.py``):

    * Adam/AdamW create ``exp_avg`` and ``exp_avg_sq`` per parameter, in order, on the first step (the
      ``step`` counters stay on the CPU). ``foreach`` then makes one ``_foreach_sqrt`` temporary per
      parameter, all before the update, and frees them as the list goes, last first; the for-loop makes
      ``sqrt`` and the quotient per parameter, frees the ``sqrt`` at once and the quotient when the next
      parameter's replaces it;
    * SGD with momentum clones each gradient into its buffer on the first step; plain SGD allocates nothing.
    """
    name = check_optimizer(optimizer)
    sizes = [int(b) for b in param_sizes]
    out: list[tuple[str, object, int]] = []
    if name == "sgd-momentum" and first:
        out += [("alloc", ("momentum", i), b) for i, b in enumerate(sizes)]
    if name not in ("adam", "adamw"):
        return out
    if first:
        for i, b in enumerate(sizes):
            out += [("alloc", ("exp_avg", i), b), ("alloc", ("exp_avg_sq", i), b)]
    if impl == "foreach":
        out += [("alloc", ("sqrt", tag, i), b) for i, b in enumerate(sizes)]
        out += [("free", ("sqrt", tag, i), 0) for i in reversed(range(len(sizes)))]
        return out
    for i, b in enumerate(sizes):
        out += [("alloc", ("sqrt", tag, i), b), ("alloc", ("denom", tag, i), b), ("free", ("sqrt", tag, i), 0)]
        if i:
            out.append(("free", ("denom", tag, i - 1), 0))
    if sizes:
        out.append(("free", ("denom", tag, len(sizes) - 1), 0))
    return out
