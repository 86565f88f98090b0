"""Lab 07: PagedAttention — block allocator, memory-savings calculator, the gather, online softmax."""

import math

import torch

from labkit.attention.reference import online_softmax_attention
from labkit.grading import ExerciseFailed, exercise, raised_type, require
from labkit.grading.remote import RemoteError

_MANAGER = "labkit.cache.block_manager.BlockManager"


@exercise("07", "SimpleBlockAllocator", forbidden=(
    # BlockManager's allocate and append go through _take_free_block, deallocate through _release_table:
    # common method names (append) would also trip the runtime's look at the source for `.append`
    f"{_MANAGER}._take_free_block", f"{_MANAGER}._release_table", f"{_MANAGER}.can_allocate",
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
    return "blocks allocated on demand, reused after free, utilization = used / total blocks"


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


@exercise("07", "calculate_memory_savings", forbidden=("labkit.grading.labs.lab07._reference_savings",))
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
    for args in (dict(lengths=[50, 16, 1, 33, 100, 47], max_length=128, block_size=16, memory_per_token=96),
                 dict(lengths=[1000] * 3 + [333, 64, 2048], max_length=2048, block_size=32, memory_per_token=512)):
        got = fn(**{**args, "lengths": list(args["lengths"])})
        want = _reference_savings(**args)
        if not isinstance(got, dict) or set(want) - set(got):
            raise ExerciseFailed(f"return a dict with keys {sorted(want)}")
        for mistake, slots in _paged_slots_if(args["lengths"], args["block_size"]).items():
            if slots * args["memory_per_token"] != want["paged_memory"] and math.isclose(
                    float(got["paged_memory"]), slots * args["memory_per_token"]):
                raise ExerciseFailed(mistakes[mistake])
        if math.isclose(got["savings_percent"], 100 * (want["savings_bytes"] / want["paged_memory"])):
            raise ExerciseFailed("savings_percent is relative to the paged memory; express it as a share of the "
                                 "traditional memory")
        for key, value in want.items():
            if not math.isclose(float(got[key]), value, rel_tol=1e-9):
                scale = " (percent means 0..100)" if key == "savings_percent" else ""
                raise ExerciseFailed(f"{key} should be {value:.6g} for {args}, got {got[key]!r}{scale}")
    for lengths, problem in (([10, 300, 20], "300"), ([10, 0], "0")):
        try:
            fn(lengths=lengths, max_length=256, block_size=16, memory_per_token=8)
        except (ValueError, RemoteError) as error:  # RemoteError: raised in the student's kernel, named there
            if raised_type(error) != "ValueError":
                raise
            if problem not in str(error):
                raise ExerciseFailed(f"the ValueError for lengths {lengths} should name the bad length {problem} "
                                     f"(it said: {error})") from None
            continue
        raise ExerciseFailed(f"lengths {lengths} with max_length 256 gave a result: a sequence longer than the "
                             "reservation (or of no tokens) has no place in this comparison; raise ValueError "
                             "naming it")
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
    "labkit.grading.labs.lab07._reference_gather",
))
def gather_kv_from_blocks(ns):
    fn = require(ns, "gather_kv_from_blocks")
    g = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(12, 3, 2, 8, 2, 4, generator=g)  # [blocks, layers, K/V, block_size, heads, dim]
    block_table = torch.tensor([[5, 2, 9, -1], [0, 11, -1, -1], [7, 3, 1, 4]])
    seq_lengths = torch.tensor([20, 9, 29])
    got = fn(kv_cache, block_table, seq_lengths, 1, 1)
    want = _reference_gather(kv_cache, block_table, seq_lengths, 1, 1)
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
    valid = torch.arange(29)[None, :] < seq_lengths[:, None]
    if not torch.equal(got[valid], want[valid]):
        raise ExerciseFailed("tokens come out in the wrong places: token t of a sequence lives in block "
                             "block_table[s, t // block_size] at offset t % block_size")
    if got[~valid].abs().sum() != 0:
        raise ExerciseFailed("positions past a sequence's length must be zero padding, not leftover block contents")
    return "each sequence's tokens in order, zero-padded to the longest"


def _softmax_attention(query, keys, values, scale):
    weights = torch.softmax(torch.einsum("hd,bhd->hb", query, keys) * scale, -1)
    return torch.einsum("hb,bhd->hd", weights, values)


@exercise("07", "online_softmax_attention", forbidden=("labkit.attention.reference.online_softmax_attention",
                                                      "labkit.grading.labs.lab07._softmax_attention"))
def online_softmax(ns):
    fn = require(ns, "online_softmax_attention")
    g = torch.Generator().manual_seed(3)
    query = torch.randn(4, 16, generator=g, dtype=torch.float64) * 4
    key_blocks = [torch.randn(8, 4, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    value_blocks = [torch.randn(8, 4, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    got = fn(query, key_blocks, value_blocks)
    want = online_softmax_attention(query, key_blocks, value_blocks)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise ExerciseFailed(f"expected a [num_heads, head_dim] = {tuple(want.shape)} tensor")
    per_block = sum(
        torch.einsum("hb,bhd->hd", torch.softmax(torch.einsum("hd,bhd->hb", query, k) / 4, -1), v)
        for k, v in zip(key_blocks, value_blocks, strict=True)
    )
    if torch.allclose(got, per_block, atol=1e-6):
        raise ExerciseFailed("each block got its own softmax: the weights must be normalized over all keys")
    keys, values = torch.cat(key_blocks), torch.cat(value_blocks)
    if torch.allclose(got, _softmax_attention(query, keys, values, 1.0), atol=1e-6):
        raise ExerciseFailed("scores were not divided by sqrt(head_dim)")
    if not torch.allclose(got, want, atol=1e-6) and torch.allclose(got / got.norm(dim=-1, keepdim=True),
                                                                   want / want.norm(dim=-1, keepdim=True), atol=1e-6):
        raise ExerciseFailed("each head's output is off by a factor: divide the accumulator by the running sum "
                             "l at the end (and rescale both by exp(m_old - m_new) as the max grows)")
    if not torch.allclose(got, want, atol=1e-6):
        raise ExerciseFailed(f"differs from softmax attention over all keys (max abs diff "
                             f"{(got - want).abs().max():.2e}); rescale l and acc by exp(m_old - m_new)")
    with torch.no_grad():
        single = fn(query[:, :], key_blocks[:1], value_blocks[:1])
    if not torch.allclose(single, online_softmax_attention(query, key_blocks[:1], value_blocks[:1]), atol=1e-6):
        raise ExerciseFailed("wrong with a single block")
    return "one pass over the blocks equals softmax over all keys"


@exercise("07", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers

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
