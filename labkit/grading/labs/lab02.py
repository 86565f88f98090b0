"""Lab 02: memory and arithmetic-intensity formulas. Graders try fresh configurations and name the
factor a wrong formula dropped."""

from labkit.grading import ExerciseFailed, exercise, require

_CONFIGS = [  # (layers, kv_heads, head_dim, seq_len, batch, dtype_bytes), each factor distinct
    (30, 3, 64, 777, 5, 4),
    (32, 8, 128, 2048, 3, 2),
    (7, 5, 96, 33, 11, 1),
]


def _kv_bytes(layers, kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * seq_len * batch * dtype_bytes


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


@exercise("02", "kv_cache_bytes", forbidden=("labkit.grading.labs.lab02._kv_bytes",))
def kv_cache_bytes(ns):
    fn = require(ns, "kv_cache_bytes")
    answers = []
    for cfg in _CONFIGS:
        layers, kv_heads, head_dim, seq_len, batch, dtype_bytes = cfg
        got = fn(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len,
                 batch_size=batch, dtype_bytes=dtype_bytes)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseFailed(f"return a number of bytes, got {type(got).__name__}")
        answers.append(got)
    if all(got == _kv_bytes(*cfg) for got, cfg in zip(answers, _CONFIGS, strict=True)):
        if any(isinstance(got, float) for got in answers):
            raise ExerciseFailed("bytes are a whole number: return an int (use // or int(), not /, and no "
                                 "float factors)")
        return "2 x layers x kv_heads x head_dim x seq_len x batch x bytes"
    for mistake, why in _KV_MISTAKES:
        if all(abs(got / mistake(cfg) - 1) < 1e-9 for got, cfg in zip(answers, _CONFIGS, strict=True)):
            raise ExerciseFailed(why)
    got, cfg = next((got, cfg) for got, cfg in zip(answers, _CONFIGS, strict=True) if got != _kv_bytes(*cfg))
    raise ExerciseFailed(f"{got} bytes for {cfg}, expected 2 x L x H_kv x D_h x S x B x bytes = {_kv_bytes(*cfg)}")


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


@exercise("02", "matmul_intensity", forbidden=("labkit.grading.labs.lab02._intensity",))
def matmul_intensity(ns):
    fn = require(ns, "matmul_intensity")
    answers = []
    for shape in _SHAPES:
        got = fn(*shape)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseFailed(f"return a number (FLOPs per byte), got {type(got).__name__}")
        answers.append(got)
    if all(abs(got / _intensity(*shape) - 1) < 1e-9 for got, shape in zip(answers, _SHAPES, strict=True)):
        return "2mkn FLOPs over (mk + kn + mn) * bytes moved"
    for mistake, why in _INTENSITY_MISTAKES:
        if all(abs(got - mistake(*shape)) <= 1e-9 * abs(mistake(*shape))
               for got, shape in zip(answers, _SHAPES, strict=True)):
            raise ExerciseFailed(why)
    got, (m, k, n, b) = next((got, shape) for got, shape in zip(answers, _SHAPES, strict=True)
                             if abs(got / _intensity(*shape) - 1) >= 1e-9)
    raise ExerciseFailed(f"intensity({m}, {k}, {n}, {b}) = {got}, expected "
                         f"2mkn / ((mk + kn + mn) * bytes) = {_intensity(m, k, n, b):.4f}")


@exercise("02", "knowledge_check")
def knowledge_check(ns):
    import torch

    from labkit.grading.quiz import Choice, Number, grade_answers, smollm2_config

    smol = smollm2_config()
    fp16, fp32 = torch.finfo(torch.float16).bits // 8, torch.finfo(torch.float32).bits // 8
    smol_mib = 2 * smol.num_layers * smol.num_kv_heads * smol.head_dim * 1024 * fp16 / 2**20
    return grade_answers(ns, {
        1: Number(smol_mib, "section 3's formula with SmolLM2's configuration", rel_tol=1e-3),
        2: Choice("a", "section 4: m = 1 in your `matmul_intensity`"),
        3: Number(2 * fp32, "section 2 on Adam's two moments"),
        4: Choice("a", "'The KV cache is read too'"),
        5: Choice("b", "the paragraph after the KV-cache plots (GQA)"),
    })
