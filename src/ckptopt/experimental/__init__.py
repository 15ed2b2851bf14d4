"""Experimental: cuts before any graph node, several tensors crossing a cut.

Not part of the stable API: names and behaviour here may change between
releases. The stable path (:func:`ckptopt.optimize_checkpoints`) cuts only where
one tensor crosses, where the chain model is exact.

* :mod:`~ckptopt.experimental.dag`: the node-level cost model and simulator
  (no torch), :func:`simulate_dag`, brute force and local search over node cuts;
* :mod:`~ckptopt.experimental.nodes`: every graph node measured on fake tensors
  (:func:`trace_dag`), :func:`solve_nodes`, :func:`apply_node_plan` and
  :func:`optimize_nodes` (the node-level counterpart of ``optimize_checkpoints``).

``import ckptopt.experimental.dag`` does not import torch; the names of
:mod:`~ckptopt.experimental.nodes` are loaded on first use.
"""

from __future__ import annotations

from .dag import DagCosts, DagNode, DagResult, NodePlan, brute_force_dag, local_search_dag, simulate_dag

_NODES = ("TracedDag", "trace_dag", "op_nodes", "node_plan", "solve_nodes", "apply_node_plan", "optimize_nodes",
          "chain_plan_as_node_cuts")

__all__ = ["DagCosts", "DagNode", "DagResult", "NodePlan", "simulate_dag", "brute_force_dag",
           "local_search_dag", *_NODES]


def __getattr__(name: str):
    if name in _NODES:  # the torch side, loaded on first use
        from . import nodes

        return getattr(nodes, name)
    raise AttributeError(f"module 'ckptopt.experimental' has no attribute {name!r}")
