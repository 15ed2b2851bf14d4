"""The (peak memory, step time) frontier of training-memory methods on small transformers models (CPU).

    python -m benchmarks.frontier                      # -> benchmarks/results/frontier/latest.json and frontier.png
    python -m benchmarks.frontier --small --rounds 2 --no-compile   # tiny sizes, a smoke run (latest-small.json)

Models, built from their transformers config classes (no weights), fp32, CPU, one thread, training mode
with the configs' default dropout: ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``BertForMaskedLM`` with 6
layers, ``T5ForConditionalGeneration`` with 3 encoder and 3 decoder blocks (6 blocks in all, for time);
width 512 (Llama's MLP 1,408 wide, BERT's and T5's 2,048), 8 heads, vocabulary 8,192, batch 4 x 512
tokens with labels (the ids for the causal LMs, 15% of the positions for BERT, random target ids of the
same length for T5). ``--small``: 2 layers (T5 1 + 1), width 64, 2 heads, vocabulary 256, batch 2 x 32.

A step is ``zero_grad(set_to_none=True)``, forward with the model's own loss (from ``labels``), backward;
no optimizer step, so what differs between methods is activation memory and recomputation. The methods
(each a point: measured peak of one step, median step time):

* ``none``: the model as it is.
* ``hf-every-layer``: transformers' checkpointing of every layer, non-reentrant
  (``benchmarks.harness.hf_checkpointing_enable``: ``activation_checkpointing_enable`` on transformers 5,
  of which ``gradient_checkpointing_enable`` is the deprecated alias).
* ``hf-every-2nd``: every second layer of each stack (layers 0, 2, 4, ...) checkpointed by hand: the
  layer instance's ``forward`` attribute is replaced by a function that calls the original bound
  ``forward`` through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. transformers 5's
  own ``activation_checkpointing_enable(every_n_layers=2)`` is measured beside it
  (``notes.hf_every_n_layers_2_tracker_bytes``): the same layers, except on T5, where it counts the
  encoder's and the decoder's blocks as one sequence.
* ``sac-mm-attn`` / ``sac-mm``: PyTorch's selective activation checkpointing as torchtitan applies it:
  every layer's forward through ``checkpoint(..., use_reentrant=False, context_fn=partial(
  create_selective_checkpoint_contexts, policy))``, the policy ``MUST_SAVE`` for the outputs of the
  matmul ops (``aten.mm``, ``aten.addmm``, ``aten.bmm``: what ``nn.Linear``, GPT-2's ``Conv1D`` and
  ``matmul`` dispatch to on the CPU) and, for ``sac-mm-attn``, of the fused attention kernels
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and the CUDA ones), ``PREFER_RECOMPUTE`` for the
  rest. The ops of one layer are listed first (the policy function sees every op); where no fused
  attention kernel runs (SDPA falls back to its math path, ``bmm`` + ``_safe_softmax``, when attention
  dropout is on) the two policies save the same ops and ``sac-mm-attn`` is left out, saying so.
* ``compile-<b>``: ``torch.compile`` (inductor) of ``forward + loss`` with
  ``torch._functorch.config.activation_memory_budget = b``, ``fullgraph=True``. Each budget is compiled
  separately: a fresh code object per budget and model (so each has its own dynamo cache entry), every
  call of it (the first compiles) run with its budget patched in; ``torch._dynamo.reset()`` is not used
  between them because the compiled steps must stay callable for the interleaved timing. Dynamo
  recompiles a function when a guard on global state fails (building another transformers model class
  grows a registry that the graphs guard on), so the compiled peaks are measured again after the warm-up
  step (``peak_profiler_bytes_after_warmup``), the graphs compiled in each warm-up step are counted
  (``graphs_compiled_in_warmup``), and so are those compiled during the timed rounds (``dynamo``).
* ``ckptopt``: ``optimize_checkpoints(model, batch, in_place=False)`` (the lowest peak), and
  ``ckptopt@<peer>``: ``optimize_checkpoints(model, batch, budget=<that peer's measured peak>,
  in_place=False)`` for every other method (for a compiled peer, its profiler-measured peak), and
  ``ckptopt@none`` at the plain model's peak: a plan that recomputes nothing, run through ckptopt's
  rewriter (one unwrapped segment), which should cost nothing against the model itself. The
  wrappers share the model's parameters. Each ckptopt row records the plan's predicted peak and
  predicted recomputation share (of a step, from the traced FLOPs), and ``1 + share`` as the FLOP-based
  predicted time ratio, beside the measured ones. ``--one-per-element`` adds ``ckptopt-1pe@<peer>``: the
  plan the same search chooses with every element of an operator without a FLOP formula counted as one
  FLOP (the compute count before ``ckptopt.tracer.op_time``), timed beside the rest. A budget plan that equals one already made is timed
  once (``same_plan_as``).

Peaks: eager methods with ckptopt's exact storage tracker (``ckptopt.measure_peak``: parameters, buffers
and the batch registered live, then every tensor storage the step makes). Compiled steps: inductor's CPU
code allocates its buffers outside the dispatcher, where the tracker cannot see them, so their peak is read
from ``torch.profiler`` (``profile_memory=True``): the CPU allocator's allocation and free events, in time
order, summed to a running peak, plus the same static bytes the tracker registers. The profiler is run on
every eager method as well and both figures recorded (``peak_profiler_bytes`` against
``peak_tracker_bytes``): the check of that method. (``prof.events()`` keeps only a few of the memory
events; the raw kineto events hold them all.) ``peak_vs_none`` divides by ``none``'s peak from the same
instrument (tracker for eager, profiler for compiled).

Step time: one warm-up step each, then ``--rounds`` rounds, each running every timed method once, the
order rotated by one each round; the median per method, and its ratio to ``none``'s median.

Writes ``benchmarks/results/frontier/latest.json`` (``latest-small.json`` with ``--small``) and the figure
``frontier.png`` beside it (``frontier-small.png``); ``--replot`` redraws the figure from the file. The
system load (``uptime``) is recorded before and after the run. On 2 shared cores the four models take
22-27 minutes to set up (planning and compiling included) and 7-8 minutes a round;
``--max-minutes M`` begins no round after M minutes (the rounds run are recorded).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import os
import statistics
import subprocess
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.harness import hf_checkpointing_enable, result_path, run_metadata, write_json  # noqa: E402

BENCH = "frontier"
MODELS = ("GPT2LMHeadModel", "LlamaForCausalLM", "BertForMaskedLM", "T5ForConditionalGeneration")
ALIASES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM",
           "t5": "T5ForConditionalGeneration"}
BUDGETS = (1.0, 0.7, 0.5, 0.3)
FULL = dict(layers=6, width=512, heads=8, vocab=8192, batch=4, seq=512)
SMALL = dict(layers=2, width=64, heads=2, vocab=256, batch=2, seq=32)
FAMILIES = ("none", "hf", "sac", "compile", "ckptopt", "ckptopt-compiled")


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------
def config(name: str, s: dict):
    """The transformers config of ``name`` at sizes ``s`` (T5: half the layers in the encoder, half in
    the decoder)."""
    import transformers as tf

    L, d, h, v = s["layers"], s["width"], s["heads"], s["vocab"]
    if name == "GPT2LMHeadModel":
        return tf.GPT2Config(n_layer=L, n_embd=d, n_head=h, vocab_size=v, n_positions=s["seq"], use_cache=False,
                              bos_token_id=v - 1, eos_token_id=v - 1)
    if name == "LlamaForCausalLM":
        return tf.LlamaConfig(num_hidden_layers=L, hidden_size=d, intermediate_size=int(2.75 * d),
                              num_attention_heads=h, num_key_value_heads=h, vocab_size=v,
                              max_position_embeddings=s["seq"], use_cache=False)
    if name == "BertForMaskedLM":
        return tf.BertConfig(num_hidden_layers=L, hidden_size=d, intermediate_size=4 * d, num_attention_heads=h,
                             vocab_size=v, max_position_embeddings=s["seq"])
    if name == "T5ForConditionalGeneration":
        return tf.T5Config(num_layers=L // 2, num_decoder_layers=L - L // 2, d_model=d, d_ff=4 * d, d_kv=d // h,
                           num_heads=h, vocab_size=v, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")


def build(name: str, s: dict) -> tuple[torch.nn.Module, dict]:
    """``(model, batch)``: the model in training mode (seed 0) and a batch as a collator yields it."""
    import transformers as tf

    torch.manual_seed(0)
    model = getattr(tf, name)(config(name, s)).train()
    if getattr(model, "loss_type", "") is None:
        # GPT2LMHeadModel's name matches no loss type: transformers falls back to ForCausalLM with a
        # warning, whose logging call breaks torch.compile's graph. Name the same loss.
        model.loss_type = "ForCausalLM"
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "BertForMaskedLM":
        labels = torch.full_like(ids, -100)
        chosen = torch.rand(ids.shape, generator=gen) < 0.15
        labels[chosen] = ids[chosen]
        batch["labels"] = labels
    elif name == "T5ForConditionalGeneration":
        batch["labels"] = torch.randint(0, s["vocab"], ids.shape, generator=gen)
    else:
        batch["labels"] = ids.clone()
    return model, batch


def layer_stacks(model) -> list:
    """The repeated layers, one list per stack (T5: encoder, decoder)."""
    name = type(model).__name__
    if name == "GPT2LMHeadModel":
        return [model.transformer.h]
    if name == "LlamaForCausalLM":
        return [model.model.layers]
    if name == "BertForMaskedLM":
        return [model.bert.encoder.layer]
    if name == "T5ForConditionalGeneration":
        return [model.encoder.block, model.decoder.block]
    raise ValueError(name)


def sizes_text(name: str, s: dict) -> str:
    layers = f"{s['layers'] // 2}+{s['layers'] - s['layers'] // 2} layers" if name.startswith("T5") \
        else f"{s['layers']} layers"
    return f"{layers}, width {s['width']}, {s['heads']} heads, vocab {s['vocab']:,}, batch {s['batch']}x{s['seq']}"


# --------------------------------------------------------------------------
# checkpointing by hand: every n-th layer, selective (SAC)
# --------------------------------------------------------------------------
def checkpoint_layer(layer, context_fn: Callable | None = None) -> None:
    """Replace ``layer.forward`` (on the instance) by its original bound forward run through
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False[, context_fn=...])`` when grad is on."""
    from torch.utils.checkpoint import checkpoint

    inner = layer.forward
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    layer.forward = forward


def checkpoint_every(model, every: int = 1, context_fn: Callable | None = None) -> None:
    """Checkpoint layers 0, every, 2 * every, ... of each stack."""
    for stack in layer_stacks(model):
        for i, layer in enumerate(stack):
            if i % every == 0:
                checkpoint_layer(layer, context_fn)


MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")
ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable")


def _op_name(func) -> str:
    return getattr(func, "_overloadpacket", func).__name__


def sac_policy(save: frozenset[str]) -> Callable:
    """An SAC policy: ``MUST_SAVE`` for ops whose name (the overload packet's) is in ``save``,
    ``PREFER_RECOMPUTE`` for the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if _op_name(func) in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac_context(save: frozenset[str]) -> Callable:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, sac_policy(save))


def first_layer_ops(model, batch: dict) -> dict[str, int]:
    """The aten ops the SAC policy function sees in one forward of the first layer of each stack (a copy
    of the model, each first layer run under SAC with a policy that records and recomputes everything),
    with their counts."""
    from collections import Counter

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    seen: Counter = Counter()

    def record(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            seen[str(func)] += 1
        return CheckpointPolicy.PREFER_RECOMPUTE

    probe = copy.deepcopy(model)
    for stack in layer_stacks(probe):
        checkpoint_layer(stack[0], functools.partial(create_selective_checkpoint_contexts, record))
    probe(**batch).loss.backward()
    del probe
    return dict(sorted(seen.items()))


# --------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------
def eager_step(module, batch: dict) -> None:
    loss = module(**batch).loss
    loss.backward()


def clear_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def static_bytes(model, batch: dict) -> int:
    """What the tracker registers as live before a step: parameters, buffers, the batch's tensors."""
    from ckptopt import StorageTracker

    tracker = StorageTracker()
    try:
        tracker.register(model, [v for v in batch.values() if torch.is_tensor(v)])
        return tracker.current_bytes
    finally:
        tracker.detach()


def profiler_peak_above_start(step: Callable[[], None]) -> tuple[int, int]:
    """``(peak, events)``: the largest running sum of the CPU allocator's allocation (+) and free (-)
    events that ``torch.profiler`` (``profile_memory=True``) records while ``step()`` runs, in time order;
    the number of memory events. Read from the raw kineto events: ``prof.events()`` keeps only some."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    mem = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events())
           if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    mem.sort()
    live = peak = 0
    for _, _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return int(peak), len(mem)


def profiler_peak(step: Callable[[], None], model, static: int) -> dict:
    """The profiler's peak of one step (gradients cleared before and after), static bytes added."""
    clear_grads(model)
    try:
        peak, events = profiler_peak_above_start(step)
    finally:
        clear_grads(model)
    return dict(peak_profiler_bytes=static + peak, profiler_events=events)


def _compiled_forward(i: int) -> Callable:
    """``forward(model, batch) -> loss`` with a code object of its own (``i`` in its name), so that
    dynamo keeps a separate cache entry for it."""
    def forward(model, batch):
        return model(**batch).loss

    code = forward.__code__.replace(co_name=f"frontier_forward_{i}", co_qualname=f"frontier_forward_{i}")
    return types.FunctionType(code, forward.__globals__, f"frontier_forward_{i}")


def compile_step(model, batch: dict, budget: float, i: int) -> tuple[Callable, float]:
    """A compiled step at ``activation_memory_budget = budget`` and its first run's wall time (compiling
    the forward and, in the first backward, the backward; the partition of both is made with the forward).

    Every call of the step runs with the budget patched in, not only the first: dynamo recompiles a
    function when a guard on global state fails, e.g. ``len(transformers.utils.output_capturing.
    _CAN_RECORD_REGISTRY)``, which grows when another model class runs for the first time, and a
    recompilation must partition with the same budget."""
    fn = torch.compile(_compiled_forward(i), fullgraph=True)

    def step():
        with torch._functorch.config.patch(activation_memory_budget=budget):
            fn(model, batch).backward()

    clear_grads(model)
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    clear_grads(model)
    return step, seconds


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (``counters['stats']['unique_graphs']``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


# --------------------------------------------------------------------------
# methods of one model
# --------------------------------------------------------------------------
@dataclass
class Method:
    """One point: how its step runs, and what was measured and predicted."""

    model: str
    name: str
    family: str
    step: Callable[[], None] | None
    params_of: Any
    row: dict = field(default_factory=dict)
    times: list[float] = field(default_factory=list)


def _eager(model_name: str, name: str, family: str, module, batch: dict, static: int, profile: bool) -> Method:
    from ckptopt import measure_peak

    step = functools.partial(eager_step, module, batch)
    row = dict(peak_tracker_bytes=measure_peak(module, batch))
    if profile:
        row.update(profiler_peak(step, module, static))
        row["profiler_minus_tracker_bytes"] = row["peak_profiler_bytes"] - row["peak_tracker_bytes"]
    row["peak_bytes"], row["peak_instrument"] = row["peak_tracker_bytes"], "tracker"
    return Method(model_name, name, family, step, module, row)


def peer_methods(name: str, model, batch: dict, ops: dict, static: int, profile: bool) -> tuple[list[Method], dict]:
    """``none``, HF every layer, every second layer, the SAC policies (each but ``none`` on a copy of the
    model); notes on what was left out and the check of the hand-wrapped every-2nd against HF's own
    ``every_n_layers=2`` where transformers has it."""
    methods = [_eager(name, "none", "none", model, batch, static, profile)]
    hf = copy.deepcopy(model)
    hf_checkpointing_enable(hf)
    methods.append(_eager(name, "hf-every-layer", "hf", hf, batch, static, profile))
    second = copy.deepcopy(model)
    checkpoint_every(second, 2)
    methods.append(_eager(name, "hf-every-2nd", "hf", second, batch, static, profile))
    notes = {}
    try:
        own = copy.deepcopy(model)
        own.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                            every_n_layers=2)
        from ckptopt import measure_peak

        notes["hf_every_n_layers_2_tracker_bytes"] = measure_peak(own, batch)
        del own
    except (AttributeError, TypeError, ValueError) as exc:
        notes["hf_every_n_layers_2"] = f"not run: {type(exc).__name__}: {exc}"
    names = {op.split(".")[1] for op in ops}
    mm = frozenset(n for n in names if n in MATMUL_OPS)
    attn = frozenset(n for n in names if n in ATTENTION_OPS)
    notes["sac_saves"] = {"sac-mm": sorted(mm), "sac-mm-attn": sorted(mm | attn)}
    variants = [("sac-mm-attn", mm | attn), ("sac-mm", mm)]
    if not attn:
        variants = variants[1:]
        notes["sac-mm-attn"] = ("left out: no fused attention kernel among the layer's ops (SDPA's math path), so "
                                "it would save the same ops as sac-mm")
    for label, save in variants:
        sac = copy.deepcopy(model)
        checkpoint_every(sac, 1, sac_context(save))
        methods.append(_eager(name, label, "sac", sac, batch, static, profile))
    return methods, notes


def compiled_methods(name: str, model, batch: dict, static: int, budgets, start: int) -> list[Method]:
    """``compile-<b>`` for each budget: compiled, run once, its peak from the profiler. A failure is
    recorded in the row (``error``) and the method left out of the timing."""
    out = []
    for k, b in enumerate(budgets):
        label = f"compile-{b:g}"
        try:
            before = dynamo_graphs()
            step, seconds = compile_step(model, batch, b, start + k)
            row = dict(compile_seconds=round(seconds, 2), activation_memory_budget=b,
                       graphs_compiled=dynamo_graphs() - before, static_bytes=static)
            row.update(profiler_peak(step, model, static))
            row["peak_bytes"], row["peak_instrument"] = row["peak_profiler_bytes"], "profiler"
            out.append(Method(name, label, "compile", step, model, row))
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            out.append(Method(name, label, "compile", None, model,
                              dict(activation_memory_budget=b, error=f"{type(exc).__name__}: {exc}"[:1500])))
            print(f"{name} {label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return out


def _ckptopt_row(module, seconds: float) -> dict:
    from ckptopt import simulate

    plan = module.plan
    share = simulate(module.traced.costs, plan.checkpoints, plan.stored).recompute_share
    return dict(predicted_peak_bytes=int(module.predicted_peak_bytes), predicted_recompute_share=share,
                predicted_time_vs_none_flops=1.0 + share, plan=list(plan.checkpoints), stored=list(plan.stored),
                solver=plan.solver, layers=module.traced.n, segments=len(plan.checkpoints) + 1,
                plan_seconds=round(seconds, 2))


def ckptopt_methods(name: str, model, batch: dict, peers: list[Method], static: int, profile: bool,
                    budget_peers=None, one_per_element: bool = False) -> list[Method]:
    """``ckptopt`` (lowest peak) and ``ckptopt@<peer>`` at each measured peer's peak (``budget=``; only
    the peers named in ``budget_peers`` when given); a plan equal to an earlier one is timed once
    (``same_plan_as``). With ``one_per_element``, also ``ckptopt-1pe@<peer>``: the plan chosen with every
    element of an operator without a FLOP formula counted as one FLOP (``ckptopt.tracer.op_time.PRICED``
    off: the compute count before the table), timed beside the others where it differs."""
    from ckptopt import InfeasibleBudget, optimize_checkpoints
    from ckptopt.tracer import op_time

    # (at the plain model's peak: a plan that recomputes nothing, through the rewriter)
    peers_in = [p for p in peers if "peak_bytes" in p.row and (budget_peers is None or p.name in budget_peers)]
    targets = [("ckptopt", "ckptopt", None, None)] + [(f"ckptopt@{p.name}", "ckptopt", p.name, p.row["peak_bytes"])
                                                      for p in peers_in]
    if one_per_element:
        targets += [(f"ckptopt-1pe@{p.name}", "ckptopt-1pe", p.name, p.row["peak_bytes"])
                    for p in peers_in if p.name != "none"]
    out: list[Method] = []
    by_plan: dict[tuple, Method] = {}
    for label, family, peer, budget in targets:
        t0 = time.perf_counter()
        op_time.PRICED = family != "ckptopt-1pe"
        try:
            module = optimize_checkpoints(model, batch, budget=budget, in_place=False)
        except InfeasibleBudget as exc:
            out.append(Method(name, label, family, None, model,
                              dict(budget_bytes=budget, budget_from=peer, error=f"InfeasibleBudget: {exc}"[:600])))
            continue
        finally:
            op_time.PRICED = True
        row = dict(budget_bytes=budget, budget_from=peer, **_ckptopt_row(module, time.perf_counter() - t0))
        key = (tuple(row["plan"]), tuple(row["stored"]))
        if key in by_plan:
            first = by_plan[key]
            row.update({k: first.row[k] for k in first.row if k.startswith("peak") or k.startswith("profiler")})
            row["same_plan_as"] = first.name
            out.append(Method(name, label, family, None, model, row))
            continue
        m = _eager(name, label, family, module, batch, static, profile)
        m.row = dict(row, **m.row)
        by_plan[key] = m
        out.append(m)
    return out


def ckptopt_compiled_methods(name: str, model, batch: dict, peers: list[Method], static: int,
                             start: int) -> list[Method]:
    """``ckptopt-compiled`` (the lowest-peak plan) and ``ckptopt-compiled@compile-<b>`` for each compiled
    peer: ``optimize_checkpoints(model, batch, budget=<the peer's profiler peak>)`` compiled as the peers
    are (inductor, ``fullgraph=True``, the partitioner's default budget 1.0), its peak from the profiler.
    The plan is made for the eager step, whose peak the tracer predicts; when the compiled step's peak
    comes out above the peer's, the budget is lowered by the excess and the plan made and compiled once
    more (``first_try``: the first plan's compiled peak). A budget below the eager step's lowest peak is
    met by the lowest plan when that plan's compiled peak is within it (``same_plan_as``)."""
    from ckptopt import InfeasibleBudget, optimize_checkpoints

    targets = [("ckptopt-compiled", None, None)] + [
        (f"ckptopt-compiled@{p.name}", p.name, p.row["peak_bytes"]) for p in peers
        if p.family == "compile" and "peak_bytes" in p.row]
    out: list[Method] = []
    for k, (label, peer, target) in enumerate(targets):
        budget, first = target, None
        for attempt in range(2):
            try:
                t0 = time.perf_counter()
                module = optimize_checkpoints(model, batch, budget=budget, in_place=False)
                plan_seconds = time.perf_counter() - t0
                step, seconds = compile_step(module, batch, 1.0, start + 2 * k + attempt)
            except Exception as exc:  # noqa: BLE001 - recorded (an infeasible budget included), the run goes on
                kind = "InfeasibleBudget" if isinstance(exc, InfeasibleBudget) else type(exc).__name__
                lowest = out[0] if out and out[0].step is not None else None
                if kind == "InfeasibleBudget" and lowest is not None and lowest.row["peak_bytes"] <= target:
                    # below the eager step's lowest peak, and the lowest plan compiled fits: that plan
                    row = dict(budget_bytes=budget, budget_from=peer, same_plan_as=lowest.name,
                               note=f"the budget is below the eager lowest peak ({kind}); the lowest plan compiled "
                                    "fits it", **{key: v for key, v in lowest.row.items()
                                                 if key.startswith(("peak", "profiler", "predicted", "plan"))})
                    if first:
                        row["first_try"] = first
                    out.append(Method(name, label, "ckptopt-compiled", None, model, row))
                    break
                row = dict(budget_bytes=budget, budget_from=peer, error=f"{kind}: {exc}"[:1500])
                if first:
                    row["first_try"] = first
                out.append(Method(name, label, "ckptopt-compiled", None, model, row))
                print(f"{name} {label}: FAILED {kind}: {str(exc)[:300]}", flush=True)
                break
            row = dict(budget_bytes=budget, budget_from=peer, compile_seconds=round(seconds, 2),
                       static_bytes=static, **_ckptopt_row(module, plan_seconds))
            row.update(profiler_peak(step, model, static))
            row["peak_bytes"], row["peak_instrument"] = row["peak_profiler_bytes"], "profiler"
            if target is None or row["peak_bytes"] <= target or attempt:
                if first:
                    row["first_try"] = first
                out.append(Method(name, label, "ckptopt-compiled", step, model, row))
                break
            first = dict(budget_bytes=budget, peak_profiler_bytes=row["peak_bytes"], plan=row["plan"])
            budget = budget - (row["peak_bytes"] - target)
    return out


def prepare_model(name: str, s: dict, budgets, compile_index: int, profile: bool = True,
                  budget_peers=None, one_per_element: bool = False) -> tuple[list[Method], dict]:
    """Every method of one model, each measured once; the model's record (sizes, ops, notes)."""
    t0 = time.perf_counter()
    model, batch = build(name, s)
    static = static_bytes(model, batch)
    ops = first_layer_ops(model, batch)
    peers, notes = peer_methods(name, model, batch, ops, static, profile)
    print(f"{name}: eager peers measured ({time.perf_counter() - t0:.0f} s)", flush=True)
    peers += compiled_methods(name, model, batch, static, budgets, compile_index)
    print(f"{name}: compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
    ours = ckptopt_methods(name, model, batch, peers, static, profile, budget_peers, one_per_element)
    print(f"{name}: ckptopt planned and measured ({time.perf_counter() - t0:.0f} s)", flush=True)
    if budgets:
        ours += ckptopt_compiled_methods(name, model, batch, peers, static, compile_index + len(budgets))
        print(f"{name}: ckptopt compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
    info = dict(model=name, sizes=dict(s), sizes_text=sizes_text(name, s), static_bytes=static,
                parameters=sum(p.numel() for p in model.parameters()),
                attn_implementation=getattr(model.config, "_attn_implementation", None),
                first_layer_ops=ops, notes=notes, setup_seconds=round(time.perf_counter() - t0, 1))
    return peers + ours, info


# --------------------------------------------------------------------------
# timing and the rows
# --------------------------------------------------------------------------
def timed_step(m: Method) -> float:
    clear_grads(m.params_of)
    t0 = time.perf_counter()
    m.params_of.zero_grad(set_to_none=True)
    m.step()
    seconds = time.perf_counter() - t0
    clear_grads(m.params_of)
    return seconds


def warm_up(methods: list[Method]) -> None:
    """One untimed step of each method; for a compiled one, the graphs dynamo compiled in it (a guard on
    global state may have failed since it was compiled and measured) and its profiler peak measured
    again after it (``peak_profiler_bytes_after_warmup``)."""
    for m in methods:
        if m.step is None:
            continue
        before = dynamo_graphs()
        timed_step(m)
        if m.family == "compile":
            m.row["graphs_compiled_in_warmup"] = dynamo_graphs() - before
            m.row["peak_profiler_bytes_after_warmup"] = profiler_peak(m.step, m.params_of,
                                                                      m.row["static_bytes"])["peak_profiler_bytes"]


def time_rounds(methods: list[Method], rounds: int, deadline: float | None = None) -> int:
    """``rounds`` rounds of every method once, the order rotated each round; no round is begun after
    ``deadline`` (``time.perf_counter()``). Returns the rounds run."""
    timed = [m for m in methods if m.step is not None]
    for r in range(rounds):
        if deadline is not None and r and time.perf_counter() > deadline:
            print(f"stopped after {r} rounds: the time limit", flush=True)
            return r
        t0 = time.perf_counter()
        k = r % len(timed)
        for m in timed[k:] + timed[:k]:
            gc.collect()
            m.times.append(timed_step(m))
        print(f"round {r + 1}/{rounds} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rounds


def rows_of(methods: list[Method], rounds: int) -> list[dict]:
    """The result rows: peaks and medians, each relative to ``none`` of its model (the peak by the same
    instrument)."""
    by_name = {(m.model, m.name): m for m in methods}
    rows = []
    for m in methods:
        none = by_name[(m.model, "none")]
        src = by_name.get((m.model, m.row.get("same_plan_as"))) if m.row.get("same_plan_as") else m
        row = dict(model=m.model, method=m.name, family=m.family, **m.row)
        if src.times:
            row["median_s"] = statistics.median(src.times)
            row["times_s"] = [round(t, 4) for t in src.times]
            row["time_vs_none"] = row["median_s"] / statistics.median(none.times)
            row["rounds"] = len(src.times)
        if "peak_bytes" in row:
            profiled = row["peak_instrument"] == "profiler"
            ref = none.row.get("peak_profiler_bytes") if profiled else none.row["peak_bytes"]
            if ref:
                row["peak_vs_none"] = row["peak_bytes"] / ref
            if "peak_profiler_bytes" in row and "peak_profiler_bytes" in none.row:
                row["peak_profiler_vs_none"] = row["peak_profiler_bytes"] / none.row["peak_profiler_bytes"]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------
# the figure
# --------------------------------------------------------------------------
STYLE = {"none": dict(marker="*", color="black", s=160), "hf": dict(marker="s", color="tab:blue", s=60),
         "sac": dict(marker="^", color="tab:green", s=70), "compile": dict(marker="D", color="tab:purple", s=50),
         "ckptopt": dict(marker="o", color="tab:red", s=45),
         "ckptopt-compiled": dict(marker="P", color="tab:orange", s=60)}
LEGEND = {"none": "no checkpointing", "hf": "HF checkpointing (every layer, every 2nd)",
          "sac": "SAC (keep matmul [+attention] outputs)", "compile": "torch.compile, activation_memory_budget",
          "ckptopt": "ckptopt (lowest peak; at each peer's peak)",
          "ckptopt-compiled": "ckptopt's plan under torch.compile (lowest; at each compile point's peak)"}


def _short(method: str) -> str:
    return (method.replace("hf-every-layer", "HF all").replace("hf-every-2nd", "HF 2nd")
            .replace("compile-", "c").replace("sac-mm-attn", "SAC mm+attn").replace("sac-mm", "SAC mm"))


def _ckptopt_label(r: dict, rows: list[dict]) -> str:
    """``lowest`` and/or the peers at whose peak this plan was chosen (one plan may serve several)."""
    same = [x["method"] for x in rows if x["method"] == r["method"] or x.get("same_plan_as") == r["method"]]
    return ", ".join("@" + _short(m.split("@", 1)[1]) if "@" in m else "lowest" for m in same)


def plot(rows: list[dict], models: list[dict], path: str, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(models)
    cols = 2 if n > 1 else 1
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(7.5 * cols, 5.6 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, info in zip(axes.flat, models):
        mine = [r for r in rows if r["model"] == info["model"] and "peak_vs_none" in r and "time_vs_none" in r]
        for fam in FAMILIES:
            pts = [r for r in mine if r["family"] == fam and not r.get("same_plan_as")]
            if not pts:
                continue
            ax.scatter([r["peak_vs_none"] for r in pts], [r["time_vs_none"] for r in pts], label=LEGEND[fam],
                       zorder=3, **STYLE[fam])
            if fam.startswith("ckptopt"):
                line = sorted(pts, key=lambda r: r["peak_vs_none"])
                ax.plot([r["peak_vs_none"] for r in line], [r["time_vs_none"] for r in line],
                        color=STYLE[fam]["color"], lw=1.2, zorder=2)
            for r in pts:
                text = _ckptopt_label(r, mine) if fam.startswith("ckptopt") else _short(r["method"])
                ax.annotate(text, (r["peak_vs_none"], r["time_vs_none"]), fontsize=6 if fam.startswith("ckptopt") else 7,
                            color=STYLE[fam]["color"] if fam.startswith("ckptopt") else "black",
                            xytext=(4, -9) if fam.startswith("ckptopt") else (4, 3),
                            textcoords="offset points")
        ax.axhline(1.0, color="grey", lw=0.6, ls=":")
        ax.axvline(1.0, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("peak memory / no checkpointing (compiled: profiler; eager: exact tracker)")
        ax.set_ylabel("step time / no checkpointing " + (f"(median of {rounds} rounds)" if rounds > 1
                                                          else "(1 round: one step each, no median)"))
        ax.set_title(f"{info['model']}\n{info['sizes_text']}, fp32, CPU 1 thread", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("Training-memory methods: peak against step time (lower left is better)", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------
def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError as exc:
        return f"uptime failed: {exc}"


def run(models: list[str], small: bool = False, rounds: int = 15, budgets=BUDGETS, profile: bool = True,
        budget_peers=None, max_minutes: float | None = None, one_per_element: bool = False) -> dict:
    """The benchmark's core: every model prepared (all kept in memory), then the interleaved rounds
    (none begun after ``max_minutes`` from the start); the rows and per-model records (no files written)."""
    t_start = time.perf_counter()
    s = SMALL if small else FULL
    methods, infos = [], []
    for i, name in enumerate(models):
        ms, info = prepare_model(name, s, budgets, compile_index=100 * i, profile=profile, budget_peers=budget_peers,
                                 one_per_element=one_per_element)
        methods += ms
        infos.append(info)
    t_warm = time.perf_counter()
    setup_graphs = dynamo_graphs()
    warm_up(methods)
    graphs = dynamo_graphs()
    t0 = time.perf_counter()
    print(f"warm-up done ({t0 - t_warm:.0f} s)", flush=True)
    done = time_rounds(methods, rounds, None if max_minutes is None else t_start + 60 * max_minutes)
    rows = rows_of(methods, done)
    return dict(rows=rows, models=infos, rounds=done, rounds_requested=rounds,
                setup_seconds=round(t_warm - t_start, 1), warm_up_seconds=round(t0 - t_warm, 1),
                rounds_seconds=round(time.perf_counter() - t0, 1),
                timed_methods=sum(m.step is not None for m in methods),
                dynamo=dict(graphs_after_setup=setup_graphs, graphs_before_rounds=graphs,
                            graphs_after_rounds=dynamo_graphs()))


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print("| model | method | peak / none | time / none | predicted peak / measured | predicted recompute | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pred, meas = r.get("predicted_peak_bytes"), r.get("peak_tracker_bytes")
        ratio = pred / meas if pred and meas else None
        print(f"| {r['model']} | {r['method']} | {_fmt(r.get('peak_vs_none'), '.3f')} | "
              f"{_fmt(r.get('time_vs_none'), '.3f')} | {_fmt(ratio, '.4f')} | "
              f"{_fmt(r.get('predicted_recompute_share'), '.1%')} | {(r.get('error') or '')[:80]} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS),
                    help=f"class names or {', '.join(ALIASES)} (default: all four)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="tiny sizes: a smoke run (writes latest-small.json)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile points")
    ap.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS),
                    help="activation_memory_budget values for torch.compile")
    ap.add_argument("--max-minutes", type=float, help="begin no round after this many minutes from the start")
    ap.add_argument("--out", help="default benchmarks/results/frontier/latest[-small].json")
    ap.add_argument("--replot", action="store_true", help="only redraw the figure from the result file (--out)")
    ap.add_argument("--one-per-element", action="store_true",
                    help="also time ckptopt's budget plans chosen with every element of an operator without a FLOP "
                         "formula counted as one FLOP (the compute count before ckptopt.tracer.op_time)")
    args = ap.parse_args(argv)
    models = [ALIASES.get(m.lower(), m) for m in args.models]
    out = args.out or result_path(BENCH, "small" if args.small else None)
    # (a run given its own --out draws beside it under its own name: the default run's figure stays)
    png = (os.path.splitext(out)[0] + ".png" if args.out else
           os.path.join(os.path.dirname(out), "frontier" + ("-small" if args.small else "") + ".png"))
    if args.replot:
        import json

        with open(out) as fh:
            res = json.load(fh)
        plot(res["rows"], res["models"], png, res["rounds"])
        print("wrote", png)
        return
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    load_before, t0 = uptime(), time.perf_counter()
    res = run(models, small=args.small, rounds=args.rounds, budgets=() if args.no_compile else args.budgets,
              max_minutes=args.max_minutes, one_per_element=args.one_per_element)
    meta = run_metadata(BENCH, "cpu")
    import resource

    meta.update(transformers=transformers.__version__, rounds=res["rounds"], rounds_requested=args.rounds,
                one_per_element=args.one_per_element,
                small=args.small, max_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                compile_budgets=[] if args.no_compile else args.budgets, load_before=load_before,
                load_after=uptime(), wall_seconds=round(time.perf_counter() - t0, 1),
                step="zero_grad(set_to_none=True) + forward with the model's loss + backward; no optimizer step")
    write_json(out, dict(meta=meta, **res))
    plot(res["rows"], res["models"], png, res["rounds"])
    print_table(res["rows"])
    print("wrote", out, "and", png)


if __name__ == "__main__":
    main()
