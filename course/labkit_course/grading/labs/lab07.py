"""Lab 07: PagedAttention — block allocator (atomic on failure), memory-savings calculator, the gather, and the
online softmax graded on its running state after every block."""

import math

import torch

from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.core import seeded_generator, seeded_random
from labkit_course.grading.remote import RemoteError

_MANAGER = "labkit.cache.block_manager.BlockManager"


@exercise("07", "SimpleBlockAllocator", forbidden=(
    # labkit's BlockManager does all of it: allocation all or nothing, appending, freeing
    *(f"{_MANAGER}.{method}" for method in ("allocate", "can_allocate", "append", "can_append", "missing_blocks",
                                            "truncate", "deallocate", "release_table", "take_free_block")),
    "labkit.cache.block_manager.pop_free_block",
))
def simple_block_allocator(ns):
    cls = require(ns, "SimpleBlockAllocator", type)
    alloc = cls(total_blocks=10, block_size=16)
    table = alloc.allocate_sequence(seq_id=1, length=50)
    if not isinstance(table, list) or len(table) != 4:
        raise ExerciseFailed(f"50 tokens in blocks of 16 need ceil(50/16) = 4 blocks, got {table!r}")
    if len(set(table)) != 4 or not all(0 <= b < 10 for b in table):
        raise ExerciseFailed(f"allocated blocks must be distinct ids in 0..9, got {table}")
    new = alloc.append_tokens(seq_id=1, num_tokens=10)  # 60 tokens: still 4 blocks
    if new:
        raise ExerciseFailed("appending 10 tokens to 50 allocated a block although the last block had 14 free slots")
    if new is not None:
        raise ExerciseFailed(f"an append that needs no new block returns None (the method's docstring), got {new!r}")
    new = alloc.append_tokens(seq_id=1, num_tokens=20)  # 80 tokens: 5 blocks
    if not new or len(new) != 1:
        raise ExerciseFailed(f"going from 60 to 80 tokens needs exactly one new block, got {new!r}")
    if new[0] in table:
        raise ExerciseFailed("append handed out a block the sequence already holds")
    other = alloc.allocate_sequence(seq_id=2, length=10)
    if len(other) != 1 or set(other) & set(table + new):
        raise ExerciseFailed(f"a second sequence must get blocks nobody holds, got {other}")
    util = alloc.get_utilization()
    if isinstance(util, float | int) and math.isclose(util, 60):
        raise ExerciseFailed("utilization is a fraction of the blocks (0.6), not a percentage")
    if isinstance(util, float | int) and math.isclose(util, 90 / 160):
        raise ExerciseFailed("utilization counted tokens (90 of 160 slots): it is allocated blocks / total "
                             "blocks, 6 of 10 = 0.6")
    if not isinstance(util, float | int) or not math.isclose(util, 0.6):
        raise ExerciseFailed(f"6 of 10 blocks are allocated, so utilization is 0.6, got {util!r}")
    freed = alloc.free_sequence(seq_id=1)
    if freed != 5:
        raise ExerciseFailed(f"sequence 1 held 5 blocks, free_sequence returned {freed!r}")
    if not math.isclose(alloc.get_utilization(), 0.1):
        raise ExerciseFailed("after freeing sequence 1, its blocks are not back in the free pool")
    table = alloc.allocate_sequence(seq_id=3, length=144)  # 9 blocks: needs the freed ones
    if len(table) != 9:
        raise ExerciseFailed("freed blocks could not be allocated again")
    _fails_without_a_trace(cls)
    _random_run(cls)
    return ("blocks allocated on demand, reused after free, utilization = used / total blocks; a request the pool "
            "cannot meet raises MemoryError and changes nothing")


def _raises_memory_error(call, what: str) -> None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the student's code may raise anything
        if raised_type(error) != "MemoryError":
            raise ExerciseFailed(f"{what} raised {raised_type(error)}: raise MemoryError, checked before anything "
                                 "changes") from None
    else:
        raise ExerciseFailed(f"{what} did not raise: when the pool has too few free blocks, raise MemoryError")


def _refuses_to_free(alloc, seq_id: int, mistake: str) -> None:
    """free_sequence of a sequence the allocator does not know must raise; `mistake` ({freed}: what it
    returned) says what returning instead means."""
    try:
        freed = alloc.free_sequence(seq_id=seq_id)
    except Exception:  # noqa: BLE001 - any error: the sequence is unknown, as it should be
        return
    raise ExerciseFailed(mistake.format(freed=freed))


def _fails_without_a_trace(cls) -> None:
    """A failed append or allocation must leave the allocator as it was: the engine preempts another
    sequence and retries the same request."""
    alloc = cls(total_blocks=5, block_size=16)
    alloc.allocate_sequence(seq_id=1, length=50)  # 4 blocks, 14 free slots in the last, 1 block free
    _refuses_to_free(alloc, 99, "free_sequence(99), for an id never allocated, returned {freed!r}: raise KeyError "
                                "for a sequence the allocator does not know")
    _raises_memory_error(lambda: alloc.allocate_sequence(seq_id=2, length=40),
                         "allocating 40 tokens (3 blocks, 1 free)")
    util = alloc.get_utilization()
    if not isinstance(util, float | int) or not math.isclose(util, 0.8):
        raise ExerciseFailed(f"the failed allocation kept the blocks it took before the pool ran dry (utilization "
                             f"{util!r}, was 0.8): count the blocks a new sequence needs and check that many are "
                             "free before taking any")
    _refuses_to_free(alloc, 2, "after its allocation failed, sequence 2 is still registered (free_sequence(2) "
                               "returned {freed!r} instead of raising KeyError): register a sequence only once its "
                               "blocks are taken")
    try:
        grown = alloc.append_tokens(seq_id=2, num_tokens=1)
    except Exception as error:  # noqa: BLE001 - any error but running out: sequence 2 is unknown
        if raised_type(error) == "MemoryError":
            raise ExerciseFailed("after its allocation failed, append_tokens(2, 1) raised MemoryError instead of "
                                 "KeyError: the failed allocation left sequence 2's length (40 tokens) behind; record "
                                 "a sequence's length only once its blocks are taken") from None
    else:
        raise ExerciseFailed(f"after its allocation failed, append_tokens(2, 1) returned {grown!r} instead of raising "
                             "KeyError: sequence 2 is still registered; register a sequence only once its blocks are "
                             "taken")
    _raises_memory_error(lambda: alloc.append_tokens(seq_id=1, num_tokens=40),
                         "appending 40 tokens to 50 (2 more blocks, 1 free)")
    util = alloc.get_utilization()
    if isinstance(util, float | int) and math.isclose(util, 1.0):
        raise ExerciseFailed("the failed append kept the block it took before the pool ran dry (utilization 1.0, was "
                             "0.8), a leak the lesson's append_token_ids has too: count the blocks needed and check "
                             "that many are free before taking any")
    try:
        new = alloc.append_tokens(seq_id=1, num_tokens=14)
    except Exception as error:  # noqa: BLE001
        new = raised_type(error)
    if new:
        raise ExerciseFailed(f"after the failed append, 14 tokens that fit the last block's free slots got {new!r}, "
                             "not None: the failed append still counted its 40 tokens; change the length only once "
                             "the blocks are there")
    new = alloc.append_tokens(seq_id=1, num_tokens=1)
    if not isinstance(new, list) or len(new) != 1:
        raise ExerciseFailed(f"token 65 needs the one free block, got {new!r}")
    _raises_memory_error(lambda: alloc.allocate_sequence(seq_id=2, length=20), "a new sequence in a full pool")
    util = alloc.get_utilization()
    if not isinstance(util, float | int) or not math.isclose(util, 1.0):
        raise ExerciseFailed(f"a failed allocation changed the utilization ({util!r}, was 1.0): check before taking "
                             "blocks")


def _random_run(cls) -> None:
    """Allocations, appends and frees drawn at random, some asking for more blocks than are free, against the
    block arithmetic: ceil(tokens / block_size) blocks a sequence, ids nobody holds, used / total blocks.
    A failure names the run so far, which replays it."""
    rng = seeded_random(707)
    total, block_size = rng.randint(12, 32), rng.choice([2, 4, 8, 16])
    alloc = cls(total_blocks=total, block_size=block_size)
    run, lengths, tables = [f"SimpleBlockAllocator(total_blocks={total}, block_size={block_size})"], {}, {}
    for new_id in range(1, 21):  # each call arms the tripwires (ms): a short run
        held = {block for table in tables.values() for block in table}
        free = total - len(held)
        if tables and rng.random() < 0.3:
            old = rng.choice(sorted(tables))
            run.append(f"free_sequence({old})")
            freed = alloc.free_sequence(old)
            if freed != len(tables[old]):
                raise ExerciseFailed(f"{'; '.join(run)}: sequence {old} held {len(tables[old])} blocks, "
                                     f"free_sequence returned {freed!r}")
            del tables[old], lengths[old]
        else:
            seq_id = rng.choice(sorted(tables)) if tables and rng.random() < 0.6 else new_id  # grow one, or start
            tokens = (rng.randint(1, 3 * block_size) if rng.random() < 0.8  # now and then more blocks than are free
                      else rng.randint(free * block_size + 1, (free + 2) * block_size))
            start, have = lengths.get(seq_id, 0), tables.get(seq_id, [])
            needed = -(-(start + tokens) // block_size) - len(have)
            call = (f"append_tokens({seq_id}, {tokens})" if seq_id in tables
                    else f"allocate_sequence({seq_id}, {tokens})")
            run.append(call)
            what = f"{'; '.join(run)}: the last call"
            grow = alloc.append_tokens if seq_id in tables else alloc.allocate_sequence
            if needed > free:
                _raises_memory_error(lambda grow=grow, seq_id=seq_id, tokens=tokens: grow(seq_id, tokens),
                                     f"{what} ({needed} blocks, {free} free)")
            else:
                got = grow(seq_id, tokens)
                if needed == 0 and got is not None:
                    raise ExerciseFailed(f"{what} fits the last block's free slots: it returns None, got {got!r}")
                if needed and not (isinstance(got, list) and len(got) == needed):
                    raise ExerciseFailed(f"{what} needs ceil({start + tokens}/{block_size}) - {len(have)} = {needed} "
                                         f"new blocks, got {got!r}")
                if needed and not (all(isinstance(b, int) and 0 <= b < total for b in got)
                                   and len(set(got)) == needed and not set(got) & held):
                    raise ExerciseFailed(f"{what} handed out {got}: new blocks are distinct free ids in "
                                         f"0..{total - 1}, and {sorted(held)} are held")
                tables[seq_id], lengths[seq_id] = have + (got or []), start + tokens
        used = sum(map(len, tables.values()))
        util = alloc.get_utilization()
        if not isinstance(util, float | int) or not math.isclose(util, used / total):
            raise ExerciseFailed(f"{'; '.join(run)}: {used} of {total} blocks are held, so utilization is "
                                 f"{used / total:.4g}, got {util!r}")


def _reference_savings(lengths, max_length, block_size, memory_per_token):
    for n in lengths:
        if not 1 <= n <= max_length:
            raise ValueError(f"a sequence of {n} tokens does not fit a reservation of 1..{max_length}")
    traditional = len(lengths) * max_length * memory_per_token
    paged = sum(math.ceil(n / block_size) * block_size for n in lengths) * memory_per_token
    used = sum(lengths) * memory_per_token
    return {"traditional_memory": traditional, "paged_memory": paged, "savings_bytes": traditional - paged,
            "savings_percent": 100 * (traditional - paged) / traditional,
            "utilization_traditional": used / traditional, "utilization_paged": used / paged}


def _paged_slots_if(lengths, block_size):
    """Paged slots under typical mistakes, to name the one a wrong answer made."""
    n, total = len(lengths), sum(lengths)
    return {
        "tokens": total,
        "average": n * math.ceil(total / n / block_size) * block_size,
        "pooled": math.ceil(total / block_size) * block_size,
        "floor": sum(length // block_size * block_size for length in lengths),
    }


@exercise("07", "calculate_memory_savings", forbidden=("labkit_course.grading.labs.lab07._reference_savings",))
def calculate_memory_savings(ns):
    fn = require(ns, "calculate_memory_savings")
    mistakes = {
        "tokens": "paged memory counts only the tokens: round each sequence up to whole blocks",
        "average": "rounded the average length up, once: each sequence's own last block is partly empty, so "
                   "round every length up to whole blocks and add them",
        "pooled": "rounded the total token count up to blocks, as if sequences shared blocks: a block belongs to "
                  "one sequence, so round each sequence up on its own",
        "floor": "rounded down: a partly filled last block still takes a whole block (ceil, not floor)",
    }
    rng = seeded_random(708)
    max_length, block_size = rng.choice([256, 512, 1024, 4096]), rng.choice([8, 16, 32])
    drawn = dict(lengths=[rng.randint(1, max_length) for _ in range(rng.randint(3, 12))], max_length=max_length,
                 block_size=block_size, memory_per_token=rng.randint(1, 64) * 16)  # lengths no notebook knows ahead
    for args in (dict(lengths=[50, 16, 1, 33, 100, 47], max_length=128, block_size=16, memory_per_token=96),
                 dict(lengths=[1000] * 3 + [333, 64, 2048], max_length=2048, block_size=32, memory_per_token=512),
                 drawn):
        got = fn(**{**args, "lengths": list(args["lengths"])})
        want = _reference_savings(**args)
        if not isinstance(got, dict) or set(want) - set(got):
            raise ExerciseFailed(f"return a dict with keys {sorted(want)}")
        for mistake, slots in _paged_slots_if(args["lengths"], args["block_size"]).items():
            if slots * args["memory_per_token"] != want["paged_memory"] and math.isclose(
                    float(got["paged_memory"]), slots * args["memory_per_token"]):
                raise ExerciseFailed(f"{args}: {mistakes[mistake]}")
        if want["savings_bytes"] and math.isclose(got["savings_percent"],
                                                  100 * (want["savings_bytes"] / want["paged_memory"])):
            raise ExerciseFailed(f"{args}: savings_percent is relative to the paged memory; express it as a share of "
                                 "the traditional memory")
        for key, value in want.items():
            if not math.isclose(float(got[key]), value, rel_tol=1e-9):
                scale = " (percent means 0..100)" if key == "savings_percent" else ""
                raise ExerciseFailed(f"{key} should be {value:.6g} for {args}, got {got[key]!r}{scale}")
    for lengths, problem in (([10, 300, 20], "300"), ([10, 0], "0"), ([10, -5], "-5")):
        try:
            fn(lengths=lengths, max_length=256, block_size=16, memory_per_token=8)
        except (ValueError, RemoteError) as error:  # RemoteError: raised in the student's kernel, named there
            if raised_type(error) != "ValueError":
                raise
            if problem not in str(error):
                raise ExerciseFailed(f"the ValueError for lengths {lengths} should name the bad length {problem} "
                                     f"(it said: {error})") from None
            continue
        raise ExerciseFailed(f"lengths {lengths} with max_length 256 gave a result: a length outside "
                             "1..max_length (longer than the reservation, or no tokens, or negative) has no place in "
                             "this comparison; raise ValueError naming it")
    return "each sequence rounded up to its own blocks, against a max_length reservation; bad lengths rejected"


def _reference_gather(kv_cache, block_table, seq_lengths, layer_idx, kv_idx):
    max_len = int(seq_lengths.max())
    bs = kv_cache.shape[3]
    out = torch.zeros(block_table.shape[0], max_len, *kv_cache.shape[4:], dtype=kv_cache.dtype)
    for s, n in enumerate(seq_lengths.tolist()):
        for t in range(n):
            out[s, t] = kv_cache[block_table[s, t // bs], layer_idx, kv_idx, t % bs]
    return out


@exercise("07", "gather_kv_from_blocks", forbidden=(
    "labkit.attention.reference.gather_kv", "labkit.attention.reference.paged_attention",
    "labkit_course.grading.labs.lab07._reference_gather",
))
def gather_kv_from_blocks(ns):
    fn = require(ns, "gather_kv_from_blocks")
    g = seeded_generator(7)
    kv_cache = torch.randn(12, 3, 2, 8, 2, 4, generator=g)  # [blocks, layers, K/V, block_size, heads, dim]
    block_table = torch.tensor([[5, 2, 9, -1], [0, 11, -1, -1], [7, 3, 1, 4]])
    seq_lengths = torch.tensor([20, 9, 29])
    want = _reference_gather(kv_cache, block_table, seq_lengths, 1, 1)
    got = _gather_reading_only(fn, kv_cache, block_table, seq_lengths, 1, 1)
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"return a tensor, got {type(got).__name__}")
    if got.dim() == 5:
        raise ExerciseFailed("the result still has a layer dimension: take layer_idx only")
    if got.shape == (3, 32, 2, 4):
        raise ExerciseFailed("shape [3, 32, 2, 4]: trim to the longest sequence (max_seq_len = 29), not whole blocks")
    if got.shape != want.shape:
        raise ExerciseFailed(f"expected shape {tuple(want.shape)} = [num_seqs, max_seq_len, heads, dim], "
                             f"got {tuple(got.shape)}")
    if torch.equal(got, _reference_gather(kv_cache, block_table, seq_lengths, 1, 0)):
        raise ExerciseFailed("gathered the keys: kv_idx = 1 asks for the values")
    _gathered_the_right_tokens(got, want, kv_cache, block_table, seq_lengths, 1, 1)
    # layer and K/V index unequal: the axes cannot be swapped
    got = _gather_reading_only(fn, kv_cache, block_table, seq_lengths, 0, 1)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise ExerciseFailed(f"layer_idx=0, kv_idx=1 gave {type(got).__name__} {tuple(getattr(got, 'shape', ()))}, "
                             f"not a tensor of shape {tuple(want.shape)}")
    if torch.equal(got, _reference_gather(kv_cache, block_table, seq_lengths, 1, 0)):
        raise ExerciseFailed("layer and K/V axes swapped: layer_idx=0, kv_idx=1 gave layer 1's keys; the cache is "
                             "[blocks, layers, K/V, block_size, heads, dim], so index the layer first, then K/V")
    _gathered_the_right_tokens(got, _reference_gather(kv_cache, block_table, seq_lengths, 0, 1), kv_cache,
                               block_table, seq_lengths, 0, 1)
    half = kv_cache.half()  # a real KV cache is fp16 or bf16
    got = _gather_reading_only(fn, half, block_table, seq_lengths, 1, 1)
    if not isinstance(got, torch.Tensor) or got.dtype != half.dtype:
        raise ExerciseFailed(f"a float16 cache gave {getattr(got, 'dtype', type(got).__name__)}: keep the cache's "
                             "dtype (torch.zeros(..., dtype=kv_cache.dtype)); a float32 copy doubles the memory")
    _gathered_the_right_tokens(got, _reference_gather(half, block_table, seq_lengths, 1, 1), half, block_table,
                               seq_lengths, 1, 1)
    return "each sequence's tokens in order, of the layer and K/V asked for, zero-padded to the longest"


def _gather_reading_only(fn, kv_cache, block_table, seq_lengths, layer_idx, kv_idx):
    """fn's gather, which must leave its arguments as they were: the references are computed from them."""
    given = (kv_cache.clone(), block_table.clone(), seq_lengths.clone())
    got = fn(*given, layer_idx, kv_idx)
    for name, before, after in zip(("kv_cache", "block_table", "seq_lengths"), (kv_cache, block_table, seq_lengths),
                                   given, strict=True):
        if not torch.equal(before, after):
            raise ExerciseFailed(f"your gather wrote into {name}: a gather only reads the cache and its tables")
    return got


def _gathered_the_right_tokens(got, want, kv_cache, block_table, seq_lengths, layer_idx, kv_idx) -> None:
    valid = torch.arange(want.shape[1])[None, :] < seq_lengths[:, None]
    if not torch.equal(got[valid], want[valid]):
        for layer in range(kv_cache.shape[1]):
            other = _reference_gather(kv_cache, block_table, seq_lengths, layer, kv_idx)
            if layer != layer_idx and torch.equal(got[valid], other[valid]):
                raise ExerciseFailed(f"asked for layer {layer_idx}, gathered layer {layer}: index the cache's "
                                     "layer axis (dimension 1) with layer_idx")
        raise ExerciseFailed("tokens come out in the wrong places: token t of a sequence lives in block "
                             "block_table[s, t // block_size] at offset t % block_size")
    if got[~valid].abs().sum() != 0:
        raise ExerciseFailed("positions past a sequence's length must be zero padding, not leftover block contents")


def _reference_state(query, key_blocks, value_blocks, scale=None, rescale=True, running=True):
    """(m, l, acc) after these blocks: the running max of the scaled scores, the sum of exp(s - m), the
    sum of exp(s - m) v. The keywords other than their defaults reproduce typical mistakes."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    m = torch.full(query.shape[:1], float("-inf"), dtype=query.dtype)
    total, acc = torch.zeros_like(m), torch.zeros_like(query)
    for k, v in zip(key_blocks, value_blocks, strict=True):
        s = torch.einsum("hd,bhd->hb", query, k) * scale
        m_new = torch.maximum(m, s.max(-1).values) if running else s.max(-1).values
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        m, total, acc = m_new, alpha * total + p.sum(-1), alpha[:, None] * acc + torch.einsum("hb,bhd->hd", p, v)
    return m, total, acc


# A step computed in float32 (as a GPU kernel does) is right too: float32 rounding stays well inside this.
_STATE_TOL = dict(rtol=1e-5, atol=1e-4)


def _blocks(g, n, scales):
    keys = [torch.randn(8, 4, 16, generator=g, dtype=torch.float64) * s for s in scales]
    return keys, [torch.randn(8, 4, 16, generator=g, dtype=torch.float64) for _ in range(n)]


@exercise("07", "online_softmax_step", forbidden=("labkit.attention.reference.online_softmax_attention",
                                                 "labkit_course.grading.labs.lab07._reference_state"))
def online_softmax_step(ns):
    step = require(ns, "online_softmax_step")
    g = seeded_generator(3)
    query = torch.randn(4, 16, generator=g, dtype=torch.float64) * 2
    keys, values = _blocks(g, 4, (0.5, 1.0, 3.0, 0.5))  # the max grows at blocks 1 and 2, not at 3
    early_keys, early_values = _blocks(g, 2, (1.0, 2.0))  # blocks the step never sees
    _fold(step, query, keys, values, [], [], _reference_state(query, [], []), "")
    early = _reference_state(query, early_keys, early_values)
    _fold(step, query, keys[:2], values[:2], early_keys, early_values, early,
          "right from the empty state, wrong from a state that stands for earlier blocks: fold the new block into "
          "the (m, l, acc) you are given, which carries every block before it (the check never shows you those); "
          "keeping blocks aside and taking a softmax over all of them is not the online softmax")
    return "m, l and acc right after every block, from the empty state and from the state of blocks it never saw"


def _fold(step, query, keys, values, early_keys, early_values, state, from_given: str) -> None:
    """Feed the blocks one at a time from `state` (that of the early blocks), comparing the state after each."""
    for i in range(len(keys)):
        given = tuple(t.clone() for t in state)
        got = step(state, query, keys[i], values[i])
        if any(not torch.equal(a, b) for a, b in zip(given, state, strict=True)):
            raise ExerciseFailed("the step changed the state it was given (in place): return new tensors")
        if not (isinstance(got, tuple | list) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
            raise ExerciseFailed(f"return the new state as a tuple (m, l, acc) of tensors, got {type(got).__name__}")
        if [tuple(t.shape) for t in got] != [(4,), (4,), (4, 16)]:
            raise ExerciseFailed(f"expected m [num_heads], l [num_heads], acc [num_heads, head_dim] = (4,), (4,), "
                                 f"(4, 16); got {[tuple(t.shape) for t in got]}")
        if any(t.dtype != query.dtype for t in got):
            raise ExerciseFailed(f"the state came back as {[t.dtype for t in got]} for {query.dtype} inputs: return it "
                                 "in the inputs' dtype (cast back if you compute in another)")
        seen_k, seen_v = early_keys + keys[:i + 1], early_values + values[:i + 1]
        want = _reference_state(query, seen_k, seen_v)
        if all(torch.allclose(a, b, **_STATE_TOL) for a, b in zip(got, want, strict=True)):
            state = tuple(got)
            continue
        if from_given:
            raise ExerciseFailed(from_given)
        after = (keys[i + 1], values[i + 1]) if i + 1 < len(keys) else None
        raise ExerciseFailed(_step_mistake(query, seen_k, seen_v, state, got, want, i, step, after))


def _step_mistake(query, keys, values, before, got, want, i, step, after) -> str:
    """Name the mistake from the state the step returned after block i (and, where one block cannot tell two
    mistakes apart, from the state it returns after the next block, `after`)."""
    m, total, acc = got
    close = lambda a, b: torch.allclose(a, b, **_STATE_TOL)  # noqa: E731
    where = f"after block {i}"
    if close(m, _reference_state(query, keys, values, scale=1.0)[0]):
        return f"{where}: scores were not divided by sqrt(head_dim): s = q . k / sqrt(d)"
    if not close(m, want[0]):
        if close(m, _reference_state(query, keys[-1:], values[-1:])[0]):
            return (f"{where}: m is this block's max only: it is the running max, max(m_old, the block's largest "
                    "score)")
        return f"{where}: m should be the largest scaled score so far (the running max)"
    if torch.isnan(total).any() or torch.isnan(acc).any():
        return (f"{where}: NaN in l or acc: before the first block m_old = -inf, so alpha = exp(m_old - m_new) = 0; "
                "an inverted exp(m_new - m_old) is inf, and inf * 0 is NaN")
    if not close(total, want[1]) and close(total, _reference_state(query, keys, values, rescale=False)[1]):
        return (f"{where}: l and acc were not rescaled when the max grew: multiply both by alpha = exp(m_old - m_new) "
                "before adding the block")
    alpha = torch.exp(before[0] - want[0])
    added_l, added_acc = want[1] - alpha * before[1], want[2] - alpha[:, None] * before[2]  # the block's own terms
    if not close(total, want[1]) and close(total, before[1] / alpha + added_l):
        return f"{where}: alpha is inverted: it is exp(m_old - m_new), at most 1"
    if close(total, want[1]) and close(acc, before[2] + added_acc):
        return f"{where}: l was rescaled but acc was not: multiply acc by alpha = exp(m_old - m_new) as well"
    per_block = (f"{where}: each block got its own softmax: the weights must be normalized over all keys, through "
                 "m and l")
    if close(total, want[1]) and close(acc, want[2] / want[1][:, None]):
        if i == 0 and after is not None:  # after one block, a softmax per block and a normalized acc agree
            nxt = step(tuple(got), query, *after)
            if isinstance(nxt, tuple | list) and len(nxt) == 3 and isinstance(nxt[2], torch.Tensor) and \
                    nxt[2].shape == acc.shape and close(nxt[2], _per_block(query, keys + [after[0]],
                                                                           values + [after[1]])):
                return per_block.replace("block 0", "block 1")
        return (f"{where}: acc was divided by l inside the step: keep acc the unnormalized sum of exp(s - m) v and "
                "divide once, after the last block")
    if close(acc, _per_block(query, keys, values)):
        return per_block
    if not close(total, want[1]):
        return f"{where}: m is right but l is not: l = alpha * l_old + sum(exp(s - m_new)) over the block"
    return f"{where}: m and l are right but acc is not: acc = alpha * acc_old + sum(exp(s - m_new) v) over the block"


def _per_block(query, keys, values):
    scale = query.shape[-1] ** -0.5
    return sum(torch.einsum("hb,bhd->hd", torch.softmax(torch.einsum("hd,bhd->hb", query, k) * scale, -1), v)
               for k, v in zip(keys, values, strict=True))


@exercise("07", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    length, block_size = 50, 16
    blocks = math.ceil(length / block_size)
    fp16 = torch.finfo(torch.float16).bits // 8
    llama2_block = 32 * 2 * block_size * 32 * 128 * fp16  # layers, K and V, tokens, KV heads, head_dim
    return grade_answers(ns, {
        1: Number(blocks, "section 3: a sequence holds ceil(L / B) blocks"),
        2: Number(blocks * block_size - length, "section 3's waste formula"),
        3: Number(llama2_block / 2**20, "section 1: what a block holds (MiB = 2**20 bytes)"),
        4: Choice("b", "section 3, on internal fragmentation"),
        5: Choice("a", "section 7, the online softmax"),
    })
