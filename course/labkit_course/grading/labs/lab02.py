"""Lab 02: memory and arithmetic-intensity formulas. Graders try fresh configurations and name the
factor a wrong formula dropped."""

import functools
import math

from labkit_course.grading import ExerciseFailed, exercise, expect_value_error, raised_type, require
from labkit_course.grading.core import naming, seeded_random

_CONFIGS = [  # (layers, kv_heads, head_dim, seq_len, batch, dtype_bytes), each factor distinct
    (30, 3, 64, 777, 5, 4),
    (32, 8, 128, 2048, 3, 2),
    (7, 5, 96, 33, 11, 1),
]
_KV_ARGS = ("num_layers", "num_kv_heads", "head_dim", "seq_len", "batch_size", "dtype_bytes")  # in that order


def _kv_bytes(layers, kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * seq_len * batch * dtype_bytes


def _drawn_kv_configs() -> list[tuple[int, ...]]:
    """Fresh configurations at real models' scale: GQA's few KV heads, long contexts, int8/bf16/fp32 caches."""
    rng = seeded_random(201)
    return [(rng.randint(12, 80), rng.choice((1, 2, 4, 8, 16)), rng.choice((64, 80, 96, 128, 256)),
             rng.randint(1, 32_768), rng.randint(1, 64), rng.choice((1, 2, 4))) for _ in range(3)]


# A wrong formula is named only when it explains every configuration (so a hard-coded dtype size is not
# mistaken for a missing K/V factor on the one config where the two coincide).
_KV_MISTAKES = (
    (lambda c: _kv_bytes(*c) / 2, "K and V are both cached: multiply by 2"),
    (lambda c: _kv_bytes(*c) / c[0], "every layer keeps its own K and V: multiply by num_layers"),
    (lambda c: _kv_bytes(*c) / c[1], "only the KV heads are cached: multiply by num_kv_heads"),
    (lambda c: _kv_bytes(*c) / c[3], "one K and one V row per token: multiply by seq_len"),
    (lambda c: _kv_bytes(*c) / c[4], "each sequence in the batch has its own cache: multiply by batch_size"),
    (lambda c: _kv_bytes(*c) / c[5], "the count is of elements: multiply by dtype_bytes for bytes"),
    (lambda c: _kv_bytes(*c) / c[5] * 2, "dtype_bytes was ignored (2 is only the default): multiply by the "
                                         "dtype_bytes you are given"),
    (lambda c: _kv_bytes(*c) * 8, "return bytes, not bits"),
    *((lambda c, unit=unit: _kv_bytes(*c) / unit, "return bytes, not KiB/MiB/GiB/GB (convert only when printing)")
      for unit in (1024, 2**20, 2**30, 1e3, 1e6, 1e9)),
)


@exercise("02", "kv_cache_bytes", forbidden=("labkit_course.grading.labs.lab02._kv_bytes",))
def kv_cache_bytes(ns):
    fn = require(ns, "kv_cache_bytes")
    configs = [*_CONFIGS, *_drawn_kv_configs()]
    answers = []
    for cfg in configs:
        got = fn(**dict(zip(_KV_ARGS, cfg, strict=True)))
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseFailed(f"return a number of bytes, got {type(got).__name__}")
        answers.append(got)
    if all(got == _kv_bytes(*cfg) for got, cfg in zip(answers, configs, strict=True)):
        if any(isinstance(got, float) for got in answers):
            raise ExerciseFailed("bytes are a whole number: return an int (use // or int(), not /, and no "
                                 "float factors)")
        return "2 x layers x kv_heads x head_dim x seq_len x batch x bytes"
    for mistake, why in _KV_MISTAKES:
        if all(abs(got / mistake(cfg) - 1) < 1e-9 for got, cfg in zip(answers, configs, strict=True)):
            raise ExerciseFailed(why)
    got, cfg = next((got, cfg) for got, cfg in zip(answers, configs, strict=True) if got != _kv_bytes(*cfg))
    call = ", ".join(f"{name}={value}" for name, value in zip(_KV_ARGS, cfg, strict=True))
    raise ExerciseFailed(f"{got} bytes for kv_cache_bytes({call}), expected 2 x L x H_kv x D_h x S x B x bytes = "
                         f"{_kv_bytes(*cfg)}")


def _intensity(m, k, n, b):
    return 2 * m * k * n / ((m * k + k * n + m * n) * b)


_INTENSITY_MISTAKES = (
    (lambda m, k, n, b: _intensity(m, k, n, b) / 2, "each multiply-add is 2 FLOPs: a [m,k] @ [k,n] product "
                                                    "costs 2*m*k*n"),
    (lambda m, k, n, b: _intensity(m, k, n, b) * b, "divide by bytes, not elements: multiply the element count "
                                                    "by dtype_bytes"),
    (lambda m, k, n, b: _intensity(m, k, n, b) * b / 2, "dtype_bytes was ignored (2 is only the default): "
                                                        "use the dtype_bytes you are given"),
    (lambda m, k, n, b: 2 * m * k * n / ((m * k + k * n) * b), "the output [m, n] must be written to memory too: "
                                                               "count m*n elements"),
    (lambda m, k, n, b: 2 * m * k * n / ((k * n + m * n) * b), "the input [m, k] must be read from memory too: "
                                                               "count m*k elements"),
    (lambda m, k, n, b: 1 / _intensity(m, k, n, b), "that is bytes per FLOP: intensity is FLOPs divided by bytes"),
    (lambda m, k, n, b: 2 * m * k * n // ((m * k + k * n + m * n) * b), "integer division (//) threw away the "
                                                                         "fraction: use /"),
)
_SHAPES = ((1, 4096, 4096, 2), (512, 4096, 11008, 2), (7, 300, 50, 4))


def _drawn_shapes() -> list[tuple[int, int, int, int]]:
    """Fresh [m, k] @ [k, n] products as in a transformer: m tokens from one (decode) to thousands (prefill)
    against weight matrices a multiple of 64 wide, in int8, bf16 or fp32."""
    rng = seeded_random(202)
    return [(rng.choice((1, rng.randint(2, 64), rng.randint(65, 8192))), 64 * rng.randint(8, 256),
             64 * rng.randint(8, 256), rng.choice((1, 2, 4))) for _ in range(3)]


@exercise("02", "matmul_intensity", forbidden=("labkit_course.grading.labs.lab02._intensity",))
def matmul_intensity(ns):
    fn = require(ns, "matmul_intensity")
    shapes = [*_SHAPES, *_drawn_shapes()]
    answers = []
    for shape in shapes:
        got = fn(*shape)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseFailed(f"return a number (FLOPs per byte), got {type(got).__name__}")
        answers.append(got)
    if all(abs(got / _intensity(*shape) - 1) < 1e-9 for got, shape in zip(answers, shapes, strict=True)):
        return "2mkn FLOPs over (mk + kn + mn) * bytes moved"
    for mistake, why in _INTENSITY_MISTAKES:
        if all(abs(got - mistake(*shape)) <= 1e-9 * abs(mistake(*shape))
               for got, shape in zip(answers, shapes, strict=True)):
            raise ExerciseFailed(why)
    got, (m, k, n, b) = next((got, shape) for got, shape in zip(answers, shapes, strict=True)
                             if abs(got / _intensity(*shape) - 1) >= 1e-9)
    raise ExerciseFailed(f"intensity({m}, {k}, {n}, {b}) = {got}, expected "
                         f"2mkn / ((mk + kn + mn) * bytes) = {_intensity(m, k, n, b):.4f}")


@exercise("02", "knowledge_check")
def knowledge_check(ns):
    import torch

    from labkit_course.grading.quiz import Choice, Number, grade_answers

    smol, _ = _smollm2_case()  # the one read of SmolLM2's file this process makes
    fp16, fp32 = torch.finfo(torch.float16).bits // 8, torch.finfo(torch.float32).bits // 8
    smol_mib = 2 * smol["num_layers"] * smol["num_kv_heads"] * smol["head_dim"] * 1024 * fp16 / 2**20
    return grade_answers(ns, {
        1: Number(smol_mib, "section 3's formula with SmolLM2's configuration", rel_tol=1e-3),
        2: Number(10 * 3.35e12 / 989e12, "'The roofline': 10 FLOP/byte is below the ridge, so memory sets the pace",
                  rel_tol=2e-2),
        3: Number(2 * fp32, "section 2 on Adam's two moments"),
        4: Choice("a", "'The KV cache is read too'"),
        5: Choice("b", "the paragraph after the KV-cache plots (GQA)"),
    })


# --- parameters per component, checked against the real GGUF's tensor shapes -----------------------------

COMPONENTS = ("embedding", "q", "k", "v", "o", "gate", "up", "down", "norms", "lm_head")
# GGUF tensor names (blk.N. prefix dropped) per component; SmolLM2's file stores the tied head once.
_GGUF_COMPONENT = {"token_embd": "embedding", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                   "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down", "output": "lm_head",
                   "attn_norm": "norms", "ffn_norm": "norms", "output_norm": "norms",
                   "attn_q_norm": "norms", "attn_k_norm": "norms"}


def gguf_component_counts(reader) -> dict[str, int]:
    """Parameters per component, summed from a GGUF file's tensor shapes (what the file really holds)."""
    import re

    counts = dict.fromkeys(COMPONENTS, 0)
    for tensor in reader.tensors:
        name = re.sub(r"^blk\.\d+\.", "", tensor.name).removesuffix(".weight")
        counts[_GGUF_COMPONENT[name]] += math.prod(int(n) for n in tensor.shape)
    return counts


def _component_counts(cfg: dict) -> dict[str, int]:
    d, layers, head_dim = cfg["hidden_size"], cfg["num_layers"], cfg["head_dim"]
    q_width, kv_width = cfg["num_heads"] * head_dim, cfg["num_kv_heads"] * head_dim
    mlp = d * cfg["intermediate_size"] * layers
    norms_per_layer = 2 * d + (2 * head_dim if cfg.get("qk_norm") else 0)
    return {"embedding": cfg["vocab_size"] * d, "q": layers * d * q_width, "k": layers * d * kv_width,
            "v": layers * d * kv_width, "o": layers * q_width * d, "gate": mlp, "up": mlp, "down": mlp,
            "norms": layers * norms_per_layer + d,
            "lm_head": 0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * d}


@functools.cache
def _smollm2_case():
    """SmolLM2's configuration (as the dict the exercise takes) and its GGUF's counts, from one read of the file."""
    import dataclasses

    from labkit.model.gguf_loader import config_from_gguf, open_gguf
    from labkit.registry import resolve_model_path

    path = resolve_model_path("smollm2")
    reader = open_gguf(path)
    smol = config_from_gguf(reader, path)
    cfg = {key: value for key, value in dataclasses.asdict(smol).items() if not isinstance(value, dict)}
    return {**cfg, "qk_norm": smol.qk_norm}, gguf_component_counts(reader)


_PARAM_CONFIGS = (  # fresh shapes, each breaking one shortcut: untied head, head_dim != d/heads, MHA, q/k norms
    dict(vocab_size=1000, hidden_size=96, intermediate_size=200, num_layers=3, num_heads=4, num_kv_heads=2,
         head_dim=32, tie_word_embeddings=False, qk_norm=False),
    dict(vocab_size=777, hidden_size=64, intermediate_size=176, num_layers=5, num_heads=8, num_kv_heads=8,
         head_dim=8, tie_word_embeddings=True, qk_norm=False),
    dict(vocab_size=513, hidden_size=48, intermediate_size=144, num_layers=2, num_heads=6, num_kv_heads=3,
         head_dim=16, tie_word_embeddings=False, qk_norm=True),
)


def _drawn_param_configs() -> list[dict]:
    """Fresh models of today's shapes: GQA groups, head_dim x num_heads that may differ from hidden_size, SwiGLU
    widths of 2-4 x hidden_size, tied or untied heads, with or without q/k norms."""
    rng = seeded_random(205)
    configs = []
    for _ in range(2):
        kv_heads, head_dim = rng.choice((2, 4, 8)), rng.choice((32, 64, 80, 128))
        heads = kv_heads * rng.choice((1, 2, 3, 4))
        hidden = heads * head_dim if rng.random() < 0.5 else 64 * rng.randint(8, 64)
        configs.append(dict(vocab_size=rng.randint(1_000, 160_000), hidden_size=hidden,
                            intermediate_size=64 * rng.randint(hidden // 32, hidden // 16),
                            num_layers=rng.randint(2, 40), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                            tie_word_embeddings=rng.random() < 0.5, qk_norm=rng.random() < 0.5))
    return configs


def _component_mistake(key: str, got: int, cfg: dict, right: int) -> str | None:
    """The misconception that explains a wrong count of one component, if a known one does."""
    d, layers, head_dim = cfg["hidden_size"], cfg["num_layers"], cfg["head_dim"]
    if got == right // layers and layers > 1:
        return f"'{key}' is one layer's count: every one of the num_layers layers has its own"
    if key in ("k", "v"):
        if got == layers * d * cfg["num_heads"] * head_dim:
            return f"'{key}' was sized with num_heads: K and V have only num_kv_heads heads (GQA)"
        if got == layers * d * d:
            return f"'{key}' was sized d x d: its width is num_kv_heads x head_dim"
    if key in ("q", "o") and got == layers * d * d:
        return f"'{key}' was sized d x d: its width is num_heads x head_dim, which need not equal hidden_size"
    if key in ("gate", "up", "down") and got == layers * d * 4 * d:
        return f"'{key}' used the classic 4 x hidden_size MLP width: use intermediate_size"
    if key == "gate" and got == 0:
        return "a SwiGLU MLP has three matrices: gate, up and down"
    if key == "lm_head":
        if cfg["tie_word_embeddings"] and got:
            return "a tied LM head reuses the embedding matrix: it adds no parameters (lm_head = 0)"
        if not cfg["tie_word_embeddings"] and not got:
            return "tie_word_embeddings is False: the LM head is its own vocab_size x hidden_size matrix"
    if key == "norms":
        qk = 2 * head_dim if cfg.get("qk_norm") else 0
        if got == right - d:
            return "'norms' left out the final norm after the last layer (hidden_size more)"
        if got == right - layers * d:
            return "'norms': each layer has two RMSNorms (before attention and before the MLP)"
        if qk and got == right - layers * qk:
            return "'norms': with qk_norm, each layer also has a query and a key norm of head_dim each"
        if qk and got == right - layers * qk + layers * head_dim * (cfg["num_heads"] + cfg["num_kv_heads"]):
            return "'norms': the q/k norms are one head_dim vector each, shared by all heads"
    return None


def _check_counts(got, cfg, expected, where):
    if not isinstance(got, dict):
        raise ExerciseFailed(f"return a dict of counts per component, got {type(got).__name__}")
    if set(got) != set(COMPONENTS):
        missing, extra = sorted(set(COMPONENTS) - set(got)), sorted(set(got) - set(COMPONENTS))
        raise ExerciseFailed(f"the keys must be exactly {list(COMPONENTS)} (missing {missing}, unexpected {extra})")
    for key in COMPONENTS:
        value = got[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ExerciseFailed(f"'{key}' should be an int (a count of parameters), got {type(value).__name__}")
    for key in COMPONENTS:
        if got[key] != expected[key]:
            why = _component_mistake(key, got[key], cfg, _component_counts(cfg)[key])
            raise ExerciseFailed(why or f"'{key}' is {got[key]:,} for {where}, expected {expected[key]:,}")


@exercise("02", "parameter_counts", forbidden=("labkit_course.grading.labs.lab02._component_counts",
                                               "labkit_course.grading.labs.lab02.gguf_component_counts"))
def parameter_counts(ns):
    fn = require(ns, "parameter_counts")
    for number, cfg in enumerate(_PARAM_CONFIGS):
        given = {key: value for key, value in cfg.items() if number or key != "qk_norm"}  # optional: may be absent
        _check_counts(fn(given), cfg, _component_counts(cfg), "a fresh configuration")
    smol, from_file = _smollm2_case()
    _check_counts(fn(dict(smol)), smol, from_file, "SmolLM2 (the GGUF file's tensor shapes)")
    for cfg in _drawn_param_configs():
        with naming(f"parameter_counts({cfg})"):
            _check_counts(fn(dict(cfg)), cfg, _component_counts(cfg), "this configuration")
    return "every component, GQA and a tied head included; SmolLM2's counts match its GGUF's tensors"


# --- a decode step's intensity with the KV-cache reads ----------------------------------------------------

def _decode_cost(cfg, num_params, contexts, b):
    layers, head_dim = cfg["num_layers"], cfg["head_dim"]
    cached = sum(contexts)
    flops = 2 * num_params * len(contexts) + 4 * layers * cfg["num_heads"] * head_dim * cached
    weight_bytes = num_params * b
    kv_bytes = 2 * layers * cfg["num_kv_heads"] * head_dim * b * cached
    return {"flops": flops, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "intensity": flops / (weight_bytes + kv_bytes)}


_DECODE_CASES = (  # (config, num_params, contexts, dtype_bytes): mixed lengths, GQA, one sequence, int8
    (dict(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64), 134_515_008, [1024] * 8 + [3, 77], 2),
    # num_heads = 2 x num_kv_heads, where 2 FLOPs per cached token and a count per KV head coincide: after SmolLM2
    (_PARAM_CONFIGS[0], 123_456, [5, 40, 17], 2),
    (dict(num_layers=4, num_heads=6, num_kv_heads=2, head_dim=16), 50_000, [9], 1),
    (dict(num_layers=4, num_heads=6, num_kv_heads=2, head_dim=16), 50_000, [0, 12], 2),  # a fresh sequence: S = 0
)


def _decode_mistake(got, cfg, num_params, contexts, b) -> str | None:
    right = _decode_cost(cfg, num_params, contexts, b)
    layers, head_dim, batch = cfg["num_layers"], cfg["head_dim"], len(contexts)
    if got["weight_bytes"] == right["weight_bytes"] * batch and batch > 1:
        return "the weights were charged once per sequence: one read of each weight serves the whole batch"
    if got["kv_bytes"] == 0:
        return "the KV cache was not counted: every sequence reads all its cached K and V in each step"
    if got["kv_bytes"] == right["kv_bytes"] * cfg["num_heads"] // cfg["num_kv_heads"] != right["kv_bytes"]:
        return "K/V bytes counted with num_heads: only num_kv_heads heads are cached (GQA)"
    if got["kv_bytes"] * 2 == right["kv_bytes"]:
        return "only K (or only V) was read: both are cached, 2 x layers x kv_heads x head_dim per token"
    if got["kv_bytes"] * b == right["kv_bytes"] and b > 1:
        return "K/V elements, not bytes: multiply by dtype_bytes"
    if len(set(contexts)) > 1:
        for length, what in ((max(contexts), "the longest"), (contexts[0], "the first")):
            if got["kv_bytes"] == right["kv_bytes"] * length * batch // sum(contexts):
                return f"every sequence was given {what} context: each reads its own contexts[i] tokens"
    if got["flops"] == 2 * num_params * batch:
        return "attention's FLOPs were left out: 4 x layers x num_heads x head_dim per cached token"
    halved = got["flops"] == 2 * num_params * batch + 2 * layers * cfg["num_heads"] * head_dim * sum(contexts)
    per_kv_head = got["flops"] == 2 * num_params * batch + 4 * layers * cfg["num_kv_heads"] * head_dim * sum(contexts)
    if halved and per_kv_head:  # num_heads = 2 x num_kv_heads: either mistake gives this count
        return ("attention FLOPs are half of 4 x layers x num_heads x head_dim per cached token: 2 FLOPs per "
                "element for q.k and 2 for the weighted V, for every query head (not per KV head)")
    if halved:
        return ("attention FLOPs counted 2 per cached token and head dimension: q.k is 2 FLOPs per element and the "
                "weighted sum of V another 2, so 4 x layers x num_heads x head_dim per cached token")
    if per_kv_head:
        return "attention FLOPs counted per KV head: every one of the num_heads query heads scores all keys"
    if got["flops"] == right["flops"] // 2 or got["flops"] == num_params * batch + (right["flops"] - 2 * num_params
                                                                                     * batch):
        return "each multiply-add is 2 FLOPs: 2 per parameter per token"
    if abs(got["intensity"] * right["intensity"] - 1) < 1e-9 and right["intensity"] != 1:
        return "that is bytes per FLOP: intensity is FLOPs divided by bytes"
    return None


def _drawn_decode_cases() -> list[tuple]:
    """Fresh decode steps: a GQA model at a real size, a batch of up to 12 sequences each at its own context (now
    and then a fresh one at 0), in int8, bf16 or fp32."""
    rng = seeded_random(206)
    cases = []
    for _ in range(3):
        kv_heads = rng.choice((1, 2, 4, 8))
        cfg = dict(num_layers=rng.randint(12, 64), num_heads=kv_heads * rng.choice((2, 3, 4, 8)),
                   num_kv_heads=kv_heads, head_dim=rng.choice((64, 96, 128)))
        contexts = [0 if rng.random() < 0.2 else rng.randint(1, 32_768) for _ in range(rng.randint(1, 12))]
        cases.append((cfg, rng.randint(100, 70_000) * 10**6, contexts, rng.choice((1, 2, 4))))
    return cases


@exercise("02", "decode_intensity", forbidden=("labkit_course.grading.labs.lab02._decode_cost",))
def decode_intensity(ns):
    fn = require(ns, "decode_intensity")
    for case in _DECODE_CASES:
        _check_decode(fn, *case)
    for cfg, num_params, contexts, b in _drawn_decode_cases():
        with naming(f"decode_intensity({cfg}, {num_params}, {contexts}, {b})"):
            _check_decode(fn, cfg, num_params, contexts, b)
    for contexts, what in (([], "an empty batch"), ([4, -1], "a negative context")):
        expect_value_error(lambda contexts=contexts: fn(dict(_DECODE_CASES[2][0]), 50_000, contexts, 2), what,
                           "a decode step needs at least one sequence, and a context cannot be negative")
    return "weights read once per batch, K/V once per sequence, at each sequence's own length"


def _check_decode(fn, cfg, num_params, contexts, b):
    try:
        got = fn(dict(cfg), num_params, list(contexts), b)
    except Exception as error:
        if 0 not in contexts or raised_type(error) != "ValueError":
            raise
        raise ExerciseFailed(f"contexts {contexts} raised {raised_type(error)}: a context of 0 is a sequence "
                             "with an empty cache (its first step), valid; only a negative context is an "
                             "error") from None
    if not isinstance(got, dict) or set(got) != {"flops", "weight_bytes", "kv_bytes", "intensity"}:
        raise ExerciseFailed("return a dict with keys 'flops', 'weight_bytes', 'kv_bytes' and 'intensity'")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in got.values()):
        raise ExerciseFailed("every value should be a finite number")
    right = _decode_cost(cfg, num_params, contexts, b)
    if any(abs(got[key] - right[key]) > 1e-9 * max(abs(right[key]), 1) for key in right):
        why = _decode_mistake(got, cfg, num_params, contexts, b)
        wrong = next(key for key in right if abs(got[key] - right[key]) > 1e-9 * max(abs(right[key]), 1))
        raise ExerciseFailed(why or f"'{wrong}' is {got[wrong]:,} for contexts {contexts}, expected "
                                    f"{right[wrong]:,}")


# --- the roofline, and the batch at which decode stops being memory-bound ----------------------------------

def _roofline(intensity, peak_flops, bandwidth):
    return min(peak_flops, intensity * bandwidth), "memory" if intensity * bandwidth < peak_flops else "compute"




_MACHINES = ((989e12, 3.35e12), (100.0, 10.0), (2.0e12, 0.1e12))


_ROOF_MISTAKES = (
    (lambda i, p, w: max(p, i * w), "the roof is the LOWER of the two ceilings: min(peak, intensity x bandwidth)"),
    (lambda i, p, w: i * w, "above the ridge the peak FLOP/s caps it: no machine exceeds its peak"),
    (lambda i, p, w: p, "below the ridge memory limits it: attainable = intensity x bandwidth"),
    (lambda i, p, w: min(p, i / w), "FLOP/s from memory = intensity (FLOP/byte) TIMES bandwidth (byte/s)"),
)


def _drawn_machines() -> list[tuple[float, float, tuple[float, ...]]]:
    """Fresh accelerators (peak FLOP/s, bandwidth) with intensities drawn on both sides of their ridge, at four
    significant digits so the feedback shows them exactly. None sits on the ridge itself: the fixed machines
    test it where floats land on it exactly, and a drawn one would test float rounding instead."""
    rng = seeded_random(203)
    machines = []
    for _ in range(3):
        peak, bandwidth = rng.randint(20, 2000) * 1e12, rng.randint(5, 80) * 1e11
        ridge = peak / bandwidth
        sides = (rng.uniform(0.05, 0.9), rng.uniform(1.1, 3), rng.uniform(3, 100))
        machines.append((peak, bandwidth, (0.0, *(float(f"{ridge * side:.4g}") for side in sides))))
    return machines


@exercise("02", "roofline", forbidden=("labkit_course.grading.labs.lab02._roofline",))
def roofline(ns):
    fn = require(ns, "roofline")
    for peak, bandwidth in _MACHINES:
        ridge = peak / bandwidth
        exact_ridge = (ridge,) if ridge * bandwidth == peak else ()  # where floats can land on it exactly
        _check_roofline(fn, peak, bandwidth, (0.0, 0.5, ridge / 3, *exact_ridge, ridge * 4, 1e6))
    for peak, bandwidth, intensities in _drawn_machines():
        with naming(f"on a {peak:g} FLOP/s, {bandwidth:g} B/s machine"):
            _check_roofline(fn, peak, bandwidth, intensities)
    expect_value_error(lambda: fn(10.0, 100.0, 0.0), "a bandwidth of 0")
    expect_value_error(lambda: fn(10.0, -1.0, 10.0), "a negative peak")
    expect_value_error(lambda: fn(-2.0, 100.0, 10.0), "a negative intensity")
    return "min(peak, intensity x bandwidth); compute-bound from the ridge point on"


def _check_roofline(fn, peak, bandwidth, intensities):
    ridge = peak / bandwidth
    answers = []
    for intensity in intensities:
        try:
            got = fn(intensity, peak, bandwidth)
        except Exception as error:
            if intensity or raised_type(error) != "ValueError":
                raise
            raise ExerciseFailed(f"an intensity of 0 raised {raised_type(error)}: only a negative intensity is an "
                                 "error; 0 FLOP/byte attains 0 FLOP/s (memory-bound)") from None
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed("return a pair: (attainable FLOP/s, 'memory' or 'compute')")
        if isinstance(got[0], bool) or not isinstance(got[0], (int, float)) or not math.isfinite(got[0]):
            raise ExerciseFailed(f"the attainable FLOP/s should be a finite number, got {got[0]!r}")
        answers.append(got)

    def explains(formula):
        return all(abs(got - formula(i, peak, bandwidth)) <= 1e-9 * peak
                   for (got, _), i in zip(answers, intensities, strict=True))

    if not explains(lambda i, p, w: _roofline(i, p, w)[0]):
        why = next((why for formula, why in _ROOF_MISTAKES if explains(formula)), None)
        got, intensity = next((got, i) for (got, _), i in zip(answers, intensities, strict=True)
                              if abs(got - _roofline(i, peak, bandwidth)[0]) > 1e-9 * peak)
        raise ExerciseFailed(why or f"attainable FLOP/s at intensity {intensity:g} on a {peak:g} FLOP/s, "
                                    f"{bandwidth:g} B/s machine: {got:g}, expected "
                                    f"{_roofline(intensity, peak, bandwidth)[0]:g}")
    for (_, bound), intensity in zip(answers, intensities, strict=True):
        want_bound = _roofline(intensity, peak, bandwidth)[1]
        if bound not in ("memory", "compute"):
            raise ExerciseFailed(f"the bound should be 'memory' or 'compute', got {bound!r}")
        if bound != want_bound:
            if intensity == ridge:
                raise ExerciseFailed("at the ridge point itself the machine reaches its peak: call it 'compute'")
            raise ExerciseFailed(f"intensity {intensity:g} is {'below' if intensity < ridge else 'above'} the "
                                 f"ridge ({ridge:g} FLOP/byte): it is {want_bound}-bound, not {bound}-bound")


def _critical_batch(cfg, num_params, context, peak_flops, bandwidth, dtype_bytes=2, max_batch=4096, *, flops=None):
    """`flops` replaces one sequence's FLOPs, to re-create a miscount."""
    one = _decode_cost(cfg, num_params, [context], dtype_bytes)  # every sequence costs the same
    per_sequence_bytes, per_sequence_flops = one["kv_bytes"], flops or one["flops"]
    for batch in range(1, max_batch + 1):
        if batch * per_sequence_flops / (one["weight_bytes"] + batch * per_sequence_bytes) >= peak_flops / bandwidth:
            return batch
    return None


_SMOL = dict(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
_LLAMA3_8B = dict(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
_BATCH_CASES = (  # (config, num_params, context, peak, bandwidth, dtype_bytes, max_batch)
    (_SMOL, 134_515_008, 16, 989e12, 3.35e12, 2, 4096),
    (_SMOL, 134_515_008, 256, 989e12, 3.35e12, 2, 4096),  # SmolLM2's small weights: K/V dominate early
    (_LLAMA3_8B, 8_030_261_248, 64, 989e12, 3.35e12, 2, 4096),
    (_LLAMA3_8B, 8_030_261_248, 4096, 989e12, 3.35e12, 2, 4096),  # the K/V reads cap it: never
    (_SMOL, 134_515_008, 100, 50e12, 1e12, 1, 4096),
    (_SMOL, 134_515_008, 100, 50e12, 1e12, 1, 20),  # reachable, but not within max_batch
    (_SMOL, 134_515_008, 100, 50e12, 1e12, 1, 31),  # reached at max_batch itself
    (_SMOL, 134_515_008, 0, 2e12, 1e12, 2, 4096),  # lands exactly on the ridge at batch 2
)


def _drawn_batch_cases() -> list[tuple]:
    """Fresh models, contexts and accelerators, in the shape of _BATCH_CASES: where the K/V reads of a long context
    cap the intensity below the ridge, the answer is None; elsewhere a batch that max_batch may or may not reach."""
    rng = seeded_random(204)
    cases = []
    for _ in range(4):
        kv_heads = rng.choice((1, 2, 4, 8))
        cfg = dict(num_layers=rng.randint(16, 64), num_heads=kv_heads * rng.choice((1, 2, 4, 8)),
                   num_kv_heads=kv_heads, head_dim=rng.choice((64, 128)))
        cases.append((cfg, rng.randint(100, 70_000) * 10**6, rng.randint(0, 8192), rng.randint(100, 2000) * 1e12,
                      rng.randint(10, 80) * 1e11, rng.choice((1, 2)), rng.choice((64, 512, 4096))))
    return cases


@exercise("02", "critical_batch", forbidden=("labkit_course.grading.labs.lab02._critical_batch",
                                             "labkit_course.grading.labs.lab02._decode_cost"))
def critical_batch(ns):
    fn = require(ns, "critical_batch")
    for case in _BATCH_CASES:
        _check_critical_batch(fn, *case)
    for case in _drawn_batch_cases():
        cfg, num_params, context, peak, bandwidth, b, max_batch = case
        with naming(f"critical_batch({cfg}, {num_params}, {context}, {peak:g}, {bandwidth:g}, {b}, {max_batch})"):
            _check_critical_batch(fn, *case)
    return "the smallest compute-bound batch, or None where the K/V reads keep decode below the ridge"


def _check_critical_batch(fn, cfg, num_params, context, peak, bandwidth, b, max_batch):
    got = fn(dict(cfg), num_params, context, peak, bandwidth, b, max_batch)
    want = _critical_batch(cfg, num_params, context, peak, bandwidth, b, max_batch)
    if got == want and type(got) is type(want):
        return
    where = f"context {context}, ridge {peak / bandwidth:g} FLOP/byte, max_batch {max_batch}"
    if want is None:
        if got == max_batch:
            raise ExerciseFailed(f"{where}: no batch up to max_batch is compute-bound: return None, "
                                 "not max_batch")
        if got in (0, -1, float("inf")):
            raise ExerciseFailed(f"{where}: return None (not {got!r}) when no batch is compute-bound")
        if isinstance(got, int) and got > max_batch:
            raise ExerciseFailed(f"{where}: {got} is above max_batch: search only up to max_batch, else None")
    weights_only = math.ceil(peak / bandwidth * b / 2 - 1e-9)  # the batch that only shares the weight reads
    if want is not None and isinstance(got, int) and not isinstance(got, bool):
        if got == want - 1:
            raise ExerciseFailed(f"{where}: {got} is the largest memory-bound batch; return the smallest "
                                 "compute-bound one")
        if want > 1 and got == want + 1:
            raise ExerciseFailed(f"{where}: {got} is one too many: the ridge itself counts as compute-bound (>=)")
    if got in (weights_only, weights_only + 1):
        raise ExerciseFailed(f"{where}: the K/V reads were left out (that batch only shares the weights): each "
                             "sequence also reads its own cache, which pulls the intensity down")
    if got is None and want == max_batch:
        raise ExerciseFailed(f"{where}: got None, but batch {want} is compute-bound: max_batch itself may be the "
                             "answer (B <= max_batch), so search up to and including it")
    if got is None and not context:
        raise ExerciseFailed(f"{where}: got None, but batch {want} is compute-bound: a context of 0 (sequences "
                             "with empty caches) is valid")
    if got == _critical_batch({**cfg, "num_kv_heads": cfg["num_heads"]}, num_params, context, peak, bandwidth,
                              b, max_batch):
        raise ExerciseFailed(f"{where}: got {got!r}, expected {want!r}: K/V bytes counted with num_heads; only "
                             "num_kv_heads heads are cached (GQA)")
    per_head = 4 * cfg["num_layers"] * cfg["head_dim"] * context  # one query head's attention FLOPs
    undercounted = ("attention FLOPs were undercounted: 4 x layers x num_heads x head_dim per cached token (2 for q.k "
                    "and 2 for the weighted V, in every query head, not per KV head)")
    for flops, why in ((2 * num_params, "attention's FLOPs were left out: each sequence also does 4 x layers x "
                                        "num_heads x head_dim per cached token"),
                       (2 * num_params + per_head * cfg["num_heads"] // 2, undercounted),
                       (2 * num_params + per_head * cfg["num_kv_heads"], undercounted)):
        if got == _critical_batch(cfg, num_params, context, peak, bandwidth, b, max_batch, flops=flops) != want:
            raise ExerciseFailed(f"{where}: got {got!r}, expected {want!r}: {why}")
    if want is None:
        raise ExerciseFailed(f"{where}: got {got!r}; no batch up to max_batch reaches the ridge, expected None")
    if got is None:
        raise ExerciseFailed(f"{where}: got None, but batch {want} is compute-bound")
    if isinstance(got, bool) or not isinstance(got, int):
        raise ExerciseFailed(f"{where}: return a batch size as an int (or None if there is none), got {got!r}")
    raise ExerciseFailed(f"{where}: got batch {got}, expected {want}")
