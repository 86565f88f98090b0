"""Lab 11: the engine step by hand. One step's tensors (against labkit's ModelRunner.prepare on real
scheduler states), stop strings streamed with hold-back, aborting a request with Lab 09's release, and
the capstone: labkit's engine on SmolLM2 run with the student's own parts."""

import functools
import itertools
import random
from collections import OrderedDict, deque
from types import SimpleNamespace

import torch

from labkit.cache.block_manager import Block, BlockManager
from labkit.cache.paged_storage import PagedKVStorage
from labkit.sampling.stop import find_stop_string
from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.core import seeded_random
from labkit_course.grading.records import Sample

STEP_KEYS = ("input_ids", "positions", "cu_seqlens_q", "cu_seqlens_k", "slot_mapping", "block_tables")
_PREPARE = ("labkit.engine.model_runner.ModelRunner.prepare", "labkit.engine.model_runner.ModelRunner.step_inputs",
            "labkit.engine.model_runner.flatten_step", "labkit.engine.model_runner.padded_block_tables",
            "labkit.cache.paged_storage.slot_mapping", "labkit_course.engine_parts.labkit_prepare_step")


# --- exercise 1: one step's tensors -------------------------------------------------------------
def mixed_steps():
    """Scheduler states of real engine steps, each mixing a prefill chunk, a prompt whose first
    blocks are prefix-cache hits, and decodes: [(seqs, num_new_tokens, block_size)]."""
    from labkit.engine import Scheduler, SchedulerConfig, Sequence
    from labkit.sampling import SamplingParams

    block_size = 8
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=128)
    scheduler = Scheduler(config, BlockManager(24, block_size), PagedKVStorage(1, 24, block_size, 1, 4))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    system = list(range(500, 517))  # 17 shared tokens: two full blocks can hit
    requests = [Sequence(system + [1, 2, 3], params), Sequence(list(range(600, 611)), params)]
    later = [Sequence(list(range(700, 745)), params), Sequence(system + [9, 8, 7, 6], params)]
    steps, token = [], 1000
    for step in range(9):
        for seq in requests if step == 0 else later if step == 3 else []:
            scheduler.add(seq)
        out = scheduler.schedule()
        kinds = {"decode" if not seq.is_prefill else "hit" if seq.num_prefix_cached_tokens else "prefill"
                 for seq in out.seqs}
        if len(kinds) >= 2:
            steps.append(([_frozen(seq) for seq in out.seqs], list(out.num_new_tokens), block_size))
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.num_cached_tokens + n == seq.num_tokens:
                seq.append_token(token)
                token += 1
        scheduler.postprocess(out)
    return steps


def _frozen(seq):
    """What ModelRunner.prepare reads of a sequence, copied as it is in this step."""
    return SimpleNamespace(token_ids=list(seq.token_ids), num_cached_tokens=seq.num_cached_tokens,
                           block_table=list(seq.block_table), num_tokens=seq.num_tokens)


def _random_step(rng: random.Random):
    block_size = rng.choice([8, 16])
    seqs, num_new, next_block = [], [], 0
    for _ in range(rng.randint(1, 5)):
        length = rng.randint(1, 60)
        computed = rng.choice([0, length - 1, rng.randint(0, length - 1)])
        blocks = -(-length // block_size)
        table = list(range(next_block, next_block + blocks))
        rng.shuffle(table)
        next_block += blocks
        seqs.append(SimpleNamespace(token_ids=[rng.randint(3, 49000) for _ in range(length)],
                                    num_cached_tokens=computed, block_table=table, num_tokens=length))
        num_new.append(rng.randint(1, length - computed))
    return seqs, num_new, block_size


def reference_step(seqs, num_new, block_size) -> dict:
    from labkit.engine.model_runner import ModelRunner

    runner = ModelRunner(SimpleNamespace(device=torch.device("cpu")),
                         SimpleNamespace(block_size=block_size), backend=None)
    step = runner.prepare(seqs, num_new)
    return {"input_ids": step.input_ids, "positions": step.positions, "cu_seqlens_q": step.meta.cu_seqlens_q,
            "cu_seqlens_k": step.meta.cu_seqlens_k, "slot_mapping": step.meta.slot_mapping,
            "block_tables": step.meta.block_tables}


def _step_args(seqs, num_new, block_size):
    return ([list(s.token_ids) for s in seqs], [s.num_cached_tokens for s in seqs], list(num_new),
            [list(s.block_table) for s in seqs], block_size)


def _where(seqs, num_new, block_size) -> str:
    return "; ".join(f"seq {i}: {s.num_tokens} tokens, {s.num_cached_tokens} computed, {n} new, table "
                     f"{s.block_table}" for i, (s, n) in enumerate(zip(seqs, num_new, strict=True))) + \
        f" (block_size {block_size})"


def _diagnose_step(key, got, want, seqs, num_new, block_size) -> str:
    starts = [s.num_cached_tokens for s in seqs]
    ends = [s.num_cached_tokens + n for s, n in zip(seqs, num_new, strict=True)]
    if key == "input_ids" and got.numel() == sum(ends):
        return "input_ids holds every token up to the step's end: only the new ones are computed (the cached " \
               "tokens' K/V is already in the cache)"
    if key == "positions":
        restart = torch.cat([torch.arange(n) for n in num_new])
        if got.numel() == restart.numel() and torch.equal(got, restart):
            return "positions restart at 0 for each sequence: a token's position is its index in its sequence, " \
                   "num_computed + i"
    if key in ("cu_seqlens_q", "cu_seqlens_k"):
        lengths = want.diff()
        if (got.numel() == len(seqs) and torch.equal(got, lengths)) or (
                got.numel() == want.numel() and torch.equal(got[1:], lengths)):
            return f"{key} holds each sequence's length: it is their running sum, starting at 0"
        if got.numel() == len(seqs) and torch.equal(got, want[1:]):
            return f"{key} lacks its leading 0: B + 1 entries, sequence i's rows are [cu[i], cu[i+1])"
        if key == "cu_seqlens_k" and got.numel() == want.numel() and torch.equal(got, reference_cu(num_new)):
            return "cu_seqlens_k counts only the new tokens: it counts each sequence's whole context, cached + new"
        if key == "cu_seqlens_k" and got.numel() == want.numel() and torch.equal(
                got, reference_cu([s.num_tokens for s in seqs])):
            return "cu_seqlens_k counts every token the sequence holds: a chunk's context ends at its last new " \
                   "token, num_computed + num_new"
    if key == "slot_mapping" and got.numel() == want.numel():
        positions = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends, strict=True)])
        if torch.equal(got, want + 1) or torch.equal(got, want - 1):
            return "slot_mapping is off by one: a token at position p goes to offset p % block_size of its block"
        if torch.equal(got, positions):
            return "slot_mapping used the positions: the slot is block_table[p // block_size] * block_size + " \
                   "p % block_size, in the sequence's own blocks"
        by_index = torch.cat([torch.tensor([s.block_table[min(i, len(s.block_table) - 1)] * block_size + p % block_size
                                            for i, p in enumerate(range(a, b))]) if b > a else torch.tensor([])
                              for s, a, b in zip(seqs, starts, ends, strict=True)]).long()
        if torch.equal(got, by_index):
            return "slot_mapping indexed the block table by the token's index in the step: use p // block_size"
    if key == "block_tables" and got.shape == want.shape and torch.equal(got.masked_fill(want == -1, -1), want):
        return "block_tables pads short tables with something other than -1: -1 marks 'no block'"
    return f"{key}: expected {want.tolist()}, got {got.tolist()}"


def reference_cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@exercise("11", "prepare_step", forbidden=_PREPARE)
def prepare_step(ns):
    fn = require(ns, "prepare_step")
    rng = seeded_random(11)
    cases = mixed_steps() + [_random_step(rng) for _ in range(25)]
    for seqs, num_new, block_size in cases:
        args = _step_args(seqs, num_new, block_size)
        got = fn(*args)
        if args != _step_args(seqs, num_new, block_size):
            raise ExerciseFailed("prepare_step changed its arguments (token_ids, num_computed, num_new or "
                                 "block_tables): the engine's sequences must stay as they are")
        if not isinstance(got, dict) or set(got) != set(STEP_KEYS):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ExerciseFailed(f"return a dict with the keys {list(STEP_KEYS)}, got {keys}")
        want = reference_step(seqs, num_new, block_size)
        for key in STEP_KEYS:
            value = got[key]
            if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
                raise ExerciseFailed(f"{key} must be a tensor of 32- or 64-bit integers (torch.tensor of ints is "
                                     f"int64), got {getattr(value, 'dtype', type(value).__name__)}: fewer bits "
                                     "overflow, since token ids reach 49,151 and positions and slots grow with "
                                     "the context")
            if value.shape != want[key].shape or not torch.equal(value.long(), want[key].long()):
                raise ExerciseFailed(f"{_diagnose_step(key, value.long(), want[key].long(), seqs, num_new, block_size)}"
                                     f" [step: {_where(seqs, num_new, block_size)}]")
    return "a mixed step's flat batch, positions, cu_seqlens, slots and block tables match the ModelRunner's"


# --- exercise 2: stop strings, streamed ----------------------------------------------------------
def reference_stop_stream(pieces, stop, include_stop_str_in_output):
    """labkit's rule (LLM.stream and check_stop): the earliest stop string that ends in the new
    text ends the output before it (after it, if asked); until then the last max(len) - 1
    characters are held back, since they may begin a stop string; the last piece flushes."""
    hold = max((len(s) - 1 for s in stop), default=0)
    text, sent, emitted = "", 0, []
    for i, piece in enumerate(pieces):
        text += piece
        match = find_stop_string(text, stop, len(piece))
        if match is not None:
            end = match.start + (len(match.stop) if include_stop_str_in_output else 0)
            emitted.append(text[sent:end])
            return emitted, match.stop
        ready = len(text) if i == len(pieces) - 1 else max(sent, len(text) - hold)
        emitted.append(text[sent:ready])
        sent = ready
    return emitted, None


STOP_CASES = [
    (["Hello", " wor", "ld", "\n\nUs", "er:", " more"], ["\n\nUser:"], False),
    (["Hello", " wor", "ld", "\n\nUs", "er:", " more"], ["\n\nUser:"], True),
    (["The answer", " is 4", ". Done", " here"], ["Done", "4."], False),
    (["a", "b", "c", "d", "e"], ["xyz"], False),
    (["end", "ing", " ENDING"], ["END"], True),
    (["one STOP two STOP"], ["STOP"], False),
    (["x", "ST", "OP", "y"], ["STOP", "TOP!"], False),
    (["no stop strings at all"], [], False),
    (["ab", "ab", "ab"], ["bab", "ba"], True),
]


@exercise("11", "stop_stream", forbidden=("labkit.sampling.stop.find_stop_string", "labkit.sampling.stop.check_stop",
                                          "labkit.sampling.check_stop",
                                          "labkit_course.grading.labs.lab11.reference_stop_stream"))
def stop_stream(ns):
    fn = require(ns, "stop_stream")
    rng = seeded_random(1111)
    alphabet = "ab:\n"
    cases = list(STOP_CASES) + [([("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))))
                                  for _ in range(rng.randint(1, 8))],
                                 ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                                  for _ in range(rng.randint(0, 2))], rng.random() < 0.5) for _ in range(300)]
    for pieces, stop, include in cases:
        got = fn(list(pieces), list(stop), include)
        want = reference_stop_stream(pieces, stop, include)
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], list)):
            raise ExerciseFailed(f"return (list of emitted strings, the stop string or None), got {got!r}")
        if got == want:
            continue
        raise ExerciseFailed(_diagnose_stop(got, want, pieces, stop, include))
    return "stop strings found across token boundaries, the text held back until it cannot start one"


def _diagnose_stop(got, want, pieces, stop, include) -> str:
    where = f"pieces={pieces!r}, stop={stop!r}, include_stop_str_in_output={include}"
    emitted, reason = got
    final, want_final = "".join(emitted), "".join(want[0])
    if reason != want[1]:
        if want[1] is not None and reason is None:
            return f"missed the stop string {want[1]!r}: it can span pieces, search where it could end in the " \
                   f"new text, starting len(stop) - 1 characters back. {where}"
        return f"stopped on {reason!r}, expected {want[1]!r}: the earliest match in the text wins (of two that " \
               f"start at the same place, the one listed first in stop). {where}"
    if want[1] is not None and final == want_final + want[1]:
        return f"kept the stop string although include_stop_str_in_output is False. {where}"
    if want[1] is not None and final + want[1] == want_final:
        return f"include_stop_str_in_output=True keeps the stop string at the end of the output. {where}"
    if final != want_final:
        sent = "".join(emitted[:len(want[0])])
        if want[1] is not None and len(sent) > len(want_final) and sent.startswith(want_final):
            return f"streamed text that the stop string later cut: hold back the last max(len(stop)) - 1 " \
                   f"characters until they cannot begin a stop string. {where}"
        return f"the output should be {want_final!r}, your pieces join to {final!r}. {where}"
    if len(emitted) != len(want[0]):
        return f"emit one string per piece consumed ({len(want[0])} here), '' when everything is held back. {where}"
    return f"emitted {emitted!r}, expected {want[0]!r}: hold back exactly max(len(stop)) - 1 characters, and flush " \
           f"the rest after the last piece. {where}"


# --- exercise 3: abort a request, with Lab 09's release -----------------------------------------

UNKNOWN_REQUEST = -1  # no sequence has a negative id, however many a grading process made


def abort_scene(preempt: bool = False):
    """A real scheduler mid-run, blocks of 8 tokens: request A runs as three samples sharing its
    prompt's blocks, B hit A's first two blocks in the prefix cache, C is halfway through a chunked
    prefill, F computed C's first block in the same steps, so C's copy of it is a duplicate the hash
    table does not point at, D waits, E has finished. With `preempt`, A's sample 1 was preempted back
    to the waiting queue. Returns (scheduler, {name: request id})."""
    from labkit.engine import Scheduler, SchedulerConfig, SchedulerOutput, Sequence
    from labkit.sampling import SamplingParams

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=128)
    scheduler = Scheduler(config, BlockManager(32, 8), PagedKVStorage(1, 32, 8, 1, 4))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    system = list(range(500, 517))  # two full blocks and one token
    a, e = Sequence(system + [1, 2, 3], params), Sequence([800, 801, 802], SamplingParams(max_tokens=1))
    b, f = Sequence(system + [7] * 6, params), Sequence(list(range(600, 608)) + [1, 2], params)
    c, d = Sequence(list(range(600, 660)), params), Sequence([9] * 20, params)
    fresh_ids, tokens = itertools.count(max(s.seq_id for s in (a, b, c, d, e, f)) + 1), itertools.count(1000)
    for step, arrivals in enumerate([[a, e], [b, f, c], []]):
        for seq in arrivals:
            scheduler.add(seq)
        out = scheduler.schedule()
        if step == 0:  # A's first token is drawn: it becomes three samples sharing its blocks
            _fork_samples(scheduler, out, a, 3, fresh_ids)
        _finish_step(scheduler, out, tokens)
    scheduler.add(d)
    _hash_running(scheduler)
    if preempt:
        sample = a.group[1]
        scheduler.running.remove(sample)
        scheduler.preempt(sample, SchedulerOutput())
    return scheduler, {name: seq.request_id for name, seq in zip("ABCDEF", (a, b, c, d, e, f), strict=True)}


def _fork_samples(scheduler, out, seq, n, fresh_ids):
    """`seq`'s first token is drawn in `out`'s step: it becomes `n` samples sharing its blocks."""
    for index in range(1, n):
        child = seq.fork(next(fresh_ids), seq.params, index)
        scheduler.fork(seq, child)
        seq.group.append(child)
        out.seqs.append(child)
        out.num_new_tokens.append(out.num_new_tokens[out.seqs.index(seq)])


def _finish_step(scheduler, out, tokens):
    """The step ran: a token for each sequence that reached its end, then the scheduler's postprocess."""
    from labkit.engine.sequence import FinishReason

    for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
        if seq.num_cached_tokens + n == seq.num_tokens:
            seq.append_token(next(tokens))
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.finish(FinishReason.MAX_TOKENS)
    scheduler.postprocess(out)


def _hash_running(scheduler):
    """What deallocate does first, done for every running sequence: hash the computed full blocks, so that
    the student's release (which hashes nothing) meets the pool labkit's abort sees."""
    for seq in scheduler.running:
        scheduler.block_manager.cache_computed_blocks(seq)


def random_abort_scene(rng):
    """abort_scene's kind of traffic drawn at random: prompts sharing a system prefix (prefix-cache hits),
    requests forked into samples at their first token, chunked prefills, preemptions when the pool runs out,
    finished and still waiting requests. Returns (scheduler, request ids, how to rebuild it)."""
    from labkit.engine import Scheduler, SchedulerConfig, Sequence
    from labkit.sampling import SamplingParams

    bs, num_blocks, budget = rng.choice([8, 16]), rng.randint(7, 16), rng.choice([8, 16, 24])
    config = SchedulerConfig(max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=budget, max_model_len=128)
    scheduler = Scheduler(config, BlockManager(num_blocks, bs), PagedKVStorage(1, num_blocks, bs, 1, 4))
    system = [rng.randint(500, 599) for _ in range(rng.randint(bs, 3 * bs))]
    prompts = [system[:rng.choice([len(system), rng.randint(0, len(system))])] +
               [rng.randint(0, 99) for _ in range(rng.randint(1, 2 * bs))] for _ in range(rng.randint(2, 6))]
    requests = [Sequence(prompt, SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True)) for prompt in prompts]
    samples = {seq.seq_id: rng.choice([1, 1, 2, 3]) for seq in requests}
    arrival = {seq.seq_id: rng.randint(0, 5) for seq in requests}
    steps = rng.randint(2, 8)
    history = (f"Scheduler(SchedulerConfig(max_num_seqs={config.max_num_seqs}, max_num_batched_tokens={budget}), "
               f"BlockManager({num_blocks}, {bs})); requests (prompt, max_tokens, samples, arriving before step): " +
               ", ".join(f"({seq.token_ids}, {seq.params.max_tokens}, {samples[seq.seq_id]}, {arrival[seq.seq_id]})"
                         for seq in requests) + f"; {steps} steps run")
    fresh_ids, tokens = itertools.count(max(samples) + 1), itertools.count(1000)
    for step in range(steps):
        for seq in requests:
            if arrival[seq.seq_id] == step:
                scheduler.add(seq)
        out = scheduler.schedule()
        for seq, n in list(zip(out.seqs, out.num_new_tokens, strict=True)):
            if seq.num_cached_tokens + n == seq.num_tokens and len(seq.group) < samples.get(seq.seq_id, 1):
                _fork_samples(scheduler, out, seq, samples[seq.seq_id], fresh_ids)
        _finish_step(scheduler, out, tokens)
    for seq in requests:
        if arrival[seq.seq_id] >= steps:
            scheduler.add(seq)
    _hash_running(scheduler)
    return scheduler, sorted({seq.request_id for seq in requests}), history


def _view(scheduler):
    """The exercise's arguments for a scheduler's state (copies: the scheduler stays as it is)."""
    bm = scheduler.block_manager
    samples = [[Sample(s.request_id, s.index, list(s.block_table)) for s in queue]
               for queue in (scheduler.waiting, scheduler.running)]
    return (deque(samples[0]), samples[1], [Block(b.block_id, b.ref_count, b.hash, b.token_ids) for b in bm.blocks],
            dict(bm.hash_to_block), deque(bm.free_uncached), OrderedDict(bm.free_cached))


def reference_abort(scheduler, request_id):
    """labkit's LLM.abort on the scheduler: every sample of the request, in index order; an id with
    no unfinished sample is an error. Returns ([(index, finish_reason)], blocks returned)."""
    group = [s for s in scheduler.waiting + scheduler.running if s.request_id == request_id]
    if not group:
        raise ValueError(f"no unfinished request with id {request_id!r}")
    free = scheduler.block_manager.num_free_blocks
    for seq in sorted(group, key=lambda s: s.index):
        scheduler.abort(seq)
    return [(s.index, str(s.finish_reason)) for s in sorted(group, key=lambda s: s.index)], \
        scheduler.block_manager.num_free_blocks - free


def _pool(view):
    waiting, running, blocks, hash_to_block, free_uncached, free_cached = view
    return ([(s.request_id, s.index, list(s.block_table)) for s in waiting],
            [(s.request_id, s.index, list(s.block_table)) for s in running],
            [(b.ref_count, b.hash, b.token_ids) for b in blocks], dict(hash_to_block), list(free_uncached),
            list(free_cached))


ABORT_CASES = ["A", "B", "C", "D", "E", "F", "P", "unknown", "AA", "BAC", "DC", "FC"]


@exercise("11", "abort_request", forbidden=("labkit.engine.scheduler.Scheduler.abort", "labkit.engine.llm.LLM.abort",
                                            "labkit.cache.block_manager.BlockManager.deallocate",
                                            "labkit.cache.block_manager.BlockManager.release_table",
                                            "labkit_course.grading.labs.lab11.reference_abort"))
def abort_request(ns):
    fn = require(ns, "abort_request")
    for case in ABORT_CASES:
        scheduler, ids = abort_scene(preempt="P" in case)
        ids["P"] = ids["A"]
        view = _view(scheduler)
        names = [case] if case == "unknown" else list(case)
        for name in names:
            request_id = ids.get(name, UNKNOWN_REQUEST)
            _check_abort(fn, scheduler, view, request_id, _where_abort(name, request_id, scheduler, case))
    rng = seeded_random(1112)
    for _ in range(12):
        scheduler, ids, history = random_abort_scene(rng)
        view = _view(scheduler)
        order = rng.sample(ids, rng.randint(1, len(ids))) + rng.choice([[], [UNKNOWN_REQUEST], ids[:1]])
        for k, request_id in enumerate(order):
            queues = _pool(view)
            where = f"aborting request {request_id} (aborts in order: {order}, this is abort {k + 1}) with waiting " \
                    f"{queues[0]}, running {queues[1]} (request, sample, block table), free_uncached {queues[4]}, " \
                    f"free_cached {queues[5]}; the scheduler: {history}"
            _check_abort(fn, scheduler, view, request_id, where)
    return "found wherever it waits or runs, every sample released through release_blocks, the pool as labkit's"


def _check_abort(fn, scheduler, view, request_id, where):
    """The student's abort on `view` against labkit's on the scheduler it copies."""
    try:
        want = reference_abort(scheduler, request_id)
    except ValueError:
        want = None
    before = _pool(view)
    try:
        got, raised = fn(request_id, *view), False
    except (NotImplementedError, ExerciseFailed):
        raise
    except Exception as error:  # a student's exception crosses as a RemoteError naming its type
        if raised_type(error) != "ValueError":
            raise
        got, raised = None, True
    if raised and want is not None:
        waits = any(s.request_id == request_id for s in view[0])
        raise ExerciseFailed("raised ValueError for a request still in the waiting queue: look there too, a "
                             f"waiting request is aborted like a running one. {where}" if waits else
                             f"raised ValueError although the request is running: {where}")
    if raised:
        if _pool(view) != before:
            raise ExerciseFailed(f"raised ValueError but changed the queues or the pool first: {where}")
        return
    if want is None:
        raise ExerciseFailed(_diagnose_missing(got, before, _pool(view), where))
    _compare_abort(got, want, view, scheduler, where)


def _where_abort(name, request_id, scheduler, case) -> str:
    what = {"A": "request A (three running samples sharing their prompt's blocks, two of them also hit by B)",
            "B": "request B (running; its first two blocks are A's, hit in the prefix cache)",
            "C": "request C (running, halfway through a chunked prefill; its first block duplicates F's, which the "
                 "hash table points at)", "D": "request D (waiting, no blocks yet)",
            "F": "request F (running; its first block is in the hash table, C holds an equal copy)",
            "P": "request A after its sample 1 was preempted back to the waiting queue (samples 0 and 2 run)",
            "E": "request E (already finished)", "unknown": f"an unknown request id ({UNKNOWN_REQUEST})"}[name]
    again = " a second time" if case == "AA" and name == "A" and not any(
        s.request_id == request_id for s in scheduler.running) else ""
    order = f" (aborts in order: {' then '.join(case)})" if len(case) > 1 and case != "unknown" else ""
    return f"aborting {what}{again}{order}"


def _diagnose_missing(got, before, after, where) -> str:
    if after != before:
        return f"released blocks of a request that has nothing left to abort (a finished, aborted or unknown id): " \
               f"raise ValueError and change nothing. {where}"
    return f"returned {got!r} for a request that is not waiting or running: raise ValueError naming the id. {where}"


def _compare_abort(got, want, view, scheduler, where):
    want_samples, want_freed = want
    want_view = _pool(_view(scheduler))
    pool = _pool(view)
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], list)):
        raise ExerciseFailed(f"return (the aborted samples in index order, the number of blocks returned), got "
                             f"{got!r}. {where}")
    samples, freed = got
    if any(not isinstance(s, Sample) for s in samples):
        raise ExerciseFailed(f"the first item returned should list the request's Sample records. {where}")
    if pool[0] != want_view[0]:
        raise _failure("the request is still in the waiting queue: a waiting request is aborted too (it holds no "
                       "blocks yet, so there is only the queue to leave)" if len(pool[0]) > len(want_view[0]) else
                       "the waiting queue changed beyond removing the request's samples", where)
    if [s[:2] for s in pool[1]] != [s[:2] for s in want_view[1]]:
        still = len(pool[1]) > len(want_view[1])
        raise _failure("a sample of the request is still in `running`: remove every sample of it, or the scheduler "
                       "would run it again" if still else "`running` lost samples of other requests", where)
    refs, want_refs = [r[0] for r in pool[2]], [r[0] for r in want_view[2]]
    if refs != want_refs:
        if any(r < w for r, w in zip(refs, want_refs, strict=True)):
            if any(r == 0 < w for r, w in zip(refs, want_refs, strict=True)):
                raise _failure("a block still held by another sequence (a sibling sample or a prefix-cache hit) was "
                               "freed: release each sample's table once, through release_blocks, which drops one "
                               "reference per block", where)
            raise _failure("dropped too many references: each sample's table is released exactly once", where)
        raise _failure("a sample's blocks were not released: call release_blocks on every sample's table (siblings "
                       "share the prompt's blocks; each holds one reference)", where)
    if pool[2:] != want_view[2:]:
        for block_id in set(pool[5]) - set(want_view[5]):
            owner = pool[3].get(pool[2][block_id][1])
            if owner is not None and owner != block_id:
                raise _failure(f"block {block_id} went to the cached free list, but hash_to_block maps its hash to "
                               f"block {owner} (an equal block computed elsewhere first): a block stays cached only "
                               f"if hash_to_block.get(block.hash) == its id; a duplicate is cleared and freed "
                               f"uncached", where)
        kept = [b for b in pool[4] if pool[2][b][1:] != (None, None)]
        if kept:
            raise _failure(f"block {kept[0]} went to the uncached free list still holding its hash and tokens: clear "
                           f"block.hash and block.token_ids there, so nothing takes it for cached content", where)
        if sorted(pool[4]) == sorted(want_view[4]) and sorted(pool[5]) == sorted(want_view[5]):
            raise _failure(f"free lists in another order than labkit's ({pool[4]} uncached, {pool[5]} cached; "
                           f"expected {want_view[4]}, {want_view[5]}): release the samples in index order, each "
                           f"with Lab 09's release_blocks (tail first)", where)
        raise _failure(f"the pool differs from labkit's after abort: ref counts/hashes, hash table and free lists "
                       f"should be {want_view[2:]}, got {pool[2:]}", where)
    if [(s.index, s.finish_reason) for s in samples] != want_samples:
        raise _failure(f"return every aborted sample in index order with finish_reason 'abort': expected "
                       f"{want_samples}, got {[(s.index, s.finish_reason) for s in samples]}", where)
    if any(s.block_table for s in samples):
        raise _failure("an aborted sample still lists its blocks: release_blocks leaves the table as it is, so the "
                       "caller empties it (the sample holds nothing now)", where)
    if freed != want_freed:
        raise _failure(f"{freed} blocks reported returned to the pool, labkit returns {want_freed}: count the blocks "
                       f"that reached ref_count 0 (both free lists grew by them), not the table entries", where)


def _failure(message, where) -> ExerciseFailed:
    return ExerciseFailed(f"{message}. {where}")


# --- capstone: labkit's engine with the student's parts -----------------------------------------
# labkit_course.engine_parts' CAPSTONE_ENGINE and CAPSTONE_BATCHES: one small engine, three batches, in which
# every part meets the cases its lesson is about; the shadows below compare each of its answers with
# labkit's on the trusted side.

@functools.cache
def smollm2_cpu():
    """SmolLM2 and its tokenizer on the CPU, loaded once per process (the parts tests share it)."""
    from labkit.model import load_model
    from labkit.tokenizer import load_tokenizer

    return load_model("smollm2", device="cpu"), load_tokenizer("smollm2")


def _run_engine(parts):
    """Each batch's tokens, the schedule of every step, and the preemptions; a part's error as a string."""
    import warnings

    from labkit.engine import LLM, FinishReason
    from labkit_course.engine_parts import CAPSTONE_BATCHES, CAPSTONE_ENGINE, PartError, capstone_requests

    model, tokenizer = smollm2_cpu()
    llm = LLM(model, tokenizer=tokenizer, components=None if parts is None else parts.components(),
              **CAPSTONE_ENGINE)
    schedule, trace = llm.scheduler.schedule, []

    def traced():
        out = schedule()
        trace.append([(seq.seq_id, n) for seq, n in zip(out.seqs, out.num_new_tokens, strict=True)])
        return out

    llm.scheduler.schedule = traced
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokens = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for batch in CAPSTONE_BATCHES:
                prompts, params, priorities = capstone_requests(batch)
                outputs = llm.generate(prompts, params, priority=priorities)
                for out in outputs:
                    if out.outputs[0].finish_reason is FinishReason.ERROR:
                        return str(out.outputs[0].stop_reason)
                tokens += [o.token_ids for o in outputs]
    except PartError as error:
        return str(error)
    finally:
        torch.set_num_threads(threads)
    if llm.block_manager.num_used_blocks:
        return f"{llm.block_manager.num_used_blocks} KV blocks still in use after every request finished"
    first = min(seq_id for step in trace for seq_id, _ in step)
    trace = [[(seq_id - first, n) for seq_id, n in step] for step in trace]  # ids relative to the first request
    return tokens, trace, llm.metrics.num_preemptions


@functools.cache
def _reference_run():
    return _run_engine(None)


PART_NAMES = ("top_k_filter", "top_p_filter", "cached_prefix_blocks", "take_free_block", "can_append",
              "schedule_step", "prepare_step")


# labkit's answers, and the engine functions they are made of
@exercise("11", "CapstoneParts", forbidden=(*(f"labkit_course.engine_parts.labkit_{name}" for name in PART_NAMES),
                                            "labkit.cache.block_manager.find_prefix_hits",
                                            "labkit.cache.block_manager.pop_free_block",
                                            "labkit.engine.model_runner.flatten_step",
                                            "labkit.sampling.filters.apply_top_k",
                                            "labkit.sampling.filters.apply_top_p"))
def capstone(ns):
    from labkit_course.engine_parts import EngineParts
    from labkit_course.grading.core import GRADING
    from labkit_course.grading.forbidden import guarded

    cls = require(ns, "CapstoneParts", type)
    holder = cls()
    student = {}
    wires = GRADING.get()
    for name in PART_NAMES:
        try:
            part = getattr(holder, name)
        except AttributeError:
            raise ExerciseFailed(f"CapstoneParts has no `{name}`: give it every part, e.g. "
                                 f"`{name} = staticmethod({name})`") from None
        if not callable(part):
            raise ExerciseFailed(f"CapstoneParts.{name} must be your function, got {type(part).__name__}")
        # In the notebook's own process the parts are plain functions: arm the tripwires around them
        # (in a student's kernel every call arms them already).
        in_process = wires is not None and isinstance(ns, dict)
        student[name] = guarded(wires, ns, part) if in_process else part
    expected = _reference_run()
    shadows = {name: _Shadow(name, part) for name, part in student.items()}
    got = _run_engine(EngineParts(**shadows))
    if not isinstance(got, str):  # then calls the engine did not make, until a first wrong answer
        by_hand = [(args, "a lookup built by hand (a state the engine never reaches)") for args in prefix_probes()]
        for name, calls in [("cached_prefix_blocks", by_hand), *random_part_calls(seeded_random(1113)).items()]:
            if any(shadow.mismatch for shadow in shadows.values()):
                break
            _probe(shadows[name], calls)
    first = min((shadow for shadow in shadows.values() if shadow.mismatch), key=lambda sh: sh.mismatch_at, default=None)
    if first is not None:  # the first wrong answer is the cause; what the engine did next, its consequence
        raise ExerciseFailed(first.mismatch + (f"; the engine then stopped: {got}" if isinstance(got, str) else ""))
    if isinstance(got, str):
        raise ExerciseFailed(f"the engine stopped: {got}")
    if got != expected:
        raise ExerciseFailed(_difference(got, expected))
    return (f"labkit's engine with your seven parts gives labkit's tokens and schedule on SmolLM2 for "
            f"{len(expected[0])} prompts, greedy and seeded, through {expected[2]} preemption(s)")


def prefix_probes():
    """Two prefix lookups the engine never reaches (labkit's LRU frees a table tail first, and its
    128-bit hashes do not collide), built by hand over four cached blocks of 4 tokens: one with a
    hole (the second block evicted, the third and fourth still cached), one whose hash table points
    the second block's hash at a block holding other tokens (a collision)."""
    from labkit.cache.block_manager import hash_block

    block_size, token_ids = 4, list(range(100, 117))  # four full blocks and a last token
    blocks, hash_to_block, prev = [Block(i) for i in range(6)], {}, None
    for i, block_id in enumerate((3, 0, 5, 1)):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        prev = hash_block(prev, chunk)
        blocks[block_id].hash, blocks[block_id].token_ids = prev, chunk
        hash_to_block[prev] = block_id
    hole = [Block(b.block_id, 0, b.hash, b.token_ids) for b in blocks]
    hole_table = {h: b for h, b in hash_to_block.items() if b != 0}
    hole[0].hash = hole[0].token_ids = None
    collision = [Block(b.block_id, 0, b.hash, b.token_ids) for b in blocks]
    collision[0].token_ids = (7, 7, 7, 7)
    return [(list(token_ids), block_size, hole_table, hole), (list(token_ids), block_size, dict(hash_to_block),
                                                              collision)]


def random_part_calls(rng):
    """For each part, calls drawn at random beside the engine's, on the states its lesson is about:
    {name: [(args, what they are)]}."""
    from labkit_course.grading.labs.lab09 import _RandomPool
    from labkit_course.grading.records import Request

    calls = {name: [] for name in PART_NAMES}
    generator = torch.Generator().manual_seed(rng.getrandbits(63))
    for _ in range(6):
        logits = torch.randn(2, 8, generator=generator) * 3
        calls["top_k_filter"].append(((logits, rng.randint(1, 8)), "random logits"))
        calls["top_p_filter"].append(((logits.clone(), rng.uniform(0.05, 0.95)), "random logits"))
        pool = _RandomPool(rng)
        m, what = pool.manager, f"a random pool (labkit's {pool})"
        calls["cached_prefix_blocks"].append(((pool.prompt(), m.block_size, m.hash_to_block, m.blocks), what))
        if m.num_free_blocks:
            calls["take_free_block"].append(((m.free_uncached, m.free_cached, m.hash_to_block, m.blocks), what))
        block_size, num_tokens = rng.choice([8, 16]), rng.randint(2, 100)
        calls["can_append"].append(((num_tokens, -(-(num_tokens - 1) // block_size), block_size, rng.randint(0, 2)),
                                    "a random decode"))
        running = [f"r{i}" for i in range(rng.randint(0, 3))]
        waiting = [Request(f"w{i}", rng.choice([-1, 0, 0, 2]), arrival, rng.randint(1, 40), rng.randint(1, 4))
                   for i, arrival in enumerate(rng.sample(range(50), rng.randint(1, 5)))]
        calls["schedule_step"].append(((running, waiting, rng.randint(len(running) + 1, 48),
                                        rng.randint(len(running) + 1, 8), rng.randint(0, 8)), "a random queue"))
        calls["prepare_step"].append((_step_args(*_random_step(rng)), "a random step"))
    return calls


def _probe(shadow, calls):
    """Ask the student's part (through its shadow, which compares) on calls the engine run did not make,
    up to its first wrong answer."""
    for args, what in calls:
        described = _describe_args(args)
        try:
            shadow(*args)
        except (NotImplementedError, ExerciseFailed):
            raise
        except Exception as error:
            raise ExerciseFailed(f"your `{shadow.name}` raised {raised_type(error)}: {error} on {what} "
                                 f"[the call: {described}]") from None
        if shadow.mismatch is not None:
            shadow.mismatch = shadow.mismatch.replace("answered the engine differently", f"answered {what} "
                                                      "differently")
            return


class _Shadow:
    """A student's part that also asks labkit's own answer (on a copy of the same arguments) and
    keeps the first call where the two differ, so the feedback names the part and the call."""

    calls = 0  # across every part of the run: the order the engine asked them in

    def __init__(self, name: str, part):
        from labkit_course.engine_parts import EngineParts

        self.name, self.part, self.labkit = name, part, EngineParts().part(name)
        self.mismatch, self.mismatch_at = None, None

    def __call__(self, *args):
        import copy

        _Shadow.calls += 1
        given = copy.deepcopy(args)
        call = _describe_args(given) if self.mismatch is None else None  # as the part was asked
        call_args = copy.deepcopy(given) if self.mismatch is None else None
        result = self.part(*args)
        if self.mismatch is None:
            want = self.labkit(*given)
            problem = _compare(result, want) or _compare(_contents(args), _contents(given), "its arguments afterwards")
            if problem:
                problem = _named_mistake(self.name, call_args, result, want, args) or problem
                self.mismatch_at = _Shadow.calls
                self.mismatch = (f"your `{self.name}` answered the engine differently from labkit's: {problem} "
                                 f"[the call: {call}]")
        return result


def _named_mistake(name, given, result, want, args) -> str | None:
    """The lesson's name for a part's wrong answer where its own lab's grader has one."""
    if name == "schedule_step" and isinstance(result, list) and all(isinstance(p, tuple) for p in result):
        import re

        from labkit_course.grading.labs.lab10 import _diagnose

        return re.split(r"[.:] running=", _diagnose(tuple(given), result, want, None))[0]
    if name == "cached_prefix_blocks" and isinstance(result, list):
        token_ids, block_size, hash_to_block, blocks = given
        limit = (len(token_ids) - 1) // block_size
        if len(result) > limit:
            return f"{len(result)} hits for a prompt of {len(token_ids)} tokens in blocks of {block_size}: the " \
                   f"block holding the last prompt token never hits (the model must compute at least that token " \
                   f"to get its logits), so look up only range((len(token_ids) - 1) // block_size), here {limit}"
        from labkit.cache.block_manager import hash_block

        chunks, prev, found = [tuple(token_ids[i * block_size:(i + 1) * block_size]) for i in range(limit)], None, {}
        for chunk in chunks:  # where the chain of the prompt's hashes leads in the table
            prev = hash_block(prev, chunk)
            found.setdefault(hash_to_block.get(prev), chunk)
        for block_id in result:
            chunk = found.get(block_id)
            if chunk is not None and blocks[block_id].token_ids != chunk:
                return f"answered {result}, but block {block_id} holds tokens {blocks[block_id].token_ids}, not the " \
                       f"prompt's {chunk}: hash_to_block pointed at it (a hash collision), and only the token check " \
                       f"blocks[b].token_ids == the prompt's tokens makes it a hit"
        if isinstance(want, list) and len(result) > len(want) and result[:len(want)] == want:
            return f"answered {result}, but the prompt's block {len(want)} is not cached, so the hits stop there " \
                   f"({want}): a later block that hits is no use after a hole, since the prefix before it must be " \
                   f"computed anyway (break at the first miss, do not continue)"
    if name == "take_free_block":
        free_uncached, free_cached, hash_to_block, blocks = args
        cached = list(given[1])
        if not given[0] and len(cached) > 1 and result == cached[-1]:
            return f"evicted block {result}, the most recently freed of the cached free blocks {cached}: LRU " \
                   f"evicts the least recently freed ({cached[0]})"
        stale = [h for h, b in hash_to_block.items() if b == result]
        if isinstance(result, int) and stale and (0 <= result < len(blocks)) and blocks[result].hash is None:
            return f"block {result} was evicted but its entry is still in hash_to_block: a stale entry that " \
                   f"would point a later prompt at reused content (delete it when you evict)"
    return None


def _contents(args):
    """What a part may change of its arguments, comparable with ==."""
    out = []
    for arg in args:
        if isinstance(arg, list) and arg and isinstance(arg[0], Block):
            out.append([(b.ref_count, b.hash, b.token_ids) for b in arg])
        elif isinstance(arg, (deque, OrderedDict)):
            out.append(list(arg))
        elif isinstance(arg, torch.Tensor):
            out.append(arg.tolist())
        else:
            out.append(arg)
    return out


def _compare(got, want, what: str = "its answer") -> str | None:
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.shape == want.shape and (
            torch.equal(got.long(), want.long()) if not want.is_floating_point() else torch.equal(got, want))
        if not same:
            if want.is_floating_point() and isinstance(got, torch.Tensor) and got.shape == want.shape:
                kept, want_kept = torch.isfinite(got).sum(-1).tolist(), torch.isfinite(want).sum(-1).tolist()
                return f"{what} keeps {kept} tokens per row, labkit's {want_kept}"
            return f"{what} is {_short(got)}, labkit's {_short(want)}"
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{what} has keys {sorted(got) if isinstance(got, dict) else type(got).__name__}, " \
                   f"labkit's {sorted(want)}"
        for key in want:
            problem = _compare(got[key], want[key], f"{key}")
            if problem:
                return problem
        return None
    return None if got == want else f"{what} is {_short(got)}, labkit's {_short(want)}"


def _short(value) -> str:
    text = repr(value.tolist() if isinstance(value, torch.Tensor) and value.numel() < 64 else value)
    return text if len(text) < 240 else text[:240] + "…"


def _describe_args(args) -> str:
    parts = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append(repr(arg.tolist()) if arg.numel() <= 16 else f"tensor{tuple(arg.shape)}")
        elif isinstance(arg, list) and arg and isinstance(arg[0], Block):
            parts.append(f"{len(arg)} blocks")
        else:
            parts.append(_short(arg))
    return ", ".join(parts)


def _difference(got, expected) -> str:
    tokens, trace, _ = got
    want_tokens, want_trace, _ = expected
    for step, (mine, theirs) in enumerate(zip(trace, want_trace, strict=False)):
        if mine != theirs:
            return f"step {step + 1} runs (request, tokens) {mine}; labkit's runs {theirs}"
    for i, (mine, theirs) in enumerate(zip(tokens, want_tokens, strict=True)):
        if mine != theirs:
            from labkit_course.engine_parts import CAPSTONE_BATCHES

            prompt = [entry[0] for batch in CAPSTONE_BATCHES for entry in batch][i]
            return f"prompt {i} ({prompt!r}) generates {mine}, labkit's engine {theirs}"
    return f"the run takes {len(trace)} steps, labkit's {len(want_trace)}"


@exercise("11", "knowledge_check")
def knowledge_check(ns):
    from labkit.engine import Sequence
    from labkit.engine.model_runner import ModelRunner
    from labkit.sampling import SamplingParams
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    block_size = 8
    decoding = Sequence(list(range(100, 118)), SamplingParams())  # 17 tokens cached, the 18th is new
    decoding.block_table, decoding.num_cached_tokens = [5, 2, 9], 17
    prefilling = Sequence(list(range(200, 212)), SamplingParams())  # a 12-token prompt, first chunk of 6
    prefilling.block_table, prefilling.num_cached_tokens = [0, 1], 0
    storage = PagedKVStorage(1, 10, block_size, 1, 4)
    runner = ModelRunner(SimpleNamespace(device=torch.device("cpu")), storage, backend=None)
    step = runner.prepare([decoding, prefilling], [1, 6])
    return grade_answers(ns, {
        1: Number(len(step.input_ids), "'Inside generate: the step loop' and the diagram: one row per new token"),
        2: Number(len(step.sample_rows), "the diagram: which sequences' rows reach their last token"),
        3: Number(int(step.meta.slot_mapping[0]), "Lab 08 section 2: block_table[t // B] * B + t % B"),
        4: Choice("b", "the finish reasons after the first `generate`"),
        5: Choice("a", "'The prefix cache pays off at the first token'"),
    })

