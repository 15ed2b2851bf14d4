"""ckptopt's benchmarks: each script runs from the repository root as ``python -m benchmarks.<name>``.

``benchmarks/harness.py`` holds what they share (run metadata, child processes, step comparison, batch
helpers, where results go); ``python -m benchmarks.report`` writes ``benchmarks/RESULTS.md`` from the newest
result of each benchmark in ``benchmarks/results/<benchmark>/``.
"""
