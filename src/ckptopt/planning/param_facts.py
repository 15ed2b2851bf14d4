"""What the parallel wrappers see of a model: its parameters, and the blocks FSDP2 shards.

:func:`param_facts` reads the parameters (sizes, first dimensions, trainable or not) and,
for FSDP2, which *unit* owns each one and which chain layers each unit's forward spans:
``fully_shard`` goes on each repeated block (:func:`repeated_blocks`) and on the root,
which owns every other parameter. The arithmetic is in :mod:`ckptopt.planning.parallel`
and :mod:`ckptopt.planning.fsdp` (no torch there).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..storages import distinct_storages, storage_nbytes
from ..torch_utils import Inputs
from ..tracer.capture.base import module_path
from .parallel import ParamFacts

__all__ = ["repeated_blocks", "param_facts", "compute_view", "compute_dtype", "held_inputs", "fsdp_options", "rank_trace"]


def repeated_blocks(model: nn.Module) -> list[str]:
    """The module paths FSDP2 is applied to besides the root, in forward order of definition.

    A transformers model names its blocks (``_no_split_modules``: ``LlamaDecoderLayer``);
    otherwise the blocks are the members of a ``ModuleList``/``Sequential`` of at least two
    modules of one class that hold parameters (a transformer's layers, a ResNet stage's
    blocks). The outermost such modules are taken: a block is never inside another. A module
    holding a parameter tied to one outside it is left to the root (FSDP2 shards a tied
    parameter in one group only).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[str] = []

    def inside(path: str) -> bool:
        return any(path == f or path.startswith(f + ".") for f in found)

    for path, mod in model.named_modules():
        if not path or inside(path):
            continue
        if names and type(mod).__name__ in names:
            found.append(path)
        elif not names and isinstance(mod, (nn.ModuleList, nn.Sequential)):
            kids = list(mod.named_children())
            if len(kids) >= 2 and len({type(k) for _, k in kids}) == 1 and \
                    all(any(True for _ in k.parameters()) for _, k in kids):
                found.extend(f"{path}.{n}" for n, _ in kids)
    return [path for path in found if not _shares_outside(model, path)]


def _shares_outside(model: nn.Module, path: str) -> bool:
    """Whether a parameter of ``path`` is also the model's under a name outside it (BERT's word
    embeddings, tied to the masked-LM decoder): FSDP2 cannot shard a tied parameter in two groups, so
    such a module is no unit of its own (its parameters stay with the root)."""
    inside = {id(p) for p in model.get_submodule(path).parameters()}
    return any(id(p) in inside and not name.startswith(path + ".")
               for name, p in model.named_parameters(remove_duplicate=False))


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(parallel) -> torch.dtype | None:
    """The dtype FSDP2's mixed precision gathers and computes in (``parallel.mixed_precision``), or None."""
    mp = getattr(parallel, "mixed_precision", None)
    return None if mp is None else _DTYPES[mp]


def held_inputs(inputs: Inputs, parallel) -> int:
    """Bytes of the floating inputs FSDP2's mixed precision casts (the caller holds them as given while
    the step runs on the casts); 0 without mixed precision."""
    dtype = compute_dtype(parallel)
    if dtype is None:
        return 0
    return sum(storage_nbytes(t) for t in distinct_storages(t for t in inputs.tensors()
                                                            if t.is_floating_point() and t.dtype != dtype))


def fsdp_options(parallel) -> dict:
    """``fully_shard``'s keywords for ``parallel``: its ``mp_policy`` under mixed precision ({} otherwise)."""
    dtype = compute_dtype(parallel)
    if dtype is None:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}


def rank_trace(model: nn.Module, inputs: Inputs, parallel, **trace_kwargs):
    """:func:`ckptopt.trace` of what a rank computes (:func:`compute_view`), the given float inputs held
    beside their casts in the static bytes."""
    import dataclasses

    from ..tracer import trace
    from .parallel import plus_static

    seen, seen_inputs, held = compute_view(model, inputs, parallel)
    tm = trace(seen, seen_inputs, **trace_kwargs)
    return dataclasses.replace(tm, costs=plus_static(tm.costs, held)) if held else tm


def compute_view(model: nn.Module, inputs: Inputs, parallel) -> tuple[nn.Module, Inputs, int]:
    """What a rank computes with: under FSDP2's mixed precision (``parallel.mixed_precision``), a
    meta-device copy of ``model`` whose floating parameters are in the compute dtype (FSDP2 gathers
    them cast; buffers keep theirs), the inputs with floating tensors cast (the root's
    ``cast_forward_inputs``), and the bytes of the floating inputs as given (held by the caller
    while the step runs on their casts); otherwise ``(model, inputs, 0)``. Nothing is copied but
    the module tree: the copy is traced as any meta model is."""
    dtype = compute_dtype(parallel)
    if dtype is None:
        return model, inputs, 0
    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point()
                                                        else p.dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    view = copy.deepcopy(model, memo)
    return view, inputs.map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t), held_inputs(inputs, parallel)


def _owner(name: str, units: list[str]) -> int:
    for u, path in enumerate(units):
        if name.startswith(path + "."):
            return u
    return -1


def param_facts(model: nn.Module, traced=None, blocks: list[str] | None = None, parallel=None) -> ParamFacts:
    """The parameters of ``model`` (each storage once, ``model.parameters()`` order) and, given the
    traced model, the FSDP2 units (``blocks``, default :func:`repeated_blocks`) with the chain
    layers each one's forward spans.

    A unit spans the layers from the first that runs an operation inside it (by the graph's
    module paths) to the last; a unit no layer runs in is dropped (its parameters go to the root).
    """
    named = dict(model.named_parameters(remove_duplicate=True))
    by_id = {id(p): n for n, p in named.items()}
    params = list(distinct_storages(named.values()))
    blocks = repeated_blocks(model) if blocks is None else list(blocks)
    span: dict[int, list[int]] = {}
    if traced is not None and blocks:
        nodes = {n.name: n for n in traced.gm.graph.nodes}
        for layer in traced.layers:
            for x in layer.nodes:
                node = nodes.get(x)
                if node is None:
                    continue
                path = module_path(node)
                u = _owner(path + ".", blocks) if path else -1
                if u >= 0:
                    lo_hi = span.setdefault(u, [layer.index, layer.index])
                    lo_hi[0], lo_hi[1] = min(lo_hi[0], layer.index), max(lo_hi[1], layer.index)
    kept = sorted(span, key=lambda u: span[u][0])
    renum = {u: k for k, u in enumerate(kept)}
    owner = [renum.get(_owner(by_id[id(p)], blocks), -1) for p in params] if kept else [-1] * len(params)
    mp = compute_dtype(parallel)
    return ParamFacts(
        nbytes=tuple(storage_nbytes(p) for p in params),
        compute_nbytes=tuple(storage_nbytes(p) * mp.itemsize // p.element_size() if mp is not None and
                             p.is_floating_point() else storage_nbytes(p) for p in params),
        dim0=tuple(int(p.shape[0]) if p.dim() else 1 for p in params),
        unit=tuple(owner),
        units=tuple((span[u][0], span[u][1]) for u in kept),
        unit_names=tuple(blocks[u] for u in kept),
        trainable=tuple(bool(p.requires_grad) for p in params),
        model_end=None if traced is None else _model_end(traced),
    )


def _model_end(traced) -> int:
    """The last layer of the model's own forward: before the loss layer when the loss is computed
    outside the model (FSDP2's root finishes its forward there)."""
    n = traced.n
    return n - 2 if n > 1 and tuple(traced.layers[-1].nodes) == ("<loss>",) else n - 1
