"""Regression cases of the cost model: random models (``tests/common/fuzz.py``) it once got wrong.

Each :class:`Case` states the rule the model must get right, the random model that tests it, what
must hold of its trace (:class:`Fact`), and the plans whose measured peaks must match their
predictions (a check of ``tests/common/exactness.py``). ``tests/test_fuzz.py::test_regression``
runs every case; ``git log --grep '<case id>'`` finds the story of how each was found.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from ckptopt import ChainCosts, simulate, solve

from .exactness import (
    assert_exact,
    assert_exact_by_phase,
    assert_within_loss,
    assert_within_loss_and_a_count,
    assert_within_loss_fake,
)
from .fuzz import Node, Spec

__all__ = ["Case", "Fact", "Traced", "CASES", "case", "plans_of", "every_layer", "dp2_optimum", "each_single_cut"]


class Traced(NamedTuple):
    """A case's model, its example input and its trace."""

    model: torch.nn.Module
    x: torch.Tensor
    tm: Any  # ckptopt.tracer.TracedModel

    @property
    def c(self):
        """The chain cost model (``tm.costs``)."""
        return self.tm.costs


@dataclass(frozen=True)
class Fact:
    """A property of a case's trace that the case relies on; the case fails where it does not hold."""

    says: str
    holds: Callable[[Traced], bool]


@dataclass(frozen=True)
class Case:
    """One regression case: a random model, what must hold of its trace, and the plans to measure."""

    id: str  # the test id
    rule: str  # what the cost model must get right on this model
    spec: Spec  # the model
    seed: int = 0  # parameters and input drawn from it (exactness.traced)
    max_crossing: int | None = None  # trace's option (1: single-tensor cuts); None: trace's default cuts
    facts: tuple[Fact, ...] = ()  # must hold of the trace
    plans: tuple = ()  # plans to measure: segment starts, (starts, stored starts), or a function of the trace
    check: Callable | None = None  # how their measured peaks meet the predictions (tests/common/exactness.py)
    fuzz: bool = False  # also every check of the fuzzing (test_fuzz.check_random_model, on build's seed 0)
    fuzz_max_crossing: int | None = None  # trace's option for that

    def __post_init__(self):
        assert bool(self.plans) == (self.check is not None), f"{self.id}: plans and a check go together"
        assert self.facts or self.plans or self.fuzz, f"{self.id}: checks nothing"

    def trace_kw(self) -> dict:
        return {} if self.max_crossing is None else {"max_crossing": self.max_crossing}


def every_layer(tm) -> list:
    """Each layer a segment of its own."""
    return [tuple(range(1, tm.n))]


def dp2_optimum(tm) -> list:
    """The plan of the ``dp2`` solver."""
    return [solve(tm.costs, "dp2").checkpoints]


def each_single_cut(tm) -> list:
    """Every plan with one cut."""
    return [(cut,) for cut in range(1, tm.n)]


def plans_of(case: Case, tm) -> list:
    """The case's plans, those given as a function of the trace worked out."""
    return [q for p in case.plans for q in (p(tm) if callable(p) else [p])]


def only(items):
    """The one item of ``items`` (fails unless there is exactly one)."""
    (item,) = items
    return item


def _held_throughout(c: ChainCosts) -> ChainCosts:
    """``c`` with the first layer of every segment holding its input through its whole backward (bf = bk = b)."""
    d = c.to_dict()
    d["layers"]["bf"] = d["layers"]["bk"] = list(d["layers"]["b"])
    return ChainCosts.from_dict(d)


def _no_layer_hands_on_its_input(t: Traced) -> bool:
    return all(layer.output_node != layer.input_node for layer in t.tm.layers)


# Models several cases share.
_TRAILING_LAYERS_SAVE_NOTHING = Spec(
    family="conv", dtype="float32", batch=2, shape=(1, 4, 4), classes=1, input_requires_grad=True,
    nodes=(Node("avgpool", (0,)), Node("dropout", (1,)), Node("dropout", (2,)), Node("bn", (3,), inplace="relu_"),
           Node("dropout", (4,)), Node("dropout", (5,)), Node("bn", (6,), inplace="relu_"), Node("dropout", (7,)),
           Node("dropout", (4,)), Node("gn", (9,)), Node("bn", (4,), inplace="mul_"), Node("cat", (11, 6))))
_TWO_SIDES_MULTIPLIED = Spec(family="conv", dtype="float32", batch=4, shape=(4, 4, 4), input_requires_grad=True,
    nodes=(Node("up", (0,)), Node("gelu", (1,)), Node("conv1", (2,), width=6), Node("dropout", (3,)),
           Node("mul", (3, 4)), Node("add", (5, 4)), Node("avgpool", (6,))))
_CONCATENATED_LINEARS = Spec(family="mlp", dtype="bfloat16", batch=2, shape=(11,), classes=4, nodes=(
    Node("linear", (0,), width=18, inplace="relu_"), Node("cat", (1, 0)), Node("linear", (2,), width=19),
    Node("cat", (3, 2)), Node("relu", (4,)), Node("gelu", (5,))))
_SIDE_INPUT_DYING_IN_A_GROUPNORM = Spec(family="conv", dtype="float64", batch=4, shape=(2, 4, 4), classes=4,
    input_requires_grad=True, nodes=(
        Node("dropout", (0,)), Node("conv3", (1,), width=2), Node("relu", (1,)), Node("cat", (3, 1)),
        Node("cat", (1, 2), inplace="relu_module"), Node("relu", (5,)), Node("gn", (5,)),
        Node("relu_module_plain", (7,)), Node("up", (6,))))
_GRADIENT_IS_A_SLICE = Spec(family="conv", dtype="float32", batch=3, shape=(2, 8, 8), classes=1, nodes=(
    Node("conv3", (0,), width=1, inplace="relu_"), Node("cat", (0, 1))))
# (also the model of test_fuzz.py's test that a trace leaves no fake tensor alive)
OUTPUT_GRADIENT_OUTLIVES_THE_BACKWARD = Spec(family="conv", dtype="float32", batch=4, shape=(6, 4, 4), classes=1,
    kind="skip", nodes=(
        Node("bn", (0,)), Node("dropout", (1,)), Node("bn", (2,)), Node("cat", (3, 1)),
        Node("conv1", (4,), width=6), Node("add", (2, 5)), Node("dropout", (6,))))


CASES: tuple[Case, ...] = (
    # ---- the rewriter and the measurement ------------------------------------------------------
    Case(
        id="last-segment-input-freed",
        rule="The input of the last, unwrapped segment is freed at its last use in that segment's forward: "
             "the rewriter keeps no reference to it (the caller's argument tuple).",
        spec=Spec(family="conv", dtype="float32", batch=6, shape=(2, 4, 4), classes=1, nodes=(
            Node("dropout", (0,)), Node("bn", (1,), inplace="relu_"), Node("avgpool", (2,)),
            Node("conv3", (3,), width=6), Node("relu", (4,)), Node("relu", (5,)), Node("dropout", (6,)),
            Node("dropout", (7,)), Node("dropout", (8,)))),
        max_crossing=1, plans=(each_single_cut,), check=assert_within_loss_fake, fuzz=True,
    ),
    Case(
        id="batchnorm-product-real-step",
        rule="A BatchNorm multiplied by the model input peaks where predicted on a real step (a fake-tensor "
             "step over-counts this model, so the fuzzing measures real steps).",
        spec=Spec(family="mlp", dtype="float32", batch=2, shape=(4,), classes=1, nodes=(
            Node("dropout", (0,)), Node("bn", (1,)), Node("mul", (2, 0)))),
        max_crossing=1, plans=((), (1,), (2,), (1, 2)), check=assert_within_loss_and_a_count, fuzz=True,
    ),
    Case(
        id="recomputed-batchnorm",
        rule="Recomputing a checkpointed BatchNorm allocates nothing beyond the model (the extra step count "
             "is undone in place) and leaves the running statistics right.",
        spec=Spec(family="mlp", dtype="float32", batch=4, shape=(24,), nodes=(Node("bn", (0,)), Node("mul", (1, 0)))),
        seed=127382995, max_crossing=1,
        facts=(Fact("plan (1,) peaks in the BatchNorm's recomputation",
                    lambda t: simulate(t.c, (1,)).phase == "recompute"),),
        plans=((1,), (1, 2)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="checkpoint-call-holds-its-input",
        rule="checkpoint(fn, *inputs) holds its arguments until it returns: a checkpointed segment's input is "
             "live through the segment's whole forward, even where the segment saves nothing.",
        spec=Spec(family="conv", dtype="float32", batch=6, shape=(1, 8, 8), classes=1, nodes=(
            Node("conv3", (0,), width=1), Node("cat", (1, 1)))),
        max_crossing=1,
        facts=(Fact("plan (1, 3) peaks in layer 2's forward (segment [1, 2] saves nothing)",
                    lambda t: ((sim := simulate(t.c, (1, 3))).phase, sim.layer) == ("forward", 2)),),
        plans=((1, 3), (1, 3, 4), (), (1,), (2,), (1, 2, 3, 4)), check=assert_within_loss, fuzz=True,
    ),
    # ---- dead ops ------------------------------------------------------------------------------
    Case(
        id="dead-op-in-checkpointed-segment",
        rule="A dead op (its output unused) ahead of the op that saves a layer's input runs in the recomputation "
             "before that input is packed: a layer that ends a recomputation runs up to fs.",
        spec=Spec(family="conv", dtype="float32", batch=2, shape=(6, 4, 4), classes=1, nodes=(
            Node("dropout", (0,)), Node("conv3", (0,), width=1), Node("dropout", (2,)), Node("dropout", (3,)),
            Node("dropout", (4,)), Node("dropout", (5,)), Node("dropout", (6,)), Node("dropout", (7,)),
            Node("dropout", (8,)), Node("dropout", (9,)))),
        fuzz=True,
    ),
    Case(
        id="dead-branch",
        rule="A dead branch's saved tensors die with its output: the layer measurement keeps detached tensors "
             "and counts only what autograd still holds after the forward.",
        spec=Spec(family="mlp", dtype="float32", batch=4, shape=(23,), classes=1, input_requires_grad=True, nodes=(
            Node("dropout", (0,)), Node("bn", (0,), inplace="relu_"), Node("dropout", (2,)),
            Node("mul", (3, 0), inplace="relu_"), Node("dropout", (4,)), Node("dropout", (5,)),
            Node("linear", (6,), width=3, inplace="relu_"), Node("dropout", (7,)), Node("dropout", (8,)),
            Node("dropout", (9,)), Node("bn", (10,), inplace="relu_"), Node("bn", (11,), inplace="relu_"),
            Node("dropout", (0,)), Node("linear", (13,), width=23))),
        fuzz=True,
    ),
    Case(
        id="dead-branch-recomputed",
        rule="Non-reentrant checkpoint re-runs a dead branch at the end of a segment and counts its saves: "
             "the recomputation runs to the segment's last pack, kept or not (fs).",
        spec=Spec(family="conv", dtype="float32", batch=2, shape=(1, 4, 4), classes=1, input_requires_grad=True,
                  nodes=(Node("dropout", (0,)), Node("up", (1,)), Node("dropout", (2,)), Node("dropout", (3,)),
                         Node("dropout", (4,)), Node("dropout", (5,)), Node("dropout", (0,)), Node("dropout", (7,)),
                         Node("dropout", (8,)), Node("dropout", (6,)), Node("dropout", (10,)),
                         Node("dropout", (11,)))),
        max_crossing=1, plans=((), (1,), (2,), (1, 3)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="dead-only-layer",
        rule="A recomputation that reaches a layer of dead ops re-runs them; dead ops join the next layer that "
             "computes something, so no layer hands on its input as its output.",
        spec=Spec(family="mlp", dtype="float32", batch=2, shape=(4,), classes=1, input_requires_grad=True, nodes=(
            Node("bn", (0,), inplace="relu_"), Node("dropout", (1,)), Node("dropout", (2,)), Node("dropout", (1,)),
            Node("dropout", (4,)), Node("dropout", (5,)))),
        max_crossing=1,
        facts=(Fact("layer 1, three Dropouts, is marked dead",
                    lambda t: t.c.dead[1] and t.tm.layers[1].ops == ("Dropout",) * 3),
               Fact("no layer's output is its input", _no_layer_hands_on_its_input)),
        plans=((2,), (2, 4), (2, 3, 4), (1, 2, 3)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="dead-ops-beside-a-passed-tensor",
        rule="Dead ops beside a tensor passed on unchanged join the next layer that computes something: a layer "
             "of their own would hand on its input as its output, counted twice.",
        spec=Spec(family="conv", dtype="float64", batch=4, shape=(6, 4, 4), classes=2, nodes=(
            Node("dropout", (0,)), Node("bn", (1,)), Node("maxpool", (2,)), Node("relu", (3,)), Node("up", (2,)))),
        seed=909214773, max_crossing=1,
        facts=(Fact("no layer's output is its input", _no_layer_hands_on_its_input),),
        plans=((), (1,), (2,), (1, 3), (1, 3, 4)), check=assert_exact_by_phase,
    ),
    Case(
        id="layer-hands-on-a-view-of-the-input",
        rule="A layer that hands on only views of storages made before it (the model input, unsqueezed) joins "
             "the next layer: the static bytes count that storage already.",
        spec=Spec(family="mlp", dtype="float32", batch=2, shape=(20,), classes=2, input_requires_grad=True, nodes=(
            Node("gelu", (0,)), Node("add", (1, 0)), Node("bn", (2,)), Node("relu", (3,)),
            Node("relu_module_plain", (4,)), Node("relu_module_plain", (5,)), Node("pool1d", (0,)))),
        seed=310200523,
        facts=(Fact("no layer ends at the unsqueeze",
                    lambda t: not any(layer.output_node.startswith("unsqueeze") for layer in t.tm.layers)),),
        plans=((), (1,), (1, 2)), check=assert_exact_by_phase,
    ),
    Case(
        id="output-is-the-model-input",
        rule="A layer whose chain output is static memory (the model input itself) has a = 0, and the next "
             "layer's input, which nothing frees, is held in every one of its figures.",
        spec=Spec(family="mlp", dtype="bfloat16", batch=2, shape=(24,), input_requires_grad=True, nodes=(
            Node("pool1d", (0,)), Node("cat", (0, 1)), Node("pool1d", (2,)), Node("tanh", (1,)),
            Node("pool1d", (4,)), Node("pool1d", (0,)), Node("mul", (1, 6)), Node("bn", (7,), inplace="dropout_"),
            Node("cat", (8, 3)), Node("sigmoid", (9,)))),
        seed=242778781,
        facts=(Fact("layer 0's output is static and a[0] == 0",
                    lambda t: t.tm.layers[0].costs.out_static and t.c.a[0] == 0),),
        plans=((), (1,), (2,), (3,), (6,), (1, 2), ((4, 7), (4,)), ((1, 2, 4, 5, 6, 7), (0, 2, 4, 5, 6))),
        check=assert_exact_by_phase,
    ),
    # ---- who holds a layer's input and saved tensors -------------------------------------------
    Case(
        id="trailing-layers-save-nothing",
        rule="The last layers of a checkpointed segment that save nothing run their backward before the "
             "recomputation starts, with the gradients they make held (rg).",
        spec=_TRAILING_LAYERS_SAVE_NOTHING,
        max_crossing=1,
        facts=(Fact("layer 5 (the mean) saves nothing",
                    lambda t: not t.c.sin[5] and not t.c.sout[5] and t.c.m[5] == 0),
               Fact("layer 4 makes gradients before its first read (rg > a)", lambda t: t.c.rg[4] > t.c.a[4])),
        plans=((), (5,), (6,), (4, 6), every_layer), check=assert_exact,
        fuzz=True, fuzz_max_crossing=1,
    ),
    Case(
        id="dead-branch-recomputed-with-side-tensors",
        rule="With several tensors crossing a cut, a layer holding a dead branch (a BatchNorm, Dropout and "
             "GroupNorm nothing reads) is priced as it runs when it is recomputed: every plan exact.",
        spec=_TRAILING_LAYERS_SAVE_NOTHING,
        plans=((), every_layer, each_single_cut, dp2_optimum, (2, 5, 8), (1, 4, 7, 9)), check=assert_exact,
        fuzz=True,
    ),
    Case(
        id="leaf-input-used-twice",
        rule="A model input that requires grad and is read twice is a leaf: the two contributions to its "
             "gradient are summed out of place.",
        spec=Spec(family="mlp", dtype="float32", batch=2, shape=(4,), classes=1, input_requires_grad=True, nodes=(
            Node("gelu", (0,)), Node("add", (1, 0)))),
        max_crossing=1,
        facts=(Fact("the model input is a leaf that requires grad", lambda t: t.x.requires_grad and t.x.is_leaf),),
        plans=((), (1,), (1, 2)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="segment-start-holds-its-input",
        rule="A layer that saves its input frees it once its backward has read it, but as the first layer of a "
             "checkpointed segment the input is the checkpoint, held through the whole backward (bk).",
        spec=Spec(family="conv", dtype="float32", batch=2, shape=(5, 8, 8), classes=1, input_requires_grad=True,
                  nodes=(Node("conv3", (0,), width=1, inplace="relu_"), Node("dropout", (1,)), Node("dropout", (2,)),
                         Node("relu_module_plain", (3,)), Node("gn", (4,)), Node("relu", (5,)), Node("mul", (6, 2)),
                         Node("cat", (7, 3)), Node("maxpool", (8,)), Node("dropout", (9,)),
                         Node("dropout", (10,)))),
        max_crossing=1,
        facts=(Fact("layer 2 saves its input and bk[2] > b[2]", lambda t: t.c.sin[2] and t.c.bk[2] > t.c.b[2]),),
        plans=((), (2, 3), (1, 2, 3), (2,)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="who-holds-the-first-input",
        rule="A segment's input during its first layer's backward is held by the layer before inside a segment "
             "(b), by the checkpoint's frame until the layer's last saved tensor goes (bk), else by nothing (bf).",
        spec=Spec(family="conv", dtype="float32", batch=1, shape=(1, 8, 8), classes=1, dropout_p=0.0, nodes=(
            Node("conv3", (0,), width=8, inplace="relu_"), Node("maxpool", (1,)), Node("conv3", (2,), width=2),
            Node("up", (3,)), Node("cat", (1, 4)), Node("conv3", (5,), width=1))),
        max_crossing=1,
        facts=(Fact("layer 0 saves its output, layer 1 its input, and bf[1], bk[1] < b[1]",
                    lambda t: t.c.sout[0] and t.c.sin[1] and t.c.bf[1] < t.c.b[1] and t.c.bk[1] < t.c.b[1]),
               Fact("bf decides plan (1,)", lambda t: simulate(_held_throughout(t.c), (1,)).peak_bytes
                    > simulate(t.c, (1,)).peak_bytes),
               Fact("bk decides plan (1, 2)", lambda t: simulate(_held_throughout(t.c), (1, 2)).peak_bytes
                    > simulate(t.c, (1, 2)).peak_bytes)),
        # a segment starting at layer 1, unwrapped or checkpointed, after a checkpointed or a stored segment
        # (which keeps the input: layer 0 saves its output), and no checkpointing
        plans=(((), ()), ((1,), ()), ((1,), (0,)), ((1, 2), ()), ((1, 2), (0,)), ((1, 3), ()), ((1, 3), (0,))),
        check=assert_exact,
    ),
    Case(
        id="recomputed-saves-die-with-their-node",
        rule="A recomputed saved tensor is handed out once and dies when the backward node that reads it "
             "returns, before the engine reduces the node's gradients (a bias gradient's sum): br, bkr.",
        spec=Spec(family="mlp", dtype="float32", batch=1, shape=(17,), classes=1, nodes=(
            Node("relu", (0,)), Node("linear", (1,), width=17))),
        seed=830024008, max_crossing=1,
        facts=(Fact("plan (1,) peaks in the backward", lambda t: simulate(t.c, (1,)).phase == "backward"),
               Fact("br and bkr leave out the ReLU output (m)",
                    lambda t: t.c.br[0] == t.c.b[0] - t.c.m[0] and t.c.bkr[0] == t.c.bk[0] - t.c.m[0])),
        plans=((), (1,), (2,), (1, 2)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="input-dies-inside-the-layer",
        rule="A layer's input that nothing else holds dies at its last use inside the layer, in a checkpointed "
             "segment's forward and recomputation and in an unwrapped one where no layer saves it (ff, ffs).",
        spec=Spec(family="conv", dtype="float32", batch=1, shape=(1, 4, 4), classes=1, nodes=(
            Node("conv1", (0,), width=1), Node("cat", (0, 1), inplace="dropout_"))),
        seed=48642128, max_crossing=1,
        facts=(Fact("plan (2,) peaks in the recomputation, and ff[1] frees the input before the mask",
                    lambda t: simulate(t.c, (2,)).phase == "recompute" and t.c.ff[1] == t.c.f[1] - t.c.a[0]),),
        plans=((), (1,), (2,), (3,), (2, 3), (2, 4), (1, 2, 3, 4)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="checkpoint-first-pass-keeps-no-saves",
        rule="A checkpoint's first pass keeps none of the saved tensors, so a saved tensor dies at its last use "
             "there: a checkpointed segment's forward is measured under a pack hook that keeps nothing (fc, ffc).",
        spec=Spec(family="conv", dtype="float32", batch=6, shape=(3, 8, 8), classes=1, nodes=(
            Node("relu_module_plain", (0,)), Node("gn", (0,)), Node("conv3", (0,), width=2), Node("gelu", (3,)),
            Node("silu", (4,)), Node("sigmoid", (5,)), Node("bn", (6,)), Node("cat", (7, 2)),
            Node("add", (2, 0), inplace="relu_module"))),
        seed=516089506, max_crossing=1,
        facts=(Fact("some layer's fc is below its f", lambda t: (t.c.fc < t.c.f).any()),),
        plans=((), (1,), (2,), (1, 2), (1, 2, 3, 4)), check=assert_exact_by_phase,
    ),
    Case(
        id="trigger-backward-before-first-read",
        rule="A checkpointed segment's last saving layer runs its backward up to its first read of a saved "
             "tensor (which starts the recomputation) without the recomputed tensors: brt, bkrt and rgp.",
        spec=Spec(family="mlp", dtype="float32", batch=3, shape=(15,), input_requires_grad=True, nodes=(
            Node("tanh", (0,)), Node("cat", (0, 1), inplace="mul_"))),
        seed=759761091,
        facts=(Fact("brt[0] < br[0] and rgp[0] > rg[0]", lambda t: t.c.brt[0] < t.c.br[0] and t.c.rgp[0] > t.c.rg[0]),),
        plans=((1,), (1, 2), (2,), ()), check=assert_exact_by_phase,
    ),
    Case(
        id="trigger-part-never-negative",
        rule="The part of a layer's backward from its first read of a saved tensor is never negative (brt >= 0), "
             "where the output gradient is used up before that read too.",
        spec=Spec(family="conv", dtype="bfloat16", batch=2, shape=(2, 4, 4), classes=2, input_requires_grad=True,
                  nodes=(Node("bn", (0,)), Node("up", (1,)), Node("dropout", (1,)), Node("conv3", (3,), width=3),
                         Node("cat", (1, 4), inplace="relu_module"), Node("cat", (0, 4)), Node("bn", (6,)),
                         Node("mul", (1, 3)), Node("gelu", (8,)), Node("sigmoid", (2,)))),
        seed=132799215,
        facts=(Fact("brt >= 0 everywhere, below br somewhere",
                    lambda t: (t.c.brt >= 0).all() and (t.c.brt < t.c.br).any()),),
        plans=((1,), (2,), (1, 2), (2, 4)), check=assert_exact_by_phase,
    ),
    # ---- gradient storages ---------------------------------------------------------------------
    Case(
        id="gradient-slice-keeps-its-storage",
        rule="A layer whose output gradient is a slice of a later layer's (a concatenation's) holds that whole "
             "storage through its backward (g).",
        spec=_GRADIENT_IS_A_SLICE,
        max_crossing=1,
        facts=(Fact("layer 0's gradient lives in the concatenation's", lambda t: t.c.g[0] == t.c.a[1] > t.c.a[0]),),
        plans=((), (1,), (4,), (2, 4), (1, 3), dp2_optimum), check=assert_exact,
    ),
    Case(
        id="gradient-slice-of-a-slice",
        rule="Where a second concatenation slices the first one's gradient in turn, the layers before live in "
             "the largest storage (the plans of this model are not all exact yet: benchmarks/RESULTS.md).",
        spec=dataclasses.replace(_GRADIENT_IS_A_SLICE, nodes=_GRADIENT_IS_A_SLICE.nodes + (Node("cat", (0, 2)),)),
        max_crossing=1,
        facts=(Fact("layers 0 to 2's gradients live in layer 2's output, the largest",
                    lambda t: list(t.c.g[:3]) == [t.c.a[2]] * 3 and t.c.a[2] > t.c.a[1] > t.c.a[0]),),
    ),
    Case(
        id="gradient-slice-layout",
        rule="A layer whose output gradient is a strided slice (a channel concatenation's) is measured with it "
             "laid out so: a GroupNorm's backward copies it first.",
        spec=Spec(family="conv", dtype="float32", batch=3, shape=(1, 4, 4), classes=1, nodes=(
            Node("gn", (0,)), Node("cat", (0, 1)))),
        seed=803927111,
        facts=(Fact("layer 1 records the slice's layout, and g[0] > a[0]",
                    lambda t: t.tm.layers[1].costs.gin_layout is not None and t.c.g[0] > t.c.a[0]),),
        plans=((), (1,), (2,), (1, 2), (1, 2, 3, 4)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="gradient-slice-layout-made-inside",
        rule="The same where the slice is made inside the next layer (an in-place ReLU after the "
             "concatenation); plan (3,) peaks in the GroupNorm's backward.",
        spec=Spec(family="conv", dtype="float32", batch=3, shape=(1, 4, 4), classes=1, nodes=(
            Node("dropout", (0,)), Node("bn", (1,)), Node("gn", (0,)), Node("gn", (3,)),
            Node("cat", (2, 4), inplace="relu_module"))),
        seed=803927111,
        plans=((3,), (), (3, 4), (1, 2, 3)), check=assert_exact,
    ),
    Case(
        id="gradient-slice-through-an-addition",
        rule="A side output's gradient slice is laid out as the last layer that adds to its gradient passes it "
             "on (an addition handing on a concatenation's slice), not only as the slicing layer hands it out.",
        spec=Spec(family="conv", dtype="float32", batch=5, shape=(2, 8, 8), classes=1, nodes=(
            Node("conv1", (0,), width=4), Node("avgpool", (1,)), Node("gn", (2,)), Node("dropout", (3,)),
            Node("bn", (4,)), Node("avgpool", (1,)), Node("add", (6, 3)), Node("cat", (7, 6)), Node("gelu", (8,)),
            Node("gn", (9,)))),
        seed=701513939,
        plans=((1, 3), (2,), ()), check=assert_exact_by_phase,
    ),
    Case(
        id="slice-used-up-early-is-held-on",
        rule="A layer that lets its slice of a gradient go before it reads a saved tensor frees nothing while "
             "another slice (a side tensor's) holds the storage: the recomputation starts with it (rg).",
        spec=Spec(family="conv", dtype="float64", batch=3, shape=(2, 4, 4), kind="two-tower", nodes=(
            Node("dropout", (0,)), Node("gn", (1,)), Node("conv3", (2,), width=2), Node("bn", (0,)),
            Node("silu", (4,)), Node("gn", (5,), inplace="mul_"), Node("cat", (6, 3)), Node("conv1", (7,), width=2))),
        seed=921776112,
        facts=(Fact("the one side tensor is read by layer 5, its gradient a view of layer 5's (shared)",
                    lambda t: (only(t.c.side).consumers, only(t.c.side).grad_view) == ((5,), 5)),),
        plans=((), (5,), (7,), (5, 7), (2, 5)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="shared-gradient-used-up-early-is-held-on",
        rule="Likewise for the one gradient an addition hands a layer and a side tensor: the side tensor's "
             "pending gradient holds it on after the layer has used it (rgk).",
        spec=Spec(family="conv", dtype="float64", batch=4, shape=(4, 4, 4), classes=1, kind="enc-dec", nodes=(
            Node("dropout", (0,)), Node("relu", (1,)), Node("gn", (2,)), Node("silu", (3,)),
            Node("gn", (0,), inplace="mul_"), Node("add", (4, 5), inplace="mul_"), Node("relu", (6,)))),
        seed=417308059,
        facts=(Fact("the one side tensor is read by layer 3, its gradient a view of layer 2's",
                    lambda t: (only(t.c.side).consumers, only(t.c.side).grad_view) == ((3,), 2)),),
        plans=((), (3,), (4,), (1, 3), (3, 5), (1, 2, 3, 4)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="output-gradient-outlives-the-backward",
        rule="A layer whose output gradient outlives its backward (another slice of the storage keeps it) is "
             "measured with it held: every figure (b, the release splits) counts it where the backward has it.",
        spec=OUTPUT_GRADIENT_OUTLIVES_THE_BACKWARD,
        seed=91550067,
        plans=((1, 3, 4, 5, 6, 7), (1, 3, 4, 5, 6, 9), (1, 4, 5, 8), (2, 4, 5), ()), check=assert_exact_by_phase,
    ),
    Case(
        id="output-gradient-found-late-to-outlive",
        rule="A layer whose output gradient turns out to outlive its backward only on the side tensors of the "
             "re-measuring pass (a view found late) is measured once more with it held.",
        spec=Spec(family="conv", dtype="float64", batch=6, shape=(4, 4, 4), classes=2, nodes=(
            Node("bn", (0,), inplace="dropout_"), Node("mul", (0, 1)), Node("gelu", (2,)),
            Node("add", (3, 1), inplace="mul_"), Node("mul", (1, 4), inplace="relu_module"),
            Node("cat", (4, 5), inplace="mul_"), Node("mul", (2, 4)))),
        seed=393472798,
        facts=(Fact("a side tensor's gradient views layer 2's output gradient, and gh[2] == 0",
                    lambda t: any(s.grad_view == 2 for s in t.c.side) and t.c.gh[2] == 0),),
        plans=((3,), (2,), (1, 3), (), (3, 5), (1,)), check=assert_exact_by_phase,
    ),
    Case(
        id="no-gradient-reaches-the-chain-output",
        rule="A chain output no gradient reaches (only a dead op reads it) is measured with none injected, "
             "and its g is 0.",
        spec=Spec(family="mlp", dtype="bfloat16", batch=6, shape=(24,), classes=1, input_requires_grad=True, nodes=(
            Node("silu", (0,)), Node("relu", (1,)), Node("linear", (2,), width=11, inplace="relu_module"),
            Node("mul", (1, 0)), Node("gelu", (4,)), Node("cat", (5, 2), inplace="relu_"),
            Node("relu_module_plain", (2,)), Node("sigmoid", (3,)))),
        seed=274652979,
        facts=(Fact("a chain output has g == 0 < a", lambda t: any(g == 0 < a for g, a in zip(t.c.g, t.c.a))),),
        plans=((), (1,), (1, 2), (1, 3), (1, 2, 3)), check=assert_exact_by_phase,
    ),
    Case(
        id="the-one-output-a-gradient-reaches-is-a-slice",
        rule="Where no gradient reaches the chain output, the side output's gradient is the layer's output "
             "gradient; a slice of a later storage, that storage is counted once.",
        spec=Spec(family="mlp", dtype="float64", batch=2, shape=(13,), classes=2, nodes=(
            Node("linear", (0,), width=20), Node("bn", (1,)), Node("relu", (2,)), Node("mul", (1, 3)),
            Node("dropout", (4,)), Node("pool1d", (5,)), Node("cat", (5, 6)), Node("cat", (6, 2)))),
        seed=799003289,
        plans=((5,), (5, 6), (1, 2, 4, 6), (3, 4, 6, 7), (2, 3, 5, 6)), check=assert_exact_by_phase,
    ),
    # ---- side tensors: their gradients ---------------------------------------------------------
    Case(
        id="saved-side-output",
        rule="A side output its producer saves is counted whole through the producer's backward (the saved "
             "reference is its last holder), not split at its release as a side input is.",
        spec=Spec(family="mlp", dtype="float32", batch=1, shape=(4,), classes=1, nodes=(
            Node("linear", (0,), width=4, inplace="relu_"), Node("dropout", (1,)), Node("add", (1, 2)))),
        facts=(Fact("one side tensor, made and saved by layer 0, which has no chain output",
                    lambda t: only(t.c.side).producer == 0 and 0 in only(t.c.side).saved_by and t.c.a[0] == 0),),
        plans=((), (1,), (2,), (3,), (1, 3), (2, 4), (1, 2, 3, 4)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="pending-side-gradient-views-the-output-gradient",
        rule="A side tensor handed a slice of a later layer's output gradient keeps that storage alive until "
             "its next contribution is summed, through the backward of the layers between.",
        spec=Spec(family="conv", dtype="float32", batch=1, shape=(1, 4, 4), classes=1, nodes=(
            Node("bn", (0,)), Node("conv3", (1,), width=1, inplace="relu_"), Node("cat", (1, 2)))),
        facts=(Fact("the one side tensor, read by layers 1 and 2, views layer 2's gradient, split at layer 1",
                    lambda t: only(t.c.side).consumers == (1, 2) and only(t.c.side).grad_view == t.c.groot[1] == 2
                    and only(t.c.side).grad_split == 1),),
        plans=((), (1,), (2,), (3,), (1, 2), (1, 3, 4), (1, 2, 3, 4, 5)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="shared-pending-gradient-outlives-the-sum",
        rule="Where side tensors' gradients share one storage, a pending gradient is held through the backward "
             "wherever another side tensor's gradient views that storage past the layer.",
        spec=Spec(family="mlp", dtype="float32", batch=2, shape=(2,), classes=1, kind="skip", nodes=(
            Node("bn", (0,)), Node("bn", (1,)), Node("add", (2, 1), inplace="relu_"), Node("mul", (3, 1)),
            Node("cat", (4, 1)), Node("linear", (5,), width=2), Node("add", (2, 6)), Node("add", (7, 3)))),
        seed=851314911,
        facts=(Fact("three side tensors, two of whose gradients view one storage",
                    lambda t: len(views := [s.grad_view for s in t.c.side]) == 3
                    and len({v for v in views if v >= 0}) < len([v for v in views if v >= 0])),),
        plans=((), (2, 5), (4, 6), (7,), (1, 2, 3), (1, 2, 3, 4, 5, 6, 7, 8, 9)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="pending-only-if-a-later-consumer-adds",
        rule="A side tensor's gradient is pending at a consumer only if a later consumer adds to it; a last "
             "reader that adds nothing leaves the consumer before it the first contribution, a view.",
        spec=Spec(family="mlp", dtype="float32", batch=3, shape=(23,), classes=1, nodes=(
            Node("ln", (0,), inplace="mul_"), Node("cat", (1, 0), inplace="mul_"),
            Node("linear", (2,), width=10, inplace="mul_"), Node("cat", (1, 3)), Node("cat", (1, 4)),
            Node("linear", (4,), width=14), Node("relu_module_plain", (6,)), Node("add", (6, 7)),
            Node("mul", (7, 8)))),
        seed=695594338,
        facts=(Fact("the LayerNorm output is read by 3 layers, 2 add to its gradient, which views a storage",
                    lambda t: len((ln := next(s for s in t.c.side if s.producer == 0)).consumers) == 3
                    and len(ln.grad_by) == 2 and ln.grad_view >= 0),),
        plans=((), (1, 2, 3, 4), (1, 7, 8), (2, 4, 5, 7, 9), (9,)), check=assert_exact,
    ),
    Case(
        id="side-output-gradient-slice",
        rule="A side output whose gradient is a slice of a larger storage is measured with it handed out as "
             "that slice: the whole storage is live when the producer's backward starts its recomputation.",
        spec=Spec(family="mlp", dtype="float64", batch=4, shape=(30,), classes=2, nodes=(
            Node("sigmoid", (0,)), Node("gelu", (1,)), Node("cat", (2, 1)), Node("ln", (0,)),
            Node("relu_module_plain", (4,)), Node("add", (0, 1)), Node("linear", (6,), width=4), Node("mul", (2, 0)),
            Node("cat", (8, 4)))),
        seed=100196380,
        facts=(Fact("the LayerNorm output (layer 0's) has twice its size of gradient, a view of layer 2's",
                    lambda t: (ln := next(s for s in t.c.side if s.grad_bytes)).producer == 0
                    and ln.grad_bytes == 2 * ln.bytes and ln.grad_view == 2),),
        plans=((), (1,), (2,), (3,), (1, 2), (2, 4), (1, 2, 3, 4)), check=assert_exact,
    ),
    Case(
        id="side-output-gradient-slice-bf16",
        rule="The same in bfloat16, with an input that requires grad.",
        spec=Spec(family="mlp", dtype="bfloat16", batch=5, shape=(30,), classes=4, input_requires_grad=True, nodes=(
            Node("linear", (0,), width=21), Node("relu", (1,)), Node("pool1d", (0,)), Node("relu", (3,)),
            Node("mul", (4, 3), inplace="relu_module"), Node("cat", (2, 3)), Node("cat", (6, 2)), Node("silu", (7,)),
            Node("mul", (3, 5)), Node("cat", (9, 4)))),
        seed=726054815,
        plans=((), (1,), (1, 2), (1, 4), (1, 2, 3, 4)), check=assert_within_loss,
    ),
    Case(
        id="side-output-gradient-slice-alone",
        rule="A layer whose one output is such a side tensor has that slice's storage as its output gradient "
             "already (g): counted once.",
        spec=Spec(family="conv", dtype="float32", batch=2, shape=(2, 8, 8), nodes=(
            Node("conv3", (0,), width=1, inplace="relu_module"), Node("tanh", (0,)), Node("add", (0, 2)),
            Node("relu_module_plain", (3,)), Node("relu_module_plain", (4,)), Node("mul", (5, 4)),
            Node("cat", (1, 6)), Node("cat", (2, 7)))),
        seed=766473487,
        facts=(Fact("layer 0's one output is a side tensor, and g[0] is more than its bytes",
                    lambda t: t.tm.layers[0].side_outputs == ("ops_0_inplace",)
                    and t.c.g[0] > t.c.side[0].bytes),),
        plans=((), (1,), (2,), (1, 8), (1, 10)), check=assert_within_loss,  # (peaks in the forward: no loss yet)
    ),
    Case(
        id="slice-of-a-summed-side-gradient",
        rule="The output gradient of the layer before a concatenation whose output is only a side tensor is a "
             "slice of that tensor's summed gradient, a storage of its own, not a later layer's output gradient.",
        spec=_CONCATENATED_LINEARS,
        seed=706591006,
        facts=(Fact("layer 1 hands on only the concatenation, a side tensor two layers read",
                    lambda t: t.tm.layers[1].side_outputs == (only(t.c.side).name,) and t.c.a[1] == 0
                    and len(only(t.c.side).consumers) == 2),
               Fact("layer 0's gradient lives in the concatenation's summed gradient",
                    lambda t: t.c.g[0] == only(t.c.side).bytes > t.c.a[0])),
        plans=((), (2,), (2, 3, 4, 5, 6), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7)), check=assert_exact,
    ),
    Case(
        id="lone-side-output-shares-the-chain-gradient",
        rule="A lone side output whose gradient is the chain gradient's storage is measured handed out as it, "
             "rg relative to it: not counted twice while the layer is recomputed.",
        spec=Spec(family="conv", dtype="float64", batch=2, shape=(6, 4, 4), classes=2, kind="two-tower", nodes=(
            Node("conv1", (0,), width=6), Node("bn", (1,)), Node("dropout", (2,)), Node("relu", (3,)),
            Node("conv3", (4,), width=6), Node("relu", (5,)), Node("bn", (0,)), Node("add", (7, 6)),
            Node("conv1", (8,), width=6))),
        seed=147787406,
        facts=(Fact("the one side tensor is its producer's only output, and its g",
                    lambda t: t.tm.layers[(s := only(t.c.side)).producer].side_outputs == (s.name,)
                    and t.c.a[s.producer] == 0 and t.c.g[s.producer] == s.bytes),),
        plans=((), (1, 6), (1,), (2, 6), (1, 3, 6, 8), (4, 6)), check=assert_exact,
    ),
    Case(
        id="rg-leaves-out-a-lone-side-outputs-gradient",
        rule="rg leaves out a lone side output's injected gradient wherever the layer has no chain output "
             "(the kernels add g).",
        spec=Spec(family="mlp", dtype="float64", batch=5, shape=(11,), classes=2, nodes=(
            Node("linear", (0,), width=3), Node("cat", (1, 0)), Node("cat", (2, 1), inplace="mul_"),
            Node("linear", (3,), width=7), Node("linear", (4,), width=23), Node("cat", (2, 5), inplace="dropout_"),
            Node("silu", (0,)), Node("cat", (2, 7)))),
        seed=1030206950,
        facts=(Fact("layer 0 has no chain output and a gradient", lambda t: t.c.a[0] == 0 < t.c.g[0]),),
        plans=((3, 4), (3, 4, 5), (3, 5), (4,), (), (1,), (2, 4)), check=assert_exact_by_phase,
    ),
    Case(
        id="lone-side-output-gradient-strided",
        rule="A lone side output's gradient is laid out as its reader hands it out (a strided channel slice, "
             "which a GroupNorm's backward copies).",
        spec=Spec(family="conv", dtype="float32", batch=3, shape=(5, 4, 4), kind="enc-dec", nodes=(
            Node("gelu", (0,)), Node("gn", (1,)), Node("silu", (2,)), Node("tanh", (3,)),
            Node("conv1", (4,), width=5), Node("gn", (5,)), Node("bn", (0,)), Node("cat", (7, 6)),
            Node("conv1", (8,), width=5), Node("gn", (9,)), Node("conv1", (10,), width=5))),
        seed=1010731505,
        plans=((5, 8, 10), (5, 7, 9, 10), (2, 5, 6, 7, 8, 10, 12), (), (3, 6)), check=assert_exact_by_phase,
    ),
    Case(
        id="lone-side-output-gradient-strided-two-tower",
        rule="The same in a two-tower model: the first tower's GroupNorm output, concatenated with the second "
             "tower's at the end.",
        spec=Spec(family="conv", dtype="float32", batch=2, shape=(3, 4, 4), kind="two-tower", nodes=(
            Node("relu", (0,)), Node("conv1", (1,), width=3), Node("gn", (2,)), Node("relu", (0,)),
            Node("dropout", (4,)), Node("dropout", (5,)), Node("bn", (6,), inplace="mul_"), Node("dropout", (7,)),
            Node("cat", (8, 3)), Node("conv1", (9,), width=3))),
        seed=1025444167,
        plans=((2, 7, 8, 9, 10, 11), (2, 4, 5, 7), (2, 3, 7, 8, 9, 10)), check=assert_exact_by_phase,
    ),
    Case(
        id="side-output-no-gradient-reaches",
        rule="A side output no later layer hands a gradient gets none; a side tensor dies inside its last "
             "reader (last_gain) only where nothing saves it.",
        spec=Spec(family="mlp", dtype="bfloat16", batch=5, shape=(9,), nodes=(
            Node("ln", (0,)), Node("cat", (0, 1), inplace="dropout_"), Node("relu_module_plain", (2,)),
            Node("pool1d", (3,)), Node("cat", (1, 4)), Node("mul", (2, 3)), Node("ln", (5,)), Node("cat", (7, 2)),
            Node("linear", (8,), width=30))),
        seed=315988539,
        facts=(Fact("a saved side tensor with no gradient that dies inside its last reader",
                    lambda t: any(s.grad_bytes == 0 and s.last_gain < 0 and s.saved_by for s in t.c.side)),),
        # the first two were under-predicted, the other three over-predicted
        plans=((5, 8), (1, 6, 7), (3, 6, 8), (3, 8), (1, 2, 3, 6)), check=assert_exact_by_phase,
    ),
    # ---- side tensors: where they die ----------------------------------------------------------
    Case(
        id="side-dies-inside-its-last-reader",
        rule="A side tensor read last by a layer that does not save it dies at that read where nothing else "
             "holds it (an unwrapped segment, a recomputation): SideTensor.last_gain.",
        spec=Spec(family="conv", dtype="float64", batch=3, shape=(1, 4, 4), classes=4, nodes=(
            Node("conv1", (0,), width=6), Node("cat", (0, 1)), Node("relu_module_plain", (1,)),
            Node("conv1", (0,), width=3), Node("cat", (3, 0)), Node("bn", (5,), inplace="mul_"), Node("cat", (4, 2)),
            Node("maxpool", (7,)))),
        seed=481963592,
        facts=(Fact("a side tensor dies inside its last reader", lambda t: any(s.last_gain < 0 for s in t.c.side)),),
        # no checkpointing (the forward peaks in that layer), a recomputation of it, and others
        plans=((), (1, 2), (3,), (5,), (3, 4, 6), (4, 7), (1, 4, 5, 6, 7)), check=assert_exact_by_phase,
    ),
    Case(
        id="dying-side-input-in-the-whole-forward",
        rule="A dying side input's gain in its reader's whole forward has its own figure (last_gain_full), "
             "apart from a recomputation that stops at the layer's last saved tensor.",
        spec=_SIDE_INPUT_DYING_IN_A_GROUPNORM,
        seed=780222873,
        facts=(Fact("a side tensor gains more in the whole forward",
                    lambda t: any(s.last_gain_full is not None and s.last_gain_full < s.last_gain
                                  for s in t.c.side)),),
        plans=((1, 4), (4,), ()), check=assert_exact_by_phase,
    ),
    Case(
        id="side-dies-in-a-checkpoints-first-pass",
        rule="A side tensor made inside a checkpointed segment and read last there dies at its last use in the "
             "checkpoint's first pass, which keeps no saved tensor (last_gain_ckpt).",
        spec=_SIDE_INPUT_DYING_IN_A_GROUPNORM,
        seed=780222873,
        facts=(Fact("a side tensor dies inside a checkpoint's first pass",
                    lambda t: any(s.last_gain_ckpt < 0 for s in t.c.side)),),
        plans=((1, 5, 6), (1, 2, 5, 6, 7), (1, 5, 6, 7)), check=assert_exact_by_phase,
    ),
    Case(
        id="dying-side-gain-by-how-the-input-is-held",
        rule="A dying side tensor's gain is measured with its reader's input held and dying (last_gain_free), "
             "and taken as the layer's forward holds that input.",
        spec=Spec(family="mlp", dtype="float32", batch=6, shape=(29,), input_requires_grad=True, nodes=(
            Node("bn", (0,)), Node("mul", (1, 0)), Node("add", (2, 1), inplace="dropout_"), Node("relu", (3,)),
            Node("silu", (4,)), Node("mul", (5, 4)))),
        seed=1002643442,
        facts=(Fact("a side tensor gains differently with the input dying",
                    lambda t: any(s.last_gain_free is not None and s.last_gain_free != s.last_gain
                                  for s in t.c.side)),),
        plans=((2,), (), (1,), (1, 2), (3,), (2, 4)), check=assert_exact_by_phase,
    ),
    Case(
        id="each-side-input-dying-in-a-layer",
        rule="Each side input a layer reads last and does not save is measured dying alone, and the largest "
             "gain goes to its input.",
        spec=Spec(family="conv", dtype="float32", batch=2, shape=(3, 8, 8), classes=2, nodes=(
            Node("conv3", (0,), width=6), Node("cat", (0, 1), inplace="dropout_"), Node("cat", (0, 1)),
            Node("gelu", (3,)), Node("add", (4, 3), inplace="dropout_"), Node("add", (5, 2)),
            Node("conv3", (6,), width=7), Node("cat", (7, 4)), Node("conv3", (8,), width=5, inplace="dropout_"),
            Node("add", (2, 5), inplace="dropout_"))),
        seed=974769144,
        plans=((), (1, 2, 4), (1, 3), (1, 4), (1, 2, 6), (1, 7)), check=assert_exact_by_phase,
    ),
    Case(
        id="side-inputs-dying-together",
        rule="Side inputs dying together in one layer are each counted: every set of them is measured, and "
             "each gets the least gain that keeps every set covered (dying_gains).",
        spec=Spec(family="mlp", dtype="float32", batch=4, shape=(27,), nodes=(
            Node("ln", (0,)), Node("cat", (0, 1)), Node("cat", (1, 2)), Node("gelu", (3,)), Node("sigmoid", (4,)),
            Node("cat", (3, 1), inplace="relu_"), Node("cat", (4, 6)),
            Node("linear", (7,), width=17, inplace="relu_"), Node("cat", (2, 4)))),
        seed=694803594,
        facts=(Fact("two side tensors die inside their last reader",
                    lambda t: sum(1 for s in t.c.side if s.last_gain < 0) == 2),),
        plans=((), (3,), (2, 3), (5,), (3, 6)), check=assert_exact_by_phase,
    ),
    Case(
        id="equal-dying-gains-go-to-the-least-likely-held",
        rule="Of equal dying gains, the side tensor a plan is least likely to hold elsewhere gets them first "
             "(dying_gains(rank=...)).",
        spec=Spec(family="conv", dtype="bfloat16", batch=2, shape=(5, 4, 4), classes=1, nodes=(
            Node("conv3", (0,), width=3, inplace="relu_"), Node("cat", (1, 0)), Node("cat", (0, 2)),
            Node("avgpool", (3,)), Node("gelu", (4,)), Node("cat", (4, 5)), Node("cat", (0, 3)), Node("cat", (3, 1)),
            Node("dropout", (7,)))),
        seed=507100533,
        facts=(Fact("the concatenation made in the segment gets the gain, the saved ReLU output none",
                    lambda t: (by := {s.name: s for s in t.c.side})["cat_1"].last_gain < 0 == by["relu_"].last_gain),),
        plans=((1, 2, 6), (5, 6, 7), (5,), (), (2, 4, 6)), check=assert_exact_by_phase,
    ),
    # ---- side tensors: their releases ----------------------------------------------------------
    Case(
        id="two-sides-let-go-together",
        rule="Side tensors let go at one moment of a backward (a product saving both) are counted together "
             "before it: their release splits are chained.",
        spec=_TWO_SIDES_MULTIPLIED,
        seed=163571349,
        facts=(Fact("the product (layer 4) saves two side tensors",
                    lambda t: sum(4 in s.saved_by for s in t.c.side) == 2),),
        plans=((), (2, 4), (7,), (4,), (5,), (2, 5, 7)), check=assert_exact, fuzz=True,
    ),
    Case(
        id="held-operand-last-in-the-release-chain",
        rule="Release splits of side tensors let go together are chained with the one an earlier segment may "
             "hold (in a checkpoint's frame) last, so that it is not counted twice.",
        spec=_TWO_SIDES_MULTIPLIED,
        seed=163571349,
        plans=((3, 4), (1, 3, 4), (3, 5), (1, 3, 5), (1, 3), ()), check=assert_exact_by_phase,
    ),
    Case(
        id="recomputed-side-copy-dies-with-its-node",
        rule="A saved side input's recomputed copy is handed out once and dies when its reader's node returns, "
             "before the bias gradient is summed (saved_pre_rec/saved_post_rec where the saver is recomputed).",
        spec=Spec(family="mlp", dtype="float32", batch=3, shape=(7,), classes=2, kind="skip", nodes=(
            Node("ln", (0,)), Node("linear", (1,), width=7), Node("tanh", (2,)), Node("cat", (3, 1)),
            Node("linear", (4,), width=7))),
        seed=351231170,
        facts=(Fact("a side tensor's recomputed split differs from its kept one",
                    lambda t: bool(split := [s for s in t.c.side if s.saved_pre_rec])
                    and all(s.saved_pre_rec != s.saved_pre for s in split)),),
        plans=((2, 3, 4, 5, 6), (2,), (2, 4), (1, 2), ()), check=assert_exact_by_phase,
    ),
    Case(
        id="release-splits-with-the-input-gone",
        rule="Where no earlier layer keeps a segment's input, release splits have the input go with the layer's "
             "last saved tensor, as its backward figure does (fkpre/fkpost, saved_pre_free/saved_post_free).",
        spec=Spec(family="conv", dtype="float32", batch=3, shape=(4, 4, 4), kind="skip", nodes=(
            Node("dropout", (0,)), Node("bn", (1,)), Node("silu", (2,)), Node("conv3", (3,), width=4),
            Node("mul", (4, 1)), Node("cat", (5, 1)), Node("conv1", (6,), width=4), Node("tanh", (7,)),
            Node("mul", (8, 2)), Node("add", (9, 2)))),
        seed=236179101,
        facts=(Fact("a side tensor has a split with the input gone, and fkpost differs from fpost",
                    lambda t: any(s.saved_pre_free for s in t.c.side) and (t.c.fkpost != t.c.fpost).any()),),
        plans=((3, 4, 5, 7, 8, 9, 10, 11), ((3, 4, 5, 7, 8, 9, 10, 11), (3,)), ((3, 4, 5, 7, 8, 9, 10, 11), (7,)),
               ((3, 4, 5, 7, 8, 9, 10, 11), (5,)), (3, 4, 5, 6, 7, 8, 9, 10, 11)),
        check=assert_exact_by_phase,
    ),
    Case(
        id="recomputed-copy-goes-with-the-frame",
        rule="A recomputed copy whose split is the checkpoint frame's is let go with the frame, one release "
             "(simulator/side_tensors.py::_with_frame).",
        spec=Spec(family="conv", dtype="float32", batch=6, shape=(5, 8, 8), classes=1, nodes=(
            Node("bn", (0,), inplace="relu_module"), Node("maxpool", (1,)), Node("add", (1, 0), inplace="mul_"),
            Node("conv3", (3,), width=4), Node("cat", (4, 0)), Node("conv1", (5,), width=5), Node("mul", (6, 3)),
            Node("cat", (5, 7)))),
        seed=721203063,
        plans=((3, 7, 9), (3, 7), (3, 6, 7, 9), (1, 3, 7, 9), (2, 7, 9), (3,), ()), check=assert_exact_by_phase,
    ),
    *(Case(
        id=f"frame-and-recomputed-copy-one-sequence-{dtype}-batch{batch}",
        rule="The checkpoint goes mid-way through the backward of the layer that lets its frame go (KernelArrays."
             "ckf), and the frame and the recomputed copies let go in one layer are one sequence of releases.",
        spec=dataclasses.replace(_CONCATENATED_LINEARS, batch=batch, dtype=dtype),
        seed=706591006,
        facts=(Fact("layer 1 lets the checkpoint go mid-way (ckf[1] < 0)", lambda t: t.c.kernel_arrays.ckf[1] < 0),),
        plans=((1, 7), (1, 3, 4), (1, 4), (1,), (), (2,), (1, 3, 6, 7)), check=assert_exact_by_phase,
    ) for batch, dtype in ((2, "bfloat16"), (4, "float32"))),  # (at batch 4 that layer peaks)
    Case(
        id="only-recomputed-splits-join-the-sequence",
        rule="Only splits of the recomputed timeline (a recomputed copy's saved_pre_rec) join the frame's "
             "sequence; a side output its producer saves stays counted whole through the producer's backward.",
        spec=Spec(family="mlp", dtype="bfloat16", batch=5, shape=(28,), classes=4, nodes=(
            Node("relu", (0,)), Node("linear", (1,), width=31), Node("cat", (1, 2)), Node("tanh", (3,)))),
        seed=524494959,
        facts=(Fact("br[0] < b[0]", lambda t: t.c.br[0] < t.c.b[0]),),
        plans=((2,), (1, 2, 3, 4), (1,), (), (3,), (2, 3)), check=assert_exact_by_phase,
    ),
)

_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "case ids repeat"


def case(case_id: str) -> Case:
    """The case of that id."""
    return _BY_ID[case_id]
