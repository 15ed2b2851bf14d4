"""ckptopt under data parallelism: two CPU processes (gloo) against one process.

Wrap order: ``optimize_checkpoints`` first (on the plain model, with the
per-process batch), then ``DistributedDataParallel`` around the returned
module (or ``fully_shard`` on its blocks and root, FSDP2). After a few SGD
steps the parameters must equal those of single-process training of the
unmodified model on the same global batch. The loss is a mean over the
local batch and DDP averages gradients over the two ranks, so the update is
the same; only the order of the floating-point additions differs
(``rtol=1e-5, atol=1e-6``: measured differences are ~1e-8).
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD = 2
STEPS = 3
LOCAL_BATCH = 32  # large enough that the optimal plan checkpoints (parameters dominate below)
TIMEOUT_S = 180
RTOL, ATOL = 1e-5, 1e-6


class ResidualMLP(nn.Module):
    """Residual blocks with LayerNorm and GELU (no BatchNorm or Dropout: per-rank statistics and
    per-rank random masks would legitimately differ from one process on the whole batch)."""

    def __init__(self, d=32, depth=6):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(depth)])
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def make_model():
    torch.manual_seed(0)
    return ResidualMLP()


def global_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(LOCAL_BATCH * WORLD, 16, generator=g), torch.randn(LOCAL_BATCH * WORLD, 4, generator=g)) for _ in range(STEPS)]


def train(module, params, batches):
    opt = torch.optim.SGD(params, lr=0.1)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(module(x), y).backward()
        opt.step()


def _train_ddp(rank, batches):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptopt import optimize_checkpoints

    model = make_model()
    opt = optimize_checkpoints(model, batches[0][0], solver="dp2")  # first ckptopt, then DDP
    wrapped = DDP(opt)
    train(wrapped, wrapped.parameters(), batches)
    return model.state_dict(), opt.plan.checkpoints


def _train_fsdp2(rank, batches):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckptopt import optimize_checkpoints

    # everything on the CPU, explicitly: with CUDA present, fully_shard's default mesh puts the
    # shards on the GPU while the batches stay on the CPU
    mesh = init_device_mesh("cpu", (WORLD,))

    model = make_model()
    # first ckptopt, then shard. FSDP2 gathers a module's parameters in a forward pre-hook, so
    # every sharded module must be *called* by the rewritten forward: keep the blocks whole
    # (leaf_modules) instead of letting FX inline them into their Linear/LayerNorm calls.
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    opt = optimize_checkpoints(model, batches[0][0], solver="dp2", leaf_modules=blocks)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(opt, mesh=mesh)
    train(opt, opt.parameters(), batches)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return state, opt.plan.checkpoints


def _train_fsdp2_one_call(rank, batches):
    from ckptopt import optimize_checkpoints
    from ckptopt.planning import Parallel

    model = make_model()
    # one call: the blocks kept whole, the plan made for one FSDP2 rank, fully_shard applied
    opt = optimize_checkpoints(model, batches[0][0], parallel=Parallel(WORLD, "fsdp"))
    assert {type(m).__name__ for m in model.blocks} != {"Sequential"}  # FSDP2 made them FSDPModules
    train(opt, opt.parameters(), batches)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return state, opt.plan.checkpoints


def make_llama():
    """A small transformers Llama (captured by torch.export, whose graph inlines the decoder layers)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def llama_batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (4 * WORLD, 64), generator=g) for _ in range(STEPS)]


def train_llama(model, params, batches):
    opt = torch.optim.SGD(params, lr=0.1)
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def _train_fsdp2_one_call_hf(rank, batches):
    from ckptopt import optimize_checkpoints
    from ckptopt.planning import Parallel

    model = make_llama()
    ids = [b.chunk(WORLD)[rank] for b in llama_batches()]
    # one call on a model only torch.export captures: each decoder layer's operations run through the
    # layer's own call, so FSDP2's hooks gather it
    opt = optimize_checkpoints(model, {"input_ids": ids[0], "labels": ids[0]}, parallel=Parallel(WORLD, "fsdp"))
    assert opt is model and type(model.model.layers[0]).__name__ == "FSDPLlamaDecoderLayer"
    calls = [n for n in model.traced.gm.graph.nodes if n.op == "call_module"]
    assert len(calls) == 3, calls  # one call per decoder layer
    train_llama(model, model.parameters(), ids)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return state, model.plan.checkpoints


_MODES = (("ddp", _train_ddp), ("fsdp2", _train_fsdp2), ("fsdp2-one-call", _train_fsdp2_one_call),
          ("fsdp2-one-call-hf", _train_fsdp2_one_call_hf))


def _worker(rank: int, port: int, out_dir: str) -> None:
    import traceback

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        batches = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in global_batches()]
        for mode, fn in _MODES:
            try:
                state, checkpoints = fn(rank, batches)
                result = {"state": {k: v.detach().clone() for k, v in state.items()}, "checkpoints": checkpoints}
            except Exception:  # reported by the test of that mode, with the traceback
                result = {"error": traceback.format_exc()}
            torch.save(result, os.path.join(out_dir, f"{mode}-rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    """Spawn two ranks once (DDP, then FSDP2); kill them (by pid) if they run past TIMEOUT_S."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    out_dir = str(tmp_path_factory.mktemp("ranks"))
    ctx = mp.start_processes(_worker, args=(_free_port(), out_dir), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"the two ranks did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return {mode: [torch.load(os.path.join(out_dir, f"{mode}-rank{r}.pt")) for r in range(WORLD)]
            for mode, _ in _MODES}


def single_process_reference() -> dict:
    model = make_model()
    train(model, model.parameters(), global_batches())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_parameters(results, ref):
    start = make_model().state_dict()
    for r, res in enumerate(results):
        assert res["state"].keys() == ref.keys()
        for k in ref:
            assert not torch.equal(ref[k], start[k]), f"{k} did not train"
            torch.testing.assert_close(res["state"][k], ref[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {r}, {k}: {m}")
    for k in ref:  # the two ranks hold the same model
        assert torch.equal(results[0]["state"][k], results[1]["state"][k]), k


def _results(two_rank_results, mode):
    results = two_rank_results[mode]
    for r, res in enumerate(results):
        assert "error" not in res, f"{mode} failed on rank {r}:\n{res['error']}"
    return results


def test_ddp_two_cpu_ranks_equal_single_process(two_rank_results):
    results = _results(two_rank_results, "ddp")
    _assert_same_parameters(results, single_process_reference())
    assert results[0]["checkpoints"] and results[0]["checkpoints"] == results[1]["checkpoints"]


def test_fsdp2_two_cpu_ranks_equal_single_process(two_rank_results):
    results = _results(two_rank_results, "fsdp2")
    _assert_same_parameters(results, single_process_reference())
    assert results[0]["checkpoints"]


def test_fsdp2_in_one_call_without_leaf_modules(two_rank_results):
    """``optimize_checkpoints(model, x, parallel=Parallel(2, "fsdp"))`` keeps the blocks whole, plans for
    the rank and shards the module: it trains as one process on the global batch does."""
    results = _results(two_rank_results, "fsdp2-one-call")
    _assert_same_parameters(results, single_process_reference())
    assert results[0]["checkpoints"] == results[1]["checkpoints"]


def test_fsdp2_in_one_call_on_an_exported_transformers_model(two_rank_results):
    """A transformers model (only torch.export captures it: its graph inlines every decoder layer) planned
    and sharded in one call trains on two ranks as one process does on the global batch."""
    pytest.importorskip("transformers")
    results = _results(two_rank_results, "fsdp2-one-call-hf")
    model = make_llama()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train_llama(model, model.parameters(), llama_batches())
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for r, res in enumerate(results):
        assert res["state"].keys() == ref.keys()
        for k in ref:
            if "rotary" not in k:
                assert not torch.equal(ref[k], start[k]), f"{k} did not train"
            torch.testing.assert_close(res["state"][k], ref[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {r}, {k}: {m}")
    assert results[0]["checkpoints"] and results[0]["checkpoints"] == results[1]["checkpoints"]
