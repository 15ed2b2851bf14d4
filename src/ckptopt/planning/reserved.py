"""What a training step reserves on CUDA: its allocations, from a fake step, replayed through the allocator.

The cost model predicts the bytes a step allocates; whether it runs depends on what the caching
allocator *reserves* for them, which rounding and fragmentation put above that in whole segments
(``docs/design.md`` §9). :func:`step_events` gives the device's allocations and frees of a training
loop's first steps, in order, without a device, and :func:`replay_steps` replays them through
:class:`ckptopt.simulator.allocator.CachingAllocator` (the native allocator's rules) under a capacity.

The sequence is built from what is known without the device:

* the model as ``model.to("cuda")`` allocates it: ``Module._apply``'s order (each module's children
  first, then its own parameters, then its buffers; a tensor shared by two modules once), then the
  batch's tensors;
* each step as a fake-tensor copy of the model runs it under the storage tracker
  (:class:`ckptopt.tracker.StorageTracker`), which sees every storage an operator makes and the moment
  each dies: ``zero_grad(set_to_none=True)``, forward, loss, backward, in the order autograd runs them
  on the CPU, which is the order the device runs them in (one stream);
* what the device adds that a fake step does not show: cuBLAS's workspace, allocated through the
  caching allocator by the first matrix product of each thread (the forward's, and the backward's on
  autograd's device thread) and kept, :data:`CUBLAS_WORKSPACE_BYTES` each;
* the optimizer's state and temporaries by its rules (:func:`ckptopt.planning.optimizer.step_allocations`).

Replayed against allocator histories recorded on an H200 (``benchmarks/allocator_replay.py``, the
``synthesized`` rows; ``tests/test_allocator_replay.py``), the reserved peak of each step of GPT and
a transformers Llama lands within one segment of what the device reserved, and every
fits/runs-out answer at the recorded capacity is right. Two things are out of its reach, and a step
that has them gets no replay (:attr:`StepEvents.unsupported` says which): convolutions, whose cuDNN
workspaces the library sizes on the device at run time (ResNet-50's replay missed by up to two
segments), and allocator settings the replay does not model (``roundup_power2_divisions``,
``garbage_collection_threshold``, the ``cudaMallocAsync`` backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..simulator.allocator import AllocatorRules, CapacityReplays, ReplayResult, replay
from ..storages import real_storage
from ..tracker import StorageTracker
from .optimizer import check_optimizer, step_allocations

__all__ = ["CUBLAS_WORKSPACE_BYTES", "StepEvents", "allocator_settings", "cublas_workspace_bytes", "step_events",
           "replay_steps", "replay_declined", "least_capacity", "replayed_needs"]

#: cuBLAS's workspace per handle (``CublasHandlePool.cpp``, ``parseChosenWorkspaceSize``): 4096 KiB x 8 on
#: compute capability 9 and above, the default assumed when the device is not at hand (the larger one);
#: 4096 KiB x 2 + 16 KiB x 8 before. ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) overrides both.
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 8
CUBLAS_WORKSPACE_BYTES_BEFORE_SM90 = 4096 * 1024 * 2 + 16 * 1024 * 8

#: ops that make a cuBLAS call (and so, the first time on a thread, its workspace)
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_addmm_activation", "_scaled_mm"})
#: ops whose device workspace the replay cannot know (cuDNN picks and sizes it on the device)
DEVICE_WORKSPACE_OPS = frozenset({"convolution", "_convolution", "convolution_backward", "cudnn_convolution",
                                  "cudnn_convolution_transpose", "conv1d", "conv2d", "conv3d"})
#: allocator settings the replay models: every other one makes it decline
MODELLED_SETTINGS = frozenset({"expandable_segments", "max_split_size_mb"})


def cublas_workspace_bytes(major: int | None = None) -> int:
    """cuBLAS's workspace per handle on a device of compute capability ``major`` (None: not at hand, the
    larger default), or as ``CUBLAS_WORKSPACE_CONFIG`` sets it."""
    conf = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    if conf:
        parts = [p for p in conf.split(":") if p]
        try:
            return sum(int(parts[i]) * 1024 * int(parts[i + 1]) for i in range(0, len(parts) - 1, 2))
        except ValueError:
            pass
    return CUBLAS_WORKSPACE_BYTES_BEFORE_SM90 if major is not None and major < 9 else CUBLAS_WORKSPACE_BYTES


def allocator_settings(conf: str | None = None) -> tuple[bool, AllocatorRules, str | None]:
    """``(expandable, rules, unsupported)`` of the CUDA allocator configuration ``conf`` (default:
    ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``); ``unsupported`` names a setting the replay
    does not model (None when it models them all)."""
    if conf is None:
        conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    expandable, max_split = False, None
    for item in conf.split(","):
        key, _, value = (s.strip() for s in item.partition(":"))
        if not key:
            continue
        if key == "backend" and value == "native":
            continue
        if key not in MODELLED_SETTINGS:
            return False, AllocatorRules(), f"the allocator setting {key}:{value} is not modelled"
        if key == "expandable_segments":
            expandable = value.lower() in ("true", "1")
        else:
            max_split = int(float(value) * 1024 * 1024)
    return expandable, AllocatorRules(max_split_size=max_split), None


@dataclass
class StepEvents:
    """A training loop's device allocations, in order: ``("alloc", key, bytes)`` and ``("free", key, 0)``.

    ``phases``: ``(name, index of its first event)`` for ``model`` and each step (``step1``, ...);
    ``unsupported``: why the sequence misses something the device allocates (None: it does not)."""

    events: list[tuple[str, Any, int]]
    phases: list[tuple[str, int]]
    unsupported: str | None = None


class _EventTracker(StorageTracker):
    """The storage tracker, also writing each new storage and each death as an event, and cuBLAS's
    workspace at the first matrix product of each pass."""

    def __init__(self, workspace: int):
        super().__init__(fake=True)
        self.events: list[tuple[str, Any, int]] = []
        self.recording = False
        self.workspace = workspace
        self.pass_name = "forward"
        self.workspaces: set[str] = set()
        self.unsupported: str | None = None

    def _add_tensor(self, t: torch.Tensor) -> None:
        count = len(self._entries)
        super()._add_tensor(t)  # (a wrapper subclass comes back here for each inner tensor)
        if self.recording and len(self._entries) > count and not is_traceable_wrapper_subclass(t):
            sid = id(real_storage(t, True))
            self.events.append(("alloc", sid, self._entries[sid][1]))

    def _release(self, sid: int) -> None:
        if self.recording and sid in self._entries:
            self.events.append(("free", sid, 0))
        super()._release(sid)

    def _on_op(self, func, out) -> None:
        name = func.__name__.split(".")[0]
        if name in MATMUL_OPS and self.pass_name not in self.workspaces:
            self.workspaces.add(self.pass_name)
            self.events.append(("alloc", ("cublas workspace", self.pass_name), self.workspace))
        elif name in DEVICE_WORKSPACE_OPS and self.unsupported is None:
            self.unsupported = (f"the step runs {name}, whose cuDNN workspace the device sizes at run time "
                                "(not known without the device)")
        super()._on_op(func, out)


def _model_events(model: nn.Module, inputs) -> list[tuple[str, Any, int]]:
    """The allocations of ``model.to(device)`` (``Module._apply``: children first, then the module's
    parameters, then its buffers; each storage once) and of the batch's tensors."""
    out, seen = [], set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and id(t.untyped_storage()) not in seen:
                seen.add(id(t.untyped_storage()))
                out.append(("alloc", ("model", len(out)), t.untyped_storage().nbytes()))

    visit(model)
    for t in inputs.tensors():
        if id(t.untyped_storage()) not in seen:
            seen.add(id(t.untyped_storage()))
            out.append(("alloc", ("model", len(out)), t.untyped_storage().nbytes()))
    return out


def step_events(model: nn.Module, inputs, loss_fn: Callable | None = None, build: Callable | None = None,
                optimizer: str = "adam", impl: str = "foreach", steps: int = 2,
                workspace_bytes: int | None = None) -> StepEvents:
    """The device allocations of building ``model`` and its batch and of ``steps`` training steps
    (``zero_grad(set_to_none=True)``, forward, loss, backward, ``optimizer.step()``), from a fake-tensor
    copy: nothing is allocated. ``build(fake_model)`` gives the module that trains (a plan applied to
    the copy; None: the copy itself). ``inputs``: :class:`ckptopt.torch_utils.Inputs`."""
    from ..fake import fake_copy
    from ..measure import forward_loss
    from ..tracer.meta import unmaterialized

    name = check_optimizer(optimizer)
    model, inputs = unmaterialized(model, inputs)  # (a model on the meta device: fakes of its tensors)
    fake = fake_copy(model, inputs)
    events = _model_events(fake.model, fake.inputs)
    phases = [("model", 0)]
    run = build(fake.model) if build is not None else fake.model
    params = [p for p in fake.model.parameters() if p.requires_grad]
    tracker = _EventTracker(cublas_workspace_bytes() if workspace_bytes is None else workspace_bytes)
    try:
        with fake.mode, torch.enable_grad():
            tracker.register(fake.model, fake.inputs.tensors())
            tracker.events = events
            tracker.recording = True
            with tracker:
                phases.append(("step1", len(events)))
                for p in params:  # zero_grad(set_to_none=True), in the optimizer's order
                    p.grad = None
                tracker.pass_name = "forward"
                loss = forward_loss(run, fake.inputs, loss_fn)
                tracker.pass_name = "backward"  # (autograd's device thread: a cuBLAS handle of its own)
                loss.backward()
                del loss
            grads = [id(real_storage(p.grad, True)) for p in params if p.grad is not None]
            sizes = [p.numel() * p.element_size() for p in params if p.grad is not None]
    finally:
        tracker.recording = False
        tracker.detach()
        if run is not fake.model and hasattr(run, "remove_hooks"):
            run.remove_hooks()
    step = events[phases[-1][1]:]
    if name != "none":
        events += step_allocations(sizes, name, impl, first=True, tag=0)
    for k in range(1, steps):  # each later step runs the first one's forward and backward again
        phases.append((f"step{k + 1}", len(events)))
        events += _again(step, grads if k == 1 else [(k - 1, g) for g in grads], k)
        if name != "none":
            events += step_allocations(sizes, name, impl, first=False, tag=k)
    return StepEvents(events, phases, tracker.unsupported)


def _again(step: list[tuple[str, Any, int]], grads: list, k: int) -> list[tuple[str, Any, int]]:
    """The forward and backward of step ``k`` (from 1) as the first step made them: the fake step is the
    same every time, so its events repeat with the step's own keys, after ``zero_grad(set_to_none=True)``
    frees the previous step's gradients (``grads``: their keys, in the optimizer's order). What the
    first step made once and kept (cuBLAS's workspaces) is not made again."""
    made = {key for what, key, _ in step if what == "alloc"}
    out: list[tuple[str, Any, int]] = [("free", g, 0) for g in grads]
    for what, key, size in step:
        if isinstance(key, tuple) and key[0] == "cublas workspace":
            continue
        out.append((what, (k, key) if key in made else key, size))
    return out


def replay_steps(steps: StepEvents, capacity: int | None, conf: str | None = None) -> ReplayResult:
    """:func:`ckptopt.simulator.allocator.replay` of ``steps`` under ``capacity`` bytes with the
    allocator configuration ``conf`` (default: the environment's)."""
    expandable, rules, unsupported = allocator_settings(conf)
    if unsupported:
        raise ValueError(f"cannot replay the CUDA allocator: {unsupported}")
    return replay(steps.events, capacity, rules, expandable)


def replay_declined(device: str, headroom: Any, parallel: Any, keep_output: bool) -> str | None:
    """Why an answer for ``device`` keeps a headroom share rather than replaying the allocator (None: it
    replays): off CUDA there is no caching allocator; a given headroom is the caller's rule; a rank's
    collective buffers, a loop that keeps the output and an allocator setting the replay does not
    model are not in the sequence. (A convolution is found when the step runs: :attr:`StepEvents.unsupported`.)"""
    if not str(device).startswith("cuda"):
        return "no caching allocator off CUDA"
    if headroom is not None:
        return "a headroom was given"
    if parallel is not None:
        return "the replay does not model a rank's collective buffers"
    if keep_output:
        return "the replay does not model a loop that keeps the output"
    return allocator_settings()[2]


def least_capacity(events: list, conf: str | None = None, step: int = 2 * 1024 * 1024) -> int:
    """The least memory (to ``step`` bytes) under which the replay of ``events`` runs without running out:
    between what it allocates at its peak and what it reserves without a limit (under a limit the allocator
    releases its cache and retries before it gives up, so less than that can do)."""
    expandable, rules, unsupported = allocator_settings(conf)
    if unsupported:
        raise ValueError(f"cannot replay the CUDA allocator: {unsupported}")
    replays = CapacityReplays(events, rules, expandable)
    free = replays.unlimited
    lo, hi = free.max_allocated - 1, free.max_reserved  # (fails at lo: less than its live blocks; fits at hi)
    while hi - lo > step:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if replays.replay(mid).fits else (mid, hi)
    return hi


def replayed_needs(model: nn.Module, inputs, loss_fn: Callable | None, builds: dict[str, Callable | None],
                   optimizer: str, impl: str) -> tuple[dict[str, int] | None, str | None]:
    """For each label in ``builds`` (a plan applied to a fake copy, or None for the model as it is), the
    least memory the loop's first two steps run in, replayed (:func:`least_capacity`); or ``(None, why)``
    when a step makes allocations the replay cannot know."""
    out = {}
    for label, build in builds.items():
        try:
            steps = step_events(model, inputs, loss_fn, build, optimizer, impl)
        except Exception as exc:  # noqa: BLE001 - the share answers instead, and the answer says why
            return None, f"the step did not run on fake tensors ({type(exc).__name__}: {str(exc)[:200]})"
        if steps.unsupported:
            return None, steps.unsupported
        out[label] = least_capacity(steps.events)
    return out, None
