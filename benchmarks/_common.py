"""What every benchmark records about its run (imported by the scripts in this folder)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys

import torch


def run_metadata(benchmark: str) -> dict:
    """Name, date, machine, torch version and the exact command of this run."""
    return dict(
        benchmark=benchmark,
        date=dt.datetime.now().isoformat(timespec="seconds"),
        machine=dict(node=platform.node(), platform=platform.platform(), processor=platform.processor(),
                     python=platform.python_version(), cpus=os.cpu_count(), torch_threads=torch.get_num_threads()),
        torch=torch.__version__,
        command="python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    )


def compare_steps(la, ga: dict, lb, gb: dict) -> dict:
    """One step of a rewritten module (loss ``la``, gradients ``ga`` by parameter name) against one of
    the unmodified model (``lb``, ``gb``): the loss difference, the largest gradient difference, the
    parameters whose gradient only one of them has (or of another shape), and whether all are equal."""
    worst, identical, missing = 0.0, torch.equal(la, lb), []
    for key, g in gb.items():
        h = ga.get(key)
        if g is None and h is None:
            continue
        if g is None or h is None or g.shape != h.shape:
            missing.append(key)
            continue
        worst = max(worst, (g - h).abs().max().item())
        identical = identical and torch.equal(g, h)
    return dict(loss_ckptopt=la.item(), loss_unmodified=lb.item(), loss_abs_diff=abs(la.item() - lb.item()),
                grad_max_abs_diff=worst, grads_compared=len(gb) - len(missing), grads_missing=missing,
                bit_identical=identical and not missing)
