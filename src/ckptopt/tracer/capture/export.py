"""The ``torch.export`` front end (non-strict): for models whose root forward FX cannot trace.

HuggingFace transformers are the case in point: keyword batches, ``ModelOutput``
results and a forward full of Python that ``torch.fx`` symbolic tracing refuses.
``torch.export.export(model, args, kwargs=..., strict=False)`` runs the forward on
fake tensors and records every ATen op; ``ep.module()`` keeps the original
``nn.Parameter`` objects under their own names and trains bit-identically to the
model (dropout included). What this module adds:

* **dynamic shapes**: batch and sequence dimensions (the first two of every tensor
  input) are exported as ``Dim.AUTO``, so the graph runs on other batch sizes and
  sequence lengths; when that fails the export is redone at the example's shapes.
  A caller that plans one shape only (``estimate``) asks for the example's shapes
  (``dynamic_shapes=False``): the symbolic shapes cost most of an export's time (a
  two-layer BERT 1.1-1.6 s against 0.2 s; Llama-3-8B from its config 5.2 s against 2.7 s);
* **a plain graph**: the pytree calling convention of ``ep.module()`` is replaced
  by plain placeholders (the flattened inputs, in order) and a flat output, and the
  specs are kept to bind a call (:attr:`Captured.bind`) and rebuild the model's
  output object (:attr:`Captured.rebuild`);
* ``config.use_cache`` is turned off while exporting (a cache is no training output;
  transformers does the same under gradient checkpointing);
* **constants at the root**: ``torch.export`` lifts tensor constants made in a
  forward (``torch.tensor(...)`` in an attention module) and ``ep.module()`` puts them
  under the submodule's path (``transformer.h.0.self_attention.lifted_tensor_0``), where
  the original model has nothing; the rewriter reads the graph's attributes through the
  model's own module tree, so each such constant moves to a root attribute of the graph
  module under a name the model does not have;
* **BatchNorm updates its statistics once**: a training batch norm updates its running
  statistics in place and its ``num_batches_tracked`` is incremented by an ``add_`` node;
  both become calls of :func:`batch_norm_stats_once` and :func:`count_batch_once`, which
  run the op unchanged in the forward and, while checkpoint recomputes a segment inside
  backward (``torch._C._current_graph_task_id() != -1``), run it with momentum 0 (the
  same output and saved tensors; the statistics keep their values) and skip the
  increment, as the rewriter's BatchNorm hooks do on the FX path.

Known limits: the mode (``train``/``eval``) is baked in at export time, so the
rewritten module runs the original forward in the other mode; an op that would update
running statistics without a momentum argument is refused. A training BatchNorm with
``momentum=None`` (a cumulative average, ``1/num_batches_tracked``) does not export at
all (``float()`` of a buffer is data-dependent).
"""

from __future__ import annotations

import inspect
import operator
import weakref
from contextlib import contextmanager
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ...errors import TraceError
from ...fake import device_meta_kernels, idle_module_to
from ...torch_utils import Inputs, exception_chain, inspected_by_type, is_fake
from .base import Captured, attr as _attr, resolves as _resolves
from .blocks import group_leaf_calls, leaf_paths
from .functions import first_argument, functions_note, opaque_functions
from .opaque import (NotOpaque, culprit, eligible, example_calls, forced, opaque_modules, opaque_note, parent_of,
                     profile)
from .packing import PACKING_NOTE, check_packing, eager_packing

__all__ = ["export_capture"]


def _export_with_input_values(target: Any, model: nn.Module, inputs: Inputs, exc: BaseException,
                              notes: list[str]) -> tuple[Any, str]:
    """``torch.export`` through branches on values the example inputs alone determine (DeBERTa's
    ``if label_index.size(0) > 0``, ProphetNet's assert on the shifted labels): ``(program, "")``, or
    ``(None, why)`` (``why`` empty, or what to do about a branch on a random draw).

    Export runs once more with real-tensor propagation (its ``draft_export`` mode): each such branch
    is taken as the example takes it and kept in the graph as a runtime assertion, so a batch that
    would take the other branch stops with "Runtime assertion failed" instead of running the wrong
    graph. Accepted only when every assertion depends on integer inputs (token ids, labels, masks)
    and constants alone: one on a buffer (BatchNorm's batch counter changes every step), on a
    random draw (LayerDrop's ``if rand() < layerdrop``), on an
    activation or on float data would fail at some later step, so the original error stands.
    """
    from torch.export import export

    from ...torch_utils import data_dependent_construct
    from ..statics import is_random

    if data_dependent_construct(exc) is None or any(
            t.is_meta for t in (*model.parameters(), *inputs.tensors())):
        return None, ""
    import torch._functorch.config as functorch_config

    try:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            ep = export(target, tuple(inputs.args), kwargs=dict(inputs.kwargs), strict=False)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        return None, ""
    gm = ep.module(check_guards=False)
    params = {name for name, _ in gm.named_parameters()} | {name for name, _ in gm.named_buffers()}
    asserts = [n for n in gm.graph.nodes if n.op == "call_function" and "_assert_scalar" in str(n.target)]
    for a in asserts:
        stack, seen = [a], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if is_random(gm, n):
                return None, _RANDOM_BRANCH
            if n.op == "get_attr" and n.target in params:
                return None, ""  # an assumption on an activation or on state (a counter)
            value = n.meta.get("val") if n.op == "placeholder" else None
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return None, ""  # on float data (a branch on `x.sum() > 0` flips from batch to batch)
            stack.extend(n.all_input_nodes)
    if asserts:
        notes.append(f"captured with the example batch's values for {len(asserts)} data-dependent branch"
                     f"{'es' if len(asserts) > 1 else ''} on the inputs (torch.export with real tensors); "
                     "a batch that takes another branch stops with 'Runtime assertion failed'")
    return ep, ""


_RANDOM_BRANCH = ("the branch depends on a random draw (LayerDrop's `if torch.rand([]) < layerdrop`: which "
                  "layers run changes every step, and one captured graph cannot); turn the random skip off for "
                  "planning and training (e.g. config.layerdrop=0, encoder_layerdrop=0, decoder_layerdrop=0)")


def export_capture(model: nn.Module, inputs: Inputs, leaf_modules: Iterable[str | type] | None = None,
                   dynamic_shapes: bool = True) -> Captured:
    """Capture ``model`` called as ``model(*inputs.args, **inputs.kwargs)`` with ``torch.export``,
    with dynamic batch and sequence dimensions, or at the example's shapes (``dynamic_shapes=False``).

    Raises
    ------
    TraceError
        When ``torch.export`` fails (the message names the first line of its error), or
        the graph holds a construct checkpointing would change (an op updating running
        statistics that a recomputation could not leave alone).
    """
    notes: list[str] = []
    leaf_paths(model, leaf_modules)  # (a misnamed leaf is the arguments' mistake: before exporting)
    inputs, ones = _without_ones_mask(model, inputs, notes)
    target = _named_call(model, inputs)
    with _no_cache(model, notes), idle_module_to():
        with opaque_functions():
            ep, dynamic, made = _export_past_values(target, model, inputs, notes, dynamic_shapes)
        for call in made:
            call.used = _used_outputs(ep.graph, call)
            profile(call)
    if made:
        notes.append(opaque_note(made))
    gm = _unlifted(ep, take=True)
    in_spec, out_spec = gm._in_spec, gm._out_spec
    gm.graph._codegen = fx.graph.CodeGen()  # plain placeholders and a flat output; the specs are kept
    _constants_to_root(gm, model)
    _batch_norm_once(gm, model)
    _whole_slices_as_aliases(gm)
    calls = group_leaf_calls(gm, model, leaf_modules)
    if calls:
        notes.append(f"leaf_modules: {calls} block call{'s' if calls > 1 else ''} kept whole, each run through "
                     "its module's own call (its hooks fire)")
    gm.recompile()
    example = pytree.tree_flatten((tuple(inputs.args), dict(inputs.kwargs)))[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example):
        raise TraceError(f"torch.export gave {len(placeholders)} graph inputs for {len(example)} call values; "
                         "pass the batch as tensors (and plain Python values)", node=type(model).__name__)

    def bind(call: Inputs) -> list | None:
        if ones:  # captured without the all-ones mask: a call with one of ones runs as the example did
            mask = call.kwargs.get("attention_mask")
            if torch.compiler.is_compiling():
                _assert_ones_when_compiled(mask, type(model).__name__)
            elif mask is not None and not _valueless(mask) and not _all_ones(mask):
                return None  # (a batch that pads: another capture; a fake copy of the example is taken as it)
            call = Inputs(call.args, {k: v for k, v in call.kwargs.items() if k != "attention_mask"})
        if len(call.args) != len(inputs.args) or set(call.kwargs) != set(inputs.kwargs):
            return None
        ordered = (tuple(call.args), {k: call.kwargs[k] for k in inputs.kwargs})
        flat, spec = pytree.tree_flatten(ordered)
        if spec != in_spec or len(flat) != len(example):
            return None
        for got, want in zip(flat, example):
            if isinstance(want, torch.Tensor):
                if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.dim() != want.dim():
                    return None
                if not dynamic and got.shape != want.shape:
                    return None
            elif got is not want and got != want:
                return None  # a non-tensor argument is baked into the graph
        return flat

    note = functions_note(gm)
    if note:
        notes.append(note)
    drawn = " (it draws random numbers: measured with the example's draws)"
    one_op = {c.path: ONE_OP_REASON + (drawn if c.random else "") for c in made}
    return Captured(gm, "export", one_op, bind, lambda out: pytree.tree_unflatten(list(out), out_spec),
                    dynamic=dynamic, training=model.training, notes=notes)


def _valueless(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t))


def _assert_ones_when_compiled(mask: Any, model_name: str) -> None:
    """Under ``torch.compile``: a run-time check, inside the compiled graph, that ``mask`` is all ones.

    Eager calls read the mask's values and take a batch that pads to another plan; a compiled graph
    cannot branch on values without a graph break (and ``fullgraph=True`` refuses one), so the check
    becomes an assertion the compiled step runs: a batch that pads stops with this message instead of
    running the graph planned without a mask."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.is_floating_point() or mask.dim() != 2:
        return
    torch._assert_async((mask == 1).all(),
                        f"ckptopt: this compiled {model_name} was planned for batches without padding (its example's "
                        "attention_mask was all ones) and got one that pads. Plan with a padded example batch "
                        "(optimize_checkpoints), or call it without torch.compile to replan on the first such batch.")


def _all_ones(mask: Any) -> bool:
    """Whether ``mask`` is an integer or boolean 2-D attention mask of ones (read from its values; a
    tensor without values, on the meta device or fake, is not known to be)."""
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point() or mask.dim() != 2 or _valueless(mask):
        return False
    return bool((mask == 1).all())


def _without_ones_mask(model: nn.Module, inputs: Inputs, notes: list[str]) -> tuple[Inputs, bool]:
    """A transformers model's example batch without its ``attention_mask`` when that is all ones, and
    whether it was dropped.

    transformers reads the mask's values in eager mode: a mask of ones means no padding, and the
    attention runs without a mask (SDPA with ``is_causal``; nothing materialized or saved). Exported
    with the mask, the graph must keep it for batches that pad, and builds and saves the mask on every
    batch. No mask means a mask of ones (transformers' convention), so such a batch is captured
    without it, and a call whose mask is all ones runs that graph (a batch that pads is another call
    structure: planned on first sight)."""
    if not inspected_by_type(model) or not _all_ones(inputs.kwargs.get("attention_mask")):
        return inputs, False
    notes.append("the example's attention_mask is all ones (no padding): captured without it, as transformers "
                 "runs such a batch eagerly (no mask built or saved); a batch that pads is planned on first sight")
    return Inputs(inputs.args, {k: v for k, v in inputs.kwargs.items() if k != "attention_mask"}), True


ONE_OP_REASON = "its forward reads a tensor's value: run as one op, measured by running it on the example batch"

#: How many kinds of submodule a capture may run as one op each before it gives up.
OPAQUE_ROUNDS = 12


def _export_past_values(target: nn.Module, model: nn.Module, inputs: Inputs, notes: list[str],
                        dynamic_shapes: bool) -> tuple[Any, bool, list]:
    """:func:`_export`, and where it stops on a submodule whose forward reads a tensor's value, again
    with that submodule run as one op (:mod:`.opaque`): ``(program, dynamic, the opaque calls)``.

    The submodule is the innermost one on the failure's stack (or, from :func:`~.opaque.forced`, the
    one whose captured ops measurement could not follow); every submodule of its class goes with it
    (the decoder layers of a model branch alike), or each one's nearest called parent where they
    cannot be one op (one returns a Python value, takes a symbolic one, or is called through methods
    of its own). Such a capture is at the example's shapes, and needs the real weights (the
    submodules run on the example batch); otherwise the first error stands."""
    from ...torch_utils import data_dependent_construct

    classes: list[type] = []  # every submodule of these classes runs as one op
    refused: set[type] = set()  # classes that cannot (their submodules' parents go instead)

    def called(m: nn.Module | None) -> nn.Module | None:
        while m is not None and type(m) in refused:
            m = parent_of(m, model)
        return m

    def add(m: nn.Module | None) -> None:
        if m is not None and type(m) not in classes:
            classes.append(type(m))

    first: TraceError | None = None
    for m in forced():  # (the graph captured without them reads values measurement cannot follow)
        add(m)
    if not classes:
        try:
            ep, dynamic = _export(target, model, inputs, notes, dynamic_shapes)
            return ep, dynamic, []
        except TraceError as error:
            first = error
        if data_dependent_construct(first) is None or any(  # (no values to run the submodules on)
                t.is_meta or is_fake(t) for t in (*model.parameters(), *inputs.tensors())):
            raise first
        add(culprit(first, model))
    last = first
    for _ in range(OPAQUE_ROUNDS):
        if not classes:
            break
        chosen = [m for m in model.modules() if type(m) in classes]
        try:
            for cls in classes:
                one = next(m for m in chosen if type(m) is cls)
                why = eligible(one)
                if why is not None:
                    raise NotOpaque(why, one)
            examples = example_calls(target, tuple(inputs.args), dict(inputs.kwargs), chosen)
            for cls in classes:  # (a class whose forward never ran: JetMoe's experts are called through methods)
                if not any(examples[m] for m in chosen if type(m) is cls):
                    raise NotOpaque(f"{cls.__name__} is not called through its forward",
                                    next(m for m in chosen if type(m) is cls))
            tried: list[str] = []
            with opaque_modules(model, examples) as made:
                ep, dynamic = _export(target, model, inputs, tried, dynamic_shapes=False)
            notes.extend(tried)
            return ep, dynamic, made
        except (NotOpaque, TraceError) as error:
            refusal = _cause_of(error, NotOpaque)
            if refusal is not None:  # its submodules cannot be one op: each one's parent instead
                cls = type(refusal.module)
                refused.add(cls)
                if cls in classes:
                    classes.remove(cls)
                for m in model.modules():
                    if type(m) is cls:
                        add(called(parent_of(m, model)))
                continue
            if data_dependent_construct(error) is None:
                raise (first or error) from None
            last = error
            add(called(culprit(error, model)))
    if last is None:
        raise TraceError("the submodules that read a tensor's value cannot run as one op", node=type(model).__name__)
    raise last


def _used_outputs(graph: fx.Graph, call: Any) -> set[int] | None:
    """The positions of the outputs of ``call``'s op the graph reads (None: the op is not in it)."""
    for n in graph.nodes:
        if n.op == "call_function" and first_argument(n.target) is call:
            return {u.args[1] for u in n.users if u.target is operator.getitem and u.users}
    return None


#: each exported program's module, made once (:func:`_unlifted`)
_UNLIFTED: "weakref.WeakKeyDictionary[Any, fx.GraphModule]" = weakref.WeakKeyDictionary()


def _unlifted(ep: Any, take: bool = False) -> fx.GraphModule:
    """``ep.module(check_guards=False)``, made once per program: unlifting generates and compiles the
    whole graph's code several times (about 0.4 s on an 8B Llama), and both the packing check, which
    only reads it, and the capture, which changes it, need it. ``take``: the last use (the module leaves
    the memo, so no one reads it changed)."""
    gm = _UNLIFTED.pop(ep, None) if take else _UNLIFTED.get(ep)
    if gm is None:
        gm = ep.module(check_guards=False)
        if not take:
            _UNLIFTED[ep] = gm
    return gm


def _cause_of(exc: BaseException, kind: type) -> BaseException | None:
    return next((e for e in exception_chain(exc) if isinstance(e, kind)), None)


def _export(target: nn.Module, model: nn.Module, inputs: Inputs, notes: list[str],
            dynamic_shapes: bool = True) -> tuple[Any, bool]:
    """The exported program and whether its shapes are dynamic (never when ``dynamic_shapes`` is False).

    The model is first exported as it runs eagerly (:func:`_eager_flags`). When that stops on a
    data-dependent construct the model skips under ``torch.export`` (its own
    ``if not is_torchdynamo_compiling()`` checks), or succeeds with a graph that reads a tensor's
    value (``.item()``, which the compiled path may not read), it is exported as torch.export presents
    itself; the eager graph is kept if that fails."""
    devices = {t.device.type for t in (*model.parameters(), *inputs.tensors()) if not t.is_meta}
    device = devices.pop() if len(devices) == 1 else "meta"  # (meta: no override)
    held = None
    try:
        held, packing = _export_eager(target, inputs, device, dynamic_shapes)
        if not _reads_values(held[0]):
            if packing:
                notes.append(PACKING_NOTE)
            return _shapes_note(held, notes)
    except Exception:  # noqa: BLE001 - exported again as torch.export presents itself
        pass
    try:
        return _shapes_note(_export_once(target, inputs, device, eager=False, dynamic_shapes=dynamic_shapes), notes)
    except _StaticFailed as failed:
        exc = failed.__cause__
        with device_meta_kernels(device):
            ep, why = _export_with_input_values(target, model, inputs, exc, notes)
        if ep is not None:
            return _shapes_note((ep, False, failed.dynamic_error), notes)
        if held is not None:
            return _shapes_note(held, notes)
        error = TraceError(f"torch.export cannot capture {type(model).__name__}: {_first_line(exc)}"
                           f"{'; ' + why if why else ''}", node=type(model).__name__)
        error.fix = why  # what to do, for the message when both front ends fail
        raise error from exc


def _export_eager(target: nn.Module, inputs: Inputs, device: str,
                  dynamic_shapes: bool = True) -> tuple[tuple[Any, bool, str | None], bool]:
    """:func:`_export_once` on the eager path, with transformers' packed-sequence check taken as in eager
    mode where sizes alone decide it (:mod:`.packing`): ``(exported, whether it was)``;
    exported again without it when an assertion reads values, fails at the example's sizes, or the
    export fails."""
    with eager_packing() as made:
        try:
            exported = _export_once(target, inputs, device, eager=True, dynamic_shapes=dynamic_shapes)
        except Exception:
            if not made:
                raise
            exported = None
    if exported is not None and (not made or not check_packing(_unlifted(exported[0]), made, inputs)):
        return exported, bool(made)
    return _export_once(target, inputs, device, eager=True, dynamic_shapes=dynamic_shapes), False


class _StaticFailed(Exception):
    """The export at the example's shapes failed too (``__cause__``); ``dynamic_error`` is the first
    line of the dynamic-shapes failure."""

    def __init__(self, dynamic_error: str | None):
        super().__init__(dynamic_error)
        self.dynamic_error = dynamic_error


def _export_once(target: nn.Module, inputs: Inputs, device: str, eager: bool,
                 dynamic_shapes: bool = True) -> tuple[Any, bool, str | None]:
    """``(program, dynamic, why dynamic shapes failed)`` at one setting of the flags: with dynamic batch
    and sequence dimensions, else at the example's shapes (raises :class:`_StaticFailed`). On the eager
    path a data-dependent failure is raised as it is (the example's shapes would not help). Without
    ``dynamic_shapes``, at the example's shapes only (``why`` None)."""
    from torch.export import export

    from ...torch_utils import data_dependent_construct

    args, kwargs = tuple(inputs.args), dict(inputs.kwargs)
    with _eager_flags(eager), device_meta_kernels(device), _no_stack_traces():
        first = None  # (None: no dynamic try to report)
        if dynamic_shapes:
            try:
                return export(target, args, kwargs=kwargs, strict=False,
                              dynamic_shapes=_dynamic_shapes(target, inputs)), True, None
            except Exception as exc:  # noqa: BLE001 - retried at the example's shapes
                if eager and data_dependent_construct(exc) is not None:
                    raise
                first = _first_line(exc)
        try:
            return export(target, args, kwargs=kwargs, strict=False), False, first
        except Exception as exc2:
            if not dynamic_shapes and eager and data_dependent_construct(exc2) is not None:
                raise  # (as the dynamic try would have)
            raise _StaticFailed(first) from exc2


def _shapes_note(exported: tuple[Any, bool, str | None], notes: list[str]) -> tuple[Any, bool]:
    ep, dynamic, first = exported
    if not dynamic and first is not None:  # (None: the example's shapes were asked for)
        notes.append(f"exported at the example's shapes only (dynamic shapes failed: {first}); "
                     "other shapes run the original forward")
    return ep, dynamic


def _reads_values(ep: Any) -> bool:
    """Whether the exported graph reads a value back from a tensor (a size or number known only at run
    time: an unbacked symbol)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in ep.graph.nodes:
        try:
            if free_unbacked_symbols(n.meta.get("val")):
                return True
        except Exception:  # noqa: BLE001 - a value of a kind it does not walk
            continue
    return False


#: whether exports record each node's source line (:func:`recorded_lines`)
_RECORD_LINES = [False]


@contextmanager
def recorded_lines():
    """While active, exports record each node's ``stack_trace``: for naming the model's line in an error
    about a node, when a failing trace is run again (``ckptopt.tracer.chain.trace``)."""
    _RECORD_LINES.append(True)
    try:
        yield
    finally:
        _RECORD_LINES.pop()


@contextmanager
def _no_stack_traces():
    """While active, graphs made by tracing record no ``stack_trace`` per node (``torch.fx.config``), unless
    :func:`recorded_lines` asks for them: extracting and symbolizing a traceback for every node is about a
    quarter of the export's time (0.9 of 3.2 s on the Llama-3-8B estimate), and only an error message
    reads it."""
    was = getattr(fx.config, "do_not_emit_stack_traces", False)
    fx.config.do_not_emit_stack_traces = not _RECORD_LINES[-1]
    try:
        yield
    finally:
        fx.config.do_not_emit_stack_traces = was


@contextmanager
def _eager_flags(eager: bool):
    """While active (``eager``), ``torch.compiler.is_compiling()`` and ``is_exporting()`` answer False to
    callers outside torch, as in eager mode: a model that picks a deployment-friendly path under export
    (the gated-delta models solve their triangular systems by a Python loop of row updates when
    ``is_exporting()``) is captured on the path it trains on. torch itself still sees the export."""
    import sys

    if not eager:
        yield
        return
    compiler = torch.compiler
    saved = compiler.is_compiling, compiler.is_exporting

    def wrap(real):
        def flag() -> bool:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            return real() if caller.split(".")[0] == "torch" else False

        return flag

    compiler.is_compiling, compiler.is_exporting = wrap(saved[0]), wrap(saved[1])
    try:
        yield
    finally:
        compiler.is_compiling, compiler.is_exporting = saved


class _NamedCall(nn.Module):
    """``model`` seen through a forward with one named parameter per call value: a model whose own
    forward takes only ``*args, **kwargs`` (PEFT's ``PeftModel``) gives ``torch.export`` no names to
    attach dynamic shapes to. Shares the model's module tree, so the graph's parameter paths are the
    model's own."""

    def __init__(self, model: nn.Module, inputs: Inputs):
        super().__init__()
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self.training = model.training
        cls = type(model).__dict__.get("_ckptopt_base", type(model))  # (a model with a plan attached in place)

        def forward(*args, **kwargs):
            return cls.forward(model, *args, **kwargs)

        P = inspect.Parameter
        forward.__signature__ = inspect.Signature(
            [P(f"arg{i}", P.POSITIONAL_ONLY) for i in range(len(inputs.args))]
            + [P(k, P.KEYWORD_ONLY) for k in inputs.kwargs])
        object.__setattr__(self, "forward", forward)


def _named_call(model: nn.Module, inputs: Inputs) -> nn.Module:
    """``model``, or a :class:`_NamedCall` of it when its forward does not name every keyword of the call."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return model
    named = {k for k, p in params.items() if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                            inspect.Parameter.VAR_KEYWORD)}
    if inputs.kwargs and not set(inputs.kwargs) <= named:  # (some go to **kwargs: HF's num_items_in_batch)
        return _NamedCall(model, inputs)
    return model


def _dynamic_shapes(model: nn.Module, inputs: Inputs) -> dict[str, Any]:
    """``Dim.AUTO`` for the first two dimensions (batch, sequence) of every tensor argument."""
    from torch.export import Dim

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: Dim.AUTO for d in range(min(value.dim(), 2))}
        return None

    bound = inspect.signature(model.forward).bind(*inputs.args, **inputs.kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = inspect.signature(model.forward).parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: pytree.tree_map(spec, v) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(pytree.tree_map(spec, v) for v in value)
        else:
            out[name] = pytree.tree_map(spec, value)
    return out


@contextmanager
def _no_cache(model: nn.Module, notes: list[str]):
    """``config.use_cache = False`` while exporting, on every config the model's modules hold (T5's
    decoder stack has a copy of its own): a key/value cache is no training output."""
    configs = {}
    for mod in model.modules():
        config = getattr(mod, "config", None)
        if getattr(config, "use_cache", False) is True:
            configs[id(config)] = config
    if not configs:
        yield
        return
    for config in configs.values():
        config.use_cache = False
    notes.append("captured with config.use_cache=False (no key/value cache while training, as transformers "
                 "does under gradient checkpointing)")
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


#: ``aten.slice`` "to the end": Python's ``x[a:]`` passes the largest int64 as the end
_SLICE_END = (1 << 63) - 1
#: ``aten.slice.Tensor(self, dim=0, start=None, end=None, step=1)``: the defaults of the arguments a call omits
_SLICE_DEFAULTS = (None, 0, None, None, 1)


def _whole_slices_as_aliases(gm: fx.GraphModule) -> None:
    """Each slice of a whole dimension (start 0, to the end, step 1) replaced by an alias of its input.

    Eager indexing returns the tensor itself for such a slice (``x[:, 0:]``, transformers'
    ``hidden_states[:, slice(-logits_to_keep, None), :]`` with ``logits_to_keep=0``), and an export at
    fixed shapes records an alias; with dynamic shapes it records ``aten.slice``, whose backward
    allocates a zero tensor of the input's size and copies the gradient into it. As an alias the graph
    computes the same values and its backward passes the gradient on, as the model's does, so a
    dynamic and a fixed-shape capture allocate alike."""
    import torch

    aten = torch.ops.aten
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.slice.Tensor or n.kwargs:
            continue
        x, _dim, start, end, step = [*n.args, *_SLICE_DEFAULTS[len(n.args):]]
        if start in (0, None) and (end is None or (isinstance(end, int) and end >= _SLICE_END)) and step == 1:
            with gm.graph.inserting_before(n):
                alias = gm.graph.call_function(aten.alias.default, (x,))
            alias.meta = dict(n.meta)
            n.replace_all_uses_with(alias)
            gm.graph.erase_node(n)


def _constants_to_root(gm: fx.GraphModule, model: nn.Module) -> None:
    """Move every ``get_attr`` target under a submodule path that the model does not have (a
    constant ``torch.export`` lifted) to a root attribute of ``gm`` whose name the model does
    not have either, and retarget its nodes: the rewriter resolves a graph attribute through the
    model's module tree, and takes from the graph module only root names the model lacks."""
    moved: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or "." not in n.target or _resolves(model, n.target):
            continue
        if n.target not in moved:
            value = _attr(gm, n.target)
            base = name = n.target.replace(".", "_")
            k = 0
            while hasattr(model, name) or hasattr(gm, name):
                k += 1
                name = f"{base}_{k}"
            if isinstance(value, nn.Module):
                gm.add_submodule(name, value)
            else:
                setattr(gm, name, value)
            moved[n.target] = name
        n.target = moved[n.target]


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: checkpoint recomputing a segment."""
    return torch._C._current_graph_task_id() != -1


def batch_norm_stats_once(op: Any, momentum_at: int, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)``, a training batch norm that updates its running statistics (in
    place, or returning the new ones to be copied in); while recomputed inside backward, with
    momentum 0: the same kernel, output and saved tensors, and statistics that keep their values
    (``0 * batch + 1 * running``), as the rewriter's BatchNorm hooks do on the FX path."""
    if _recomputing():
        args = args[:momentum_at] + (0.0,) + args[momentum_at + 1:]
    return op(*args, **kwargs)


def count_batch_once(op: Any, counter: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``op(counter, *args, **kwargs)`` (``num_batches_tracked.add_(1)``), skipped while recomputed."""
    if _recomputing():
        return counter
    return op(counter, *args, **kwargs)


_MOMENTUM = ("momentum", "exponential_average_factor")


def _batch_norm_once(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make a recomputed segment leave BatchNorm's running statistics and batch count alone.

    Training batch norms with running statistics become :func:`batch_norm_stats_once`, in-place
    writes to a ``num_batches_tracked`` buffer :func:`count_batch_once`.

    Raises
    ------
    TraceError
        For a batch norm op that would update running statistics without a momentum argument.
    """
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        op = n.target
        names = [a.name for a in op._schema.arguments]
        if "batch_norm" in op.name():
            bound = dict(zip(names, n.args))
            bound.update(n.kwargs)
            if bound.get("running_mean") is None or bound.get("training", True) is False:
                continue  # no statistics, or not updating them (eval)
            at = next((names.index(m) for m in _MOMENTUM if m in names), None)
            if at is None or len(n.args) <= at:
                raise TraceError(
                    f"{type(model).__name__} runs a BatchNorm in training mode ({op}) that updates its running "
                    "statistics in a form ckptopt cannot keep from being updated again by a recomputation; "
                    "pass capture='fx' (with leaf_modules=[...] for the submodules FX cannot trace).",
                    node=n.name)
            n.target = batch_norm_stats_once
            n.args = (op, at) + tuple(n.args)
        elif (n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"
              and n.args[0].target.split(".")[-1] == "num_batches_tracked"
              and op._schema.arguments[0].alias_info is not None and op._schema.arguments[0].alias_info.is_write):
            n.target = count_batch_once
            n.args = (op,) + tuple(n.args)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
