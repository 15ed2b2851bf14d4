"""The per-layer fields of the chain cost model, declared once (docs/design.md §3).

:data:`FULL` and :data:`ADDITIVE` are the tables: each :class:`Field` has its symbol (the paper's
notation: the keyword :class:`~ckptopt.costs.ChainCosts` takes and the key of a cost file), a name a
reader can say aloud (an attribute and keyword too), its unit, what it means and how a missing value
is filled in. Construction, validation, the JSON form and the glossary in ``docs/design.md`` are all
driven by them. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["Field", "FULL", "ADDITIVE", "REQUIRED", "OPTIONAL", "by_key", "glossary"]

#: The field must be given.
REQUIRED = "required"
#: The field may be missing (unknown); nothing fills it in.
OPTIONAL = "optional"


# A default is filled from the fields before it in the table (``v``, filled already), knowing which were
# given (``given``) and the layer count.
def _zeros(v: dict, given: set, n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


def _own_index(v: dict, given: set, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def _to_last_save(v: dict, of: str) -> np.ndarray:
    """A layer is re-run to its end if it saves what it produces (its output or extra tensors), else not at
    all: a recomputation stops at the last saved tensor."""
    return np.where((v["sout"] > 0) | (v["m"] > 0), v[of], 0).astype(np.int64)


def _forward_to_save(v: dict, given: set, n: int) -> np.ndarray:
    return _to_last_save(v, "f")


def _forward_free_to_save(v: dict, given: set, n: int) -> np.ndarray:
    return v["fs"] if "fs" in given else _to_last_save(v, "ff")


@dataclass(frozen=True)
class Field:
    """One per-layer field of the cost model."""

    symbol: str  #: the paper's notation: the keyword and the key in a cost file
    name: str  #: what a reader says: also an attribute and a keyword
    unit: str  #: "bytes", "flag" (0/1) or "layer" (a layer index)
    meaning: str
    #: how a missing value is filled: REQUIRED, OPTIONAL, another field's symbol (its values), or a
    #: function of the fields before it, the ones given and the layer count
    default: str | Callable = REQUIRED
    signed: bool = False  #: may be below 0 (relative to a backward's start, which an input freed can undercut)
    #: a cost file leaves the field out where it equals its default
    omit_default: bool = False
    #: the fields that come with this one: given without them is an error
    needs: tuple[str, ...] = ()

    @property
    def flag(self) -> bool:
        return self.unit == "flag"

    @property
    def default_text(self) -> str:
        if self.default in (REQUIRED, OPTIONAL):
            return self.default
        if isinstance(self.default, str):
            return f"``{self.default}``"
        return {_zeros: "0", _own_index: "``i``", _forward_to_save: "``f`` where it saves its output or extras, else 0",
                _forward_free_to_save: "``fs`` if given, else ``ff`` where it saves its output or extras"}[self.default]


FULL: tuple[Field, ...] = (
    Field("a", "out_bytes", "bytes", "bytes of the output ``x_i`` (its gradient has the same size)"),
    Field("p", "param_bytes", "bytes", "parameter bytes (their gradients have the same size)"),
    Field("sin", "saves_input", "flag", "the layer saves its input ``x_{i-1}``"),
    Field("sout", "saves_output", "flag", "the layer saves its output ``x_i``"),
    Field("m", "saved_extra", "bytes", "bytes of everything else it saves (statistics, masks, interior tensors)"),
    Field("f", "forward", "bytes", "forward transient: the forward's peak above the parameters and the input"),
    Field("b", "backward", "bytes", "backward transient: the backward's peak above the parameters, the saved set "
          "and the output gradient (its new parameter and input gradients included)"),
    Field("fs", "forward_to_save", "bytes", "``f`` up to the last tensor the layer saves: a recomputation that "
          "ends in this layer stops there", _forward_to_save),
    Field("rg", "grad_at_read", "bytes", "gradient bytes the backward holds when it first reads a saved tensor "
          "(its output gradient and what ops that save nothing made before): a recomputation it triggers "
          "starts there", "a"),
    Field("dead", "dead_branch", "flag", "the forward packs tensors autograd does not keep (a dead branch): a "
          "recomputation that reaches the layer re-runs it (up to ``fs``)", _zeros),
    Field("bk", "backward_frame", "bytes", "``b`` when only the checkpoint of a segment it starts holds its input "
          "(freed with the layer's last saved tensor)", "b"),
    Field("bf", "backward_free", "bytes", "``b`` when nothing but the layer holds its input although layer "
          "``i-1`` saves its output (an unwrapped segment's first layer after a checkpointed one)", "b"),
    Field("ff", "forward_free", "bytes", "``f`` with the input dying at its last use inside the layer (nothing "
          "else holds it)", "f", omit_default=True),
    Field("ffs", "forward_free_to_save", "bytes", "``fs`` likewise", _forward_free_to_save, omit_default=True),
    Field("fc", "forward_ckpt", "bytes", "``f`` in a checkpoint's first pass, which keeps none of the tensors the "
          "layer saves (each dies at its last use)", "f", omit_default=True),
    Field("ffc", "forward_ckpt_free", "bytes", "``fc`` with the input dying at its last use", "ff",
          omit_default=True),
    Field("br", "backward_rec", "bytes", "``b`` in a checkpointed segment: a recomputed saved tensor dies when "
          "the backward node that reads it returns", "b", omit_default=True),
    Field("bkr", "backward_rec_frame", "bytes", "``bk`` likewise", "bk", omit_default=True),
    Field("brt", "backward_rec_after_read", "bytes", "``br`` from the first read of a saved tensor on: the part "
          "a segment's last saving layer runs after the recomputation it triggers", "br", omit_default=True),
    Field("bkrt", "backward_rec_frame_after_read", "bytes", "``bkr`` likewise", "bkr", omit_default=True),
    Field("rgp", "grad_before_read", "bytes", "``rg`` at the peak of the part before that read (taken with the "
          "recomputation)", "rg", omit_default=True),
    Field("g", "out_grad_bytes", "bytes", "bytes of the storage that holds the output gradient in the backward: "
          "``a``, a larger storage the next layer hands a slice of, the view's size for a view output, or 0 when "
          "no gradient reaches the output", "a"),
    Field("holds", "holds_frame", "flag", "the layer keeps saved tensors none of ``sin``, ``sout``, ``m`` counts "
          "(a static input, a parameter): a checkpoint around it keeps its frame", _zeros),
    Field("groot", "out_grad_owner", "layer", "the layer whose output gradient's storage holds this one's "
          "(itself, or a later layer that handed it a view)", _own_index, omit_default=True),
    Field("gh", "out_grad_held_gain", "bytes", "what the backward's peak gains when its output gradient "
          "outlives it (a side tensor's gradient views that storage)", _zeros, omit_default=True),
    Field("fpre", "frame_pre", "bytes", "the backward's peak, relative as ``b``, before the layer's last saved "
          "tensor is released (a checkpoint's frame goes then)", OPTIONAL, signed=True, needs=("fpost",)),
    Field("fpost", "frame_post", "bytes", "the same from that moment on", OPTIONAL, signed=True,
          needs=("fpre",)),
    Field("fkpre", "frame_pre_frame_input", "bytes", "``fpre`` where only the frame holds the layer's input (it "
          "goes with the frame, as ``bkr`` has it)", "fpre", signed=True, omit_default=True, needs=("fpre",)),
    Field("fkpost", "frame_post_frame_input", "bytes", "``fpost`` likewise", "fpost", signed=True,
          omit_default=True, needs=("fpre",)),
)

ADDITIVE: tuple[Field, ...] = (
    Field("w", "checkpoint", "bytes", "bytes a segment starting at layer ``i`` holds as its checkpoint "
          "(``w[0]`` unused)"),
    Field("h", "kept", "bytes", "bytes layer ``i`` leaves saved inside its segment"),
    Field("q", "peak_term", "bytes", "layer ``i``'s term of its segment's peak"),
)


def by_key(fields: tuple[Field, ...]) -> dict[str, Field]:
    """Each field under its symbol and under its name."""
    out = {f.symbol: f for f in fields}
    out.update({f.name: f for f in fields})
    return out


def glossary(fields: tuple[Field, ...] = FULL) -> str:
    """The fields as a Markdown table (docs/design.md §3 holds this text; a test keeps it so)."""
    rows = ["| symbol | name | unit | default | meaning |", "|---|---|---|---|---|"]
    for f in fields:
        rows.append(f"| `{f.symbol}` | `{f.name}` | {f.unit} | {f.default_text} | {f.meaning} |")
    return "\n".join(rows)
