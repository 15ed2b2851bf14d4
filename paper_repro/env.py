"""Run metadata written into every result file: machine, device, versions, date, commit."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def device_name(device: str) -> str:
    """A readable name for the device the steps run on."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    proc = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    proc = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {proc}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def run_metadata(mode: str, device: str, measure: str) -> dict:
    """Machine, device, torch version, date, git commit and command of this run."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=f"{platform.node()} ({platform.platform()})",
        device=device,
        device_name=device_name(device),
        torch=torch.__version__,
        python=platform.python_version(),
        mode=mode,
        measured_with=("real tensors" if measure == "real" else "fake tensors (same byte counts, nothing allocated)")
        + (", torch.cuda.max_memory_allocated" if device.startswith("cuda") and measure == "real"
           else ", ckptopt's exact storage tracker"),
        git_commit=_git("rev-parse", "--short", "HEAD"),
        git_dirty=bool(dirty) if dirty is not None else None,
        command="python -m paper_repro " + " ".join(sys.argv[1:]),
    )


def metadata_line(meta: dict) -> str:
    """One line for a Markdown file or a figure footer."""
    return (f"{meta['date']} | {meta['device_name']} | torch {meta['torch']} | {meta['machine']} | "
            f"commit {meta['git_commit']}{' (dirty tree)' if meta.get('git_dirty') else ''} | {meta['command']}")
