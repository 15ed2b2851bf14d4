"""A small model of repeated blocks and the per-rank checks of tests/test_parallel.py, shared by the
in-process runs (fake process group) and the spawned gloo ranks."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn


class Block(nn.Module):
    """A residual MLP block (the residual inside, as in a transformer layer)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h, bias=False)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class Blocks(nn.Module):
    """Blocks of different widths, a 3-row head: first dimensions that do not divide by 2, 4 or 8
    (FSDP2 pads their shards), so every rank's optimizer state differs."""

    def __init__(self, d: int = 64, depth: int = 4, features: int = 16):
        super().__init__()
        self.inp = nn.Linear(features, d)
        self.blocks = nn.ModuleList([Block(d, 2 * d + 8 * i + 4) for i in range(depth)])
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@contextlib.contextmanager
def fake_world(world: int, rank: int):
    """PyTorch's fake process group as rank ``rank`` of ``world`` (collectives move no data; memory is
    what a real rank allocates), with a 1-D CPU device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def make(d: int = 64, batch: int = 32):
    torch.manual_seed(0)
    return Blocks(d), torch.randn(batch, 16)


def predicted_and_measured(parallel, optimizer: str, d: int = 64, batch: int = 32, mesh=None,
                           model_and_inputs=None, loss_fn=None) -> list[tuple]:
    """``(label, plan, predicted, measured)`` for no checkpointing and the optimal plan of one rank
    (``model_and_inputs``: another model and its batch; default :func:`make`'s)."""
    from ckptopt import estimate
    from ckptopt.measure import measure_rank_step

    model, x = model_and_inputs or make(d, batch)
    est = estimate(model, x, optimizer=optimizer, parallel=parallel, loss_fn=loss_fn)
    out = []
    for pe in (est.no_checkpointing, est.optimal):
        measured = measure_rank_step(copy.deepcopy(model), x, parallel, optimizer=optimizer,
                                     checkpoints=pe.checkpoints or None, stored=pe.stored, mesh=mesh,
                                     loss_fn=loss_fn)
        out.append((pe.label, pe.checkpoints, pe.peak_bytes, measured))
    return out
