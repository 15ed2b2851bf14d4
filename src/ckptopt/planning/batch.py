"""The cost model as a function of the batch size, and the largest batch that fits."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..costs import ChainCosts
from ..plan import Plan
from ..simulator.allocator import replay
from ..solvers import solve
from ..torch_utils import Inputs, is_fake, normalize_inputs
from ..tracer import trace
from ..tracer.chain import trace_captured
from ..tracer.meta import unmaterialized
from ..units import parse_bytes
from .estimate import (is_sharded, batch_of, calibration_choice, check_keep_output, optimal_plan,
                       plan_recompute_share, sharded_leaves)
from .headroom import Headroom, check_calibrate, default_headroom, device_free_memory
from .reserved import replay_declined
from .optimizer import OptimizerMemory, optimizer_memory
from .parallel import Parallel, RankCosts, plus_static
from .ranks import rank_costs
from .param_facts import compute_view, held_inputs, param_facts

__all__ = ["with_batch", "BatchCosts", "BatchFit", "MaxBatch", "max_batch"]

_BATCH_CAP = 1 << 24


def with_batch(example_inputs: Any, batch: int, example_batch: int) -> Any:
    """The example inputs resized to ``batch`` along dimension 0 (rows repeated cyclically).

    Tensors whose first dimension is not the example batch are passed as they are.
    Returns :class:`~ckptopt.torch_utils.Inputs` for ``Inputs``, else the positional
    arguments as a tuple.
    """
    import torch

    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"a batch size is a positive integer, got {batch!r}")

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and t.shape[0] == example_batch:
            idx = torch.arange(batch, device=t.device) % example_batch
            if is_fake(t):  # (a meta model's batch, tracer/meta.py): the index joins its fake mode
                idx = t.fake_mode.from_tensor(idx)
            return t.detach()[idx].requires_grad_(t.requires_grad)
        return t

    out = normalize_inputs(example_inputs).map_tensors(resize)
    return out if isinstance(example_inputs, Inputs) else out.args


def _affine(c1: dict, c2: dict, b1: int, b2: int) -> tuple[dict, dict] | None:
    """(intercept, slope) of every integer field of two cost dicts, or None when not exactly affine."""
    l1, l2 = c1["layers"], c2["layers"]
    if l1.keys() != l2.keys() or c1.get("names") != c2.get("names"):
        return None
    icpt, slope = {"layers": {}}, {"layers": {}}
    for k in l1:
        if len(l1[k]) != len(l2[k]):
            return None
        if k in ("sin", "sout", "dead", "holds"):  # flags: equal at both sizes, taken as they are
            if l1[k] != l2[k]:
                return None
            continue
        icpt["layers"][k], slope["layers"][k] = [], []
        for v1, v2 in zip(l1[k], l2[k]):
            d = int(v2) - int(v1)
            if d % (b2 - b1):
                return None
            s = d // (b2 - b1)
            icpt["layers"][k].append(int(v1) - s * b1)
            slope["layers"][k].append(s)
    side = _affine_side(c1.get("side", []), c2.get("side", []), b1, b2)
    if side is None:
        return None
    icpt["side"], slope["side"] = side
    d = int(c2["static"]) - int(c1["static"])
    if d % (b2 - b1):
        return None
    slope["static"] = d // (b2 - b1)
    icpt["static"] = int(c1["static"]) - slope["static"] * b1
    for k in ("compute", "backward_compute"):  # compute per layer: affine when it can be, else as at b1
        if k in c1 and k in c2:
            diffs = [int(v2) - int(v1) for v1, v2 in zip(c1[k], c2[k])]
            if all(x % (b2 - b1) == 0 for x in diffs):
                slope[k] = [x // (b2 - b1) for x in diffs]
                icpt[k] = [int(v1) - s * b1 for v1, s in zip(c1[k], slope[k])]
            else:
                slope[k], icpt[k] = [0] * len(diffs), [int(v) for v in c1[k]]
    return icpt, slope


# the side-tensor fields that scale with the batch
_SIDE_SIZES = ("bytes", "grad", "saved_pre", "saved_post", "saved_pre_rec", "saved_post_rec", "saved_pre_free",
               "saved_post_free", "last_gain", "last_gain_full", "last_gain_ckpt",
               "last_gain_free", "last_gain_full_free", "last_gain_ckpt_free")


def _affine_side(s1: list, s2: list, b1: int, b2: int) -> tuple[list, list] | None:
    """(intercepts, slopes) of the side tensors' sizes, or None when their structure differs or a
    size is not exactly affine."""
    if len(s1) != len(s2):
        return None
    icpt, slope = [], []
    for t1, t2 in zip(s1, s2):
        if {k: v for k, v in t1.items() if k not in _SIDE_SIZES} != {k: v for k, v in t2.items() if k not in _SIDE_SIZES}:
            return None
        i, s = {}, {}
        for k in _SIDE_SIZES:
            if (k in t1) != (k in t2):
                return None
            if k not in t1:
                continue
            v1, v2 = (t1[k], t2[k]) if isinstance(t1[k], list) else ([t1[k]], [t2[k]])
            if len(v1) != len(v2) or any((int(y) - int(x)) % (b2 - b1) for x, y in zip(v1, v2)):
                return None
            s[k] = [(int(y) - int(x)) // (b2 - b1) for x, y in zip(v1, v2)]
            i[k] = [int(x) - q * b1 for x, q in zip(v1, s[k])]
        icpt.append(i)
        slope.append(s)
    return icpt, slope


class BatchCosts:
    """The cost model of a model at any batch size, from a few traces.

    Every integer field is fitted as an affine function of the batch size
    through two traced batch sizes (adjacent sizes, so the slopes are exact
    integers) and checked against a third trace. Fields need not be affine
    everywhere: a layer's backward transient can be a maximum of a
    parameter-sized and an activation-sized term, so small batch sizes follow
    another line than large ones (measured on ResNet-18 at 32x32). Callers
    therefore confirm an answer by tracing it and re-fit (:meth:`refit`) near it.

    Parameters
    ----------
    model : nn.Module
    example_inputs : tuple
        One batch; other batch sizes repeat its rows (:func:`with_batch`).
    loss_fn, leaf_modules, capture
        As for :func:`ckptopt.trace`. The model is captured once; a graph that runs
        at any batch size (``torch.fx``, or ``torch.export`` with dynamic shapes) is
        re-measured at the other sizes without a new capture.
    probe : tuple of three ints, default (4, 5, 16)
        The batch sizes traced to fit the affine model (first two) and to check it.

    Attributes
    ----------
    affine : bool
        Whether the check at the third probe passed.
    traces : int
        How many traces were run.
    refits : int
        How many times the fit was moved near an answer.
    """

    def __init__(self, model, example_inputs, loss_fn=None, leaf_modules=None, probe=(4, 5, 16), capture="auto",
                 parallel: Parallel | None = None):
        # a meta model is planned on fakes of its tensors on a real device (tracer/meta.py); under FSDP2's
        # mixed precision, a copy in the compute dtype (the given float inputs held besides their casts)
        given = normalize_inputs(example_inputs)
        seen, seen_inputs, held = compute_view(model, given, parallel)
        self._held = (lambda b: held_inputs(with_batch(given, b, batch_of(given)), parallel)) if held \
            else (lambda b: 0)
        self.model, self.inputs = unmaterialized(seen, seen_inputs)
        self.example_batch = batch_of(self.inputs)
        if self.example_batch is None:
            raise ValueError("the example inputs have no batch dimension (no tensor with a first dimension)")
        self.loss_fn, self.capture = loss_fn, capture
        self.leaf_modules = sharded_leaves(model, parallel, leaf_modules)
        self._captured = None
        self.traces = 0
        self.refits = 0
        self._traced: dict[int, Any] = {}
        self.parallel = parallel
        b1, b2, b3 = probe
        t1 = self.traced(b1)
        self.names = t1.costs.names
        self.param_bytes = t1.param_bytes
        self.facts = param_facts(model, t1 if is_sharded(parallel) else None, parallel=parallel)  # (the same layers at every batch)
        self.sizes = rank_costs(t1.costs, self.facts, self.param_bytes, parallel).sizes
        self._fit = None
        self._fit_at(b1, b2)
        self.affine = self._fit is not None and self.interpolated(b3) == self.traced(b3).costs

    def _fit_at(self, b1: int, b2: int) -> bool:
        fit = _affine(self.traced(b1).costs.to_dict(), self.traced(b2).costs.to_dict(), b1, b2)
        if fit is not None:
            self._fit, self._fit_batch = fit, b1
        return fit is not None

    def refit(self, batch: int) -> bool:
        """Fit the affine model through ``batch`` and ``batch + 1`` (traced); False if the layers differ."""
        self.refits += 1
        return self._fit_at(batch, batch + 1)

    def traced(self, batch: int):
        """The :class:`~ckptopt.TracedModel` at ``batch`` (cached)."""
        if batch not in self._traced:
            inputs = with_batch(self.inputs, batch, self.example_batch)
            try:
                if self._captured is not None:
                    tm = trace_captured(self.model, self._captured, inputs, self.loss_fn)
                else:
                    tm = trace(self.model, inputs, loss_fn=self.loss_fn, leaf_modules=self.leaf_modules,
                               capture=self.capture)
                    if tm.capture.front_end != "fx" and tm.capture.dynamic:
                        self._captured = tm.capture  # exporting again at each size would cost seconds
                self._traced[batch] = dataclasses.replace(tm, costs=plus_static(tm.costs, self._held(batch)))
            except Exception as exc:
                raise type(exc)(f"tracing the model at batch size {batch} failed: {exc}") from exc
            self.traces += 1
        return self._traced[batch]

    def first_traced(self):
        """The first :class:`~ckptopt.TracedModel` traced (the graph and its cuts are alike at every batch:
        what the rewriter needs to apply a plan at any batch)."""
        return self._traced[next(iter(self._traced))]

    def interpolated(self, batch: int) -> ChainCosts:
        """The affine model's costs at ``batch``."""
        icpt, slope = self._fit
        d = dict(format="ckptopt.ChainCosts", kind="full", static=icpt["static"] + slope["static"] * batch,
                 layers={})
        if self.names is not None:
            d["names"] = list(self.names)
        traced = self._traced[self._fit_batch].costs.to_dict()
        for k in ("compute", "backward_compute"):
            if k in icpt:
                d[k] = [max(0, i + s * batch) for i, s in zip(icpt[k], slope[k])]
        for k in ("compute_unit", "segment_cost"):  # (a segment's fixed cost does not grow with the batch)
            if k in traced:
                d[k] = traced[k]
        base = traced["layers"]
        for k, v in base.items():
            if k in ("sin", "sout", "dead", "holds"):  # flags: equal at both sizes, taken as they are
                d["layers"][k] = v
            else:
                d["layers"][k] = [max(0, i + s * batch) for i, s in zip(icpt["layers"][k], slope["layers"][k])]
        if "g" in d["layers"]:  # fitted apart from a, a gradient's storage may drop to 0 where a does not
            d["layers"]["g"] = [g if g > 0 or a == 0 else a for g, a in zip(d["layers"]["g"], d["layers"]["a"])]
        if traced.get("side"):
            d["side"] = []
            for t, i, s in zip(traced["side"], icpt["side"], slope["side"]):
                t = dict(t)
                for k in i:
                    # (sizes at least 0; the gains, what a forward peak loses, at most 0)
                    v = [min(0, a + b * batch) if k.startswith("last_gain") else max(0, a + b * batch)
                         for a, b in zip(i[k], s[k])]
                    t[k] = v if isinstance(t[k], list) else v[0]
                if t.get("grad"):  # a gradient's storage holds the gradient (fitted apart, they may cross)
                    t["grad"] = max(t["grad"], t["bytes"])
                d["side"].append(t)
        return ChainCosts.from_dict(d)

    def costs(self, batch: int, trace: bool = False) -> ChainCosts:
        """The cost model at ``batch``: traced when cached or ``trace`` (or no fit exists), else interpolated."""
        if batch in self._traced or trace or self._fit is None:
            return self.traced(batch).costs
        return self.interpolated(batch)

    def for_parallel(self, parallel: Parallel | None) -> "BatchCosts":
        """The same traces and fit for another world size or strategy (``parallel`` must shard the same
        blocks: an FSDP2 one needs this object built for FSDP2, which records the blocks)."""
        if is_sharded(parallel) and not self.facts.units:
            raise ValueError("for_parallel: these costs were built without FSDP2's blocks; build them with "
                             "parallel=Parallel(world_size, 'fsdp')")
        if getattr(parallel, "mixed_precision", None) != getattr(self.parallel, "mixed_precision", None):
            raise ValueError("for_parallel: these costs were traced for another compute dtype; build them with "
                             f"parallel=Parallel(..., mixed_precision={getattr(parallel, 'mixed_precision', None)!r})")
        other = copy.copy(self)
        other.parallel = parallel
        other.sizes = rank_costs(self.first_traced().costs, self.facts, self.param_bytes, parallel).sizes
        return other

    def rank(self, batch: int, trace: bool = False, costs: ChainCosts | None = None) -> RankCosts:
        """One rank's step at local batch ``batch`` (:meth:`costs`, or ``costs`` given)."""
        return rank_costs(self.costs(batch, trace) if costs is None else costs, self.facts, self.param_bytes,
                          self.parallel)


@dataclass(frozen=True)
class BatchFit:
    """The largest batch that fits under one strategy.

    ``batch`` is 0 when not even batch 1 fits; ``peak_bytes`` is its predicted
    peak, ``next_peak_bytes`` that of ``batch + 1`` (over the memory), both
    confirmed by a trace when ``verified``; ``checkpoints`` and ``stored`` are the
    plan at ``batch`` (:class:`ckptopt.Plan`'s fields). ``calibrated``: the peaks
    include what the device takes beyond the tensors, measured at these batch sizes
    (:mod:`ckptopt.calibration`).
    """

    strategy: str
    batch: int
    peak_bytes: int | None
    next_peak_bytes: int | None
    checkpoints: tuple[int, ...]
    recompute_share: float
    verified: bool
    stored: tuple[int, ...] = ()
    calibrated: bool = False
    #: the allocator replay's reserved peak at ``batch`` (:mod:`ckptopt.planning.reserved`) where the
    #: answer is the replay's, and at ``batch + 1`` without a limit (None where the predicted peak
    #: alone rules that batch out)
    reserved_bytes: int | None = None
    next_reserved_bytes: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checkpoints"] = list(self.checkpoints)
        d["stored"] = list(self.stored)
        return d


@dataclass(frozen=True)
class MaxBatch:
    """What :func:`max_batch` returns."""

    memory_bytes: int
    optimizer: OptimizerMemory
    no_checkpointing: BatchFit
    optimal: BatchFit
    affine: bool
    traces: int
    headroom: Headroom = Headroom()
    usable_bytes: int = 0
    usable_checkpointed_bytes: int | None = None  # (the optimal plan's, where the headroom differs)
    #: how the answers were fitted to the memory: "replay" (the caching allocator replayed over the
    #: step's allocations: the reserved peak fits) or "headroom" (the predicted peak fits below the
    #: headroom kept), and why the replay did not apply where it did not
    fitted_by: str = "headroom"
    replay_note: str | None = None

    def fitting_lines(self, device: str) -> list[str]:
        """How the answers were fitted to the memory, for a person (the CLI's lines)."""
        from ..units import format_bytes

        if self.fitted_by == "replay":
            return ["fitted by replaying PyTorch's caching allocator over the first two training steps' "
                    "allocations (reserved bytes, not a headroom share): each answer's steps reserve at most "
                    f"{format_bytes(self.memory_bytes)}, and one more sample does not fit"]
        within = format_bytes(self.usable_bytes)
        if self.usable_checkpointed_bytes not in (None, self.usable_bytes):
            within += f" ({format_bytes(self.usable_checkpointed_bytes)} with checkpoints)"
        lines = [f"{self.headroom.describe()}: the peaks above stay within {within}"]
        if str(device).startswith("cuda"):
            from .headroom import EXPANDABLE_HINT, expandable_segments

            if self.replay_note:
                lines.append(f"(a headroom share, not the allocator replay: {self.replay_note})")
            if not expandable_segments():
                lines.append(EXPANDABLE_HINT)
        return lines

    def to_dict(self) -> dict:
        return dict(memory_bytes=self.memory_bytes, usable_bytes=self.usable_bytes, fitted_by=self.fitted_by,
                    replay_note=self.replay_note,
                    usable_checkpointed_bytes=self.usable_checkpointed_bytes, headroom=self.headroom.to_dict(),
                    optimizer=asdict(self.optimizer), affine=self.affine, traces=self.traces,
                    no_checkpointing=self.no_checkpointing.to_dict(), optimal=self.optimal.to_dict())


def peak_and_plan(rank: RankCosts, strategy: str, opt: OptimizerMemory, accumulate: bool = False,
                  final: bool = False) -> tuple[int, Plan]:
    """Predicted step peak of the rank and its plan; ``accumulate``: a micro-batch after the first.

    During a search only the optimal peak matters (the ``auto`` policy); ``final``
    picks the least-recompute plan among those reaching it (:func:`optimal_plan`).
    """
    fb_costs = rank.solver_costs(accumulate)
    if strategy == "none":
        plan = solve(fb_costs, "none")
    elif final or rank.fsdp is not None:
        plan = optimal_plan(rank, opt, accumulate)
    else:
        plan = solve(fb_costs, "auto")
    fb = plan.peak_bytes if rank.fsdp is None else rank.fb_peak(plan.checkpoints, plan.stored, accumulate).bytes
    return max(fb + opt.state_bytes, rank.step_peak(opt)), plan


def largest_fitting(fits: Callable[[int], bool], cap: int = _BATCH_CAP) -> int:
    """The largest b in 1..cap with fits(b), for a monotone predicate (0 if none). O(log b) calls."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        return lo if not fits(cap) else cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def search_batch(bc: BatchCosts, strategy: str, memory: int, opt: OptimizerMemory, accumulate: bool = False,
            cap: int = _BATCH_CAP, rounds: int = 4) -> BatchFit:
    """Largest batch (<= cap) whose predicted peak fits, confirmed by tracing it and the next size.

    Searched on interpolated costs; when the traces at the answer disagree,
    the fit is moved through the answer and the search repeated (``rounds``
    times at most), then every candidate is traced.
    """
    def peak(b: int, trace: bool = False) -> int:
        return peak_and_plan(bc.rank(b, trace), strategy, opt, accumulate)[0]

    def confirmed(b: int) -> bool:
        ok = b == 0 or peak(b, trace=True) <= memory
        return ok and (b >= cap or peak(b + 1, trace=True) > memory)

    best, verified = 0, False
    for _ in range(rounds):
        best = largest_fitting(lambda b: peak(b) <= memory, cap)
        if confirmed(best):
            verified = True
            break
        if not bc.refit(max(best, 1)):
            break
    if not verified:  # trace every candidate
        best = largest_fitting(lambda b: peak(b, trace=True) <= memory, cap)
        verified = True
    if not best:
        return BatchFit(strategy, 0, None, peak(1, trace=True), (), 0.0, verified)
    rank = bc.rank(best, trace=True)
    p, plan = peak_and_plan(rank, strategy, opt, accumulate, final=True)
    share = plan_recompute_share(rank.solver_costs(accumulate), plan.checkpoints, plan.stored)[1]
    nxt = peak(best + 1, trace=True) if best < cap else None
    return BatchFit(strategy, best, p, nxt, plan.checkpoints, share, verified, plan.stored)


def optimizer_for(bc: BatchCosts, optimizer: str, impl: str | None, device: str | None) -> OptimizerMemory:
    dev = device or str(next(bc.model.parameters()).device)
    return optimizer_memory(bc.sizes, optimizer, impl, dev)


def max_batch(model, example_inputs, memory=None, optimizer: str = "adam", impl: str | None = None,
              device: str | None = None, loss_fn=None, leaf_modules=None, capture="auto",
              headroom: Headroom | None = None, calibrate: bool | None = None,
              parallel: Parallel | None = None, keep_output: bool = False) -> MaxBatch:
    """The largest batch whose training step fits in ``memory``, without and with the optimal plan.

    Parameters
    ----------
    model : nn.Module
    example_inputs : Tensor or tuple
        One batch of any size; other sizes repeat its rows along dimension 0.
    memory : int or str, optional
        Bytes, or a size such as ``"8GiB"``, ``"8GB"``, ``"512MiB"``. Default: what the
        device has free (:func:`device_free_memory`).
    optimizer, impl, device, loss_fn, leaf_modules, capture
        As for :func:`estimate`.
    headroom : Headroom, optional
        Kept free below ``memory`` for the caching allocator and library workspaces;
        default :func:`default_headroom` of the device (none on the CPU). The batch
        reported peaks at most ``headroom.usable(memory)`` (``headroom.usable(memory,
        checkpointed=True)`` for the optimal plan).
    calibrate : bool, optional
        Confirm each answer on the device (see Notes). Default: on CUDA.
    parallel : Parallel, optional
        One rank of a DDP or FSDP2 run: the batch is the rank's local batch (see :func:`estimate`).
    keep_output : bool, default False
        The loop keeps the model's output through the step (see :func:`estimate`): each answer
        is then lowered until a fake kept-output step at its batch fits too.

    Returns
    -------
    MaxBatch

    Notes
    -----
    The cost model is traced at batch 4 and 5 and checked at 16; when every
    field is affine in the batch size, candidates are scored on interpolated
    costs (no tracing), otherwise each candidate is traced. The peak grows
    with the batch, so the largest fitting batch is found by doubling and
    bisection: O(log b) simulations (and solves of the ``auto`` policy for the optimal plan).
    The answer ``b`` and ``b + 1`` are traced to confirm the interpolation.
    Calibrated (the default on CUDA), each answer is then run layer by layer on the
    device at its batch size (:func:`ckptopt.calibration.calibrate`) and lowered
    until the measured scratch and workspace fit too (a few calibrations).

    On CUDA, unless a ``headroom`` is given, the answers are instead fitted by replaying the caching
    allocator over the first two training steps' allocations (:func:`replayed_fit`,
    :mod:`ckptopt.planning.reserved`; ``fitted_by="replay"``): no share is kept and nothing is
    calibrated. Where the replay cannot know the step's allocations (convolutions, an allocator
    setting it does not model, a rank of a parallel run, ``keep_output``) the above applies and
    ``replay_note`` says why.
    """
    bc = BatchCosts(model, example_inputs, loss_fn, leaf_modules, capture=capture, parallel=parallel)
    opt = optimizer_for(bc, optimizer, impl, device)
    model_dev = str(next(bc.model.parameters()).device)
    dev = device or model_dev
    calibrated = calibration_choice(calibrate, dev, model_dev, parallel)
    check_calibrate(calibrated, dev, str(next(model.parameters()).device))  # (meta: refused)
    why_not = replay_declined(dev, headroom, parallel, keep_output)
    if why_not is None:
        mem = parse_bytes(memory) if memory is not None else device_free_memory(dev)
        try:
            none, best = replayed_fit(bc, "none", mem, opt), replayed_fit(bc, "optimal", mem, opt)
            return MaxBatch(mem, opt, none, best, bc.affine, bc.traces,
                            Headroom(0, 0.0, "none: the caching allocator's replay fits each answer"), mem, mem,
                            "replay")
        except ReplayDeclined as exc:
            why_not = str(exc)
    mem, hr, usable = memory_and_headroom(bc, memory, device, headroom)
    usable_ckpt = hr.usable(mem, checkpointed=True)
    none = search_batch(bc, "none", usable, opt)
    best = search_batch(bc, "optimal", usable_ckpt, opt)
    if calibrated or keep_output:
        if keep_output:
            check_keep_output(parallel)
        # (calibrated: the workspace is measured into the costs: keep only the allocator's share)
        kept = hr.without_workspace() if calibrated else hr
        none = lowered_fit(bc, none, kept.usable(mem), opt, calibrated, keep_output)
        best = lowered_fit(bc, best, kept.usable(mem, checkpointed=True), opt, calibrated, keep_output)
    return MaxBatch(mem, opt, none, best, bc.affine, bc.traces, hr, usable, usable_ckpt, "headroom", why_not)


class ReplayDeclined(Exception):
    """The allocator replay cannot answer for this step (the message says why)."""


def replayed_fit(bc: BatchCosts, strategy: str, memory: int, opt: OptimizerMemory) -> BatchFit:
    """The largest batch whose first two training steps (the second on the cache the first leaves) the
    caching allocator's replay serves within ``memory`` (:mod:`ckptopt.planning.reserved`), with the
    ``strategy``'s plan at each batch.

    No batch whose predicted peak passes ``memory`` fits (the allocator reserves at least what is
    allocated), so the search starts at the largest that does; each next guess is where a secant
    through the replayed reserved bytes (without a limit) at the two bounds meets ``memory``, the batch
    next to a bound where it falls on one. The answer fits and one more sample does not.

    Raises :class:`ReplayDeclined` when the step makes allocations the replay cannot know."""
    from ..rewriter import apply_plan
    from .reserved import allocator_settings, step_events

    expandable, rules, _ = allocator_settings()
    seen: dict[int, tuple[bool, int, int]] = {}  # batch -> (fits, reserved peak under memory, without a limit)
    graph = bc.first_traced()

    peaks: dict[int, int] = {}

    def peak(b: int) -> int:  # (interpolated where the costs are affine: no trace)
        if b not in peaks:
            peaks[b] = peak_and_plan(bc.rank(b), strategy, opt)[0]
        return peaks[b]

    def replayed(b: int) -> tuple[bool, int, int]:
        if b not in seen:
            plan = peak_and_plan(bc.rank(b), strategy, opt, final=True)[1]
            build = None if strategy == "none" else (lambda fm: apply_plan(fm, graph, plan))
            x = with_batch(bc.inputs, b, bc.example_batch)
            try:
                steps = step_events(bc.model, x, bc.loss_fn, build, opt.name, opt.impl)
            except Exception as exc:  # noqa: BLE001 - the share answers instead, and the answer says why
                raise ReplayDeclined(f"the step did not run on fake tensors ({type(exc).__name__}: "
                                     f"{str(exc)[:200]})") from exc
            if steps.unsupported:
                raise ReplayDeclined(steps.unsupported)
            capped = replay(steps.events, memory, rules, expandable)
            free = replay(steps.events, None, rules, expandable)  # (under the limit, released caches hide it)
            seen[b] = (capped.fits, capped.max_reserved, free.max_reserved)
        return seen[b]

    ceiling = search_batch(bc, strategy, memory, opt).batch
    lo, hi = 0, ceiling + 1  # fits(lo) (0 trivially); not fits(hi)
    b = ceiling
    while hi - lo > 1:
        fits, _, reserved = replayed(b)
        if fits:
            lo = b
        else:
            hi = b
        if hi - lo <= 1:
            break
        # the next guess: where the reserved bytes, about affine in the batch between the bounds, meet the
        # memory (a secant through the two bounds' replays); from a first bound that does not fit, the batch
        # whose predicted peak plus what the allocator added there meets it
        if lo in seen and hi in seen:
            (_, _, r_lo), (_, _, r_hi) = seen[lo], seen[hi]
            guess = lo + (memory - r_lo) * (hi - lo) // max(r_hi - r_lo, 1)
        elif not fits and b > 1:  # (the peak about affine in the batch: its slope from b and 1)
            slope = max((peak(b) - peak(1)) / (b - 1), 1.0)
            guess = 1 + int((memory - (reserved - peak(b)) - peak(1)) // slope)
        else:
            guess = hi - 1
        b = min(max(guess, lo + 1), hi - 1)  # (a guess on a bound: the batch next to it)
    nxt_reserved = seen[hi][2] if hi in seen else None
    if lo == 0:
        return BatchFit(strategy, 0, None, peak_and_plan(bc.rank(1, trace=True), strategy, opt)[0], (), 0.0, True,
                        next_reserved_bytes=nxt_reserved)
    rank = bc.rank(lo, trace=True)
    p, plan = peak_and_plan(rank, strategy, opt, final=True)
    if strategy != "none" and plan != peak_and_plan(bc.rank(lo), strategy, opt, final=True)[1]:
        seen.pop(lo, None)  # (the traced costs chose another plan than the interpolated ones: replay it)
        if not replayed(lo)[0]:
            raise ReplayDeclined("the traced and the interpolated costs chose different plans, and the traced "
                                 "one's replay does not fit")
    share = plan_recompute_share(rank.solver_costs(), plan.checkpoints, plan.stored)[1]
    nxt = peak_and_plan(bc.rank(lo + 1, trace=True), strategy, opt)[0]
    return BatchFit(strategy, lo, p, nxt, plan.checkpoints, share, True, plan.stored,
                    reserved_bytes=seen[lo][1], next_reserved_bytes=nxt_reserved)


def lowered_fit(bc: BatchCosts, fit: BatchFit, usable: int, opt: OptimizerMemory, calibrated: bool,
                keep_output: bool) -> BatchFit:
    """``fit`` lowered until its peak is at most ``usable`` with what the interpolated costs leave
    out, measured at each batch tried: the device's scratch and workspace (``calibrated``, each
    batch calibrated) and what a loop that keeps the model's output adds (``keep_output``, a
    fake kept-output step). The largest such batch up to ``fit.batch``."""
    from ..calibration import calibrate
    from .estimate import kept_output_extra, peak_estimate

    if fit.batch == 0:
        return fit
    seen: dict[int, tuple[int, Plan, ChainCosts]] = {}

    def peak(b: int) -> int:
        if b not in seen:
            tm = bc.traced(b)
            x = with_batch(bc.inputs, b, bc.example_batch)
            costs = calibrate(bc.model, tm, x).apply(tm.costs) if calibrated else tm.costs
            rank = bc.rank(b, costs=costs)
            p, plan = peak_and_plan(rank, fit.strategy, opt, final=True)
            if keep_output:
                kept = kept_output_extra(bc.model, x, bc.loss_fn, tm, [plan])[0]
                p = peak_estimate(rank, plan, opt, "", kept).peak_bytes
            seen[b] = (p, plan, rank.costs)
        return seen[b][0]

    lo, hi = 0, fit.batch + 1  # fits(lo) (0 trivially); not fits(hi): the traced peak is over already
    b = fit.batch
    while b > lo:  # step down in proportion to the overshoot, then bisect
        if peak(b) <= usable:
            lo = b
            break
        hi = b
        b = min(b - 1, b * usable // peak(b))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= usable else (lo, mid)
    if lo == 0:
        return BatchFit(fit.strategy, 0, None, peak(1), (), 0.0, True, calibrated=calibrated)
    p, plan, costs = seen[lo]
    share = plan_recompute_share(costs, plan.checkpoints, plan.stored)[1]
    nxt = seen[hi][0] if hi in seen else fit.next_peak_bytes
    return BatchFit(fit.strategy, lo, p, nxt, plan.checkpoints, share, True, plan.stored, calibrated=calibrated)


def memory_and_headroom(bc: BatchCosts, memory, device: str | None,
                        headroom: Headroom | None) -> tuple[int, Headroom, int]:
    """``(memory, headroom, usable)``: the limit (the device's free memory when not given), the
    headroom kept below it, and the largest predicted peak that leaves it free."""
    dev = device or str(next(bc.model.parameters()).device)
    mem = parse_bytes(memory) if memory is not None else device_free_memory(dev)
    hr = headroom or default_headroom(dev)
    usable = hr.usable(mem)
    if usable <= 0:
        raise ValueError(f"{mem} bytes leave nothing after the headroom ({hr.describe()})")
    return mem, hr, usable
