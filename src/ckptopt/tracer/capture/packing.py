"""transformers' causal mask, captured as the model builds it eagerly: no mask when sizes alone say so.

In eager mode transformers leaves the causal mask out when the sequences are not packed and
nothing is padded, and SDPA runs with ``is_causal=True``. Whether the sequences are packed
(``masking_utils.find_packed_sequence_indices``) is read from the position ids' values, which a
traced model cannot read (``is_tracing`` is true for fake tensors), so a plain export of a Llama-like
model builds a batch x 1 x seq x seq boolean mask, which SDPA turns into a float mask and saves in
every attention layer: memory the eager step does not use (128 KiB a layer at batch 2, sequence 128;
64 MiB a layer at batch 1, sequence 4,096), and half the blocks of causal attention computed for
nothing (``tests/test_hf.py::test_unpacked_causal_lm_is_captured_without_a_mask_as_eager_mode_runs_it``).

While the model is exported as it runs eagerly, :func:`eager_packing` makes that check in the graph
(an ``aten._assert_async``: checked at run time, as eager mode checks it every call)
and takes the eager answer, "not packed". :func:`check_packing` accepts the graph when each such
assertion depends on sizes alone (position ids made with ``arange``, as every model makes them when
the batch has none: no batch can make it fail) and holds at the example's sizes; otherwise (position
ids or a mask from the batch, a buffer) the capture is redone without it, mask and all, which is
right for every batch.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ...torch_utils import Inputs, is_fake

__all__ = ["eager_packing", "check_packing", "MARK", "PACKING_NOTE"]

PACKING_NOTE = ("captured transformers' unpacked-sequence path (no causal mask, SDPA with is_causal=True, as "
                "in eager mode): the position ids come from the sizes alone, checked at run time")


#: The message of the assertion :func:`eager_packing` puts in the graph (how :func:`check_packing` finds it).
MARK = "ckptopt: the sequences are not packed (transformers' causal-mask skip, taken as in eager mode)"


@contextmanager
def eager_packing() -> Iterator[list]:
    """While active, transformers' ``find_packed_sequence_indices`` on a fake tensor answers "not
    packed" and asserts it in the graph (``aten._assert_async`` with :data:`MARK`). Yields a list with
    one entry per assertion made (empty when none was, or transformers is not loaded)."""
    made: list = []
    mu = sys.modules.get("transformers.masking_utils")
    original = getattr(mu, "find_packed_sequence_indices", None) if mu is not None else None
    if original is None:
        yield made
        return

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        packed = original(position_ids, *args, **kwargs)
        if not isinstance(packed, torch.Tensor) or not is_fake(packed) or packed.dim() != 2:
            return packed  # answered from values (None, or packed), or not the form we know
        # what eager mode reads: every row is one sequence
        torch._assert_async((packed[:, -1] == 0).all(), MARK)
        made.append(True)
        return None

    mu.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield made
    finally:
        mu.find_packed_sequence_indices = original


def _roots(gm: fx.GraphModule) -> list[fx.Node]:
    """The values the assertions of :func:`eager_packing` test."""
    return [n.args[0] for n in gm.graph.nodes
            if n.op == "call_function" and "_assert_async" in str(n.target) and MARK in n.args[1:]]


_SIZE_OPS = ("aten.sym_size", "aten.sym_numel", "aten.sym_stride", "aten.sym_storage_offset")


def check_packing(gm: fx.GraphModule, made: list, inputs: Inputs) -> str:
    """"" when every assertion of :func:`eager_packing` in ``gm`` (an exported program's module, which
    is read, not changed) depends on sizes alone (no value of an input, parameter or buffer, no random
    draw) and holds at the example's sizes; else why not."""
    from ..statics import is_random

    roots = _roots(gm)
    if len(roots) != len(made):
        return "the assertion is not where it was made"
    needed: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op == "placeholder":
            return "it reads an input's values"
        if n.op == "get_attr":
            return "it reads a parameter or buffer"
        if n.op == "call_function" and str(n.target).startswith(_SIZE_OPS):
            continue  # a size of its argument: the value is not read
        if is_random(gm, n):
            return "it depends on a random draw"
        stack.extend(n.all_input_nodes)
    # evaluate at the example's sizes (the sizes are read from the example's tensors)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat = pytree.tree_flatten((tuple(inputs.args), dict(inputs.kwargs)))[0]
    if len(placeholders) != len(flat):
        return "the graph's inputs are not the call's"
    env: dict[fx.Node, Any] = dict(zip(placeholders, flat))
    try:
        with torch.no_grad():
            for n in gm.graph.nodes:
                if n not in needed or n.op == "placeholder":
                    continue
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
                env[n] = n.target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the check stays as the graph would make it
        return f"it cannot be evaluated at the example's sizes ({type(exc).__name__})"
    if not all(bool(env[r]) for r in roots):
        return "the example's position ids are packed"
    return ""
