"""Lab 11: one step's tensors, stop strings streamed with hold-back, aborting a request (with Lab 09's release),
and the capstone (the engine with the student's own parts)."""

from functools import partial

import torch

from catalogue import Right, Wrong
from catalogue.lab10 import schedule
from labkit.cache.sequence_blocks import BlockSequence
from labkit.engine.model_runner import ModelRunner, flatten_step
from labkit.sampling.stop import find_stop_string


# --- prepare_step ---------------------------------------------------------------------------------
def step(token_ids, num_computed, num_new, block_tables, block_size, *, positions_from_zero=False,
         recompute_cached=False, k_counts_new_only=False, k_counts_all=False, lengths_not_sums=False, slot_shift=0,
         slot_from_position=False, pad=-1, no_leading_zero=False):
    ids, positions, slots, q, k = [], [], [], [0], [0]
    for tokens, start, n, table in zip(token_ids, num_computed, num_new, block_tables, strict=True):
        first = 0 if recompute_cached else start
        for p in range(first, start + n):
            ids.append(tokens[p])
            positions.append(p - start if positions_from_zero else p)
            slot = p if slot_from_position else table[p // block_size] * block_size + p % block_size
            slots.append(slot + slot_shift)
        context = n if k_counts_new_only else len(tokens) if k_counts_all else start + n
        q.append(n if lengths_not_sums else q[-1] + n)
        k.append(context if lengths_not_sums else k[-1] + context)
    if no_leading_zero:
        q, k = q[1:], k[1:]
    width = max(len(t) for t in block_tables)
    tables = [t + [pad] * (width - len(t)) for t in block_tables]
    return {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions), "cu_seqlens_q": torch.tensor(q),
            "cu_seqlens_k": torch.tensor(k), "slot_mapping": torch.tensor(slots), "block_tables": torch.tensor(tables)}


def step_advancing(token_ids, num_computed, num_new, block_tables, block_size):
    """Right tensors, then the step "done" on the engine's own lists, as postprocess would."""
    out = step(token_ids, num_computed, num_new, block_tables, block_size)
    for i, n in enumerate(num_new):
        num_computed[i] += n
        num_new[i] = 0
    return out


def step_vectorized(token_ids, num_computed, num_new, block_tables, block_size):
    new = torch.tensor(num_new)
    starts = torch.tensor(num_computed)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), (starts + new).cumsum(0)])
    which = torch.repeat_interleave(torch.arange(len(num_new)), new)
    positions = torch.arange(int(cu_q[-1])) - cu_q[:-1][which] + starts[which]
    width = max(map(len, block_tables))
    tables = torch.tensor([t + [-1] * (width - len(t)) for t in block_tables])
    slots = tables[which, positions // block_size] * block_size + positions % block_size
    ids = torch.tensor([t[p] for t, s, n in zip(token_ids, num_computed, num_new, strict=True)
                        for p in range(s, s + n)], dtype=torch.long)
    return {"input_ids": ids, "positions": positions, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "slot_mapping": slots, "block_tables": tables.int()}


def step_by_labkit(token_ids, num_computed, num_new, block_tables, block_size):
    return ModelRunner.prepare(None, token_ids, num_new)


def step_by_flatten_step(token_ids, num_computed, num_new, block_tables, block_size):
    seqs = [BlockSequence(i, t, b, c)
            for i, (t, c, b) in enumerate(zip(token_ids, num_computed, block_tables, strict=True))]
    return flatten_step(seqs, num_new, block_size)._asdict()


# --- stop_stream ----------------------------------------------------------------------------------
def stream(pieces, stop, include, *, hold=True, search_new_only=False, keep_stop=None, flush=True,
           first_in_list=False):
    held = max((len(s) - 1 for s in stop), default=0) if hold else 0
    text, sent, emitted = "", 0, []
    for i, piece in enumerate(pieces):
        text += piece
        where = len(text) - len(piece) if search_new_only else max(0, len(text) - len(piece) - held - 1)
        if not hold:
            where = max(0, len(text) - len(piece) - max((len(s) - 1 for s in stop), default=0))
        found = [(text.find(s, where), s) for s in stop if text.find(s, where) != -1]
        if found:
            start, s = found[0] if first_in_list else min(found, key=lambda m: m[0])
            keep = include if keep_stop is None else keep_stop
            emitted.append(text[sent:start + (len(s) if keep else 0)])
            return emitted, s
        last = i == len(pieces) - 1
        ready = len(text) if last and flush else max(sent, len(text) - held)
        emitted.append(text[sent:ready])
        sent = ready
    return emitted, None


def stream_with_labkit(pieces, stop, include):
    text, emitted = "", []
    for piece in pieces:
        text += piece
        find_stop_string(text, stop, len(piece))
        emitted.append(piece)
    return emitted, None


def stream_by_suffix(pieces, stop, include):
    """Another correct style: hold back only what is still a live prefix's worth, per stop string."""
    text, sent, out = "", 0, []
    hold = max([len(s) - 1 for s in stop] or [0])
    for i, piece in enumerate(pieces):
        before = len(text)
        text += piece
        best = None
        for s in stop:
            at = text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best:
            cut = best[0] + len(best[1]) * include
            out.append(text[sent:cut])
            return out, best[1]
        upto = len(text) if i + 1 == len(pieces) else max(sent, len(text) - hold)
        out.append(text[sent:upto])
        sent = upto
    return out, None


# --- abort_request --------------------------------------------------------------------------------
def release_blocks(block_table, hash_to_block, blocks, free_uncached, free_cached, *, tail_first=True, shared=True,
                   owner_check=True, clear=True):
    """Lab 09's release, as the student pastes it (with the wrong turns some take)."""
    for block_id in reversed(block_table) if tail_first else list(block_table):
        block = blocks[block_id]
        block.ref_count = block.ref_count - 1 if shared else 0
        if block.ref_count > 0:
            continue
        if block.hash is not None and (hash_to_block.get(block.hash) == block_id or not owner_check):
            free_cached[block_id] = None
        else:
            if clear:
                block.hash = block.token_ids = None
            free_uncached.append(block_id)


def abort(request_id, waiting, running, blocks, hash_to_block, free_uncached, free_cached, *, search_waiting=True,
          leave_running=False, raise_unknown=True, only_first_sample=False, clear_table=True, count_table=False,
          reason="abort", queue_order=None, **release):
    queues = (waiting, running) if search_waiting else (running,)
    samples = [s for queue in (queue_order or queues) for s in queue if s.request_id == request_id]
    if queue_order is None:
        samples.sort(key=lambda s: s.index)
    if not samples and raise_unknown:
        raise ValueError(f"no unfinished request with id {request_id!r}")
    for queue in queues if not leave_running else (waiting,):
        for sample in [s for s in queue if s.request_id == request_id]:
            queue.remove(sample)
    free_before = len(free_uncached) + len(free_cached)
    freed_entries = 0
    for sample in samples[:1] if only_first_sample else samples:
        freed_entries += len(sample.block_table)
        release_blocks(sample.block_table, hash_to_block, blocks, free_uncached, free_cached, **release)
        if clear_table:
            sample.block_table = []
        sample.finish_reason = reason
    return samples, freed_entries if count_table else len(free_uncached) + len(free_cached) - free_before


def abort_by_index(request_id, waiting, running, blocks, hash_to_block, free_uncached, free_cached):
    """Another correct style: samples gathered by index while the queues are rebuilt, the freed blocks
    counted by their reference counts."""
    found = {}
    for queue in (waiting, running):
        kept = [s for s in queue if s.request_id != request_id]
        found.update({s.index: s for s in queue if s.request_id == request_id})
        queue.clear()
        queue.extend(kept)
    if not found:
        raise ValueError(f"request {request_id} is neither waiting nor running")
    freed = 0
    for index in sorted(found):
        table = found[index].block_table
        freed += sum(blocks[b].ref_count == 1 for b in table)
        release_blocks(table, hash_to_block, blocks, free_uncached, free_cached)
        table.clear()
        found[index].finish_reason = "abort"
    return [found[i] for i in sorted(found)], freed


def abort_with_labkit(request_id, waiting, running, blocks, hash_to_block, free_uncached, free_cached):
    from labkit.engine.scheduler import Scheduler

    Scheduler.abort(None, None)


# --- capstone -------------------------------------------------------------------------------------
def top_k(logits, k):
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits, p):
    s, order = logits.sort(dim=-1, descending=True)
    probs = s.softmax(-1)
    remove = (probs.cumsum(-1) - probs) >= p
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def prefix(token_ids, block_size, hash_to_block, blocks, *, whole=False, skip_miss=False, token_check=True):
    from labkit.cache.block_manager import hash_block

    hits, prev = [], None
    for i in range(len(token_ids) // block_size if whole else (len(token_ids) - 1) // block_size):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        prev = hash_block(prev, chunk)
        block_id = hash_to_block.get(prev)
        if block_id is None or (token_check and blocks[block_id].token_ids != chunk):
            if skip_miss:
                continue
            break
        hits.append(block_id)
    return hits


def take(free_uncached, free_cached, hash_to_block, blocks):
    if free_uncached:
        block_id = free_uncached.popleft()
    else:
        block_id, _ = free_cached.popitem(last=False)
        del hash_to_block[blocks[block_id].hash]
        blocks[block_id].hash = blocks[block_id].token_ids = None
    blocks[block_id].ref_count = 1
    return block_id


def can_append(num_tokens, num_blocks_held, block_size, num_free_blocks):
    return -(-num_tokens // block_size) - num_blocks_held <= num_free_blocks


def parts(**replaced):
    members = {"top_k_filter": top_k, "top_p_filter": top_p, "cached_prefix_blocks": prefix, "take_free_block": take,
               "can_append": can_append, "schedule_step": schedule, "prepare_step": step} | replaced
    return type("CapstoneParts", (), {name: staticmethod(fn) for name, fn in members.items()})


def parts_as_methods():
    """Another style: an instance whose attributes are the functions, set in __init__."""

    class CapstoneParts:
        def __init__(self):
            self.top_k_filter, self.top_p_filter = top_k, top_p
            self.cached_prefix_blocks, self.take_free_block = prefix, take
            self.can_append, self.schedule_step, self.prepare_step = can_append, schedule, step_vectorized

    return CapstoneParts


def top_p_without_crossing(logits, p):
    s, order = logits.sort(dim=-1, descending=True)
    remove = s.softmax(-1).cumsum(-1) > p
    remove[..., 0] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def schedule_uncharged(running, waiting, token_budget, max_num_seqs, free_blocks):
    """Plans the running decodes but leaves their tokens in the budget the prompts are chunked to."""
    plan, budget = [(r, 1) for r in running], token_budget
    for req in sorted(waiting, key=lambda r: (-r.priority, r.arrival)):
        if budget == 0 or len(plan) >= max_num_seqs or req.blocks > free_blocks:
            break
        plan.append((req.id, min(req.prompt_len, budget)))
        budget, free_blocks = budget - plan[-1][1], free_blocks - req.blocks
    return plan


def take_most_recent(free_uncached, free_cached, hash_to_block, blocks):
    """Evicts the most recently freed cached block (LIFO), not the least recently freed."""
    if free_uncached:
        return take(free_uncached, free_cached, hash_to_block, blocks)
    block_id, _ = free_cached.popitem(last=True)
    del hash_to_block[blocks[block_id].hash]
    blocks[block_id].hash = blocks[block_id].token_ids = None
    blocks[block_id].ref_count = 1
    return block_id


def take_keeping_hash(free_uncached, free_cached, hash_to_block, blocks):
    """Evicts, but leaves the evicted block's entry in hash_to_block (Lab 09's stale entry)."""
    block_id = free_uncached.popleft() if free_uncached else free_cached.popitem(last=False)[0]
    blocks[block_id].hash = blocks[block_id].token_ids = None
    blocks[block_id].ref_count = 1
    return block_id


def labkit_prepare(*args):
    from labkit_course.engine_parts import labkit_prepare_step

    return labkit_prepare_step(*args)


WRONG_CAPSTONE = [
    ("top-k keeps one token too many", dict(top_k_filter=lambda logits, k: top_k(logits, k + 1)),
     "your `top_k_filter` answered the engine differently"),
    ("slot mapping off by one", dict(prepare_step=lambda *a: step(*a, slot_shift=1)), "slot_mapping"),
    ("positions restart at zero", dict(prepare_step=lambda *a: step(*a, positions_from_zero=True)),
     "your `prepare_step` answered the engine differently from labkit's: positions"),
    ("can_append with floor division", dict(can_append=lambda n, h, bs, f: n // bs - h <= f), "`can_append`"),
    ("can_append with < instead of <=", dict(can_append=lambda n, h, bs, f: -(-n // bs) - h < f),
     "your `can_append` answered the engine differently from labkit's: its answer is False"),
    ("admits what does not fit", dict(schedule_step=lambda r, w, budget, seats, _: schedule(r, w, budget, seats, 99)),
     "whose blocks do not fit"),
    ("prefix lookup without the chain", dict(cached_prefix_blocks=lambda *a: []), "`cached_prefix_blocks`"),
    ("top-p drops the token that crosses top_p", dict(top_p_filter=top_p_without_crossing), "`top_p_filter`"),
    ("skips a request that does not fit", dict(schedule_step=partial(schedule, skip=True)), "skipping it for a later"),
    ("ignores max_num_seqs", dict(schedule_step=partial(schedule, seats=False)), "more than max_num_seqs"),
    ("ignores priority", dict(schedule_step=partial(schedule, order=lambda r: r.arrival)), "ignored priorities"),
    ("shortest prompt first", dict(schedule_step=partial(schedule, order=lambda r: (r.prompt_len, r.arrival))),
     "shortest prompt first"),
    ("never chunks a prompt", dict(schedule_step=partial(schedule, chunk=False)), "chunked prefill"),
    ("forgets to subtract the blocks it gave", dict(schedule_step=partial(schedule, subtract=False)),
     "subtract them before the next request"),
    ("evicts the most recently freed block", dict(take_free_block=take_most_recent), "LRU evicts the least recently"),
    ("keeps the evicted block's hash", dict(take_free_block=take_keeping_hash), "a stale entry"),
    ("cu_seqlens_k counts only new tokens", dict(prepare_step=lambda *a: step(*a, k_counts_new_only=True)),
     "counts only the new tokens, so no sequence ever reaches its end"),
    ("running decodes not charged to the budget", dict(schedule_step=schedule_uncharged),
     "more than the budget of 32"),
    ("a whole block-aligned prompt can hit", dict(cached_prefix_blocks=partial(prefix, whole=True)),
     "the block holding the last prompt token never hits"),
    ("continues past a miss", dict(cached_prefix_blocks=partial(prefix, skip_miss=True)),
     "break at the first miss, do not continue"),
    ("no token check on a hit", dict(cached_prefix_blocks=partial(prefix, token_check=False)),
     "a hash collision"),
]


RIGHT = [
    Right("prepare_step", "a loop over sequences and positions", step),
    Right("prepare_step", "vectorized with repeat_interleave", step_vectorized),
    Right("stop_stream", "search back max(len) - 1 characters, min over the matches", stream),
    Right("stop_stream", "per-stop search window and an early return", stream_by_suffix),
    Right("abort_request", "queues searched, samples sorted by index", lambda *a: abort(*a)),
    Right("abort_request", "queues rebuilt, samples gathered by index", abort_by_index),
    Right("CapstoneParts", "staticmethods on a class", parts()),
    Right("CapstoneParts", "attributes set in __init__, a vectorized step", parts_as_methods()),
]

WRONG = [
    Wrong("prepare_step", "positions restart at 0 per sequence", lambda *a: step(*a, positions_from_zero=True),
          "positions restart at 0"),
    Wrong("prepare_step", "recomputes the cached tokens", lambda *a: step(*a, recompute_cached=True),
          "only the new ones are computed"),
    Wrong("prepare_step", "cu_seqlens_k counts only new tokens", lambda *a: step(*a, k_counts_new_only=True),
          "cu_seqlens_k counts only the new tokens"),
    Wrong("prepare_step", "cu_seqlens_k counts the whole sequence", lambda *a: step(*a, k_counts_all=True),
          "a chunk's context ends at its last new token"),
    Wrong("prepare_step", "lengths instead of running sums", lambda *a: step(*a, lengths_not_sums=True),
          "it is their running sum"),
    Wrong("prepare_step", "no leading zero", lambda *a: step(*a, no_leading_zero=True), "lacks its leading 0"),
    Wrong("prepare_step", "slot off by one", lambda *a: step(*a, slot_shift=1), "off by one"),
    Wrong("prepare_step", "slot is the position", lambda *a: step(*a, slot_from_position=True),
          "slot_mapping used the positions"),
    Wrong("prepare_step", "pads block tables with 0", lambda *a: step(*a, pad=0), "-1 marks 'no block'"),
    Wrong("prepare_step", "returns lists", lambda *a: {k: v.tolist() for k, v in step(*a).items()},
          "must be a tensor of 32- or 64-bit integers"),
    Wrong("prepare_step", "8-bit tensors", lambda *a: {k: v.to(torch.uint8) for k, v in step(*a).items()},
          "fewer bits overflow"),
    Wrong("prepare_step", "advances num_computed and num_new", step_advancing, "prepare_step changed its arguments"),
    Wrong("prepare_step", "calls the ModelRunner", step_by_labkit, "`prepare` is labkit's answer",
          calls="labkit.engine.model_runner.ModelRunner.prepare"),
    Wrong("prepare_step", "calls labkit's flatten_step", step_by_flatten_step, "`flatten_step` is labkit's answer",
          calls="labkit.engine.model_runner.flatten_step"),
    Wrong("stop_stream", "no hold-back", lambda p, s, i: stream(p, s, i, hold=False), "streamed text that the stop"),
    Wrong("stop_stream", "searches the new piece only", lambda p, s, i: stream(p, s, i, search_new_only=True),
          "it can span pieces"),
    Wrong("stop_stream", "always drops the stop string", lambda p, s, i: stream(p, s, i, keep_stop=False),
          "keeps the stop string at the end"),
    Wrong("stop_stream", "always keeps the stop string", lambda p, s, i: stream(p, s, i, keep_stop=True),
          "although include_stop_str_in_output is False"),
    Wrong("stop_stream", "never flushes the held text", lambda p, s, i: stream(p, s, i, flush=False),
          "your pieces join to"),
    Wrong("stop_stream", "first stop string in list order", lambda p, s, i: stream(p, s, i, first_in_list=True),
          "the earliest match in the text wins"),
    Wrong("stop_stream", "calls find_stop_string", stream_with_labkit, "`find_stop_string` is labkit's answer",
          calls="labkit.sampling.stop.find_stop_string"),
    Wrong("abort_request", "forgets the waiting queue", lambda *a: abort(*a, search_waiting=False,
                                                                      raise_unknown=False),
          "still in the waiting queue"),
    Wrong("abort_request", "looks for the request in running only", lambda *a: abort(*a, search_waiting=False),
          "still in the waiting queue"),
    Wrong("abort_request", "frees blocks others still hold", lambda *a: abort(*a, shared=False),
          "still held by another sequence"),
    Wrong("abort_request", "leaves the request in running", lambda *a: abort(*a, leave_running=True),
          "still in `running`"),
    Wrong("abort_request", "releases head first", lambda *a: abort(*a, tail_first=False), "tail first"),
    Wrong("abort_request", "a finished or unknown id is a silent no-op", lambda *a: abort(*a, raise_unknown=False),
          "raise ValueError naming the id"),
    Wrong("abort_request", "releases only sample 0", lambda *a: abort(*a, only_first_sample=True),
          "call release_blocks on every sample's table"),
    Wrong("abort_request", "keeps the block table", lambda *a: abort(*a, clear_table=False),
          "still lists its blocks"),
    Wrong("abort_request", "counts table entries as freed", lambda *a: abort(*a, count_table=True),
          "not the table entries"),
    Wrong("abort_request", "finish reason 'aborted'", lambda *a: abort(*a, reason="aborted"),
          "finish_reason 'abort'"),
    Wrong("abort_request", "samples in queue order, waiting first",
          lambda r, w, run, *a: abort(r, w, run, *a, queue_order=(w, run)),
          "return every aborted sample in index order"),
    Wrong("abort_request", "samples in queue order, running first",
          lambda r, w, run, *a: abort(r, w, run, *a, queue_order=(run, w)),
          "return every aborted sample in index order"),
    Wrong("abort_request", "release caches a duplicate block", lambda *a: abort(*a, owner_check=False),
          "a duplicate is cleared and freed uncached"),
    Wrong("abort_request", "release keeps a freed block's hash", lambda *a: abort(*a, clear=False),
          "still holding its hash and tokens"),
    Wrong("abort_request", "calls the scheduler's abort", abort_with_labkit, "`abort` is labkit's answer",
          calls="labkit.engine.scheduler.Scheduler.abort"),
    *[Wrong("CapstoneParts", name, parts(**replaced), feedback) for name, replaced, feedback in WRONG_CAPSTONE],
    Wrong("CapstoneParts", "plugs in labkit's own step", parts(prepare_step=labkit_prepare),
          "`labkit_prepare_step` is labkit's answer", calls="labkit_course.engine_parts.labkit_prepare_step"),
]
