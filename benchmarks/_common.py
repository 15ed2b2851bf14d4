"""What every benchmark records about its run (imported by the scripts in this folder)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time

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


def cases_in_processes(script: str, cases: list[str], out_dir: str, prefix: str, device: str, timeout: float,
                       extra: tuple = ()):
    """Run each ``MODEL:PLAN`` case as ``script --child MODEL PLAN DEVICE PATH *extra`` in its own process
    (all at once, ``src/`` on the path, two threads each), then yield ``(case, record)`` for each that wrote a
    record without an error, saying why for the others (timeout, no result, the child's error)."""
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    procs = []
    for case in cases:
        name, plan = case.split(":")
        path = os.path.join(out_dir, f"{prefix}_{name}_{plan}.json")
        procs.append((case, path, time.perf_counter(), subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--child", name, plan, device, path, *map(str, extra)],
            env=env)))
    for case, path, t0, p in procs:
        try:
            p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            print(case, "timeout", flush=True)
            continue
        try:
            with open(path) as fh:
                r = json.load(fh)
        except (OSError, ValueError):
            print(case, "no result, exit", p.returncode, flush=True)
            continue
        if "error" in r:
            print(case, "ERROR", r["error"][:300], flush=True)
            continue
        yield case, r
