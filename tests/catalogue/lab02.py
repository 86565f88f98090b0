"""Lab 02: the KV-cache size and a matmul's arithmetic intensity."""

import math

from catalogue import Right, Wrong
from labkit_course.grading.labs.lab02 import (
    _component_counts,
    _critical_batch,
    _decode_cost,
    _intensity,
    _kv_bytes,
    _roofline,
)


def kv_product(num_layers, num_kv_heads, head_dim, seq_len, batch_size=1, dtype_bytes=2):
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * dtype_bytes


def kv_per_token_then_scale(num_layers, num_kv_heads, head_dim, seq_len, batch_size=1, dtype_bytes=2):
    per_token_per_layer = 2 * num_kv_heads * head_dim * dtype_bytes  # one K row and one V row
    return math.prod((per_token_per_layer, num_layers, seq_len, batch_size))


def kv(**drop):
    """A kv_cache_bytes that leaves out (or replaces) some factors."""
    def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size=1, dtype_bytes=2):
        factors = dict(two=2, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_len=seq_len,
                       batch_size=batch_size, dtype_bytes=dtype_bytes)
        factors.update(drop)
        return math.prod(factors.values())
    return kv_cache_bytes


def intensity(m, k, n, dtype_bytes=2):
    return 2 * m * k * n / ((m * k + k * n + m * n) * dtype_bytes)


def intensity_in_steps(m, k, n, dtype_bytes=2):
    flops = 2 * m * k * n
    bytes_moved = dtype_bytes * (m * k) + dtype_bytes * (k * n) + dtype_bytes * (m * n)
    return flops / bytes_moved


RIGHT = [
    Right("kv_cache_bytes", "one product", kv_product),
    Right("kv_cache_bytes", "bytes per token per layer, then scaled", kv_per_token_then_scale),
    Right("matmul_intensity", "one expression", intensity),
    Right("matmul_intensity", "FLOPs and bytes in steps", intensity_in_steps),
]

WRONG = [
    Wrong("kv_cache_bytes", "caches only K (or only V)", kv(two=1), "K and V are both cached"),
    Wrong("kv_cache_bytes", "one layer's cache", kv(num_layers=1), "every layer"),
    Wrong("kv_cache_bytes", "forgot the KV heads", kv(num_kv_heads=1),
          "multiply by num_kv_heads"),
    Wrong("kv_cache_bytes", "forgot the batch", kv(batch_size=1), "each sequence in the batch"),
    Wrong("kv_cache_bytes", "counted elements, not bytes", kv(dtype_bytes=1), "multiply by dtype_bytes for bytes"),
    Wrong("kv_cache_bytes", "hard-coded fp16 (ignores dtype_bytes)", kv(dtype_bytes=2), "dtype_bytes was ignored"),
    Wrong("kv_cache_bytes", "one token's cache", kv(seq_len=1), "one K and one V row per token"),
    Wrong("kv_cache_bytes", "returned KiB", lambda **c: kv_product(**c) / 1024, "not KiB/MiB/GiB"),
    Wrong("kv_cache_bytes", "returned GiB", lambda **c: kv_product(**c) / 2**30, "not KiB/MiB/GiB"),
    Wrong("kv_cache_bytes", "returned GB", lambda **c: kv_product(**c) / 1e9, "not KiB/MiB/GiB"),
    Wrong("kv_cache_bytes", "returned bits", lambda **c: kv_product(**c) * 8, "not bits"),
    Wrong("kv_cache_bytes", "returned a float", lambda **c: float(kv_product(**c)), "return an int"),
    Wrong("kv_cache_bytes", "returned a string", lambda **c: f"{kv_product(**c)} bytes", "return a number"),
    Wrong("kv_cache_bytes", "an extra token", lambda **c: kv_product(**{**c, "seq_len": c["seq_len"] + 1}),
          "expected 2 x L"),
    Wrong("kv_cache_bytes", "imports the grader's formula", lambda **c: _kv_bytes(*c.values()),
          "`_kv_bytes`", calls="labkit_course.grading.labs.lab02._kv_bytes"),
    Wrong("matmul_intensity", "one FLOP per multiply-add", lambda m, k, n, b=2: intensity(m, k, n, b) / 2, "2 FLOPs"),
    Wrong("matmul_intensity", "divided by elements, not bytes", lambda m, k, n, b=2: intensity(m, k, n, 1),
          "divide by bytes"),
    Wrong("matmul_intensity", "hard-coded 2 bytes", lambda m, k, n, b=2: intensity(m, k, n, 2),
          "dtype_bytes was ignored"),
    Wrong("matmul_intensity", "forgot writing the output", lambda m, k, n, b=2: 2 * m * k * n / ((m * k + k * n) * b),
          "output [m, n]"),
    Wrong("matmul_intensity", "forgot reading the input", lambda m, k, n, b=2: 2 * m * k * n / ((k * n + m * n) * b),
          "input [m, k]"),
    Wrong("matmul_intensity", "bytes per FLOP", lambda m, k, n, b=2: 1 / intensity(m, k, n, b), "bytes per FLOP"),
    Wrong("matmul_intensity", "integer division", lambda m, k, n, b=2: 2 * m * k * n // ((m * k + k * n + m * n) * b),
          "integer division"),
    Wrong("matmul_intensity", "returned the FLOP count", lambda m, k, n, b=2: 2 * m * k * n, "expected 2mkn"),
    Wrong("matmul_intensity", "imports the grader's formula", lambda m, k, n, b=2: _intensity(m, k, n, b),
          "`_intensity`", calls="labkit_course.grading.labs.lab02._intensity"),
]


# --- parameter_counts -------------------------------------------------------------------------------------

def counts_by_matrix(cfg):
    d, layers, head_dim = cfg["hidden_size"], cfg["num_layers"], cfg["head_dim"]
    q_width, kv_width = cfg["num_heads"] * head_dim, cfg["num_kv_heads"] * head_dim
    ffn = cfg["intermediate_size"]
    qk_norms = 2 * head_dim if cfg.get("qk_norm", False) else 0
    return {"embedding": cfg["vocab_size"] * d, "q": layers * d * q_width, "k": layers * d * kv_width,
            "v": layers * d * kv_width, "o": layers * q_width * d, "gate": layers * d * ffn,
            "up": layers * d * ffn, "down": layers * ffn * d, "norms": layers * (2 * d + qk_norms) + d,
            "lm_head": 0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * d}


def counts_layer_by_layer(cfg):
    """Walks the layers one by one, adding each weight's shape, as a model's state dict would list them."""
    d, head_dim = cfg["hidden_size"], cfg["head_dim"]
    shapes = {"q": (d, cfg["num_heads"] * head_dim), "k": (d, cfg["num_kv_heads"] * head_dim),
              "v": (d, cfg["num_kv_heads"] * head_dim), "o": (cfg["num_heads"] * head_dim, d),
              "gate": (d, cfg["intermediate_size"]), "up": (d, cfg["intermediate_size"]),
              "down": (cfg["intermediate_size"], d)}
    counts = {"embedding": cfg["vocab_size"] * d, **dict.fromkeys(shapes, 0), "norms": d,
              "lm_head": 0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * d}
    for _ in range(cfg["num_layers"]):
        for name, (rows, cols) in shapes.items():
            counts[name] += rows * cols
        counts["norms"] += 2 * d + (2 * head_dim if cfg.get("qk_norm") else 0)
    return counts


def counts_with(**changes):
    """A parameter_counts that gets some components wrong (each change: cfg -> value)."""
    def parameter_counts(cfg):
        counts = counts_by_matrix(cfg)
        counts.update({key: change(cfg) for key, change in changes.items()})
        return counts
    return parameter_counts


def kv_width_h(cfg):
    return cfg["num_layers"] * cfg["hidden_size"] * cfg["num_heads"] * cfg["head_dim"]


def q_square(cfg):
    return cfg["num_layers"] * cfg["hidden_size"] ** 2


def mlp_4h(cfg):
    return cfg["num_layers"] * cfg["hidden_size"] * 4 * cfg["hidden_size"]


def untied_always(cfg):
    return cfg["vocab_size"] * cfg["hidden_size"]


def norms_without_final(cfg):
    return counts_by_matrix(cfg)["norms"] - cfg["hidden_size"]


def norms_without_qk(cfg):
    return cfg["num_layers"] * 2 * cfg["hidden_size"] + cfg["hidden_size"]


def k_one_layer(cfg):
    return cfg["hidden_size"] * cfg["num_kv_heads"] * cfg["head_dim"]


# --- decode_intensity ---------------------------------------------------------------------------------------

def decode_cost(cfg, num_params, contexts, dtype_bytes=2):
    if not contexts:
        raise ValueError("a decode step needs at least one sequence")
    if min(contexts) < 0:
        raise ValueError(f"contexts must be >= 0, got {contexts}")
    per_token_kv = 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["head_dim"] * dtype_bytes
    per_token_attention = 4 * cfg["num_layers"] * cfg["num_heads"] * cfg["head_dim"]
    flops = sum(2 * num_params + per_token_attention * s for s in contexts)
    weight_bytes, kv_bytes = num_params * dtype_bytes, sum(per_token_kv * s for s in contexts)
    return {"flops": flops, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "intensity": flops / (weight_bytes + kv_bytes)}


def decode_cost_per_sequence(cfg, num_params, contexts, dtype_bytes=2):
    """Sequence by sequence, as a scheduler would see its batch."""
    if len(contexts) == 0 or any(s < 0 for s in contexts):
        raise ValueError("need one or more sequences, each with a context >= 0")
    L, H, H_kv, D = cfg["num_layers"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    flops = kv_bytes = 0
    for s in contexts:
        flops += 2 * num_params + 2 * 2 * L * H * D * s
        kv_bytes += s * L * 2 * H_kv * D * dtype_bytes
    weight_bytes = num_params * dtype_bytes
    return {"flops": flops, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "intensity": flops / (weight_bytes + kv_bytes)}


def decode_with(**changes):
    """A decode_intensity that gets some parts wrong (each change: (cfg, P, contexts, b) -> value)."""
    def decode_intensity(cfg, num_params, contexts, dtype_bytes=2):
        cost = decode_cost(cfg, num_params, contexts, dtype_bytes)
        cost.update({key: change(cfg, num_params, contexts, dtype_bytes) for key, change in changes.items()})
        cost["intensity"] = cost["flops"] / (cost["weight_bytes"] + cost["kv_bytes"])
        return cost
    return decode_intensity


def decode_no_checks(cfg, num_params, contexts, dtype_bytes=2):
    L, H, H_kv, D = cfg["num_layers"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    flops = 2 * num_params * len(contexts) + 4 * L * H * D * sum(contexts)
    weight_bytes, kv_bytes = num_params * dtype_bytes, 2 * L * H_kv * D * dtype_bytes * sum(contexts)
    return {"flops": flops, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "intensity": flops / (weight_bytes + kv_bytes) if contexts else 0.0}


# --- roofline and critical_batch ----------------------------------------------------------------------------

def roofline_min(intensity, peak_flops, bandwidth):
    if peak_flops <= 0 or bandwidth <= 0 or intensity < 0:
        raise ValueError("peak and bandwidth must be positive, the intensity non-negative")
    attainable = min(peak_flops, intensity * bandwidth)
    return attainable, "compute" if intensity >= peak_flops / bandwidth else "memory"


def roofline_times(intensity, peak_flops, bandwidth):
    """One byte's worth of work: the slower of computing it and moving it sets the pace."""
    if not (peak_flops > 0 and bandwidth > 0 and intensity >= 0):
        raise ValueError(f"bad machine or intensity: {peak_flops}, {bandwidth}, {intensity}")
    compute_time, memory_time = intensity / peak_flops, 1 / bandwidth
    if memory_time > compute_time:
        return intensity / memory_time, "memory"
    return peak_flops, "compute"


def roofline_with(attainable=None, bound=None, validate=True):
    def roofline(intensity, peak_flops, bandwidth):
        if validate and (peak_flops <= 0 or bandwidth <= 0 or intensity < 0):
            raise ValueError("bad arguments")
        ridge = peak_flops / bandwidth
        value = (attainable or (lambda i, p, w: min(p, i * w)))(intensity, peak_flops, bandwidth)
        label = (bound or (lambda i, r: "compute" if i >= r else "memory"))(intensity, ridge)
        return value, label
    return roofline


def critical_batch_search(cfg, num_params, context, peak_flops, bandwidth, dtype_bytes=2, max_batch=4096):
    """Closed form: B F / (W + B K) >= ridge  <=>  B (F - ridge K) >= ridge W."""
    one = decode_cost(cfg, num_params, [context], dtype_bytes)
    ridge = peak_flops / bandwidth
    spare = one["flops"] - ridge * one["kv_bytes"]
    if spare <= 0:
        return None
    batch = max(1, math.ceil(ridge * one["weight_bytes"] / spare))
    while batch > 1 and decode_cost(cfg, num_params, [context], dtype_bytes)["flops"] * (batch - 1) / (
            one["weight_bytes"] + (batch - 1) * one["kv_bytes"]) >= ridge:  # float rounding of the ceiling
        batch -= 1
    return batch if batch <= max_batch else None


def critical_batch_bisect(cfg, num_params, context, peak_flops, bandwidth, dtype_bytes=2, max_batch=4096):
    """The intensity only grows with the batch: bisect for the first batch at or above the ridge."""
    def compute_bound(batch):
        cost = decode_cost_per_sequence(cfg, num_params, [context] * batch, dtype_bytes)
        return cost["intensity"] >= peak_flops / bandwidth

    if not compute_bound(max_batch):
        return None
    low, high = 1, max_batch
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle + 1, high)
    return low


def critical_batch_with(compare=lambda intensity, ridge: intensity >= ridge, cost=decode_cost, none=None,
                        limit=None):
    def critical_batch(cfg, num_params, context, peak_flops, bandwidth, dtype_bytes=2, max_batch=4096):
        for batch in range(1, (limit or max_batch) + 1):
            if compare(cost(cfg, num_params, [context] * batch, dtype_bytes)["intensity"], peak_flops / bandwidth):
                return batch
            if batch > 600:  # the intensity has long stopped growing (keeps the catalogue fast)
                break
        return none
    return critical_batch


def decode_refusing_zero(cfg, num_params, contexts, dtype_bytes=2):
    if not contexts or min(contexts) <= 0:
        raise ValueError("every context must be positive")
    return decode_cost(cfg, num_params, contexts, dtype_bytes)


def roofline_refusing_zero(intensity, peak_flops, bandwidth):
    if intensity <= 0:
        raise ValueError("the intensity must be positive")
    return roofline_min(intensity, peak_flops, bandwidth)


def critical_batch_before_max(cfg, num_params, context, peak_flops, bandwidth, dtype_bytes=2, max_batch=4096):
    one = decode_cost(cfg, num_params, [context], dtype_bytes)
    for batch in range(1, max_batch):
        if batch * one["flops"] / (one["weight_bytes"] + batch * one["kv_bytes"]) >= peak_flops / bandwidth:
            return batch
    return None


def critical_batch_none_at_zero(cfg, num_params, context, *args):
    return None if context == 0 else critical_batch_search(cfg, num_params, context, *args)


def kv_with_query_heads(cfg, num_params, contexts, dtype_bytes=2):
    return decode_cost({**cfg, "num_kv_heads": cfg["num_heads"]}, num_params, contexts, dtype_bytes)


def weights_only_cost(cfg, num_params, contexts, dtype_bytes=2):
    flops = 2 * num_params * len(contexts)
    return {"intensity": flops / (num_params * dtype_bytes)}


def critical_batch_last_memory_bound(*args):
    batch = critical_batch_search(*args)
    return None if batch is None else batch - 1


RIGHT += [
    Right("parameter_counts", "one formula per matrix", counts_by_matrix),
    Right("parameter_counts", "layer by layer over the weight shapes", counts_layer_by_layer),
    Right("decode_intensity", "sums over the batch", decode_cost),
    Right("decode_intensity", "sequence by sequence", decode_cost_per_sequence),
    Right("roofline", "min of the two ceilings", roofline_min),
    Right("roofline", "compare the two times", roofline_times),
    Right("critical_batch", "linear search", critical_batch_search),
    Right("critical_batch", "bisection on a monotone intensity", critical_batch_bisect),
]

WRONG += [
    Wrong("parameter_counts", "K and V sized with the query heads (no GQA)", counts_with(k=kv_width_h, v=kv_width_h),
          "num_kv_heads heads (GQA)"),
    Wrong("parameter_counts", "q is d x d (seed 001's H in place of heads x head_dim)", counts_with(q=q_square),
          "need not equal hidden_size"),
    Wrong("parameter_counts", "the classic 4H MLP (seed 001's [4H]*2)",
          counts_with(gate=mlp_4h, up=mlp_4h, down=mlp_4h), "4 x hidden_size"),
    Wrong("parameter_counts", "a two-matrix MLP", counts_with(gate=lambda cfg: 0), "three matrices"),
    Wrong("parameter_counts", "counts a tied head twice", counts_with(lm_head=untied_always), "tied LM head"),
    Wrong("parameter_counts", "never counts the head", counts_with(lm_head=lambda cfg: 0), "its own vocab_size"),
    Wrong("parameter_counts", "forgot the final norm", counts_with(norms=norms_without_final), "final norm"),
    Wrong("parameter_counts", "forgot Qwen3-style q/k norms", counts_with(norms=norms_without_qk), "qk_norm"),
    Wrong("parameter_counts", "one layer's K", counts_with(k=k_one_layer), "one layer's count"),
    Wrong("parameter_counts", "requires the optional qk_norm key",
          lambda cfg: {**counts_by_matrix(cfg), "norms": counts_by_matrix(cfg)["norms"] + 0 * cfg["qk_norm"]},
          "KeyError"),
    Wrong("parameter_counts", "the total only", lambda cfg: sum(counts_by_matrix(cfg).values()),
          "return a dict of counts"),
    Wrong("parameter_counts", "HF-style key names",
          lambda cfg: {f"{k}_proj": v for k, v in counts_by_matrix(cfg).items()},
          "the keys must be exactly"),
    Wrong("parameter_counts", "counts as floats", lambda cfg: {k: float(v) for k, v in counts_by_matrix(cfg).items()},
          "should be an int"),
    Wrong("parameter_counts", "imports the grader's counter",
          lambda cfg: _component_counts(cfg), "`_component_counts`",
          calls="labkit_course.grading.labs.lab02._component_counts"),
    Wrong("decode_intensity", "weights read once per sequence",
          decode_with(weight_bytes=lambda c, p, s, b: p * b * len(s)), "once per sequence"),
    Wrong("decode_intensity", "the erratum: no K/V reads", decode_with(kv_bytes=lambda c, p, s, b: 0),
          "KV cache was not counted"),
    Wrong("decode_intensity", "K/V bytes with the query heads",
          decode_with(kv_bytes=lambda c, p, s, b: 2 * c["num_layers"] * c["num_heads"] * c["head_dim"] * b * sum(s)),
          "counted with num_heads"),
    Wrong("decode_intensity", "only K is read",
          decode_with(kv_bytes=lambda c, p, s, b: c["num_layers"] * c["num_kv_heads"] * c["head_dim"] * b * sum(s)),
          "only K (or only V)"),
    Wrong("decode_intensity", "every sequence at the longest context",
          decode_with(kv_bytes=lambda c, p, s, b: 2 * c["num_layers"] * c["num_kv_heads"] * c["head_dim"] * b
                      * max(s) * len(s)), "the longest context"),
    Wrong("decode_intensity", "no attention FLOPs", decode_with(flops=lambda c, p, s, b: 2 * p * len(s)),
          "attention's FLOPs were left out"),
    Wrong("decode_intensity", "attention FLOPs per KV head",
          decode_with(flops=lambda c, p, s, b: 2 * p * len(s) + 4 * c["num_layers"] * c["num_kv_heads"]
                      * c["head_dim"] * sum(s)), "counted per KV head"),
    Wrong("decode_intensity", "2 attention FLOPs per cached token and head dimension",
          decode_with(flops=lambda c, p, s, b: 2 * p * len(s) + 2 * c["num_layers"] * c["num_heads"]
                      * c["head_dim"] * sum(s)), "counted 2 per cached token"),
    Wrong("decode_intensity", "refuses a context of 0", decode_refusing_zero, "a context of 0 is a sequence"),
    Wrong("roofline", "refuses an intensity of 0", roofline_refusing_zero, "only a negative intensity"),
    Wrong("critical_batch", "never tries max_batch itself (range(1, max_batch))", critical_batch_before_max,
          "max_batch itself may be the answer"),
    Wrong("critical_batch", "None for a context of 0", critical_batch_none_at_zero, "a context of 0"),
    Wrong("critical_batch", "K/V bytes with the query heads", critical_batch_with(cost=kv_with_query_heads),
          "K/V bytes counted with num_heads"),
    Wrong("decode_intensity", "accepts an empty batch", decode_no_checks, "was accepted"),
    Wrong("decode_intensity", "NaN everywhere (NaN compares unequal to nothing)",
          decode_with(**{key: lambda c, p, s, b: math.nan for key in ("flops", "weight_bytes", "kv_bytes")}),
          "finite number"),
    Wrong("decode_intensity", "imports the grader's formula", lambda c, p, s, b=2: _decode_cost(c, p, s, b),
          "`_decode_cost`", calls="labkit_course.grading.labs.lab02._decode_cost"),
    Wrong("roofline", "max instead of min", roofline_with(attainable=lambda i, p, w: max(p, i * w)), "LOWER"),
    Wrong("roofline", "no compute ceiling", roofline_with(attainable=lambda i, p, w: i * w), "caps it"),
    Wrong("roofline", "always the peak", roofline_with(attainable=lambda i, p, w: p), "memory limits it"),
    Wrong("roofline", "NaN attainable FLOP/s", roofline_with(attainable=lambda i, p, w: math.nan), "finite number"),
    Wrong("roofline", "divides by the bandwidth", roofline_with(attainable=lambda i, p, w: min(p, i / w)), "TIMES"),
    Wrong("roofline", "bounds swapped", roofline_with(bound=lambda i, r: "memory" if i >= r else "compute"),
          "not compute-bound"),
    Wrong("roofline", "ridge counted as memory-bound",
          roofline_with(bound=lambda i, r: "compute" if i > r else "memory"),
          "ridge point itself"),
    Wrong("roofline", "intensity compared with the peak, not the ridge",
          roofline_with(bound=lambda i, r: "memory"), "-bound, not memory-bound"),
    Wrong("roofline", "no argument checks", roofline_with(validate=False), "raise a ValueError"),
    Wrong("roofline", "imports the grader's roofline", lambda i, p, w: _roofline(i, p, w), "`_roofline`",
          calls="labkit_course.grading.labs.lab02._roofline"),
    Wrong("critical_batch", "no attention FLOPs", critical_batch_with(cost=decode_with(
        flops=lambda c, p, s, b: 2 * p * len(s))), "attention's FLOPs were left out"),
    Wrong("critical_batch", "attention FLOPs per KV head", critical_batch_with(cost=decode_with(
        flops=lambda c, p, s, b: 2 * p * len(s) + 4 * c["num_layers"] * c["num_kv_heads"] * c["head_dim"] * sum(s))),
          "not per KV head"),
    Wrong("critical_batch", "2 attention FLOPs per cached token and head dimension", critical_batch_with(
        cost=decode_with(flops=lambda c, p, s, b: 2 * p * len(s) + 2 * c["num_layers"] * c["num_heads"]
                         * c["head_dim"] * sum(s))), "attention FLOPs were undercounted"),
    Wrong("critical_batch", "the erratum: weights only", critical_batch_with(cost=weights_only_cost),
          "K/V reads were left out"),
    Wrong("critical_batch", "strictly above the ridge", critical_batch_with(compare=lambda i, r: i > r),
          "one too many"),
    Wrong("critical_batch", "the last memory-bound batch", critical_batch_last_memory_bound, "largest memory-bound"),
    Wrong("critical_batch", "0 for never", critical_batch_with(none=0), "return None"),
    Wrong("critical_batch", "max_batch for never", critical_batch_with(none=4096), "return None"),
    Wrong("critical_batch", "ignores max_batch", critical_batch_with(limit=5000), "above max_batch"),
    Wrong("critical_batch", "imports the grader's search", lambda *a: _critical_batch(*a), "`_critical_batch`",
          calls="labkit_course.grading.labs.lab02._critical_batch"),
]
