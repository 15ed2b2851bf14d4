"""One rank's training step under the strategy asked for: one process, DDP or FSDP2."""

from __future__ import annotations

from ..costs import ChainCosts
from .fsdp import fsdp_rank_costs
from .parallel import Parallel, ParamFacts, RankCosts, ddp_rank_costs, single_rank

__all__ = ["rank_costs"]


def rank_costs(costs: ChainCosts, facts: ParamFacts, param_bytes: int, parallel: Parallel | None) -> RankCosts:
    """The step of one rank of ``parallel`` whose local batch ``costs`` was traced on.

    Parameters
    ----------
    costs : ChainCosts
        The traced cost model of the local batch (static: parameters, buffers, inputs).
    facts : ParamFacts
        The parameters (:func:`ckptopt.planning.param_facts.param_facts`; FSDP2 needs its units).
    param_bytes : int
        Bytes of all parameters (trainable or not) in ``costs.static``.
    parallel : Parallel or None
        None: one process.
    """
    if parallel is None:
        return single_rank(costs, facts.sizes, param_bytes)
    if parallel.strategy == "ddp":
        return ddp_rank_costs(costs, facts, param_bytes, parallel)
    return fsdp_rank_costs(costs, facts, param_bytes, parallel, facts.model_end)
