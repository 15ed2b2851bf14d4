"""The rewriter: a plan becomes a module that checkpoints the chosen segments.

:func:`apply_plan` returns a :class:`CheckpointedModule` that *shares* the
original model's submodules, parameters and buffers (its ``state_dict`` keys
and values are the original's, ``.to()``/``.train()`` act on the same
modules) and runs the traced graph segment by segment: every segment but the
last through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
the last one plainly. In eval mode or without grad no segment is
checkpointed, so nothing is recomputed.

Design note (``docs/design.md`` §6):

* A segment is a generated ``fx.GraphModule`` forward called with the
  wrapper as ``self``, so it reads submodules through the shared tree and
  follows ``.to()`` and parameter replacement.
* Between segments travel the values a segment reads from earlier ones:
  every tensor crossing the cut (the chain tensor and the side tensors; the
  trace's ``max_crossing`` bounds how many of them the layers compute) and
  non-tensor values (sizes, ints), each returned by the segment that computes
  it and passed to the ones that use it, so other batch sizes work.
* BatchNorm would update its running statistics twice (once more during the
  recomputation). A forward pre-hook detects recomputation
  (``torch._C._current_graph_task_id() != -1``: the forward runs inside a
  backward), sets ``momentum`` to 0 and takes back the count ``num_batches_tracked`` gains;
  a forward hook restores both, and so does a callback queued on the
  autograd engine, because the recomputation can stop inside BatchNorm
  (when its statistics are the segment's last saved tensors) before any
  forward hook runs. Dropout gets the same mask through
  checkpoint's ``preserve_rng_state``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .plan import Plan
from .simulator import simulate
from .torch_utils import Inputs, inputs_from_list
from .tracer.capture.base import attr as _attr
from .tracer.capture.blocks import BlockCall
from .tracer.capture.opaque import submodule_of_op
from .tracer.chain import TracedModel
from .tracer.cuts import subgraph_module
from .units import format_bytes

__all__ = ["apply_plan", "CheckpointedModule"]


@dataclass
class _Segment:
    """One run of consecutive graph nodes, called as one function.

    ``input_names`` are the values it reads from earlier segments or the
    model's inputs (tensors and non-tensor values such as sizes, in first-use
    order), ``output_names`` the values it computes that later segments (or
    the model's output) use, ``drop_names`` the values nothing after it
    needs: the forward forgets them once it has run, so that Python holds no
    tensor longer than the unmodified model would.
    """

    index: int
    nodes: tuple[str, ...]  # FX node names, in order
    wrapped: bool
    code: type  # a generated GraphModule class; code.forward(wrapper, *inputs)
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    drop_names: tuple[str, ...] = field(default=())


def _graph_nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _bn_restore(module: nn.Module) -> None:
    stack = module.__dict__.get("_ckptopt_saved")
    if stack:
        momentum, counted = stack.pop()
        module.momentum = momentum
        if counted:  # the recomputed forward counted the batch once more: take it back
            with torch.no_grad():
                module.num_batches_tracked.sub_(1)


def _bn_pre_hook(module: nn.Module, args):
    if module.training and torch._C._current_graph_task_id() != -1:
        # recomputation inside backward: do not update the running statistics again
        stack = module.__dict__.setdefault("_ckptopt_saved", [])
        # BatchNorm's forward adds 1 to num_batches_tracked before it computes (so before any
        # tensor it saves, where a recomputation may stop); restoring subtracts it in place:
        # no copy, which would be memory the cost model does not count (8 B while the layer is
        # recomputed; tests/common/regressions.py case recomputed-batchnorm), and it works on fake tensors too
        # (num_batches_tracked is not saved by BatchNorm's backward)
        counted = module.num_batches_tracked is not None and getattr(module, "track_running_stats", True)
        stack.append((module.momentum, counted))
        module.momentum = 0.0
        # The recomputation may stop inside this module's forward (non-reentrant checkpoint
        # stops once the segment's last saved tensor is rebuilt, e.g. BatchNorm's statistics
        # at the end of a segment), so the forward hook may never run: restore at the end of
        # the backward pass as well.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _bn_restore(module))


def _bn_post_hook(module: nn.Module, args, output):
    if module.training and torch._C._current_graph_task_id() != -1:
        _bn_restore(module)


def _segments_of_groups(gm: fx.GraphModule, groups: list[list[fx.Node]], wrapped: list[bool]) -> list[_Segment]:
    """Segments running ``groups`` (consecutive runs of ``gm``'s op nodes, in order).

    Each segment's inputs are the values its nodes read from outside it (any
    number of tensors and non-tensor values: several tensors may cross a
    cut), its outputs the values it computes that later segments or the
    graph's output read.
    """
    seg_of: dict[str, int] = {}
    for k, members in enumerate(groups):
        for m in members:
            seg_of[m.name] = k
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    final_uses = {a.name for a in out_node.all_input_nodes}
    last_use: dict[str, int] = {}  # value name -> last segment reading it (len(groups): the output)
    inputs_of: list[list[fx.Node]] = []
    for k, members in enumerate(groups):
        own = {m.name for m in members}
        ins: list[fx.Node] = []
        for m in members:
            for a in m.all_input_nodes:
                if a.name in own or a.op == "get_attr":
                    continue
                if a not in ins:
                    ins.append(a)
                last_use[a.name] = k
        inputs_of.append(ins)
    for name in final_uses:
        last_use[name] = len(groups)
    segments = []
    for k, members in enumerate(groups):
        outputs = [m for m in members if last_use.get(m.name, -1) > k]
        sub = subgraph_module(gm, members, inputs_of[k], tuple(outputs))
        if not wrapped[k]:
            _take_inputs_from_list(sub)
        values = [a.name for a in inputs_of[k]] + [m.name for m in outputs]
        drop = tuple(dict.fromkeys(nm for nm in values if last_use.get(nm, -1) <= k))
        segments.append(_Segment(k, tuple(m.name for m in members), wrapped[k], type(sub),
                                 tuple(a.name for a in inputs_of[k]), tuple(m.name for m in outputs), drop))
    return segments


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
        # the model's own forward, for calls the plan does not cover (eval, no_grad, other keywords):
        # the module itself, or, once attached in place (ckptopt.inplace), its class's forward
        object.__setattr__(self, "_original_forward", model)
        object.__setattr__(self, "traced", traced)
        object.__setattr__(self, "plan", plan)
        self.predicted_peak_bytes = plan.peak_bytes
        self.baseline_peak_bytes = simulate(traced.costs, ()).peak_bytes
        self._warned_shapes = False
        self._warned_unplanned = False
        object.__setattr__(self, "_replan", None)  # set by optimize_checkpoints: plans another call structure
        object.__setattr__(self, "_unverified", None)  # set by optimize_checkpoints: why no fake step ran
        object.__setattr__(self, "_variants", {})  # call structure -> CheckpointedModule (or None: failed)
        gm = traced.gm
        self._ph_names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
        self._out_template = _output_template(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        self._copy_root_attrs(model, gm)
        groups = self._chain_groups(traced, plan)
        self._segments = _segments_of_groups(gm, *groups)
        self._hooks = self._install_bn_hooks(gm)

    # -- construction ---------------------------------------------------------
    def _copy_root_attrs(self, model: nn.Module, gm: fx.GraphModule) -> None:
        """Attributes the graph reads that are not the model's submodules, parameters or buffers:
        the model's own, else the graph's (an exported graph's constants and subgraphs)."""
        for n in gm.graph.nodes:
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), BlockCall):
                # an exported block's call: run through the model's own block (its hooks, its parameters)
                call = gm.get_submodule(n.target)
                object.__setattr__(self, n.target, call.bound_to(model.get_submodule(call.path)))
            elif n.op == "get_attr":
                head = n.target.split(".")[0]
                if head not in self._modules and head not in self._parameters and head not in self._buffers:
                    object.__setattr__(self, head, getattr(model, head) if hasattr(model, head) else getattr(gm, head))

    @staticmethod
    def _chain_groups(tm: TracedModel, plan: Plan) -> tuple[list[list[fx.Node]], list[bool]]:
        """Chain plan -> node groups (the layers of each segment) and which are checkpointed."""
        layers = tm.layers
        has_loss_layer = layers[-1].nodes == ("<loss>",)
        n_model = len(layers) - 1 if has_loss_layer else len(layers)
        nodes = _graph_nodes(tm.gm)
        groups, wrapped = [], []
        if tm.hoisted:  # static values read by several layers: computed once, first, never re-run
            groups.append([nodes[nm] for nm in tm.hoisted])
            wrapped.append(False)
        # the segment holding the loss (the plan's last) is never wrapped
        last_plan_seg_includes_model = plan.segments[-1][0] <= n_model - 1
        bounds = [(first, min(last, n_model - 1)) for first, last in plan.segments if first <= n_model - 1]
        stored = set(getattr(plan, "stored", ()))  # segments the plan leaves unwrapped
        for k, (first, last) in enumerate(bounds):
            groups.append([nodes[nm] for j in range(first, last + 1) for nm in layers[j].nodes])
            wrapped.append((k < len(bounds) - 1 or not last_plan_seg_includes_model) and first not in stored)
        return groups, wrapped

    def _install_bn_hooks(self, gm: fx.GraphModule) -> list:
        handles = []
        nodes = _graph_nodes(gm)
        seen = set()
        for seg in self._segments:
            if not seg.wrapped:
                continue
            for nm in seg.nodes:
                n = nodes.get(nm)
                if n is None:
                    continue
                if n.op == "call_module":
                    tree = self.get_submodule(n.target)
                else:  # (a submodule run as one op: capture/opaque.py)
                    tree = submodule_of_op(n.target) if n.op == "call_function" else None
                if tree is None:
                    continue
                for mod in tree.modules():  # this module's tree
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
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None:
                raise
            return getattr(original, name)  # .config, .save_pretrained, .generate ... fall through

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

    def _variant(self, call: Inputs) -> "CheckpointedModule | None":
        """The plan for a call structure the capture does not cover, made on first sight and cached;
        None when planning it failed (the call then runs the original forward, with a warning)."""
        key = call_structure(call, static_shapes=not self.traced.capture.dynamic)
        if key not in self._variants:
            try:
                variant = self._replan(call)
            except Exception as exc:  # noqa: BLE001 - reported, and the call runs the original forward
                warnings.warn(f"ckptopt: planning a training call of {type(self.original).__name__} with another "
                              f"structure ({key[0]}) failed: {type(exc).__name__}: {exc}", stacklevel=3)
                variant = None
            if variant is not None:
                object.__setattr__(variant, "_original_forward", self._original_forward)
                object.__setattr__(variant, "_replan", None)
            self._variants[key] = variant
        return self._variants[key]

    def forward(self, *args, **kwargs):
        captured = self.traced.capture
        training = self.original.training  # (the model's own flag: .train()/.eval() may be called on it)
        active = training and torch.is_grad_enabled()
        exported = captured.front_end != "fx"
        if exported and (not active or training != captured.training):
            # an exported graph has the training mode baked in: eval, no_grad and generate() run
            # the original forward (nothing to recompute there anyway)
            return self._original_forward(*args, **kwargs)
        vals = captured.bind(Inputs(args, kwargs))
        if vals is None and active and self._replan is not None:
            # another call structure (a keyword Trainer adds, a flag, a static capture's other shape):
            # planned on first sight and cached (one capture, trace and solve: seconds)
            variant = self._variant(Inputs(args, kwargs))
            if variant is not None:
                return variant(*args, **kwargs)
        if vals is None:  # not the planned call (other keywords, flags or dtypes): the original forward
            if active and not self._warned_unplanned:
                self._warned_unplanned = True
                why = ("the graph was exported at the example's shapes only (" + "; ".join(captured.notes) + ")"
                       if exported and not captured.dynamic else
                       "its keywords, flags or dtypes differ from the planned call's")
                warnings.warn(f"ckptopt: this training call of {type(self.original).__name__} runs the original forward "
                              f"without checkpointing: {why}. Plan with such a batch (optimize_checkpoints) to "
                              "checkpoint it.", stacklevel=2)
            return self._original_forward(*args, **kwargs)
        if not exported:
            self._check_shapes(vals)
        env = dict(zip(self._ph_names, vals))
        del vals
        for seg in self._segments:
            inputs = [env[nm] for nm in seg.input_names]
            fn = _bound(seg.code, self)
            if seg.wrapped and active:
                res = checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=True)
            elif seg.wrapped:
                res = fn(*inputs)
            else:  # it empties the list: each input is freed after its last use inside the segment
                for nm in seg.drop_names:
                    env.pop(nm, None)
                res = fn(inputs) if seg.input_names else fn()  # (a segment that reads nothing takes no list)
            del inputs
            env.update(zip(seg.output_names, res))
            del res
            for nm in seg.drop_names:  # hold no tensor longer than the unmodified model does
                env.pop(nm, None)
        out = _fill_output(self._out_template, env, self)
        return captured.rebuild(out)

    def predicted_peak_for(self, *args, **kwargs) -> int:
        """The predicted peak of one training step under this plan for a batch of other shapes.

        The plan's cuts do not depend on the shapes (a batch of another size or
        sequence length runs the same segments); this re-measures the layers at the
        given batch's shapes on fake tensors (no memory, no new capture) and
        simulates the plan.
        """
        from .tracer.chain import trace_captured

        call = Inputs(args, kwargs)
        if self.traced.capture.bind(call) is None and self._replan is not None:
            # another call structure (a keyword Trainer adds): priced under the plan that call runs
            variant = self._variant(call)
            if variant is None:
                raise ValueError(f"this call of {type(self.original).__name__} has another structure than the "
                                 "planned one and planning it failed (see the warning): call optimize_checkpoints "
                                 "with such a batch")
            return variant.predicted_peak_for(*args, **kwargs)
        tm = trace_captured(self.original, self.traced.capture, call, self.traced.loss_fn,
                            self.traced.max_crossing)
        if tm.n != self.traced.n:
            raise ValueError(f"at these shapes the model traces into {tm.n} layers, not {self.traced.n}: "
                             "call optimize_checkpoints with this batch")
        return simulate(tm.costs, self.plan.checkpoints, self.plan.stored).peak_bytes

    # -- reporting ------------------------------------------------------------------
    def explain(self) -> str:
        """A readable account of the plan: segments, what each keeps, the predicted peak."""
        tm, plan = self.traced, self.plan
        costs = tm.costs
        base, pred = self.baseline_peak_bytes, self.predicted_peak_bytes
        stored = set(plan.stored)
        sim = simulate(costs, plan.checkpoints, plan.stored)
        lines = [
            f"ckptopt plan for {type(self.original).__name__}: {tm.n} layers, solver {plan.solver!r} "
            f"({plan.solve_seconds * 1e3:.1f} ms)",
            f"predicted peak {format_bytes(pred)} against {format_bytes(base)} without checkpointing "
            f"({100.0 * (pred - base) / base:+.1f}%); static (parameters, buffers, inputs) "
            f"{format_bytes(costs.static)}",
        ]
        captured = tm.capture
        if captured is not None and captured.front_end != "fx":
            shapes = ("any batch size and sequence length run the same segments (predicted_peak_for(batch) "
                      "prices them)" if captured.dynamic else "other shapes run the original forward")
            lines.append(f"captured with torch.export ({'; '.join(captured.notes) or 'as asked'}); {shapes}; "
                         "eval mode and no_grad run the original forward")
        elif captured is not None and captured.notes:
            lines.append(f"captured with torch.fx ({'; '.join(captured.notes)})")
        if self._unverified:
            lines.append(self._unverified)
        if not plan.checkpoints:
            lines.append("checkpointing cannot lower the peak of this model at these shapes: "
                         "it runs unchanged (one unwrapped segment)")
        for k, (first, last) in enumerate(plan.segments):
            names = f"{tm.layers[first].name}" + (f" .. {tm.layers[last].name}" if last > first else "")
            if k < len(plan.segments) - 1 and first in stored:
                what = ("not wrapped (stored): keeps what its layers save while later segments run, "
                        "no recomputation")
            elif k < len(plan.segments) - 1:
                held = "the model input (static)" if first == 0 else format_bytes(int(costs.a[first - 1]))
                made_inside = {o for j in range(first, last + 1) for o in tm.layers[j].side_outputs}
                sides = sorted({s for j in range(first, last + 1) for s in tm.layers[j].side_inputs} - made_inside)
                keeps = ([f"{tm.layers[first].input_node} ({held})"] if first == 0 or costs.a[first - 1] else [])
                keeps += [f"{s} (side)" for s in sides]
                what = (f"checkpointed: keeps only what crosses into it, {', '.join(keeps) or 'nothing'}, "
                        "and recomputes the rest in backward")
            else:
                what = "not wrapped: keeps what its layers save, no recomputation"
            lines.append(f"  segment {k}: layers {first}-{last} ({names}): {what}")
        step = ("measured forward + backward, predicted "
                f"{1e3 * sim.recompute_seconds:.2f} ms" if sim.recompute_seconds is not None else
                "counted forward + backward" if costs.cb is not None else "3x forward")
        added = (f"recomputation {100.0 * sim.recompute_share:.1f}% of a step's compute ({step})"
                 if not sim.segment_overhead else
                 f"recomputation and the segments' fixed cost {100.0 * sim.recompute_share:.1f}% of a step's "
                 f"compute ({step}; the fixed cost "
                 f"{100.0 * sim.segment_overhead / max(1, sim.step_flops or 3 * sim.forward_flops):.1f}%)")
        lines.append(f"peak reached in the {sim.phase} of layer {sim.layer} ({tm.layers[sim.layer].name}); {added}")
        if tm.calibration is not None:
            cal = tm.calibration
            lines.append(f"calibrated on {cal.device}: {cal.measured} of {len(cal.layers)} layers run "
                         f"({cal.seconds:.1f} s), library workspace {format_bytes(cal.workspace_bytes)} in the static bytes"
                         + (f" and {format_bytes(cal.recompute_workspace_bytes)} more that recomputation takes on "
                            "autograd's thread" if cal.recompute_workspace_bytes else ""))
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return (f"plan={self.plan.checkpoints}, solver={self.plan.solver!r}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes}")

    def remove_hooks(self) -> None:
        """Remove the BatchNorm hooks installed on the shared modules."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def call_structure(call: Inputs, static_shapes: bool = False) -> tuple:
    """What a capture fixes about a call: its keywords and argument count, its non-tensor values,
    each tensor's dtype and rank (and shape, for a capture at the example's shapes only)."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, tuple(v.shape) if static_shapes else v.dim())
        return ("value", repr(v)[:64])

    return (tuple(sorted(call.kwargs)), len(call.args), tuple(one(v) for v in call.args),
            tuple((k, one(call.kwargs[k])) for k in sorted(call.kwargs)))


def _take_inputs_from_list(sub: fx.GraphModule) -> None:
    """Make ``sub``'s forward take its inputs as one list, which it empties on entry.

    Called as ``forward(self, *inputs)``, the caller's argument tuple would
    hold every input until the segment returns; an unwrapped segment (which
    does not checkpoint its inputs) must free an input after its last use, as
    the unmodified model does: otherwise the input of a last segment whose ops
    do not save it stays alive through its forward (``tests/common/regressions.py``
    case ``last-segment-input-freed``).
    """
    inputs_from_list(sub.graph)
    sub.recompile()


class _Value(NamedTuple):
    """A graph value in a module's output: ``env[name]``, or the module's attribute ``target``."""

    name: str
    attribute: str | None


def _output_template(arg: Any) -> Any:
    """The graph's output argument with each node replaced by a :class:`_Value` and fx's immutable
    containers by plain ones: the forward fills it without reading the graph (``torch.compile`` does not
    trace into ``torch.fx``, so a forward that reads a node's arguments breaks the compiled graph)."""
    if isinstance(arg, fx.Node):
        return _Value(arg.name, arg.target if arg.op == "get_attr" else None)
    if isinstance(arg, dict):
        return {k: _output_template(v) for k, v in arg.items()}
    if isinstance(arg, tuple) and hasattr(arg, "_fields"):  # a named tuple
        return type(arg)._make(_output_template(v) for v in arg)
    if isinstance(arg, (list, tuple)):
        return (list if isinstance(arg, list) else tuple)(_output_template(v) for v in arg)
    return arg


def _fill_output(template: Any, env: dict, module: nn.Module) -> Any:
    """:func:`_output_template` filled with this call's values."""
    if isinstance(template, _Value):
        return env[template.name] if template.attribute is None else _attr(module, template.attribute)
    if isinstance(template, dict):
        return {k: _fill_output(v, env, module) for k, v in template.items()}
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)._make(_fill_output(v, env, module) for v in template)
    if isinstance(template, (list, tuple)):
        return type(template)(_fill_output(v, env, module) for v in template)
    return template


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
    from .tracer.meta import refuse_meta

    refuse_meta(model, Inputs(()), "apply_plan")
    if plan.n != traced.n:
        raise ValueError(
            f"the plan was made for {plan.n} layers but the traced model has {traced.n}; "
            "solve traced.costs again"
        )
    return CheckpointedModule(model, traced, plan)
