"""Lab 05: the pieces of a real decoder layer. Graders test the student's functions on fresh random
inputs against labkit.model / labkit.attention (the code that runs SmolLM2) and name the usual
mistakes."""

import torch
import torch.nn.functional as F

from labkit.attention.dense import causal_attention
from labkit.cache import KVCache
from labkit.model.config import ModelConfig
from labkit.model.generate import step_metadata
from labkit.model.layers import MLP, DecoderLayer, rope_cos_sin, rope_inv_freq
from labkit.model.layers import apply_rotary as ref_rotary
from labkit_course.grading import ExerciseFailed, exercise, expect_tensor, raised_type, require, tensors_close
from labkit_course.grading.core import seeded_generator

# ---- RMSNorm ---------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@exercise("05", "rms_norm", forbidden=("labkit.model.layers.RMSNorm.forward", "labkit.model.layers.rms_norm",
                                         "torch.nn.functional.rms_norm",
                                         "torch.nn.RMSNorm.forward", "labkit_course.grading.labs.lab05._rms"))
def rms_norm(ns):
    fn = require(ns, "rms_norm")
    g = seeded_generator(50)
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
    if tensors_close(got, _rms(x, 1.0, eps)):
        raise ExerciseFailed("the learned weight was not applied: multiply by weight at the end")
    layer_norm = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * w
    if tensors_close(got, layer_norm):
        raise ExerciseFailed("that is LayerNorm: RMSNorm does not subtract the mean")
    if tensors_close(got, x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w):
        raise ExerciseFailed("divided by the root of the *sum* of squares: RMS is the root of their mean")
    if tensors_close(got, x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w):
        raise ExerciseFailed("eps was added after the square root: it goes inside, sqrt(mean(x^2) + eps)")
    if tensors_close(got, x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps) * w):
        raise ExerciseFailed("the mean was taken over the wrong axis: normalise each token's vector "
                             "(the last dimension, keepdim=True)")
    if not tensors_close(got, _rms(x, w, eps)):
        raise ExerciseFailed("the values differ from x / sqrt(mean(x^2) + eps) * weight (last dimension)")
    # fp16 activations of a real model reach hundreds: x^2 overflows fp16 (max 65504) from |x| > 256
    big = (torch.randn(4, 16, generator=g) * 200).clamp(-400, 400)
    big[:, 0] = 400.0
    half = fn(big.half(), w.half(), 1e-5)
    if not isinstance(half, torch.Tensor) or half.dtype != torch.half:
        raise ExerciseFailed("for fp16 input return fp16 (compute in fp32 if you like, then cast back)")
    expected = _rms(big.half().float(), w.half().float(), 1e-5)
    if not tensors_close(half.float(), expected, atol=2e-2):
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
                                             "labkit.model.layers.rope_inv_freq",
                                             "labkit_course.grading.labs.lab05._rotary"))
def apply_rotary(ns):
    fn = require(ns, "apply_rotary")
    g = seeded_generator(51)
    for theta in (10000.0, 100000.0):
        x = torch.randn(6, 3, 8, generator=g)
        positions = torch.tensor([0, 1, 2, 7, 30, 500])
        got = expect_tensor(fn(x.clone(), positions, theta), x.shape, "the rotated x [T, heads, head_dim]")
        inv_freq = rope_inv_freq(8, theta)
        expected = ref_rotary(x, *rope_cos_sin(positions, inv_freq, torch.float32))
        if tensors_close(got, x):
            raise ExerciseFailed("x came back unchanged: rotate each pair by position * frequency")
        if tensors_close(got, _rotary(x, positions, theta, interleaved=True)):
            raise ExerciseFailed("you rotated neighbouring pairs (x0, x1), (x2, x3)...: Hugging Face's layout "
                                 "pairs x[i] with x[i + head_dim/2] (the two halves)")
        if tensors_close(got, _rotary(x, positions, theta, sign=-1.0)):
            raise ExerciseFailed("rotated the wrong way: the first half is x1*cos - x2*sin, "
                                 "the second x2*cos + x1*sin")
        if tensors_close(got, _rotary(x, positions, theta, exponent=1)):
            raise ExerciseFailed("wrong frequencies: they are theta^(-2i/head_dim) for i = 0 .. head_dim/2 - 1")
        if tensors_close(got, _rotary(x, positions + 1, theta)) or tensors_close(got, _rotary(x, positions - 1, theta)):
            raise ExerciseFailed("positions are off by one: the first token is at position 0 and is left "
                                 "unrotated (angle 0)")
        if tensors_close(got, _rotary(x, torch.arange(len(positions)), theta)):
            raise ExerciseFailed("the positions argument was ignored (0, 1, 2, ... assumed): rotate each token by "
                                 "its own position, e.g. 500 after a long prompt")
        if theta != 10000.0 and tensors_close(got, _rotary(x, positions, 10000.0)):
            raise ExerciseFailed("theta was ignored (10000 is only the default): SmolLM2 uses 100000")
        if not tensors_close(got, expected, atol=1e-4):
            raise ExerciseFailed(f"the rotation differs from labkit's for theta={theta:g}")
    _rotary_half_precision(fn, g)
    return "half-split pairs rotated by position * theta^(-2i/d), any theta, in float32 for fp16 and bf16 inputs"


_HALF_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}  # a few units in the last place of values near 4


def _rotary_half_precision(fn, g):
    """fp16 and bf16 inputs far into a sequence: right only if the angles are computed in float32."""
    theta, positions = 100000.0, torch.tensor([0, 3, 500, 1000, 2500, 4000])
    x = torch.randn(len(positions), 3, 8, generator=g)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(8, theta), torch.float32)
    for dtype, tolerance in _HALF_TOLERANCE.items():
        given = x.to(dtype)
        got = expect_tensor(fn(given.clone(), positions, theta), x.shape, f"the rotated {dtype} x")
        if got.dtype != dtype:
            raise ExerciseFailed(f"a {dtype} x came back as {got.dtype}: compute in float32, then return the "
                                 "input's dtype (x.dtype)")
        expected = ref_rotary(given.float(), cos, sin)
        error = (got.float() - expected).abs().max().item()
        if not error <= tolerance:
            raise ExerciseFailed(f"a {dtype} x at positions up to {int(positions.max())} (theta={theta:g}) is off "
                                 f"by up to {error:.3g}: compute the frequencies, angles, cos/sin and the rotation "
                                 f"in float32 (in {dtype} theta^(...) overflows or position * frequency loses whole "
                                 "radians), then cast the result back to x.dtype")


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
    "labkit_course.grading.labs.lab05._attend", "torch.nn.functional.scaled_dot_product_attention",
))
def attention_with_cache(ns):
    fn = require(ns, "attention_with_cache")
    _attention_steps(fn, 6, 2, 52)  # SmolLM2's proportions: groups of 3 query heads per KV head
    for hq, hkv, seed in ((8, 2, 58), (4, 4, 59)):  # groups of 4, and plain multi-head attention
        where = f"with {hq} query heads on {hkv} KV heads (groups of {hq // hkv})"
        try:
            _attention_steps(fn, hq, hkv, seed)
        except ExerciseFailed as failure:
            raise ExerciseFailed(f"right with 6 query heads on 2 KV heads, wrong {where}: {failure} (take the "
                                 "group size from the shapes, num_heads // num_kv_heads, not SmolLM2's 3)") from None
        except Exception as error:
            raise ExerciseFailed(f"right with 6 query heads on 2 KV heads, but {where} it raised "
                                 f"{raised_type(error)}: take the group size from the shapes, "
                                 "num_heads // num_kv_heads, not SmolLM2's 3") from None
    return "appends to the cache, attends causally over it, GQA heads grouped for any group size"


def _attention_steps(fn, hq, hkv, seed):
    """A prefill of 4, a chunk of 2 and three decode steps through `fn`, checked against labkit's attention."""
    g = seeded_generator(seed)
    d, steps = 8, (4, 2, 1, 1, 1)
    total = sum(steps)
    q, k, v = torch.randn(total, hq, d, generator=g), torch.randn(total, hkv, d, generator=g), \
        torch.randn(total, hkv, d, generator=g)
    cache = {"k": torch.empty(hkv, 0, d), "v": torch.empty(hkv, 0, d)}
    outs, start = [], 0
    for n in steps:
        s = slice(start, start + n)
        new = (q[s].clone(), k[s].clone(), v[s].clone())  # not views of q, k, v: the references read those
        out = expect_tensor(fn(*new, cache), (n, hq, d), f"the output of {n} new queries [n, Hq, D]")
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

    if tensors_close(got, reference()):
        return
    if tensors_close(got, reference(scale=False)):
        raise ExerciseFailed("scores were not divided by sqrt(head_dim)")
    if hq != hkv and tensors_close(got, reference(interleave=False)):
        raise ExerciseFailed("query head h must use KV head h // (Hq / Hkv): expand KV heads with "
                             "repeat_interleave, not repeat")
    if tensors_close(got, reference(align_end=False)):
        raise ExerciseFailed("the causal mask was aligned to the first key (as SDPA's is_causal does when there "
                             "are more keys than queries): new query i sits at position cached + i, so it sees "
                             "keys 0 .. cached + i")
    ok = reference()
    prefill_ok, chunk_ok, decode_ok = (tensors_close(got[a:b], ok[a:b]) for a, b in per_step)
    if decode_ok and not prefill_ok:
        raise ExerciseFailed("the prefill is wrong but decode steps are right: with several new tokens each "
                             "query may only see keys up to its own position (causal mask)")
    if prefill_ok and decode_ok and not chunk_ok:
        raise ExerciseFailed("two new tokens after a filled cache came out wrong: query i sits at position "
                             "cached + i and sees keys 0 .. cached + i")
    raise ExerciseFailed("the output differs from causal attention over cached + new keys "
                         f"(max abs diff {(got - ok).abs().max():.3g})")


# ---- the SwiGLU MLP with merged gate/up weights ----------------------------------------------------

_LAYER_FORWARDS = ("labkit.model.layers.MLP.forward", "labkit.model.layers.silu_mul",
                   "labkit.model.layers.DecoderLayer.forward", "labkit.model.layers.Attention.forward")


def _swiglu(x, gate_up, down, *, swap=False, interleaved=False, act=F.silu, act_after_product=False):
    """Reference with switches that reproduce the usual mistakes."""
    both = x @ gate_up.T
    gate, up = (both[..., 0::2], both[..., 1::2]) if interleaved else both.chunk(2, dim=-1)
    if swap:
        gate, up = up, gate
    hidden = act(gate * up) if act_after_product else act(gate) * up
    return hidden @ down.T


@exercise("05", "swiglu_mlp", forbidden=(*_LAYER_FORWARDS, "labkit_course.grading.labs.lab05._swiglu"))
def swiglu_mlp(ns):
    fn = require(ns, "swiglu_mlp")
    g = seeded_generator(53)
    hidden, inter = 24, 64  # the same 8/3 ratio as SmolLM2's 576 -> 1536
    config = ModelConfig("llama", 10, hidden, inter, 1, 2, 1, 12, 64, 1e-5, 1e4, True)
    mlp = MLP(config)
    with torch.no_grad():
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.3)
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()  # nano-vLLM's merged layout
    down = mlp.down_proj.weight.detach().clone()
    x = torch.randn(5, hidden, generator=g)
    got = expect_tensor(fn(x.clone(), gate_up.clone(), down.clone()), (5, hidden),
                        "the MLP's output [tokens, hidden] (did you apply down_weight?)")
    with torch.no_grad():
        expected = mlp(x)
    if tensors_close(got, expected, atol=1e-4):
        return "splits the merged gate/up projection, down(silu(gate) * up), matches labkit's MLP"
    if tensors_close(got, _swiglu(x, gate_up, down, swap=True), atol=1e-4):
        raise ExerciseFailed("gate and up are swapped: the merged weight holds gate's rows first, then up's, "
                             "and silu goes on the gate")
    if tensors_close(got, _swiglu(x, gate_up, down, interleaved=True), atol=1e-4):
        raise ExerciseFailed("the merged output was split into even and odd columns; it is two halves, "
                             "[gate | up], each intermediate_size wide")
    if tensors_close(got, _swiglu(x, gate_up, down, act_after_product=True), atol=1e-4):
        raise ExerciseFailed("silu was applied to gate * up; it goes on the gate alone: silu(gate) * up")
    for act, name in ((F.gelu, "GELU"), (F.relu, "ReLU"), (torch.sigmoid, "a sigmoid")):
        if tensors_close(got, _swiglu(x, gate_up, down, act=act), atol=1e-4):
            raise ExerciseFailed(f"{name} instead of SiLU (x * sigmoid(x)): SwiGLU gates with SiLU")
    if tensors_close(got, F.silu(x @ gate_up[:inter].T) @ down.T, atol=1e-4):
        raise ExerciseFailed("the up projection was left out: SwiGLU multiplies silu(gate) by up")
    raise ExerciseFailed("the output differs from down(silu(gate) * up) "
                         f"(max abs diff {(got - expected).abs().max():.3g})")


# ---- a whole decoder layer -----------------------------------------------------------------------------

_LAYER_CONFIG = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 8, "rope_theta": 100000.0, "eps": 1e-5}
# Qwen3-0.6B's proportions: 16 heads of 128 on a 1024-wide stream, so the heads are twice the hidden size
_WIDE_HEADS_CONFIG = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rope_theta": 1000000.0, "eps": 1e-6}
_LAYER_STEPS = (5, 2, 1, 1)  # a prefill of 5, a chunk of 2, two decode steps


def _layer_weights(seed, cfg=_LAYER_CONFIG, hidden=None):
    """Random weights for a small layer (SmolLM2's shape by default: 6/2 heads, width = heads * head_dim, MLP
    8/3 wide), in labkit's DecoderLayer and merged as the exercise takes them."""
    hidden = hidden or cfg["num_heads"] * cfg["head_dim"]
    config = ModelConfig("llama", 10, hidden, hidden * 8 // 3, 1, cfg["num_heads"], cfg["num_kv_heads"],
                         cfg["head_dim"], 64, cfg["eps"], cfg["rope_theta"], True)
    layer = DecoderLayer(config, 0)
    g = seeded_generator(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.5 if name.endswith("norm.weight") else 0.25
            param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + torch.randn(param.shape, generator=g) * scale)
    attn, mlp = layer.self_attn, layer.mlp
    weights = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
               "qkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
               "o": attn.o_proj.weight, "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
               "down": mlp.down_proj.weight}
    return layer, {name: w.detach().clone() for name, w in weights.items()}


def _layer(x, w, cfg, *, attn_residual=True, mlp_residual=True, post_norm=False, one_norm=False,
           rotate_k=True, rotate_v=False, o_proj=True, o_transposed=True, mlp_normed=True, parallel=False):
    """The whole sequence through a layer, with switches that reproduce the usual mistakes."""
    hq, hkv, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    n, layer_input = x.shape[0], x
    positions = torch.arange(n)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(d, cfg["rope_theta"]), torch.float32)
    post_weight = w["input_norm"] if one_norm else w["post_norm"]
    h = x if post_norm else _rms(x, w["input_norm"], cfg["eps"])
    q, k, v = (h @ w["qkv"].T).split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    q = ref_rotary(q, cos, sin)
    k = ref_rotary(k, cos, sin) if rotate_k else k
    v = ref_rotary(v, cos, sin) if rotate_v else v
    out = causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1).reshape(n, -1)
    out = out @ (w["o"].T if o_transposed else w["o"]) if o_proj else out
    x = x + out if attn_residual else out
    if post_norm:
        x = _rms(x, w["input_norm"], cfg["eps"])
    mlp_input = layer_input if parallel else x
    h = mlp_input if post_norm or not mlp_normed else _rms(mlp_input, post_weight, cfg["eps"])
    mlp = _swiglu(h, w["gate_up"], w["down"])
    x = x + mlp if mlp_residual else mlp
    return _rms(x, w["post_norm"], cfg["eps"]) if post_norm else x


def _run_layer(fn, layer, w, cfg, x):
    """The student's layer over _LAYER_STEPS of `x`, step by step with its own cache, and labkit's on the same
    weights: (got, expected)."""
    hidden, hkv, d = x.shape[1], cfg["num_kv_heads"], cfg["head_dim"]
    cache, labkit_cache = {"k": torch.empty(hkv, 0, d), "v": torch.empty(hkv, 0, d)}, KVCache(1)
    outs, expected, start = [], [], 0
    for n in _LAYER_STEPS:
        positions = torch.arange(start, start + n)
        step = x[start:start + n]
        out = expect_tensor(fn(step.clone(), positions, dict(w), cache, dict(cfg)), (n, hidden),
                            f"the layer's output for {n} new tokens [n, hidden]")
        stored = cache.get("k")
        if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != (hkv, start + n, d):
            raise ExerciseFailed(f"after {start + n} tokens the cache should hold [{hkv}, {start + n}, {d}] keys: "
                                 "hand the cache to attention_with_cache, which appends to it")
        cos, sin = rope_cos_sin(positions, rope_inv_freq(d, cfg["rope_theta"]), torch.float32)
        with torch.no_grad():
            expected.append(layer(step, cos, sin, step_metadata(1, n, start, "cpu"), labkit_cache))
        outs.append(out)
        start += n
    return torch.cat(outs), torch.cat(expected)


@exercise("05", "decoder_layer", forbidden=(*_LAYER_FORWARDS, "labkit_course.grading.labs.lab05._layer"))
def decoder_layer(ns):
    fn = require(ns, "decoder_layer")
    cfg = _LAYER_CONFIG
    layer, w = _layer_weights(54)
    x = torch.randn(sum(_LAYER_STEPS), cfg["num_heads"] * cfg["head_dim"], generator=seeded_generator(55))
    try:
        got, expected = _run_layer(fn, layer, w, cfg, x)
    except ExerciseFailed:
        raise
    except Exception as error:
        if "split" in str(error) or "shape" in str(error):
            raise ExerciseFailed(f"{raised_type(error)} on the merged qkv "
                                 f"weight ({w['qkv'].shape[0]} rows): it is (num_heads + 2 * num_kv_heads) * "
                                 "head_dim wide, so split it with head_dim, not the hidden size") from None
        raise
    if not tensors_close(got, expected, atol=1e-4):
        _name_layer_mistake(got, expected, x, w, cfg)
    _wide_heads(fn)
    return ("norm, merged QKV split by head_dim, rotary, cached attention, o_proj, SwiGLU, both residuals; "
            "also where heads are wider than the hidden size")


def _name_layer_mistake(got, expected, x, w, cfg):
    mistakes = (
        ({"attn_residual": False}, "the attention's residual is missing: x = x + attention(norm(x))"),
        ({"mlp_residual": False}, "the MLP's residual is missing: x = x + mlp(norm(x))"),
        ({"post_norm": True}, "that is a post-norm layer (normalise after adding); Llama normalises each "
                              "sublayer's input: x + f(norm(x))"),
        ({"one_norm": True}, "the MLP's input went through input_norm; it has its own weight, post_norm"),
        ({"rotate_k": False}, "the keys were not rotated: rotary goes on queries and keys alike"),
        ({"rotate_v": True}, "the values were rotated too: rotary goes on queries and keys only"),
        ({"o_proj": False}, "the output projection o was left out: the heads' outputs go through it"),
        ({"o_transposed": False}, "o was applied as out @ o: like every nn.Linear weight it is [out_features, "
                                  "in_features], so a layer computes out @ o.T"),
        ({"mlp_normed": False}, "the MLP read the un-normalised stream: it takes post_norm(x), "
                                "x = x + mlp(post_norm(x))"),
        ({"parallel": True}, "that is a parallel block (attention and MLP both read the layer's input); Llama "
                             "runs them in sequence: the MLP reads x after the attention's residual is added"),
    )
    for switches, why in mistakes:
        if tensors_close(got, _layer(x, w, cfg, **switches), atol=1e-4):
            raise ExerciseFailed(why)
    first = _LAYER_STEPS[0]
    if tensors_close(got[:first], expected[:first], atol=1e-4):
        raise ExerciseFailed("the prefill is right but later steps are not: each step's positions (given) "
                             "rotate its queries and keys, and the cache holds every earlier token")
    raise ExerciseFailed("the output differs from labkit's DecoderLayer on the same weights "
                         f"(max abs diff {(got - expected).abs().max():.3g}); check each step in Llama's order: "
                         "input_norm, qkv split by head_dim, rotary on q and k, cached attention, o, residual, "
                         "post_norm, SwiGLU, residual")


def _wide_heads(fn):
    """Right on SmolLM2's shape; now a layer whose heads are not hidden / num_heads wide (Qwen3-0.6B's case)."""
    cfg, hidden = _WIDE_HEADS_CONFIG, 32
    layer, w = _layer_weights(56, cfg, hidden)
    x = torch.randn(sum(_LAYER_STEPS), hidden, generator=seeded_generator(57))
    why = (f"with hidden {hidden}, {cfg['num_heads']} heads of head_dim {cfg['head_dim']} (not {hidden} / "
           f"{cfg['num_heads']} = {hidden // cfg['num_heads']}: Qwen3-0.6B has 16 heads of 128 on a 1024-wide "
           "stream)")
    groups = (f" (and this layer's GQA groups are {cfg['num_heads'] // cfg['num_kv_heads']} query heads per KV head, "
              "not SmolLM2's 3)")
    try:
        got, expected = _run_layer(fn, layer, w, cfg, x)
    except ExerciseFailed:
        raise
    except Exception as error:
        raise ExerciseFailed(f"your layer raised {raised_type(error)} {why}: take head_dim from config, never "
                             "hidden / num_heads; the heads' output is num_heads * head_dim wide, and o maps it back "
                             f"to hidden{groups}") from None
    if not tensors_close(got, expected, atol=1e-4):
        raise ExerciseFailed(f"right when hidden = num_heads * head_dim, wrong {why}: take head_dim from config, "
                             f"never hidden / num_heads{groups}")


@exercise("05", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers, smollm2_config

    smol = smollm2_config()
    fp32 = torch.finfo(torch.float32).bits // 8
    return grade_answers(ns, {
        1: Number(smol.num_heads // smol.num_kv_heads, "'Attention that reads and appends to a KV cache'"),
        2: Number(2 * smol.num_layers * smol.num_kv_heads * smol.head_dim * fp32,
                  "section 4: Lab 02's formula with one token and 4-byte elements"),
        3: Choice("a", "the RMSNorm exercise's formula"),
        4: Choice("b", "'The rotary embedding'"),
        5: Choice("b", "what the timings show, in section 3"),
        6: Number((smol.num_heads + 2 * smol.num_kv_heads) * smol.head_dim,
                  "'Two widths the nano-vLLM walk-through gets wrong': widths count head_dim per head"),
    })
