"""Re-run the experiments of Hong et al. (arXiv 2502.12499) on ckptopt's model zoo.

``python -m paper_repro [--quick] [--device cpu|cuda] [--out DIR]`` runs every
experiment and writes JSON, Markdown tables and PNG figures; see
``paper_repro/README.md``. The paper's own tables are not available to us: this
reproduces the *shape* of its experiments (peak memory per strategy, solver
cost, time overhead) on our zoo, with our measured memory model.

Modules: :mod:`.config` (sizes per mode), :mod:`.env` (run metadata),
:mod:`.experiments` (the measurements), :mod:`.figures` (PNGs),
:mod:`.report` (Markdown), :mod:`.run` (the pipeline).
"""
