"""Leaf modules in an exported graph: each call of a named block becomes one node again.

``torch.export`` inlines every submodule: its graph reads a block's parameters with
``get_attr`` and never calls the block, so nothing registered on the block runs (FSDP2's
``fully_shard`` gathers a block's parameters in the block's forward pre-hook) and a plan may
cut anywhere inside it. ``leaf_modules=[...]`` on the export front end puts each call of a
named block back together: the block's operations (a contiguous run of the graph, by the
nodes' ``nn_module_stack``) move into a graph of their own, and one ``call_module`` node of a
:class:`BlockCall` runs them *through the block's own* ``__call__``: the block's hooks fire,
and the operations read the parameters the block holds at that moment (FSDP2's gathered ones).
The tracer sees one opaque layer per call, as it does for a torch.fx leaf.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Iterable

import torch.fx as fx
import torch.nn as nn

from ...errors import TraceError
from .base import attr as _attr, module_path, resolves as _resolves

__all__ = ["BlockCall", "group_leaf_calls", "leaf_paths", "rebind"]


class BlockCall(nn.Module):
    """One call of ``block`` running the operations the exported graph ran inside it.

    ``code`` is the class of a ``GraphModule`` whose ``get_attr`` targets are paths inside the
    block; it runs with the block as ``self``, inside the block's ``__call__`` (its forward is
    swapped for the call's duration), so the block's forward hooks see the call. Only the class is
    kept, never a graph module instance: an instance would hold the parameters it was built with
    (after ``fully_shard``, the unsharded originals). The block is a registered child, so the call's
    ``parameters()`` are the block's (what the tracer counts for the layer).
    """

    def __init__(self, block: nn.Module, path: str, code: type, graph: fx.Graph):
        super().__init__()
        self.block = block
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "graph", graph)  # (for the tracer's questions: does it draw random numbers)
        self.path = path

    def bound_to(self, block: nn.Module) -> "BlockCall":
        """The same operations run through another module object (the user's block, where the graph
        holds a copy of the module tree with the same parameters)."""
        return BlockCall(block, self.path, self.code, self.graph)

    def forward(self, *args: Any) -> Any:
        block, code = self.block, self.code
        own = block.__dict__.get("forward")  # (an instance-level forward someone installed)

        def run(*a: Any) -> Any:
            return code.forward(block, *a)

        object.__setattr__(block, "forward", run)
        try:
            return block(*args)
        finally:
            if own is None:
                object.__delattr__(block, "forward")
            else:
                object.__setattr__(block, "forward", own)

    def extra_repr(self) -> str:
        return f"{self.path} ({type(self.block).__name__}, {sum(1 for _ in self.graph.nodes)} graph nodes)"


def leaf_paths(model: nn.Module, leaf_modules: Iterable[str | type] | None) -> list[str]:
    """The module paths ``leaf_modules`` names (paths, or classes: every module of that class), the
    outermost only.

    Raises
    ------
    TraceError
        For a name that is not a submodule of ``model`` (``node=None``: the arguments' mistake).
    """
    names = {x for x in (leaf_modules or ()) if isinstance(x, str)}
    types = tuple(x for x in (leaf_modules or ()) if isinstance(x, type))
    known = dict(model.named_modules())
    unknown = sorted(n for n in names if n not in known)
    if unknown:
        raise TraceError(
            f"leaf_modules names {unknown} that are not submodules of the model; "
            f"valid names look like {list(known)[1:4]} (see model.named_modules())"
        )
    out: list[str] = []
    for path, mod in known.items():
        if path and (path in names or (types and isinstance(mod, types))):
            if not any(path.startswith(p + ".") for p in out):
                out.append(path)
    return out


def _owner(node: fx.Node, paths: list[str]) -> tuple[str, str] | None:
    """``(leaf path, the call's key)`` of the leaf call ``node`` runs in, or None: any module of the stack,
    not only the innermost (a block may call a module that lives outside it). The key tells calls of one
    module apart (``nn_module_stack`` numbers a module's later calls: ``L__self___blk@1``)."""
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        if str(value[0]) in paths:
            return str(value[0]), str(key)
    where = module_path(node)
    path = next((p for p in paths if where == p or where.startswith(p + ".")), None)
    return None if path is None else (path, "")


def group_leaf_calls(gm: fx.GraphModule, model: nn.Module, leaf_modules: Iterable[str | type] | None) -> int:
    """Replace each call of a leaf module in ``gm`` (an exported graph, whose nodes carry
    ``nn_module_stack``) by one ``call_module`` node of a :class:`BlockCall`; the number of calls.

    A call is a maximal run of consecutive operations inside one call of a leaf (a module called
    several times in a row, as a shared layer is, makes several calls). Its inputs are the values it
    reads from outside the run (attributes outside the block included), its outputs the values read
    after it; the attributes inside the block are read in the block's own graph.
    """
    paths = leaf_paths(model, leaf_modules)
    if not paths:
        return 0
    runs: list[tuple[tuple[str, str], list[fx.Node]]] = []
    open_run = False
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        owner = _owner(n, paths)
        if owner is None:
            open_run = False
        elif open_run and runs[-1][0] == owner:
            runs[-1][1].append(n)
        else:
            runs.append((owner, [n]))
            open_run = True
    taken: set[str] = set()
    for k, ((path, _), members) in enumerate(runs):
        name = f"ckptopt_call_{k}"
        while hasattr(model, name) or hasattr(gm, name):
            name += "_"
        _group(gm, model, path, members, name)
        taken.add(path)
    missing = [p for p in paths if p not in taken]
    if missing and len(missing) == len(paths):
        raise TraceError(f"leaf_modules {missing} run no operation in the exported graph: the forward does not "
                         "call them; name the submodules it calls (model.named_modules()), e.g. the decoder layers")
    gm.graph.lint()
    gm.recompile()
    return len(runs)


def _group(gm: fx.GraphModule, model: nn.Module, path: str, members: list[fx.Node], name: str) -> None:
    own = set(members)
    prefix = path + "."
    inputs: list[fx.Node] = []
    for m in members:
        for a in m.all_input_nodes:
            if a in own or a in inputs or (a.op == "get_attr" and a.target.startswith(prefix)):
                continue
            inputs.append(a)
    outputs = [m for m in members if any(u not in own for u in m.users)]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: g.placeholder(a.name) for a in inputs}

    def load(a: fx.Node) -> fx.Node:
        if a not in env:  # an attribute inside the block: read relative to it
            env[a] = g.get_attr(a.target[len(prefix):])
        return env[a]

    for m in members:
        env[m] = g.node_copy(m, load)
    g.output(tuple(env[o] for o in outputs))
    block = _attr(gm, path) if _resolves(gm, path) else model.get_submodule(path)
    # (built on a copy: a graph refers to the module that owns it, which holds the parameters it was made with)
    code = type(fx.GraphModule(block, copy.deepcopy(g), f"{type(model.get_submodule(path)).__name__}Ops"))
    gm.add_submodule(name, BlockCall(block, path, code, g))
    with gm.graph.inserting_after(members[-1]):  # (after every input; before every reader of an output)
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["ckptopt_block"] = path
    stack = members[0].meta.get("nn_module_stack") or {}
    call.meta["nn_module_stack"] = {k: v for k, v in stack.items()  # (the block and the modules around it)
                                    if path == str(v[0]) or path.startswith(str(v[0]) + ".")}
    vals = [o.meta.get("val") for o in outputs]
    call.meta["val"] = tuple(vals)
    with gm.graph.inserting_after(call):
        for k in reversed(range(len(outputs))):
            item = gm.graph.call_function(operator.getitem, (call, k))
            item.meta["val"] = vals[k]
            item.meta["nn_module_stack"] = call.meta["nn_module_stack"]
            outputs[k].replace_all_uses_with(item, delete_user_cb=lambda u: u not in own)
    for m in reversed(members):
        gm.graph.erase_node(m)


def rebind(gm: fx.GraphModule, model: nn.Module) -> None:
    """Point the traced graph module at the model's parameters as they are now (``fully_shard`` replaced
    them with shards): the graph module read the originals (an exported graph, through its own copy of
    the module tree), and holding them would keep every unsharded parameter alive on every rank."""
    for path, mod in list(gm.named_modules()):
        if isinstance(mod, BlockCall):
            mod.block = model.get_submodule(mod.path)
    for path, mod in list(gm.named_modules()):
        if isinstance(mod, BlockCall) or not path:
            continue
        try:
            own = model.get_submodule(path)
        except AttributeError:
            continue
        if own is mod:
            continue
        for name in list(mod._parameters):
            mod._parameters[name] = getattr(own, name, None)
        for name in list(mod._buffers):
            mod._buffers[name] = getattr(own, name, None)
    for name in list(gm._parameters):  # (a root parameter the graph reads)
        gm._parameters[name] = getattr(model, name, None)
