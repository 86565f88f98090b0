"""Lab 13: quantization. An int8 KV block whose scale grows as it fills, int8 weights per output
channel, and the GGUF's Q4_1 groups (32 weights, a scale d and a minimum m) decoded and encoded."""

import numpy as np
import torch

from labkit_course.grading import ExerciseFailed, exercise, require
from labkit_course.grading.core import seeded_generator

_GGUF = ("gguf.quants.dequantize", "gguf.quants.quantize", "gguf.quants.Q4_1.dequantize_blocks",
         "gguf.quants.Q4_1.quantize_blocks", "labkit.model.gguf_loader.load_gguf",
         "labkit.model.weight_formats.dequantize_q4_1", "labkit.model.weight_formats.quantize_q4_1")


def _unchanged(given: torch.Tensor, original: torch.Tensor, what: str) -> None:
    """In-place answers rewrite the caller's data (in the notebook, SmolLM2's own weights): name them."""
    if not torch.equal(given, original):
        raise ExerciseFailed(f"your function changed the {what} it was given (an in-place op such as div_, -= or "
                             "&=): work on a copy, the caller's tensor must stay as it was")


def _two_tensors(got, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(got, tuple | list) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        raise ExerciseFailed(f"return a pair of tensors ({what}), got {type(got).__name__}")
    return got[0], got[1]


# ---- exercise 1: a KV block that fills over time -------------------------------------------------
def reference_append_to_block(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, offset: int,
                              *, grow=True, rescale=True, reset=True, per_head=True, rounding=torch.round,
                              rerounding=torch.round):
    """labkit's rule (labkit.cache.kv_quant). The keywords re-create typical mistakes."""
    codes, scales = codes.clone(), scales.clone()
    old = torch.zeros_like(scales) if offset == 0 and reset else scales
    head_max = x.abs().amax(-1) if per_head else x.abs().amax().expand(scales.shape)
    new = torch.maximum(old, head_max / 127) if grow else torch.where(old > 0, old, head_max / 127)
    if rescale:
        grown = (new > old) & (old > 0)
        ratio = torch.where(grown, old / torch.where(new > 0, new, 1.0), 1.0)
        codes[:offset] = rerounding(codes[:offset].float() * ratio[:, None]).to(torch.int8)
    safe = torch.where(new > 0, new, 1.0)
    codes[offset] = rounding(x / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, new


_APPEND_MISTAKES = (
    (dict(grow=False), "the new token is larger than the block's scale allows and got clipped: grow the scale"),
    (dict(rescale=False), "the scale grew but the codes already in the block still mean the old scale: re-round "
                          "them to the new one (code x old / new)"),
    (dict(reset=False), "offset 0 starts the block over: the scale it holds belonged to a freed block's tokens"),
    (dict(per_head=False), "one scale for the whole block: keep one scale per KV head (heads differ in size)"),
    (dict(rounding=torch.trunc), "the new token's codes were cast to int8 without rounding, which truncates toward "
                                 "zero: round x / scale to the nearest code first"),
    (dict(rerounding=torch.trunc), "the scale grew and the old codes (code x old / new) were cast to int8 without "
                                   "rounding, which truncates toward zero: round them to the nearest code"),
)


def _steps(g, heads_sizes, block_size=8, dim=16):
    """A block a freed owner left behind (random codes and scales), and tokens of the given per-head sizes."""
    heads = len(heads_sizes[0])
    codes = torch.randint(-127, 128, (block_size, heads, dim), generator=g, dtype=torch.int8)
    scales = torch.rand(heads, generator=g) * 5
    return codes, scales, [torch.randn(heads, dim, generator=g) * size[:, None] for size in heads_sizes]


@exercise("13", "append_to_block", forbidden=("labkit.cache.kv_quant.store_quantized",
                                             "labkit_course.grading.labs.lab13.reference_append_to_block"))
def append_to_block(ns):
    fn = require(ns, "append_to_block")
    g = seeded_generator(1313)
    runs = [
        [[1.0, 0.1, 10.0], [0.5, 0.05, 5.0], [4.0, 0.4, 1.0], [0.0, 0.0, 0.0], [30.0, 0.2, 1.0]],
        [[0.0, 1.0], [2.0, 0.0], [1.0, 8.0]],  # a head whose first token is all zeros
    ]
    for sizes in runs:
        codes, scales, tokens = _steps(g, [torch.tensor(s) for s in sizes])
        for offset, x in enumerate(tokens):
            got = fn(codes.clone(), scales.clone(), x.clone(), offset)
            got_codes, got_scales = _two_tensors(got, "the block's codes, its scales")
            if got_codes.dtype != torch.int8 or got_codes.shape != codes.shape or got_scales.shape != scales.shape:
                raise ExerciseFailed(f"return the codes as int8 {tuple(codes.shape)} and the scales as "
                                     f"{tuple(scales.shape)}, got {got_codes.dtype} {tuple(got_codes.shape)} and "
                                     f"{tuple(got_scales.shape)}")
            if not torch.isfinite(got_scales).all() or (got_codes.float() * got_scales[:, None]).isnan().any():
                raise ExerciseFailed("NaN or inf in the scales: a head whose values are all 0 so far has scale 0, "
                                     "and its codes are 0")
            want_codes, want_scales = reference_append_to_block(codes, scales, x, offset)
            if not _same_block(got_codes, got_scales, want_codes, want_scales, offset):
                for kwargs, why in _APPEND_MISTAKES:
                    if _same_block(got_codes, got_scales, *reference_append_to_block(codes, scales, x, offset,
                                                                                     **kwargs), offset):
                        raise ExerciseFailed(f"token at offset {offset}: {why}")
                if offset > 0 and got_scales.lt(scales * (1 - 1e-6)).any():
                    raise ExerciseFailed(f"token at offset {offset}: a scale shrank; it may only grow, or the codes "
                                         "already in the block would no longer fit it")
                raise ExerciseFailed(f"token at offset {offset} (head sizes {sizes[offset]}): "
                                     + _block_difference(got_codes, got_scales, want_codes, want_scales, offset))
            codes, scales = want_codes, want_scales
    return "scales only grow, old codes re-rounded when they do, offset 0 starts over, no NaN on zeros"


def _block_difference(codes, scales, want_codes, want_scales, offset) -> str:
    """Where a block differs from the right one: the first scale, else the first code, with its place."""
    if not torch.allclose(scales, want_scales, rtol=1e-5, atol=1e-12):
        head = int((~torch.isclose(scales, want_scales, rtol=1e-5, atol=1e-12)).nonzero()[0])
        return f"head {head}'s scale should be {want_scales[head].item():.9g}, got {scales[head].item():.9g}"
    row, head, dim = (codes[:offset + 1] != want_codes[:offset + 1]).nonzero()[0].tolist()
    which = "the new token's code" if row == offset else f"the code written at offset {row}, re-rounded,"
    return (f"the scales are right, but {which} at head {head}, element {dim} should be "
            f"{int(want_codes[row, head, dim])}, got {int(codes[row, head, dim])}")


def _same_block(codes, scales, want_codes, want_scales, offset) -> bool:
    """The block's first offset + 1 codes (the rest is a freed owner's junk) and its scales."""
    return (torch.allclose(scales, want_scales, rtol=1e-5, atol=1e-12)
            and torch.equal(codes[:offset + 1], want_codes[:offset + 1]))


# ---- exercise 2: int8 weights, one scale per output channel -------------------------------------
def _weight_cases(g):
    w = torch.randn(24, 40, generator=g) * torch.logspace(-2, 1, 24)[:, None]  # rows of very different sizes
    w[3] = 0.0  # a row of zeros (a pruned channel)
    w[5, 7] = -50.0  # a row whose largest magnitude is negative
    return [w, torch.randn(1, 1, generator=g), torch.randn(7, 96, generator=g) * 0.02]


@exercise("13", "quantize_per_channel", forbidden=(
    "torch.quantize_per_channel", "torch.fake_quantize_per_channel_affine",
    "labkit_course.grading.labs.lab13.reference_quantize_per_channel",
))
def quantize_per_channel(ns):
    fn = require(ns, "quantize_per_channel")
    g = seeded_generator(13)
    for w in _weight_cases(g):
        given = w.clone()
        q, scales = _two_tensors(fn(given), "int8 codes, scales")
        _unchanged(given, w, "weight")
        if q.dtype != torch.int8 or q.shape != w.shape:
            raise ExerciseFailed(f"the codes must be an int8 tensor of the weight's shape {tuple(w.shape)}, "
                                 f"got {q.dtype} {tuple(q.shape)}")
        if scales.numel() == w.shape[1] and w.shape[0] != w.shape[1]:
            raise ExerciseFailed(f"{scales.numel()} scales: one per input column; per output channel means one "
                                 f"scale per row (dim 0), {w.shape[0]} of them")
        if scales.numel() == 1 and w.shape[0] > 1:
            raise ExerciseFailed("one scale for the whole matrix (per tensor): per output channel means one scale "
                                 "per row, so a small row is not rounded on a large row's grid")
        if scales.shape != (w.shape[0],) or scales.dtype != torch.float32:
            raise ExerciseFailed(f"return the scales as a float32 vector of shape ({w.shape[0]},), one per row; got "
                                 f"{scales.dtype} {tuple(scales.shape)}")
        if not torch.isfinite(scales).all() or (q.float() * scales[:, None]).isnan().any():
            raise ExerciseFailed("NaN or inf: an all-zero row has max |w| = 0; give it scale 0 (or any) and codes 0")
        want = reference_quantize_per_channel(w)[1]
        live = want > 0
        if torch.allclose(scales[live], w[live].amax(1) / 127, rtol=1e-5) and not torch.allclose(
                scales[live], want[live], rtol=1e-5):
            raise ExerciseFailed("the scale came from the largest w, not the largest |w|: a row whose extreme is "
                                 "negative gets clipped")
        added = scales[live] - want[live]
        if added.min() > 0 and torch.allclose(added, added[0].expand_as(added), rtol=1e-3):
            raise ExerciseFailed("an epsilon was added to every scale: it coarsens every row's grid; guard only "
                                 "the all-zero rows (max |w| = 0) against dividing by zero")
        if not torch.allclose(scales[live], want[live], rtol=1e-5):
            ratio = (want[live] / scales[live]).median().item()
            hint = (" (you divided by 128 or 255: the codes run -127..127, so scale = max|w| / 127)"
                    if abs(ratio - 128 / 127) < 1e-3 or abs(ratio - 255 / 127) < 1e-3 else "")
            raise ExerciseFailed(f"scales differ from max|w| / 127 per row{hint}")
        error = (q.float() * scales[:, None] - w).abs()
        if (error > scales[:, None] / 2 + 1e-6 * w.abs()).any():
            raise ExerciseFailed(f"a weight is off by {error.max().item():.3g}, more than half a step: round to the "
                                 "nearest code (casting to int8 truncates toward zero)")
        if q.min() < -127:
            raise ExerciseFailed("a code is -128: keep the codes symmetric, -127..127")
    return "one scale per row, max|w| / 127, every weight within half a step"


def reference_quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = w.abs().amax(dim=1) / 127
    safe = torch.where(scales > 0, scales, 1.0)
    return (w / safe[:, None]).round().clamp(-127, 127).to(torch.int8), scales


# ---- exercises 3 and 4: the GGUF's Q4_1 -------------------------------------------------------
Q4_1_GROUP, Q4_1_BYTES = 32, 20


def _q4_1_bytes(g, n_groups):
    """Real Q4_1 blocks of random weights, encoded by gguf (the oracle), with one constant group."""
    import gguf

    w = (np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g))).standard_normal(
        (n_groups, Q4_1_GROUP)) * np.logspace(-3, 1, n_groups)[:, None] + np.linspace(-1, 1, n_groups)[:, None])
    w[1] = 0.25  # a constant group: d = 0
    raw = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    return w.astype(np.float32), raw.reshape(-1)


def _gguf_decode(raw: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw.reshape(-1, Q4_1_BYTES), gguf.GGMLQuantizationType.Q4_1).reshape(-1)


def _decode_variants(raw: np.ndarray) -> dict[str, np.ndarray]:
    blocks = raw.reshape(-1, Q4_1_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    low, high = (qs & 0x0F).astype(np.float32), (qs >> 4).astype(np.float32)
    halves = np.concatenate([low, high], axis=1)
    interleaved = np.stack([low, high], axis=2).reshape(len(blocks), -1)
    variants = {
        "the 16 bytes hold weights j (low nibble) and j + 16 (high nibble) of byte j, not neighbours 2j, 2j + 1":
            d * interleaved + m,
        "the low nibble comes first: weights 0..15 are the low nibbles, 16..31 the high ones":
            d * np.concatenate([high, low], axis=1) + m,
        "the block starts with d, then m (both float16): you swapped them": m * halves + d,
        "Q4_1 adds the minimum m: w = d * q + m (w = d * (q - 8) is Q4_0's, symmetric format)": d * (halves - 8),
        "w = d * q + m, plus the minimum, not minus": d * halves - m,
    }
    return {why: w.reshape(-1) for why, w in variants.items()}


@exercise("13", "decode_q4_1", forbidden=_GGUF)
def decode_q4_1(ns):
    fn = require(ns, "decode_q4_1")
    g = seeded_generator(4)
    for n_groups in (2, 3, 40):
        _, raw = _q4_1_bytes(g, n_groups)
        given = torch.from_numpy(raw.copy())
        got = fn(given)
        _unchanged(given, torch.from_numpy(raw), "bytes")
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"return a tensor of weights, got {type(got).__name__}")
        want = _gguf_decode(raw)
        if got.numel() != want.size:
            raise ExerciseFailed(f"{len(raw)} bytes are {len(raw) // Q4_1_BYTES} groups of 32 weights: expected "
                                 f"{want.size} weights, got shape {tuple(got.shape)}")
        if got.shape != (want.size,):
            raise ExerciseFailed(f"return the weights flat, shape ({want.size},), got {tuple(got.shape)}")
        if got.dtype != torch.float32:
            raise ExerciseFailed(f"return float32 weights (d * q + m computed in float16 loses digits), "
                                 f"got {got.dtype}")
        got = got.numpy()
        if np.allclose(got, want, rtol=1e-6, atol=1e-7):
            continue
        for why, variant in _decode_variants(raw).items():
            if np.allclose(got, variant, rtol=1e-6, atol=1e-7):
                raise ExerciseFailed(why)
        if np.allclose(got, want, rtol=1e-2, atol=1e-3):
            raise ExerciseFailed("close but not equal: read d and m as little-endian float16 and compute in float32")
        first = int(np.argmax(~np.isclose(got, want, rtol=1e-6, atol=1e-7)))
        raise ExerciseFailed(f"weight {first} (group {first // 32}, position {first % 32}): expected "
                             f"{want[first]:.6g}, got {got[first]:.6g}")
    return "d and m as float16, low nibbles then high nibbles, w = d * q + m: equal to gguf's dequantize"


def _encode_bound(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: the header a correct encoder writes (float16 d and m) and how far a weight may be off."""
    groups = w.reshape(-1, Q4_1_GROUP)
    lo, hi = groups.min(1), groups.max(1)
    d32 = (hi - lo) / 15
    d16, m16 = d32.astype(np.float16), lo.astype(np.float16)
    slack = d32 / 2 + np.abs(lo - m16.astype(np.float32)) + 15 * np.abs(d32 - d16.astype(np.float32)) + 1e-6
    return d16, m16, slack


@exercise("13", "encode_q4_1", forbidden=_GGUF)
def encode_q4_1(ns):
    fn = require(ns, "encode_q4_1")
    g = seeded_generator(41)
    for n_groups in (2, 25):
        w, _ = _q4_1_bytes(g, n_groups)
        given = torch.from_numpy(w.reshape(-1).copy())
        got = fn(given)
        _unchanged(given, torch.from_numpy(w.reshape(-1)), "weights")
        if not isinstance(got, torch.Tensor) or got.dtype != torch.uint8:
            raise ExerciseFailed(f"return the bytes as a uint8 tensor, got "
                                 f"{got.dtype if isinstance(got, torch.Tensor) else type(got).__name__}")
        if got.numel() != n_groups * Q4_1_BYTES:
            raise ExerciseFailed(f"{w.size} weights are {n_groups} groups of 32: expected {n_groups * Q4_1_BYTES} "
                                 f"bytes (2 for d, 2 for m, 16 for 32 four-bit codes per group), got {got.numel()}")
        raw = got.reshape(-1).numpy().astype(np.uint8)
        blocks = raw.reshape(-1, Q4_1_BYTES)
        d = blocks[:, 0:2].copy().view(np.float16).reshape(-1)
        m = blocks[:, 2:4].copy().view(np.float16).reshape(-1)
        want_d, want_m, slack = _encode_bound(w)
        groups = w.reshape(-1, Q4_1_GROUP)
        if not np.isfinite(d.astype(np.float32)).all():
            raise ExerciseFailed("d is NaN or inf: a group whose weights are all equal has d = 0 (and codes 0)")
        if not np.array_equal(m, want_m):
            if np.array_equal(d, want_m) and np.array_equal(m, want_d):
                raise ExerciseFailed("the block starts with d, then m (both float16): you wrote m first")
            if np.allclose(m.astype(np.float32), 0):
                raise ExerciseFailed("m is 0: Q4_1 stores each group's minimum as m, so the 16 levels span min..max")
            raise ExerciseFailed("m must be the group's minimum, as float16")
        if not np.array_equal(d, want_d):
            ratio = np.median((want_d.astype(np.float32) / np.where(d == 0, 1, d).astype(np.float32))[want_d > 0])
            if abs(ratio - 16 / 15) < 1e-2:
                raise ExerciseFailed("d = (max - min) / 16: 16 levels have 15 steps between them, d = (max - min) / 15")
            if np.allclose(d.astype(np.float32), d[0].astype(np.float32)):
                raise ExerciseFailed("every group has the same d: one d and one m per group of 32 weights")
            raise ExerciseFailed("d must be (max - min) / 15 of the group, as float16")
        decoded = _gguf_decode(raw).reshape(-1, Q4_1_GROUP)
        error = np.abs(decoded - groups)
        if (error > slack[:, None]).any():
            for repack, why in ((_interleave, "weights j and j + 16 share byte j (low and high nibble), "
                                              "not neighbours 2j, 2j + 1"),
                                (_swap_nibbles, "weight j goes in byte j's low nibble and weight j + 16 in its "
                                                "high nibble: you swapped them")):
                repacked = _gguf_decode(repack(raw)).reshape(-1, Q4_1_GROUP)
                if (np.abs(repacked - groups) <= slack[:, None]).all():
                    raise ExerciseFailed(why)
            raise ExerciseFailed(f"a weight decodes {error.max():.3g} away from its value, more than half a step "
                                 "(d / 2): round (w - m) / d to the nearest code, do not truncate")
    return "d = (max - min) / 15 and m = min as float16, codes rounded and packed j | (j + 16) << 4"


def _interleave(raw: np.ndarray) -> np.ndarray:
    """Re-pack codes written as neighbours (2j low, 2j + 1 high) the way Q4_1 packs them."""
    blocks = raw.reshape(-1, Q4_1_BYTES).copy()
    qs = blocks[:, 4:]
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(len(blocks), Q4_1_GROUP)
    blocks[:, 4:] = codes[:, :16] | (codes[:, 16:] << 4)
    return blocks.reshape(-1)


def _swap_nibbles(raw: np.ndarray) -> np.ndarray:
    """Re-pack codes written high nibble first the way Q4_1 packs them."""
    blocks = raw.reshape(-1, Q4_1_BYTES).copy()
    blocks[:, 4:] = (blocks[:, 4:] >> 4) | (blocks[:, 4:] << 4)
    return blocks.reshape(-1)


@exercise("13", "knowledge_check")
def knowledge_check(ns):
    from labkit.engine.memory import num_blocks_for_memory
    from labkit.model.random_weights import SMOLLM2_135M
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    budget = 64 * 2**20
    blocks = {dtype: num_blocks_for_memory(SMOLLM2_135M, 16, torch.float32, cpu_kv_cache_bytes=budget,
                                           kv_cache_dtype=dtype) for dtype in ("auto", "int8")}
    return grade_answers(ns, {
        1: Number(blocks["int8"] - blocks["auto"], "'How much room int8 makes'"),
        2: Number(Q4_1_BYTES * 8 / Q4_1_GROUP, "'The GGUF's Q4_1 groups'"),
        3: Choice("b", "'A block that fills over time'"),
        4: Choice("c", "'Weights: one scale per output channel'"),
        5: Choice("a", "'Quality: perplexity and greedy agreement'"),
    })
