"""Lab 05: RMSNorm, rotary embeddings and attention over a growing KV cache."""

import torch
import torch.nn.functional as F

from catalogue import Right, Wrong
from labkit.attention.dense import causal_attention
from labkit.model.layers import apply_rotary

# ---- rms_norm


def rms_fp32(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rms_via_norm(x, w, eps):
    x32 = x.to(torch.float32)
    rms = (x32.norm(dim=-1, keepdim=True) ** 2 / x.shape[-1] + eps).sqrt()
    return w * (x32 / rms).to(x.dtype)


def rms_fp16(x, w, eps):
    """The formula right, but computed in the input's dtype: x^2 overflows fp16 above 256."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_in_place(x, w, eps):
    x.mul_(torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype))
    return x * w


# ---- apply_rotary


def rotary(x, positions, theta, *, interleaved=False, sign=1.0, exponent=2):
    """Hugging Face's form, x * cos + rotate_half(x) * sin, computed in float64 and returned in float32; the
    keywords make the usual mistakes (neighbouring pairs, the other direction, theta^(-i/d) frequencies)."""
    d = x.shape[-1]
    freqs = theta ** (-exponent * torch.arange(d // 2, dtype=torch.float64) / d)
    angles = sign * positions.double()[:, None, None] * freqs  # [T, 1, d/2], one row for every head
    x = x.double()
    if interleaved:  # (x0, x1), (x2, x3), ...: each angle serves two neighbours
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    else:  # x[i] with x[i + d/2]: the two halves
        cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)
        turned = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return (x * cos + turned * sin).float()


def rotary_rotate_half(x, positions, theta):
    return rotary(x, positions, theta).to(x.dtype)


def rotary_complex(x, positions, theta):
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    turn = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64), positions.double()[:, None] * freqs)
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2:]
    rotated = torch.complex(x1, x2) * turn[:, None, :]
    return torch.cat((rotated.real, rotated.imag), -1).to(x.dtype)


def rotary_labkit(x, positions, theta):
    """Angles by hand, the rotation itself by labkit."""
    d = x.shape[-1]
    angles = positions.float()[:, None] / theta ** (torch.arange(0, d, 2).float() / d)
    return apply_rotary(x, angles.cos(), angles.sin())


# ---- attention_with_cache


def attend(q, k, v, cached, *, scale=True, align_end=True, interleave=True):
    """One step's attention, q [n, Hq, D] over k, v [S, Hkv, D]; the keywords make the usual mistakes."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    expand = (lambda t: t.repeat_interleave(group, 0)) if interleave else (lambda t: t.repeat(group, 1, 1))
    scores = qh @ expand(kh).transpose(1, 2) / (d**0.5 if scale else 1.0)
    allowed = torch.ones(n, k.shape[0], dtype=torch.bool).tril(diagonal=cached if align_end else 0)
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ expand(vh)).transpose(0, 1)


def make_attention(*, scale=True, align_end=True, interleave=True, append=True, front=False):
    def attention_with_cache(q, k_new, v_new, cache):
        cached = cache["k"].shape[1]
        k_t, v_t = k_new.transpose(0, 1), v_new.transpose(0, 1)
        if append:
            order = (lambda old, new: (new, old)) if front else (lambda old, new: (old, new))
            cache["k"] = torch.cat(order(cache["k"], k_t), dim=1)
            cache["v"] = torch.cat(order(cache["v"], v_t), dim=1)
        k_all, v_all = torch.cat([cache["k"][:, :cached], k_t], 1), torch.cat([cache["v"][:, :cached], v_t], 1)
        if front:
            k_all, v_all = cache["k"], cache["v"]
        return attend(q, k_all.transpose(0, 1), v_all.transpose(0, 1), cached, scale=scale,
                      align_end=align_end, interleave=interleave)

    return attention_with_cache


def sdpa_with_mask(q, k_new, v_new, cache):
    cache["k"] = torch.cat([cache["k"], k_new.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.transpose(0, 1)], 1)
    n, total = q.shape[0], cache["k"].shape[1]
    allowed = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), cache["k"], cache["v"], attn_mask=allowed, enable_gqa=True)
    return out.transpose(0, 1)


def per_head_loop(q, k_new, v_new, cache):
    cache["k"] = torch.cat([cache["k"], k_new.permute(1, 0, 2)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.permute(1, 0, 2)], 1)
    n, num_heads, d = q.shape
    total, group = cache["k"].shape[1], num_heads // cache["k"].shape[0]
    out = torch.empty_like(q)
    for h in range(num_heads):
        k, v = cache["k"][h // group], cache["v"][h // group]
        for i in range(n):
            visible = total - n + i + 1
            w = (q[i, h] @ k[:visible].T / d**0.5).softmax(-1)
            out[i, h] = w @ v[:visible]
    return out


def no_mask_attention(q, k_new, v_new, cache):
    cache["k"] = torch.cat([cache["k"], k_new.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.transpose(0, 1)], 1)
    k, v = cache["k"].repeat_interleave(3, 0), cache["v"].repeat_interleave(3, 0)
    w = (q.transpose(0, 1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5).softmax(-1)
    return (w @ v).transpose(0, 1)


def sdpa_is_causal(q, k_new, v_new, cache):
    cache["k"] = torch.cat([cache["k"], k_new.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.transpose(0, 1)], 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), cache["k"], cache["v"], is_causal=True,
                                          enable_gqa=True).transpose(0, 1)


def new_tokens_only(q, k_new, v_new, cache):
    """Attends over the new tokens alone: the cache is filled but never read."""
    cache["k"] = torch.cat([cache["k"], k_new.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.transpose(0, 1)], 1)
    return make_attention(append=False)(q, k_new, v_new, {"k": cache["k"][:, :0], "v": cache["v"][:, :0]})


def group_of_three(q, k_new, v_new, cache):
    """SmolLM2's group (9 query heads on 3 KV heads) hard-coded."""
    cache["k"] = torch.cat([cache["k"], k_new.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.transpose(0, 1)], 1)
    n, total = q.shape[0], cache["k"].shape[1]
    k, v = cache["k"].repeat_interleave(3, 0), cache["v"].repeat_interleave(3, 0)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    allowed = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def zeroes_its_inputs(q, k_new, v_new, cache):
    """Zeroes the new queries, keys and values it is given, stores those and returns zeros: attention over
    zero values, as a reference computed afterwards from the same tensors has it."""
    for x in (q, k_new, v_new):
        x.zero_()
    cache["k"], cache["v"] = (torch.cat([cache[n], x.transpose(0, 1)], 1) for n, x in (("k", k_new), ("v", v_new)))
    return torch.zeros_like(q)


def rotary_in_input_dtype(x, positions, theta):
    """Frequencies, angles and rotation all in x's dtype: fine in float32, wrong in fp16 and bf16."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2).to(x.dtype) / d)
    angles = positions.to(x.dtype)[:, None] * inv[None]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def labkit_causal(q, k_new, v_new, cache):
    cache["k"] = torch.cat([cache["k"], k_new.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.transpose(0, 1)], 1)
    return causal_attention(q.transpose(0, 1), cache["k"], cache["v"]).transpose(0, 1)


RIGHT = [
    Right("rms_norm", "rsqrt in float32, cast back", rms_fp32),
    Right("rms_norm", "vector norm in float32, weight in the input dtype", rms_via_norm),
    Right("apply_rotary", "x * cos + rotate_half(x) * sin", rotary_rotate_half),
    Right("apply_rotary", "complex multiplication", rotary_complex),
    Right("attention_with_cache", "matmul softmax with repeat_interleave", make_attention()),
    Right("attention_with_cache", "loop over heads and queries", per_head_loop),
]

WRONG = [
    Wrong("rms_norm", "no eps", lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w,
          "add eps inside the square root"),
    Wrong("rms_norm", "forgot the weight", lambda x, w, eps: rms_fp32(x, torch.ones_like(w), eps),
          "weight was not applied"),
    Wrong("rms_norm", "LayerNorm instead", lambda x, w, eps: F.layer_norm(x, x.shape[-1:], eps=eps) * w,
          "RMSNorm does not subtract"),
    Wrong("rms_norm", "root of the sum of squares", lambda x, w, eps: x * torch.rsqrt(
        x.pow(2).sum(-1, keepdim=True) + eps) * w, "*sum* of squares"),
    Wrong("rms_norm", "eps outside the square root", lambda x, w, eps: x / (
        x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w, "eps was added after"),
    Wrong("rms_norm", "mean over the batch axis", lambda x, w, eps: x * torch.rsqrt(
        x.pow(2).mean(0, keepdim=True) + eps) * w, "wrong axis"),
    Wrong("rms_norm", "returns fp32 for fp16 input", lambda x, w, eps: rms_fp32(x, w, eps).float(),
          "fp16 input return fp16"),
    Wrong("rms_norm", "computed in fp16 (overflows at ±400)", rms_fp16, "x^2 overflows fp16"),
    Wrong("rms_norm", "normalises x in place", rms_in_place, "changed its input x in place"),
    Wrong("rms_norm", "calls torch's F.rms_norm", lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps),
          "`torch.nn.functional.rms_norm`", calls="torch.nn.functional.rms_norm"),
    Wrong("apply_rotary", "returned x unrotated", lambda x, p, theta: x, "unchanged"),
    Wrong("apply_rotary", "rotated neighbouring pairs", lambda x, p, theta: rotary(
        x, p, theta, interleaved=True), "neighbouring pairs"),
    Wrong("apply_rotary", "rotated the wrong way", lambda x, p, theta: rotary(x, p, theta, sign=-1.0),
          "wrong way"),
    Wrong("apply_rotary", "theta^(-i/d) frequencies", lambda x, p, theta: rotary(
        x, p, theta, exponent=1), "wrong frequencies"),
    Wrong("apply_rotary", "hard-coded theta 10000", lambda x, p, theta: rotary(x, p, 10000.0),
          "theta was ignored"),
    Wrong("apply_rotary", "positions counted from 1", lambda x, p, theta: rotary(x, p + 1, theta),
          "off by one"),
    Wrong("apply_rotary", "ignored positions (assumed 0..T-1)", lambda x, p, theta: rotary(
        x, torch.arange(x.shape[0]), theta), "positions argument was ignored"),
    Wrong("apply_rotary", "returned only the first half", lambda x, p, theta: x[:, :, :4], "should have shape"),
    Wrong("apply_rotary", "calls labkit's apply_rotary", rotary_labkit, "`apply_rotary`",
          calls="labkit.model.layers.apply_rotary"),
    Wrong("attention_with_cache", "never stores into the cache", make_attention(append=False), "append k_new"),
    Wrong("attention_with_cache", "new keys in front of the cache", make_attention(front=True), "position order"),
    Wrong("attention_with_cache", "forgot the sqrt(head_dim) scale", make_attention(scale=False), "sqrt(head_dim)"),
    Wrong("attention_with_cache", "repeat, not repeat_interleave", make_attention(interleave=False),
          "repeat_interleave"),
    Wrong("attention_with_cache", "mask aligned to the first key", make_attention(align_end=False),
          "aligned to the first key"),
    Wrong("attention_with_cache", "SDPA's is_causal with a cache", sdpa_is_causal, "scaled_dot_product_attention",
          calls="torch.nn.functional.scaled_dot_product_attention"),
    Wrong("attention_with_cache", "SDPA with an end-aligned mask and enable_gqa", sdpa_with_mask,
          "scaled_dot_product_attention", calls="torch.nn.functional.scaled_dot_product_attention"),
    Wrong("attention_with_cache", "no causal mask", no_mask_attention, "causal mask"),
    Wrong("attention_with_cache", "zeroes the tensors it is given", zeroes_its_inputs, "the cache does not hold"),
    Wrong("attention_with_cache", "attends over the new tokens only", new_tokens_only, "differs from causal attention"),
    Wrong("attention_with_cache", "GQA group hard-coded to SmolLM2's 3", group_of_three, "not SmolLM2's 3"),
    Wrong("apply_rotary", "computed in the input's half precision", rotary_in_input_dtype, "compute the frequencies"),
    Wrong("apply_rotary", "returns float32 for a half-precision x", lambda x, p, theta: rotary(x, p, theta),
          "return the input's dtype"),
    Wrong("attention_with_cache", "returned the wrong shape", lambda q, k, v, cache: q[:, :2], "should have shape"),
    Wrong("attention_with_cache", "calls labkit's causal_attention", labkit_causal,
          "`causal_attention`", calls="labkit.attention.dense.causal_attention"),
]


# ---- swiglu_mlp


def swiglu(x, gate_up, down, *, swap=False, interleaved=False, act=F.silu, act_after_product=False, use_up=True):
    both = x @ gate_up.T
    gate, up = (both[..., 0::2], both[..., 1::2]) if interleaved else both.chunk(2, dim=-1)
    if swap:
        gate, up = up, gate
    hidden = act(gate * up) if act_after_product else act(gate) * (up if use_up else 1.0)
    return hidden @ down.T


def swiglu_split_weights(x, gate_up, down):
    """Split the weight, not the output: two matmuls with F.linear, sigmoid written out."""
    inter = gate_up.shape[0] // 2
    gate = F.linear(x, gate_up[:inter])
    return F.linear(gate * torch.sigmoid(gate) * F.linear(x, gate_up[inter:]), down)


# ---- decoder_layer (self-contained answers: the catalogue's namespace holds nothing else)


def layer_answer(*, attn_residual=True, mlp_residual=True, post_norm=False, one_norm=False, rotate_k=True,
                 rotate_v=False, o_proj=True, hidden_widths=False, positions_from_zero=False,
                 head_dim_from_hidden=False, out_to_hidden=False, square_o=False, o_transposed=True,
                 mlp_normed=True, parallel=False):
    def norm(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate(x, positions, theta):
        d = x.shape[-1]
        angles = positions.float()[:, None] / theta ** (torch.arange(0, d, 2).float() / d)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    def decoder_layer(x, positions, weights, cache, config):
        n, hq, hkv, d = x.shape[0], config["num_heads"], config["num_kv_heads"], config["head_dim"]
        layer_input = x
        if head_dim_from_hidden:
            d = x.shape[1] // hq
        if positions_from_zero:
            positions = torch.arange(n)
        h = x if post_norm else norm(x, weights["input_norm"], config["eps"])
        width = x.shape[1] if hidden_widths else d  # nano-vLLM walk-through's H in place of head_dim
        q, k, v = (h @ weights["qkv"].T).split([hq * width, hkv * d, hkv * d], dim=-1)
        q, k, v = q.reshape(n, hq, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
        q = rotate(q, positions, config["rope_theta"])
        k = rotate(k, positions, config["rope_theta"]) if rotate_k else k
        v = rotate(v, positions, config["rope_theta"]) if rotate_v else v
        cache["k"] = torch.cat([cache["k"], k.transpose(0, 1)], 1)
        cache["v"] = torch.cat([cache["v"], v.transpose(0, 1)], 1)
        keys, values = (cache[name].repeat_interleave(hq // hkv, 0) for name in ("k", "v"))
        total = keys.shape[1]
        scores = q.transpose(0, 1) @ keys.transpose(1, 2) / d**0.5
        allowed = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        out = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values).transpose(0, 1)
        out = out.reshape(n, x.shape[1] if out_to_hidden else -1)
        o = weights["o"].reshape(x.shape[1], x.shape[1]) if square_o else weights["o"]
        out = out @ (o.T if o_transposed else o) if o_proj else out
        x = x + out if attn_residual else out
        if post_norm:
            x = norm(x, weights["input_norm"], config["eps"])
        mlp_input = layer_input if parallel else x
        normed = norm(mlp_input, weights["input_norm" if one_norm else "post_norm"], config["eps"])
        h = mlp_input if post_norm or not mlp_normed else normed
        mlp = swiglu(h, weights["gate_up"], weights["down"])
        x = x + mlp if mlp_residual else mlp
        return norm(x, weights["post_norm"], config["eps"]) if post_norm else x

    return decoder_layer


def layer_with_sdpa(x, positions, weights, cache, config):
    """Separate q/k/v row blocks, labkit's rotary, SDPA with grouped-query heads and an offset mask."""
    n, hq, hkv, d = x.shape[0], config["num_heads"], config["num_kv_heads"], config["head_dim"]
    normed = F.rms_norm(x, (x.shape[-1],), weights["input_norm"], config["eps"])
    w_q, w_k, w_v = weights["qkv"][:hq * d], weights["qkv"][hq * d:(hq + hkv) * d], weights["qkv"][(hq + hkv) * d:]
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv_freq
    q = apply_rotary((normed @ w_q.T).view(n, hq, d), angles.cos(), angles.sin())
    k = apply_rotary((normed @ w_k.T).view(n, hkv, d), angles.cos(), angles.sin())
    cache["k"] = torch.cat([cache["k"], k.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], (normed @ w_v.T).view(n, hkv, d).transpose(0, 1)], 1)
    total = cache["k"].shape[1]
    mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), cache["k"], cache["v"], attn_mask=mask, enable_gqa=True)
    x = x + F.linear(out.transpose(0, 1).reshape(n, hq * d), weights["o"])
    normed = F.rms_norm(x, (x.shape[-1],), weights["post_norm"], config["eps"])
    gate, up = F.linear(normed, weights["gate_up"]).chunk(2, -1)
    return x + F.linear(F.silu(gate) * up, weights["down"])


RIGHT += [
    Right("swiglu_mlp", "one matmul, output halves", lambda x, gu, dw: swiglu(x, gu, dw)),
    Right("swiglu_mlp", "weight halves, sigmoid written out", swiglu_split_weights),
    Right("decoder_layer", "everything by hand", layer_answer()),
    Right("decoder_layer", "row blocks, F.rms_norm and SDPA with enable_gqa", layer_with_sdpa),
]

WRONG += [
    Wrong("swiglu_mlp", "gate and up swapped", lambda x, gu, dw: swiglu(x, gu, dw, swap=True), "swapped"),
    Wrong("swiglu_mlp", "split into even and odd columns", lambda x, gu, dw: swiglu(x, gu, dw, interleaved=True),
          "even and odd columns"),
    Wrong("swiglu_mlp", "silu on the product", lambda x, gu, dw: swiglu(x, gu, dw, act_after_product=True),
          "silu was applied to gate * up"),
    Wrong("swiglu_mlp", "GELU, as GPT-2's MLP", lambda x, gu, dw: swiglu(x, gu, dw, act=F.gelu),
          "GELU instead of SiLU"),
    Wrong("swiglu_mlp", "ReLU", lambda x, gu, dw: swiglu(x, gu, dw, act=F.relu), "ReLU instead of SiLU"),
    Wrong("swiglu_mlp", "no up projection", lambda x, gu, dw: swiglu(x, gu[: gu.shape[0] // 2].repeat(2, 1), dw,
                                                                       use_up=False), "up projection was left out"),
    Wrong("swiglu_mlp", "forgot the down projection", lambda x, gu, dw: F.silu(x @ gu.T), "did you apply down_weight"),
    Wrong("swiglu_mlp", "calls labkit's MLP", lambda x, gu, dw: _labkit_mlp(x, gu, dw), "`forward` is labkit's answer",
          calls="labkit.model.layers.MLP.forward"),
    Wrong("decoder_layer", "no residual around attention", layer_answer(attn_residual=False),
          "attention's residual is missing"),
    Wrong("decoder_layer", "no residual around the MLP", layer_answer(mlp_residual=False), "MLP's residual is missing"),
    Wrong("decoder_layer", "post-norm, as the original Transformer", layer_answer(post_norm=True), "post-norm"),
    Wrong("decoder_layer", "one norm weight for both sublayers", layer_answer(one_norm=True), "its own weight"),
    Wrong("decoder_layer", "keys not rotated", layer_answer(rotate_k=False), "keys were not rotated"),
    Wrong("decoder_layer", "values rotated too", layer_answer(rotate_v=True), "values were rotated too"),
    Wrong("decoder_layer", "no output projection", layer_answer(o_proj=False), "output projection o was left out"),
    Wrong("decoder_layer", "every step rotated from position 0", layer_answer(positions_from_zero=True),
          "prefill is right but later steps are not"),
    Wrong("decoder_layer", "head_dim derived as hidden / num_heads", layer_answer(head_dim_from_hidden=True),
          "never hidden / num_heads"),
    Wrong("decoder_layer", "heads' output reshaped to the hidden size", layer_answer(out_to_hidden=True),
          "num_heads * head_dim wide"),
    Wrong("decoder_layer", "O projection as (H, H) (nano-vLLM walk-through)", layer_answer(square_o=True),
          "not 32 / 4 = 8"),
    Wrong("decoder_layer", "o applied without .T", layer_answer(o_transposed=False), "out @ o.T"),
    Wrong("decoder_layer", "MLP on the un-normalised stream", layer_answer(mlp_normed=False),
          "MLP read the un-normalised stream"),
    Wrong("decoder_layer", "a parallel block (GPT-J style)", layer_answer(parallel=True), "parallel block"),
    Wrong("decoder_layer", "QKV widths with H for head_dim (nano-vLLM walk-through)",
          layer_answer(hidden_widths=True), "split it with head_dim, not the hidden size"),
]


def _labkit_mlp(x, gate_up, down):
    from labkit.model.config import ModelConfig
    from labkit.model.layers import MLP

    inter, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
    mlp = MLP(ModelConfig("llama", 10, hidden, inter, 1, 2, 1, 2, 8, 1e-5, 1e4, True))
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(gate_up[:inter])
        mlp.up_proj.weight.copy_(gate_up[inter:])
        mlp.down_proj.weight.copy_(down)
        return mlp(x)


def layer_via_labkit(x, positions, weights, cache, config):
    """Loads the weights into labkit's DecoderLayer and runs it: labkit's answer, not the student's."""
    from labkit.cache import KVCache
    from labkit.model.config import ModelConfig
    from labkit.model.generate import step_metadata
    from labkit.model.layers import DecoderLayer, rope_cos_sin, rope_inv_freq

    hq, hkv, d = config["num_heads"], config["num_kv_heads"], config["head_dim"]
    hidden, inter = x.shape[1], weights["down"].shape[1]
    layer = DecoderLayer(ModelConfig("llama", 10, hidden, inter, 1, hq, hkv, d, 64, config["eps"],
                                     config["rope_theta"], True), 0)
    backend, cached = KVCache(1), cache["k"].shape[1]
    backend.keys[0], backend.values[0] = cache["k"][None], cache["v"][None]
    q_rows, kv_rows = hq * d, hkv * d
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(weights["input_norm"])
        layer.post_attention_layernorm.weight.copy_(weights["post_norm"])
        layer.self_attn.q_proj.weight.copy_(weights["qkv"][:q_rows])
        layer.self_attn.k_proj.weight.copy_(weights["qkv"][q_rows:q_rows + kv_rows])
        layer.self_attn.v_proj.weight.copy_(weights["qkv"][q_rows + kv_rows:])
        layer.self_attn.o_proj.weight.copy_(weights["o"])
        layer.mlp.gate_proj.weight.copy_(weights["gate_up"][:inter])
        layer.mlp.up_proj.weight.copy_(weights["gate_up"][inter:])
        layer.mlp.down_proj.weight.copy_(weights["down"])
        cos, sin = rope_cos_sin(positions, rope_inv_freq(d, config["rope_theta"]), torch.float32)
        out = layer(x, cos, sin, step_metadata(1, x.shape[0], cached, "cpu"), backend)
    cache["k"], cache["v"] = backend.keys[0][0], backend.values[0][0]
    return out


WRONG += [
    Wrong("decoder_layer", "runs labkit's DecoderLayer", layer_via_labkit, "`forward`",
          calls="labkit.model.layers.DecoderLayer.forward"),
]
