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


@exercise("02", "kv_cache_bytes")
def kv_cache_bytes(ns):
    fn = require(ns, "kv_cache_bytes")
    for cfg in _CONFIGS:
        layers, kv_heads, head_dim, seq_len, batch, dtype_bytes = cfg
        got = fn(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len,
                 batch_size=batch, dtype_bytes=dtype_bytes)
        expected = _kv_bytes(*cfg)
        if not isinstance(got, (int, float)):
            raise ExerciseFailed(f"return a number of bytes, got {type(got).__name__}")
        if got == expected:
            continue
        ratio = got / expected
        for factor, why in ((2, "K and V are both cached: multiply by 2"),
                            (layers, "every layer keeps its own K and V: multiply by num_layers"),
                            (batch, "each sequence in the batch has its own cache: multiply by batch_size"),
                            (dtype_bytes, "the count is of elements: multiply by dtype_bytes for bytes"),
                            (seq_len, "one K and one V row per token: multiply by seq_len")):
            if abs(ratio * factor - 1) < 1e-9:
                raise ExerciseFailed(why)
        if abs(ratio * 1024 - 1) < 1e-9 or abs(ratio * 2**20 - 1) < 1e-9:
            raise ExerciseFailed("return bytes, not KiB/MiB (convert only when printing)")
        raise ExerciseFailed(f"{got} bytes for {cfg}, expected 2 x L x H_kv x D_h x S x B x bytes = {expected}")
    return "2 x layers x kv_heads x head_dim x seq_len x batch x bytes"


@exercise("02", "matmul_intensity")
def matmul_intensity(ns):
    fn = require(ns, "matmul_intensity")
    for m, k, n, b in ((1, 4096, 4096, 2), (512, 4096, 11008, 2), (7, 300, 50, 4)):
        got = fn(m, k, n, b)
        flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * b
        expected = flops / moved
        if not isinstance(got, (int, float)):
            raise ExerciseFailed(f"return a number (FLOPs per byte), got {type(got).__name__}")
        if abs(got / expected - 1) < 1e-9:
            continue
        if abs(got / expected - 0.5) < 1e-9:
            raise ExerciseFailed("each multiply-add is 2 FLOPs: a [m,k] @ [k,n] product costs 2*m*k*n")
        if abs(got - flops / (moved / b)) < 1e-9 * expected * b:
            raise ExerciseFailed("divide by bytes, not elements: multiply the element count by dtype_bytes")
        if abs(got - flops / ((m * k + k * n) * b)) < 1e-9 * expected * 2:
            raise ExerciseFailed("the output [m, n] must be written to memory too: count m*n elements")
        raise ExerciseFailed(f"intensity({m}, {k}, {n}, {b}) = {got}, expected "
                             f"2mkn / ((mk + kn + mn) * bytes) = {expected:.4f}")
    return "2mkn FLOPs over (mk + kn + mn) * bytes moved"


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
