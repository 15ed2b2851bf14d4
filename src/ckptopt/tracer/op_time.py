"""What an operator without a FLOP formula costs, in the compute unit of the tracer.

Matrix products, convolutions and attention are priced by their FLOPs
(``torch.utils.flop_counter``). Every other operator (elementwise ops, norms, softmax, random
draws, reductions) is priced by its time per element measured on the device type, converted to
FLOP-equivalents at the rate the same run measured for the products: on one CPU thread a dropout
mask (``bernoulli_``) costs hundreds of FLOP-equivalents per element and a softmax tens: counted as
one each, a plan that re-runs BERT's attention dropout would look nearly free, where it costs a
fifth of a layer's forward (``benchmarks/RESULTS.md``, "What an operator costs besides its FLOPs").

The table is ``ckptopt/data/op_time_<device type>.json``, written by ``python -m
benchmarks.op_time --write-table``: per operator (``aten`` overload packet name) nanoseconds per
element, the product rate of the same run, and where it was measured. A device type without a table
(CUDA until one is measured there, ``meta``) counts one per element, as before.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any, NamedTuple

from ..torch_utils import tensor_leaves

__all__ = ["OpWeights", "weights_for", "elements", "GATHERS", "PRICED"]

#: Whether operators without a FLOP formula are priced by the table; off only to compare with counting one
#: per element, the count before the table (``python -m benchmarks.frontier --one-per-element``).
PRICED = True

#: Operators that read only the rows they index: their time follows their output, not their (table) input.
GATHERS = frozenset({"aten.embedding", "aten.index", "aten.index_select", "aten.gather", "aten.take",
                     "aten.embedding_bag", "aten._embedding_bag", "aten.index_put", "aten.index_put_",
                     "aten.scatter", "aten.scatter_", "aten.scatter_add", "aten.scatter_add_"})


class OpWeights(NamedTuple):
    """FLOP-equivalents per element on one device type."""

    per_op: dict  #: operator name -> FLOP-equivalents per element (whole numbers)
    default: int  #: for an operator the table does not list: the median of those it does

    def weight(self, name: str) -> int:
        return self.per_op.get(name, self.default)


def elements(name: str, args: Any, out: Any) -> int:
    """The elements an operator's time follows: the larger of its output and its largest tensor input
    (a reduction reads more than it writes), the output alone for an operator in :data:`GATHERS`; none
    for one that returns no tensor (``prim.device``, a size: metadata, no work on elements)."""
    outs = tensor_leaves(out)
    if not outs:
        return 0
    written = sum(t.numel() for t in outs)
    if name in GATHERS:
        return written
    read = max((t.numel() for t in tensor_leaves(args)), default=0)
    return max(written, read)


@functools.lru_cache(maxsize=None)
def weights_for(device_type: str) -> OpWeights | None:
    """The weights measured on ``device_type`` (None: no table; each element then counts one)."""
    try:
        text = resources.files("ckptopt").joinpath("data", f"op_time_{device_type}.json").read_text()
    except (FileNotFoundError, OSError):
        return None
    return weights_from_table(json.loads(text))


def weights_from_table(table: dict) -> OpWeights:
    """:class:`OpWeights` from a table as ``benchmarks/op_time.py`` writes it (``ns_per_element`` per
    operator, ``product_flops_per_second``): FLOP-equivalents = seconds per element x product rate."""
    rate = float(table["product_flops_per_second"])
    if rate <= 0:
        raise ValueError(f"op-time table: product_flops_per_second must be positive, got {rate}")
    # whole numbers: a layer's compute stays an integer count, exactly affine in the batch where its
    # elements are (planning/batch.py interpolates it so); below half a FLOP-equivalent an element is free
    per_op = {name: round(ns * 1e-9 * rate) for name, ns in table["ns_per_element"].items()}
    ordered = sorted(per_op.values())
    default = ordered[len(ordered) // 2] if ordered else 1
    return OpWeights(per_op=per_op, default=default)


