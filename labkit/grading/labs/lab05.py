"""Lab 05: the pieces of a real decoder layer. Graders test the student's functions on fresh random
inputs against labkit.model / labkit.attention (the code that runs SmolLM2) and name the usual
mistakes."""

import torch

from labkit.attention.dense import causal_attention
from labkit.grading import ExerciseFailed, exercise, expect_tensor, require
from labkit.model.layers import apply_rotary as ref_rotary
from labkit.model.layers import rope_cos_sin, rope_inv_freq


def _close(a, b, atol=1e-5):
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=atol)


# ---- RMSNorm ---------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@exercise("05", "rms_norm", forbidden=("labkit.model.layers.RMSNorm.forward", "torch.nn.functional.rms_norm",
                                         "torch.nn.RMSNorm.forward", "labkit.grading.labs.lab05._rms"))
def rms_norm(ns):
    fn = require(ns, "rms_norm")
    g = torch.Generator().manual_seed(50)
    x, w = torch.randn(5, 16, generator=g), torch.rand(16, generator=g) + 0.5
    x[0] = 0.0  # an all-zero row: only eps keeps it finite
    eps = 0.1  # large, so where eps goes shows
    given = x.clone()
    got = expect_tensor(fn(given, w.clone(), eps), x.shape, "the normalised x")
    if not torch.equal(given, x):
        raise ExerciseFailed("rms_norm changed its input x in place: the residual stream still needs it, "
                             "return a new tensor")
    if not torch.isfinite(got).all():
        raise ExerciseFailed("an all-zero row gave NaN/inf: add eps inside the square root")
    if _close(got, _rms(x, 1.0, eps)):
        raise ExerciseFailed("the learned weight was not applied: multiply by weight at the end")
    if _close(got, (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * w):
        raise ExerciseFailed("that is LayerNorm: RMSNorm does not subtract the mean")
    if _close(got, x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w):
        raise ExerciseFailed("divided by the root of the *sum* of squares: RMS is the root of their mean")
    if _close(got, x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w):
        raise ExerciseFailed("eps was added after the square root: it goes inside, sqrt(mean(x^2) + eps)")
    if _close(got, x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps) * w):
        raise ExerciseFailed("the mean was taken over the wrong axis: normalise each token's vector "
                             "(the last dimension, keepdim=True)")
    if not _close(got, _rms(x, w, eps)):
        raise ExerciseFailed("the values differ from x / sqrt(mean(x^2) + eps) * weight (last dimension)")
    # fp16 activations of a real model reach hundreds: x^2 overflows fp16 (max 65504) from |x| > 256
    big = (torch.randn(4, 16, generator=g) * 200).clamp(-400, 400)
    big[:, 0] = 400.0
    half = fn(big.half(), w.half(), 1e-5)
    if not isinstance(half, torch.Tensor) or half.dtype != torch.half:
        raise ExerciseFailed("for fp16 input return fp16 (compute in fp32 if you like, then cast back)")
    expected = _rms(big.half().float(), w.half().float(), 1e-5)
    if not _close(half.float(), expected, atol=2e-2):
        raise ExerciseFailed("wrong for fp16 activations around ±400: x^2 overflows fp16 (largest 65504), so "
                             "compute in float32 (x.float()) and cast the result back to x's dtype")
    return "x / sqrt(mean(x^2) + eps) * weight, finite on a zero row, safe for large fp16 activations"


# ---- rotary embedding ------------------------------------------------------------------------------------

def _rotary(x, positions, theta, *, interleaved=False, sign=1.0, exponent=2):
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).double() * exponent / 2 / d)
    angles = positions.double()[:, None] * inv_freq * sign
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x = x.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, -1)
    a, b = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.stack((a, b), -1).flatten(-2) if interleaved else torch.cat((a, b), -1)


@exercise("05", "apply_rotary", forbidden=("labkit.model.layers.apply_rotary", "labkit.model.layers.rope_cos_sin",
                                             "labkit.model.layers.rope_inv_freq", "labkit.grading.labs.lab05._rotary"))
def apply_rotary(ns):
    fn = require(ns, "apply_rotary")
    g = torch.Generator().manual_seed(51)
    for theta in (10000.0, 100000.0):
        x = torch.randn(6, 3, 8, generator=g)
        positions = torch.tensor([0, 1, 2, 7, 30, 500])
        got = expect_tensor(fn(x.clone(), positions, theta), x.shape, "the rotated x [T, heads, head_dim]")
        inv_freq = rope_inv_freq(8, theta)
        expected = ref_rotary(x, *rope_cos_sin(positions, inv_freq, torch.float32))
        if _close(got, x):
            raise ExerciseFailed("x came back unchanged: rotate each pair by position * frequency")
        if _close(got, _rotary(x, positions, theta, interleaved=True)):
            raise ExerciseFailed("you rotated neighbouring pairs (x0, x1), (x2, x3)...: Hugging Face's layout "
                                 "pairs x[i] with x[i + head_dim/2] (the two halves)")
        if _close(got, _rotary(x, positions, theta, sign=-1.0)):
            raise ExerciseFailed("rotated the wrong way: the first half is x1*cos - x2*sin, "
                                 "the second x2*cos + x1*sin")
        if _close(got, _rotary(x, positions, theta, exponent=1)):
            raise ExerciseFailed("wrong frequencies: they are theta^(-2i/head_dim) for i = 0 .. head_dim/2 - 1")
        if _close(got, _rotary(x, positions + 1, theta)) or _close(got, _rotary(x, positions - 1, theta)):
            raise ExerciseFailed("positions are off by one: the first token is at position 0 and is left "
                                 "unrotated (angle 0)")
        if _close(got, _rotary(x, torch.arange(len(positions)), theta)):
            raise ExerciseFailed("the positions argument was ignored (0, 1, 2, ... assumed): rotate each token by "
                                 "its own position, e.g. 500 after a long prompt")
        if theta != 10000.0 and _close(got, _rotary(x, positions, 10000.0)):
            raise ExerciseFailed("theta was ignored (10000 is only the default): SmolLM2 uses 100000")
        if not _close(got, expected, atol=1e-4):
            raise ExerciseFailed(f"the rotation differs from labkit's for theta={theta:g}")
    return "half-split pairs rotated by position * theta^(-2i/d), any theta"


# ---- attention with a KV cache ---------------------------------------------------------------------------

def _attend(q, k, v, cached, *, scale=True, align_end=True, interleave=True):
    """Reference for one step, with switches that reproduce the usual mistakes. q [n, Hq, D]."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if interleave:
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    else:
        kh, vh = kh.repeat(group, 1, 1), vh.repeat(group, 1, 1)
    scores = qh @ kh.transpose(1, 2) / (d**0.5 if scale else 1.0)
    offset = cached if align_end else 0
    allowed = torch.ones(n, k.shape[0], dtype=torch.bool).tril(diagonal=offset)
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vh).transpose(0, 1)


@exercise("05", "attention_with_cache", forbidden=(
    "labkit.attention.dense.causal_attention", "labkit.attention.dense.dense_attention",
    "labkit.attention.reference.naive_attention", "labkit.cache.KVCache.__call__",
    "labkit.grading.labs.lab05._attend",
))
def attention_with_cache(ns):
    fn = require(ns, "attention_with_cache")
    g = torch.Generator().manual_seed(52)
    hq, hkv, d, steps = 6, 2, 8, (4, 2, 1, 1, 1)  # prefill 4, a chunk of 2, three decode steps
    total = sum(steps)
    q, k, v = torch.randn(total, hq, d, generator=g), torch.randn(total, hkv, d, generator=g), \
        torch.randn(total, hkv, d, generator=g)
    cache = {"k": torch.empty(hkv, 0, d), "v": torch.empty(hkv, 0, d)}
    outs, start = [], 0
    for n in steps:
        s = slice(start, start + n)
        out = expect_tensor(fn(q[s], k[s], v[s], cache), (n, hq, d), f"the output of {n} new queries [n, Hq, D]")
        stored = cache.get("k")
        if not isinstance(stored, torch.Tensor) or stored.shape[:2] != (hkv, start + n):
            got = tuple(stored.shape) if isinstance(stored, torch.Tensor) else stored
            raise ExerciseFailed(f"after {start + n} tokens cache['k'] should be [{hkv}, {start + n}, {d}], got "
                                 f"{got}: append k_new (as [Hkv, n, D]) along dim 1 and store it back in the dict")
        if not (torch.equal(cache["k"], k[: start + n].transpose(0, 1))
                and torch.equal(cache["v"], v[: start + n].transpose(0, 1))):
            raise ExerciseFailed("the cache does not hold every key/value in position order: new ones go at the end")
        outs.append(out)
        start += n
    got = torch.cat(outs)
    per_step = [(0, 4), (4, 6), (6, 9)]

    bounds = [(0, 4), (4, 6), (6, 7), (7, 8), (8, 9)]

    def reference(**mistake):
        if not mistake:  # labkit's own attention, the one SmolLM2 runs with
            return torch.cat([causal_attention(q[a:b].transpose(0, 1), k[:b].transpose(0, 1),
                                               v[:b].transpose(0, 1)).transpose(0, 1) for a, b in bounds])
        return torch.cat([_attend(q[a:b], k[:b], v[:b], a, **mistake) for a, b in bounds])

    if _close(got, reference()):
        return "appends to the cache, attends causally over it, GQA heads grouped correctly"
    if _close(got, reference(scale=False)):
        raise ExerciseFailed("scores were not divided by sqrt(head_dim)")
    if _close(got, reference(interleave=False)):
        raise ExerciseFailed("query head h must use KV head h // (Hq / Hkv): expand KV heads with "
                             "repeat_interleave, not repeat")
    if _close(got, reference(align_end=False)):
        raise ExerciseFailed("the causal mask was aligned to the first key (as SDPA's is_causal does when there "
                             "are more keys than queries): new query i sits at position cached + i, so it sees "
                             "keys 0 .. cached + i")
    ok = reference()
    prefill_ok, chunk_ok, decode_ok = (_close(got[a:b], ok[a:b]) for a, b in per_step)
    if decode_ok and not prefill_ok:
        raise ExerciseFailed("the prefill is wrong but decode steps are right: with several new tokens each "
                             "query may only see keys up to its own position (causal mask)")
    if prefill_ok and decode_ok and not chunk_ok:
        raise ExerciseFailed("two new tokens after a filled cache came out wrong: query i sits at position "
                             "cached + i and sees keys 0 .. cached + i")
    raise ExerciseFailed("the output differs from causal attention over cached + new keys "
                         f"(max abs diff {(got - ok).abs().max():.3g})")


@exercise("05", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers, smollm2_config

    smol = smollm2_config()
    fp32 = torch.finfo(torch.float32).bits // 8
    return grade_answers(ns, {
        1: Number(smol.num_heads // smol.num_kv_heads, "'Attention that reads and appends to a KV cache'"),
        2: Number(2 * smol.num_layers * smol.num_kv_heads * smol.head_dim * fp32,
                  "section 4: Lab 02's formula with one token and 4-byte elements"),
        3: Choice("a", "the RMSNorm exercise's formula"),
        4: Choice("b", "'The rotary embedding'"),
        5: Choice("b", "what the timings show, in section 3"),
    })
