"""Lab 12: K/V heads on the roofline, KV-cache capacity, pooling K/V heads, perplexity."""

import itertools
import math

import torch
import torch.nn.functional as F

from catalogue import Right, Wrong
from labkit.model.config import ModelConfig
from labkit.model.kv_heads import pool_kv_heads as labkit_pool_kv_heads
from labkit.model.perplexity import perplexity_from_logits
from labkit_course.grading.labs.lab12 import reference_decode_regimes, reference_kv_capacity
from labkit_course.roofline import _linear_params_per_layer, decode_cost

# ------------------------------------------------------------------------------------- decode_regimes


def roofline(intensity, peak_flops, bandwidth):
    """Lab 02's answer, which a Lab 12 student pastes in and calls."""
    memory_roof = intensity * bandwidth
    return min(peak_flops, memory_roof), "memory" if memory_roof < peak_flops else "compute"


def _check_heads(config, kv_heads_list):
    for kv_heads in kv_heads_list:
        if kv_heads < 1 or config["num_heads"] % kv_heads:
            raise ValueError(f"{kv_heads} K/V heads do not divide {config['num_heads']} query heads")


def _decode_step(config, kv_heads, batch, context, dtype_bytes, *, weight_kv_heads=None, attention_heads=None,
                 weights_per_sequence=False):
    """(FLOPs, bytes) of one decode step, labkit_course.roofline's accounting; the keywords switch a step to a
    mistake."""
    hidden, layers, head_dim = config["hidden_size"], config["num_layers"], config["head_dim"]
    projections = hidden * (2 * config["num_heads"] + 2 * (weight_kv_heads or kv_heads)) * head_dim
    params = layers * (projections + 3 * hidden * config["intermediate_size"]) + config["vocab_size"] * hidden
    attention = layers * 4 * (attention_heads or config["num_heads"]) * head_dim * context
    flops = batch * (2 * params + attention)
    kv_bytes = batch * context * 2 * layers * kv_heads * head_dim * dtype_bytes
    return flops, (batch if weights_per_sequence else 1) * params * dtype_bytes + kv_bytes


def regimes_nested_loops(config, kv_heads_list, batches, contexts, peak_flops, bandwidth, dtype_bytes=2):
    _check_heads(config, kv_heads_list)
    result = {}
    for kv_heads in kv_heads_list:
        result[kv_heads] = {}
        for batch in batches:
            for context in contexts:
                flops, nbytes = _decode_step(config, kv_heads, batch, context, dtype_bytes)
                attainable, bound = roofline(flops / nbytes, peak_flops, bandwidth)
                result[kv_heads][batch, context] = (flops / attainable, bound)
    return result


def regimes_by_bytes_and_flops(config, kv_heads_list, batches, contexts, peak_flops, bandwidth, dtype_bytes=2):
    """The weights' and the K/V cache's share worked out once per head count, the time as max(F/P, B/W)."""
    _check_heads(config, kv_heads_list)
    hidden, layers, d = config["hidden_size"], config["num_layers"], config["head_dim"]
    result = {}
    for h in kv_heads_list:
        params = (layers * hidden * ((2 * config["num_heads"] + 2 * h) * d + 3 * config["intermediate_size"])
                  + config["vocab_size"] * hidden)
        per_token_flops, per_cached_bytes = 4 * layers * config["num_heads"] * d, 2 * layers * h * d * dtype_bytes
        grid = result[h] = {}
        for b, n in itertools.product(batches, contexts):
            flops = b * (2 * params + per_token_flops * n)
            nbytes = params * dtype_bytes + b * n * per_cached_bytes
            _, bound = roofline(flops / nbytes, peak_flops, bandwidth)
            grid[b, n] = (flops / min(peak_flops, flops / nbytes * bandwidth), bound)
    return result


def regimes_derived_head_dim(config, *args):
    return regimes_nested_loops({**config, "head_dim": config["hidden_size"] // config["num_heads"]}, *args)


def regimes_writing_config(config, kv_heads_list, *args):
    result = {}
    for h in kv_heads_list:
        config["num_kv_heads"] = h  # the caller's dict now says MQA
        result.update(regimes_nested_loops(config, [h], *args))
    return result


def regimes_with_labkit_costs(config, kv_heads_list, batches, contexts, peak_flops, bandwidth, dtype_bytes=2):
    """labkit_course.roofline's decode_cost on a ModelConfig rebuilt from the dict: the pricing the exercise asks
    for."""
    _check_heads(config, kv_heads_list)

    def step(kv_heads, batch, context):
        shape = ModelConfig(architecture="llama", **{**config, "num_kv_heads": kv_heads}, max_position_embeddings=8192,
                            rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True)
        cost = decode_cost(shape, batch, context, dtype_bytes)
        attainable, bound = roofline(cost.intensity, peak_flops, bandwidth)
        return cost.flops / attainable, bound

    return {h: {(b, n): step(h, b, n) for b, n in itertools.product(batches, contexts)} for h in kv_heads_list}


def regimes_from_labkit_parts(config, kv_heads_list, batches, contexts, peak_flops, bandwidth, dtype_bytes=2):
    """The pricing assembled from labkit's per-layer parameter count and K/V bytes per token."""
    _check_heads(config, kv_heads_list)
    result = {}
    for h in kv_heads_list:
        shape = ModelConfig(architecture="llama", **{**config, "num_kv_heads": h}, max_position_embeddings=1,
                            rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True)
        params = shape.num_layers * _linear_params_per_layer(shape) + shape.vocab_size * shape.hidden_size
        grid = result[h] = {}
        for b, n in itertools.product(batches, contexts):
            flops = b * (2 * params + 4 * shape.num_layers * shape.num_heads * shape.head_dim * n)
            nbytes = params * dtype_bytes + b * n * shape.kv_cache_bytes_per_token(dtype_bytes)
            attainable, bound = roofline(flops / nbytes, peak_flops, bandwidth)
            grid[b, n] = (flops / attainable, bound)
    return result


def regimes_refusing_only_zero(config, kv_heads_list, *args):
    """Guards only the zero division: 9 % -3 == 0, so -3 K/V heads are priced."""
    if any(h == 0 or config["num_heads"] % h for h in kv_heads_list):
        raise ValueError("K/V heads must divide the query heads")
    return regimes_with(check=False)(config, kv_heads_list, *args)


def regimes_half_right(config, kv_heads_list, batches, contexts, peak_flops, bandwidth, dtype_bytes=2, *,
                       check=True, same_heads=False, time=None, dtype=None, **step_mistake):
    """The nested loops with one step switched to what a student half-remembers."""
    if check:
        _check_heads(config, kv_heads_list)
    result = {}
    for kv_heads in kv_heads_list:
        priced = config["num_kv_heads"] if same_heads else kv_heads
        named = {"kv": priced, "config": config["num_kv_heads"]}  # which head count a mistaken step uses
        mistake = {key: named.get(value, value) for key, value in step_mistake.items()}
        result[kv_heads] = {}
        for batch, context in itertools.product(batches, contexts):
            flops, nbytes = _decode_step(config, priced, batch, context, dtype or dtype_bytes, **mistake)
            attainable, bound = roofline(flops / nbytes, peak_flops, bandwidth)
            seconds = time(flops, nbytes, peak_flops, bandwidth) if time else flops / attainable
            result[kv_heads][batch, context] = (seconds, bound)
    return result


def regimes_with(**mistake):
    return lambda *args: regimes_half_right(*args, **mistake)


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
                           tensors=2, layers=True, whole_blocks=True, seq_blocks=math.ceil, pool_blocks=math.floor,
                           derive_head_dim=False):
    """The arithmetic with one step of it switched to what a student half-remembers."""
    head_dim = config["hidden_size"] // config["num_heads"] if derive_head_dim else config["head_dim"]
    per_token = tensors * (config["num_layers"] if layers else 1) * config[heads] * head_dim * dtype_bytes
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


def pool_in_float32(weight, num_kv_heads, new_num_kv_heads):
    """Averages in float32 and keeps it: a bf16 checkpoint's pooled weight comes back float32."""
    return pool_reshape_mean(weight.float(), num_kv_heads, new_num_kv_heads)


def pool_returning_the_weight(weight, num_kv_heads, new_num_kv_heads):
    if num_kv_heads == new_num_kv_heads:
        return weight
    return pool_reshape_mean(weight, num_kv_heads, new_num_kv_heads)


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


def perplexity_log_of_softmax_in_float64(logits, token_ids):
    """log(softmax) in float64: exp(-200) survives, exp(-1000) is 0."""
    probs = torch.softmax(logits.double(), dim=-1)
    return float(torch.exp(-torch.log(probs[:-1].gather(1, token_ids[1:, None])).mean()))


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
    Right("decode_regimes", "nested loops over the grid", regimes_nested_loops),
    Right("decode_regimes", "bytes and FLOPs per head count, max of the two times", regimes_by_bytes_and_flops),
    Right("kv_capacity", "closed-form arithmetic", kv_capacity_arithmetic),
    Right("kv_capacity", "allocate blocks in a loop", kv_capacity_by_allocation),
    Right("pool_kv_heads", "reshape and mean", pool_reshape_mean),
    Right("pool_kv_heads", "a loop over groups", pool_loop),
    Right("pool_kv_heads", "an averaging matrix", pool_by_matrix),
    Right("perplexity", "log_softmax and gather", perplexity_log_softmax),
    Right("perplexity", "logsumexp position by position", perplexity_logsumexp_loop),
]

WRONG = [
    Wrong("decode_regimes", "every head count priced at the config's", regimes_with(same_heads=True),
          "with its own num_kv_heads"),
    Wrong("decode_regimes", "k_proj and v_proj keep their size", regimes_with(weight_kv_heads="config"),
          "shrink k_proj and v_proj"),
    Wrong("decode_regimes", "attention FLOPs per K/V head", regimes_with(attention_heads="kv"),
          "attention FLOPs count num_heads"),
    Wrong("decode_regimes", "float32 bytes whatever dtype_bytes", regimes_with(dtype=4), "not float32's 4"),
    Wrong("decode_regimes", "weights read once per sequence",
          regimes_with(weights_per_sequence=True),
          "the batch shares one read of the weights"),
    Wrong("decode_regimes", "time from the bytes only", regimes_with(time=lambda f, b, p, w: b / w),
          "not limited by its bytes"),
    Wrong("decode_regimes", "time from the FLOPs only", regimes_with(time=lambda f, b, p, w: f / p),
          "longer than flops / peak"),
    Wrong("decode_regimes", "compute and memory times added", regimes_with(time=lambda f, b, p, w: f / p + b / w),
          "not flops / peak + bytes / bandwidth"),
    Wrong("decode_regimes", "no check that K/V heads divide the query heads", regimes_with(check=False),
          "must divide num_heads"),
    Wrong("decode_regimes", "bound spelled differently",
          lambda *a: {h: {key: (t, f"{b}-bound") for key, (t, b) in grid.items()}
                      for h, grid in regimes_nested_loops(*a).items()},
          "\"memory\" or \"compute\""),
    Wrong("decode_regimes", "imports the grader's reference", lambda *a: reference_decode_regimes(*a),
          "`reference_decode_regimes`", calls="labkit_course.grading.labs.lab12.reference_decode_regimes"),
    Wrong("decode_regimes", "head_dim derived as hidden_size / num_heads", regimes_derived_head_dim,
          "read head_dim from the config"),
    Wrong("decode_regimes", "writes each head count into the config", regimes_writing_config,
          "wrote into the config it was given"),
    Wrong("decode_regimes", "labkit's decode_cost on a rebuilt config", regimes_with_labkit_costs, "`decode_cost`",
          calls="labkit_course.roofline.decode_cost"),
    Wrong("decode_regimes", "labkit's parameter count and K/V bytes per token", regimes_from_labkit_parts,
          "`_linear_params_per_layer`", calls="labkit_course.roofline._linear_params_per_layer"),
    Wrong("decode_regimes", "refuses a zero K/V-head count but not a negative one", regimes_refusing_only_zero,
          "a count below 1"),
    Wrong("kv_capacity", "writes defaults into the config",
          lambda config, *a: kv_capacity_arithmetic(config, *a) if config.update(hidden_size=1) is None else None,
          "wrote into the config it was given"),
    Wrong("kv_capacity", "ignores dtype_bytes",
          lambda config, seq_len, memory, dtype_bytes, block: kv_capacity_arithmetic(config, seq_len, memory, 1, block),
          "multiply by dtype_bytes"),
    Wrong("kv_capacity", "query heads instead of KV heads", kv_with(heads="num_heads"), "use num_kv_heads"),
    Wrong("kv_capacity", "head_dim derived as hidden_size / num_heads", kv_with(derive_head_dim=True),
          "read head_dim from the config"),
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
          calls="labkit_course.grading.labs.lab12.reference_kv_capacity"),
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
    Wrong("pool_kv_heads", "returns float64", lambda *a: pool_reshape_mean(*a).double(), "return the weight's dtype"),
    Wrong("pool_kv_heads", "averages in float32 and returns it", pool_in_float32,
          "return the weight's dtype (torch.bfloat16)"),
    Wrong("pool_kv_heads", "returns the weight itself when nothing is pooled", pool_returning_the_weight,
          "return a new tensor"),
    Wrong("perplexity", "log of softmax in float64", perplexity_log_of_softmax_in_float64, "use log_softmax"),
    Wrong("perplexity", "subtracts the logsumexp in place",
          lambda logits, ids: perplexity_log_softmax(logits.sub_(logits.logsumexp(-1, keepdim=True)), ids),
          "changed the logits"),
    Wrong("perplexity", "returns a 0-d tensor", lambda *a: torch.tensor(perplexity_log_softmax(*a)),
          "not a tensor of shape ()"),
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
