"""Device calibration: each layer run once on the real device, folded into the cost model.

The traced cost model counts tensors, measured on fake tensors. On a real device two
more things cost memory and one thing costs time:

* **scratch**: memory an operator takes from the allocator beyond its tensors (cuDNN
  convolution workspaces, block rounding), present only while it runs: the
  allocator's peak minus the tensor-storage peak of the same phase;
* **a fixed workspace**: what the libraries keep once the first matrix product ran
  (cuBLAS: 65-70 MB on an H100, ``docs/gpu.md``), measured, never
  assumed. The libraries keep one per thread: the forward runs on the caller's thread, the
  backward on autograd's device thread, and a checkpointed segment's recomputation runs
  forward kernels there too (cuBLASLt's 1 MiB for a Linear with a bias, on an H200); so the
  layers' forwards are replayed once inside a backward and what that adds is kept as well
  (``recompute_workspace_bytes``);
* **time**: the forward and backward of each layer, measured, so that recomputation
  is priced in seconds rather than FLOPs (memory-bound BatchNorm/ReLU/add cost more
  than their FLOPs on a GPU).

:func:`calibrate` runs each layer alone (its inputs synthesized at the traced shapes;
model inputs and the values computed from them alone are the real ones), so only one
layer's memory is ever allocated, and caches the result per layer signature, shapes,
dtype and device: a model's repeated blocks are measured once.
:meth:`Calibration.apply` folds it into a :class:`~ckptopt.ChainCosts` (scratch into
the transients ``f``/``fs``/``b``/``bk``/``bf`` (and ``ff``/``ffs``/``br``/``bkr``), the
workspace into the static bytes, times into ``c``/``cb`` with unit ``"ns"``), so the
simulator and every solver see it. On
a device without allocator statistics (the CPU) scratch and workspace are zero and
only the times change. Design notes: ``docs/design.md`` §9.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .costs import ChainCosts
from .segment_cost import segment_cost
from .torch_utils import Inputs, no_lasting_state, normalize_inputs, tensor_leaves
from .tracer import TracedModel
from .tracer.cuts import WithLoss, subgraph_module
from .tracker import StorageTracker

__all__ = ["LayerCalibration", "Calibration", "DeviceProbe", "calibrate", "clear_cache"]


# --------------------------------------------------------------------------
# what a device tells about its memory
# --------------------------------------------------------------------------
class DeviceProbe:
    """Allocator statistics and synchronization of one device.

    ``phase()`` returns the allocator's peak since ``begin()`` above what was allocated
    then, or None where the device keeps no statistics (the CPU); ``workspace()`` the
    bytes that stayed allocated since ``start()`` once every tensor of the calibration
    is gone (libraries' workspaces: ``start()`` clears cuBLAS's, so that they are
    measured even when an earlier step created them). Subclass it to inject figures
    (the tests do, on CPU).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._base = 0
        self._start = 0

    @property
    def has_statistics(self) -> bool:
        """Whether :meth:`phase` reports an allocator peak (CUDA), so that scratch can be measured."""
        return self.cuda

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        if self.cuda:
            self.synchronize()
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def phase(self) -> int | None:
        if not self.cuda:
            return None
        self.synchronize()
        return int(torch.cuda.max_memory_allocated(self.device)) - self._base

    def start(self) -> None:
        if self.cuda:
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
                _in_backward(clear, self.device)  # (builds that keep them per thread: autograd's too)
            self.synchronize()
            self._start = torch.cuda.memory_allocated(self.device)

    def workspace(self) -> int:
        if not self.cuda:
            return 0
        self.synchronize()
        return max(0, int(torch.cuda.memory_allocated(self.device)) - self._start)


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCalibration:
    """One layer measured on the device.

    Attributes
    ----------
    forward_seconds, backward_seconds : float
        Medians over the timed repeats (after a warm-up run).
    forward_scratch, backward_scratch : int
        Allocator peak minus tensor-storage peak of the phase (0 without allocator statistics).
    cached : bool
        Taken from an earlier measurement of the same layer signature.
    """

    forward_seconds: float
    backward_seconds: float
    forward_scratch: int = 0
    backward_scratch: int = 0
    cached: bool = False


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured; :meth:`apply` folds it into a cost model."""

    device: str
    layers: tuple[LayerCalibration, ...]
    workspace_bytes: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    recompute_workspace_bytes: int = 0
    segment_seconds: float | None = None

    @property
    def measured(self) -> int:
        """How many layers were run (the others reused a measurement of the same signature)."""
        return sum(not layer.cached for layer in self.layers)

    def apply(self, costs: ChainCosts) -> ChainCosts:
        """``costs`` with scratch in the transients, the workspaces in the static bytes, and measured
        times (ns) as the compute costs ``c`` (forward) and ``cb`` (backward), and the measured fixed
        time of a checkpointed segment (``segment_seconds``) as its ``segment_cost``.

        The workspace a recomputation adds (``recompute_workspace_bytes``) is counted for every
        plan: a plan that recomputes nothing is over-predicted by it (1 MiB where measured)."""
        if len(self.layers) != costs.n:
            raise ValueError(f"the calibration has {len(self.layers)} layers, the cost model {costs.n}")
        d = costs.to_dict()
        _add_scratch(d["layers"], self.layers, 1)
        d["static"] = int(d["static"]) + self.workspace_bytes + self.recompute_workspace_bytes
        d["compute"] = [int(round(cal.forward_seconds * 1e9)) for cal in self.layers]
        d["backward_compute"] = [int(round(cal.backward_seconds * 1e9)) for cal in self.layers]
        d["compute_unit"] = "ns"
        d["segment_cost"] = segment_cost(self.device.split(":")[0], "ns", self.segment_seconds)
        return ChainCosts.from_dict(d)


#: The transients a layer's scratch joins: every forward one (``ff``/``fc``/``ffc`` are present where they
#: differ from ``f``), the forward saved ones where positive, and every backward one.
FORWARD_TRANSIENTS = ("f", "ff", "fc", "ffc")
FORWARD_SAVED = ("fs", "ffs")
BACKWARD_TRANSIENTS = ("b", "bk", "bf", "br", "bkr", "brt", "bkrt")


def _add_scratch(layers: dict, cals, sign: int) -> None:
    """Each layer's scratch added to (``sign`` 1) or taken from (-1) the transients of a cost model's
    ``to_dict()["layers"]``: a saved transient changes only where positive, which it stays."""
    for i, cal in enumerate(cals):
        for name in FORWARD_TRANSIENTS + FORWARD_SAVED + BACKWARD_TRANSIENTS:
            if name not in layers or (name in FORWARD_SAVED and layers[name][i] <= 0):
                continue
            layers[name][i] += sign * (cal.backward_scratch if name in BACKWARD_TRANSIENTS else cal.forward_scratch)


_CACHE: dict[tuple, LayerCalibration] = {}


def clear_cache() -> None:
    """Forget every cached layer measurement."""
    _CACHE.clear()


# --------------------------------------------------------------------------
# running the layers
# --------------------------------------------------------------------------
def calibrate(model: nn.Module, traced: TracedModel, example_inputs: Any, repeats: int = 3,
              probe: DeviceProbe | None = None, cache: bool = True) -> Calibration:
    """Run every layer of ``traced`` alone on the model's device and measure it.

    Parameters
    ----------
    model : nn.Module
        The traced model, on the device it trains on (its parameters are used; its
        buffers, gradients and RNG state are left as they were).
    traced : TracedModel
        ``ckptopt.trace(model, example_inputs)``.
    example_inputs
        The batch it was traced with (model inputs are run as they are).
    repeats : int, default 3
        Timed runs per layer after a warm-up run; the medians are kept.
    probe : DeviceProbe, optional
        The device's allocator statistics (default: the model's device).
    cache : bool, default True
        Reuse measurements of layers with the same signature, shapes, dtype and device.

    Returns
    -------
    Calibration

    Notes
    -----
    Only one layer's activations exist at a time: its input is synthesized at the
    traced shape (random values; the model's inputs and the static values computed from
    them are the real ones).
    """
    inputs = normalize_inputs(example_inputs)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    probe = probe or DeviceProbe(device)
    t_start = time.perf_counter()
    built = _layer_modules(traced, inputs, device)  # the static values it computes stay: they are counted
    out: list[LayerCalibration] = []
    with no_lasting_state(model, inputs.tensors(), device):
        probe.start()
        for module, make_input, statics, key in built:
            full_key = (key, str(device), type(probe).__name__)
            if cache and full_key in _CACHE:
                hit = _CACHE[full_key]
                out.append(LayerCalibration(hit.forward_seconds, hit.backward_seconds, hit.forward_scratch,
                                            hit.backward_scratch, cached=True))
                continue
            cal = _measure(module, make_input, statics, probe, repeats)  # one layer's inputs at a time
            if cache:
                _CACHE[full_key] = cal
            out.append(cal)
            for p in module.parameters():
                p.grad = None
        workspace = probe.workspace()
        recompute_workspace = 0
        if probe.has_statistics:
            distinct = {key: (module, make_input, statics) for module, make_input, statics, key in built}
            _replay_in_backward(list(distinct.values()), device)
            recompute_workspace = max(0, probe.workspace() - workspace)
    seconds = checkpoint_segment_seconds(device, probe)
    return Calibration(str(device), tuple(out), workspace, time.perf_counter() - t_start,
                       recompute_workspace_bytes=recompute_workspace, segment_seconds=seconds)


def _sine_chain(x: torch.Tensor, length: int, wrapped: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    y = x
    for _ in range(length):  # sin saves its input: the backward unpacks it, so a wrapper recomputes
        y = checkpoint(torch.sin, y, use_reentrant=False, preserve_rng_state=True) if wrapped else torch.sin(y)
    y.sum().backward()


def checkpoint_segment_seconds(device: torch.device, probe: DeviceProbe | None = None, length: int = 32,
                               repeats: int = 7) -> float:
    """The fixed time of one checkpointed segment on ``device``: a step of ``length`` one-op layers
    each run under ``torch.utils.checkpoint`` (non-reentrant, as the rewriter runs a segment) less the
    same step unwrapped and less one more forward of the op (the recomputation), per layer; the median
    of ``repeats`` paired runs after a warm-up. The op is on a tiny tensor, so the figure is the
    wrapper's time: the checkpoint call, its hooks, the re-run's dispatch."""
    probe = probe or DeviceProbe(device)
    x = torch.randn(8, 64, device=device, requires_grad=True)

    def timed(work) -> float:
        probe.synchronize()
        t0 = time.perf_counter()
        work()
        probe.synchronize()
        return time.perf_counter() - t0

    def forwards():
        with torch.no_grad():
            y = x
            for _ in range(length):
                y = torch.sin(y)

    extra = []
    for r in range(repeats + 1):  # run 0 warms up
        wrapped = timed(lambda: _sine_chain(x, length, True))
        plain = timed(lambda: _sine_chain(x, length, False))
        again = timed(forwards)
        if r:
            extra.append((wrapped - plain - again) / length)
    x.grad = None
    return max(0.0, statistics.median(extra))


class _InBackward(torch.autograd.Function):
    """Runs ``work()`` inside its backward, with gradients on: where a checkpointed segment's
    recomputation runs (on CUDA, autograd's device thread, whose library handles and
    workspaces are its own)."""

    @staticmethod
    def forward(ctx, anchor, work):
        ctx.work = work
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        work, ctx.work = ctx.work, None
        with torch.enable_grad():
            work()
        return None, None


def _in_backward(work, device: torch.device) -> None:
    anchor = torch.zeros((), device=device, requires_grad=True)
    _InBackward.apply(anchor, work).backward()


def _replay_in_backward(runs: list[tuple], device: torch.device) -> None:
    """Each of ``runs`` (a layer, its input maker, its static values) run forward once inside a backward."""

    def forwards():
        for module, make_input, statics in runs:
            y = module(_fresh(make_input()) + list(statics))
            del y

    _in_backward(forwards, device)


def _measure(module: nn.Module, make_input, statics: list, probe: DeviceProbe,
             repeats: int) -> LayerCalibration:
    fwd_t, bwd_t = [], []
    for r in range(repeats + 1):  # run 0 warms up (lazy library state, algorithm choice)
        t_fwd, t_bwd = _run_once(module, make_input, statics, probe)
        if r:
            fwd_t.append(t_fwd)
            bwd_t.append(t_bwd)
    fwd_s = bwd_s = 0
    if probe.has_statistics:  # one more run under the storage tracker: allocator peak minus tensor peak
        fwd_s, bwd_s = _scratch(module, make_input, statics, probe)
    return LayerCalibration(statistics.median(fwd_t), statistics.median(bwd_t), fwd_s, bwd_s)


class _Input(torch.autograd.Function):
    """A layer input that takes a gradient and is no leaf: autograd's leaf node would hold it
    through the backward, where in the model it dies at its last use inside the layer (fp32
    logits, which the loss does not save). Its gradient ends here; the anchor gets zero."""

    @staticmethod
    def forward(ctx, anchor, value):
        return value.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(()), None


def _fresh(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One run's inputs: one that takes a gradient is an alias of it made by :class:`_Input` (a
    copy would hold its bytes twice); one that does not is copied (the layer may write into it in
    place)."""
    out = []
    for x in xs:
        if x.requires_grad:
            anchor = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
            out.append(_Input.apply(anchor, x.detach()))  # (no edge to x: nothing holds it)
        else:
            out.append(x.detach().clone())
    return out


def _run_once(module: nn.Module, make_input, statics: list, probe: DeviceProbe) -> tuple[float, float]:
    """Forward and backward seconds of one untracked run (the tracker's dispatch would inflate them)."""
    args = _fresh(make_input()) + list(statics)  # (boxed: the layer empties the list, see _boxed)
    probe.synchronize()
    t0 = time.perf_counter()
    y = module(args)
    probe.synchronize()
    t_fwd = time.perf_counter() - t0
    ys = [t for t in tensor_leaves(y) if t.requires_grad]
    grads = [torch.ones_like(t) for t in ys]
    probe.synchronize()
    t0 = time.perf_counter()
    if ys:
        torch.autograd.backward(ys, grads)
    probe.synchronize()
    t_bwd = time.perf_counter() - t0
    for p in module.parameters():
        p.grad = None
    return t_fwd, t_bwd


def _scratch(module: nn.Module, make_input, statics: list, probe: DeviceProbe) -> tuple[int, int]:
    """Scratch of the forward and of the backward: the allocator's peak above the phase's start
    minus the tensor storages' peak above it."""
    args = _fresh(make_input()) + list(statics)
    tracker = StorageTracker()
    tracker.register(module, args)
    start = tracker.current_bytes
    probe.begin()
    with tracker:
        y = module(args)
    alloc = probe.phase()
    fwd = 0 if alloc is None else max(0, alloc - (tracker.peak_bytes - start))
    ys = [t for t in tensor_leaves(y) if t.requires_grad]
    grads = [torch.ones_like(t) for t in ys]
    tracker.register(grads)  # a backward may return views of them (a reshape's does)
    tracker.reset_peak()
    before = tracker.current_bytes
    probe.begin()
    with tracker:
        if ys:
            torch.autograd.backward(ys, grads)
    alloc = probe.phase()
    bwd = 0 if alloc is None else max(0, alloc - (tracker.peak_bytes - before))
    tracker.detach()
    del y, ys, grads
    for p in module.parameters():
        p.grad = None
    return fwd, bwd


class _BoxedCodeGen(fx.graph.CodeGen):
    """Code that takes a layer's inputs in one list and empties it, as a layer inside the
    model gets them: each input dies at its last use (a calibration run that held its input
    would peak above the step where the input is large, fp32 logits before the loss)."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, *args, **kwargs) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        head = f"def {getattr(self, '_func_name', 'forward')}(self, args_list){maybe_return_annotation}:"
        return head + "".join(f"\n    {v} = args_list[{i}]" for i, v in enumerate(names)) + "\n    args_list.clear()"


class _BoxedLoss(nn.Module):
    """:class:`~ckptopt.tracer.cuts.WithLoss` taking its inputs in one list it empties."""

    def __init__(self, inner: WithLoss):
        super().__init__()
        self.inner = inner

    def forward(self, args_list: list):
        w = self.inner
        if w.body is None:
            x = args_list[0]
            args_list.clear()
            return w.loss_fn(w.rebuild(x) if w.rebuild is not None else x)
        out = w.body(args_list)
        return w.loss_fn(w.rebuild(out) if w.rebuild is not None else out)


def _boxed(module: nn.Module) -> nn.Module:
    """``module`` (a layer's GraphModule, or one ending with the loss) called with one list of its
    inputs, which it empties."""
    if isinstance(module, WithLoss):
        if module.body is not None:
            module.body = _boxed(module.body)
        return _BoxedLoss(module)
    module.graph.set_codegen(_BoxedCodeGen())  # (built for the calibration alone: changed in place)
    module.recompile()
    return module


def _layer_modules(traced: TracedModel, inputs: Inputs, device: torch.device) -> list[tuple]:
    """``(module, make_input, statics, signature)`` per layer: the layer on the real
    parameters, a function that makes its input (the real one for the first layer, else
    synthetic at the traced shape), the real static values it reads."""
    gm = traced.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    consts = {nodes[k]: v for k, v in traced.constants.items() if k in nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat = traced.capture.bind(inputs) if traced.capture is not None else list(inputs.args)
    real: dict[str, Any] = {n.name: v for n, v in zip(placeholders, flat)}
    real.update(_hoisted_values(gm, traced, nodes, placeholders, flat, consts))
    model_output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    rebuild = traced.capture.rebuild if traced.capture is not None else None
    out = []
    n = traced.n
    for j, layer in enumerate(traced.layers):
        if layer.nodes == ("<loss>",):
            module: nn.Module = WithLoss(None, traced.loss_fn)
            members: list[fx.Node] = []
        else:
            members = [nodes[nm] for nm in layer.nodes]
            ins = ([nodes[layer.input_node]] if layer.input_node else []) + [nodes[s] for s in layer.side_inputs] + [
                nodes[s] for s in layer.static_inputs]
            last = j == n - 1
            main_out = layer.output_node if layer.output_node in nodes else None
            if last:
                output = model_output
            elif layer.side_outputs:  # as the tracer built it: (chain output, *side outputs)
                output = tuple(([nodes[main_out]] if main_out else []) + [nodes[s] for s in layer.side_outputs])
            else:
                output = nodes[main_out] if main_out else nodes[traced.layers[j + 1].input_node]
            body = subgraph_module(gm, members, ins, output, consts)
            module = WithLoss(body, traced.loss_fn, rebuild) if last else body
        names = ([layer.input_node] if layer.input_node else []) + list(layer.side_inputs)
        metas, makers = [], []
        for name in names:  # the model's own values where it has them, else synthetic at the traced shape
            given = real.get(name)
            if given is not None:
                metas.append((tuple(given.shape), given.dtype, bool(given.requires_grad)))
                makers.append(functools.partial(lambda v: v, given))
            else:
                metas.append(traced.tensor_meta[name])
                makers.append(functools.partial(_synthetic, metas[-1], device))
        meta = tuple(metas)
        make_input = functools.partial(lambda fs: [f() for f in fs], makers)
        statics = [real[s] for s in layer.static_inputs]
        key = (_signature(gm, members) or ("<loss>",),
               tuple((tuple(p.shape), p.dtype) for p in module.parameters()), meta,
               tuple((tuple(s.shape), s.dtype) for s in statics if isinstance(s, torch.Tensor)))
        out.append((_boxed(module), make_input, statics, key))
    return out


def _synthetic(meta: tuple, device: torch.device) -> torch.Tensor:
    """A tensor of the traced shape, dtype and requires_grad (random floats, zeros otherwise)."""
    shape, dtype, grad = meta
    t = (torch.randn(shape, dtype=dtype, device=device) if dtype.is_floating_point
         else torch.zeros(shape, dtype=dtype, device=device))
    return t.requires_grad_(grad)


def _signature(gm: fx.GraphModule, members: list[fx.Node]) -> tuple:
    """What a layer runs, without the names that differ between repeated blocks: each op's
    target (a submodule by its type and settings) and which earlier ops of the layer it reads."""
    pos = {m: i for i, m in enumerate(members)}
    out = []
    for m in members:
        if m.op == "call_module":
            sub = gm.get_submodule(m.target)
            what = f"{type(sub).__name__}({sub.extra_repr()})"
        else:
            what = str(m.target)
        out.append((m.op, what, tuple(pos.get(a, -1) for a in m.all_input_nodes)))
    return tuple(out)


def _hoisted_values(gm: fx.GraphModule, traced: TracedModel, nodes: dict, placeholders: list, flat: list,
                    consts: dict) -> dict[str, Any]:
    """The real values of the hoisted static nodes (run once on the real inputs)."""
    if not traced.hoisted:
        return {}
    members = [nodes[nm] for nm in traced.hoisted]
    prefix = subgraph_module(gm, members, placeholders, tuple(members), consts)
    with torch.no_grad():
        values = prefix(*flat)
    return {m.name: v for m, v in zip(members, values)}
