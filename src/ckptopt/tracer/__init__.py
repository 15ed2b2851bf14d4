"""The tracer stage: an ``nn.Module`` becomes a chain cost model, without allocating activations.

Its stages, a module each (``chain`` runs them in order)::

    model --capture-----> fx.GraphModule        (ckptopt.tracer.capture)
          --propagate---> fake value per node   (ckptopt.tracer.propagate)
          --cuts--------> layers between cuts    (ckptopt.tracer.cuts)
          --layer_costs-> measured layers        (ckptopt.tracer.layer_costs)
          --> ChainCosts                         (ckptopt.tracer.chain.trace)
"""

from __future__ import annotations

from .chain import Layer, TracedModel, trace
from .layer_costs import LayerMeasurement, measure_layer

__all__ = ["trace", "TracedModel", "Layer", "LayerMeasurement", "measure_layer"]
