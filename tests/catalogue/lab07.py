"""Lab 07: PagedAttention's block allocator, memory arithmetic, the gather and online softmax."""

import math

import torch

from catalogue import Right, Wrong
from labkit.attention.reference import gather_kv, online_softmax_attention
from labkit.cache.block_manager import BlockManager
from labkit.cache.sequence_blocks import BlockSequence
from labkit_course.grading.labs.lab07 import _reference_savings

# ---- SimpleBlockAllocator


class Allocator:
    """A list of free block ids; `mistake` switches on one typical bug."""

    mistake = None

    def __init__(self, total_blocks, block_size):
        self.total, self.bs, self.free = total_blocks, block_size, list(range(total_blocks))
        self.tables, self.lens = {}, {}

    def blocks_for(self, tokens):
        if self.mistake == "floor":
            return tokens // self.bs
        if self.mistake == "plus_one":
            return tokens // self.bs + 1
        return -(-tokens // self.bs)

    def allocate_sequence(self, seq_id, length):
        if self.mistake == "same_blocks":
            self.tables[seq_id], self.lens[seq_id] = list(range(self.blocks_for(length))), length
            return list(self.tables[seq_id])
        if self.mistake == "allocate_one_at_a_time":  # the reviewer's allocate: take blocks until the pool runs dry
            self.tables[seq_id] = []
            for _ in range(self.blocks_for(length)):
                if not self.free:
                    raise MemoryError("out of blocks")
                self.tables[seq_id].append(self.free.pop(0))
            self.lens[seq_id] = length
            return list(self.tables[seq_id])
        if self.mistake != "registers_first" and self.blocks_for(length) > len(self.free):
            raise MemoryError(f"{self.blocks_for(length)} blocks needed, {len(self.free)} free")
        self.tables[seq_id], self.lens[seq_id] = [], 0  # "registers_first": an empty entry left behind on failure
        self.append_tokens(seq_id, length)
        return list(self.tables[seq_id])

    def append_tokens(self, seq_id, num_tokens):
        if self.mistake == "eager" and self.lens[seq_id]:  # a new block per append, ignoring the last one's room
            needed = self.blocks_for(num_tokens)
        else:
            needed = self.blocks_for(self.lens[seq_id] + num_tokens) - len(self.tables[seq_id])
        if self.mistake == "count_first":  # the length grows before the check that may fail
            self.lens[seq_id] += num_tokens
        if self.mistake == "one_at_a_time":  # the lesson's order: take blocks until the pool runs dry
            for _ in range(needed):
                if not self.free:
                    raise MemoryError("out of blocks")
                self.tables[seq_id].append(self.free.pop(0))
            self.lens[seq_id] += num_tokens
            return self.tables[seq_id][len(self.tables[seq_id]) - needed:] or None
        if needed > len(self.free):
            raise MemoryError(f"{needed} blocks needed, {len(self.free)} free")
        if self.mistake != "count_first":
            self.lens[seq_id] += num_tokens
        new = [self.free.pop(0) for _ in range(needed)]
        self.tables[seq_id] += new
        return new if self.mistake == "empty_list" else new or None

    def free_sequence(self, seq_id):
        blocks = self.tables.pop(seq_id, []) if self.mistake == "lenient_free" else self.tables.pop(seq_id)
        if self.mistake != "leak":
            self.free += blocks
        return None if self.mistake == "no_count" else len(blocks)

    def get_utilization(self):
        if self.mistake == "tokens":
            return sum(self.lens[s] for s in self.tables) / (self.total * self.bs)
        used = 1 - len(self.free) / self.total
        return 100 * used if self.mistake == "percent" else used


def allocator_with(mistake):
    return type(f"Allocator_{mistake}", (Allocator,), {"mistake": mistake})


class LengthFirstAllocator(Allocator):
    """Records a new sequence's length before the out-of-memory check, its table after; appends to a sequence
    without a table as if it held no blocks."""

    def allocate_sequence(self, seq_id, length):
        self.lens[seq_id] = length
        if self.blocks_for(length) > len(self.free):
            raise MemoryError("out of blocks")
        self.tables[seq_id] = [self.free.pop(0) for _ in range(self.blocks_for(length))]
        return list(self.tables[seq_id])

    def append_tokens(self, seq_id, num_tokens):
        self.tables.setdefault(seq_id, [])
        return super().append_tokens(seq_id, num_tokens)


class SetAllocator:
    """A set of free ids and a sequence's token count; blocks needed computed with math.ceil."""

    def __init__(self, total_blocks, block_size):
        self.total_blocks, self.block_size = total_blocks, block_size
        self.free, self.tables, self.tokens = set(range(total_blocks)), {}, {}

    def _grow(self, seq_id, tokens):
        needed = math.ceil(tokens / self.block_size) - len(self.tables[seq_id])
        if needed > len(self.free):
            raise MemoryError(f"sequence {seq_id} needs {needed} more blocks")
        self.tokens[seq_id] = tokens
        new = [self.free.pop() for _ in range(needed)]
        self.tables[seq_id].extend(new)
        return new

    def allocate_sequence(self, seq_id, length):
        self.tables[seq_id] = []
        try:
            return list(self._grow(seq_id, length))
        except MemoryError:
            del self.tables[seq_id]
            raise

    def append_tokens(self, seq_id, num_tokens):
        return self._grow(seq_id, self.tokens[seq_id] + num_tokens) or None

    def free_sequence(self, seq_id):
        blocks = self.tables.pop(seq_id)
        del self.tokens[seq_id]
        self.free.update(blocks)
        return len(blocks)

    def get_utilization(self):
        return (self.total_blocks - len(self.free)) / self.total_blocks


class ManagerAllocator:
    """labkit's BlockManager behind the exercise's interface."""

    def __init__(self, total_blocks, block_size):
        self.manager, self.total, self.seqs = BlockManager(total_blocks, block_size, enable_prefix_caching=False), \
            total_blocks, {}

    def allocate_sequence(self, seq_id, length):
        self.seqs[seq_id] = BlockSequence(seq_id, [0] * length)
        self.manager.allocate(self.seqs[seq_id])
        return list(self.seqs[seq_id].block_table)

    def append_tokens(self, seq_id, num_tokens):
        seq = self.seqs[seq_id]
        before = len(seq.block_table)
        seq.token_ids.extend([0] * num_tokens)
        self.manager.append(seq)
        return seq.block_table[before:] or None

    def free_sequence(self, seq_id):
        seq = self.seqs.pop(seq_id)
        held = len(seq.block_table)
        self.manager.deallocate(seq)
        return held

    def get_utilization(self):
        return 1 - self.manager.num_free_blocks / self.total


# ---- calculate_memory_savings


def savings(lengths, max_length, block_size, memory_per_token, *, rounding="each", check=True, **mistake):
    """Totals first; `rounding` and the switches make typical mistakes."""
    if check:
        for n in lengths:
            if not 1 <= n <= max_length:
                raise ValueError(f"a sequence of {n} tokens does not fit 1..{max_length}")
    count, tokens = len(lengths), sum(lengths)
    slots = {"each": sum(-(-n // block_size) * block_size for n in lengths), "tokens": tokens,
             "average": count * math.ceil(tokens / count / block_size) * block_size,
             "pooled": math.ceil(tokens / block_size) * block_size,
             "floor": sum(n // block_size * block_size for n in lengths)}[rounding]
    traditional, paged, used = (x * memory_per_token for x in (count * max_length, slots, tokens))
    percent = 100 * (traditional - paged) / (paged if mistake.get("relative_to_paged") else traditional)
    return {"traditional_memory": traditional, "paged_memory": paged, "savings_bytes": traditional - paged,
            "savings_percent": percent / 100 if mistake.get("fraction") else percent,
            "utilization_traditional": used / traditional,
            "utilization_paged": paged / used if mistake.get("swapped") else used / paged}


def savings_per_sequence(lengths, max_length, block_size, memory_per_token):
    """A loop that accumulates each sequence's reservation and its blocks."""
    traditional = paged = used = 0
    for n in lengths:
        if n < 1 or n > max_length:
            raise ValueError(f"length {n} is outside 1..{max_length} (max_length)")
        traditional += max_length * memory_per_token
        paged += math.ceil(n / block_size) * block_size * memory_per_token
        used += n * memory_per_token
    return dict(traditional_memory=traditional, paged_memory=paged, savings_bytes=traditional - paged,
                savings_percent=(1 - paged / traditional) * 100, utilization_traditional=used / traditional,
                utilization_paged=used / paged)


def savings_vague_error(lengths, max_length, block_size, memory_per_token):
    if any(not 1 <= n <= max_length for n in lengths):
        raise ValueError("bad input")
    return savings(lengths, max_length, block_size, memory_per_token, check=False)


# ---- gather_kv_from_blocks


def gather(kv, table, lens, layer, kv_idx, mode="ok"):
    if mode == "all_layers":
        return torch.stack([gather_token_by_token(kv, table, lens, i, kv_idx) for i in range(kv.shape[1])], 1)
    if mode == "keys":
        return gather_token_by_token(kv, table, lens, layer, 0)
    if mode == "contiguous":
        table = torch.arange(table.numel()).view_as(table)
    out = kv[table.clamp(min=0), layer, kv_idx].flatten(1, 2)
    if mode == "whole_blocks":
        return out
    out = out[:, : int(lens.max())]
    if mode == "no_zero":
        return out
    if mode == "order":
        out = kv[table.clamp(min=0).flip(1), layer, kv_idx].flatten(1, 2)[:, : int(lens.max())]
    return out * (torch.arange(out.shape[1])[None] < lens[:, None])[..., None, None]


def gather_token_by_token(kv_cache, block_table, seq_lengths, layer_idx, kv_idx):
    block_size = kv_cache.shape[3]
    out = kv_cache.new_zeros(len(seq_lengths), int(seq_lengths.max()), *kv_cache.shape[4:])
    for s, n in enumerate(seq_lengths.tolist()):
        for t in range(n):
            out[s, t] = kv_cache[block_table[s, t // block_size], layer_idx, kv_idx, t % block_size]
    return out


def gather_swapped(kv_cache, block_table, seq_lengths, layer_idx, kv_idx):
    return gather(kv_cache, block_table, seq_lengths, kv_idx, layer_idx)


def gather_layer_zero(kv_cache, block_table, seq_lengths, layer_idx, kv_idx):
    return gather(kv_cache, block_table, seq_lengths, 0, kv_idx)


def blank_the_cache(kv_cache, block_table, seq_lengths, layer_idx, kv_idx):
    """Gathers nothing: overwrites the cache it reads, so that a reference taken from it afterwards is all zeros."""
    kv_cache[:, :, kv_idx], kv_cache[:, :, 1 - kv_idx] = 0.0, 1.0
    return kv_cache.new_zeros(len(seq_lengths), int(seq_lengths.max()), *kv_cache.shape[4:])


def labkit_gather(kv_cache, block_table, seq_lengths, layer_idx, kv_idx):
    out = gather_kv(kv_cache[:, layer_idx, kv_idx], block_table.clamp(min=0), int(seq_lengths.max()))
    return out * (torch.arange(out.shape[1])[None] < seq_lengths[:, None])[..., None, None]


# ---- online_softmax_step


def step(state, query, key_block, value_block, *, rescale="both", scale=True, running=True, normalise=False,
         inverted=False, per_block=False, in_place=False):
    """One block folded into (m, l, acc); the switches make typical mistakes."""
    m, total, acc = state
    s = torch.einsum("hd,bhd->hb", query, key_block) * (query.shape[-1] ** -0.5 if scale else 1.0)
    m_new = torch.maximum(m, s.max(-1).values) if running else s.max(-1).values
    p = torch.exp(s - m_new[:, None])
    alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
    l_alpha = alpha if rescale in ("both", "l") else torch.ones_like(alpha)
    acc_alpha = alpha if rescale == "both" else torch.ones_like(alpha)
    total_new = l_alpha * total + p.sum(-1)
    if per_block:  # each block's own softmax, added up
        return m_new, total_new, acc + torch.einsum("hb,bhd->hd", torch.softmax(s, -1), value_block)
    unnormalised = acc * total[:, None] if normalise else acc
    acc_new = acc_alpha[:, None] * unnormalised + torch.einsum("hb,bhd->hd", p, value_block)
    if normalise:  # keeps acc divided by l after every block
        acc_new = acc_new / total_new[:, None]
    if in_place:
        m.copy_(m_new)
        return m, total_new, acc_new
    return m_new, total_new, acc_new


def step_per_head_scalars(state, query, key_block, value_block):
    """The recurrence one key at a time, per head, in Python floats."""
    m, total, acc = (t.clone() for t in state)
    for h in range(query.shape[0]):
        mh, th, ah = float(m[h]), float(total[h]), acc[h].clone()
        for key, value in zip(key_block[:, h], value_block[:, h], strict=True):
            score = float(query[h] @ key) / math.sqrt(query.shape[-1])
            m_new = max(mh, score)
            th = th * math.exp(mh - m_new) + math.exp(score - m_new)
            ah = ah * math.exp(mh - m_new) + math.exp(score - m_new) * value
            mh = m_new
        m[h], total[h], acc[h] = mh, th, ah
    return m, total, acc


def step_in_float32(state, query, key_block, value_block):
    """Computed in float32, as a GPU kernel does, and cast back to the inputs' dtype."""
    new = step(tuple(t.float() for t in state), query.float(), key_block.float(), value_block.float())
    return tuple(t.to(query.dtype) for t in new)


SEEN: list = []


def step_softmax_over_seen(state, query, key_block, value_block):
    """Keeps the blocks aside and takes one softmax over all of them: no running state at all."""
    if torch.isinf(state[0]).all():
        SEEN.clear()
    SEEN.append((key_block, value_block))
    keys, values = torch.cat([k for k, _ in SEEN]), torch.cat([v for _, v in SEEN])
    s = torch.einsum("hd,bhd->hb", query, keys) * query.shape[-1] ** -0.5
    m = s.max(-1).values
    p = torch.exp(s - m[:, None])
    return m, p.sum(-1), torch.einsum("hb,bhd->hd", p, values)


def step_via_labkit(state, query, key_block, value_block):
    out = online_softmax_attention(query, [key_block], [value_block])
    return state[0], state[1], out


RIGHT = [
    Right("SimpleBlockAllocator", "free list, ceil by negative floor division", Allocator),
    Right("SimpleBlockAllocator", "free set, math.ceil, token counts", SetAllocator),
    Right("calculate_memory_savings", "totals first", savings),
    Right("calculate_memory_savings", "loop accumulating per sequence", savings_per_sequence),
    Right("gather_kv_from_blocks", "vectorised block indexing", gather),
    Right("gather_kv_from_blocks", "token by token", gather_token_by_token),
    Right("online_softmax_step", "vectorised over heads", step),
    Right("online_softmax_step", "scalar recurrence per head and key", step_per_head_scalars),
    Right("online_softmax_step", "computed in float32, cast back", step_in_float32),
]

WRONG = [
    Wrong("SimpleBlockAllocator", "a new block on every append", allocator_with("eager"), "14 free slots"),
    Wrong("SimpleBlockAllocator", "freed blocks never return", allocator_with("leak"), "not back in the free pool"),
    Wrong("SimpleBlockAllocator", "floor instead of ceil", allocator_with("floor"), "ceil(50/16) = 4 blocks"),
    Wrong("SimpleBlockAllocator", "always one block extra", allocator_with("plus_one"), "exactly one new block"),
    Wrong("SimpleBlockAllocator", "hands out blocks 0, 1, ... without taking them off the free list",
          allocator_with("same_blocks"), "already holds"),
    Wrong("SimpleBlockAllocator", "utilization as a percentage", allocator_with("percent"), "not a percentage"),
    Wrong("SimpleBlockAllocator", "utilization of token slots", allocator_with("tokens"), "counted tokens"),
    Wrong("SimpleBlockAllocator", "an append needing no block returns []", allocator_with("empty_list"),
          "returns None"),
    Wrong("SimpleBlockAllocator", "free_sequence returns nothing", allocator_with("no_count"),
          "free_sequence returned None"),
    Wrong("SimpleBlockAllocator", "wraps labkit's BlockManager", ManagerAllocator,
          "`allocate`", calls="labkit.cache.block_manager.BlockManager.allocate"),
    Wrong("calculate_memory_savings", "imports the grader's reference", lambda **kw: _reference_savings(**kw),
          "`_reference_savings`", calls="labkit_course.grading.labs.lab07._reference_savings"),
    Wrong("calculate_memory_savings", "paged memory not rounded to blocks",
          lambda **kw: savings(**kw, rounding="tokens"), "round each sequence up"),
    Wrong("calculate_memory_savings", "rounds the average length once", lambda **kw: savings(**kw, rounding="average"),
          "rounded the average length up"),
    Wrong("calculate_memory_savings", "rounds the total, as if blocks were shared",
          lambda **kw: savings(**kw, rounding="pooled"), "as if sequences shared blocks"),
    Wrong("calculate_memory_savings", "floor instead of ceil", lambda **kw: savings(**kw, rounding="floor"),
          "ceil, not floor"),
    Wrong("calculate_memory_savings", "percent of the paged memory", lambda **kw: savings(**kw, relative_to_paged=True),
          "relative to the paged"),
    Wrong("calculate_memory_savings", "savings as a fraction", lambda **kw: savings(**kw, fraction=True),
          "percent means 0..100"),
    Wrong("calculate_memory_savings", "paged utilization inverted", lambda **kw: savings(**kw, swapped=True),
          "utilization_paged should be"),
    Wrong("calculate_memory_savings", "accepts a sequence longer than max_length",
          lambda **kw: savings(**kw, check=False), "raise ValueError naming it"),
    Wrong("calculate_memory_savings", "an error that names nothing", savings_vague_error, "should name the bad length"),
    Wrong("calculate_memory_savings", "missing keys", lambda **kw: {"paged_memory": 0}, "return a dict with keys"),
    Wrong("gather_kv_from_blocks", "kept every layer", lambda *a: gather(*a, mode="all_layers"), "layer dimension"),
    Wrong("gather_kv_from_blocks", "gathered K for V", lambda *a: gather(*a, mode="keys"), "gathered the keys"),
    Wrong("gather_kv_from_blocks", "whole blocks, not trimmed", lambda *a: gather(*a, mode="whole_blocks"),
          "trim to the longest"),
    Wrong("gather_kv_from_blocks", "no zero padding", lambda *a: gather(*a, mode="no_zero"), "zero padding"),
    Wrong("gather_kv_from_blocks", "blocks in reverse order", lambda *a: gather(*a, mode="order"), "wrong places"),
    Wrong("gather_kv_from_blocks", "ignored the block table", lambda *a: gather(*a, mode="contiguous"), "wrong places"),
    Wrong("gather_kv_from_blocks", "layer and K/V indices swapped", gather_swapped, "layer and K/V axes swapped"),
    Wrong("gather_kv_from_blocks", "always layer 0", gather_layer_zero, "asked for layer 1, gathered layer 0"),
    Wrong("gather_kv_from_blocks", "overwrote the cache it reads", blank_the_cache, "your gather wrote into kv_cache"),
    Wrong("gather_kv_from_blocks", "returned a list per sequence", lambda *a: list(gather(*a)), "return a tensor"),
    Wrong("gather_kv_from_blocks", "calls labkit's gather_kv", labkit_gather, "`gather_kv`",
          calls="labkit.attention.reference.gather_kv"),
    Wrong("SimpleBlockAllocator", "the length counted before the out-of-memory check", allocator_with("count_first"),
          "still counted its 40 tokens"),
    Wrong("SimpleBlockAllocator", "blocks taken one at a time until the pool runs dry (the lesson's order)",
          allocator_with("one_at_a_time"), "kept the block it took"),
    Wrong("SimpleBlockAllocator", "a new sequence's blocks taken one at a time until the pool runs dry",
          allocator_with("allocate_one_at_a_time"), "failed allocation kept the blocks"),
    Wrong("SimpleBlockAllocator", "the sequence registered (empty) before the out-of-memory check",
          allocator_with("registers_first"), "still registered"),
    Wrong("SimpleBlockAllocator", "free_sequence of an unknown id returns 0", allocator_with("lenient_free"),
          "for an id never allocated"),
    Wrong("SimpleBlockAllocator", "the length recorded before the out-of-memory check", LengthFirstAllocator,
          "left sequence 2's length"),
    Wrong("calculate_memory_savings", "accepts a negative length", lambda **kw: savings(**kw, check=False)
          if min(kw["lengths"]) < 0 else savings(**kw), "lengths [10, -5]"),
    Wrong("gather_kv_from_blocks", "a float32 result for any cache", lambda *a: gather(*a).float(),
          "keep the cache's dtype"),
    Wrong("online_softmax_step", "a float32 state for float64 inputs",
          lambda *a: tuple(t.float() for t in step_in_float32(*a)), "in the inputs' dtype"),
    Wrong("online_softmax_step", "no rescaling when the max grows", lambda *a: step(*a, rescale="none"),
          "not rescaled when the max grew"),
    Wrong("online_softmax_step", "l rescaled, acc not", lambda *a: step(*a, rescale="l"), "acc was not"),
    Wrong("online_softmax_step", "alpha inverted", lambda *a: step(*a, inverted=True), "inverted"),
    Wrong("online_softmax_step", "forgot the 1/sqrt(d) scale", lambda *a: step(*a, scale=False),
          "not divided by sqrt(head_dim)"),
    Wrong("online_softmax_step", "m is the block's own max", lambda *a: step(*a, running=False), "running max"),
    Wrong("online_softmax_step", "acc divided by l in every step", lambda *a: step(*a, normalise=True),
          "divide once, after the last block"),
    Wrong("online_softmax_step", "a softmax per block", lambda *a: step(*a, per_block=True), "its own softmax"),
    Wrong("online_softmax_step", "blocks kept aside, one softmax over all seen", step_softmax_over_seen,
          "keeping blocks aside"),
    Wrong("online_softmax_step", "updates the given m in place", lambda *a: step(*a, in_place=True),
          "changed the state it was given"),
    Wrong("online_softmax_step", "returns only the output", lambda *a: step(*a)[2], "return the new state"),
    Wrong("online_softmax_step", "calls labkit's reference", step_via_labkit, "`online_softmax_attention`",
          calls="labkit.attention.reference.online_softmax_attention"),
]
