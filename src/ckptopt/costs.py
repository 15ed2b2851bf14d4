"""The chain cost model: per-layer memory quantities, in integer bytes.

Two forms share one type, :class:`ChainCosts`.

**Full form** (docs/design.md §3, measured against PyTorch). Layers
``0..n-1`` run in order; ``x_i`` is the output of layer ``i`` and the model
input ``x_{-1}`` is part of the static bytes. The per-layer fields are declared
once, in :data:`ckptopt.cost_fields.FULL` (symbol, name, unit, meaning, default;
the glossary of docs/design.md §3): ``a, p, sin, sout, m, f, b`` are required,
the rest refine them where the tracer measured more and default to what they
refine. Each field is a keyword and an attribute under its symbol (the paper's
notation, the key in a cost file) and under its name (``forward_free`` for
``ff``). ``static`` (K) is the bytes held for the whole step: parameters,
buffers and the model input.

**Side tensors** (optional, full form; ``docs/design.md`` §4): tensors that cross a
layer boundary besides the chain tensor ``x_{i-1}`` -- an encoder output every
decoder layer reads, a position bias computed once and passed on, a skip
connection's source, the first tower's output while the second runs. Each
:class:`SideTensor` has its bytes, its producer layer, the later layers that
consume it, and which of them (and the producer) save it. It is one storage held
once, however many cuts it crosses: held by each checkpointed segment that reads
it and saves anything (until the backward of that segment's first saving layer),
by each unwrapped layer that saves it (until its backward), and freed when the
last holder lets go; with no holder, after its last consumer's forward. Its
gradient lives from the backward of its last consumer to that of its producer.
A layer's per-layer figures do not count its side inputs and outputs (the
simulator does), except that their gradients are in ``b`` where the layer
creates them.

Both forms take an optional ``c[i]``: the forward compute cost of layer ``i``
(the tracer fills it with FLOPs, other operators at their measured time per element,
:mod:`ckptopt.tracer.op_time`; any non-negative integer unit works). It does
not change a peak; the simulator reports the recomputation a plan adds in this
unit and the least-recomputation solvers minimize it. Without it every layer
costs 1, so "least recomputation" means "fewest layers run again". An optional
``cb[i]``, the backward cost in the same unit (the tracer counts it as it counts ``c``),
makes a step cost ``sum(c + cb)`` instead of ``3 sum(c)``; ``unit`` names the unit (``"flops"``, or ``"ns"`` for
times measured on a device by :mod:`ckptopt.calibration`).

**Additive form** (the form the O(n) solver is exact for, :data:`ckptopt.cost_fields.ADDITIVE`):
arrays ``w``, ``h``, ``q``; a plan whose segments are ``[l_0=0, r_0], [l_1, r_1], ...`` has
peak ``static + max_k (sum_{j=1..k} w[l_j] + max_{i in [l_k, r_k]}
(sum_{t=l_k}^{i-1} h[t] + q[i]))``; ``w[0]`` is unused.

A *plan* is the sorted tuple of layers that start a new segment, excluding
layer 0 (see :mod:`ckptopt.plan`).
"""

from __future__ import annotations

import copy
import json
import math
import os
from functools import cached_property
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from .cost_fields import ADDITIVE, FULL, REQUIRED, Field, by_key
from .errors import InvalidCosts
from .sides import SideArrays, SideTensor, side_tensors

__all__ = ["ChainCosts", "KernelArrays", "SideTensor", "SideArrays"]

_FULL = by_key(FULL)
_ADDITIVE = by_key(ADDITIVE)
# Sums of byte counts must stay far from int64 overflow in the solvers' sums.
_MAX_TOTAL = 2**60
_FORMAT = "ckptopt.ChainCosts"
_VERSION = 1


def _int_array(field: str, values: Any, flag: bool = False, signed: bool = False) -> np.ndarray:
    """Convert ``values`` to a read-only 1-D int64 array, or raise InvalidCosts."""
    if isinstance(values, (str, bytes)) or values is None:
        raise InvalidCosts(
            f"field {field!r} must be a sequence of integers, got {type(values).__name__}",
            field=field,
        )
    if not isinstance(values, np.ndarray):
        try:
            values = list(values)
        except TypeError:
            raise InvalidCosts(
                f"field {field!r} must be a sequence of integers, got {type(values).__name__}", field=field
            ) from None
        for i, v in enumerate(values):
            if isinstance(v, (list, tuple, np.ndarray)):
                raise InvalidCosts(
                    f"field {field!r} must be one-dimensional (one value per layer); index {i} is a sequence",
                    field=field,
                )
            if (isinstance(v, bool) and not flag) or not isinstance(v, (int, float, np.integer, np.floating, np.bool_)):
                raise InvalidCosts(f"field {field!r} index {i}: {v!r} is not an integer", field=field, index=i)
    try:
        arr = np.asarray(values)
    except Exception as exc:  # ragged lists and the like
        raise InvalidCosts(f"field {field!r} is not an array of numbers: {exc}", field=field) from exc
    if arr.ndim != 1:
        raise InvalidCosts(
            f"field {field!r} must be one-dimensional (one value per layer), got shape {arr.shape}",
            field=field,
        )
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.bool_)
    ):
        for i, v in enumerate(arr):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise InvalidCosts(
                    f"field {field!r} index {i}: {v!r} is not an integer", field=field, index=i
                )
        arr = arr.astype(float)
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidCosts(
                f"field {field!r} index {i}: {arr[i]!r} is not an integer number of bytes",
                field=field,
                index=i,
            )
        if (np.abs(arr) >= _MAX_TOTAL).any():
            i = int(np.flatnonzero(np.abs(arr) >= _MAX_TOTAL)[0])
            raise InvalidCosts(
                f"field {field!r} index {i}: {arr[i]!r} is too large", field=field, index=i
            )
    out = arr.astype(np.int64)
    neg = out < 0
    if neg.any() and not signed:
        i = int(np.flatnonzero(neg)[0])
        raise InvalidCosts(
            f"field {field!r} index {i}: {int(out[i])} is negative; sizes are non-negative bytes",
            field=field,
            index=i,
        )
    if flag and (out > 1).any():
        i = int(np.flatnonzero(out > 1)[0])
        raise InvalidCosts(
            f"field {field!r} index {i}: {int(out[i])} is not a flag (0/1 or bool)",
            field=field,
            index=i,
        )
    out.setflags(write=False)
    return out


def _int_scalar(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidCosts(f"field {field!r} must be an integer, got {value!r}", field=field)
    if isinstance(value, (float, np.floating)) and (not math.isfinite(value) or value != round(value)):
        raise InvalidCosts(f"field {field!r}: {value!r} is not an integer number of bytes", field=field)
    v = int(value)
    if v < 0:
        raise InvalidCosts(f"field {field!r}: {v} is negative; sizes are non-negative bytes", field=field)
    if v >= _MAX_TOTAL:
        raise InvalidCosts(f"field {field!r}: {v} is too large", field=field)
    return v


def _by_symbol(given: Mapping[str, Any], table: dict[str, Field], kind: str) -> dict[str, Any]:
    """The given fields under their symbols (a name is the same field; both is an error), None dropped."""
    out: dict[str, Any] = {}
    for key, value in given.items():
        if key not in table:
            raise InvalidCosts(f"a cost model of kind {kind!r} has no field {key!r} (see ckptopt.cost_fields)",
                               field=key)
        symbol = table[key].symbol
        if symbol in out:
            raise InvalidCosts(f"field {symbol!r} given twice (as {symbol!r} and {table[symbol].name!r})",
                               field=symbol)
        if value is not None:
            out[symbol] = value
    return out


def _check_given(fields: tuple[Field, ...], given: dict[str, Any]) -> None:
    """Every required field is given, and every field with the fields it goes with."""
    missing = [f.symbol for f in fields if f.default == REQUIRED and f.symbol not in given]
    if missing:
        raise InvalidCosts(f"a cost model needs field(s) {', '.join(missing)}", field=missing[0])
    for f in fields:
        lacking = [x for x in f.needs if x not in given]
        if f.symbol in given and lacking:
            raise InvalidCosts(f"field {f.symbol!r} goes with {', '.join(map(repr, lacking))}: give "
                               f"{'them' if len(lacking) > 1 else 'it'} too", field=f.symbol)


def _with_defaults(fields: tuple[Field, ...], values: dict[str, np.ndarray], given: set, n: int) -> dict[str, np.ndarray]:
    """Every field in table order: as given (validated), or filled by its default from the fields before
    it; an optional field nothing gives, and a default refining it, stay missing."""
    out: dict[str, np.ndarray] = {}
    for f in fields:
        if f.symbol in values:
            out[f.symbol] = values[f.symbol]
        elif isinstance(f.default, str) and f.default in out:
            out[f.symbol] = out[f.default]
        elif callable(f.default):
            arr = np.asarray(f.default(out, given, n), dtype=np.int64)
            arr.setflags(write=False)
            out[f.symbol] = arr
    return out


class KernelArrays(NamedTuple):
    """The per-layer int64 arrays the compiled simulator and solvers read, by name.

    Built once per cost model (:attr:`ChainCosts.kernel_arrays`), all read-only.
    With ``H(l, i) = P[i] - P[l]`` what layers ``l..i-1`` of a segment leave
    saved (deduplicated by storage):

    ``P``     prefix sums (length n+1) of what each layer leaves saved
    ``qb``    backward term of layer i (its saves, output gradient, transient, later gradients)
    ``ck``    bytes a segment starting at layer i holds as its checkpoint (``ck[0] = 0``)
    ``qf``    forward term of layer i inside an unwrapped segment (input not already saved + ``f``)
    ``fw``    forward term of layer i inside a wrapped segment (input + ``f``)
    ``f``     forward transient
    ``G``     gradient bytes of the parameters of the layers after i
    ``a``     output bytes
    ``runs``  a recomputation that needs layer i last runs it (up to its last save)
    ``saves`` layer i saves a tensor (its input, output or extras)
    ``sin``   layer i saves its input
    ``qs``    ``qf`` with the transient up to the last save (``fs``)
    ``fs``    forward transient up to the last saved tensor
    ``keep``  what layer i keeps of what it produces (a stored segment ending at i)
    ``sout``  layer i saves its output
    ``rb``    gradient bytes held while a checkpointed segment ending at i is recomputed
    ``ext``   a recomputation that reaches layer i must run it (it saves, or packs a dead tensor)
    ``qbk``   ``qb`` with ``bk`` for ``b`` (a segment's first layer whose input stays held)
    ``qbf``   ``qb`` with ``bf`` for ``b`` (an unwrapped segment's first layer whose input
              the previous segment does not keep)
    ``qbr``   ``qb`` with ``br`` for ``b`` (a layer of a checkpointed segment: recomputed saves)
    ``qbkr``  ``qbk`` with ``bkr`` for ``bk``
    ``qbt``, ``qbkt`` ``qbr``, ``qbkr`` with ``brt``, ``bkrt``: the backward term of a checkpointed
              segment's last saving layer, from its first read of a saved tensor on
    ``rbp``   ``rb`` with ``rgp``: the part of that layer's backward before that read
    ``ckf``   what a checkpointed segment starting at i changes in the backward term of its first saving
              layer when that is not i: the frame lets the checkpoint go mid-way through it (at its last
              saved tensor's release, ``fpre``/``fpost``): ``max(pre + ck, post) - max(pre, post) - ck``
    ``ff``    ``f`` with the input dying at its last use (an unwrapped segment's first layer whose
              input nothing else holds); ``qf`` and ``qs`` take ``ff``/``ffs`` where
              nothing holds the layer's input
    ``fc``    ``f`` in a checkpoint's first pass (its saved tensors not kept): the forward term of a
              checkpointed segment's first layer; ``fw`` is the input plus ``ffc``
    ``cseg``  the fixed cost of running a checkpointed segment that starts at layer i, in the unit of
              the compute costs (:attr:`ChainCosts.segment_cost`): the solvers add it to the segment's
              recomputation

    For the additive form only ``P``, ``qb`` (= ``q``), ``ck`` (= ``w``), ``keep``
    (= ``h``), ``qbk`` and ``qbf`` are meaningful; ``runs``, ``saves``, ``sin`` and ``ext``
    are ones and the rest zeros. numba reads the tuple by field name in nopython mode.
    """

    P: np.ndarray
    qb: np.ndarray
    ck: np.ndarray
    qf: np.ndarray
    fw: np.ndarray
    f: np.ndarray
    G: np.ndarray
    a: np.ndarray
    runs: np.ndarray
    saves: np.ndarray
    sin: np.ndarray
    qs: np.ndarray
    fs: np.ndarray
    keep: np.ndarray
    sout: np.ndarray
    rb: np.ndarray
    ext: np.ndarray
    qbk: np.ndarray
    qbf: np.ndarray
    qbr: np.ndarray
    qbkr: np.ndarray
    ff: np.ndarray
    fc: np.ndarray
    qbt: np.ndarray
    qbkt: np.ndarray
    rbp: np.ndarray
    ckf: np.ndarray
    cseg: np.ndarray

    @classmethod
    def of(cls, n: int, **arrays: Any) -> "KernelArrays":
        """Contiguous read-only int64 copies of the arrays given by name; a field not given is zeros
        (length ``n``). One array type for every kernel."""
        unknown = set(arrays) - set(cls._fields)
        if unknown:
            raise TypeError(f"KernelArrays has no field(s) {', '.join(sorted(unknown))}")
        out = {}
        for name in cls._fields:
            x = np.array(arrays[name] if name in arrays else np.zeros(n), dtype=np.int64, copy=True)
            x.setflags(write=False)
            out[name] = x
        return cls(**out)


class ChainCosts:
    """Per-layer memory costs of a chain of ``n`` layers, in integer bytes.

    Parameters
    ----------
    **fields : sequences of length n
        The per-layer fields by symbol or name (:data:`ckptopt.cost_fields.FULL`; see the module
        docstring and docs/design.md §3): ``a, p, sin, sout, m, f, b`` are required, the rest
        optional. ``sin``/``sout`` and the other flags take bools or 0/1.
    static : int
        Bytes held for the whole step (parameters, buffers, model input).
    names : sequence of str, optional
        A label per layer, for display.
    c, cb, unit : optional
        Forward and backward compute per layer, and its unit (module docstring).
    segment_cost : int, optional
        The fixed cost, in the unit of ``c``, of running one segment under a checkpoint besides the
        compute it re-runs (the checkpoint call, its saved-tensor hooks, the re-run's dispatch). The
        least-recomputation solvers and the lowest peak's tie-break minimise recomputation plus this
        per checkpointed segment, so of plans alike in recomputation they take the one with fewer
        segments. Default 0.
    side : sequence of SideTensor or dict, optional
        Tensors crossing layer boundaries besides the chain tensor (docs/design.md §4).

    Raises
    ------
    InvalidCosts
        When lengths disagree, ``n < 1``, a field is unknown or missing, or a value is negative,
        not an integer, or not a flag; the exception names the field and index.

    Examples
    --------
    >>> c = ChainCosts(a=[4, 4], p=[0, 0], sin=[1, 1], sout=[0, 0], m=[0, 0], f=[4, 4], b=[4, 4])
    >>> c.f is c.forward, c.ff.tolist()  # a name for each symbol; ff (the input dying) defaults to f
    (True, [4, 4])
    >>> ChainCosts.additive(w=[0, 4], h=[4, 4], q=[8, 8]).kind
    'additive'
    """

    def __init__(self, *, static: int = 0, names: Iterable[str] | None = None, c: Sequence[int] | None = None,
                 cb: Sequence[int] | None = None, unit: str = "flops", segment_cost: int = 0,
                 side: Sequence[SideTensor | Mapping[str, Any]] | None = None, **fields: Sequence[int]):
        given = _by_symbol(fields, _FULL, "full")
        _check_given(FULL, given)
        self._init("full", given, static, names, c, cb, unit, segment_cost)
        self._fields = _with_defaults(FULL, self._fields, set(given), self.n)
        groot = self._fields["groot"]
        bad = np.flatnonzero((groot < np.arange(self.n)) | (groot >= self.n))
        if bad.size:
            i = int(bad[0])
            raise InvalidCosts(f"field 'groot' index {i}: {int(groot[i])} is not a layer in {i}..{self.n - 1} "
                               "(the layer whose output gradient's storage holds layer i's: itself or a later one)",
                               field="groot", index=i)
        self.side = side_tensors(self.n, side)

    # -- construction -------------------------------------------------------
    def _init(self, kind: str, values: Mapping[str, Any], static: Any, names: Any, c: Any = None, cb: Any = None,
              unit: str = "flops", segment_cost: Any = 0) -> None:
        table = _FULL if kind == "full" else _ADDITIVE
        fields = {}
        for name, v in values.items():
            fields[name] = _int_array(name, v, flag=table[name].flag, signed=table[name].signed)
        lengths = [len(arr) for arr in fields.values()]
        n = max(set(lengths), key=lambda x: (lengths.count(x), -lengths.index(x)))
        for name, arr in fields.items():
            if len(arr) != n:
                others = [k for k, v in fields.items() if len(v) == n]
                raise InvalidCosts(
                    f"field {name!r} has {len(arr)} entries but {', '.join(map(repr, others))} "
                    f"{'has' if len(others) == 1 else 'have'} {n}; every per-layer field needs one entry per layer",
                    field=name,
                )
        if not n:
            raise InvalidCosts("a cost model needs at least one layer (n >= 1), got 0", field=None)
        self.kind = kind
        self.static = _int_scalar("static", static)
        total = self.static + sum(int(arr.sum()) for arr in fields.values())
        if total >= _MAX_TOTAL:
            raise InvalidCosts(
                f"the sizes sum to {total} bytes, beyond what the solvers can add up exactly (2**60)",
                field=None,
            )
        self._fields = fields
        if names is not None:
            names = tuple(str(x) for x in names)
            if len(names) != n:
                raise InvalidCosts(
                    f"field 'names' has {len(names)} entries for {n} layers", field="names"
                )
        self.names = names
        if c is not None:
            compute = _int_array("c", c)
            if len(compute) != n:
                raise InvalidCosts(
                    f"field 'c' has {len(compute)} entries for {n} layers; give one compute cost per layer",
                    field="c",
                )
        else:
            compute = np.ones(n, dtype=np.int64)
            compute.setflags(write=False)
        self._c = compute
        self.has_compute = c is not None
        self._cb = None
        if cb is not None:
            self._cb = _int_array("cb", cb)
            if len(self._cb) != n:
                raise InvalidCosts(f"field 'cb' has {len(self._cb)} entries for {n} layers", field="cb")
        if not isinstance(unit, str) or not unit:
            raise InvalidCosts(f"unit must be a name such as 'flops' or 'ns', got {unit!r}", field="unit")
        self.unit = unit
        self.segment_cost = _int_scalar("segment_cost", segment_cost)

    @property
    def cb(self) -> np.ndarray | None:
        """Backward compute cost per layer, in :attr:`unit` (None: a step taken as 3 forwards)."""
        return self._cb

    @property
    def step_compute(self) -> int:
        """The compute of one step without recomputation: ``sum(c + cb)``, or ``3 sum(c)``."""
        forward = int(self._c.sum())
        return forward + int(self._cb.sum()) if self._cb is not None else 3 * forward

    @property
    def c(self) -> np.ndarray:
        """Forward compute cost per layer (FLOPs from the tracer; ones when not given)."""
        return self._c

    @cached_property
    def compute_prefix(self) -> np.ndarray:
        """Prefix sums of :attr:`c` (length n+1, int64, read-only): compute of layers ``l..r`` is
        ``compute_prefix[r+1] - compute_prefix[l]``."""
        out = np.concatenate([[0], np.cumsum(self._c)]).astype(np.int64)
        out.setflags(write=False)
        return out

    @classmethod
    def additive(
        cls,
        w: Sequence[int],
        h: Sequence[int],
        q: Sequence[int],
        static: int = 0,
        names: Iterable[str] | None = None,
        c: Sequence[int] | None = None,
        cb: Sequence[int] | None = None,
        unit: str = "flops",
        segment_cost: int = 0,
    ) -> "ChainCosts":
        """Build the additive form (see the module docstring). ``w[0]`` is unused."""
        self = cls.__new__(cls)
        self._init("additive", dict(w=w, h=h, q=q), static, names, c, cb, unit, segment_cost)
        self.side = ()
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ChainCosts":
        """Inverse of :meth:`to_dict`."""
        if not isinstance(data, Mapping):
            raise InvalidCosts(f"a cost model must be a JSON object, got {type(data).__name__}")
        if data.get("format", _FORMAT) != _FORMAT:
            raise InvalidCosts(f"not a ckptopt cost file: format is {data.get('format')!r}, expected {_FORMAT!r}")
        kind = data.get("kind", "full")
        layers = data.get("layers")
        if not isinstance(layers, Mapping):
            raise InvalidCosts("cost file has no 'layers' object with one array per field", field="layers")
        if kind not in ("full", "additive"):
            raise InvalidCosts(f"unknown cost model kind {kind!r}: expected 'full' or 'additive'", field="kind")
        fields, table = (FULL, _FULL) if kind == "full" else (ADDITIVE, _ADDITIVE)
        missing = [f.symbol for f in fields if f.default == REQUIRED and f.symbol not in layers and f.name not in layers]
        if missing:
            raise InvalidCosts(
                f"cost file of kind {kind!r} lacks field(s) {', '.join(missing)} in 'layers'",
                field=missing[0],
            )
        extra = sorted(set(layers) - set(table))
        if extra:
            raise InvalidCosts(f"cost file of kind {kind!r} has unknown field(s) {', '.join(extra)}", field=extra[0])
        common = dict(static=data.get("static", 0), names=data.get("names"), c=data.get("compute"),
                      cb=data.get("backward_compute"), unit=data.get("compute_unit", "flops"),
                      segment_cost=data.get("segment_cost", 0))
        if kind == "full":
            return cls(**layers, side=data.get("side"), **common)
        return cls.additive(**{table[k].symbol: v for k, v in layers.items()}, **common)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> "ChainCosts":
        """Load a cost model from a JSON file path (or a JSON string starting with ``{``)."""
        if isinstance(source, str) and source.lstrip().startswith("{"):
            text = source
            where = "JSON text"
        else:
            where = os.fspath(source)
            try:
                with open(where, encoding="utf-8") as fh:
                    text = fh.read()
            except OSError as exc:
                raise InvalidCosts(f"cannot read cost file {where!r}: {exc.strerror}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidCosts(
                f"cost file {where!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                f"{exc.msg}); is it truncated? Regenerate it with ChainCosts.to_json or `ckptopt profile --json`."
            ) from exc
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": _FORMAT,
            "version": _VERSION,
            "kind": self.kind,
            "static": self.static,
            "layers": self._written_layers(),
        }
        if self.names is not None:
            out["names"] = list(self.names)
        if self.has_compute:
            out["compute"] = [int(x) for x in self._c]
        if self._cb is not None:
            out["backward_compute"] = [int(x) for x in self._cb]
        if self.unit != "flops":
            out["compute_unit"] = self.unit
        if self.segment_cost:
            out["segment_cost"] = self.segment_cost
        if self.side:
            out["side"] = [t.to_dict() for t in self.side]
        return out

    def _written_layers(self) -> dict[str, list]:
        """The per-layer fields as a cost file has them, in table order: a field that equals the default
        it would be read back with is left out (docs/design.md §3 says which fields may be)."""
        written: dict[str, list] = {}
        for f in FULL if self.kind == "full" else ADDITIVE:
            v = self._fields.get(f.symbol)
            if v is None:
                continue
            if f.omit_default:
                default = (self._fields.get(f.default) if isinstance(f.default, str)
                           else f.default(self._fields, set(written), self.n))
                if default is not None and np.array_equal(v, default):
                    continue
            written[f.symbol] = [bool(x) for x in v] if f.flag else [int(x) for x in v]
        return written

    def to_json(self, path: str | os.PathLike | None = None, indent: int | None = 1) -> str:
        """Serialize to JSON; also write it to ``path`` when given. Returns the text."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        return text

    # -- access ---------------------------------------------------------------
    def __getattr__(self, name: str) -> np.ndarray:
        # Only called when normal lookup fails: the per-layer fields, by symbol or by name.
        fields = self.__dict__.get("_fields")
        if fields is None:
            raise AttributeError(name)
        table = _FULL if self.kind == "full" else _ADDITIVE
        if name in table and table[name].symbol in fields:
            return fields[table[name].symbol]
        if name in _FULL or name in _ADDITIVE:
            raise AttributeError(f"a cost model of kind {self.kind!r} has no field {name!r}")
        raise AttributeError(name)

    @property
    def n(self) -> int:
        """Number of layers."""
        return len(next(iter(self._fields.values())))

    @property
    def is_additive(self) -> bool:
        return self.kind == "additive"

    def __len__(self) -> int:
        return self.n

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChainCosts):
            return NotImplemented
        return (
            self.kind == other.kind
            and self.static == other.static
            and self._fields.keys() == other._fields.keys()
            and all(np.array_equal(v, other._fields[k]) for k, v in self._fields.items())
            and self.has_compute == other.has_compute
            and np.array_equal(self._c, other._c)
            and self.unit == other.unit
            and self.segment_cost == other.segment_cost
            and (self._cb is None) == (other._cb is None)
            and (self._cb is None or np.array_equal(self._cb, other._cb))
            and self.side == other.side
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        side = f", side={len(self.side)}" if self.side else ""
        return f"ChainCosts(kind={self.kind!r}, n={self.n}, static={self.static}{side})"

    @property
    def has_side(self) -> bool:
        """Whether tensors besides the chain tensor cross layer boundaries (:class:`SideTensor`)."""
        return bool(self.side)

    @cached_property
    def side_arrays(self) -> SideArrays:
        """The side tensors as arrays for the compiled kernels (:class:`SideArrays`; built once)."""
        return SideArrays.build(self.n, self.side, self._fields["groot"], self._fields["gh"],
                                self._fields.get("fpre"), self._fields.get("fpost"), self._fields.get("g"),
                                self._fields.get("fkpre"), self._fields.get("fkpost"))

    # -- derived quantities (used by the simulator and the solvers) -------------
    @cached_property
    def grad_after(self) -> np.ndarray:
        """``G[i]``: gradient bytes of the parameters of layers after ``i`` (full form)."""
        p = self._fields["p"]
        suffix = np.concatenate([np.cumsum(p[::-1])[::-1], [0]])
        return suffix[1:].astype(np.int64)

    @cached_property
    def kernel_arrays(self) -> KernelArrays:
        """The arrays the compiled kernels read (:class:`KernelArrays`; built once, read-only).

        Full form, from the per-layer fields: ``k[t]`` says activation ``x_t`` is
        saved (by layer t as its output or by layer t+1 as its input), so what
        layer ``i`` leaves saved is ``h[i] = m[i] + a[i] k[i]``; ``rb[r] = G[j] +
        rg[j]`` for ``j`` the last layer up to ``r`` that saves a tensor (the
        trailing layers' backward runs before the recomputation); ``runs[i]``:
        when layer ``i`` is the last one a recomputation needs, it runs up to its
        last saved tensor (``fs``) -- it saves what it produces, or work precedes
        its input's pack -- else its input pack comes first.
        """
        n = self.n
        if self.kind == "additive":
            h, q, w = self._fields["h"], self._fields["q"], self._fields["w"]
            P = np.concatenate([[0], np.cumsum(h)])
            ck = w.copy()
            ck[0] = 0
            one = np.ones(n, dtype=np.int64)
            # every backward term is q; every layer runs, saves and saves its input; the rest is 0
            return KernelArrays.of(n, P=P, qb=q, ck=ck, runs=one, saves=one, sin=one, keep=h, ext=one, qbk=q, qbf=q,
                                   qbr=q, qbkr=q, qbt=q, qbkt=q, cseg=np.full(n, self.segment_cost))
        a, sin, sout, m, f, b = (self._fields[k] for k in ("a", "sin", "sout", "m", "f", "b"))
        G = self.grad_after
        nxt_sin = np.concatenate([sin[1:], [0]])
        k = ((sout > 0) | (nxt_sin > 0)).astype(np.int64)
        h = m + a * k
        P = np.concatenate([[0], np.cumsum(h)])
        g = self._fields["g"]  # the output gradient's storage
        qb = m + a * sout + g + b + G
        a_prev = np.concatenate([[0], a[:-1]])
        k_prev = np.concatenate([[0], k[:-1]])
        # the input of layer i is held while it runs if a layer saves it (k_prev), else it dies at
        # its last use inside the layer (ff, ffs): always so in a checkpointed segment's first pass,
        # whose saves the checkpoint does not keep
        ff, ffs = self._fields["ff"], self._fields["ffs"]
        qf = a_prev * (1 - k_prev) + np.where(k_prev > 0, f, ff)
        fw = a_prev + self._fields["ffc"]  # (a checkpoint's first pass keeps none of the saved tensors)
        fs = self._fields["fs"]
        side_saves = np.zeros(n, dtype=bool)  # the layer saves a side tensor (an input, or an output it made)
        side_out_saved = np.zeros(n, dtype=bool)
        for t in self.side:
            for u in t.saved_by:
                side_saves[u] = True
                if u == t.producer:
                    side_out_saved[u] = True
        runs = (sout > 0) | (m > 0) | (fs > 0) | side_out_saved
        saves = (sout > 0) | (m > 0) | (sin > 0) | (self._fields["holds"] > 0) | side_saves
        qs = a_prev * (1 - k_prev) + np.where(k_prev > 0, fs, ffs)
        keep = m + a * sout
        rg = self._fields["rg"] + g - a  # (measured with an a-byte output gradient)
        j = np.maximum.accumulate(np.where(saves, np.arange(n), -1))  # last saving layer <= r
        rb = np.where(j >= 0, G[j] + rg[j], G + g)
        rbp = np.where(j >= 0, G[j] + (self._fields["rgp"] + g - a)[j], G + g)
        ext = saves | (self._fields["dead"] > 0)
        qbk = qb - b + self._fields["bk"]
        sout_prev = np.concatenate([[0], sout[:-1]])
        qbf = qb - b + np.where(sout_prev > 0, self._fields["bf"], b)  # b is bf where i-1 saves nothing
        qbr = qb - b + self._fields["br"]
        qbkr = qb - b + self._fields["bkr"]
        ckf = np.zeros(n, dtype=np.int64)
        if "fpre" in self._fields:  # (the first saving layer u after l; unknown splits: held throughout)
            pre, post, u = self._fields["fpre"], self._fields["fpost"], n
            for l in range(n - 1, 0, -1):
                if saves[l]:
                    u = l
                elif u < n:
                    ckf[l] = max(pre[u] + a_prev[l], post[u]) - max(pre[u], post[u]) - a_prev[l]
        return KernelArrays.of(n, P=P, qb=qb, ck=a_prev, qf=qf, fw=fw, f=f, G=G, a=a, runs=runs, saves=saves, sin=sin,
                               qs=qs, fs=fs, keep=keep, sout=sout, rb=rb, ext=ext, qbk=qbk, qbf=qbf, qbr=qbr, qbkr=qbkr,
                               ff=ff, fc=self._fields["fc"], qbt=qb - b + self._fields["brt"],
                               qbkt=qb - b + self._fields["bkrt"], rbp=rbp, ckf=ckf,
                               cseg=np.full(n, self.segment_cost))

    def with_segment_cost(self, segment_cost: int) -> "ChainCosts":
        """A copy of this cost model with :attr:`segment_cost` set (the arrays are shared)."""
        out = copy.copy(self)
        out.segment_cost = _int_scalar("segment_cost", segment_cost)
        out.__dict__.pop("kernel_arrays", None)  # (built again, with the new cseg)
        return out

    def additive_form(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(w, h, q)`` of the additive form.

        Exact for an additive instance. For a full-form instance it is the
        approximation the ``linear`` solver optimizes: ``w[l] = a[l-1]``, ``h``
        what each layer leaves saved (deduplicated by storage), and ``q[i]`` the
        largest of layer ``i``'s backward, recomputation (as if the segment
        ended at ``i``) and forward terms. The backward terms are exact; the
        recomputation and forward terms are not, because in the full model
        they depend on where the segment ends. The simulator scores the
        resulting plan with the full model.
        """
        K = self.kernel_arrays
        h = np.diff(K.P)
        if self.kind == "additive":
            return K.ck, h, K.qb
        q = np.maximum(np.maximum(K.qb, K.G + K.a + K.qf), K.fw)
        return K.ck, h, q
