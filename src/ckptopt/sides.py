"""Side tensors: tensors that cross layer boundaries besides the chain tensor (docs/design.md §4).

:class:`SideTensor` describes one (its bytes, producer, consumers and savers) as a cost
model holds it; :class:`SideArrays` is the same as arrays for the compiled kernels
(:mod:`ckptopt.simulator.side_tensors`). No torch import.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from .errors import InvalidCosts

__all__ = ["SideTensor", "SideArrays", "side_tensors", "MAX_OPEN"]

#: At most this many side tensors may cross one boundary: the exact programs keep a state per
#: subset of them (2**k states).
MAX_OPEN = 12


def _count(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidCosts(f"field {field!r} must be an integer, got {value!r}", field="side")
    if isinstance(value, (float, np.floating)) and (not math.isfinite(value) or value != round(value)):
        raise InvalidCosts(f"field {field!r}: {value!r} is not an integer number of bytes", field="side")
    if int(value) < 0:
        raise InvalidCosts(f"field {field!r}: {int(value)} is negative; sizes are non-negative bytes", field="side")
    if int(value) >= 2**50:
        raise InvalidCosts(f"field {field!r}: {int(value)} is too large", field="side")
    return int(value)


@dataclass(frozen=True)
class SideTensor:
    """A tensor that crosses layer boundaries besides the chain tensor (see the module docstring).

    Attributes
    ----------
    bytes : int
        Bytes of its storage.
    producer : int
        The layer that computes it; -1 for a value computed once before the first layer (a
        mask or rotary table several layers read, which no checkpoint recomputes).
    consumers : tuple of int
        The later layers that read it, increasing (at least one, each after ``producer``).
    saved_by : tuple of int
        The layers among ``producer`` and ``consumers`` that save it for their backward.
    grad : int or None
        Bytes of its gradient's storage (None: ``bytes``; 0: it needs no gradient; less than
        ``bytes`` for a view of a larger storage, one chunk of a projection).
    name : str
        A label (the graph node), for display.
    saved_pre, saved_post : tuple of int
        Per layer of ``saved_by`` (optional): that layer's backward peak (relative, as its
        ``b``) before and from the moment its saved reference to this tensor is released: a
        layer that is the last to hold it frees it mid-backward. Empty: held to the end.
    grad_view : int
        -1, or the layer whose output gradient's storage its gradient is a view of (a
        concatenation's backward hands each input a slice of its output gradient): one
        storage, counted once however many tensors' gradients view it, and not where it is
        that layer's chain gradient already (``ChainCosts.groot``).
    grad_by : tuple of int
        The consumers whose backward adds to its gradient (a consumer may only read its size or
        dtype); empty: every consumer. Its gradient lives from the backward of the last of them
        to its producer's, and a view lasts until the next of them sums its contribution in.
    last_gain : int
        At most 0: what its last consumer's forward peak changes by when nothing else holds it there
        (no save, no checkpoint call, no earlier segment): it dies at its last use inside that layer,
        which runs on after it (a concatenation that does not save it, then a BatchNorm). 0: unknown,
        or no change. This one for a recomputation that stops at the layer's last saved tensor
        (perhaps before the tensor's last use), with the layer's input held (as ``ChainCosts.f``/``fs``);
        in files written before ``last_gain_free``, the smaller change of the two.
    last_gain_free, last_gain_full_free, last_gain_ckpt_free : int or None
        ``last_gain``, ``last_gain_full`` and ``last_gain_ckpt`` where the layer's input dies at its last use
        inside it too (as ``ff``/``ffs``/``ffc`` count it: nothing else holds it); None: the same.
    last_gain_full : int or None
        The same for the layer's whole forward (an unwrapped segment's, or a recomputation that runs
        past the layer), at most 0; None: ``last_gain``.
    saved_pre_rec, saved_post_rec : tuple of int
        ``saved_pre``/``saved_post`` where the saving layer is recomputed with the tensor's producer:
        the recomputed copy is handed out once and dies when the backward node that read it returns,
        before the engine sums that node's gradients to their shapes (a bias's), where autograd
        elsewhere keeps it until after. Empty: as ``saved_pre``/``saved_post``.
    saved_pre_free, saved_post_free : tuple of int
        ``saved_pre``/``saved_post`` where nothing but the saving layer's own saved tensors holds its chain
        input (the first layer of an unwrapped segment that no earlier layer keeps the input of: the
        input then goes with the last saved tensor over it, as ``ChainCosts.bf`` has it), where
        ``saved_pre``/``saved_post`` are measured with the input held as ``b`` has it. Empty: the same.
    last_gain_ckpt : int
        ``last_gain_full`` in a checkpoint's first pass (its last consumer in the checkpointed segment
        that makes it): that pass keeps none of the tensors its layers save, so the tensor dies at its
        last use there even where a layer saves it. At most 0; 0: unknown, or no change.
    """

    bytes: int
    producer: int
    consumers: tuple[int, ...]
    _: KW_ONLY
    saved_by: tuple[int, ...] = ()
    grad: int | None = None
    name: str = ""
    grad_view: int = -1
    saved_pre: tuple[int, ...] = ()
    saved_post: tuple[int, ...] = ()
    grad_by: tuple[int, ...] = ()
    last_gain: int = 0
    last_gain_full: int | None = None
    saved_pre_rec: tuple[int, ...] = ()
    saved_post_rec: tuple[int, ...] = ()
    last_gain_ckpt: int = 0
    saved_pre_free: tuple[int, ...] = ()
    saved_post_free: tuple[int, ...] = ()
    last_gain_free: int | None = None
    last_gain_full_free: int | None = None
    last_gain_ckpt_free: int | None = None

    @property
    def grad_bytes(self) -> int:
        return self.bytes if self.grad is None else self.grad

    @property
    def grad_consumers(self) -> tuple[int, ...]:
        """The consumers whose backward adds to its gradient (``grad_by``, or all of them)."""
        return self.grad_by or self.consumers

    @property
    def grad_split(self) -> int:
        """The layer whose backward adds the next contribution after the last consumer's: a view of
        that consumer's output gradient lasts until then (the producer, with one such consumer)."""
        gc = self.grad_consumers
        return gc[-2] if len(gc) > 1 else self.producer

    @property
    def grad_last(self) -> int:
        """The layer whose backward makes its gradient first (it lives from there to its producer's)."""
        return self.grad_consumers[-1]

    def grad_storage(self, i: int) -> tuple[tuple, int]:
        """(key, bytes) of the storage its gradient lives in while layer ``i``'s backward runs
        (producer <= i < last consumer). A view of a layer's output gradient lasts until the
        next contribution is summed in (at the next consumer), which makes a storage of its own."""
        if self.grad_view >= 0 and i >= self.grad_split:
            return ("view", self.grad_view), self.grad_bytes
        return ("own", id(self)), (self.bytes if self.grad_view >= 0 else self.grad_bytes)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes": int(self.bytes), "producer": int(self.producer),
                               "consumers": [int(u) for u in self.consumers],
                               "saved_by": [int(u) for u in self.saved_by]}
        if self.grad is not None:
            out["grad"] = int(self.grad)
        if self.name:
            out["name"] = self.name
        if self.grad_view >= 0:
            out["grad_view"] = int(self.grad_view)
        if self.grad_by and self.grad_by != self.consumers:
            out["grad_by"] = [int(u) for u in self.grad_by]
        if self.saved_pre:
            out["saved_pre"] = [int(x) for x in self.saved_pre]
            out["saved_post"] = [int(x) for x in self.saved_post]
        if self.saved_pre_rec:
            out["saved_pre_rec"] = [int(x) for x in self.saved_pre_rec]
            out["saved_post_rec"] = [int(x) for x in self.saved_post_rec]
        if self.saved_pre_free:
            out["saved_pre_free"] = [int(x) for x in self.saved_pre_free]
            out["saved_post_free"] = [int(x) for x in self.saved_post_free]
        if self.last_gain:
            out["last_gain"] = int(self.last_gain)
        if self.last_gain_full is not None and self.last_gain_full != self.last_gain:
            out["last_gain_full"] = int(self.last_gain_full)
        if self.last_gain_ckpt:
            out["last_gain_ckpt"] = int(self.last_gain_ckpt)
        for k in ("last_gain_free", "last_gain_full_free", "last_gain_ckpt_free"):
            if getattr(self, k) is not None:
                out[k] = int(getattr(self, k))
        return out


class SideArrays(NamedTuple):
    """The side tensors as int64 arrays for the compiled kernels (:attr:`ChainCosts.side_arrays`).

    ``sa``, ``sg``, ``sp``, ``smax``: bytes, gradient bytes, producer and last consumer per side
    tensor; ``cptr``/``cu``/``csv``: its consumers and whether each saves it (CSR); ``psv``: the
    producer saves it; ``optr``/``olist``: the side tensors layer i produces; ``bptr``/``blist``:
    the side tensors open at boundary l (produced before layer l, read at or after it), in
    increasing order (bit k of a kernel's state mask is ``blist[bptr[l] + k]``); ``bgrad[i]``:
    side gradients live through layer i's backward besides what it creates (pending ones, and
    those of its own side outputs); ``rside[t]``: side gradients live when layer t's backward
    triggers a recomputation (beyond its own output gradients, which its ``rg`` counts);
    ``sdie``: its ``last_gain``; ``sdief``: its ``last_gain_full`` (``last_gain`` where None); ``sdiec``:
    its ``last_gain_ckpt``; ``sdie_f``, ``sdief_f``, ``sdiec_f``: the same with the reader's input dying too.
    ``svpre``/``svpost`` (per saver, CSR by ``svptr``/``svu``): the release split;
    ``_r``: a recomputed copy's, ``_f``: with the saver's input held by nothing else; ``split_known``: per
    side tensor, 0 no split is known (held to the saver's end), 1 its splits, 2 a recomputed copy's too;
    ``fpre``/``fpost``/``fkpre``/``fkpost``: the frame's split per layer (``ChainCosts``), and
    ``frame_known``: 1 where the cost model gives them.
    """

    sa: np.ndarray
    sg: np.ndarray
    sp: np.ndarray
    smax: np.ndarray
    cptr: np.ndarray
    cu: np.ndarray
    csv: np.ndarray
    psv: np.ndarray
    optr: np.ndarray
    olist: np.ndarray
    bptr: np.ndarray
    blist: np.ndarray
    bgrad: np.ndarray
    rside: np.ndarray
    svptr: np.ndarray
    svu: np.ndarray
    svpre: np.ndarray
    svpost: np.ndarray
    svpre_r: np.ndarray
    svpost_r: np.ndarray
    svpre_f: np.ndarray
    svpost_f: np.ndarray
    split_known: np.ndarray
    fpre: np.ndarray
    fpost: np.ndarray
    fkpre: np.ndarray
    fkpost: np.ndarray
    sdie: np.ndarray
    sdief: np.ndarray
    sdiec: np.ndarray
    sdie_f: np.ndarray
    sdief_f: np.ndarray
    sdiec_f: np.ndarray
    frame_known: int

    @classmethod
    def build(cls, n: int, side: Sequence[SideTensor], groot: Sequence[int] | None = None,
              gh: Sequence[int] | None = None, fpre: Sequence[int] | None = None,
              fpost: Sequence[int] | None = None, g: Sequence[int] | None = None,
              fkpre: Sequence[int] | None = None, fkpost: Sequence[int] | None = None) -> "SideArrays":
        m = len(side)
        sa = [t.bytes for t in side]
        sg = [t.grad_bytes for t in side]
        sp = [t.producer for t in side]
        smax = [t.consumers[-1] for t in side]
        glast = [t.grad_last for t in side]
        cptr, cu, csv = [0], [], []
        for t in side:
            saved = set(t.saved_by)
            cu.extend(t.consumers)
            csv.extend(1 if u in saved else 0 for u in t.consumers)
            cptr.append(len(cu))
        psv = [1 if t.producer in set(t.saved_by) else 0 for t in side]
        optr, olist = [0], []
        by_producer: dict[int, list[int]] = {}
        for j, t in enumerate(side):
            by_producer.setdefault(t.producer, []).append(j)
        for i in range(n):
            olist.extend(by_producer.get(i, ()))
            optr.append(len(olist))
        bptr, blist = [0], []
        for l in range(n + 1):
            blist.extend(j for j in range(m) if sp[j] < l <= smax[j])
            bptr.append(len(blist))
        bgrad = np.zeros(n, dtype=np.int64)
        rside = np.zeros(n, dtype=np.int64)
        # one storage viewed by several side gradients: as large as the largest of them says
        vmax: dict[int, int] = {}
        for t in side:
            if t.grad_view >= 0 and t.grad_bytes:
                vmax[t.grad_view] = max(vmax.get(t.grad_view, 0), t.grad_bytes)
        for i in range(n):
            chain_key = ("view", int(groot[i]) if groot is not None else i)  # layer i's output gradient
            for out, lo in ((bgrad, 0), (rside, 1)):  # live: p <= i (backward), p < i (recomputation)
                keys: dict[tuple, int] = {}
                outlives = False
                for j, t in enumerate(side):
                    if sg[j] and sp[j] + lo <= i < glast[j]:
                        key, size = t.grad_storage(i)
                        if key[0] == "view":
                            size = vmax[key[1]]
                        if key != chain_key:  # (that one is the chain gradient the kernels count ...)
                            keys[key] = max(keys.get(key, 0), size)
                        else:
                            if lo == 0 and g is not None and size > g[i]:  # (... as g[i]: 0 for a layer
                                # whose only output is this side tensor; the rest is counted here)
                                keys[("short", i)] = max(keys.get(("short", i), 0), size - int(g[i]))
                            if i > t.grad_split:  # (its next contribution, summed at or after layer i's
                                outlives = True     # backward, lets the view go within it)
                # ... but it then outlives the layer's backward, which its b assumed freed
                out[i] = sum(keys.values()) + (int(gh[i]) if gh is not None and outlives and lo == 0 else 0)
        splits = _release_splits(side)
        have = fpre is not None and fpost is not None
        fp = list(fpre) if have else [0] * n
        fq = list(fpost) if have else [0] * n
        arrays = dict(sa=sa, sg=sg, sp=sp, smax=smax, cptr=cptr, cu=cu, csv=csv, psv=psv, optr=optr, olist=olist,
                      bptr=bptr, blist=blist, bgrad=bgrad, rside=rside, **splits, fpre=fp, fpost=fq,
                      fkpre=list(fkpre) if have and fkpre is not None else fp,
                      fkpost=list(fkpost) if have and fkpost is not None else fq,
                      **_gain_arrays(side))
        out = {}
        for name, x in arrays.items():
            x = np.array(x, dtype=np.int64).reshape(-1)
            x.setflags(write=False)
            out[name] = x
        return cls(**out, frame_known=int(have))


def _release_splits(side: Sequence[SideTensor]) -> dict[str, list]:
    """The release splits per saver (CSR): as autograd keeps the tensor, as a recomputed copy goes, with the
    saver's input held by nothing else (each the first where the others are not known), and what is known."""
    out: dict[str, list] = dict(svptr=[0], svu=[], svpre=[], svpost=[], svpre_r=[], svpost_r=[], svpre_f=[],
                                svpost_f=[], split_known=[])
    for t in side:
        out["svu"].extend(t.saved_by)
        zero = [0] * len(t.saved_by)
        out["svpre"].extend(t.saved_pre or zero)
        out["svpost"].extend(t.saved_post or zero)
        out["svpre_r"].extend(t.saved_pre_rec or t.saved_pre or zero)
        out["svpost_r"].extend(t.saved_post_rec or t.saved_post or zero)
        out["svpre_f"].extend(t.saved_pre_free or t.saved_pre or zero)
        out["svpost_f"].extend(t.saved_post_free or t.saved_post or zero)
        out["split_known"].append(2 if t.saved_pre_rec else 1 if t.saved_pre else 0)
        out["svptr"].append(len(out["svu"]))
    return out


def _gain_arrays(side: Sequence[SideTensor]) -> dict[str, list]:
    """Per side tensor, its dying gains (``last_gain`` and kin) with the reader's input held, then dying
    too (each of the second as the first where not known)."""
    held = dict(sdie=[t.last_gain for t in side],
                sdief=[t.last_gain if t.last_gain_full is None else t.last_gain_full for t in side],
                sdiec=[t.last_gain_ckpt for t in side])
    free = {}
    for (name, h), key in zip(held.items(), ("last_gain_free", "last_gain_full_free", "last_gain_ckpt_free")):
        free[name + "_f"] = [h[j] if getattr(t, key) is None else getattr(t, key) for j, t in enumerate(side)]
    return {**held, **free}


_FREE_GAINS = ("last_gain_free", "last_gain_full_free", "last_gain_ckpt_free")


def _from_mapping(t: Mapping, where: str, k: int) -> SideTensor:
    """A side tensor from its dict (a cost file's form, :meth:`SideTensor.to_dict`)."""
    fields = SideTensor.__dataclass_fields__
    unknown = set(t) - set(fields)
    if unknown:
        raise InvalidCosts(f"{where} has unknown key(s) {', '.join(sorted(unknown))}", field="side", index=k)
    lacking = [key for key in ("bytes", "producer", "consumers") if key not in t]
    if lacking:
        raise InvalidCosts(f"{where} lacks {lacking[0]!r} (needs bytes, producer, consumers)", field="side", index=k)
    try:
        given = {key: tuple(v) if isinstance(fields[key].default, tuple) or key == "consumers" else v
                 for key, v in t.items()}
        if "name" in given:
            given["name"] = str(given["name"])
        if "grad_view" in given:
            given["grad_view"] = int(given["grad_view"])
        return SideTensor(**given)
    except TypeError as exc:
        raise InvalidCosts(f"{where}: {exc}", field="side", index=k) from None


def side_tensors(n: int, side: Any) -> tuple[SideTensor, ...]:
    """Validate the ``side`` argument (SideTensor objects or their dicts) for ``n`` layers."""
    if side is None:
        return ()
    if isinstance(side, (str, bytes, Mapping)):
        raise InvalidCosts("field 'side' must be a list of side tensors (SideTensor or dicts)", field="side")
    out = []
    for k, t in enumerate(side):
        where = f"side tensor {k}"
        if isinstance(t, Mapping):
            t = _from_mapping(t, where, k)
        if not isinstance(t, SideTensor):
            raise InvalidCosts(f"{where} is a {type(t).__name__}, not a SideTensor or a dict", field="side", index=k)
        size = _count(f"side[{k}].bytes", t.bytes)
        grad = None if t.grad is None else _count(f"side[{k}].grad", t.grad)
        prod = t.producer
        if isinstance(prod, bool) or not isinstance(prod, (int, np.integer)) or not -1 <= prod < n - 1:
            raise InvalidCosts(f"{where}: producer {prod!r} is not a layer in 0..{n - 2} (a side tensor is read by "
                               "a later layer), or -1 (computed before the first layer)", field="side", index=k)
        cons = tuple(t.consumers)
        if not cons or any(isinstance(u, bool) or not isinstance(u, (int, np.integer)) for u in cons):
            raise InvalidCosts(f"{where}: consumers must be a non-empty list of layer indices, got {cons!r}",
                               field="side", index=k)
        if list(cons) != sorted(set(cons)) or cons[0] <= prod or cons[-1] > n - 1:
            raise InvalidCosts(f"{where}: consumers {cons} must increase strictly, each in {prod + 1}..{n - 1} "
                               "(after the producer)", field="side", index=k)
        saved = tuple(sorted(set(int(u) for u in t.saved_by)))
        bad = [u for u in saved if u != prod and u not in set(cons)]
        if bad:
            raise InvalidCosts(f"{where}: saved_by {bad} are neither its producer nor a consumer", field="side",
                               index=k)
        view = t.grad_view
        if isinstance(view, bool) or not isinstance(view, (int, np.integer)) or not (view == -1 or 0 <= view < n):
            raise InvalidCosts(f"{where}: grad_view {view!r} is not -1 or a layer index", field="side", index=k)
        pre, post = tuple(int(x) for x in t.saved_pre), tuple(int(x) for x in t.saved_post)
        if (pre or post) and not (len(pre) == len(post) == len(t.saved_by)):
            raise InvalidCosts(f"{where}: saved_pre and saved_post need one entry per saved_by layer", field="side",
                               index=k)
        pre_r, post_r = tuple(int(x) for x in t.saved_pre_rec), tuple(int(x) for x in t.saved_post_rec)
        if (pre_r or post_r) and not (pre and len(pre_r) == len(post_r) == len(t.saved_by)):
            raise InvalidCosts(f"{where}: saved_pre_rec and saved_post_rec need saved_pre and one entry per "
                               "saved_by layer", field="side", index=k)
        pre_f, post_f = tuple(int(x) for x in t.saved_pre_free), tuple(int(x) for x in t.saved_post_free)
        if (pre_f or post_f) and not (pre and len(pre_f) == len(post_f) == len(t.saved_by)):
            raise InvalidCosts(f"{where}: saved_pre_free and saved_post_free need saved_pre and one entry per "
                               "saved_by layer", field="side", index=k)
        if pre:  # in the order of the sorted saved_by
            order = sorted(range(len(t.saved_by)), key=lambda q: int(t.saved_by[q]))
            pre, post = tuple(pre[q] for q in order), tuple(post[q] for q in order)
            if pre_r:
                pre_r, post_r = tuple(pre_r[q] for q in order), tuple(post_r[q] for q in order)
            if pre_f:
                pre_f, post_f = tuple(pre_f[q] for q in order), tuple(post_f[q] for q in order)
        gby = tuple(sorted(set(int(u) for u in t.grad_by)))
        if any(u not in set(cons) for u in gby):
            raise InvalidCosts(f"{where}: grad_by {gby} are not all consumers {cons}", field="side", index=k)
        gain, full = t.last_gain, t.last_gain_full
        frees = tuple(getattr(t, key) for key in _FREE_GAINS)
        for what, v in (("last_gain", gain), ("last_gain_full", full), ("last_gain_ckpt", t.last_gain_ckpt),
                        *zip(_FREE_GAINS, frees)):
            if v is None and what != "last_gain" and what != "last_gain_ckpt":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v > 0:
                raise InvalidCosts(f"{where}: {what} {v!r} is not an integer at most 0 (what its last consumer's "
                                   "forward peak changes by when it dies there)", field="side", index=k)
        out.append(SideTensor(
            bytes=size, producer=int(prod), consumers=tuple(int(u) for u in cons), saved_by=saved, grad=grad,
            name=t.name, grad_view=int(view), saved_pre=pre, saved_post=post,
            grad_by=gby if gby != tuple(int(u) for u in cons) else (), last_gain=int(gain),
            last_gain_full=None if full is None else int(full), saved_pre_rec=pre_r, saved_post_rec=post_r,
            last_gain_ckpt=int(t.last_gain_ckpt), saved_pre_free=pre_f, saved_post_free=post_f,
            **{key: None if v is None else int(v) for key, v in zip(_FREE_GAINS, frees)}))
    opened = [0] * (n + 1)
    for t in out:
        for b in range(t.producer + 1, t.consumers[-1] + 1):
            opened[b] += 1
    if max(opened) > MAX_OPEN:
        b = opened.index(max(opened))
        raise InvalidCosts(f"{max(opened)} side tensors cross the boundary before layer {b}; at most {MAX_OPEN} may "
                           "(the exact programs keep a state per subset of them)", field="side")
    return tuple(out)
