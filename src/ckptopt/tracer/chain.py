"""The tracer's entry point: a model becomes a chain of measured layers and its cost model.

Stages (a file each)::

    model --capture--------> fx.GraphModule   (opaque leaves where FX fails)
          --propagate------> fake value per node (no activation memory)
          --cuts-----------> candidate cuts; the layers between them
          --layer_costs----> LayerMeasurement per layer (fake tensors)
          --> ChainCosts

Each layer runs forward and backward once in isolation under ``FakeTensorMode``:
the storage tracker counts fake storages exactly as it counts real ones, and a
``saved_tensors_hooks`` pack hook tells which storages autograd keeps. No
activation is ever allocated, so a model that needs tens of GB to train traces
in a few MB.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

import networkx as nx
import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from ..costs import ChainCosts
from ..errors import TraceError
from ..segment_cost import segment_cost
from ..fake import fake_copy
from ..storages import storage_nbytes
from ..torch_utils import Inputs, default_loss, is_fake, normalize_inputs, tensor_leaves
from .capture import Captured, check_capture_mode
from .capture import capture as capture_graph
from .capture.export import OPAQUE_ROUNDS, recorded_lines
from .capture.opaque import starting_with
from ..solvers.limits import SIDE_AUTO_MAX_WORK, spare_core
from ..solvers.side_tensors import solves_within
from .cuts import MAX_CROSSING, SIDE_AUTO_MAX_N, candidate_groups
from .meta import unmaterialized
from .side_tensors import find_crossings, merge_aliased, merge_outputless
from .layer_run import reachable
from .assemble import ChainParts, chain_costs, distinct_bytes, prefix_peak
from .layers import Layer, hoisted_side_tensors, measure_layers
from .propagate import FakeRecorder, autocast_cache_bytes
from .statics import param_views, place_statics, static_nodes

__all__ = ["trace", "TracedModel", "Layer"]


@dataclass
class TracedModel:
    """What :func:`trace` returns.

    Attributes
    ----------
    gm : torch.fx.GraphModule
        The traced model; it shares parameters and buffers with the original.
    graph : networkx.DiGraph
        One vertex per FX node (attributes ``op``, ``target``, ``bytes``,
        ``shape``, ``dtype``), one edge per use.
    layers : list of Layer
        The chain handed to the solvers, in order; the last is the loss when
        the model returns one tensor.
    costs : ChainCosts
        The full-form cost model of that chain (static = parameters, buffers
        and inputs).
    opaque_modules : dict
        Submodules traced as one opaque layer because FX could not trace
        into them, with the reason.
    input_bytes, param_bytes, buffer_bytes : int
    example_shapes : tuple
        Shapes of the example's tensors.
    loss_fn : callable
    capture : Captured
        What the capture stage returned: the front end, how to bind a call to
        the graph and how to rebuild the model's output.
    hoisted : tuple of str
        Static graph nodes computed once before the first layer (counted in
        the static bytes; :mod:`ckptopt.tracer.statics`).
    constants : dict
        Node name -> the non-tensor value it had (sizes, flags), to rebuild a layer.
    tensor_meta : dict
        Node name -> ``(shape, dtype, requires_grad)`` of every layer input, to run a
        layer alone on a device (:mod:`ckptopt.calibration`).
    calibration : Calibration or None
        Set when ``costs`` were calibrated on the device (:mod:`ckptopt.calibration`).
    max_crossing : int
        The most tensors a cut may be crossed by (:func:`trace`); re-tracing at other
        shapes uses the same.
    """

    gm: fx.GraphModule
    graph: nx.DiGraph
    layers: list[Layer]
    costs: ChainCosts
    opaque_modules: dict[str, str]
    input_bytes: int
    param_bytes: int
    buffer_bytes: int
    example_shapes: tuple
    loss_fn: Callable | None = None
    capture: Captured | None = None
    hoisted: tuple[str, ...] = ()
    constants: dict = dataclasses.field(default_factory=dict)
    tensor_meta: dict = dataclasses.field(default_factory=dict)
    calibration: Any = None
    max_crossing: int = MAX_CROSSING

    @property
    def n(self) -> int:
        return len(self.layers)

    @property
    def flops(self) -> list[int]:
        """Forward FLOPs of every layer."""
        return [l.flops for l in self.layers]


def check_model_and_inputs(model, example_inputs) -> Inputs:
    """The normalized inputs, once model and inputs are checked (a module, trainable, one device)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"trace() needs an nn.Module, got {type(model).__name__}; pass the model itself "
            "(not model.parameters() or a function)"
        )
    inputs = normalize_inputs(example_inputs)
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"{type(model).__name__} has no parameters that require grad, so a training step has no "
            "backward pass to plan; unfreeze some parameters (p.requires_grad_(True)) first"
        )
    # (the meta device holds nothing: a meta model is planned on its batch's device, tracer/meta.py)
    meta_model = bool(params) and all(p.is_meta for p in params)
    devices = {t.device for t in inputs.tensors() + params if not (meta_model and t.is_meta)}
    if len(devices) > 1:
        raise ValueError(
            f"the model and its example inputs are on different devices ({', '.join(sorted(map(str, devices)))}); "
            "move them to one device first, e.g. model.to(dev) and x.to(dev)"
        )
    return inputs


def trace(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable | None = None,
    leaf_modules: Iterable[str | type] | None = None,
    capture: str = "auto",
    max_crossing: int | None = None,
    dynamic_shapes: bool = True,
) -> TracedModel:
    """Trace ``model`` into a chain cost model without allocating activations.

    Parameters
    ----------
    model : nn.Module
        In the mode it will train in (``model.train()``).
    example_inputs : Tensor, tuple or dict
        One training batch as the model is called: a tensor, a tuple of positional
        arguments, or a dict of keyword arguments (``model(**batch)``, as
        HuggingFace collators yield). Non-tensor values (None, flags) are allowed.
        Only shapes and dtypes are used.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar``; default: the output's ``loss`` when it has
        one (HuggingFace models given ``labels``), else ``output.float().pow(2).mean()``
        summed over tensor outputs (what :func:`ckptopt.measure_peak` uses).
    leaf_modules : iterable of str or type, optional
        Submodules (by qualified name, e.g. ``"transformer.h.0"``, or by
        class) to treat as one opaque layer each (``torch.fx`` capture).
        Submodules FX cannot trace are made opaque automatically; this is the
        explicit override.
    capture : str, default "auto"
        ``"fx"`` (``torch.fx`` symbolic tracing), ``"export"`` (``torch.export``,
        non-strict) or ``"auto"``: FX, and export when FX cannot trace the model
        (:mod:`ckptopt.tracer.capture`).
    max_crossing : int, optional
        A cut is offered where at most this many tensors computed before it are read
        after it (docs/design.md §4): the chain tensor and up to ``max_crossing - 1``
        side tensors (an encoder output read by every decoder layer, a skip connection,
        a second tower's input). 1 gives the single-tensor chain. Default: 8, halved (4, 2,
        1) while the model would have more than 1,000 layers or a trial run of the exact
        side-tensor program on its costs does not finish within ``SIDE_AUTO_MAX_WORK``
        (about 2 s; it can take minutes where nothing prunes; ``capture.notes`` says so).
    dynamic_shapes : bool, default True
        Export with dynamic batch and sequence dimensions, so that the graph (and a plan applied
        to it) runs on other shapes; False captures the example's shapes only, which is faster
        (for a caller that plans one shape, as :func:`ckptopt.planning.estimate` does).

    Returns
    -------
    TracedModel

    Raises
    ------
    TraceError
        The model cannot be captured (the message names the construct and what
        to try), or a layer cannot be measured.
    TypeError, ValueError
        Bad model or inputs (not a Module, no trainable parameters, mixed
        devices, inputs the model rejects).

    Notes
    -----
    Model inputs that need no gradient are static memory (the caller holds the
    batch): any layer may read them. Under an active ``torch.autocast`` context
    the layers are measured as they run under it (bf16/fp16 activations where
    autocast casts), and the weight copies autocast caches for the step count as
    static memory (the figures assume backward runs inside the same autocast
    context, as :func:`ckptopt.measure_peak` does; with backward outside it the
    cache is dropped earlier and the prediction errs high by at most that amount).
    """
    check_capture_mode(capture)
    if max_crossing is not None and (isinstance(max_crossing, bool) or not isinstance(max_crossing, int)
                                     or max_crossing < 1):
        raise ValueError(f"max_crossing must be an integer >= 1 (1: single-tensor cuts only), got {max_crossing!r}")
    if not isinstance(dynamic_shapes, bool):
        raise ValueError(f"dynamic_shapes must be True (other batch sizes and sequence lengths run the graph) or "
                         f"False (the example's shapes only), got {dynamic_shapes!r}")
    inputs = check_model_and_inputs(model, example_inputs)
    model, inputs = unmaterialized(model, inputs)  # meta tensors: fakes on a real device
    args = (model, inputs, loss_fn, leaf_modules, capture, max_crossing, dynamic_shapes)
    try:
        return _trace(*args)
    except TraceError as exc:
        if not getattr(exc, "line_unrecorded", False):
            raise
    with recorded_lines():  # (the same failure again, its graph with source lines: the message names the line)
        return _trace(*args)


def _trace(model: nn.Module, inputs: Inputs, loss_fn: Callable | None, leaf_modules, capture: str,
           max_crossing: int | None, dynamic_shapes: bool) -> TracedModel:
    """:func:`trace` of checked inputs: the capture, then its cost model."""
    captured = capture_graph(model, inputs, capture, leaf_modules, dynamic_shapes)
    try:
        return trace_captured(model, captured, inputs, loss_fn, max_crossing)
    except TraceError as exc:
        error, reading = exc, []
    # a submodule whose captured ops read a value runs as one op (capture/opaque.py), one more per round
    first = error
    for _ in range(OPAQUE_ROUNDS if capture != "fx" else 0):
        module = _reading_submodule(model, error)
        if module is None or module in reading:
            break
        reading.append(module)
        try:
            with starting_with(reading):
                captured = capture_graph(model, inputs, "export", leaf_modules, dynamic_shapes)
            return trace_captured(model, captured, inputs, loss_fn, max_crossing)
        except TraceError as exc:  # (another submodule reads a value: one more round)
            error = exc
        except Exception:  # noqa: BLE001 - the measurement's error names the line
            break
    raise (error if getattr(error, "module_path", None) else first) from None


def _reading_submodule(model: nn.Module, exc: TraceError) -> nn.Module | None:
    """The submodule of ``model`` whose captured ops (or, under FX, whose opaque leaf) read a tensor's
    value that measuring on fake tensors cannot follow (JetMoe's router: ``.tolist()``), or None."""
    path = getattr(exc, "module_path", None)
    if not path or any(p.is_meta or is_fake(p) for p in model.parameters()):  # (no values to run it on)
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def trace_captured(model: nn.Module, captured: Captured, example_inputs: Any,
                   loss_fn: Callable | None = None, max_crossing: int | None = None) -> TracedModel:
    """The cost model of an already captured graph at these inputs' shapes (no new capture):
    what :func:`trace` runs after its capture stage, and what re-prices a plan at other shapes."""
    inputs = normalize_inputs(example_inputs)
    loss_fn = loss_fn or default_loss
    run = _propagate(model, captured, inputs, loss_fn)
    grouping = _Grouping.of(run, captured)
    static = _StaticBytes(param=distinct_bytes(list(model.parameters())), buffer=distinct_bytes(list(model.buffers())),
                          input=distinct_bytes(list(inputs.tensors())))
    layers, costs, hoisted, max_crossing = _measure_at_a_crossing(run, grouping, captured, loss_fn, static,
                                                                   max_crossing)
    if costs.has_compute:  # (each checkpointed segment's fixed time, on the device it trains on)
        costs = costs.with_segment_cost(segment_cost(_device_type(model, inputs), costs.unit))
    gm, values = captured.gm, run.values
    read = {name for l in layers for name in (l.input_node, *l.static_inputs, *l.side_inputs)}
    return TracedModel(
        gm=gm, graph=_nx_graph(gm, values, run.fake_gm), layers=layers, costs=costs,
        opaque_modules=captured.opaque, input_bytes=static.input, param_bytes=static.param,
        buffer_bytes=static.buffer, example_shapes=inputs.shapes, loss_fn=loss_fn, capture=captured,
        hoisted=tuple(n.name for n in hoisted),
        constants={n.name: v for n, v in values.items() if n.op != "output" and not tensor_leaves(v)},
        tensor_meta={n.name: (tuple(v.shape), v.dtype, bool(v.requires_grad)) for n, v in values.items()
                     if n.name in read and isinstance(v, torch.Tensor)},
        max_crossing=max_crossing)


def _device_type(model: nn.Module, inputs: Inputs) -> str:
    """The type of the device the model trains on: its inputs' (a meta model is planned on its batch's
    device), else its parameters'."""
    for t in list(inputs.tensors()) + list(model.parameters()):
        if not t.is_meta:
            return t.device.type
    return "meta"


@dataclass
class _Propagated:
    """The captured graph run once on fake tensors."""

    fake_gm: fx.GraphModule
    fake_mode: Any
    values: dict  #: node of ``fake_gm`` -> its fake value
    trained: set[int] | None  #: ids of the parameters the loss reaches (None: all)
    cast_cache_bytes: int  #: autocast's cached weight casts (static)


def _propagate(model: nn.Module, captured: Captured, inputs: Inputs, loss_fn: Callable) -> _Propagated:
    """Bind the batch to the graph and run it on a fake copy of the model."""
    flat = captured.bind(inputs)
    if flat is None:
        takes = ", ".join(n.target for n in captured.placeholders)
        given = [f"{len(inputs.args)} positional"] + [f"{k}=" for k in inputs.kwargs]
        raise TypeError(f"example_inputs do not fit {type(model).__name__}.forward: it takes ({takes}), got "
                        f"{', '.join(given)}; pass the batch as the model is called in training")
    fake = fake_copy(captured.gm, Inputs(tuple(flat)))
    rec = FakeRecorder(fake.model)
    with fake.mode, torch.enable_grad():
        out = rec.run(*fake.inputs.args)
        trained = _trained_parameters(out, captured, loss_fn)
    run = _Propagated(fake.model, fake.mode, dict(rec.values), trained,
                      autocast_cache_bytes(fake.model, fake.inputs, fake.mode))
    if not any(t.requires_grad for t in tensor_leaves(out)):
        raise ValueError(
            "the model's output does not require grad on these inputs (no trainable parameter reaches it); "
            "nothing to checkpoint"
        )
    return run


@dataclass
class _Grouping:
    """How the graph's nodes fall into layers at a crossing: static values (model inputs needing no
    gradient; on op-level (export) graphs also what is computed from them alone, hoisted before the first
    layer when several layers read it), then the cuts between the rest."""

    run: _Propagated
    static: set
    placeholders: list
    out_node: fx.Node
    derived: bool  #: an op-level graph: statics derived from inputs are hoisted

    @classmethod
    def of(cls, run: _Propagated, captured: Captured) -> "_Grouping":
        gm, values = run.fake_gm, run.values
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        derived = captured.front_end != "fx"
        static = static_nodes(gm, values) if derived else {
            n for n in placeholders if not any(t.requires_grad for t in tensor_leaves(values.get(n)))}
        static |= param_views(gm, values)  # (a weight's transpose: the parameter's storage, placed like a static)
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        return cls(run, static, placeholders, out_node, derived)

    def groups(self, crossing: int) -> tuple[list[list[fx.Node]], list[fx.Node]]:
        """``(groups, hoisted)``: the layers' nodes at ``crossing``, and the nodes hoisted before them."""
        values = self.run.values
        groups = candidate_groups(self.run.fake_gm, values, self.static, crossing)
        hoisted: list[fx.Node] = []
        if self.derived or any(n.op != "placeholder" for n in self.static):
            groups, hoisted = place_statics(groups, self.static, values)
        groups = [g for g in groups if g]  # (empty: made only of hoisted or moved nodes)
        # op-level graphs: assertions and same-dtype casts between blocks are no layers
        groups = merge_aliased(groups, self.static, values, self.out_node, always=self.derived)
        groups = merge_outputless(groups, self.static, values, self.out_node)
        return groups, hoisted


@dataclass(frozen=True)
class _StaticBytes:
    """The model's own static bytes."""

    param: int
    buffer: int
    input: int


def _measure_at_a_crossing(run: _Propagated, grouping: _Grouping, captured: Captured, loss_fn: Callable,
                           static: _StaticBytes, max_crossing: int | None) -> tuple[list, ChainCosts, list, int]:
    """``(layers, costs, hoisted, crossing)`` at ``max_crossing``, or, when None, at the most tensors per cut
    (8, halved down to 1) whose layers the tracer measures and whose exact side-tensor program finishes in
    seconds (:data:`~ckptopt.tracer.cuts.SIDE_AUTO_MAX_N`, a trial run within
    :data:`~ckptopt.solvers.limits.SIDE_AUTO_MAX_WORK`); the reason for fewer goes to the capture's notes.

    The exact side-tensor program is fast when its saved-bytes bound prunes and O(n^3 2^k) when nothing
    does (a peak in the loss): which one, only the costs tell, so a trial run says. Each trial runs in a
    thread of its own (the program releases the GIL) while the next crossing's layers are measured, and
    the answer is the same as trying them one after the other: the first crossing whose trial finishes;
    the trials of smaller crossings stop once it is known."""
    auto = max_crossing is None
    max_crossing = MAX_CROSSING if auto else max_crossing
    groups, hoisted = grouping.groups(max_crossing)
    many = len(groups)
    while auto and max_crossing > 1 and len(groups) > SIDE_AUTO_MAX_N:  # too many layers at this crossing
        max_crossing //= 2
        groups, hoisted = grouping.groups(max_crossing)
    why = f"the model has {many} layers, more than the {SIDE_AUTO_MAX_N} the tracer measures at that crossing"
    memo: dict = {}  # (a layer that stays the same at another crossing is not measured again)
    measure = lambda g, h: _measured_costs(run, grouping, g, h, captured, loss_fn, static, memo)  # noqa: E731
    if not auto:
        layers, costs = measure(groups, hoisted)
        return layers, costs, hoisted, max_crossing
    trials = _Trials()
    try:
        while True:
            t0 = time.perf_counter()
            try:
                measured = measure(groups, hoisted)
            except Exception:  # noqa: BLE001 - speculative: a larger crossing's trial may make it moot
                if not trials.pending:
                    raise
                trials.last = (max_crossing, None, hoisted, sys.exc_info()[1])
                break
            if max_crossing == 1 or not measured[1].side:  # (no trial: this crossing answers if none before does)
                trials.last = (max_crossing, measured, hoisted, None)
                break
            trials.start(max_crossing, measured, hoisted)
            # measure the next crossing beside the trial only once the trial has run about as long as that
            # takes (a trial that finishes sooner, as most do, costs no measurement it does not need)
            if trials.settled(timeout=time.perf_counter() - t0):
                break
            max_crossing //= 2
            groups, hoisted = grouping.groups(max_crossing)
        (max_crossing, (layers, costs), hoisted), failed = trials.answer()
    finally:
        trials.stop_all()
    if failed is not None:
        why = (f"the exact side-tensor program over its {failed[1]} layers at {failed[0]} would not finish "
               f"in seconds (more than {SIDE_AUTO_MAX_WORK:,} layer passes)")
    if max_crossing < MAX_CROSSING:
        note = (f"cuts crossed by at most {max_crossing} tensor{'s' if max_crossing > 1 else ''}: with up to "
                f"{MAX_CROSSING} {why} (trace(max_crossing={MAX_CROSSING}) forces them)")
        if note not in captured.notes:
            captured.notes.append(note)
    return layers, costs, hoisted, max_crossing


class IdleTask:
    """Work a caller hands the tracer to run, in the tracing thread, while it would otherwise wait for a
    crossing's trial (:func:`while_waiting`), work that does not depend on the trace (an estimate's
    allocator replay of the model as it is). :meth:`value` runs it where the wait never came."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn = fn
        self.done = False
        self._result: Any = None
        self._error: Exception | None = None

    def run(self) -> None:
        if not self.done:
            self.done = True
            try:
                self._result = self._fn()
            except Exception as exc:  # noqa: BLE001 - raised where the caller asks for the value
                self._error = exc

    def value(self) -> Any:
        self.run()
        if self._error is not None:
            raise self._error
        return self._result


_IDLE = threading.local()  # .tasks: the tasks :func:`while_waiting` gave this thread


@contextmanager
def while_waiting(task: IdleTask | None):
    """While active, traces in this thread run ``task`` (None: nothing) when they would wait for a trial."""
    tasks = _IDLE.__dict__.setdefault("tasks", [])
    tasks.append(task)
    try:
        yield task
    finally:
        tasks.pop()


def _run_idle_tasks() -> None:
    for task in getattr(_IDLE, "tasks", ()):
        if task is not None:
            task.run()


class _Trial(NamedTuple):
    """One crossing's trial run (:func:`~ckptopt.solvers.side_tensors.solves_within`)."""

    crossing: int
    measured: tuple  # (layers, costs)
    hoisted: list
    done: Future  # whether the program finished within its work limit
    stop: np.ndarray  # set to 1 to end it early


class _Trials:
    """The crossings' trial runs, largest crossing first, each in a thread; :meth:`answer` is the first
    crossing whose trial finishes, else the last one measured (:attr:`last`, which needs no trial). Without
    a spare core the trials run one at a time."""

    def __init__(self):
        self.pending: list[_Trial] = []  # largest crossing first
        self.last: tuple | None = None  # (crossing, (layers, costs) or None, hoisted, error or None)
        self._pool = ThreadPoolExecutor(max_workers=MAX_CROSSING.bit_length()) if spare_core() else None
        self._failed: tuple | None = None  # (crossing, layers) of the last trial that did not finish

    def start(self, crossing: int, measured: tuple, hoisted: list) -> None:
        stop = np.zeros(1, dtype=np.int64)
        if self._pool is not None:
            done = self._pool.submit(solves_within, measured[1], SIDE_AUTO_MAX_WORK, stop)
        else:
            done = Future()
            done.set_result(solves_within(measured[1], SIDE_AUTO_MAX_WORK, stop))
        self.pending.append(_Trial(crossing, measured, hoisted, done, stop))

    def settled(self, timeout: float | None = None) -> bool:
        """Whether the answer is known: the largest pending trial finished (waiting up to ``timeout``
        seconds for it; None: as long as it takes), or failed and the next one did, and so on. Failed
        trials leave the list. Before it waits, the tasks :func:`while_waiting` gave run."""
        if self.pending and not self.pending[0].done.done():
            _run_idle_tasks()
        while self.pending:
            trial = self.pending[0]
            try:
                if trial.done.result(timeout=timeout):
                    return True
            except FutureTimeout:
                return False
            self._failed = (trial.crossing, trial.measured[1].n)
            self.pending.pop(0)
        return False

    def answer(self) -> tuple[tuple, tuple | None]:
        """``((crossing, (layers, costs), hoisted), failed)``: ``failed`` the last larger crossing whose trial
        did not finish (None if none)."""
        if self.settled():
            trial = self.pending[0]
            return (trial.crossing, trial.measured, trial.hoisted), self._failed
        crossing, measured, hoisted, error = self.last
        if error is not None:
            raise error
        return (crossing, measured, hoisted), self._failed

    def stop_all(self) -> None:
        for trial in self.pending:
            trial.stop[0] = 1
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _measured_costs(run: _Propagated, grouping: _Grouping, groups: list, hoisted: list, captured: Captured,
                    loss_fn: Callable, static: _StaticBytes,
                    memo: dict | None = None) -> tuple[list[Layer], ChainCosts]:
    """``(layers, costs)`` of one grouping: the layers measured (``memo``: the measurements of layers alike,
    :mod:`~ckptopt.tracer.layer_key`), the side tensors found."""
    gm, values, out_node = run.fake_gm, run.values, grouping.out_node
    readable = {n for n in grouping.static if n.op == "placeholder" or n in set(hoisted)}
    crossings = find_crossings(groups, grouping.static, values, out_node)
    model_output = out_node.args[0]
    single_output = isinstance(model_output, fx.Node) and isinstance(values.get(model_output), torch.Tensor)
    layers, side, grad_store, grad_root, param_owner = measure_layers(
        gm, run.fake_mode, groups, crossings, readable, values, grouping.placeholders, captured, loss_fn,
        model_output, single_output, memo)
    inputs = [t for n in grouping.placeholders for t in tensor_leaves(values.get(n))]
    existing = inputs + list(gm.parameters()) + list(gm.buffers())  # (a hoisted weight view is free)
    kept = [n for n in hoisted if any(u not in set(hoisted) for u in n.users)]  # the rest die in the prefix
    # hoisted values the layers read live as side tensors made before the first layer (held while a layer
    # that saves them, or a checkpoint's frame, does: not for the whole step); the rest (read by the
    # model's output) stay static
    early, kept = hoisted_side_tensors(kept, layers, values, out_node, existing)
    kept_bytes = distinct_bytes(existing + [t for n in kept for t in tensor_leaves(values.get(n))]) - distinct_bytes(
        existing)
    parts = ChainParts(
        side=list(side) + early, grad_store=grad_store, grad_root=grad_root,
        param_grad_bytes=_param_grad_bytes(gm, len(layers), param_owner, run.trained),
        static=static.param + static.buffer + static.input + run.cast_cache_bytes + kept_bytes,
        prefix_peak=(prefix_peak(hoisted, values, existing) - kept_bytes - sum(t.bytes for t in early)
                     if hoisted else None))
    return layers, chain_costs(layers, parts)


def _param_grad_bytes(gm: fx.GraphModule, n: int, param_owner: dict, trained: set[int] | None) -> list[int]:
    """Gradient bytes of the parameters, charged to the last layer that uses them (tied weights once); a
    frozen parameter (a LoRA base weight) gets none, and neither does one the loss does not reach (a head
    whose output is returned beside the loss)."""
    params = {id(p): p for p in gm.parameters() if p.requires_grad}
    out = [0] * n
    for pid, j in param_owner.items():
        out[j] += storage_nbytes(params[pid]) if pid in params and (trained is None or pid in trained) else 0
    return out


def _trained_parameters(out: Any, captured: Captured, loss_fn: Callable) -> set[int] | None:
    """Ids of the parameters the loss's backward reaches (their AccumulateGrad nodes), from the
    propagation run's fake output; None when the loss cannot be formed here (all count)."""
    try:
        loss = loss_fn(captured.rebuild(out) if captured.rebuild is not None else out)
    except Exception:  # noqa: BLE001 - the last layer's measurement reports a loss that fails
        return None
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return None
    return {id(fn.variable) for fn in reachable([loss]) if isinstance(getattr(fn, "variable", None), torch.Tensor)}


def _nx_graph(gm: fx.GraphModule, values: dict, fake_gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    by_name = {n.name: n for n in fake_gm.graph.nodes}
    for n in gm.graph.nodes:
        v = values.get(by_name.get(n.name))
        ts = tensor_leaves(v)
        g.add_node(n.name, op=n.op, target=str(n.target),
                   bytes=sum(storage_nbytes(t) for t in ts),
                   shape=tuple(ts[0].shape) if ts else None, dtype=str(ts[0].dtype) if ts else None)
    for n in gm.graph.nodes:
        for u in n.users:
            g.add_edge(n.name, u.name)
    return g
