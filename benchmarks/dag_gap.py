"""What restricting cuts to single-tensor live sets costs: node-level plans vs chain plans.

For each model: the best plan over the tracer's single-tensor cuts (``solve(costs, "dp2")``)
and the best node-level plan (cuts anywhere in the topological order, several tensors
crossing), both scored by the node-level simulator (ckptopt.experimental.dag) and both *measured* (the
rewritten model run on fake tensors under the exact storage tracker). On the small DAGs the
node-level optimum is brute force over every plan; on zoo models, where 2**c plans are too
many, it is a local search started from the chain optimum (an upper bound on the optimum).

    python benchmarks/dag_gap.py [--quick]

writes benchmarks/results/dag_gap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import run_metadata  # noqa: E402

from ckptopt import solve, zoo  # noqa: E402
from ckptopt.experimental.dag import NodePlan, brute_force_dag, local_search_dag, simulate_dag  # noqa: E402
from ckptopt.experimental.nodes import apply_node_plan, solve_nodes, trace_dag  # noqa: E402
from ckptopt.measure import measure_plans_fake  # noqa: E402
from tests.test_dag_exactness import CASES  # noqa: E402

SMALL = ("resnet-like", "densenet-like", "unet-like")
ZOO = {
    "resnet50": dict(batch_size=2, input_size=64),
    "densenet121": dict(batch_size=2, input_size=64),
    "unet": dict(batch_size=2, input_size=64, base=8),
}


def fake_peak(model, inputs, td, cuts) -> int:
    """Measured peak of node plan ``cuts``: the rewritten model on fake tensors."""
    return measure_plans_fake(model, inputs, td.traced, [NodePlan(tuple(cuts), td.costs.n)],
                              apply=apply_node_plan)[0]


from ckptopt.experimental.nodes import chain_plan_as_node_cuts as chain_cuts  # noqa: E402


def one_model(name, model, inputs, brute: bool) -> dict:
    t0 = time.perf_counter()
    td = trace_dag(model, inputs)
    trace_s = time.perf_counter() - t0
    costs = td.costs
    chain = solve(td.traced.costs, "dp2")
    c_cuts = chain_cuts(td, chain.checkpoints)
    t0 = time.perf_counter()
    if brute:
        sims = brute_force_dag(costs)
        node_cuts, node_sim = min(sims, key=lambda kv: (kv[1], len(kv[0])))
        method = f"brute force over all {len(sims)} node-level plans"
    else:
        plan = solve_nodes(td)  # local search from the chain optimum and from no cut
        node_cuts, node_sim = plan.cuts, plan.peak_bytes
        method = "local search from the chain optimum and from no cut (upper bound on the node-level optimum)"
    search_s = time.perf_counter() - t0
    ls_cuts, ls_sim = local_search_dag(costs, c_cuts) if brute else (node_cuts, node_sim)
    none_measured = fake_peak(model, inputs, td, ())
    chain_measured = fake_peak(model, inputs, td, c_cuts)
    node_measured = fake_peak(model, inputs, td, node_cuts)
    row = dict(
        model=name, nodes=costs.n, cut_positions=len(costs.cuttable), chain_layers=td.traced.n,
        trace_seconds=round(trace_s, 2), search_seconds=round(search_s, 2), node_method=method,
        none_measured=none_measured,
        chain_plan_layers=list(chain.checkpoints), chain_plan_nodes=list(c_cuts),
        chain_simulated_chain_model=int(chain.peak_bytes), chain_simulated_dag=simulate_dag(costs, c_cuts).peak_bytes,
        chain_measured=chain_measured,
        node_plan=list(node_cuts), node_simulated=int(node_sim), node_measured=node_measured,
        gap_bytes=chain_measured - node_measured,
        gap_percent_of_chain=round(100.0 * (chain_measured - node_measured) / chain_measured, 3),
        chain_below_none_percent=round(100.0 * (none_measured - chain_measured) / none_measured, 3),
        node_below_none_percent=round(100.0 * (none_measured - node_measured) / none_measured, 3),
    )
    if brute:
        row.update(local_search_plan=list(ls_cuts), local_search_simulated=int(ls_sim))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small DAGs only")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dag_gap.json"))
    args = ap.parse_args()
    rows = []
    for name in SMALL:
        torch.manual_seed(0)
        model, inputs = CASES[name]()
        rows.append(one_model(name, model, inputs, brute=True))
        print(json.dumps(rows[-1]), flush=True)
    if not args.quick:
        for name, kw in ZOO.items():
            torch.manual_seed(0)
            model, inputs = zoo.get(name, **kw)
            row = one_model(name, model, (inputs,) if isinstance(inputs, torch.Tensor) else inputs, brute=False)
            row["zoo_args"] = kw
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = dict(run_metadata("dag_gap"), rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
