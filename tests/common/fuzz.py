"""Random PyTorch models for fuzzing the tracer, the solvers and the rewriter.

A model is described by a :class:`Spec` (plain tuples, so a failing example
prints as something that can be pasted back into :func:`build`) and built by
:class:`RandomNet`, whose ``forward`` walks the spec's node list. The walk is
plain Python over a fixed list, so ``torch.fx`` unrolls it into one graph.

Two families:

* ``conv``: ``(B, C, H, W)`` tensors; convolutions, BatchNorm2d, GroupNorm
  (LayerNorm over channels), activations, Dropout, max/avg pooling, nearest
  upsampling, and a head ``mean((2, 3)) -> Linear``;
* ``mlp``: ``(B, F)`` tensors; Linear, LayerNorm, BatchNorm1d, activations,
  Dropout, 1-d pooling, and a head ``Linear``.

Both have residual adds, products and concatenations of two earlier values
of matching shape, so branches leave the main path and rejoin it (DAGs with
long skips, dense-block-like concatenations), and in-place ops (``relu_``,
``mul_``, ``nn.ReLU(inplace=True)``, in-place dropout) applied to an op's
output right after it is computed (where autograd allows it: the op does not
save its output). Widths, batch sizes and dtypes (float32, float64, bfloat16)
vary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

__all__ = ["Node", "Spec", "RandomNet", "build", "specs", "stream_specs"]

# ops whose output is not saved by their own backward: an in-place op may follow them
_INPLACE_OK = {"conv3", "conv1", "linear", "bn", "gn", "ln", "add", "cat", "mul"}
_INPLACE = ("relu_", "relu_module", "mul_", "dropout_")
_ACTS = ("relu", "gelu", "tanh", "sigmoid", "silu", "relu_module_plain")


@dataclass(frozen=True)
class Node:
    """One op of a random model.

    Attributes
    ----------
    op : str
    inputs : tuple of int
        Indices of earlier values (0 is the model input, i is node i-1's output).
    width : int
        Output channels or features of ``conv*``/``linear``; 0 otherwise.
    inplace : str
        An in-place op applied to the output right away ("" for none).
    """

    op: str
    inputs: tuple[int, ...]
    width: int = 0
    inplace: str = ""


@dataclass(frozen=True)
class Spec:
    family: str  # "conv" or "mlp"
    dtype: str  # "float32", "float64", "bfloat16"
    batch: int
    shape: tuple[int, ...]  # input shape without the batch: (C, H, W) or (F,)
    nodes: tuple[Node, ...]
    classes: int = 3
    input_requires_grad: bool = False
    dropout_p: float = 0.3
    kind: str = ""  # stream_specs' shape of the model ("two-tower", "enc-dec", "skip"); "" for specs'

    def example_input(self, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((self.batch, *self.shape), generator=g).to(getattr(torch, self.dtype))
        return x.requires_grad_(self.input_requires_grad)


class RandomNet(nn.Module):
    """The model a :class:`Spec` describes (parameters created in spec order)."""

    def __init__(self, spec: Spec):
        super().__init__()
        self.spec = spec
        shapes = [spec.shape]
        self.ops = nn.ModuleDict()
        for i, node in enumerate(spec.nodes):
            src = shapes[node.inputs[0]]
            module, out = _make(spec, node, src, shapes)
            if module is not None:
                self.ops[str(i)] = module
            if node.inplace == "relu_module":
                self.ops[f"{i}_inplace"] = nn.ReLU(inplace=True)
            shapes.append(out)
        last = shapes[-1]
        self.head = nn.Linear(last[0], spec.classes)
        self.to(getattr(torch, spec.dtype))

    def forward(self, x):
        values = [x]
        for i, node in enumerate(self.spec.nodes):
            args = [values[j] for j in node.inputs]
            y = self._run(i, node, args)
            y = self._inplace(i, node, y)
            values.append(y)
        out = values[-1]
        if self.spec.family == "conv":
            out = out.mean((2, 3))
        return self.head(out)

    def _run(self, i: int, node: Node, args: list):
        op = node.op
        if op in ("add",):
            return args[0] + args[1]
        if op == "mul":
            return args[0] * args[1]
        if op == "cat":
            return torch.cat(args, 1)
        if op == "relu":
            return torch.relu(args[0])
        if op == "gelu":
            return F.gelu(args[0])
        if op == "tanh":
            return torch.tanh(args[0])
        if op == "sigmoid":
            return args[0].sigmoid()
        if op == "silu":
            return F.silu(args[0])
        if op == "maxpool":
            return F.max_pool2d(args[0], 2)
        if op == "avgpool":
            return F.avg_pool2d(args[0], 2)
        if op == "up":
            return F.interpolate(args[0], scale_factor=2, mode="nearest")
        if op == "pool1d":
            return F.max_pool1d(args[0].unsqueeze(1), 2).squeeze(1)
        return self.ops[str(i)](args[0])

    def _inplace(self, i: int, node: Node, y):
        kind = node.inplace
        if kind == "relu_":
            return y.relu_()
        if kind == "mul_":
            return y.mul_(0.5)
        if kind == "relu_module":
            return self.ops[f"{i}_inplace"](y)
        if kind == "dropout_":
            return F.dropout(y, self.spec.dropout_p, training=self.training, inplace=True)
        return y


def _make(spec: Spec, node: Node, src: tuple, shapes: list) -> tuple[nn.Module | None, tuple]:
    """The module of one node (None for functional ops) and its output shape."""
    op, w = node.op, node.width
    out = _out_shape(node, src, shapes)
    if op == "conv3":
        return nn.Conv2d(src[0], w, 3, padding=1, bias=w % 2 == 0), out
    if op == "conv1":
        return nn.Conv2d(src[0], w, 1), out
    if op == "linear":
        return nn.Linear(src[0], w, bias=w % 2 == 1), out
    if op == "bn":
        return (nn.BatchNorm2d(src[0]) if spec.family == "conv" else nn.BatchNorm1d(src[0])), out
    if op == "gn":
        return nn.GroupNorm(1, src[0]), out
    if op == "ln":
        return nn.LayerNorm(src[0]), out
    if op == "dropout":
        return nn.Dropout(spec.dropout_p), out
    if op == "relu_module_plain":
        return nn.ReLU(), out
    return None, out  # functional ops


def _out_shape(node: Node, src: tuple, shapes: list) -> tuple:
    op, w = node.op, node.width
    if op in ("conv3", "conv1"):
        return (w, *src[1:])
    if op == "linear":
        return (w,)
    if op == "cat":
        return (src[0] + shapes[node.inputs[1]][0], *src[1:])
    if op in ("maxpool", "avgpool"):
        return (src[0], src[1] // 2, src[2] // 2)
    if op == "up":
        return (src[0], src[1] * 2, src[2] * 2)
    if op == "pool1d":
        return (src[0] // 2,)
    return src  # norms, dropout, activations, add, mul


def build(spec: Spec, seed: int = 0) -> tuple[RandomNet, torch.Tensor]:
    """The model (parameters drawn from ``seed``) and an example input."""
    torch.manual_seed(seed)
    return RandomNet(spec), spec.example_input(seed)


# --------------------------------------------------------------------------
# hypothesis strategy
# --------------------------------------------------------------------------
def _candidates(family: str, shape: tuple) -> list[str]:
    ops = ["dropout", "bn", *_ACTS]
    if family == "conv":
        ops += ["conv3", "conv3", "conv1", "gn"]
        if shape[1] >= 2 and shape[1] % 2 == 0:
            ops += ["maxpool", "avgpool"]
        if shape[1] <= 4:
            ops += ["up"]
    else:
        ops += ["linear", "linear", "ln"]
        if shape[0] >= 2 and shape[0] % 2 == 0:
            ops += ["pool1d"]
    return ops


@st.composite
def specs(draw, max_nodes: int = 10) -> Spec:
    """A random :class:`Spec`: a chain or a DAG of ``2..max_nodes`` ops."""
    family = draw(st.sampled_from(["conv", "mlp"]))
    dtype = draw(st.sampled_from(["float32", "float32", "float32", "float64", "bfloat16"]))
    batch = draw(st.integers(2, 6))
    if family == "conv":
        hw = draw(st.sampled_from([4, 8]))
        shape: tuple = (draw(st.integers(1, 6)), hw, hw)
    else:
        shape = (draw(st.integers(4, 32)),)
    n = draw(st.integers(2, max_nodes))
    shapes = [shape]
    nodes: list[Node] = []
    for i in range(n):
        last = len(shapes) - 1
        # mostly continue the main path; sometimes branch off an earlier value
        src = last if draw(st.integers(0, 9)) < 7 else draw(st.integers(0, last))
        joins = [j for j in range(len(shapes)) if j != src and shapes[j][1:] == shapes[src][1:]]
        kinds = _candidates(family, shapes[src])
        if joins:
            kinds += ["add", "cat", "mul"] * 2
        op = draw(st.sampled_from(kinds))
        inputs: tuple = (src,)
        if op in ("add", "mul", "cat"):
            same = [j for j in joins if shapes[j] == shapes[src]]
            if op != "cat" and not same:
                op = "cat"
            pool = joins if op == "cat" else same
            inputs = (src, draw(st.sampled_from(pool)))
            if draw(st.booleans()):
                inputs = inputs[::-1]
        width = draw(st.integers(1, 8) if family == "conv" else st.integers(2, 32)) if op in ("conv3", "conv1", "linear") else 0
        inplace = ""
        if op in _INPLACE_OK and draw(st.integers(0, 3)) == 0:
            inplace = draw(st.sampled_from(_INPLACE))
        node = Node(op, inputs, width, inplace)
        nodes.append(node)
        shapes.append(_out_shape(node, shapes[inputs[0]], shapes))
    return Spec(family, dtype, batch, shape, tuple(nodes), classes=draw(st.integers(1, 4)),
                input_requires_grad=draw(st.integers(0, 4)) == 0)


@st.composite
def stream_specs(draw, max_len: int = 6) -> Spec:
    """Random models where several tensors cross layer boundaries (docs/design.md §4):

    * ``two-tower``: two chains from the input, joined at the end (a CLIP-like model: the
      first tower's output waits while the second runs);
    * ``enc-dec``: an encoder chain whose output every few decoder ops read again (added,
      multiplied or concatenated: an encoder output read by each decoder layer);
    * ``skip``: one chain with long skip connections (values read again several ops later).

    Values keep one shape (``C`` channels or ``F`` features; a concatenation is followed by a
    1x1 convolution or a linear layer back to it), so any two may be joined.
    """
    family = draw(st.sampled_from(["conv", "mlp"]))
    kind = draw(st.sampled_from(["two-tower", "enc-dec", "skip"]))
    dtype = draw(st.sampled_from(["float32", "float32", "float64"]))
    batch = draw(st.integers(2, 4))
    if family == "conv":
        width = draw(st.integers(2, 6))
        shape: tuple = (width, 4, 4)
    else:
        width = draw(st.integers(4, 24))
        shape = (width,)
    unary = ["dropout", "bn", "relu", "gelu", "tanh", "silu"] + (
        ["conv3", "conv1", "gn"] if family == "conv" else ["linear", "ln"])
    nodes: list[Node] = []

    def add(op: str, inputs: tuple) -> int:
        w = width if op in ("conv3", "conv1", "linear") else 0
        inplace = ""
        if op in _INPLACE_OK and draw(st.integers(0, 4)) == 0:
            inplace = draw(st.sampled_from(_INPLACE))
        nodes.append(Node(op, inputs, w, inplace))
        if op == "cat":  # back to the common width
            nodes.append(Node("conv1" if family == "conv" else "linear", (len(nodes),), width, ""))
        return len(nodes)

    def chain(src: int, k: int) -> int:
        for _ in range(k):
            src = add(draw(st.sampled_from(unary)), (src,))
        return src

    def join(a: int, b: int) -> int:
        op = draw(st.sampled_from(["add", "mul", "cat"]))
        return add(op, (a, b) if draw(st.booleans()) else (b, a))

    if kind == "two-tower":
        a = chain(0, draw(st.integers(1, max_len)))
        b = chain(0, draw(st.integers(1, max_len)))
        out = chain(join(a, b), draw(st.integers(0, 2)))
    elif kind == "enc-dec":
        enc = chain(0, draw(st.integers(1, max_len)))
        dec = chain(0, draw(st.integers(1, 2)))
        for _ in range(draw(st.integers(1, 4))):
            dec = chain(join(dec, enc), draw(st.integers(1, 2)))
        out = dec
    else:
        out = add(draw(st.sampled_from(unary)), (0,))
        for _ in range(draw(st.integers(2, max_len + 2))):
            # (a concatenation's own output is twice as wide: only the layer after it is joined)
            back = [j for j in range(1, out - 1) if nodes[j - 1].op != "cat"]
            if back and draw(st.integers(0, 9)) < 4:
                out = join(out, draw(st.sampled_from(back)))
            else:
                out = add(draw(st.sampled_from(unary)), (out,))
    del out
    return Spec(family, dtype, batch, shape, tuple(nodes), classes=draw(st.integers(1, 3)),
                input_requires_grad=False, kind=kind)
