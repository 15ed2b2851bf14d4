"""Exact memory measurement: hand-computed peaks and per-layer figures, to the byte.

All sizes are float32 (4 bytes per element) on CPU. Each expected value is
derived from the shapes in the test, never read back from the tool.
"""

import gc

import pytest
import torch
from torch import nn

from ckptopt.measure import PeakMeasurement, measure_peak, measure_peak_detailed
from ckptopt.tracer import LayerMeasurement, measure_layer
from ckptopt.tracker import StorageTracker

F32 = 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------
# StorageTracker
# ---------------------------------------------------------------------------
def test_tracker_counts_allocations_and_frees():
    t = StorageTracker()
    with t:
        a = torch.ones(1000)
        b = torch.ones(500)
        assert t.current_bytes == 1500 * F32
        del a
        assert t.current_bytes == 500 * F32
        c = b * 2
        assert t.current_bytes == 1000 * F32
    assert t.peak_bytes == 1500 * F32
    del b, c  # frees are tracked after the block too
    assert t.current_bytes == 0
    t.detach()


def test_views_share_storage_and_are_not_double_counted():
    t = StorageTracker()
    with t:
        base = torch.ones(1000)
        views = [base.view(10, 100), base[::2], base[10:20], base.view(10, 100).t(), base.unsqueeze(0)]
        assert t.current_bytes == 1000 * F32
        del base
        assert t.current_bytes == 1000 * F32  # still alive through the views
        views.pop(0)
        assert t.current_bytes == 1000 * F32
        views.clear()
        assert t.current_bytes == 0
    assert t.peak_bytes == 1000 * F32
    t.detach()


def test_register_counts_each_storage_once():
    lin = nn.Linear(100, 50, bias=False)
    tied = nn.Sequential(lin, nn.ReLU())
    x = torch.zeros(4, 100)
    t = StorageTracker()
    t.register(lin, tied, x, x.view(400), (x[0], {"again": x}))
    assert t.current_bytes == 100 * 50 * F32 + 4 * 100 * F32
    assert t.peak_bytes == t.current_bytes
    t.detach()
    assert t.current_bytes == 0
    with pytest.raises(TypeError, match="tensors"):
        StorageTracker().register(3.0)


def test_register_counts_existing_grads():
    lin = nn.Linear(10, 10, bias=False)
    lin.weight.grad = torch.zeros(10, 10)
    t = StorageTracker()
    t.register(lin)
    assert t.current_bytes == 2 * 100 * F32
    t.detach()


def test_resize_in_place_is_followed():
    t = StorageTracker()
    with t:
        a = torch.empty(10)
        a.resize_(100)
        assert t.current_bytes == 100 * F32
    del a
    assert t.current_bytes == 0
    t.detach()


def test_backward_ops_and_accumulated_grads_are_counted():
    # The backward runs through the dispatch mode: the weight gradient that
    # AccumulateGrad stores in .grad must be one of the tracked storages.
    lin = nn.Linear(300, 200, bias=False)
    x = torch.randn(8, 300)
    t = StorageTracker(timeline=True)
    t.register(lin, x)
    with t:
        lin(x).pow(2).mean().backward()
    names = [name for _, name, _ in t.timeline]
    assert "aten.mm.default" in names and names.count("aten.mm.default") == 2  # forward and grad_W
    assert t.is_tracked(lin.weight.grad)
    # W + X + gW, the loss and its output are gone
    assert t.current_bytes == 2 * 300 * 200 * F32 + 8 * 300 * F32
    lin.weight.grad = None
    assert t.current_bytes == 300 * 200 * F32 + 8 * 300 * F32
    t.detach()


def test_timeline_is_consistent_with_peak():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x = torch.randn(16, 64)
    t = StorageTracker(timeline=True)
    t.register(model, x)
    start = t.current_bytes
    with t:
        model(x).pow(2).mean().backward()
    indices = [i for i, _, _ in t.timeline]
    assert indices == list(range(len(indices))) and len(indices) > 10
    assert all(cur >= start for _, _, cur in t.timeline)
    assert t.peak_bytes == max([start] + [cur for _, _, cur in t.timeline])
    # the last entry is the state after the last op; nothing is allocated after it
    for p in model.parameters():
        p.grad = None
    gc.collect()
    assert t.current_bytes == start
    t.detach()


def test_tracker_is_not_reentrant():
    t = StorageTracker()
    with t:
        with pytest.raises(RuntimeError, match="reentrant"):
            t.__enter__()


# ---------------------------------------------------------------------------
# measure_peak: hand-computed cases
# ---------------------------------------------------------------------------
def test_linear_peak_is_exactly_w_x_y_gw_plus_8():
    # docs/design.md §2: Linear 1000 -> 2000, no bias, batch 10.
    n, d_in, d_out = 10, 1000, 2000
    lin = nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(n, d_in)
    W = d_out * d_in * F32  # 8_000_000
    X = n * d_in * F32  # 40_000
    Y = n * d_out * F32  # 80_000: at the peak this is grad(Y); Y itself was freed by PowBackward
    gW = W
    scalars = 4 + 4  # the loss (held by the caller) and its seed gradient (held by the engine)
    # The peak is when mm allocates grad(W): everything else from the loss's
    # backward is freed by then, and X needs no gradient.
    assert measure_peak(lin, x) == W + X + Y + gW + scalars == 16_120_008
    assert lin.weight.grad is None


def test_sum_loss_hides_the_output_gradient():
    # docs/design.md §2: with .sum() the output gradient is an expanded 4-byte tensor.
    lin = nn.Linear(1000, 2000, bias=False)
    x = torch.randn(10, 1000)
    W, X = 2000 * 1000 * F32, 10 * 1000 * F32
    assert measure_peak(lin, x, loss_fn=lambda y: y.sum()) == W + X + W + 8
    assert measure_peak(lin, x) - measure_peak(lin, x, loss_fn=lambda y: y.sum()) == 10 * 2000 * F32


def test_two_layer_peak():
    # Linear(1000->2000) - ReLU - Linear(2000->500), no biases, batch 10.
    n = 10
    model = nn.Sequential(nn.Linear(1000, 2000, bias=False), nn.ReLU(), nn.Linear(2000, 500, bias=False))
    x = torch.randn(n, 1000)
    W1, W2 = 2000 * 1000 * F32, 500 * 2000 * F32
    X = n * 1000 * F32
    H = n * 2000 * F32  # hidden activation and its gradients
    Y = n * 500 * F32
    # Backward of layer 3 (mm for grad W2): W1 W2 X, ReLU output (saved), grad Y, gW2, grad(relu out).
    at_layer3 = W1 + W2 + X + H + Y + W2 + H + 8
    # Backward of layer 1 (mm for grad W1): the ReLU output, grad Y and grad(relu out) are freed;
    # grad(h1) from threshold_backward remains, with gW2 and the new gW1.
    at_layer1 = W1 + W2 + X + W2 + H + W1 + 8
    assert at_layer1 > at_layer3
    assert measure_peak(model, x) == at_layer1 == 24_120_008


def test_detailed_result_and_timeline():
    lin = nn.Linear(1000, 2000, bias=False)
    x = torch.randn(10, 1000)
    res = measure_peak_detailed(lin, x)
    assert isinstance(res, PeakMeasurement)
    assert res.peak_bytes == 16_120_008
    assert res.reserved_bytes is None and res.device == torch.device("cpu")
    start = 2000 * 1000 * F32 + 10 * 1000 * F32
    assert max(cur for _, _, cur in res.timeline) == res.peak_bytes
    assert res.timeline[0][2] == start  # aten.t of the weight is a view: nothing new
    assert [name for _, name, _ in res.timeline].count("aten.mm.default") == 2


def test_peak_with_tuple_args_and_dict_output():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(100, 100, bias=False)

        def forward(self, x, z, scale=1.0):
            return {"y": self.a(x) * scale, "idx": torch.arange(3), "z": z}

    model = Two()
    x, z = torch.randn(4, 100), torch.randn(7)
    peak = measure_peak(model, (x, z, 2.0))
    W, X, Z = 100 * 100 * F32, 4 * 100 * F32, 7 * F32
    assert peak >= W + X + Z + W  # parameters, inputs and the weight gradient
    assert peak == measure_peak(model, (x, z, 2.0))  # deterministic, no state left behind


def test_measure_peak_leaves_no_state():
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5))
    model.train()
    x = torch.randn(8, 16, requires_grad=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].weight.grad = torch.ones(16, 16)
    rng = torch.get_rng_state()
    measure_peak(model, x)
    assert all(p.grad is None for p in model.parameters())
    assert x.grad is None
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k  # running stats and num_batches_tracked restored
    assert torch.equal(rng, torch.get_rng_state())


def test_measure_peak_under_no_grad_still_runs_backward():
    lin = nn.Linear(1000, 2000, bias=False)
    with torch.no_grad():
        assert measure_peak(lin, torch.randn(10, 1000)) == 16_120_008


# ---------------------------------------------------------------------------
# measure_peak: bad input
# ---------------------------------------------------------------------------
def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        measure_peak(lambda x: x, torch.randn(2))
    with pytest.raises(TypeError, match="not model.parameters"):
        measure_peak(nn.Linear(2, 2).parameters(), torch.randn(2))


def test_inputs_on_another_device():
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"meta.*cpu"):
        measure_peak(lin, torch.empty(2, 4, device="meta"))
    with pytest.raises(ValueError, match="device"):
        measure_peak(lin, torch.randn(2, 4), device="meta")


def test_no_trainable_parameters():
    lin = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        measure_peak(lin, torch.randn(2, 4))


def test_detached_output():
    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).detach()

    with pytest.raises(ValueError, match="does not require grad"):
        measure_peak(Detached(), torch.randn(2, 4))


def test_bad_loss_fn():
    with pytest.raises(ValueError, match="scalar"):
        measure_peak(nn.Linear(4, 4), torch.randn(2, 4), loss_fn=lambda y: y * 2)


def test_checkpoints_and_fake_measurement():
    """measure_peak(checkpoints=...) measures the rewritten model; fake=True gives the same
    figure without running the model on real tensors."""
    from ckptopt import simulate, trace

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)], nn.Linear(64, 4))
    x = torch.randn(128, 64)
    tm = trace(model, (x,))
    for plan in [(), (2,), (1, 3, 5), tuple(range(1, tm.n))]:
        real = measure_peak(model, (x,), checkpoints=plan)
        assert measure_peak(model, (x,), checkpoints=plan, fake=True) == real
        assert abs(real - simulate(tm.costs, plan).peak_bytes) <= 8
    from ckptopt import solve

    best = solve(tm.costs, "dp2")
    assert measure_peak(model, (x,), checkpoints=best) == best.peak_bytes + 8  # + the scalar loss and its grad
    big = torch.zeros(1, 64).expand(1_000_000, 64)  # a 256 MB batch, measured without allocating it
    assert measure_peak(model, (big,), fake=True) > 1_000_000 * 64 * 4


# ---------------------------------------------------------------------------
# measure_layer
# ---------------------------------------------------------------------------
def _numel_bytes(*shape):
    n = 1
    for s in shape:
        n *= s
    return n * F32


def test_layer_linear():
    n, d_in, d_out = 10, 1000, 2000
    m = measure_layer(nn.Linear(d_in, d_out, bias=False), torch.randn(n, d_in))
    A, X, P = _numel_bytes(n, d_out), _numel_bytes(n, d_in), _numel_bytes(d_out, d_in)
    assert isinstance(m, LayerMeasurement)
    assert (m.a, m.p, m.sin, m.sout, m.m) == (A, P, True, False, 0)
    assert m.f == A  # one mm output, nothing else
    assert m.b == X + P  # the input gradient and the weight gradient
    assert m.input_bytes == X and m.saved_bytes == X


def test_layer_linear_with_bias():
    m = measure_layer(nn.Linear(100, 200), torch.randn(10, 100))
    P = _numel_bytes(200, 100) + _numel_bytes(200)
    assert (m.a, m.p, m.sin, m.sout, m.m) == (_numel_bytes(10, 200), P, True, False, 0)
    assert m.b == _numel_bytes(10, 100) + P


def test_layer_relu_saves_its_output():
    x = torch.randn(10, 1000)
    A = _numel_bytes(10, 1000)
    m = measure_layer(nn.ReLU(), x)
    assert (m.a, m.p, m.sin, m.sout, m.m, m.f, m.b) == (A, 0, False, True, 0, A, A)


def test_layer_inplace_relu_has_no_forward_transient():
    # docs/design.md §3: same saved set as ReLU, lower forward peak only.
    x = torch.randn(10, 1000)
    A = _numel_bytes(10, 1000)
    m = measure_layer(nn.ReLU(inplace=True), x)
    assert (m.a, m.sin, m.sout, m.m, m.f, m.b) == (A, False, True, 0, 0, A)
    assert not torch.equal(x, torch.relu(x))  # the caller's tensor was not modified


def test_layer_gelu_saves_its_input():
    m = measure_layer(nn.GELU(), torch.randn(10, 1000))
    assert (m.sin, m.sout, m.m) == (True, False, 0)


def test_layer_conv_saves_its_input():
    x = torch.randn(2, 3, 16, 16)
    m = measure_layer(nn.Conv2d(3, 8, 3, padding=1), x)
    P = _numel_bytes(8, 3, 3, 3) + _numel_bytes(8)
    assert (m.a, m.p, m.sin, m.sout, m.m) == (_numel_bytes(2, 8, 16, 16), P, True, False, 0)
    # input gradient + weight and bias gradients (CPU kernel scratch is invisible)
    assert m.b == _numel_bytes(2, 3, 16, 16) + P


def test_layer_batchnorm_saves_input_and_statistics():
    # On CPU native_batch_norm saves the input, the weight, the running mean and
    # variance (buffers: part of the static bytes K, so not in m) and the batch
    # mean and inverse std, 2*C*4 bytes: m counts those only.
    C = 8
    bn = nn.BatchNorm2d(C)
    m = measure_layer(bn, torch.randn(2, C, 16, 16))
    assert (m.sin, m.sout) == (True, False)
    assert m.m == 2 * C * F32
    assert m.buffer_bytes == 2 * C * F32 + 8  # running mean/var and the int64 num_batches_tracked
    assert m.f == m.a + 2 * C * F32
    assert bn.num_batches_tracked.item() == 0  # no state left behind


def test_layer_dropout_saves_a_float_mask():
    # docs/design.md §3: Dropout on CPU saves a full float32 mask.
    x = torch.randn(10, 1000)
    A = _numel_bytes(10, 1000)
    m = measure_layer(nn.Dropout(0.5), x)
    assert (m.a, m.sin, m.sout, m.m) == (A, False, False, A)
    assert m.f == 2 * A  # mask and output


def test_layer_linear_relu_dropout_saves_2a():
    A = _numel_bytes(10, 256)
    m = measure_layer(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Dropout()), torch.randn(10, 128))
    assert (m.sin, m.sout, m.m) == (True, False, 2 * A)


def test_layer_maxpool_saves_int64_indices():
    x = torch.randn(2, 8, 16, 16)
    m = measure_layer(nn.MaxPool2d(2), x)
    A = _numel_bytes(2, 8, 8, 8)
    assert (m.a, m.sin, m.sout, m.m) == (A, True, False, 2 * A)


def test_layer_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        measure_layer(torch.relu, torch.randn(3))
    with pytest.raises(TypeError, match="tensor"):
        measure_layer(nn.ReLU(), [torch.randn(3)])
    with pytest.raises(ValueError, match=r"meta.*cpu"):
        measure_layer(nn.Linear(3, 3), torch.empty(2, 3, device="meta"))
    with pytest.raises(TypeError, match="one tensor output"):
        measure_layer(nn.LSTM(3, 3), torch.randn(2, 1, 3))



def test_fake_tracker_matches_real_tracker():
    """Under FakeTensorMode the tracker (fake=True) gives the real run's figures exactly."""
    from torch._dynamo.utils import deepcopy_to_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ckptopt.tracker import StorageTracker

    def step(model, x, tracker):
        tracker.register(model, x)
        with tracker:
            model(x).pow(2).mean().backward()
        return tracker.peak_bytes, tracker.current_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(128, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
    fm = FakeTensorMode()
    fake_model = deepcopy_to_fake_tensor(model, fm)
    real = step(model, torch.randn(16, 64), StorageTracker())
    with fm:
        fake = step(fake_model, torch.empty(16, 64), StorageTracker(fake=True))
    assert real == fake
    # and a plain tracker ignores fake tensors entirely
    fake_model2 = deepcopy_to_fake_tensor(model, fm)
    with fm:
        ignored = step(fake_model2, torch.empty(16, 64), StorageTracker())
    assert ignored == (0, 0)


def test_fake_measurement_of_a_plan_does_not_copy_the_rewritten_module(monkeypatch):
    """fake=True with checkpoints traces the model and rewrites a fake copy of it. Copying the
    rewritten module instead overflowed the recursion limit on ResNet-50-sized graphs (its
    graph module's node list is deep-copied recursively); a copy now fails loudly here."""
    from ckptopt import CheckpointedModule, solve, trace, zoo

    def refuse(self, memo):
        raise AssertionError("a CheckpointedModule was deep-copied")

    monkeypatch.setattr(CheckpointedModule, "__deepcopy__", refuse, raising=False)
    torch.manual_seed(0)
    model, x = zoo.get("resnet18", batch_size=2, input_size=32)
    plan = solve(trace(model, x).costs, "sqrt").checkpoints
    assert plan
    assert measure_peak(model, x, checkpoints=plan, fake=True) == measure_peak(model, x, checkpoints=plan)
    # a rewritten module measured on fake tensors: its plan is applied again to a fake copy of
    # the original (paper_repro's batch sweep overflowed the recursion limit on ResNet-50 here)
    from ckptopt import Plan, apply_plan, simulate

    tm = trace(model, x)
    opt = apply_plan(model, tm, Plan(plan, simulate(tm.costs, plan).peak_bytes, "given", 0.0, tm.n))
    assert measure_peak(opt, x, fake=True) == measure_peak(opt, x)
    with pytest.raises(ValueError, match="already rewritten"):
        measure_peak(opt, x, checkpoints=plan, fake=True)


def test_fake_measurement_of_a_large_rewritten_module():
    """ResNet-50's rewritten module on fake tensors, at the default recursion limit."""
    import sys

    from ckptopt import optimize_checkpoints, zoo

    model, x = zoo.get("resnet50", batch_size=2, input_size=32)
    opt = optimize_checkpoints(model, x)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default (a deep copy of the graphs needs far more)
    try:
        measured = measure_peak(opt, x, fake=True)
    finally:
        sys.setrecursionlimit(limit)
    assert measured - opt.predicted_peak_bytes == 8


def test_a_loss_that_reads_its_own_targets_plans_exactly_and_trains_identically():
    """``loss_fn=lambda out: F.cross_entropy(out, target)`` with ``target`` a real tensor the loss
    closes over (not a model input): the fake runs take it in as a model input (its integer
    value kept, so a mask of the ignored rows runs), the plan's prediction is the measured peak,
    and the rewritten model trains as the original. It raised fake tensors' AssertionError."""
    import torch.nn.functional as F

    from ckptopt import optimize_checkpoints

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 512))
    x = torch.randn(64, 32)
    target = torch.randint(0, 512, (64,))
    target[::7] = -100  # ignored rows, dropped by a mask (an op whose output size depends on the values)
    loss_fn = lambda out: F.cross_entropy(out[target != -100], target[target != -100])  # noqa: E731
    opt = optimize_checkpoints(model, x, loss_fn=loss_fn, calibrate=False)
    assert measure_peak(opt, x, loss_fn) - opt.predicted_peak_bytes in (0, 8)  # (design §4: the 8-byte loss)
    assert measure_peak(model, x, loss_fn, fake=True) == measure_peak(model, x, loss_fn)
    loss_fn(opt(x)).backward()
    got = [p.grad.clone() for p in opt.parameters()]
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, model.parameters()))


def _ce_head_model():
    """An MLP whose loss (cross-entropy) does not save the logits: the step frees them after the loss."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 2048))
    x = torch.randn(256, 32)
    target = torch.randint(0, 2048, (256,))
    return model, x, (lambda out: F.cross_entropy(out, target))


def _kept_loop_peak(module, x, loss_fn, opt=None, steps=3) -> int:
    """The tracked peak of the last of ``steps`` steps of ``out = module(x); loss_fn(out).backward()``."""
    tracker = StorageTracker()
    tracker.register(module, x)
    out = None
    with tracker:
        for i in range(steps):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                for p in module.parameters():
                    p.grad = None
            if i == steps - 1:
                tracker.reset_peak()
            out = module(x)
            loss_fn(out).backward()
            if opt is not None:
                opt.step()
    del out
    return tracker.peak_bytes


def test_keep_output_measures_the_loop_that_keeps_the_output():
    """measure_peak(keep_output=True): the step of a loop that keeps ``out`` (alive through the
    backward, and the previous one through the forward), real and fake alike, as such a loop
    measures; here the logits, which the loss does not save, stay alive: +256 x 2048 x 4 B."""
    from ckptopt import Plan, apply_plan, trace

    model, x, loss_fn = _ce_head_model()
    tm = trace(model, x, loss_fn=loss_fn)
    for cps in ((), (2,), (1, 3)):
        module = apply_plan(model, tm, Plan(cps, 0, "given", 0.0, tm.n, ())) if cps else model
        kept = measure_peak_detailed(module, x, loss_fn, keep_output=True)
        assert kept.output_bytes == 256 * 2048 * 4
        assert kept.peak_bytes == measure_peak(module, x, loss_fn, keep_output=True, fake=True)
        assert kept.peak_bytes == _kept_loop_peak(module, x, loss_fn)
        assert kept.peak_bytes == measure_peak(module, x, loss_fn) + kept.output_bytes
