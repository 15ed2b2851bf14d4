"""A layer's compute: FLOPs for products, measured time per element for every other operator (op_time)."""

import torch
from torch import nn

from ckptopt import trace
from ckptopt.tracer.flops import layer_compute
from ckptopt.tracer.op_time import elements, weights_for, weights_from_table


class Act(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _cpu():
    w = weights_for("cpu")
    assert w is not None, "the CPU table ckptopt/data/op_time_cpu.json is missing"
    return w


def test_an_elementwise_op_costs_its_measured_time_per_element():
    w = _cpu()
    x = torch.randn(8, 64, requires_grad=True)
    forward, backward = layer_compute(Act(torch.tanh), [x])
    assert forward == x.numel() * w.weight("aten.tanh")
    assert backward == x.numel() * w.weight("aten.tanh_backward")
    assert w.weight("aten.tanh") > 10 * w.weight("aten.add_")  # a transcendental is not an addition


def test_a_dropout_mask_costs_more_than_the_product_beside_it():
    # BERT's attention dropout: the mask draw is several times a 64-wide product per element
    w = _cpu()
    x = torch.randn(4, 128, 64, requires_grad=True)
    drop, _ = layer_compute(Act(nn.Dropout(0.1)), [x])
    lin = nn.Linear(64, 64, bias=False)
    product, _ = layer_compute(lin, [x])
    assert product == 2 * x.numel() * 64  # FLOPs from the formula, untouched
    assert drop >= x.numel() * w.weight("aten.bernoulli_") > product


def test_a_layer_counts_its_own_backward():
    x = torch.randn(8, 32, requires_grad=True)
    lin = nn.Linear(32, 16)
    forward, backward = layer_compute(lin, [x])
    # the input's and the weight's gradients: two products of the forward's size, and the bias sum
    assert 2 * forward <= backward <= 2 * forward + x.shape[0] * 16 * _cpu().weight("aten.sum")
    _, none = layer_compute(lin, [x.detach()], backward=True)
    assert none > 0  # the parameters still take gradients
    frozen = nn.Linear(32, 16).requires_grad_(False)
    assert layer_compute(frozen, [x.detach()])[1] == 0  # nothing takes a gradient: no backward


def test_metadata_ops_and_views_cost_nothing():
    assert elements("prim.device", (torch.ones(3),), torch.device("cpu")) == 0
    assert elements("aten.sym_size", (torch.ones(3),), 3) == 0
    x = torch.randn(16, 16, requires_grad=True)
    assert layer_compute(Act(lambda t: t.view(-1).t()), [x]) == (0, 0)


def test_a_reduction_counts_what_it_reads_and_a_gather_what_it_writes():
    table = torch.randn(1000, 8)
    assert elements("aten.sum", (table,), table.sum(0)) == table.numel()
    rows = torch.tensor([1, 2, 3])
    assert elements("aten.embedding", (table, rows), table[rows]) == 3 * 8


def test_the_table_converts_time_to_flop_equivalents_at_the_product_rate():
    w = weights_from_table(dict(product_flops_per_second=1e11, ns_per_element={"a": 5.0, "b": 0.004, "c": 1.0}))
    assert w.weight("a") == 500 and w.weight("b") == 0 and w.weight("c") == 100
    assert w.default == 100  # an operator the table does not list: the median
    assert weights_for("meta") is None  # no table: one per element, as the counter always did


def test_a_traced_model_carries_forward_and_backward_compute():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32)).train()
    x = torch.randn(16, 32)
    costs = trace(model, x).costs
    assert costs.cb is not None and len(costs.cb) == costs.n
    assert costs.step_compute == int(costs.c.sum() + costs.cb.sum())
    by_name = dict(zip(costs.names, zip(costs.c, costs.cb)))
    c, cb = next(v for k, v in by_name.items() if "2" in k)  # the dropout: its backward is one product with the mask
    assert cb < c
