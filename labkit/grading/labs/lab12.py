"""Lab 12: memory-bound inference. The roofline, KV-cache capacity, MHA -> GQA -> MQA by pooling K/V
heads, and perplexity, the number that measures what the pooling cost."""

import math
import random

import torch

from labkit.grading import ExerciseFailed, exercise, expect_tensor, require
from labkit.model.kv_heads import pool_kv_heads as reference_pool_kv_heads
from labkit.model.perplexity import perplexity_from_logits

# ---------------------------------------------------------------- Exercise 1: a point on the roofline

ROOFLINE_KEYS = ("intensity", "ridge", "attainable", "seconds", "bound")


def reference_roofline_point(flops, bytes_moved, peak_flops, bandwidth, *, mistake=None):
    """Where a step of `flops` operations moving `bytes_moved` bytes lands on a machine's roofline.
    `mistake` re-creates a typical wrong answer, so that a wrong result can be named."""
    intensity = bytes_moved / flops if mistake == "inverted" else flops / bytes_moved
    ridge = bandwidth / peak_flops if mistake == "ridge_inverted" else peak_flops / bandwidth
    if mistake == "max":
        attainable = max(peak_flops, bandwidth * intensity)
    elif mistake == "no_intensity":
        attainable = min(peak_flops, bandwidth)
    else:
        attainable = min(peak_flops, bandwidth * intensity)
    if mistake == "compute_only":
        seconds = flops / peak_flops
    elif mistake == "sum":
        seconds = flops / peak_flops + bytes_moved / bandwidth
    else:
        seconds = max(flops / peak_flops, bytes_moved / bandwidth)
    if mistake == "ridge_is_memory":
        bound = "compute" if intensity > ridge else "memory"
    else:
        bound = "compute" if intensity >= ridge else "memory"
    return {"intensity": intensity, "ridge": ridge, "attainable": attainable, "seconds": seconds, "bound": bound}


_ROOFLINE_MISTAKES = {
    "inverted": "intensity is FLOPs per byte (flops / bytes_moved), not bytes per FLOP",
    "ridge_inverted": "the ridge point is peak_flops / bandwidth (FLOP per byte), not bandwidth / peak_flops",
    "max": "attainable performance is the lower of the two roofs, min(peak, bandwidth * intensity), not the higher",
    "no_intensity": "the memory roof is bandwidth * intensity (bytes/s times FLOP/byte), not the bandwidth alone",
    "compute_only": "the time ignores memory: a step takes at least max(flops / peak, bytes / bandwidth)",
    "sum": "the roofline overlaps compute and memory traffic: the time is max(flops / peak, bytes / bandwidth), "
           "not their sum",
    "ridge_is_memory": "a step exactly at the ridge point reaches the peak: intensity >= ridge is compute-bound",
}


def _same(got, want) -> bool:
    return got == want if isinstance(want, str) else math.isclose(got, want, rel_tol=1e-6)


@exercise("12", "roofline_point", forbidden=("labkit.grading.labs.lab12.reference_roofline_point",))
def roofline_point(ns):
    fn = require(ns, "roofline_point")
    rng = random.Random(12)
    machines = [(100e9, 20e9), (1e15, 3.35e12), (130e9, 12.5e9)]
    cases = [(2e9, 1e9, *machines[0]), (2e9, 0.4e9, *machines[0]), (5e9, 1e9, *machines[0]),  # below, above, at
             (2.7e8, 5.4e8, *machines[1]), (1.5e14, 5.4e8, *machines[1]), (3.4e10, 5.4e8, *machines[2])]
    cases += [(rng.uniform(1e6, 1e12), rng.uniform(1e6, 1e10), *rng.choice(machines)) for _ in range(30)]
    for case in cases:
        got = fn(*case)
        if not isinstance(got, dict) or set(got) != set(ROOFLINE_KEYS):
            raise ExerciseFailed(f"return a dict with exactly the keys {', '.join(ROOFLINE_KEYS)}; got {got!r}")
        if got["bound"] not in ("memory", "compute"):
            raise ExerciseFailed(f"'bound' must be \"memory\" or \"compute\", got {got['bound']!r}")
        if not all(isinstance(got[k], int | float) and not isinstance(got[k], bool) for k in ROOFLINE_KEYS[:4]):
            raise ExerciseFailed(f"intensity, ridge, attainable and seconds must be numbers, got {got!r}")
        want = reference_roofline_point(*case)
        wrong = [k for k in ROOFLINE_KEYS if not _same(got[k], want[k])]
        if not wrong:
            continue
        explained = []  # mistakes that explain every wrong entry, the most specific first
        for mistake, why in _ROOFLINE_MISTAKES.items():
            theirs = reference_roofline_point(*case, mistake=mistake)
            if all(_same(got[k], theirs[k]) for k in wrong):
                explained.append((sum(not _same(theirs[k], want[k]) for k in ROOFLINE_KEYS), why))
        if explained:
            raise ExerciseFailed(min(explained)[1])
        flops, nbytes, peak, bw = case
        raise ExerciseFailed(f"flops={flops:.4g}, bytes_moved={nbytes:.4g}, peak_flops={peak:.4g}, "
                             f"bandwidth={bw:.4g}: {', '.join(wrong)} wrong (got {got!r})")
    return "min(peak, bandwidth * intensity), ridge = peak / bandwidth, time = the larger of the two"


# ------------------------------------------------------- Exercise 2: KV bytes and sequences that fit

def reference_kv_capacity(config, seq_len, memory_bytes, dtype_bytes, block_size, *, mistake=None):
    """(KV bytes per token, sequences of seq_len tokens that fit in memory_bytes of blocks)."""
    heads = config["num_heads"] if mistake == "query_heads" else config["num_kv_heads"]
    per_token = (1 if mistake == "k_only" else 2) * config["num_layers"] * heads * config["head_dim"] * dtype_bytes
    if mistake == "one_layer":
        per_token //= config["num_layers"]
    if mistake == "tokens_not_blocks":
        return per_token, memory_bytes // (seq_len * per_token)
    blocks_per_seq = seq_len // block_size if mistake == "floor_blocks" else -(-seq_len // block_size)
    num_blocks = memory_bytes // (block_size * per_token)
    if mistake == "round_up_blocks":
        num_blocks = -(-memory_bytes // (block_size * per_token))
    return per_token, num_blocks // max(blocks_per_seq, 1)


_KV_MISTAKES = {
    "query_heads": "the cache stores K and V per KV head: use num_kv_heads, not num_heads (GQA shares them)",
    "k_only": "the cache holds K and V: two tensors per layer (the factor 2)",
    "one_layer": "every layer has its own K and V: multiply by num_layers",
    "tokens_not_blocks": "memory is handed out in whole blocks: a sequence takes ceil(seq_len / block_size) "
                         "blocks, and its last block is paid in full",
    "floor_blocks": "a sequence's last, partly filled block still takes a whole block: round blocks per sequence up",
    "round_up_blocks": "a block that does not fit in memory_bytes cannot be used: round the number of blocks down",
}


@exercise("12", "kv_capacity", forbidden=("labkit.grading.labs.lab12.reference_kv_capacity",
                                          "labkit.model.config.ModelConfig.kv_cache_bytes_per_token"))
def kv_capacity(ns):
    fn = require(ns, "kv_capacity")
    smollm2 = {"num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "hidden_size": 576}
    llama3_8b = {"num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "hidden_size": 4096}
    rng = random.Random(1212)
    cases = [(smollm2, 1000, 2**30, 2, 16), ({**smollm2, "num_kv_heads": 1}, 1000, 2**30, 2, 16),
             ({**smollm2, "num_kv_heads": 9}, 1000, 2**30, 2, 16), (llama3_8b, 2048, 16 * 2**30, 2, 16),
             (smollm2, 17, 40 * 16 * 23040, 2, 16), (smollm2, 16, 40 * 16 * 23040 - 1, 2, 16),
             (smollm2, 5, 10**6, 4, 8), (smollm2, 100, 10**5, 2, 16)]
    for _ in range(30):
        kv = rng.choice([1, 2, 4, 8])
        config = {"num_layers": rng.randint(1, 40), "num_heads": kv * rng.choice([1, 2, 4]), "num_kv_heads": kv,
                  "head_dim": rng.choice([32, 64, 128]), "hidden_size": 0}
        config["hidden_size"] = config["num_heads"] * config["head_dim"]
        cases.append((config, rng.randint(1, 5000), rng.randint(10**5, 10**10), rng.choice([1, 2, 4]),
                      rng.choice([8, 16, 32])))
    for config, *rest in cases:
        got = fn(dict(config), *rest)
        if not (isinstance(got, tuple | list) and len(got) == 2 and all(type(x) is int for x in got)):
            raise ExerciseFailed(f"return a pair of ints (bytes per token, number of sequences), got {got!r}")
        want = reference_kv_capacity(config, *rest)
        if tuple(got) == want:
            continue
        for mistake, why in _KV_MISTAKES.items():
            if tuple(got) == reference_kv_capacity(config, *rest, mistake=mistake):
                raise ExerciseFailed(why)
        seq_len, memory, dtype_bytes, block_size = rest
        raise ExerciseFailed(f"config={config}, seq_len={seq_len}, memory_bytes={memory}, dtype_bytes={dtype_bytes}, "
                             f"block_size={block_size}: expected {want}, got {tuple(got)}")
    return "2 * layers * KV heads * head_dim * bytes per token; whole blocks, rounded the right ways"


# ------------------------------------------------- Exercise 3: fewer K/V heads by mean-pooling groups

def _pool_mistakes(weight, num_kv, new):
    """Wrong poolings a student writes, by the misconception each one names."""
    head_dim = weight.shape[0] // num_kv
    heads = weight.reshape(num_kv, head_dim, -1)
    group = num_kv // new
    yield ("the rows are num_kv_heads blocks of head_dim rows each (head-major): reshape to "
           "(num_kv_heads, head_dim, ...), not (head_dim, num_kv_heads, ...)",
           weight.reshape(head_dim, num_kv, -1).reshape(head_dim, new, group, -1).mean(2).reshape(-1, weight.shape[1]))
    yield ("query head h reads K/V head h // group: a group is a run of consecutive heads, not every "
           f"{new}th head", heads.reshape(group, new, head_dim, -1).mean(0).reshape(-1, weight.shape[1]))
    yield ("average the heads of a group (mean), don't add them up",
           heads.reshape(new, group, head_dim, -1).sum(1).reshape(-1, weight.shape[1]))
    yield ("every head of a group counts: pool them, don't keep only the first",
           heads.reshape(new, group, head_dim, -1)[:, 0].reshape(-1, weight.shape[1]))
    yield ("pool over the heads of each group, not over all heads at once",
           heads.mean(0, keepdim=True).expand(new, head_dim, -1).reshape(-1, weight.shape[1]))


@exercise("12", "pool_kv_heads", forbidden=("labkit.model.kv_heads.pool_kv_heads",
                                            "labkit.model.kv_heads.with_kv_heads"))
def pool_kv_heads(ns):
    fn = require(ns, "pool_kv_heads")
    gen = torch.Generator().manual_seed(12)
    # (num_kv_heads, new_num_kv_heads, head_dim, hidden): SmolLM2's 3 -> 1 first, then groups of 2 and 4
    for num_kv, new, head_dim, hidden in [(3, 1, 4, 5), (6, 2, 3, 4), (4, 2, 2, 3), (8, 2, 6, 2), (6, 3, 2, 7),
                                          (4, 4, 3, 2), (2, 1, 64, 8)]:
        weight = torch.randn(num_kv * head_dim, hidden, generator=gen)
        given = weight.clone()
        got = fn(given, num_kv, new)
        if not torch.equal(given, weight):
            raise ExerciseFailed("your function changed the weight it was given: return a new tensor "
                                 "(the original model keeps its heads)")
        expect_tensor(got, (new * head_dim, hidden), f"pooling {num_kv} heads of {head_dim} rows into {new}")
        want = reference_pool_kv_heads(weight, num_kv, new)
        if torch.allclose(got, want, atol=1e-6):
            continue
        for why, wrong in _pool_mistakes(weight, num_kv, new):
            if wrong is not None and wrong.shape == got.shape and torch.allclose(got, wrong, atol=1e-6):
                raise ExerciseFailed(why)
        if new == num_kv:
            raise ExerciseFailed(f"with as many new heads as old ones ({num_kv}) every group is one head: "
                                 "pooling must return the weight unchanged")
        group = num_kv // new
        raise ExerciseFailed(f"{num_kv} -> {new} heads (head_dim {head_dim}): new head j must be the mean of old "
                             f"heads j*{group} .. j*{group}+{group - 1} (the query heads that read them)")
    return "each new K/V head is the mean of the consecutive heads whose query heads it now serves"


# ---------------------------------------------------------------- Exercise 4: perplexity from logits

def _perplexity_mistakes(logits, ids):
    lp = torch.log_softmax(logits.double(), -1)
    yield "no shift: the logits at position t predict token t + 1, not token t", \
        torch.exp(-lp.gather(1, ids[:, None]).mean())
    yield "shifted the wrong way: score token t + 1 with the logits at position t (logits[:-1], ids[1:])", \
        torch.exp(-lp[1:].gather(1, ids[:-1, None]).mean())
    yield "perplexity is exp of the MEAN negative log-likelihood, not of the sum", \
        torch.exp(-lp[:-1].gather(1, ids[1:, None]).sum())
    yield "that is the mean negative log-likelihood (cross-entropy): perplexity is its exp", \
        -lp[:-1].gather(1, ids[1:, None]).mean()
    yield "perplexity uses the log-probabilities: exp(-mean log p), not 1 / mean p", \
        1 / lp[:-1].gather(1, ids[1:, None]).exp().mean()
    yield "score only each position's target token, not the whole vocabulary row", \
        torch.exp(-lp[:-1].mean())


@exercise("12", "perplexity", forbidden=(
    "labkit.model.perplexity.perplexity_from_logits", "labkit.model.perplexity.perplexity",
    "torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss", "torch.nn.CrossEntropyLoss.forward",
    "torch.nn.NLLLoss.forward",
))
def perplexity(ns):
    fn = require(ns, "perplexity")
    gen = torch.Generator().manual_seed(1200)
    cases = []
    for T, vocab, scale in [(2, 5, 1.0), (6, 11, 2.0), (20, 50, 3.0), (64, 300, 1.5)]:
        cases.append((torch.randn(T, vocab, generator=gen) * scale, torch.randint(vocab, (T,), generator=gen)))
    # a confident model that is wrong once: the target's logit is 200 below the best one
    confident = torch.zeros(4, 8)
    confident[:, 0] = 200.0
    cases.append((confident, torch.tensor([3, 5, 0, 0])))
    for logits, ids in cases:
        got = fn(logits.clone(), ids.clone())
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, int | float):
            raise ExerciseFailed(f"return the perplexity as a number, got {type(got).__name__}")
        want = perplexity_from_logits(logits, ids)
        if math.isclose(got, want, rel_tol=1e-4):
            continue
        if not math.isfinite(got):
            raise ExerciseFailed("a token the model finds very unlikely gives log(softmax) = log(0) = -inf: "
                                 "use log_softmax (logits minus their logsumexp), which stays finite")
        for why, wrong in _perplexity_mistakes(logits, ids):
            if math.isclose(got, float(wrong), rel_tol=1e-4):
                raise ExerciseFailed(why)
        raise ExerciseFailed(f"logits of shape {tuple(logits.shape)}: expected {want:.6g}, got {got:.6g}")
    return "exp(mean -log softmax(logits[t])[ids[t + 1]]), numerically stable"


# ----------------------------------------------------------------------------------- knowledge check

@exercise("12", "knowledge_check")
def knowledge_check(ns):
    import dataclasses

    from labkit.grading.quiz import Choice, Number, grade_answers
    from labkit.model import load_config
    from labkit.roofline import ILLUSTRATIVE_BANDWIDTH, ILLUSTRATIVE_PEAK_FLOPS, decode_cost

    smollm2 = load_config("smollm2")
    mqa = dataclasses.replace(smollm2, num_kv_heads=1)
    ridge = ILLUSTRATIVE_PEAK_FLOPS / ILLUSTRATIVE_BANDWIDTH
    batch = next(b for b in range(1, 10_000) if decode_cost(smollm2, b, 0, dtype_bytes=2).intensity >= ridge)
    return grade_answers(ns, {
        1: Number(mqa.kv_cache_bytes_per_token(dtype_bytes=2), "'MHA, GQA, MQA: bytes per token'"),
        2: Number(batch, "'Batch size moves decode along the roofline' (weights only, bf16)"),
        3: Choice("a", "'Where prefill and decode fall'"),
        4: Choice("c", "'Back to MHA costs nothing but memory'"),
        5: Choice("b", "'Long contexts: the K/V reads cap decode'"),
    })

