"""Lab 13: int8 weights per channel, an int8 KV block that fills over time, the GGUF's Q4_1 groups."""

import gguf
import numpy as np
import torch

from catalogue import Right, Wrong
from labkit.cache.kv_quant import INT8, store_quantized
from labkit.model.weight_formats import dequantize_q4_1, quantize_q4_1


# ---- quantize_per_channel --------------------------------------------------------------------
def per_channel_torch(w):
    scales = w.abs().amax(dim=1) / 127
    codes = torch.where(scales[:, None] > 0, w / scales[:, None], torch.zeros_like(w))
    return codes.round().clamp(-127, 127).to(torch.int8), scales


def per_channel_loop(w):
    codes, scales = torch.zeros(w.shape, dtype=torch.int8), torch.zeros(w.shape[0])
    for i, row in enumerate(w):
        biggest = max(abs(float(v)) for v in row)
        scales[i] = biggest / 127
        if biggest:
            codes[i] = torch.tensor([round(float(v) / scales[i].item()) for v in row], dtype=torch.int8)
    return codes, scales


def per_channel_numpy(w):
    a = w.numpy()
    scales = np.abs(a).max(axis=1, keepdims=True) / 127
    codes = np.rint(np.divide(a, scales, out=np.zeros_like(a), where=scales > 0)).astype(np.int8)
    return torch.from_numpy(codes), torch.from_numpy(scales[:, 0])


def per_tensor(w):
    scale = w.abs().max() / 127
    return (w / scale).round().to(torch.int8), scale.reshape(1)


def per_tensor_expanded(w):
    scale = w.abs().max() / 127
    return (w / scale).round().to(torch.int8), scale.expand(w.shape[0]).clone()


def per_column(w):
    scales = w.abs().amax(dim=0).clamp_min(1e-12) / 127
    return (w / scales).round().to(torch.int8), scales


def over_128(w):
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 128
    return (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8), scales


def truncates(w):
    scales = w.abs().amax(dim=1)
    return (w / scales.clamp_min(1e-12)[:, None] * 127).to(torch.int8), scales / 127


def largest_not_absolute(w):
    scales = w.amax(dim=1).clamp_min(1e-12) / 127
    return (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def epsilon_on_every_scale(w):
    scales = w.abs().amax(dim=1) / 127 + 1e-4
    return (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def float_codes(w):
    codes, scales = per_channel_torch(w)
    return codes.float(), scales


def torch_quantizer(w):
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.quantize_per_channel(w, scales.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return q.int_repr(), scales


# ---- append_to_block -------------------------------------------------------------------------
def append_torch(codes, scales, x, offset):
    old = torch.zeros_like(scales) if offset == 0 else scales
    new = torch.maximum(old, x.abs().amax(dim=-1) / 127)
    grown = (new > old) & (old > 0)
    if grown.any():
        ratio = torch.where(grown, old / new, torch.ones_like(new))
        codes[:offset] = (codes[:offset].float() * ratio[:, None]).round().to(torch.int8)
    safe = torch.where(new > 0, new, torch.ones_like(new))
    codes[offset] = (x / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, new


def append_per_head_loop(codes, scales, x, offset):
    scales = scales.clone()
    for h in range(scales.shape[0]):
        old = 0.0 if offset == 0 else scales[h].item()
        new = max(old, x[h].abs().max().item() / 127)
        if old > 0 and new > old:
            codes[:offset, h] = (codes[:offset, h].float() * (old / new)).round().to(torch.int8)
        codes[offset, h] = 0 if new == 0 else (x[h] / new).round().clamp(-127, 127).to(torch.int8)
        scales[h] = new
    return codes, scales


def append_with(codes, scales, x, offset, grow=True, rescale=True, reset=True, per_head=True, rounding=torch.round,
                rerounding=None):
    """The rule with one step left out or done wrong, as a student might."""
    rerounding = rerounding or rounding
    old = torch.zeros_like(scales) if offset == 0 and reset else scales
    head_max = x.abs().amax(-1) if per_head else x.abs().amax().expand(scales.shape)
    new = torch.maximum(old, head_max / 127) if grow else torch.where(old > 0, old, head_max / 127)
    if rescale:
        ratio = torch.where((new > old) & (old > 0), old / new.clamp_min(1e-30), torch.ones_like(new))
        codes[:offset] = rerounding(codes[:offset].float() * ratio[:, None]).to(torch.int8)
    codes[offset] = rounding(x / new.clamp_min(1e-30)[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, new


def append_inverse_ratio(codes, scales, x, offset):
    old = torch.zeros_like(scales) if offset == 0 else scales
    new = torch.maximum(old, x.abs().amax(dim=-1) / 127)
    ratio = torch.where((new > old) & (old > 0), new / old.clamp_min(1e-30), torch.ones_like(new))
    codes[:offset] = (codes[:offset].float() * ratio[:, None]).round().clamp(-127, 127).to(torch.int8)
    codes[offset] = (x / new.clamp_min(1e-30)[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, new


def append_with_the_new_token_only(codes, scales, x, offset):
    new = x.abs().amax(dim=-1).clamp_min(1e-12) / 127  # shrinks when a small token follows a large one
    codes[offset] = (x / new[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, new


def append_with_labkit(codes, scales, x, offset):
    one_block = scales[None].clone()
    store_quantized(INT8, x[None], codes[None], one_block, torch.tensor([offset]))
    return codes, one_block[0]


# ---- decode_q4_1 -----------------------------------------------------------------------------
def decode_numpy(raw):
    blocks = raw.numpy().reshape(-1, 20)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
    return torch.from_numpy((d * q + m).reshape(-1))


def decode_torch(raw):
    blocks = raw.view(-1, 20)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    qs = blocks[:, 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=1).float()
    return (d * q + m).flatten()


def decode_struct(raw):
    import struct

    data, out = bytes(raw.tolist()), []
    for start in range(0, len(data), 20):
        d, m = struct.unpack_from("<ee", data, start)
        qs = data[start + 4:start + 20]
        out += [d * (b & 15) + m for b in qs] + [d * (b >> 4) + m for b in qs]
    return torch.tensor(out, dtype=torch.float32)


def _decode_with(raw, order, header=(0, 2), offset=None, sign=1):
    blocks = raw.numpy().reshape(-1, 20)
    d = blocks[:, header[0]:header[0] + 2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, header[1]:header[1] + 2].copy().view(np.float16).astype(np.float32)
    low, high = blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4
    if order == "interleaved":
        q = np.stack([low, high], axis=2).reshape(len(blocks), 32)
    else:
        q = np.concatenate([high, low] if order == "high first" else [low, high], axis=1)
    q = q.astype(np.float32)
    w = d * (q - offset) if offset is not None else d * q + sign * m
    return torch.from_numpy(w.reshape(-1))


def decode_in_float16(raw):
    return decode_torch(raw).half()


def decode_in_groups(raw):
    return decode_torch(raw).view(-1, 32)


def decode_with_gguf(raw):
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy().reshape(-1, 20), gguf.GGMLQuantizationType.Q4_1)
                            .reshape(-1).copy())


# ---- encode_q4_1 -----------------------------------------------------------------------------
def encode_numpy(w):
    groups = w.numpy().reshape(-1, 32)
    lo, hi = groups.min(axis=1, keepdims=True), groups.max(axis=1, keepdims=True)
    d = (hi - lo) / 15
    inverse = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint((groups - lo) * inverse), 0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    header = np.concatenate([d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8)], axis=1)
    return torch.from_numpy(np.concatenate([header, packed], axis=1).reshape(-1))


def encode_loop(w):
    import struct

    out = bytearray()
    for group in w.view(-1, 32).tolist():
        lo, hi = min(group), max(group)
        d = (hi - lo) / 15
        codes = [0 if d == 0 else min(15, max(0, round((v - lo) / d))) for v in group]
        out += struct.pack("<ee", d, lo) + bytes(codes[j] | codes[j + 16] << 4 for j in range(16))
    return torch.tensor(list(out), dtype=torch.uint8)


def _encode_with(w, steps=15, minimum=True, rounding=np.rint, interleave=False, per_group=True):
    groups = w.numpy().reshape(-1, 32)
    axis_values = groups if per_group else np.broadcast_to(groups.reshape(1, -1), (len(groups), groups.size))
    lo = axis_values.min(axis=1, keepdims=True) if minimum else np.zeros((len(groups), 1), np.float32)
    hi = axis_values.max(axis=1, keepdims=True)
    d = (hi - lo) / steps
    inverse = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(rounding((groups - lo) * inverse), 0, 15).astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)) if interleave else (q[:, :16] | (q[:, 16:] << 4))
    header = np.concatenate([d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8)], axis=1)
    return torch.from_numpy(np.concatenate([header, packed], axis=1).reshape(-1).astype(np.uint8))


def encode_nan_on_constant_groups(w):
    groups = w.numpy().reshape(-1, 32)
    lo, hi = groups.min(axis=1, keepdims=True), groups.max(axis=1, keepdims=True)
    d = (hi - lo) / 15
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.nan_to_num(np.rint((groups - lo) / d)).clip(0, 15).astype(np.uint8)
        d = np.where(d == 0, np.nan, d)
    header = np.concatenate([d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8)], axis=1)
    return torch.from_numpy(np.concatenate([header, q[:, :16] | (q[:, 16:] << 4)], axis=1).reshape(-1))


def per_channel_in_place(w):
    scales = w.abs().amax(dim=1) / 127
    safe = torch.where(scales > 0, scales, 1.0)
    return w.div_(safe[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales


def decode_masking_in_place(raw):
    blocks = raw.view(-1, 20)
    high = blocks[:, 4:] >> 4
    blocks[:, 4:] &= 15  # the caller's bytes lose their high nibbles
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * torch.cat([blocks[:, 4:], high], dim=1).float() + m).flatten()


def decode_with_labkit(raw):
    blocks = raw.view(-1, 20)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    codes = torch.cat([blocks[:, 4:] & 15, blocks[:, 4:] >> 4], dim=1)
    return dequantize_q4_1(codes, d, m).flatten()


def encode_subtracting_in_place(w):
    groups = w.view(-1, 32)
    lo = groups.amin(1, keepdim=True).clone()
    groups -= lo  # the caller's weights are now w - m
    return encode_numpy(groups.add(lo).reshape(-1))


def encode_with_labkit(w):
    codes, d, m = quantize_q4_1(w.view(-1, 32))
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    header = torch.cat([d.half().view(torch.uint8).view(-1, 2), m.half().view(torch.uint8).view(-1, 2)], dim=1)
    return torch.cat([header, packed], dim=1).reshape(-1)


def encode_high_nibble_first(w):
    raw = encode_numpy(w).view(-1, 20).clone()
    raw[:, 4:] = (raw[:, 4:] >> 4) | (raw[:, 4:] << 4)
    return raw.reshape(-1)


def encode_m_first(w):
    raw = encode_numpy(w).view(-1, 20)
    return torch.cat([raw[:, 2:4], raw[:, 0:2], raw[:, 4:]], dim=1).reshape(-1)


def encode_with_gguf(w):
    raw = gguf.quants.quantize(w.numpy().reshape(-1, 32), gguf.GGMLQuantizationType.Q4_1)
    return torch.from_numpy(raw.reshape(-1).copy())


RIGHT = [
    Right("quantize_per_channel", "torch, a where for zero rows", per_channel_torch),
    Right("quantize_per_channel", "a Python loop over rows", per_channel_loop),
    Right("quantize_per_channel", "numpy with a guarded divide", per_channel_numpy),
    Right("append_to_block", "vectorized over heads", append_torch),
    Right("append_to_block", "a loop over heads", append_per_head_loop),
    Right("decode_q4_1", "numpy views", decode_numpy),
    Right("decode_q4_1", "torch views", decode_torch),
    Right("decode_q4_1", "struct, byte by byte", decode_struct),
    Right("encode_q4_1", "numpy, vectorized", encode_numpy),
    Right("encode_q4_1", "struct, group by group", encode_loop),
]

WRONG = [
    Wrong("quantize_per_channel", "divides the caller's weight in place", per_channel_in_place,
          "changed the weight it was given"),
    Wrong("quantize_per_channel", "scales kept as a column", lambda w: (per_channel_torch(w)[0],
                                                                      per_channel_torch(w)[1][:, None]),
          "a float32 vector of shape"),
    Wrong("quantize_per_channel", "float64 scales",
          lambda w: (per_channel_torch(w)[0], per_channel_torch(w)[1].double()), "a float32 vector of shape"),
    Wrong("decode_q4_1", "masks the caller's bytes in place", decode_masking_in_place,
          "changed the bytes it was given"),
    Wrong("decode_q4_1", "labkit's dequantize_q4_1 on the unpacked codes", decode_with_labkit, "`dequantize_q4_1`",
          calls="labkit.model.weight_formats.dequantize_q4_1"),
    Wrong("encode_q4_1", "subtracts the minimum in place", encode_subtracting_in_place,
          "changed the weights it was given"),
    Wrong("encode_q4_1", "labkit's quantize_q4_1, then packs", encode_with_labkit, "`quantize_q4_1`",
          calls="labkit.model.weight_formats.quantize_q4_1"),
    Wrong("encode_q4_1", "high nibble first", encode_high_nibble_first, "you swapped them"),
    Wrong("encode_q4_1", "m before d in the header", encode_m_first, "you wrote m first"),
    Wrong("quantize_per_channel", "one scale for the matrix", per_tensor, "one scale for the whole matrix"),
    Wrong("quantize_per_channel", "one scale for the matrix, repeated per row", per_tensor_expanded,
          "scales differ from max|w| / 127 per row"),
    Wrong("quantize_per_channel", "per input channel", per_column, "one per input column"),
    Wrong("quantize_per_channel", "divides by 128", over_128, "you divided by 128 or 255"),
    Wrong("quantize_per_channel", "truncates instead of rounding", truncates, "casting to int8 truncates"),
    Wrong("quantize_per_channel", "largest w, not largest |w|", largest_not_absolute, "not the largest |w|"),
    Wrong("quantize_per_channel", "an epsilon on every scale", epsilon_on_every_scale, "guard only the all-zero rows"),
    Wrong("quantize_per_channel", "returns float codes", float_codes, "must be an int8 tensor"),
    Wrong("quantize_per_channel", "calls torch.quantize_per_channel", torch_quantizer,
          "`torch.quantize_per_channel`", calls="torch.quantize_per_channel"),
    Wrong("append_to_block", "a fixed scale that clips", lambda *a: append_with(*a, grow=False),
          "got clipped: grow the scale"),
    Wrong("append_to_block", "grows without re-rounding old codes", lambda *a: append_with(*a, rescale=False),
          "re-round them to the new one"),
    Wrong("append_to_block", "keeps a freed block's scale", lambda *a: append_with(*a, reset=False),
          "offset 0 starts the block over"),
    Wrong("append_to_block", "one scale per block", lambda *a: append_with(*a, per_head=False),
          "one scale per KV head"),
    Wrong("append_to_block", "casts without rounding", lambda *a: append_with(*a, rounding=torch.trunc),
          "without rounding"),
    Wrong("append_to_block", "rounds new codes, truncates the re-scaled old ones",
          lambda *a: append_with(*a, rerounding=torch.trunc), "the old codes (code x old / new) were cast"),
    Wrong("append_to_block", "truncates the new token's codes only",
          lambda *a: append_with(*a, rounding=torch.trunc, rerounding=torch.round), "the new token's codes were cast"),
    Wrong("append_to_block", "re-rounds old codes with the inverse ratio (new / old)",
          append_inverse_ratio, "the scales are right, but the code written at offset"),
    Wrong("append_to_block", "the new token's scale only", append_with_the_new_token_only, "may only grow"),
    Wrong("append_to_block", "calls labkit's store_quantized", append_with_labkit, "`store_quantized`",
          calls="labkit.cache.kv_quant.store_quantized"),
    Wrong("decode_q4_1", "interleaved nibbles", lambda raw: _decode_with(raw, "interleaved"), "not neighbours 2j"),
    Wrong("decode_q4_1", "high nibble first", lambda raw: _decode_with(raw, "high first"), "low nibble comes first"),
    Wrong("decode_q4_1", "d and m swapped", lambda raw: _decode_with(raw, "halves", header=(2, 0)), "swapped them"),
    Wrong("decode_q4_1", "Q4_0's formula", lambda raw: _decode_with(raw, "halves", offset=8), "Q4_0's"),
    Wrong("decode_q4_1", "subtracts the minimum", lambda raw: _decode_with(raw, "halves", sign=-1), "not minus"),
    Wrong("decode_q4_1", "float16 arithmetic", decode_in_float16, "return float32 weights"),
    Wrong("decode_q4_1", "one row per group", decode_in_groups, "return the weights flat"),
    Wrong("decode_q4_1", "calls gguf's dequantize", decode_with_gguf, "`gguf.quants.dequantize`",
          calls="gguf.quants.dequantize"),
    Wrong("encode_q4_1", "16 steps", lambda w: _encode_with(w, steps=16), "15 steps between them"),
    Wrong("encode_q4_1", "no minimum", lambda w: _encode_with(w, minimum=False), "m is 0"),
    Wrong("encode_q4_1", "truncates", lambda w: _encode_with(w, rounding=np.floor), "do not truncate"),
    Wrong("encode_q4_1", "packs neighbours", lambda w: _encode_with(w, interleave=True), "not neighbours 2j"),
    Wrong("encode_q4_1", "one d and m for the tensor", lambda w: _encode_with(w, per_group=False),
          "must be the group's minimum"),
    Wrong("encode_q4_1", "NaN on a constant group", encode_nan_on_constant_groups, "d is NaN or inf"),
    Wrong("encode_q4_1", "calls gguf's quantize", encode_with_gguf, "`gguf.quants.quantize`",
          calls="gguf.quants.quantize"),
]
