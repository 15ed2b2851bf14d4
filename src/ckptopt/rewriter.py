"""The rewriter: a plan becomes a module that checkpoints the chosen segments.

:func:`apply_plan` returns a :class:`CheckpointedModule` that *shares* the
original model's submodules, parameters and buffers (its ``state_dict`` keys
and values are the original's, ``.to()``/``.train()`` act on the same
modules) and runs the traced graph segment by segment: every segment but the
last through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
the last one plainly. In eval mode or without grad no segment is
checkpointed, so nothing is recomputed.

Design note (DESIGN.md section 6):

* A segment is a generated ``fx.GraphModule`` forward called with the
  wrapper as ``self``, so it reads submodules through the shared tree and
  follows ``.to()`` and parameter replacement.
* Between segments only the single tensor of the cut travels (the tracer's
  candidate cuts guarantee it) plus non-tensor values (sizes, ints), which
  are returned by the segment that computes them and passed to the ones that
  use them, so other batch sizes work.
* BatchNorm would update its running statistics twice (once more during the
  recomputation). A forward pre-hook detects recomputation
  (``torch._C._current_graph_task_id() != -1``: the forward runs inside a
  backward), sets ``momentum`` to 0 and remembers ``num_batches_tracked``;
  a forward hook restores both, and so does a callback queued on the
  autograd engine, because the recomputation can stop inside BatchNorm
  (when its statistics are the segment's last saved tensors) before any
  forward hook runs. Dropout gets the same mask through
  checkpoint's ``preserve_rng_state``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .simulate import simulate
from .solvers import Plan
from .tracer import TracedModel, _subgraph_module
from .units import format_bytes

__all__ = ["apply_plan", "CheckpointedModule"]


@dataclass
class _Segment:
    index: int
    first: int  # first and last layer index (of the traced chain)
    last: int
    wrapped: bool
    is_final: bool
    code: type  # a generated GraphModule class; code.forward(wrapper, *inputs)
    extra_names: tuple[str, ...]  # non-tensor values from earlier segments / inputs
    export_names: tuple[str, ...] = field(default=())  # non-tensor values it hands on


def _graph_nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _bn_restore(module: nn.Module) -> None:
    stack = module.__dict__.get("_ckptopt_saved")
    if stack:
        momentum, nbt = stack.pop()
        module.momentum = momentum
        if nbt is not None:
            with torch.no_grad():
                module.num_batches_tracked.copy_(nbt)


def _bn_pre_hook(module: nn.Module, args):
    if module.training and torch._C._current_graph_task_id() != -1:
        # recomputation inside backward: do not update the running statistics again
        stack = module.__dict__.setdefault("_ckptopt_saved", [])
        nbt = module.num_batches_tracked
        # a tensor copy, not .item(): works on fake tensors too (num_batches_tracked is not
        # saved by BatchNorm's backward, so restoring it in place is safe)
        stack.append((module.momentum, None if nbt is None else nbt.detach().clone()))
        module.momentum = 0.0
        # The recomputation may stop inside this module's forward (non-reentrant checkpoint
        # stops once the segment's last saved tensor is rebuilt, e.g. BatchNorm's statistics
        # at the end of a segment), so the forward hook may never run: restore at the end of
        # the backward pass as well.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _bn_restore(module))


def _bn_post_hook(module: nn.Module, args, output):
    if module.training and torch._C._current_graph_task_id() != -1:
        _bn_restore(module)


class CheckpointedModule(nn.Module):
    """A model that trains with activation checkpointing at the planned cuts.

    Attributes
    ----------
    plan : Plan
        The checkpoint plan (segment-start layers of the traced chain).
    predicted_peak_bytes : int
        The plan's simulated peak for one training step at the traced shapes.
    baseline_peak_bytes : int
        The simulated peak with no checkpointing.
    traced : TracedModel
        The tracer's output the plan was made from.
    original : nn.Module
        The model it wraps (modules, parameters and buffers are shared).
    """

    def __init__(self, model: nn.Module, traced: TracedModel, plan: Plan):
        super().__init__()
        # share the original's module tree: same state_dict keys, same tensors, same order
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.training = model.training
        object.__setattr__(self, "original", model)
        object.__setattr__(self, "traced", traced)
        object.__setattr__(self, "plan", plan)
        self.predicted_peak_bytes = plan.peak_bytes
        self.baseline_peak_bytes = simulate(traced.costs, ()).peak_bytes
        self._warned_shapes = False
        gm = traced.gm
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._ph_names = tuple(n.name for n in self._placeholders)
        self._copy_root_attrs(model, gm)
        self._segments = self._build_segments(traced, plan)
        self._hooks = self._install_bn_hooks(gm)

    # -- construction ---------------------------------------------------------
    def _copy_root_attrs(self, model: nn.Module, gm: fx.GraphModule) -> None:
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                head = n.target.split(".")[0]
                if head not in self._modules and head not in self._parameters and head not in self._buffers:
                    object.__setattr__(self, head, getattr(model, head))

    def _build_segments(self, tm: TracedModel, plan: Plan) -> list[_Segment]:
        gm = tm.gm
        nodes = _graph_nodes(gm)
        layers = tm.layers
        has_loss_layer = layers[-1].nodes == ("<loss>",)
        n_model = len(layers) - 1 if has_loss_layer else len(layers)
        bounds = []
        for first, last in plan.segments:
            last = min(last, n_model - 1)
            if first <= last:
                bounds.append((first, last))
        # the segment holding the loss (the plan's last) is never wrapped
        last_plan_seg_includes_model = plan.segments[-1][0] <= n_model - 1
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        is_tensor = {name: tm.graph.nodes[name]["shape"] is not None for name in tm.graph.nodes}
        seg_of: dict[str, int] = {}
        members_of = []
        for k, (first, last) in enumerate(bounds):
            names = [nm for j in range(first, last + 1) for nm in layers[j].nodes]
            for nm in names:
                seg_of[nm] = k
            members_of.append([nodes[nm] for nm in names])
        exports: list[list[str]] = [[] for _ in bounds]
        extras: list[list[str]] = [[] for _ in bounds]
        for k, members in enumerate(members_of):
            own = {m.name for m in members}
            first_layer = bounds[k][0]
            entry = None if k == 0 else layers[first_layer].input_node
            for m in members:
                for a in m.all_input_nodes:
                    if a.name in own or a.op == "get_attr" or a.name == entry:
                        continue
                    if a.op == "placeholder":
                        if k > 0 and a.name not in extras[k]:
                            extras[k].append(a.name)
                        continue
                    if is_tensor.get(a.name, False):
                        raise AssertionError(f"tensor {a.name} crosses a cut; the tracer should not offer it")
                    if a.name not in extras[k]:
                        extras[k].append(a.name)
                    src = seg_of[a.name]
                    if a.name not in exports[src]:
                        exports[src].append(a.name)
        # a non-tensor produced in segment j and used in k > j+1 is handed on by the ones between
        for k in range(len(bounds)):
            for name in extras[k]:
                if name in self._ph_names:
                    continue
                for j in range(seg_of[name] + 1, k):
                    if name not in extras[j]:
                        extras[j].append(name)
                    if name not in exports[j]:
                        exports[j].append(name)
        segments = []
        for k, (first, last) in enumerate(bounds):
            final = k == len(bounds) - 1
            if k == 0:
                inputs = list(self._placeholders)
            else:
                inputs = [nodes[layers[first].input_node]]
            inputs += [nodes[nm] for nm in extras[k]]
            if final:
                output = out_node.args[0]
            else:
                nxt = nodes[layers[last + 1].input_node]
                output = tuple([nxt] + [nodes[nm] for nm in exports[k]])
            sub = _subgraph_module(gm, members_of[k], inputs, output)
            wrapped = not final or not last_plan_seg_includes_model
            segments.append(_Segment(k, first, last, wrapped, final, type(sub), tuple(extras[k]),
                                     tuple(exports[k])))
        return segments

    def _install_bn_hooks(self, gm: fx.GraphModule) -> list:
        handles = []
        wrapped_layers = {j for s in self._segments if s.wrapped for j in range(s.first, s.last + 1)}
        nodes = _graph_nodes(gm)
        seen = set()
        for j in wrapped_layers:
            for nm in self.traced.layers[j].nodes:
                n = nodes.get(nm)
                if n is None or n.op != "call_module":
                    continue
                for mod in self.get_submodule(n.target).modules():  # this module's tree
                    if isinstance(mod, nn.modules.batchnorm._BatchNorm) and id(mod) not in seen:
                        seen.add(id(mod))
                        handles.append(mod.register_forward_pre_hook(_bn_pre_hook))
                        handles.append(mod.register_forward_hook(_bn_post_hook))
        return handles

    def train(self, mode: bool = True) -> "CheckpointedModule":
        """Set training mode here and on the original model (they share every submodule)."""
        self.original.train(mode)
        self.training = mode
        return self

    # -- running ----------------------------------------------------------------
    def _bind(self, args: tuple, kwargs: dict) -> list:
        if len(args) > len(self._placeholders):
            raise TypeError(f"forward() takes {len(self._placeholders)} inputs, got {len(args)}")
        vals = list(args)
        for n in self._placeholders[len(args):]:
            name = n.target.lstrip("*")
            if name in kwargs:
                vals.append(kwargs.pop(name))
            elif n.args:
                vals.append(n.args[0])
            else:
                raise TypeError(f"forward() missing argument {name!r}")
        if kwargs:
            raise TypeError(f"forward() got unexpected keyword arguments {sorted(kwargs)}")
        return vals

    def _check_shapes(self, vals: list) -> None:
        if self._warned_shapes:
            return
        shapes = tuple(tuple(v.shape) for v in vals if isinstance(v, torch.Tensor))
        want = self.traced.example_shapes
        if shapes != want and not (len(shapes) == len(want) and all(
                len(a) == len(b) and a[1:] == b[1:] for a, b in zip(shapes, want))):
            warnings.warn(
                f"ckptopt: the plan was made for inputs of shapes {want}, this call has {shapes}; "
                "it still runs correctly, but its memory was planned for other shapes: call "
                "optimize_checkpoints again with inputs of the new shape",
                stacklevel=3,
            )
            self._warned_shapes = True

    def forward(self, *args, **kwargs):
        vals = self._bind(args, dict(kwargs))
        self._check_shapes(vals)
        do_ckpt = self.training and torch.is_grad_enabled()
        env = dict(zip(self._ph_names, vals))
        x = None
        for seg in self._segments:
            inputs = vals if seg.index == 0 else [x]
            inputs = [*inputs, *(env[nm] for nm in seg.extra_names)]
            fn = _bound(seg.code, self)
            if seg.wrapped and do_ckpt:
                res = checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=True)
            else:
                res = fn(*inputs)
            if seg.is_final:
                return res
            x = res[0]
            env.update(zip(seg.export_names, res[1:]))
        raise AssertionError("unreachable: a plan has at least one segment")

    # -- reporting ------------------------------------------------------------------
    def explain(self) -> str:
        """A readable account of the plan: segments, what each keeps, the predicted peak."""
        tm, plan = self.traced, self.plan
        costs = tm.costs
        base, pred = self.baseline_peak_bytes, self.predicted_peak_bytes
        sim = simulate(costs, plan.checkpoints)
        lines = [
            f"ckptopt plan for {type(self.original).__name__}: {tm.n} layers, solver {plan.solver!r} "
            f"({plan.solve_seconds * 1e3:.1f} ms)",
            f"predicted peak {format_bytes(pred)} against {format_bytes(base)} without checkpointing "
            f"({100.0 * (pred - base) / base:+.1f}%); static (parameters, buffers, inputs) "
            f"{format_bytes(costs.static)}",
        ]
        if not plan.checkpoints:
            lines.append("checkpointing cannot lower the peak of this model at these shapes: "
                         "it runs unchanged (one unwrapped segment)")
        for k, (first, last) in enumerate(plan.segments):
            names = f"{tm.layers[first].name}" + (f" .. {tm.layers[last].name}" if last > first else "")
            if k < len(plan.segments) - 1:
                held = "the model input (static)" if first == 0 else format_bytes(int(costs.a[first - 1]))
                what = (f"checkpointed: keeps only its input {tm.layers[first].input_node} "
                        f"({held}) and recomputes the rest in backward")
            else:
                what = "not wrapped: keeps what its layers save, no recomputation"
            lines.append(f"  segment {k}: layers {first}-{last} ({names}): {what}")
        lines.append(f"peak reached in the {sim.phase} of layer {sim.layer} ({tm.layers[sim.layer].name})")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return (f"plan={self.plan.checkpoints}, solver={self.plan.solver!r}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes}")

    def remove_hooks(self) -> None:
        """Remove the BatchNorm hooks installed on the shared modules."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _bound(cls: type, self: nn.Module) -> Callable:
    return lambda *a: cls.forward(self, *a)


def apply_plan(model: nn.Module, traced: TracedModel, plan: Plan) -> CheckpointedModule:
    """Rewrite ``model`` so that it checkpoints the segments of ``plan``.

    Parameters
    ----------
    model : nn.Module
        The model that was traced (its modules are shared, not copied).
    traced : TracedModel
        :func:`ckptopt.trace` of ``model``.
    plan : Plan
        A plan for ``traced.costs`` (from :func:`ckptopt.solve`).

    Returns
    -------
    CheckpointedModule

    Raises
    ------
    ValueError
        When the plan was made for a cost model of another length.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_plan needs a Plan (from ckptopt.solve), got {type(plan).__name__}")
    if plan.n != traced.n:
        raise ValueError(
            f"the plan was made for {plan.n} layers but the traced model has {traced.n}; "
            "solve traced.costs again"
        )
    return CheckpointedModule(model, traced, plan)
