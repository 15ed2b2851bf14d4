"""What one layer's measured forward and backward recorded: plain data, no torch.

:func:`ckptopt.tracer.layer_run.record_layer` runs a layer once forward and backward under the exact
storage tracker and fills a :class:`LayerRecord`: the live bytes after every operator (the
*timeline*), the moments autograd saved and released each tensor, and when each watched storage
died. :mod:`ckptopt.tracer.layer_figures` derives every cost of the chain model from it with pure
functions, so each rule can be checked on a timeline written by hand (``tests/test_layer_figures.py``).

Storage keys are opaque hashable values (an address, or a fake storage's identity); a key that
died and was reused is told apart by a generation count, ``(key, 2)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Entry", "Release", "Copy", "FirstRead", "InjectedGradients", "LayerKeys", "LayerRecord"]


class Entry(NamedTuple):
    """One operator of the timeline."""

    op: int  #: the operator's running number
    name: str  #: what it ran
    live: int  #: live bytes after it


class Release(NamedTuple):
    """Autograd let go of one saved reference."""

    index: int  #: timeline length at that moment
    key: Any  #: the saved tensor's storage key (None: a storage the layer does not own)
    holds_input: bool  #: it was over the chain input's storage


class Copy(NamedTuple):
    """A saved side input handed to the backward as a copy (a recomputation hands out its own)."""

    made: int  #: timeline index where making the copy began
    counted: int  #: timeline index from which the copy is live
    died: int | None  #: timeline index of its death (None: alive at the end)
    nbytes: int


class FirstRead(NamedTuple):
    """The backward's first read of a saved tensor: where a recomputation it triggers starts."""

    live: int  #: live bytes then, the chain input counted as held
    out_grad_gone: bool  #: the injected output gradient was already freed (used up by ops that save nothing)
    index: int  #: timeline length then


@dataclass(frozen=True)
class InjectedGradients:
    """The gradients the measurement handed the layer's backward, in bytes."""

    outputs: int = 0  #: every injected output gradient's storage (the chain output's and the side outputs')
    pending: int = 0  #: gradients later layers already made (tied weights, pending side-input gradients)
    chain: int = 0  #: the chain output's own gradient (a view output's is the view's size)
    chain_storage: int = 0  #: the storage holding the layer's output gradient (a lone side output's, if so)
    lone_side: int | None = None  #: a lone side output's gradient, where the layer has no chain output
    chain_grad_bytes: int = 0  #: the injected chain output gradient's storage (0: none injected)


@dataclass(frozen=True)
class LayerKeys:
    """The storage keys of what the layer reads and makes (None: no storage)."""

    chain_in: Any = None
    chain_out: Any = None
    side_in: tuple = ()
    side_out: tuple = ()
    static_in: tuple = ()


@dataclass
class LayerRecord:
    """One forward and backward of a layer, as the storage tracker and autograd's hooks saw it.

    The chain input is held by nothing but the caller through the forward; in the backward it is
    held to the end of the record's timelines where the figures want it held (the derivations add
    its bytes back from its death, :func:`ckptopt.tracer.layer_figures.held_timelines`).
    """

    timeline: list[Entry]  #: live bytes after every operator, forward then backward
    start: int  #: live bytes before the forward: parameters, buffers, inputs
    input_bytes: int  #: the chain input's storage bytes (0 without a chain input)
    forward: tuple[int, int]  #: timeline indices [first, end) of the forward
    input_death_in_forward: int  #: where the chain input died in the forward (the forward's end if it did not)
    last_pack: int | None  #: timeline length at the forward's last pack (None: it packed nothing)
    packs: int  #: tensors the forward packed
    kept: tuple  #: storage keys of the packs autograd still keeps when the forward ends (None: not the layer's)
    keys: LayerKeys
    output_bytes: int  #: bytes of the chain output's storage
    backward_index: int  #: timeline length when the backward starts
    backward_start: int  #: live bytes then, the chain input counted as held
    input_dead: bool  #: nothing saved the chain input: it died before the backward
    alive_keys: dict  #: storage key -> saved references autograd holds when the backward starts
    releases: list[Release]  #: every saved reference released in the backward, in order
    rec_gone: list[tuple[int, Any]]  #: (index, key): the moments a recomputed copy would die (read, then freed)
    deaths: dict  #: storage key -> (timeline index, bytes) of each watched storage's death
    copies: list[Copy]
    first_read: FirstRead | None
    out_grad_freed: int | None  #: timeline index where the injected output gradient died
    grads: InjectedGradients = field(default_factory=InjectedGradients)

    @property
    def end(self) -> int:
        """The timeline's length at the backward's end."""
        return len(self.timeline)

    @property
    def saved(self) -> dict:
        """Storage key -> bytes of the layer's saved tensors autograd keeps at the forward's end."""
        return dict(self._saved)

    def __post_init__(self) -> None:
        self._saved: dict = {}
        for key, nbytes in self.kept:
            if key is not None:
                self._saved[key] = nbytes

    @property
    def alive(self) -> int:
        """Saved references autograd holds when the backward starts."""
        return sum(self.alive_keys.values())

    @property
    def dead_packs(self) -> bool:
        """The forward packed tensors autograd no longer keeps at its end (a dead branch's)."""
        return len(self.kept) < self.packs
