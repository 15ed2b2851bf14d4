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
