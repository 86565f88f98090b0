"""Lab 12: the roofline, KV-cache capacity, pooling K/V heads, perplexity."""

import math

import torch
import torch.nn.functional as F

from catalogue import Right, Wrong
from labkit.grading.labs.lab12 import reference_kv_capacity, reference_roofline_point
from labkit.model.kv_heads import pool_kv_heads as labkit_pool_kv_heads
from labkit.model.perplexity import perplexity_from_logits

# ------------------------------------------------------------------------------------- roofline_point


def roofline_min_max(flops, bytes_moved, peak_flops, bandwidth):
    intensity = flops / bytes_moved
    ridge = peak_flops / bandwidth
    return {"intensity": intensity, "ridge": ridge, "attainable": min(peak_flops, bandwidth * intensity),
            "seconds": max(flops / peak_flops, bytes_moved / bandwidth),
            "bound": "compute" if intensity >= ridge else "memory"}


def roofline_by_regime(flops, bytes_moved, peak_flops, bandwidth):
    """Decide the regime first, then read everything off the roof that binds."""
    intensity, ridge = flops / bytes_moved, peak_flops / bandwidth
    if intensity < ridge:
        return dict(intensity=intensity, ridge=ridge, attainable=bandwidth * intensity,
                    seconds=bytes_moved / bandwidth, bound="memory")
    return dict(intensity=intensity, ridge=ridge, attainable=float(peak_flops), seconds=flops / peak_flops,
                bound="compute")


def roofline_with(**changes):
    def answer(flops, bytes_moved, peak_flops, bandwidth):
        return {**roofline_min_max(flops, bytes_moved, peak_flops, bandwidth), **{
            key: change(flops, bytes_moved, peak_flops, bandwidth) for key, change in changes.items()}}
    return answer


def roofline_bound_strict(flops, bytes_moved, peak_flops, bandwidth):
    point = roofline_min_max(flops, bytes_moved, peak_flops, bandwidth)
    return {**point, "bound": "compute" if point["intensity"] > point["ridge"] else "memory"}


# ---------------------------------------------------------------------------------------- kv_capacity


def kv_capacity_arithmetic(config, seq_len, memory_bytes, dtype_bytes, block_size):
    per_token = 2 * config["num_layers"] * config["num_kv_heads"] * config["head_dim"] * dtype_bytes
    blocks = memory_bytes // (block_size * per_token)
    return per_token, blocks // math.ceil(seq_len / block_size)


def kv_capacity_by_allocation(config, seq_len, memory_bytes, dtype_bytes, block_size):
    """Hand out whole blocks to one sequence after another until the next one does not fit."""
    k_bytes = config["num_layers"] * config["num_kv_heads"] * config["head_dim"] * dtype_bytes
    per_token = k_bytes + k_bytes  # V is the same size as K
    free_blocks = memory_bytes // (per_token * block_size)
    needed = (seq_len + block_size - 1) // block_size
    sequences = 0
    while free_blocks >= needed:
        free_blocks -= needed
        sequences += 1
    return per_token, sequences


def kv_capacity_half_right(config, seq_len, memory_bytes, dtype_bytes, block_size, *, heads="num_kv_heads",
                           tensors=2, layers=True, whole_blocks=True, seq_blocks=math.ceil, pool_blocks=math.floor):
    """The arithmetic with one step of it switched to what a student half-remembers."""
    per_token = tensors * (config["num_layers"] if layers else 1) * config[heads] * config["head_dim"] * dtype_bytes
    if not whole_blocks:
        return per_token, memory_bytes // (seq_len * per_token)
    blocks = int(pool_blocks(memory_bytes / (block_size * per_token)))
    return per_token, blocks // max(int(seq_blocks(seq_len / block_size)), 1)


def kv_with(**mistake):
    return lambda *args: kv_capacity_half_right(*args, **mistake)


# -------------------------------------------------------------------------------------- pool_kv_heads


def pool_reshape_mean(weight, num_kv_heads, new_num_kv_heads):
    head_dim = weight.shape[0] // num_kv_heads
    group = num_kv_heads // new_num_kv_heads
    return weight.reshape(new_num_kv_heads, group, head_dim, -1).mean(dim=1).reshape(-1, weight.shape[1])


def pool_loop(weight, num_kv_heads, new_num_kv_heads):
    """Slice out each group's rows, one new head at a time."""
    head_dim = weight.shape[0] // num_kv_heads
    group = num_kv_heads // new_num_kv_heads
    new_heads = []
    for j in range(new_num_kv_heads):
        members = [weight[(j * group + i) * head_dim:(j * group + i + 1) * head_dim] for i in range(group)]
        new_heads.append(sum(members) / group)
    return torch.cat(new_heads)


def pool_by_matrix(weight, num_kv_heads, new_num_kv_heads):
    """An averaging matrix [new, old] applied over the head axis."""
    head_dim = weight.shape[0] // num_kv_heads
    old_to_new = torch.arange(num_kv_heads) // (num_kv_heads // new_num_kv_heads)
    average = (old_to_new[None, :] == torch.arange(new_num_kv_heads)[:, None]).to(weight.dtype)
    average = average / average.sum(dim=1, keepdim=True)
    heads = weight.reshape(num_kv_heads, head_dim, -1)
    return torch.einsum("no,odh->ndh", average, heads).reshape(-1, weight.shape[1])


def pool_dim_major(weight, num_kv_heads, new_num_kv_heads):
    head_dim = weight.shape[0] // num_kv_heads
    heads = weight.reshape(head_dim, num_kv_heads, -1)
    return heads.reshape(head_dim, new_num_kv_heads, -1, weight.shape[1]).mean(2).reshape(-1, weight.shape[1])


def pool_strided(weight, num_kv_heads, new_num_kv_heads):
    head_dim = weight.shape[0] // num_kv_heads
    heads = weight.reshape(num_kv_heads, head_dim, -1)
    return torch.stack([heads[j::new_num_kv_heads].mean(0) for j in range(new_num_kv_heads)]).reshape(
        -1, weight.shape[1])


def pool_sum(weight, num_kv_heads, new_num_kv_heads):
    return pool_reshape_mean(weight, num_kv_heads, new_num_kv_heads) * (num_kv_heads // new_num_kv_heads)


def pool_first(weight, num_kv_heads, new_num_kv_heads):
    head_dim = weight.shape[0] // num_kv_heads
    group = num_kv_heads // new_num_kv_heads
    return weight.reshape(new_num_kv_heads, group, head_dim, -1)[:, 0].reshape(-1, weight.shape[1])


def pool_everything(weight, num_kv_heads, new_num_kv_heads):
    head_dim = weight.shape[0] // num_kv_heads
    mean = weight.reshape(num_kv_heads, head_dim, -1).mean(0)
    return mean.repeat(new_num_kv_heads, 1)


def pool_in_place(weight, num_kv_heads, new_num_kv_heads):
    pooled = pool_reshape_mean(weight, num_kv_heads, new_num_kv_heads)
    weight.zero_()
    return pooled


def pool_skips_identity(weight, num_kv_heads, new_num_kv_heads):
    if num_kv_heads == new_num_kv_heads:
        return torch.zeros_like(weight)
    return pool_reshape_mean(weight, num_kv_heads, new_num_kv_heads)


# ----------------------------------------------------------------------------------------- perplexity


def perplexity_log_softmax(logits, token_ids):
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(-log_probs.gather(1, token_ids[1:, None]).mean().item())


def perplexity_logsumexp_loop(logits, token_ids):
    """Position by position: -log p = logsumexp(row) - row[target]."""
    total = 0.0
    for t in range(len(token_ids) - 1):
        row = logits[t].double()
        total += (torch.logsumexp(row, 0) - row[token_ids[t + 1]]).item()
    return math.exp(total / (len(token_ids) - 1))


def perplexity_unstable(logits, token_ids):
    probs = torch.softmax(logits[:-1], dim=-1)
    return torch.exp(-torch.log(probs.gather(1, token_ids[1:, None])).mean()).item()


def _nll(logits, token_ids):
    return -torch.log_softmax(logits.double(), -1)


def perplexity_no_shift(logits, token_ids):
    return math.exp(_nll(logits, token_ids).gather(1, token_ids[:, None]).mean().item())


def perplexity_wrong_shift(logits, token_ids):
    return math.exp(_nll(logits, token_ids)[1:].gather(1, token_ids[:-1, None]).mean().item())


def perplexity_sum(logits, token_ids):
    return math.exp(_nll(logits, token_ids)[:-1].gather(1, token_ids[1:, None]).sum().item())


def perplexity_no_exp(logits, token_ids):
    return _nll(logits, token_ids)[:-1].gather(1, token_ids[1:, None]).mean().item()


def perplexity_inverse_mean_prob(logits, token_ids):
    probs = torch.softmax(logits[:-1].double(), -1).gather(1, token_ids[1:, None])
    return 1 / probs.mean().item()


def perplexity_whole_row(logits, token_ids):
    return math.exp(_nll(logits, token_ids)[:-1].mean().item())


def perplexity_cross_entropy(logits, token_ids):
    return math.exp(F.cross_entropy(logits[:-1], token_ids[1:]).item())


RIGHT = [
    Right("roofline_point", "min and max", roofline_min_max),
    Right("roofline_point", "regime first", roofline_by_regime),
    Right("kv_capacity", "closed-form arithmetic", kv_capacity_arithmetic),
    Right("kv_capacity", "allocate blocks in a loop", kv_capacity_by_allocation),
    Right("pool_kv_heads", "reshape and mean", pool_reshape_mean),
    Right("pool_kv_heads", "a loop over groups", pool_loop),
    Right("pool_kv_heads", "an averaging matrix", pool_by_matrix),
    Right("perplexity", "log_softmax and gather", perplexity_log_softmax),
    Right("perplexity", "logsumexp position by position", perplexity_logsumexp_loop),
]

WRONG = [
    Wrong("roofline_point", "bytes per FLOP", roofline_with(intensity=lambda f, b, p, w: b / f), "not bytes per FLOP"),
    Wrong("roofline_point", "ridge inverted", roofline_with(ridge=lambda f, b, p, w: w / p),
          "not bandwidth / peak_flops"),
    Wrong("roofline_point", "the higher roof", roofline_with(attainable=lambda f, b, p, w: max(p, w * f / b)),
          "not the higher"),
    Wrong("roofline_point", "memory roof without intensity", roofline_with(attainable=lambda f, b, p, w: min(p, w)),
          "not the bandwidth alone"),
    Wrong("roofline_point", "time from compute only", roofline_with(seconds=lambda f, b, p, w: f / p),
          "the time ignores memory"),
    Wrong("roofline_point", "compute and memory times added", roofline_with(seconds=lambda f, b, p, w: f / p + b / w),
          "not their sum"),
    Wrong("roofline_point", "the ridge point counted as memory-bound", roofline_bound_strict, "intensity >= ridge"),
    Wrong("roofline_point", "returns a tuple", lambda f, b, p, w: tuple(roofline_min_max(f, b, p, w).values()),
          "return a dict"),
    Wrong("roofline_point", "bound spelled differently",
          roofline_with(bound=lambda f, b, p, w: "memory-bound" if f / b < p / w else "compute-bound"),
          "'bound' must be"),
    Wrong("roofline_point", "imports the grader's reference", lambda *a: reference_roofline_point(*a),
          "`reference_roofline_point`",
          calls="labkit.grading.labs.lab12.reference_roofline_point"),
    Wrong("kv_capacity", "query heads instead of KV heads", kv_with(heads="num_heads"), "use num_kv_heads"),
    Wrong("kv_capacity", "K only", kv_with(tensors=1), "the factor 2"),
    Wrong("kv_capacity", "one layer", kv_with(layers=False), "multiply by num_layers"),
    Wrong("kv_capacity", "tokens, not blocks", kv_with(whole_blocks=False), "whole blocks"),
    Wrong("kv_capacity", "blocks per sequence rounded down", kv_with(seq_blocks=math.floor),
          "round blocks per sequence up"),
    Wrong("kv_capacity", "number of blocks rounded up", kv_with(pool_blocks=math.ceil),
          "round the number of blocks down"),
    Wrong("kv_capacity", "float division", lambda *a: tuple(float(x) for x in kv_capacity_arithmetic(*a)),
          "pair of ints"),
    Wrong("kv_capacity", "imports the grader's reference", lambda *a: reference_kv_capacity(*a),
          "`reference_kv_capacity`",
          calls="labkit.grading.labs.lab12.reference_kv_capacity"),
    Wrong("pool_kv_heads", "head_dim-major layout", pool_dim_major, "head-major"),
    Wrong("pool_kv_heads", "every new_num_kv_heads-th head in a group", pool_strided, "consecutive heads"),
    Wrong("pool_kv_heads", "sums instead of averaging", pool_sum, "don't add them up"),
    Wrong("pool_kv_heads", "keeps the first head of each group", pool_first, "don't keep only the first"),
    Wrong("pool_kv_heads", "one mean over all heads", pool_everything, "not over all heads at once"),
    Wrong("pool_kv_heads", "writes into the original weight", pool_in_place, "changed the weight it was given"),
    Wrong("pool_kv_heads", "special-cases equal head counts wrongly", pool_skips_identity,
          "return the weight unchanged"),
    Wrong("pool_kv_heads", "calls labkit's pooling", lambda *a: labkit_pool_kv_heads(*a), "`pool_kv_heads`",
          calls="labkit.model.kv_heads.pool_kv_heads"),
    Wrong("perplexity", "no shift", perplexity_no_shift, "no shift"),
    Wrong("perplexity", "shifted the wrong way", perplexity_wrong_shift, "shifted the wrong way"),
    Wrong("perplexity", "exp of the sum", perplexity_sum, "not of the sum"),
    Wrong("perplexity", "cross-entropy without exp", perplexity_no_exp, "perplexity is its exp"),
    Wrong("perplexity", "1 / mean probability", perplexity_inverse_mean_prob, "not 1 / mean p"),
    Wrong("perplexity", "averages over the whole vocabulary", perplexity_whole_row, "whole vocabulary row"),
    Wrong("perplexity", "log of softmax underflows", perplexity_unstable, "use log_softmax"),
    Wrong("perplexity", "calls F.cross_entropy", perplexity_cross_entropy, "torch.nn.functional.cross_entropy",
          calls="torch.nn.functional.cross_entropy"),
    Wrong("perplexity", "calls labkit's perplexity", lambda *a: perplexity_from_logits(*a), "`perplexity_from_logits`",
          calls="labkit.model.perplexity.perplexity_from_logits"),
]
