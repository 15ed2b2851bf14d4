"""Every solver against the brute-force oracle, the simulator and hand cases."""

import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ckptopt import (
    SOLVERS, ChainCosts, InfeasibleBudget, InvalidCosts, ProblemTooLarge, UnknownSolver, simulate, solve,
)
from ckptopt.solvers import baselines, exact
from ckptopt.solvers import solver_names

from .common.strategies import additive_costs, full_costs, random_additive, random_full

EXACT_FULL = ["brute", "dp", "dp2"]
BASELINES = ["none", "every", "sqrt", "chen-greedy", "uniform:1", "uniform:2", "uniform:3"]
ALL = EXACT_FULL + ["linear"] + BASELINES


# ---------------------------------------------------------------- exactness
@given(full_costs(max_n=12))
def test_dp_dp2_brute_agree_on_full_model(c):
    peaks = {s: solve(c, s).peak_bytes for s in EXACT_FULL}
    assert len(set(peaks.values())) == 1, peaks


@given(additive_costs(max_n=14))
def test_linear_equals_brute_on_additive(c):
    assert solve(c, "linear").peak_bytes == solve(c, "brute").peak_bytes


@given(st.integers(0, 2**32 - 1), st.integers(15, 300))
@settings(max_examples=150)
def test_linear_equals_dp2_on_large_additive(seed, n):
    c = random_additive(np.random.default_rng(seed), n)
    assert solve(c, "linear").peak_bytes == solve(c, "dp2").peak_bytes


def test_design_counterexample_to_greedy_binary_search():
    # docs/design.md §5: greedy "extend each segment" was wrong here.
    c = ChainCosts.additive(w=[10, 0, 14], h=[16, 7, 8], q=[24, 3, 27])
    opt = solve(c, "brute").peak_bytes
    assert solve(c, "linear").peak_bytes == solve(c, "dp").peak_bytes == opt


# ---------------------------------------------------------------- consistency
@given(st.one_of(full_costs(max_n=12), additive_costs(max_n=12)))
def test_every_solver_reports_the_simulated_peak_and_none_beats_the_optimum(c):
    opt = solve(c, "brute").peak_bytes
    for s in ALL:
        p = solve(c, s)
        assert p.peak_bytes == simulate(c, p.checkpoints).peak_bytes, s
        assert p.peak_bytes >= opt, s
        assert p.solver == s and p.n == c.n and p.solve_seconds >= 0
        assert list(p.checkpoints) == sorted(set(p.checkpoints))


@given(full_costs(max_n=10))
def test_exact_kernels_report_the_value_of_their_plan(c):
    full, K = True, c.kernel_arrays
    cpre = np.concatenate([[0], np.cumsum(c.c)]).astype(np.int64)
    SD, sc, side = exact._side_context(c)
    brute = lambda n, full, K: exact.brute_force_lex(n, full, K, cpre, SD, sc, side)[::2]  # (value, plan)
    for kern in (exact.dp_cubic, exact.dp_quadratic, brute):
        value, plan = kern(c.n, full, K)
        assert int(value) + c.static == simulate(c, tuple(int(x) for x in plan)).peak_bytes


def test_linear_on_full_model_is_scored_by_simulator():
    rng = np.random.default_rng(7)
    worse = 0
    for _ in range(200):
        c = random_full(rng, int(rng.integers(1, 40)))
        lin, opt = solve(c, "linear"), solve(c, "dp2")
        assert lin.peak_bytes == simulate(c, lin.checkpoints).peak_bytes >= opt.peak_bytes
        worse += lin.peak_bytes > opt.peak_bytes
    # the additive approximation is not always exact on the full model; it must not be absurd either
    assert worse < 200


def test_segments_property():
    c = ChainCosts.additive([0] * 5, [1] * 5, [1] * 5)
    p = solve(c, "uniform:2")
    assert p.segments == ((0, 1), (2, 4)) and p.checkpoints == (2,)
    assert solve(c, "none").segments == ((0, 4),)


# ---------------------------------------------------------------- hand cases
HAND = [
    # (name, costs, optimum, {solver: expected peak})
    ("n=1", ChainCosts.additive(w=[0], h=[5], q=[7], static=3), 10, {s: 10 for s in ALL}),
    ("n=1 full", ChainCosts(a=[4], p=[8], sin=[1], sout=[0], m=[0], f=[4], b=[12], static=20), 36,
     {s: 36 for s in ALL}),
    ("all zero", ChainCosts.additive(w=[0] * 6, h=[0] * 6, q=[0] * 6), 0, {s: 0 for s in ALL}),
    ("all zero full", ChainCosts(a=[0] * 5, p=[0] * 5, sin=[1] * 5, sout=[0] * 5, m=[0] * 5, f=[0] * 5,
                                 b=[0] * 5, static=9), 9, {s: 9 for s in ALL}),
    # layer 1's q dominates every plan: 1000 plus one byte of either h[0] or w[1]
    ("one huge layer", ChainCosts.additive(w=[0, 1, 1, 1], h=[1, 1, 1, 1], q=[1, 1000, 1, 1]), 1001,
     {s: 1001 for s in ALL}),
    # equal layers: none = 6+1 = 7, every = 2*3+1 = 7, two halves = max(3, 2+3) = 5
    ("equal layers", ChainCosts.additive(w=[0, 2, 2, 2], h=[2] * 4, q=[1] * 4), 5,
     {"none": 7, "every": 7, "uniform:2": 5, "sqrt": 5}),
    # three Linear-like layers: see test_simulate.test_hand_full_model
    ("mlp3", ChainCosts(a=[100] * 3, p=[0] * 3, sin=[1] * 3, sout=[0] * 3, m=[0] * 3, f=[100] * 3,
                        b=[100] * 3), 300, {"none": 400, "every": 400, "uniform:3": 400}),
]


@pytest.mark.parametrize("name, c, opt, expected", HAND, ids=[h[0] for h in HAND])
@pytest.mark.parametrize("solver", ALL)
def test_hand_cases(name, c, opt, expected, solver):
    p = solve(c, solver)
    if solver in EXACT_FULL or (solver == "linear" and c.is_additive):
        assert p.peak_bytes == opt
    else:
        assert p.peak_bytes >= opt
    if solver in expected:
        assert p.peak_bytes == expected[solver]


def test_mlp3_optimal_plan_is_unique():
    c = HAND[-1][1]
    for s in EXACT_FULL:
        assert solve(c, s).checkpoints == (2,)


# ---------------------------------------------------------------- baselines
def test_uniform_and_sqrt_split_by_count():
    c = ChainCosts.additive([0] * 10, [1] * 10, [1] * 10)
    assert solve(c, "uniform:2").checkpoints == (5,)
    assert solve(c, "uniform:5").checkpoints == (2, 4, 6, 8)
    assert solve(c, "uniform:1").checkpoints == ()
    assert solve(c, "uniform:99").checkpoints == tuple(range(1, 10))
    assert solve(c, "sqrt").checkpoints == (2, 4, 6)  # ceil(sqrt(10)) = 4 segments of 10 // 4, as torch does
    assert solve(c, "uniform:3").checkpoints == (3, 6)
    assert solve(c, "every").checkpoints == tuple(range(1, 10))
    assert solve(c, "none").checkpoints == ()


def test_chen_greedy_single_pass():
    sizes = np.array([5, 5, 5, 5, 5, 5], dtype=np.int64)
    starts, saved, biggest = baselines.chen_greedy_pass(sizes, 9)
    # running totals 5, 10 > 9 -> checkpoint after layer 1, then after layer 3; layer 5 is the end
    assert list(starts) == [2, 4] and saved == 10 and biggest == 10


# ---------------------------------------------------------------- budgets
@given(st.one_of(full_costs(max_n=10), additive_costs(max_n=10)), st.data())
def test_budget_path(c, data):
    opt = solve(c, "brute").peak_bytes
    budget = data.draw(st.integers(max(1, opt - 20), opt + 50))
    solver = data.draw(st.sampled_from(ALL))
    if budget < opt:
        with pytest.raises(InfeasibleBudget) as ei:
            solve(c, solver, budget=budget)
        assert ei.value.min_peak_bytes == opt and ei.value.budget_bytes == budget
        assert str(opt) in str(ei.value)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = solve(c, solver, budget=budget)
        assert p.peak_bytes <= budget
        assert p.peak_bytes == simulate(c, p.checkpoints).peak_bytes


def test_budget_falls_back_to_exact_with_warning():
    c = HAND[-1][1]  # mlp3: none peaks at 400, optimum 300
    with pytest.warns(UserWarning, match="over the budget"):
        p = solve(c, "none", budget=350)
    assert p.peak_bytes == 300 and p.solver == "dp2"


@pytest.mark.parametrize("budget", [0, -5, float("nan"), float("inf"), "1GB", True])
def test_bad_budgets(budget):
    with pytest.raises(ValueError):
        solve(HAND[0][1], "dp", budget=budget)


# ---------------------------------------------------------------- bad input
def test_unknown_solver_lists_valid_ones():
    with pytest.raises(UnknownSolver) as ei:
        solve(HAND[0][1], "optimal")
    for name in ("brute", "dp", "dp2", "linear", "chen-greedy", "uniform:K"):
        assert name in str(ei.value)
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("name", ["uniform", "uniform:x", "uniform:0", "dp:3"])
def test_bad_solver_arguments(name):
    with pytest.raises(UnknownSolver):
        solve(HAND[0][1], name)


def test_brute_refuses_large_n():
    c = ChainCosts.additive([0] * 21, [1] * 21, [1] * 21)
    with pytest.raises(ProblemTooLarge, match="dp2"):
        solve(c, "brute")
    assert solve(ChainCosts.additive([0] * 20, [1] * 20, [1] * 20), "brute").n == 20


def test_solve_rejects_non_costs():
    with pytest.raises(InvalidCosts, match="ChainCosts"):
        solve({"a": [1]}, "dp")


def test_registry_and_names():
    assert set(SOLVERS) == {"auto", "brute", "dp", "dp2", "linear", "budget", "none", "every", "sqrt", "chen-greedy",
                            "uniform"}
    assert "uniform:K" in solver_names()


@given(full_costs(max_n=10), st.data())
def test_auto_is_the_default_policy(c, data):
    """``auto``: dp2 improved with unwrapped segments without a budget, the budget solver with one."""
    from ckptopt.solvers import improve_with_stored

    auto, default = solve(c, "auto"), improve_with_stored(c, solve(c, "dp2"))
    assert (auto.checkpoints, auto.stored, auto.peak_bytes, auto.solver) == (
        default.checkpoints, default.stored, default.peak_bytes, default.solver)
    assert auto.peak_bytes <= solve(c, "brute").peak_bytes
    limit = data.draw(st.integers(max(1, auto.peak_bytes), simulate(c, ()).peak_bytes + 1))
    within, budget = solve(c, "auto", budget=limit), solve(c, "budget", budget=limit)
    assert (within.checkpoints, within.stored, within.peak_bytes) == (budget.checkpoints, budget.stored,
                                                                      budget.peak_bytes) and within.peak_bytes <= limit


def test_solvers_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; import ckptopt; from ckptopt import ChainCosts, solve; "
        "c = ChainCosts.additive([0, 1], [1, 1], [1, 1]); [solve(c, s) for s in ('dp', 'dp2', 'linear', 'brute')]; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stale_numba_caches_are_dropped_when_a_compiled_source_changes(tmp_path):
    """numba keys a cache by the caller's own file only: a changed callee must clear them all."""
    import shutil

    from ckptopt.simulator import kernels

    src = Path(kernels.__file__).resolve().parent.parent
    for rel in kernels.COMPILED_SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, tmp_path / rel)
    cache = tmp_path / "solvers" / "__pycache__"
    cache.mkdir()
    (cache / "exact.dp_cubic-1.py311.nbi").write_text("stale")
    assert kernels.drop_stale_caches(tmp_path)  # no stamp yet: dropped
    assert not list(cache.glob("*.nbi"))
    (cache / "exact.dp_cubic-1.py311.nbi").write_text("fresh")
    assert not kernels.drop_stale_caches(tmp_path)  # sources unchanged: kept
    assert list(cache.glob("*.nbi"))
    with open(tmp_path / "simulator" / "kernels.py", "a") as fh:
        fh.write("\n# changed\n")
    assert kernels.drop_stale_caches(tmp_path) and not list(cache.glob("*.nbi"))
