"""What every capture front end returns: a plain graph and how to call it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from ...torch_utils import Inputs

__all__ = ["Captured", "module_path", "resolves", "attr"]


@dataclass
class Captured:
    """A model's forward as a ``torch.fx`` graph, whatever produced it.

    Attributes
    ----------
    gm : torch.fx.GraphModule
        A plain graph: its placeholders take the call's values in order (positional,
        no pytree processing); its output is what the model returns (``fx``) or the
        model's outputs flattened (``export``). Parameters and buffers are read
        with ``get_attr`` under the model's own names.
    front_end : str
        ``"fx"`` or ``"export"``.
    opaque : dict
        Submodules kept as one opaque node, with the reason: those FX cannot trace (``fx``), and
        those whose forward reads a tensor's value, run as one op (``export``, :mod:`.opaque`).
    bind : callable
        ``bind(Inputs) -> list`` of the placeholders' values for a call, or None
        when the call does not match the captured signature (other keywords, a
        non-tensor argument with another value, another dtype).
    rebuild : callable
        ``rebuild(graph output) -> what the model returns`` (a ``ModelOutput``,
        a dict, a tuple...).
    dynamic : bool
        The graph runs at shapes other than the example's.
    training : bool
        The mode the graph was captured in (``export`` bakes dropout's mode in).
    notes : list of str
        What the front end had to do (shown by ``explain()``).
    """

    gm: fx.GraphModule
    front_end: str
    opaque: dict[str, str]
    bind: Callable[[Inputs], list | None]
    rebuild: Callable[[Any], Any]
    dynamic: bool = True
    training: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]


def module_path(node: fx.Node) -> str:
    """The dotted path of the module a node runs in (``model.layers.3.mlp``), from the graph's
    metadata (``nn_module_stack``, or the target of a ``call_module`` node); "" at the root."""
    if node.op == "call_module":  # (an exported block's call says which block it runs)
        return str(node.meta.get("ckptopt_block") or node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path.startswith("_empty_nn_module_stack") else str(path)


def resolves(root: Any, target: str) -> bool:
    """Whether the dotted ``target`` names an attribute path under ``root``."""
    try:
        attr(root, target)
    except AttributeError:
        return False
    return True


def attr(root: Any, target: str) -> Any:
    """The attribute at the dotted ``target`` under ``root``."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
