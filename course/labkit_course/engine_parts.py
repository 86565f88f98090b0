"""The engine's replaceable parts: where a student's own functions plug into labkit's engine, through
the engine's public extension points alone (labkit knows nothing of this module).

    from labkit.engine import LLM
    from labkit_course.engine_parts import EngineParts
    parts = EngineParts(top_k_filter=my_top_k_filter, prepare_step=my_prepare_step)
    llm = LLM("smollm2", components=parts.components())

Each part has exactly the signature of the lab exercise that builds it, so the function a student
wrote in that lab plugs in unchanged:

| part                   | exercise                | the engine asks it                                        |
| ---------------------- | ----------------------- | --------------------------------------------------------- |
| `top_k_filter`         | Lab 06 `top_k_filter`   | the sampled rows' logits, after temperature, for one k    |
| `top_p_filter`         | Lab 06 `top_p_filter`   | the same after top-k, for one top_p                       |
| `cached_prefix_blocks` | Lab 09                  | which cached blocks a waiting prompt reuses               |
| `take_free_block`      | Lab 09                  | which free block new content goes into (LRU eviction)     |
| `can_append`           | Lab 10 `can_append`     | whether a running sequence's next tokens have KV slots    |
| `schedule_step`        | Lab 10 `schedule_step`  | which waiting requests join this step, with how many tokens |
| `prepare_step`         | Lab 11 `prepare_step`   | input_ids, positions, cu_seqlens_q/k, slot_mapping, block_tables |

A part left at its default (None) is labkit's own answer to that exercise (`labkit_<part>` below), written
against the same signature; `LLM(components=EngineParts().components())` therefore runs every adapter
below with labkit's answers and gives the tokens of `LLM()` (the tests check it). The adapters are the
block manager, scheduler and model runner that the engine builds through its public hook,
`EngineComponents` (labkit/engine/components.py lists the methods they override). They turn the
engine's state into each exercise's plain arguments, call the part, use its answer (a `can_append`
that says False preempts, even needlessly), and raise `PartError` naming the part when it raises,
answers something the engine cannot use, or leaves the engine without progress (no sequence due a
token for longer than any chunked prefill takes). Block-manager calls are all or nothing: a part that
fails halfway leaves the block pool as it was, so aborting the requests (as `generate` does on any
error) returns every block.
"""

import copy
import dataclasses
import functools
from collections.abc import Callable
from contextlib import contextmanager

import torch

from labkit.cache.block_manager import BlockManager, find_prefix_hits, pop_free_block
from labkit.cache.sequence_blocks import BlockSequence
from labkit.engine.components import EngineComponents
from labkit.engine.model_runner import ModelRunner, StepInputs, StepTensors, flatten_step
from labkit.engine.scheduler import Scheduler, SchedulerOutput
from labkit.engine.sequence import Sequence
from labkit.sampling import Sampler, SamplingParams
from labkit.sampling.filters import apply_top_k, apply_top_p


class PartError(RuntimeError):
    """An engine part raised, or returned something the engine cannot use; the message names the part."""

    def __init__(self, part: str, problem: str):
        super().__init__(f"engine part `{part}`: {problem}")
        self.part = part


@dataclasses.dataclass(frozen=True)
class Request:
    """A waiting request as `schedule_step` sees it (Lab 10's record)."""

    id: str
    priority: int  # higher runs first (the engine passes its aged, effective priority)
    arrival: int  # earlier runs first among equal priorities
    prompt_len: int  # tokens still to compute (prefix-cache hits already taken off)
    blocks: int  # free KV blocks admitting it takes


# --- labkit's own answers, with the exercises' signatures (named apart from the exercises, so that a
# student's `self.prepare_step` is never taken for a use of labkit's) ----------------------------
def labkit_top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th included); the rest become -inf."""
    return apply_top_k(logits, torch.full((logits.shape[0],), k, device=logits.device))


def labkit_top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches top_p."""
    return apply_top_p(logits, torch.full((logits.shape[0],), top_p, dtype=torch.float64, device=logits.device))


def labkit_cached_prefix_blocks(token_ids: list[int], block_size: int, hash_to_block: dict, blocks: list) -> list[int]:
    """Ids of the cached blocks a prompt reuses: the chained-hash lookup of `BlockManager.prefix_hits`."""
    return [block.block_id for block in find_prefix_hits(token_ids, block_size, hash_to_block, blocks)]


def labkit_take_free_block(free_uncached, free_cached, hash_to_block: dict, blocks: list) -> int:
    """A never-cached free block if there is one, else the least recently freed cached one, evicted."""
    return pop_free_block(free_uncached, free_cached, hash_to_block, blocks)


def labkit_can_append(num_tokens: int, num_blocks_held: int, block_size: int, num_free_blocks: int) -> bool:
    """Whether a sequence of num_tokens tokens holding num_blocks_held blocks finds KV slots for them all."""
    return -(-num_tokens // block_size) - num_blocks_held <= num_free_blocks


def labkit_schedule_step(running: list, waiting: list, token_budget: int, max_num_seqs: int,
                  free_blocks: int) -> list[tuple]:
    """labkit's admission rule: running ones decode one token each; then waiting requests by priority
    and arrival, while seats, tokens and blocks last, each chunked to the budget; the head is never
    skipped."""
    plan = [(rid, 1) for rid in running]
    budget = token_budget - len(plan)
    for req in sorted(waiting, key=lambda r: (-r.priority, r.arrival)):
        if budget <= 0 or len(plan) >= max_num_seqs or req.blocks > free_blocks:
            break
        plan.append((req.id, min(req.prompt_len, budget)))
        budget -= plan[-1][1]
        free_blocks -= req.blocks
    return plan


def labkit_prepare_step(token_ids: list[list[int]], num_computed: list[int], num_new: list[int],
                 block_tables: list[list[int]], block_size: int) -> dict[str, torch.Tensor]:
    """One step's model inputs: sequence i computes its tokens num_computed[i] .. + num_new[i]."""
    seqs = [BlockSequence(i, list(t), list(b), c)
            for i, (t, c, b) in enumerate(zip(token_ids, num_computed, block_tables, strict=True))]
    return flatten_step(seqs, list(num_new), block_size)._asdict()


STEP_KEYS = StepTensors._fields


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """The replaceable parts of `LLM` (see the module docstring); each left None is labkit's own."""

    top_k_filter: Callable | None = None
    top_p_filter: Callable | None = None
    cached_prefix_blocks: Callable | None = None
    take_free_block: Callable | None = None
    can_append: Callable | None = None
    schedule_step: Callable | None = None
    prepare_step: Callable | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            part = getattr(self, field.name)
            if part is not None and not callable(part):
                raise TypeError(f"engine part `{field.name}` must be callable, or None for labkit's own, got {part!r}")

    def part(self, name: str) -> Callable:
        """Part `name`: the function given, or labkit's own (`labkit_<name>`, looked up in this module
        when asked, so that a grader's tripwire on it holds however the parts were made)."""
        return getattr(self, name) or globals()[f"labkit_{name}"]

    def components(self) -> EngineComponents:
        """The engine's block manager, scheduler and model runner, asking these parts: pass it as
        `LLM(..., components=parts.components())`."""
        return EngineComponents(block_manager=functools.partial(PartsBlockManager, self),
                                scheduler=functools.partial(PartsScheduler, self),
                                model_runner=functools.partial(PartsModelRunner, self))

    def call(self, name: str, *args):
        """Call part `name`; anything it raises comes back as a PartError naming it."""
        try:
            return self.part(name)(*args)
        except PartError:
            raise
        except Exception as error:
            raise PartError(name, f"raised {type(error).__name__}: {error}") from error


# --- the adapters: the engine's components, asking the parts ---------------------------------
class PartsBlockManager(BlockManager):
    """The BlockManager with its prefix lookup, free-block choice and append rule asked of the parts."""

    def __init__(self, parts: EngineParts, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts = parts
        self.needless_preemptions = 0  # times can_append said False although the blocks were there

    def prefix_hits(self, token_ids):
        if not self.enable_prefix_caching:
            return []
        ids = self.parts.call("cached_prefix_blocks", list(token_ids), self.block_size, self.hash_to_block,
                              self.blocks)
        limit = (len(token_ids) - 1) // self.block_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < self.num_blocks for i in ids):
            raise PartError("cached_prefix_blocks", f"must return a list of block ids in [0, {self.num_blocks}), "
                                                    f"got {ids!r}")
        if len(ids) > limit:
            raise PartError("cached_prefix_blocks", f"returned {len(ids)} blocks for {len(token_ids)} tokens: at "
                                                    f"most {limit} full blocks before the last token can hit")
        return [self.blocks[i] for i in ids]

    def take_free_block(self) -> int:
        evicting = not self.free_uncached
        if not self.num_free_blocks:
            raise PartError("take_free_block", "called with no free block (an engine bug)")
        block_id = self.parts.call("take_free_block", self.free_uncached, self.free_cached, self.hash_to_block,
                                   self.blocks)
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise PartError("take_free_block", f"must return a block id in [0, {self.num_blocks}), got {block_id!r}")
        if block_id in self.free_uncached or block_id in self.free_cached:
            raise PartError("take_free_block", f"block {block_id} is still in a free list after it was taken")
        if self.blocks[block_id].ref_count != 1:
            raise PartError("take_free_block", f"block {block_id} has ref_count {self.blocks[block_id].ref_count} "
                                               "after it was taken; its new owner makes it 1")
        self.stats.evictions += evicting
        return block_id

    def can_append(self, seq) -> bool:
        # A copy-on-write copy of a shared partial block takes one free block more.
        free = self.num_free_blocks - len(self.shared_write_indexes(seq))
        self.missing_blocks(seq)  # its checks: the sequence holds blocks, no tokens were removed
        answer = self.parts.call("can_append", len(seq.token_ids), len(seq.block_table), self.block_size, free)
        if not isinstance(answer, bool):
            raise PartError("can_append", f"must return True or False, got {answer!r}")
        # The answer decides: False preempts (needlessly, if there was room), True goes on to append,
        # which cannot go on without a slot for every token.
        if answer and not super().can_append(seq):
            raise PartError("can_append", f"answered True for {len(seq.token_ids)} tokens in {len(seq.block_table)} "
                                          f"blocks of {self.block_size} with {free} free, but they need "
                                          f"{self.missing_blocks(seq)} more block(s): the next token has no KV slot")
        if not answer and super().can_append(seq):
            self.needless_preemptions += 1
        return answer

    # All or nothing: a part failing halfway leaves the pool as it was.
    @contextmanager
    def _unchanged_on_error(self):
        saved = (copy.copy(self.blocks), [dataclasses.replace(b) for b in self.blocks], copy.copy(self.free_uncached),
                 copy.copy(self.free_cached), dict(self.hash_to_block), dataclasses.replace(self.stats))
        try:
            yield
        except BaseException:
            objects, states, free_uncached, free_cached, hash_to_block, stats = saved
            for block, state in zip(objects, states, strict=True):  # Block's public fields, in place
                for field in dataclasses.fields(block):
                    setattr(block, field.name, getattr(state, field.name))
            self.blocks[:] = objects
            self.free_uncached.clear()
            self.free_uncached.extend(free_uncached)
            self.free_cached.clear()
            self.free_cached.update(free_cached)
            self.hash_to_block.clear()
            self.hash_to_block.update(hash_to_block)
            self.stats = stats
            raise

    def allocate(self, seq, use_prefix_cache: bool = True) -> None:
        with self._unchanged_on_error():
            super().allocate(seq, use_prefix_cache)

    def append(self, seq, storage=None):
        with self._unchanged_on_error():
            return super().append(seq, storage)

    def swap_in(self, seq, storage) -> None:
        with self._unchanged_on_error():
            super().swap_in(seq, storage)


class PartsScheduler(Scheduler):
    """The Scheduler with admission (step 3) decided by the `schedule_step` part."""

    def __init__(self, parts: EngineParts, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts = parts
        self.idle_steps = 0  # steps in a row in which no sequence was due its next token
        self._needless_before = 0  # the block manager's needless preemptions when a token was last due

    def schedule(self) -> SchedulerOutput:
        """labkit's schedule, stopped with a PartError naming the part when the engine makes no
        progress: no sequence due a token for longer than any prompt's chunked prefill can take."""
        out = super().schedule()
        needless = getattr(self.block_manager, "needless_preemptions", 0)
        if any(seq.num_cached_tokens + n == seq.num_tokens for seq, n in zip(out.seqs, out.num_new_tokens,
                                                                             strict=True)):
            self.idle_steps, self._needless_before = 0, needless
            return out
        self.idle_steps += 1
        if self.idle_steps > self.config.max_model_len + 1:
            if needless > self._needless_before:
                raise PartError("can_append", f"no sequence got a token in {self.idle_steps} steps: your can_append "
                                              f"answered False {needless - self._needless_before} times although the "
                                              "free blocks were enough, and each False preempts a sequence")
            raise PartError("schedule_step", f"no sequence got a token in {self.idle_steps} steps: the engine makes "
                                             "no progress with the plans schedule_step returns")
        return out

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting or budget <= 0:
            return
        bm = self.block_manager
        # This step's decodes are the `running` the exercise plans first, one token each.
        decodes = [seq for seq, n in zip(out.seqs, out.num_new_tokens, strict=True) if not seq.is_prefill and n == 1]
        ids = {f"seq{seq.seq_id}": seq for seq in self.waiting}
        waiting = []
        for name, seq in ids.items():
            use_cache = self.uses_prefix_cache(seq)
            hits = bm.prefix_hits(seq.token_ids) if use_cache else []
            cached = min(len(hits) * bm.block_size, seq.num_tokens - 1)
            to_compute = self.capped_prefill(seq.num_tokens - cached)
            waiting.append(Request(name, self.effective_priority(seq), seq.arrival_order, to_compute,
                                   bm.blocks_to_take(seq.token_ids, hits)))
        running = [f"seq{seq.seq_id}" for seq in decodes]
        seats = self.config.max_num_seqs - len(self.running) + len(decodes)
        plan = self.parts.call("schedule_step", running, waiting, budget + len(decodes), seats,
                               bm.num_free_blocks)
        if not isinstance(plan, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in plan):
            raise PartError("schedule_step", f"must return a list of (request id, tokens) pairs, got {plan!r}")
        if plan[:len(running)] != [(rid, 1) for rid in running]:
            raise PartError("schedule_step", f"the plan must start with the running requests {running}, one token "
                                             f"each; got {plan[:len(running)]}")
        wanted = {r.id: r.prompt_len for r in waiting}
        for rid, n in plan[len(running):]:
            seq = ids.get(rid)
            if seq is None or seq not in self.waiting:
                raise PartError("schedule_step", f"admitted {rid!r}, which is not a waiting request (or twice)")
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= min(budget, wanted[rid]):
                raise PartError("schedule_step", f"gave {rid!r} {n!r} tokens; it has {wanted[rid]} to compute "
                                                 f"and {budget} tokens of budget are left")
            if len(self.running) >= self.config.max_num_seqs:
                raise PartError("schedule_step", f"admitted {rid!r} past max_num_seqs={self.config.max_num_seqs}")
            if not bm.can_allocate(seq, self.uses_prefix_cache(seq)):
                raise PartError("schedule_step", f"admitted {rid!r}, whose blocks do not fit the free pool")
            if not self.config.enable_chunked_prefill and n < wanted[rid]:
                raise PartError("schedule_step", f"cut {rid!r}'s prompt to {n} tokens, but chunked prefill is off")
            budget -= self.admit(seq, n, out)
        if out.is_empty:  # nothing runs: the head of the queue fits the empty cache (check_fits)
            raise PartError("schedule_step", f"planned nothing although nothing runs and {len(waiting)} request(s) "
                                             f"wait: admit the first by priority and arrival, or the engine waits "
                                             f"forever (waiting={waiting}, token_budget={budget}, "
                                             f"free_blocks={bm.num_free_blocks})")


class PartsModelRunner(ModelRunner):
    """The ModelRunner with the step's tensors built by the `prepare_step` part."""

    def __init__(self, parts: EngineParts, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts = parts
        self.sampler = PartsSampler(parts)

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int],
                num_scored: list[int] | None = None) -> StepInputs:
        step = self.parts.call("prepare_step", [list(seq.token_ids) for seq in seqs],
                               [seq.num_cached_tokens for seq in seqs], list(num_new_tokens),
                               [list(seq.block_table) for seq in seqs], self.block_size)
        tensors = _check_step(step, seqs, num_new_tokens, self.storage.num_blocks * self.block_size)
        return self.step_inputs(seqs, *tensors, num_scored)


def _check_step(step, seqs, num_new_tokens, num_slots: int) -> list[torch.Tensor]:
    """The part's tensors in labkit's dtypes, after checking what a wrong step would break on."""
    if not isinstance(step, dict) or set(step) != set(STEP_KEYS):
        got = sorted(step) if isinstance(step, dict) else type(step).__name__
        raise PartError("prepare_step", f"must return a dict with keys {list(STEP_KEYS)}, got {got}")
    for key in STEP_KEYS:
        value = step[key]
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
            raise PartError("prepare_step", f"{key} must be an integer tensor, got {value!r}")
    total, batch = sum(num_new_tokens), len(seqs)
    shapes = {"input_ids": (total,), "positions": (total,), "cu_seqlens_q": (batch + 1,),
              "cu_seqlens_k": (batch + 1,), "slot_mapping": (total,)}
    for key, shape in shapes.items():
        if tuple(step[key].shape) != shape:
            raise PartError("prepare_step", f"{key} must have shape {shape} for {batch} sequences and {total} new "
                                            f"tokens, got {tuple(step[key].shape)}")
    tables = step["block_tables"]
    if tables.dim() != 2 or tables.shape[0] != batch or tables.shape[1] < max(len(s.block_table) for s in seqs):
        raise PartError("prepare_step", f"block_tables must be [{batch}, longest block table], "
                                        f"got {tuple(tables.shape)}")
    cu_q, cu_k = step["cu_seqlens_q"], step["cu_seqlens_k"]
    if cu_q.diff().tolist() != list(num_new_tokens) or int(cu_q[0]) != 0:
        raise PartError("prepare_step", f"cu_seqlens_q {cu_q.tolist()} must be the running sum of the new tokens "
                                        f"{list(num_new_tokens)}, from 0")
    contexts = [seq.num_cached_tokens + n for seq, n in zip(seqs, num_new_tokens, strict=True)]
    if int(cu_k[0]) != 0 or cu_k.diff().tolist() != contexts:
        why = ("counts only the new tokens, so no sequence ever reaches its end and none is sampled"
               if cu_k.diff().tolist() == list(num_new_tokens) else "is not that")
        raise PartError("prepare_step", f"cu_seqlens_k {cu_k.tolist()} must be the running sum, from 0, of each "
                                        f"sequence's context, cached + new tokens ({contexts}); it {why}")
    slots = step["slot_mapping"]
    if len(slots) and (slots.min() < 0 or slots.max() >= num_slots):
        raise PartError("prepare_step", f"slot_mapping {slots.tolist()} has slots outside the cache's "
                                        f"[0, {num_slots})")
    return [*(step[key].to(torch.int64) for key in STEP_KEYS[:5]), tables.to(torch.int32)]


class PartsSampler(Sampler):
    """The Sampler with top-k and top-p asked of the parts, one call per distinct setting."""

    def __init__(self, parts: EngineParts):
        super().__init__()
        self.parts = parts

    def top_k(self, logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None) -> torch.Tensor:
        return self._per_setting(logits, "top_k_filter", top_k, lambda k: k > 0, int)

    def top_p(self, logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return self._per_setting(logits, "top_p_filter", top_p, lambda p: p < 1, float)

    def _per_setting(self, logits, part: str, settings: torch.Tensor, enabled, cast) -> torch.Tensor:
        result = logits.clone()
        for value in sorted(set(settings.tolist())):
            if not enabled(value):
                continue
            rows = (settings == value).nonzero().flatten()
            given = logits[rows]
            filtered = self.parts.call(part, given.clone(), cast(value))
            if not isinstance(filtered, torch.Tensor) or filtered.shape != given.shape:
                shape = tuple(filtered.shape) if isinstance(filtered, torch.Tensor) else type(filtered).__name__
                raise PartError(part, f"must return a tensor of shape {tuple(given.shape)}, got {shape}")
            if not torch.isfinite(filtered).any(-1).all():
                raise PartError(part, "removed every token of a row: the most likely one must stay")
            result[rows] = filtered.to(result.dtype)
        return result


# --- Lab 11's capstone: the workload its check runs with a student's parts ----------------------
CAPSTONE_ENGINE = {"block_size": 8, "num_kvcache_blocks": 7, "max_num_batched_tokens": 32, "max_num_seqs": 3,
                   "max_model_len": 64}
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # 38 tokens: longer than a step's token budget
STORY = "Once upon a time, in a small village at the edge of a forest,"
COLORS = "red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown, pink, gold, silver, cyan, teal,"
CAPSTONE_BATCHES = [  # (prompt, priority) or (prompt, priority, max_tokens); 4 tokens by default
    # More requests than seats, three priorities, a prompt that must be chunked, a head of the queue
    # that does not fit while a later request would, and decodes that run out of blocks (preemption).
    [("The three primary colors are", 0), (COUNT, 0), ("The capital of France is", 1), (STORY, 1),
     ("Water boils at", 2)],
    # After the first batch every free block is cached: a prompt that reuses cached blocks, and new
    # prompts whose blocks are taken by evicting among several cached candidates (least recent first).
    [(COUNT, 0), ("A recipe for bread needs flour,", 1), (STORY + " there lived", 0),
     ("Two plus two is", 0)],
    # STORY is exactly two blocks, both cached by the second batch: only the first may hit, since the
    # last prompt token is always computed. COLORS does not fit beside the other two; it is admitted
    # when STORY finishes, while the longer request (8 tokens) still decodes, so its chunk is the
    # budget that decode leaves.
    [(STORY, 2), ("The sky is", 1, 8), (COLORS, 0)],
]


def capstone_requests(batch: list[tuple]) -> tuple[list[str], list[SamplingParams], list[int]]:
    """A capstone batch as `generate`'s prompts, sampling params and priorities: greedy and seeded
    requests in turn (the seeded ones hot and narrow, so a filter that keeps one token too many or
    too few changes a draw)."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seeded = SamplingParams(temperature=1.5, top_k=3, top_p=0.7, seed=7, max_tokens=4, ignore_eos=True)
    params = [dataclasses.replace((greedy, seeded)[i % 2], max_tokens=(*entry[2:], 4)[0])
              for i, entry in enumerate(batch)]
    return [entry[0] for entry in batch], params, [entry[1] for entry in batch]
