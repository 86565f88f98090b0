"""Lab 12: memory-bound inference. How K/V heads move decode on Lab 02's roofline, KV-cache capacity,
MHA -> GQA -> MQA by pooling K/V heads, and perplexity, the number that measures what the pooling cost."""

import math

import torch

from labkit.model.config import ModelConfig
from labkit.model.kv_heads import pool_kv_heads as reference_pool_kv_heads
from labkit.model.perplexity import perplexity_from_logits
from labkit_course.grading import ExerciseFailed, exercise, expect_tensor, raised_type, require
from labkit_course.grading.core import seeded_generator, seeded_random
from labkit_course.roofline import decode_cost, weight_bytes

# ------------------------------------------- Exercise 1: where K/V heads put decode on the roofline

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def _model_config(config: dict, num_kv_heads: int) -> ModelConfig:
    """labkit's own config for a shape dict, so the reference prices steps with labkit_course.roofline."""
    return ModelConfig(architecture="llama", **{**{k: config[k] for k in SHAPE_KEYS}, "num_kv_heads": num_kv_heads},
                       max_position_embeddings=1 << 20, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True)


def _mistaken_cost(config, kv_heads, batch, context, dtype_bytes, mistake):
    """decode_cost with one step of it switched to what a student half-remembers."""
    if mistake == "kept_heads":
        kv_heads = config["num_kv_heads"]
    if mistake == "float32":
        dtype_bytes = 4
    if mistake == "derived_head_dim":
        config = {**config, "head_dim": config["hidden_size"] // config["num_heads"]}
    cost = decode_cost(_model_config(config, kv_heads), batch, context, dtype_bytes)
    flops, nbytes = cost.flops, cost.bytes_moved
    if mistake == "kv_only":  # the K/V reads shrink, but k_proj and v_proj are priced at the original heads
        original = _model_config(config, config["num_kv_heads"])
        flops = decode_cost(original, batch, context, dtype_bytes).flops
        nbytes += weight_bytes(original, dtype_bytes) - weight_bytes(_model_config(config, kv_heads), dtype_bytes)
    if mistake == "attention_flops":  # QK^T and PV counted per K/V head instead of per query head
        flops -= batch * config["num_layers"] * 4 * (config["num_heads"] - kv_heads) * config["head_dim"] * context
    if mistake == "weights_per_sequence":
        nbytes += (batch - 1) * weight_bytes(_model_config(config, kv_heads), dtype_bytes)
    return flops, nbytes


def reference_decode_regimes(config, kv_heads_list, batches, contexts, peak_flops, bandwidth, dtype_bytes=2, *,
                             mistake=None):
    """{kv_heads: {(batch, context): (seconds, bound)}} of one decode step, priced by labkit_course.roofline.
    `mistake` re-creates a typical wrong answer, so that a wrong result can be named."""
    for kv_heads in kv_heads_list:
        if mistake != "no_validation" and (kv_heads < 1 or config["num_heads"] % kv_heads):
            raise ValueError(f"{kv_heads} K/V heads cannot be shared by {config['num_heads']} query heads")
    regimes = {}
    for kv_heads in kv_heads_list:
        grid = regimes[kv_heads] = {}
        for batch in batches:
            for context in contexts:
                flops, nbytes = _mistaken_cost(config, kv_heads, batch, context, dtype_bytes, mistake)
                memory_roof = flops / nbytes * bandwidth
                bound = "memory" if memory_roof < peak_flops else "compute"
                if mistake == "memory_time":
                    seconds = nbytes / bandwidth
                elif mistake == "compute_time":
                    seconds = flops / peak_flops
                elif mistake == "sum":
                    seconds = flops / peak_flops + nbytes / bandwidth
                else:
                    seconds = flops / min(peak_flops, memory_roof)
                grid[(batch, context)] = (seconds, bound)
    return regimes


_REGIME_MISTAKES = {
    "derived_head_dim": "read head_dim from the config: hidden_size / num_heads is not every model's head size "
                        "(Qwen3-0.6B: 1024 / 16 = 64, but its head_dim is 128)",
    "kept_heads": "every K/V-head count gave the same step: price each one with its own num_kv_heads",
    "kv_only": "fewer K/V heads also shrink k_proj and v_proj: the weights read per step change with num_kv_heads "
               "too, not only the K/V cache",
    "attention_flops": "GQA shares K/V heads but every query head still does its own QK^T and PV: attention FLOPs "
                       "count num_heads, not num_kv_heads",
    "float32": "price the weights and the K/V cache at dtype_bytes bytes per element (bf16: 2), not float32's 4",
    "weights_per_sequence": "the batch shares one read of the weights: only the K/V reads grow with the batch",
    "memory_time": "the step time is flops / attainable (the larger of flops / peak and bytes / bandwidth): "
                   "a compute-bound step is not limited by its bytes",
    "compute_time": "the step time is flops / attainable: a memory-bound step takes bytes / bandwidth, "
                    "longer than flops / peak",
    "sum": "the roofline overlaps compute and memory traffic: the time is flops / attainable, "
           "not flops / peak + bytes / bandwidth",
}

_SHAPES = {  # name: (shape, K/V-head counts to price)
    "SmolLM2-135M": ({"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                      "num_heads": 9, "num_kv_heads": 3, "head_dim": 64}, [9, 3, 1]),
    "Llama-3 8B": ({"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32,
                    "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}, [32, 8, 1]),
    "Qwen3-0.6B": ({"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_layers": 28,
                    "num_heads": 16, "num_kv_heads": 8, "head_dim": 128}, [16, 8, 2]),
    "a toy": ({"vocab_size": 100, "hidden_size": 16, "intermediate_size": 32, "num_layers": 2, "num_heads": 4,
               "num_kv_heads": 2, "head_dim": 4}, [2, 4]),
}


def _drawn_regime_case(rng):
    """A shape, machine and grid no notebook can know ahead: head_dim need not be hidden_size / num_heads, and
    every K/V-head count that divides the query heads is priced."""
    kv_heads, head_dim = rng.choice([1, 2, 4, 8]), rng.choice([32, 64, 128])
    heads = kv_heads * rng.choice([1, 2, 3, 4])
    hidden = heads * head_dim // rng.choice([1, 1, 2])
    shape = {"vocab_size": rng.randint(1000, 160000), "hidden_size": hidden,
             "intermediate_size": hidden * rng.randint(2, 4), "num_layers": rng.randint(2, 40), "num_heads": heads,
             "num_kv_heads": kv_heads, "head_dim": head_dim}
    peak = float(f"{rng.uniform(1e11, 2e15):.4g}")  # 4 digits, so that the message gives the exact machine
    return (f"the shape {shape}", shape, [h for h in range(heads, 0, -1) if heads % h == 0],
            (peak, float(f"{peak / rng.uniform(5, 600):.4g}")), rng.choice([1, 2, 4]),
            sorted(rng.sample(range(1, 4097), 3)), [0] + sorted(rng.sample(range(1, 65537), 3)))


def _same_step(got, want) -> bool:
    return (isinstance(got, tuple | list) and len(got) == 2 and isinstance(got[0], int | float)
            and not isinstance(got[0], bool) and math.isclose(got[0], want[0], rel_tol=1e-6) and got[1] == want[1])


def _unchanged(given: dict, original: dict, name: str) -> None:
    if given != original:
        raise ExerciseFailed(f"your {name} wrote into the config it was given: read it, don't change it "
                             "(the caller's model shape must stay as it was)")


@exercise("12", "decode_regimes", forbidden=("labkit_course.grading.labs.lab12.reference_decode_regimes",
                                             "labkit_course.roofline.decode_cost", "labkit_course.roofline.step_cost",
                                             "labkit_course.roofline.weight_bytes",
                                             "labkit_course.roofline._linear_params_per_layer",
                                             "labkit.model.config.ModelConfig.kv_cache_bytes_per_token"))
def decode_regimes(ns):
    fn = require(ns, "decode_regimes")
    machines = [(1.0e15, 3.35e12), (100e9, 20e9), (8.0e12, 2.0e12), (2.0e12, 0.1e12)]
    batches, contexts = [1, 16, 256, 2048], [0, 1, 512, 4096, 32768]
    cases = [(f"{name}'s shape", shape, kv_heads_list, machine, dtype_bytes, batches, contexts)
             for (name, (shape, kv_heads_list)), machine in zip(_SHAPES.items(), machines, strict=True)
             for dtype_bytes in (2, 1)]
    cases.append(_drawn_regime_case(seeded_random(1201)))
    for label, shape, kv_heads_list, (peak, bandwidth), dtype_bytes, batches, contexts in cases:
        args = (shape, kv_heads_list, batches, contexts, peak, bandwidth, dtype_bytes)
        given = dict(shape)
        got = fn(given, list(kv_heads_list), list(batches), list(contexts), peak, bandwidth, dtype_bytes)
        _unchanged(given, shape, "decode_regimes")
        if not isinstance(got, dict) or set(got) != set(kv_heads_list):
            raise ExerciseFailed(f"return a dict with one entry per K/V-head count {kv_heads_list}, got {got!r}")
        want = reference_decode_regimes(*args)
        for kv_heads, grid in got.items():
            if not isinstance(grid, dict) or set(grid) != set(want[kv_heads]):
                keys = sorted(grid) if isinstance(grid, dict) else grid
                raise ExerciseFailed(f"{kv_heads} K/V heads: map every (batch, context) pair of the grid to "
                                     f"(seconds, bound); got {keys}")
            for step in grid.values():
                if isinstance(step, tuple | list) and len(step) == 2 and step[1] not in ("memory", "compute"):
                    raise ExerciseFailed("the bound is what Lab 02's roofline says, \"memory\" or \"compute\"; "
                                         f"got {step[1]!r}")
        wrong = [(h, key) for h in want for key in want[h] if not _same_step(got[h][key], want[h][key])]
        if not wrong:
            continue
        where = f"{label}, dtype_bytes {dtype_bytes}, {peak:g} FLOP/s, {bandwidth:g} B/s"
        for mistake, why in _REGIME_MISTAKES.items():
            theirs = reference_decode_regimes(*args, mistake=mistake)
            if all(_same_step(got[h][key], theirs[h][key]) for h, key in wrong):
                raise ExerciseFailed(f"{where}: {why}")
        h, (batch, context) = wrong[0]
        raise ExerciseFailed(f"{where}, {h} K/V heads, batch {batch}, context {context}: "
                             f"expected {want[h][batch, context]}, got {got[h][batch, context]!r}")
    smollm2 = _SHAPES["SmolLM2-135M"][0]
    for bad in ([2], [9, 0], [4, 3], [-3]):
        try:
            fn(dict(smollm2), bad, [1], [0], *machines[0], 2)
        except ExerciseFailed:
            raise
        except Exception as error:  # noqa: BLE001 - which error the student raised is the point
            raised = raised_type(error)  # a RemoteError names the student's type
            if raised == "ValueError":
                continue
            raise ExerciseFailed(f"K/V heads {bad} for 9 query heads: raise a ValueError, not {raised}") from None
        if min(bad) < 0:
            raise ExerciseFailed(f"K/V heads {bad} for 9 query heads: a count below 1 is no model, even where it "
                                 "divides num_heads (9 % -3 == 0); raise a ValueError naming the count")
        raise ExerciseFailed(f"K/V heads {bad} for 9 query heads: every K/V-head count must divide num_heads "
                             "(and be at least 1); raise a ValueError naming the count")
    if fn(dict(smollm2), [], [1], [0], *machines[0], 2) != {}:
        raise ExerciseFailed("no K/V-head counts to price: return an empty dict")
    return "each K/V-head count priced with its own weights and K/V reads, timed as flops / attainable"


# ------------------------------------------------------- Exercise 2: KV bytes and sequences that fit

def reference_kv_capacity(config, seq_len, memory_bytes, dtype_bytes, block_size, *, mistake=None):
    """(KV bytes per token, sequences of seq_len tokens that fit in memory_bytes of blocks)."""
    heads = config["num_heads"] if mistake == "query_heads" else config["num_kv_heads"]
    head_dim = config["hidden_size"] // config["num_heads"] if mistake == "derived_head_dim" else config["head_dim"]
    per_token = ((1 if mistake == "k_only" else 2) * config["num_layers"] * heads * head_dim
                 * (1 if mistake == "no_dtype" else dtype_bytes))
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
    "derived_head_dim": "read head_dim from the config: hidden_size / num_heads is not every model's head size "
                        "(Qwen3-0.6B: 1024 / 16 = 64, but its head_dim is 128)",
    "no_dtype": "multiply by dtype_bytes: the bytes per token depend on the element size (2 in bf16, 4 in float32)",
    "k_only": "the cache holds K and V: two tensors per layer (the factor 2)",
    "one_layer": "every layer has its own K and V: multiply by num_layers",
    "tokens_not_blocks": "memory is handed out in whole blocks: a sequence takes ceil(seq_len / block_size) "
                         "blocks, and its last block is paid in full",
    "floor_blocks": "a sequence's last, partly filled block still takes a whole block: round blocks per sequence up",
    "round_up_blocks": "a block that does not fit in memory_bytes cannot be used: round the number of blocks down",
}


@exercise("12", "kv_capacity", forbidden=("labkit_course.grading.labs.lab12.reference_kv_capacity",
                                          "labkit.model.config.ModelConfig.kv_cache_bytes_per_token"))
def kv_capacity(ns):
    fn = require(ns, "kv_capacity")
    smollm2 = {"num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "hidden_size": 576}
    llama3_8b = {"num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "hidden_size": 4096}
    qwen3_06b = {"num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128, "hidden_size": 1024}
    rng = seeded_random(1212)
    cases = [(smollm2, 1000, 2**30, 2, 16), (qwen3_06b, 2048, 2**30, 2, 16),
             ({**smollm2, "num_kv_heads": 1}, 1000, 2**30, 2, 16),
             ({**smollm2, "num_kv_heads": 9}, 1000, 2**30, 2, 16), (llama3_8b, 2048, 16 * 2**30, 2, 16),
             (smollm2, 17, 40 * 16 * 23040, 2, 16), (smollm2, 16, 40 * 16 * 23040 - 1, 2, 16),
             (smollm2, 5, 10**6, 4, 8), (smollm2, 100, 10**5, 2, 16)]
    for _ in range(30):
        kv = rng.choice([1, 2, 4, 8])
        config = {"num_layers": rng.randint(1, 40), "num_heads": kv * rng.choice([1, 2, 4]), "num_kv_heads": kv,
                  "head_dim": rng.choice([32, 64, 128]), "hidden_size": 0}
        # as in Qwen3 and Gemma, head_dim need not be hidden_size / num_heads
        config["hidden_size"] = config["num_heads"] * config["head_dim"] // rng.choice([1, 1, 2])
        cases.append((config, rng.randint(1, 5000), rng.randint(10**5, 10**10), rng.choice([1, 2, 4]),
                      rng.choice([8, 16, 32])))
    answers = []
    for config, *rest in cases:
        given = dict(config)
        got = fn(given, *rest)
        _unchanged(given, config, "kv_capacity")
        if not (isinstance(got, tuple | list) and len(got) == 2 and all(type(x) is int for x in got)):
            raise ExerciseFailed(f"return a pair of ints (bytes per token, number of sequences), got {got!r}")
        answers.append(tuple(got))
    wants = [reference_kv_capacity(config, *rest) for config, *rest in cases]
    for mistake, why in _KV_MISTAKES.items():  # first a mistake that explains every answer
        if answers != wants and answers == [reference_kv_capacity(config, *rest, mistake=mistake)
                                            for config, *rest in cases]:
            raise ExerciseFailed(why)
    for got, want, (config, *rest) in zip(answers, wants, cases, strict=True):
        if got == want:
            continue
        for mistake, why in _KV_MISTAKES.items():
            if got == reference_kv_capacity(config, *rest, mistake=mistake):
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
    yield ("query head h reads K/V head h // group: a group is a run of consecutive heads, not heads "
           f"{new} apart", heads.reshape(group, new, head_dim, -1).mean(0).reshape(-1, weight.shape[1]))
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
    gen = seeded_generator(12)
    float32, bfloat16 = torch.float32, torch.bfloat16  # bf16, as real checkpoints are
    # (num_kv_heads, new_num_kv_heads, head_dim, hidden, dtype): SmolLM2's 3 -> 1 first, then groups of 2 and 4
    for num_kv, new, head_dim, hidden, dtype in [(3, 1, 4, 5, float32), (6, 2, 3, 4, float32), (4, 2, 2, 3, float32),
                                                 (8, 2, 6, 2, float32), (6, 3, 2, 7, float32), (4, 4, 3, 2, float32),
                                                 (2, 1, 64, 8, float32), (6, 2, 4, 8, bfloat16)]:
        weight = torch.randn(num_kv * head_dim, hidden, generator=gen).to(dtype)
        given = weight.clone()
        got = fn(given, num_kv, new)
        if not torch.equal(given, weight):
            raise ExerciseFailed("your function changed the weight it was given: return a new tensor "
                                 "(the original model keeps its heads)")
        expect_tensor(got, (new * head_dim, hidden), f"pooling {num_kv} heads of {head_dim} rows into {new}")
        if got.dtype != weight.dtype:
            raise ExerciseFailed(f"return the weight's dtype ({weight.dtype}), got {got.dtype}: average in a wider "
                                 "dtype if you like, then convert back")
        want = reference_pool_kv_heads(weight, num_kv, new)
        tolerance = 1e-6 if dtype == float32 else 1e-2  # bf16 keeps 8 bits: a sum, then a division, may round
        if torch.allclose(got, want, atol=tolerance, rtol=tolerance):
            if got.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
                raise ExerciseFailed(f"{num_kv} -> {new} heads returned the weight's own memory: return a new "
                                     "tensor (clone it), or an edit of the pooled weight changes the original model")
            continue
        for why, wrong in _pool_mistakes(weight, num_kv, new):
            if wrong is not None and wrong.shape == got.shape and torch.allclose(got, wrong, atol=tolerance,
                                                                                 rtol=tolerance):
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
    gen = seeded_generator(1200)
    cases = []
    for T, vocab, scale in [(2, 5, 1.0), (6, 11, 2.0), (20, 50, 3.0), (64, 300, 1.5)]:
        cases.append((torch.randn(T, vocab, generator=gen) * scale, torch.randint(vocab, (T,), generator=gen)))
    # a confident model that is wrong once: the target's logit is 1000 below the best one, so its probability,
    # exp(-1000), is 0 even in float64; over 15 predictions the perplexity, exp(1000 / 15), still fits a float32
    confident = torch.zeros(16, 8)
    confident[:, 0] = 1000.0
    cases.append((confident, torch.tensor([3, 5] + [0] * 14)))
    for logits, ids in cases:
        given_logits, given_ids = logits.clone(), ids.clone()
        got = fn(given_logits, given_ids)
        if not (torch.equal(given_logits, logits) and torch.equal(given_ids, ids)):
            raise ExerciseFailed("your perplexity changed the logits (or ids) it was given: work on new tensors "
                                 "(x - x.logsumexp(...), not x.sub_(...)); the caller still needs them")
        if isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"return the perplexity as a Python float (.item()), not a tensor of shape "
                                 f"{tuple(got.shape)}")
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

    from labkit.model import load_config
    from labkit_course.grading.quiz import Choice, Number, grade_answers
    from labkit_course.roofline import ILLUSTRATIVE_BANDWIDTH, ILLUSTRATIVE_PEAK_FLOPS, decode_cost

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

