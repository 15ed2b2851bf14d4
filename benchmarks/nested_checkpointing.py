"""Nested (two-level) non-reentrant checkpointing of the BART configuration of hf_families.py, by hand.

Issue 19 asks BART to peak at most x0.90 of HF's checkpointing; ckptopt's plan (flat segments, each
recomputed at most once) peaks at x0.911. This measures whether nesting checkpoints (an outer one per
layer or sublayer, inner ones inside it, as torch.utils.checkpoint supports) goes lower: each variant
rewrites BART's layer forwards with the checkpoints named in VARIANTS.

Configuration: the BART configuration
(benchmarks/hf_families.py: BartForConditionalGeneration, 6+6 layers, width 256, FFN 1024,
batch 4x256, labels 4x64, dropout at config default, train mode), measured with ckptopt's
measure_peak exactly as the benchmark does (build after manual_seed(0), make_batch, measure_peak(module, batch),
the model's own .loss), one fresh process per variant, torch.set_num_threads(1).

Run: python -m benchmarks.nested_checkpointing [variant ...]   (each variant in a fresh subprocess;
     results merged into benchmarks/results/nested_checkpointing/latest.json; about 4 minutes for all)
"""
import argparse, json, os, time, warnings
from functools import partial

from benchmarks.harness import (child_args, hf_checkpointing_enable, result_path, run_child, run_metadata, write_json,
                                write_record)

NAME = "BartForConditionalGeneration"
MiB = 2 ** 20

# variant -> spec.  outer: "mine" (each layer's forward wrapped here), "hf" (transformers'
# activation_checkpointing_enable, use_reentrant=False) or None.  Inner regions (all non-reentrant):
#   sa / ca:  "attn" = the self-/cross-attention module call (q,k,v,sdpa,out_proj);
#             "sub"  = the whole sublayer: attention + dropout + residual + LayerNorm
#   ffn:      "fc1act" = fc1 + activation (inner region of the FFN); "sub" = fc1,act,dropout,fc2,dropout,residual,LN
VARIANTS = {
    "outer":                 dict(outer="mine"),
    "outer+ffn":             dict(outer="mine", ffn="fc1act"),
    "outer+sa":              dict(outer="mine", sa="attn"),
    "outer+sa+ca":           dict(outer="mine", sa="attn", ca="attn"),
    "outer+ffn+sa":          dict(outer="mine", ffn="fc1act", sa="attn"),
    "outer+ffn+sa+ca":       dict(outer="mine", ffn="fc1act", sa="attn", ca="attn"),
    "outer+sasub+casub":     dict(outer="mine", sa="sub", ca="sub"),
    "outer+sasub+casub+ffn": dict(outer="mine", sa="sub", ca="sub", ffn="fc1act"),
    "hf+ffn":                dict(outer="hf", ffn="fc1act"),
    "hf+ffn+sa":             dict(outer="hf", ffn="fc1act", sa="attn"),
    "hf+ffn+sa+ca":          dict(outer="hf", ffn="fc1act", sa="attn", ca="attn"),
    "hf+sa+ca":              dict(outer="hf", sa="attn", ca="attn"),
    "outer+sasub+casub+ffn+emb": dict(outer="mine", sa="sub", ca="sub", ffn="fc1act", emb=True),
    "outer+ffn+sa+ca+emb":   dict(outer="mine", ffn="fc1act", sa="attn", ca="attn", emb=True),
    # the encoder's embedding stage and enc0 in ONE outer checkpoint (input: input_ids), nested inside as above
    "outer+sasub+casub+ffn+emb0": dict(outer="mine", sa="sub", ca="sub", ffn="fc1act", emb="with_layer0"),
    "flat-sub":              dict(outer=None, sa="sub", ca="sub", ffn="sub"),   # no nesting: one level, finer
}
BENCH_WAYS = ("none", "hf", "ckptopt")   # run through the benchmark's own run_case


def ck(fn, *args, **kw):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(fn, *args, use_reentrant=False, **kw)


def _maybe(region, want, fn, *args):
    return ck(fn, *args) if region == want else fn(*args)


def _attn_sublayer(layer, attn, norm, inner):
    """Attention (checkpointed inside when ``inner == "attn"``), dropout, residual and ``norm``."""
    import torch.nn.functional as F

    def sub(h, *extra):
        residual = h
        h = ck(attn, h, *extra) if inner == "attn" else attn(h, *extra)
        h = F.dropout(h, p=layer.dropout, training=layer.training)
        return norm(residual + h)
    return sub


def _ffn_sublayer(layer, inner):
    """fc1 and the activation (checkpointed inside when ``inner == "fc1act"``), dropouts, fc2, residual, norm."""
    import torch.nn.functional as F

    def fc1act(h):
        return layer.activation_fn(layer.fc1(h))

    def sub(h):
        residual = h
        h = ck(fc1act, h) if inner == "fc1act" else fc1act(h)
        h = F.dropout(h, p=layer.activation_dropout, training=layer.training)
        h = layer.fc2(h)
        h = F.dropout(h, p=layer.dropout, training=layer.training)
        return layer.final_layer_norm(residual + h)
    return sub


def enc_forward(self, hidden_states, attention_mask, spec=None, **kwargs):
    """BartEncoderLayer.forward (transformers 5.24), with inner checkpoints per ``spec``."""
    sa, ffn = spec.get("sa"), spec.get("ffn")

    def attn(h):
        return self.self_attn(h, attention_mask=attention_mask, **kwargs)[0]

    sa_sub = _attn_sublayer(self, attn, self.self_attn_layer_norm, sa)
    ffn_sub = _ffn_sublayer(self, ffn)
    h = ck(sa_sub, hidden_states) if sa == "sub" else sa_sub(hidden_states)
    h = ck(ffn_sub, h) if ffn == "sub" else ffn_sub(h)
    return h   # (the fp16 clamp of the original is a no-op in fp32)


def dec_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                cache=None, use_cache=True, spec=None, **kwargs):
    """BartDecoderLayer.forward (transformers 5.24, cache unused: use_cache=False), with inner checkpoints."""
    sa, ca, ffn = spec.get("sa"), spec.get("ca"), spec.get("ffn")

    def sattn(h):
        return self.self_attn(h, cache=cache, attention_mask=attention_mask, **kwargs)[0]

    def cattn(h, enc):
        return self.encoder_attn(h, key_value_states=enc, attention_mask=encoder_attention_mask, cache=cache,
                                 **kwargs)[0]

    sa_sub = _attn_sublayer(self, sattn, self.self_attn_layer_norm, sa)
    ca_sub = _attn_sublayer(self, cattn, self.encoder_attn_layer_norm, ca)
    ffn_sub = _ffn_sublayer(self, ffn)
    h = ck(sa_sub, hidden_states) if sa == "sub" else sa_sub(hidden_states)
    if encoder_hidden_states is not None:
        h = ck(ca_sub, h, encoder_hidden_states) if ca == "sub" else ca_sub(h, encoder_hidden_states)
    h = ck(ffn_sub, h) if ffn == "sub" else ffn_sub(h)
    return h


def rewrite(model, spec):
    """Replace each Bart layer's forward (instance attribute) by the rewritten one; outer checkpoint per spec."""
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer
    for layer in list(model.model.encoder.layers) + list(model.model.decoder.layers):
        base = enc_forward if isinstance(layer, BartEncoderLayer) else dec_forward
        body = partial(base, layer, spec=spec)
        if spec.get("outer") == "mine":
            def fwd(*args, _body=body, **kw):
                return ck(partial(_body, **kw), *args)     # the way HF calls its checkpoint function
        else:
            fwd = body
        layer.forward = fwd
    if spec.get("emb") == "with_layer0":
        checkpoint_encoder_embedding_and_layer0(model.model.encoder, spec)
    elif spec.get("emb"):
        checkpoint_encoder_embedding(model.model.encoder)


def checkpoint_encoder_embedding_and_layer0(enc, spec):
    """As checkpoint_encoder_embedding, with enc0 (rewritten, nested) inside the same outer checkpoint, so
    that enc0's input is not kept: its 4D mask is rebuilt inside from the 2D mask (captured by a pre-hook
    on the encoder), and layers[0] then forwards its input."""
    import torch
    import torch.nn.functional as F
    from transformers.masking_utils import create_bidirectional_mask
    emb, pos, ln, p = enc.embed_tokens.forward, enc.embed_positions.forward, enc.layernorm_embedding.forward, enc.dropout
    layer0 = enc.layers[0]
    body0 = partial(enc_forward, layer0, spec=spec)
    seen = {}
    enc.register_forward_pre_hook(lambda m, a, k: seen.update(mask=k.get("attention_mask")), with_kwargs=True)

    def stage(ids, mask2d):
        x = emb(ids)
        x = x + pos(x[:, :, -1]).to(x.device)
        x = F.dropout(ln(x), p=p, training=enc.training)
        m4 = create_bidirectional_mask(config=enc.config, inputs_embeds=x, attention_mask=mask2d)
        return body0(x, m4)
    enc.embed_tokens.forward = lambda ids: ck(stage, ids, seen["mask"])
    enc.embed_positions.forward = lambda *a, **k: torch.zeros((), dtype=torch.float32)
    enc.layernorm_embedding.forward = lambda x: x
    enc.dropout = 0.0
    layer0.forward = lambda h, *a, **k: h


def checkpoint_encoder_embedding(enc):
    """One more checkpoint around the encoder's embedding stage (token embedding + positions +
    layernorm_embedding + dropout), which HF never checkpoints: module patches, since the stage is
    inline in BartEncoder.forward. embed_tokens returns the whole stage's output (under a checkpoint whose
    only input is input_ids); embed_positions then returns a 0-d zero (x + 0.0 == x), layernorm_embedding
    forwards its input (its parameters stay in place) and the encoder's own dropout p=0 (F.dropout(p=0) returns its input)."""
    import torch
    import torch.nn.functional as F
    emb, pos, ln, p = enc.embed_tokens.forward, enc.embed_positions.forward, enc.layernorm_embedding.forward, enc.dropout

    def stage(ids):
        x = emb(ids)
        x = x + pos(x[:, :, -1]).to(x.device)
        return F.dropout(ln(x), p=p, training=enc.training)
    enc.embed_tokens.forward = lambda ids: ck(stage, ids)
    enc.embed_positions.forward = lambda *a, **k: torch.zeros((), dtype=torch.float32)
    enc.layernorm_embedding.forward = lambda x: x
    enc.dropout = 0.0


def patch_modules_under_hf(model, spec):
    """HF's own outer checkpoint (class-level forward wrapper) + inner checkpoints by module patches:
    fc1.forward -> ckpt(act(fc1(x))) with the layer's activation_fn set to identity; self_attn/encoder_attn
    forward -> ckpt(attention)."""
    import torch
    for layer in list(model.model.encoder.layers) + list(model.model.decoder.layers):
        if spec.get("ffn") == "fc1act":
            fc1, act = layer.fc1, layer.activation_fn
            orig = fc1.forward
            fc1.forward = lambda x, _o=orig, _a=act: ck(lambda y: _a(_o(y)), x)
            layer.activation_fn = torch.nn.Identity()
        for key, attr in (("sa", "self_attn"), ("ca", "encoder_attn")):
            if spec.get(key) == "attn" and hasattr(layer, attr):
                mod = getattr(layer, attr)
                orig = mod.forward
                mod.forward = lambda *a, _o=orig, **k: ck(partial(_o, **k), *a)
        if spec.get(key := "sa") == "sub" or spec.get("ca") == "sub" or spec.get("ffn") == "sub":
            raise ValueError("sublayer regions need the rewritten forward")


def child(variant, path):
    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from benchmarks import hf_families as H
    import ckptopt.measure as M
    from ckptopt import measure_peak

    if variant in BENCH_WAYS:
        rec = H.run_case(NAME, variant, None)
        if variant == "hf":   # HF's checkpointing against the unmodified model, as the benchmark checks ckptopt
            m = H.build_model(NAME)
            hf_checkpointing_enable(m)
            rec["same_training"] = H.same_training(m, NAME, H.make_batch(NAME, None))
            del m
    else:
        spec = VARIANTS[variant]
        rec = dict(model=NAME, way=variant, spec=spec)
        t0 = time.perf_counter()
        model = H.build_model(NAME)
        batch = H.make_batch(NAME, None)
        if spec["outer"] == "hf":
            hf_checkpointing_enable(model)
            patch_modules_under_hf(model, spec)
        else:
            rewrite(model, spec)
        t = time.perf_counter()
        rec["measured_peak_bytes"] = int(measure_peak(model, batch))
        rec["measure_seconds"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        rec["same_training"] = H.same_training(model, NAME, batch)
        rec["check_seconds"] = round(time.perf_counter() - t, 2)
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        module = model
    # where the peak is: a second measurement, detailed, with module markers (counts recomputations too)
    if variant != "ckptopt":
        if variant in ("none", "hf"):
            module = H.build_model(NAME)
            batch = H.make_batch(NAME, None)
            if variant == "hf":
                    hf_checkpointing_enable(module)
        rec.update(locate_peak(module, batch, M))
    write_record(path, rec)


def locate_peak(model, batch, M):
    import torch
    holder, marks, calls = {}, [], {}

    class T(M.StorageTracker):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            holder["t"] = self
    orig_cls = M.StorageTracker
    M.StorageTracker = T

    def hook(name):
        def h(mod, args):
            t = holder.get("t")
            if t is None or t.timeline is None:
                return
            bw = torch._C._current_graph_task_id() != -1
            marks.append((len(t.timeline), name, bw))
            kind = name.split(".")[-1]
            calls[(kind, "backward" if bw else "forward")] = calls.get((kind, "backward" if bw else "forward"), 0) + 1
        return h
    handles = []
    for pre, layers in (("enc", model.model.encoder.layers), ("dec", model.model.decoder.layers)):
        for i, layer in enumerate(layers):
            for sub in ("self_attn", "encoder_attn", "fc1", "fc2", "final_layer_norm"):
                if hasattr(layer, sub):
                    handles.append(getattr(layer, sub).register_forward_pre_hook(hook(f"{pre}{i}.{sub}")))
    handles.append(model.lm_head.register_forward_pre_hook(hook("lm_head")))
    try:
        det = M.measure_peak_detailed(model, batch)
    finally:
        M.StorageTracker = orig_cls
        for h in handles:
            h.remove()
    tl = det.timeline
    pk = max(range(len(tl)), key=lambda i: tl[i][2])
    before = [m for m in marks if m[0] <= pk]
    last = before[-1] if before else None
    # first backward op index: first mark in backward, else None
    return dict(peak_detailed=det.peak_bytes, peak_op_index=pk, peak_op=tl[pk][1], n_ops=len(tl),
                peak_after_module=(f"{last[1]} ({'recompute' if last[2] else 'forward'}) pass" if last else None),
                module_calls={f"{k}/{p}": v for (k, p), v in sorted(calls.items())},
                forward_peak=max((c for i, n, c in tl if not any(m[2] for m in marks if m[0] <= i)), default=None))


def main():
    child_call = child_args()
    if child_call:
        path, (variant,) = child_call
        child(variant, path)
        return
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    every = list(BENCH_WAYS) + list(VARIANTS)
    ap.add_argument("variants", nargs="*", metavar="VARIANT", help="the variants to run (default all): " + ", ".join(every))
    names = ap.parse_args().variants or every
    unknown = [v for v in names if v not in every]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}")
    out_path = result_path("nested_checkpointing")
    res = json.load(open(out_path)) if os.path.exists(out_path) else {}
    for v in names:
        c = run_child("benchmarks.nested_checkpointing", [v], timeout=3600)
        if c.returncode != 0 or c.record is None:
            print(v, "FAILED", c.failure, c.output)
            continue
        rec = c.record
        rec["wall_seconds"] = round(c.seconds, 1)
        res[v] = rec
        res["meta"] = run_metadata("nested_checkpointing")  # (the last run's; each variant keeps its own time)
        write_json(out_path, res)
        st = rec.get("same_training") or {}
        print(f"{v:24s} {rec['measured_peak_bytes']:>12,d} B  peak at {rec.get('peak_after_module')} op {rec.get('peak_op')}"
              f"  bit_identical={st.get('bit_identical')} maxdiff={st.get('grad_max_abs_diff')}  [{rec['wall_seconds']} s]",
              flush=True)


if __name__ == "__main__":
    main()
