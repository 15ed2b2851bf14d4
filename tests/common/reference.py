"""An independent, deliberately naive simulator of one training step (docs/design.md §3).

It walks the step event by event and keeps an explicit set of live storages
(activations ``x{t}``, their gradients ``g{t}``, private saved tensors
``m{i}``, parameter gradients ``gp{i}``), so a tensor saved by two layers is
one set element. It shares no code with ``ckptopt._kernels`` (which uses
prefix sums and closed forms); the tests require both to agree.
"""

from __future__ import annotations


def reference_peak(costs, checkpoints, stored=()) -> int:
    """The peak of one step; ``stored``: start layers of middle segments left unwrapped."""
    if costs.is_additive:
        assert not stored
        return _additive(costs, checkpoints)
    return _full(costs, checkpoints, set(stored))


def _segments(n, checkpoints):
    starts = [0] + list(checkpoints)
    ends = [s - 1 for s in checkpoints] + [n - 1]
    return list(zip(starts, ends))


def _additive(c, checkpoints):
    w, h, q = (list(map(int, x)) for x in (c.w, c.h, c.q))
    best = 0
    held = 0
    for k, (l, r) in enumerate(_segments(c.n, checkpoints)):
        if k:
            held += w[l]
        for i in range(l, r + 1):
            best = max(best, held + sum(h[l:i]) + q[i])
    return c.static + best


def _full(c, checkpoints, stored):
    n = c.n
    a = [int(x) for x in c.a]
    p = [int(x) for x in c.p]
    f = [int(x) for x in c.f]
    ff = [int(x) for x in c.ff]  # f and fs with the input dying at its last use in the layer
    ffs = [int(x) for x in c.ffs]
    b = [int(x) for x in c.b]
    bk = [int(x) for x in c.bk]  # b with the input held through the backward
    bf = [int(x) for x in c.bf]  # b with nothing but the layer holding its input
    br = [int(x) for x in c.br]  # b and bk in a checkpointed segment (recomputed saved tensors die
    bkr = [int(x) for x in c.bkr]  # when the node reading them returns)
    brt = [int(x) for x in c.brt]  # ... and in the segment's last saving layer, from its first read on
    bkrt = [int(x) for x in c.bkrt]
    g = [int(x) for x in c.g]  # the storage a layer's output gradient lives in (a view of a larger one)
    m = [int(x) for x in c.m]
    fs = [int(x) for x in c.fs]
    rg = [int(x) for x in c.rg]
    dead = [bool(x) for x in c.dead]
    holds = [bool(x) for x in c.holds]  # keeps a saved tensor none of sin/sout/m counts (a static input)
    sin = [bool(x) for x in c.sin]
    sout = [bool(x) for x in c.sout]
    side = list(c.side)  # tensors crossing boundaries besides the chain tensor (s{j}, gradient sg{j})
    side_in_saved = [False] * n  # the layer saves a side tensor it reads (packed like an input)
    side_out_saved = [False] * n  # ... or one it computes (packed after computing it)
    for t in side:
        for u in t.saved_by:
            if u == t.producer:
                side_out_saved[u] = True
            else:
                side_in_saved[u] = True
    size = {}
    for t in range(n):
        size[f"x{t}"] = a[t]
        size[f"g{t}"] = g[t]
        size[f"m{t}"] = m[t]
        size[f"gp{t}"] = p[t]
        # gradients held when layer t's backward first reads a saved tensor (rg is measured with
        # an a-byte output gradient)
        size[f"r{t}"] = rg[t] + g[t] - a[t]
        size[f"rp{t}"] = int(c.rgp[t]) + g[t] - a[t]  # ... the most before that read (the first part)
    size["x-1"] = 0  # the model input lives in the static bytes
    groot = [int(x) for x in c.groot]  # the storage layer t's output gradient lives in
    for i in range(n):
        size[f"gh{i}"] = int(c.gh[i])
    for j, t in enumerate(side):
        size[f"s{j}"] = t.bytes
        size[f"sr{j}"] = t.bytes
        # a side gradient that views a layer's output gradient (a concatenation's slice) is that
        # storage, one token for every tensor viewing it, until the next consumer's contribution
        # is summed in: then a storage of its own (the tensor's size)
        if t.grad_view >= 0:
            size[f"sgv{t.grad_view}"] = max(size.get(f"sgv{t.grad_view}", 0), t.grad_bytes)
            size[f"sg{j}"] = t.bytes
        else:
            size[f"sg{j}"] = t.grad_bytes

    def side_grad_token(j, i):
        t = side[j]
        gc = t.grad_consumers
        split = gc[-2] if len(gc) > 1 else t.producer
        return f"sgv{t.grad_view}" if t.grad_view >= 0 and i >= split else f"sg{j}"

    def saved(i):
        s = {f"m{i}"}
        if sin[i]:
            s.add(f"x{i - 1}")
        if sout[i]:
            s.add(f"x{i}")
        return s

    def total(live):
        return sum(size[s] for s in live)

    segs = _segments(n, checkpoints)
    last = len(segs) - 1
    unwrapped = [k == last or l in stored for k, (l, r) in enumerate(segs)]
    seg_of = [k for k, (l, r) in enumerate(segs) for _ in range(l, r + 1)]
    peak = 0

    def saves_anything(i):
        return sin[i] or sout[i] or m[i] > 0 or holds[i] or side_in_saved[i] or side_out_saved[i]

    # Side tensors (docs/design.md §4). Holders of the forward copy: a checkpointed segment that
    # reads it and saves anything (its frame, released with the backward of its first saving
    # layer), and every layer of an unwrapped segment that saves it (released with its backward;
    # the producer's own checkpointed segment holds nothing: its recomputation makes a new copy).
    # The copy lives while the forward still needs it (to its last consumer, or to the end of a
    # checkpointed consumer segment, whose call holds its arguments), and while any holder has not
    # let go; a release counts after the releasing layer's backward.
    release = []  # per side tensor: the smallest releasing layer (None: never held) ...
    release_kind = []  # ... and who lets go there: "own" (a layer's saved reference) or "frame"
    fend = []  # the last forward layer that needs it
    for t in side:
        rho = []
        for k, (l, r) in enumerate(segs):
            if unwrapped[k]:
                rho += [(u, "own") for u in t.saved_by if l <= u <= r]
            elif t.producer < l and any(l <= u <= r for u in t.consumers):
                first = next((i for i in range(l, r + 1) if saves_anything(i)), None)
                if first is not None:
                    rho.append((first, "frame"))
        release.append(min(rho)[0] if rho else None)
        release_kind.append(min(rho)[1] if rho else None)
        ku = seg_of[t.consumers[-1]]
        lu, ru = segs[ku]
        fend.append(ru if not unwrapped[ku] and t.producer < lu else t.consumers[-1])

    def side_forward(i):
        return {f"s{j}" for j, t in enumerate(side) if t.producer < i and (i <= fend[j] or release[j] is not None)}

    has_frame = "fpre" in c.to_dict()["layers"]

    def gain(x, pre, post):
        """What x bytes present until a moment of a layer's backward add to its peak."""
        return max(pre + x, post) - max(pre, post)

    def side_released(i, rec_side=(), alone=False, frame_layer=False, ck=None):
        """(tokens let go mid-way through layer i's backward, what they add to its peak); ``alone``:
        nothing before layer i holds its input (the first layer of its segment): its splits then
        have the input go as its backward figure has it (with the frame, or its own last save);
        ``frame_layer``: layer i lets its checkpointed segment's frame go (its first saving layer);
        ``ck``: the checkpoint that frame holds. Where the splits are all of the recomputed timeline
        (not ``alone``), the frame (with ``ck``) and the recomputed copies let go here are one sequence
        of releases."""
        tokens, add, frame = set(), 0, 0
        fsplit = ((int(c.fkpre[i]), int(c.fkpost[i])) if alone else (int(c.fpre[i]), int(c.fpost[i]))) \
            if has_frame else None
        joint = frame_layer and has_frame and not alone
        entries = []  # (pre, post, bytes) of the recomputed copies released with the frame
        if joint and ck is not None:
            tokens.add(ck)
            frame += size[ck]
        for j, t in enumerate(side):
            if release[j] == i:
                tokens.add(f"s{j}")
                if release_kind[j] == "frame":
                    frame += t.bytes
                else:
                    add += own_gain(j, i, t.bytes, free=alone and sout[i - 1])  # (b is bf where i-1 saves nothing)
        for tok, first in rec_side:
            if first == i:
                tokens.add(tok)
                split = rec_split(int(tok[2:]), i)
                if joint and side[int(tok[2:])].saved_pre_rec:  # (a split of the recomputed timeline)
                    entries.append((*split, size[tok]))
                elif frame_layer and fsplit is not None and split == fsplit:
                    frame += size[tok]  # (a recomputed copy that goes at the frame's moment: one release)
                else:
                    add += own_gain(int(tok[2:]), i, size[tok], rec=True)
        if joint:
            add += releases(entries + [(*fsplit, frame)], max(fsplit))
        elif frame and has_frame:
            add += gain(frame, *fsplit)
        elif frame:
            add += frame
        return tokens, add

    def releases(entries, top):
        """What tensors let go one after another mid-way through a layer's backward add to its peak:
        in the order their splits say (a later release has a higher peak before it, or as high and a
        lower one after), the most of each peak before plus everything not yet let go, and the last peak
        after."""
        entries = sorted(entries, key=lambda e: (e[0], -e[1]))
        still, best = sum(e[2] for e in entries), []
        for pre, post, x in entries:
            best.append(pre + still)
            still -= x
        return max(best + [entries[-1][1]]) - top

    def rec_split(j, u):
        """A recomputed copy's release split at its saver ``u`` (None: not known)."""
        t = side[j]
        if not t.saved_pre:
            return None
        q = t.saved_by.index(u)
        return (t.saved_pre_rec[q], t.saved_post_rec[q]) if t.saved_pre_rec else (t.saved_pre[q], t.saved_post[q])

    def own_gain(j, u, x, rec=False, free=False):
        t = side[j]
        if not t.saved_pre:
            return x
        q = t.saved_by.index(u)
        if rec and t.saved_pre_rec:  # a recomputed copy: it goes with the node that read it
            return gain(x, t.saved_pre_rec[q], t.saved_post_rec[q])
        if free and t.saved_pre_free:  # its saver's input held by nothing but its own saves
            return gain(x, t.saved_pre_free[q], t.saved_post_free[q])
        return gain(x, t.saved_pre[q], t.saved_post[q])

    def side_backward(i):
        """Forward copies and gradients live while layer i's backward runs."""
        live = {f"s{j}" for j, t in enumerate(side) if release[j] is not None and i >= release[j]}
        live |= {side_grad_token(j, i) for j, t in enumerate(side)
                 if t.producer <= i < t.grad_last and t.grad_bytes}
        if f"sgv{groot[i]}" in live:  # layer i's own output gradient is the chain's g{i}, which then
            live.discard(f"sgv{groot[i]}")  # outlives the layer's backward (when an earlier layer's
            if size[f"sgv{groot[i]}"] > g[i]:  # (g{i} smaller: 0 for a layer whose only output is
                size[f"gs{i}"] = size[f"sgv{groot[i]}"] - g[i]  # the side tensor; the rest counted)
                live.add(f"gs{i}")
            if any(i > t.grad_split and side_grad_token(j, i) == f"sgv{groot[i]}"  # tensor views it): gh more
                   for j, t in enumerate(side) if t.producer <= i < t.grad_last and t.grad_bytes):
                live.add(f"gh{i}")
        return live

    def side_recompute(k, trigger, e, i):
        """Side tensors live while layer i of segment k is recomputed (its backward started at trigger)."""
        live = {f"s{j}" for j, t in enumerate(side) if release[j] is not None and trigger >= release[j]}
        live |= {side_grad_token(j, trigger) for j, t in enumerate(side)
                 if t.producer < trigger < t.grad_last and t.grad_bytes}
        live -= {f"sgv{groot[trigger]}"}  # the trigger's output gradient (its r{trigger})
        l, r = segs[k]
        for j, t in enumerate(side):
            p = t.producer
            if not l <= p < i:
                continue
            # the recomputed copy lives to its last consumer the recomputation runs, or to the
            # stop when a later segment reads it (the segment returns it), or a layer saves it
            saved = any(p <= u <= trigger for u in t.saved_by)  # (its packs are re-done, run or not)
            if t.consumers[-1] > r or saved or t.consumers[-1] > e or i <= t.consumers[-1]:
                live.add(f"sr{j}")
        return live

    def side_saved_after_recompute(k, trigger, e):
        """Recomputed side tensors a layer of segment k saves: (token, first saver). The
        recomputation re-does every pack up to the last saving layer (trigger), run or not."""
        l, r = segs[k]
        out = []
        for j, t in enumerate(side):
            if l <= t.producer <= e:
                savers = [u for u in t.saved_by if t.producer <= u <= trigger]
                if savers:
                    out.append((f"sr{j}", min(savers)))
        return out
    # ---- forward
    ckpt = set()  # checkpoints held (inputs of segments 1..k)
    kept = {}  # per unwrapped segment (a stored one or the last): the saved sets its layers keep

    def kept_before(k):
        return set().union(*(v for j, v in kept.items() if j < k))

    for k, (l, r) in enumerate(segs):
        # docs/design.md §4: a checkpointed segment keeps its input only if it saves
        # something; an unwrapped one only if its first layer saves its input
        if k and (sin[l] if unwrapped[k] else any(saves_anything(i) for i in range(l, r + 1))):
            ckpt.add(f"x{l - 1}")
        if unwrapped[k]:
            kept[k] = set()
        for i in range(l, r + 1):
            live = ckpt | kept_before(k + 1) | {f"x{i - 1}"} | side_forward(i)  # a layer's input is live while it runs
            if k and not unwrapped[k]:  # ... and a checkpointed segment's call holds its argument until it returns
                live.add(f"x{l - 1}")
            # ... until its last use inside the layer when nothing else holds it: neither a save (of a
            # stored or the last segment's layers; a checkpoint keeps none in its first pass), nor a
            # checkpoint, nor the call, nor the caller (the model input)
            held_by_other = (i == 0 or f"x{i - 1}" in ckpt or f"x{i - 1}" in kept_before(k + 1)
                             or (unwrapped[k] and (sin[i] or (i > l and sout[i - 1])))
                             or (not unwrapped[k] and i == l))
            peak = max(peak, total(live) + (f[i] if held_by_other else ff[i]))
            if unwrapped[k]:
                kept[k] |= saved(i)
    # ---- backward, last segment first
    grads = set()  # parameter gradients accumulated so far
    for k in range(last, -1, -1):
        l, r = segs[k]
        # b is measured with the input held iff the previous layer saves its output. The first
        # layer of a segment has its input held by an earlier layer only if the previous segment
        # is stored and its last layer saves its output; otherwise only by the checkpoint's frame
        # while the layer's saved tensors live (bk), or by nothing else when unwrapped (bf)
        prev_keeps = k > 0 and unwrapped[k - 1] and sout[l - 1]
        first_saving = next((j for j in range(l, r + 1) if saves_anything(j)), None)
        bseg = b if unwrapped[k] else br
        if l == 0 or prev_keeps:
            b_first = bseg[l]
        elif unwrapped[k]:
            b_first = bf[l] if sout[l - 1] else b[l]  # (b is measured that way where l-1 saves nothing)
        else:
            b_first = bkr[l]
        held = set(ckpt) | kept_before(k) | grads | {f"g{r}"}
        top = r  # the backward continues from here after the recomputation
        if unwrapped[k]:
            seg_saved = set(kept[k])
        else:
            # layers at the end that save nothing: their backward reads no saved tensor, so the
            # engine runs it before anything triggers the recomputation
            while top >= l and not saves_anything(top):
                gone, add = side_released(top, alone=top == l and l > 0 and not prev_keeps)
                peak = max(peak, total((held | grads | {f"g{top}"} | side_backward(top)) - gone) + add
                           + (b_first if top == l else bseg[top]))
                grads.add(f"gp{top}")
                held.discard(f"g{top}")
                if top > l:
                    held.add(f"g{top - 1}")
                top -= 1
            # recompute layer by layer. Non-reentrant checkpoint stops at the last *pack
            # event* of the segment: a layer packs its input before it computes and its
            # output/extra tensors after. If the last event is after a layer's compute, that
            # layer runs up to it (fs); if it is an input pack, the layer before runs fully
            # (unless the layer computes before packing its input: a dead op ahead of it).
            events = []
            for i in range(l, r + 1):
                # an input, or a static tensor it keeps (holds), is packed before the layer
                # computes, unless work precedes it (fs > 0)
                if sin[i] or holds[i] or side_in_saved[i]:
                    events.append((i, 1 if fs[i] > 0 else 0))
                if sout[i] or m[i] > 0 or side_out_saved[i]:
                    events.append((i, 1))
            # tensors packed and then dropped (a dead branch) are re-packed as well, if anything
            # triggers the recomputation at all (a tensor the segment keeps)
            dropped = [(i, 1 if fs[i] > 0 else 0) for i in range(l, r + 1) if dead[i]]
            stop = max(events + dropped) if events else None
            # the last layer the recomputation runs (a last input pack is not run)
            stop_layer = -1 if stop is None else (stop[0] if stop[1] == 1 else stop[0] - 1)
            rec_side = side_saved_after_recompute(k, top, stop_layer) if stop is not None else []
            if top >= l:  # the trigger's backward up to its first read: no recomputed tensor exists yet
                peak = max(peak, total((held - {f"g{top}"}) | grads | {f"rp{top}"}
                                       | side_recompute(k, top, stop_layer, l)))
            seg_saved = set()
            for i in range(l, r + 1):
                if stop is None or (i, 0) == stop or i > stop[0]:
                    if sin[i] and i > l:
                        seg_saved.add(f"x{i - 1}")
                    break
                if sin[i] and i > l:
                    seg_saved.add(f"x{i - 1}")
                # the backward of layer top started: its gradients are r{top}, not g{top}
                live = (held - {f"g{top}"}) | grads | {f"r{top}"} | seg_saved | ({f"x{i - 1}"} if i > l else set())
                live |= side_recompute(k, top, stop_layer, i)
                held_by_other = i == l or f"x{i - 1}" in seg_saved or sin[i]  # (recomputed saves are kept)
                peak = max(peak, total(live) + ((fs[i] if held_by_other else ffs[i]) if (i, 1) == stop
                                                else (f[i] if held_by_other else ff[i])))
                seg_saved |= saved(i) - {f"x{l - 1}"}
                if (i, 1) == stop:
                    break
        for i in range(top, l - 1, -1):
            live = held | grads | seg_saved | saved(i) | {f"g{i}"} | side_backward(i)
            if not unwrapped[k]:
                live |= {tok for tok, first in rec_side if first <= i}
            lets_ck_go = not unwrapped[k] and k and i == first_saving and f"x{l - 1}" not in kept_before(k)
            gone, add = side_released(i, rec_side if not unwrapped[k] else (), i == l and l > 0 and not prev_keeps,
                                      not unwrapped[k] and i == first_saving,
                                      f"x{l - 1}" if lets_ck_go and i > l else None)
            bi = b_first if i == l else bseg[i]
            if not unwrapped[k] and i == top:  # (from its first read on)
                bi = brt[i] if i > l or l == 0 or prev_keeps else bkrt[l]
            peak = max(peak, total(live - gone) + add + bi)
            # after layer i's backward: its saved set is released unless an earlier layer
            # of the segment also saved the same storage; its parameter gradient stays.
            still = set().union(*(saved(j) for j in range(l, i))) if i > l else set()
            seg_saved = (seg_saved - saved(i)) | (seg_saved & still)
            grads.add(f"gp{i}")
            held.discard(f"g{i}")
            if i > l:
                held.add(f"g{i - 1}")
            # a checkpoint's frame (holding x{l-1}) goes with the segment's last saved tensor,
            # released by the backward of its first layer that saves one
            if lets_ck_go:
                held.discard(f"x{l - 1}")
        if k:
            ckpt.discard(f"x{l - 1}")
    return c.static + peak
