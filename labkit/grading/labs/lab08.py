"""Lab 08: Triton kernels — a tiled row softmax, store K/V into slots, paged decode with online softmax,
and paged varlen prefill checked against torch's scaled_dot_product_attention.

The student's kernels run wherever the notebook runs them: compiled on CUDA, or in the Triton
interpreter on a CPU (the notebook sets TRITON_INTERPRET=1 before importing triton).
"""

import torch
import torch.nn.functional as F

from labkit.attention.reference import paged_decode_attention, random_paged_inputs
from labkit.cache.paged_storage import store_kv
from labkit.device import pick_device
from labkit.grading import ExerciseFailed, exercise, require
from labkit.grading.labs.lab00 import FORBIDDEN as SOFTMAX_CALLS


def _device():
    return pick_device()


def _softmax_inputs(dev):
    """A narrow batch (fits any tile) and a vocabulary-wide one: several tiles and a partial last one,
    a row of huge logits (exp overflows without the max) and a row with filtered (-inf) logits."""
    g = torch.Generator().manual_seed(81)
    narrow = torch.randn(3, 5, generator=g)
    wide = torch.randn(4, 1000, generator=g) * 3
    wide[1] += 2000.0
    wide[2, ::7] = float("-inf")
    return narrow.to(dev), wide.to(dev)


@exercise("08", "softmax_rows", forbidden=SOFTMAX_CALLS)
def softmax_rows(ns):
    fn = require(ns, "softmax_rows")
    narrow, wide = _softmax_inputs(_device())
    for x in (narrow, wide):
        got = fn(x.clone())
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            raise ExerciseFailed(f"expected a tensor of the input's shape {tuple(x.shape)}")
        want = x.softmax(-1)
        if torch.allclose(got, want, atol=1e-6):
            continue
        if x is narrow and torch.allclose(got, x.softmax(0), atol=1e-6):
            raise ExerciseFailed("normalized over the wrong axis: each row (one token's logits) must sum to 1")
        if not torch.isfinite(got[1]).all() and torch.isfinite(got[[0, 3]]).all():
            raise ExerciseFailed("exp overflowed on a row of large logits: subtract the row's max (over all its "
                                 "tiles) before exponentiating")
        if torch.allclose(got, (x - x.amax(-1, keepdim=True)).exp(), atol=1e-6):
            raise ExerciseFailed("not divided by the row's sum: a softmax row must sum to 1")
        sums = got.sum(-1, keepdim=True)
        if torch.isfinite(got).all() and torch.allclose(got / sums, want, atol=1e-6):
            raise ExerciseFailed(f"right shape of distribution, but rows sum to {sums.min():.3f}..{sums.max():.3f}: "
                                 "the row's sum included lanes past its end; masked loads of the tail tile must "
                                 "give -inf (other=float('-inf')), whose exp is 0")
        for width in (16, 32, 64, 128, 256, 512):
            if x is wide and torch.allclose(got[0, :width], x[0, :width].softmax(-1), atol=1e-6):
                if torch.allclose(got[0, width:2 * width], x[0, width:2 * width].softmax(-1), atol=1e-6):
                    break  # every tile normalized on its own: the message below
                raise ExerciseFailed(f"only the first {width} columns were normalized: a vocabulary row is wider "
                                     "than one tile; loop over it tile by tile (max, then sum, then write)")
        if x is wide:
            raise ExerciseFailed("right on rows narrower than a tile, wrong on rows of several tiles: the max and "
                                 "the sum must cover the whole row, every tile, before any value is written")
        raise ExerciseFailed(f"differs from exp(x - max) / sum along each row (max abs diff "
                             f"{(got - want).abs().nan_to_num(1.0).max():.2e})")
    return "rows of several tiles and a partial tail sum to 1; large and -inf logits handled"


@exercise("08", "store_kvcache", forbidden=(
    "labkit.cache.paged_storage.store_kv", "labkit.attention.triton_kernels.store_kvcache",
    "labkit.attention.triton_kernels._kernels",
))
def store_kvcache(ns):
    fn = require(ns, "store_kvcache")
    g = torch.Generator().manual_seed(8)
    dev = _device()
    row = 2 * 16
    # each cache sits in a buffer one block past a guard region, where a stray slot -1 would land
    k_buf = torch.cat([torch.zeros(8 * row), torch.randn(4 * 8 * row, generator=g)]).to(dev)
    v_buf = torch.cat([torch.zeros(8 * row), torch.randn(4 * 8 * row, generator=g)]).to(dev)
    k_cache, v_cache = k_buf[8 * row:].view(4, 8, 2, 16), v_buf[8 * row:].view(4, 8, 2, 16)
    k, v = torch.randn(5, 2, 16, generator=g).to(dev), torch.randn(5, 2, 16, generator=g).to(dev)
    slots = torch.tensor([9, -1, 31, 0, -1], device=dev)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, want_k, want_v, slots)
    before_k = k_cache.clone()
    fn(k, v, k_cache, v_cache, slots)
    if torch.equal(k_cache, before_k):
        raise ExerciseFailed("the cache did not change: the kernel stored nothing")
    if k_buf[:8 * row].any() or v_buf[:8 * row].any():
        raise ExerciseFailed("a token with slot -1 was stored (just before the cache, out of bounds): mask it out")
    stored = slots >= 0
    k_rows, v_rows = k_cache.reshape(-1, row)[slots[stored]], v_cache.reshape(-1, row)[slots[stored]]
    if torch.equal(k_rows, v[stored].flatten(1)) and torch.equal(v_rows, k[stored].flatten(1)):
        raise ExerciseFailed("K went into the V cache and V into the K cache: keep the argument order "
                             "(k, v, k_cache, v_cache, slot_mapping)")
    if torch.equal(k_cache, want_k) and not torch.equal(v_cache, want_v):
        raise ExerciseFailed("K is right but V is not: store both")
    if not torch.equal(k_cache, want_k) or not torch.equal(v_cache, want_v):
        wrong = int((k_cache != want_k).any(-1).any(-1).sum())
        raise ExerciseFailed(f"{wrong} cache rows differ from storing token t's K/V row at slot_mapping[t]; "
                             "row of slot s starts at s * num_kv_heads * head_dim")
    return "every token's K/V row is in its slot; slot -1 skipped"


def _decode_inputs(g, dev):
    k_cache = torch.randn(10, 8, 2, 16, generator=g)
    v_cache = torch.randn(10, 8, 2, 16, generator=g)
    context_lens = torch.tensor([1, 13, 20])
    block_tables = torch.tensor([[7, -1, -1], [2, 9, -1], [4, 0, 5]], dtype=torch.int32)
    for s, n in enumerate(context_lens.tolist()):  # slots past the context hold large junk
        for t in range(n, 24):
            block = int(block_tables[s, t // 8])
            if block >= 0:
                k_cache[block, t % 8], v_cache[block, t % 8] = 30.0, 30.0
    q = torch.randn(3, 6, 16, generator=g)
    return [x.to(dev) for x in (q, k_cache, v_cache, block_tables, context_lens)]


@exercise("08", "paged_decode", forbidden=(
    "labkit.attention.reference.paged_decode_attention", "labkit.attention.reference.paged_attention",
    "labkit.attention.reference.gather_kv", "labkit.attention.triton_kernels.paged_attention",
    "labkit.attention.triton_kernels._kernels",
))
def paged_decode(ns):
    fn = require(ns, "paged_decode")
    g = torch.Generator().manual_seed(80)
    q, k_cache, v_cache, block_tables, context_lens = _decode_inputs(g, _device())
    got = fn(q, k_cache, v_cache, block_tables, context_lens)
    want = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise ExerciseFailed(f"expected a [num_seqs, num_heads, head_dim] = {tuple(want.shape)} tensor")
    if torch.allclose(got, want, atol=1e-4):
        return "matches the gather-then-attend reference (GQA, partial last blocks)"
    padded = paged_decode_attention(q, k_cache, v_cache, block_tables, (context_lens + 7) // 8 * 8)
    if torch.allclose(got, padded, atol=1e-4):
        raise ExerciseFailed("keys past the context length were attended to: mask positions >= context_len")
    k_mod = k_cache.repeat(1, 1, 3, 1)  # query head h reading KV head h % num_kv_heads
    v_mod = v_cache.repeat(1, 1, 3, 1)
    if torch.allclose(got, paged_decode_attention(q, k_mod, v_mod, block_tables, context_lens), atol=1e-4):
        raise ExerciseFailed("query head h read KV head h % num_kv_heads: with GQA it is h // (num_heads // "
                             "num_kv_heads)")
    if torch.allclose(got, paged_decode_attention(q * q.shape[-1] ** 0.5, k_cache, v_cache, block_tables,
                                                  context_lens), atol=1e-4):
        raise ExerciseFailed("scores were not scaled: multiply q . k by scale = 1/sqrt(head_dim)")
    in_order = torch.arange(block_tables.numel(), dtype=block_tables.dtype, device=block_tables.device)
    if torch.allclose(got, paged_decode_attention(q, k_cache, v_cache, in_order.view_as(block_tables), context_lens),
                      atol=1e-4):
        raise ExerciseFailed("the block table was ignored (blocks assumed to be 0, 1, 2, ...): load block b of "
                             "sequence s from block_tables[s, b]")
    one = paged_decode_attention(q[:1], k_cache, v_cache, block_tables[:1], context_lens[:1])
    if torch.allclose(got[:1], one, atol=1e-4):
        raise ExerciseFailed("right for the one-token context, wrong for longer ones: check the running max "
                             "rescaling (alpha = exp(m_old - m_new)) and the block-table lookup")
    raise ExerciseFailed(f"differs from the reference (max abs diff {(got - want).abs().max():.2e})")


def _prefill_inputs(dev):
    """A whole prompt, a prompt after a 15-token cached prefix, and a decode step, in shuffled blocks of 8
    (padded block table, -1 past each sequence's blocks); slots past each context hold large junk."""
    q_lens, k_lens = [5, 4, 1], [5, 19, 13]
    q, k_cache, v_cache, tables, cu_q, cu_k = random_paged_inputs(k_lens, q_lens, num_kv_heads=2, head_dim=16,
                                                                  block_size=8, num_heads=4, seed=82)
    for s, n in enumerate(k_lens):
        for t in range(n, 8 * tables.shape[1]):
            block = int(tables[s, t // 8])
            if block >= 0:
                k_cache[block, t % 8], v_cache[block, t % 8] = 30.0, 30.0
    return [x.to(dev) for x in (q, k_cache, v_cache, tables, cu_q, cu_k)], max(q_lens)


def _sdpa_paged(q, k_cache, v_cache, block_tables, cu_q, cu_k, *, visible="causal", gqa="div", scale=None):
    """Per sequence: gather its keys through the block table, then torch's scaled_dot_product_attention
    with an explicit mask. `visible` and `gqa` other than the defaults reproduce typical mistakes."""
    out, block_size = torch.empty_like(q), k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for s in range(len(cu_q) - 1):
        q0, q1, n_k = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s + 1] - cu_k[s])
        blocks = block_tables[s, : -(-n_k // block_size)].long()
        keys, values = (c[blocks].flatten(0, 1)[:n_k] for c in (k_cache, v_cache))
        expand = (lambda x: x.repeat_interleave(group, 1)) if gqa == "div" else (lambda x: x.repeat(1, group, 1))
        rows, cols = torch.arange(q1 - q0, device=q.device)[:, None], torch.arange(n_k, device=q.device)[None]
        last = n_k - (q1 - q0) + rows  # the last key row i may see: the new tokens end the context
        mask = {"causal": cols <= last, "top_left": cols <= rows, "all": cols >= 0,
                "new_only": (cols <= last) & (cols > n_k - (q1 - q0) - 1)}[visible]
        out[q0:q1] = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), expand(keys).transpose(0, 1),
                                                    expand(values).transpose(0, 1), attn_mask=mask,
                                                    scale=scale).transpose(0, 1)
    return out


@exercise("08", "paged_prefill", forbidden=(
    "labkit.attention.reference.paged_attention", "labkit.attention.reference.varlen_attention",
    "labkit.attention.reference.paged_decode_attention", "labkit.attention.reference.gather_kv",
    "labkit.attention.triton_kernels.paged_attention", "labkit.attention.triton_kernels._kernels",
    "torch.nn.functional.scaled_dot_product_attention",
))
def paged_prefill(ns):
    fn = require(ns, "paged_prefill")
    args, max_q = _prefill_inputs(_device())
    got = fn(*args, max_q)
    want = _sdpa_paged(*args)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise ExerciseFailed(f"expected a [total_new_tokens, num_heads, head_dim] = {tuple(want.shape)} tensor")
    if torch.allclose(got, want, atol=1e-4):
        return "matches torch's scaled_dot_product_attention: whole prompt, cached prefix and decode in one launch"
    mistakes = [
        (dict(visible="top_left"), "row i saw keys 0..i only, as if the prompt started the context: the new tokens "
                                   "end it, so row i sees keys up to k_len - q_len + i (the cached prefix too)"),
        (dict(visible="all"), "no causal mask: row i saw keys after its own position (up to k_len - q_len + i)"),
        (dict(visible="new_only"), "the cached prefix was ignored: row i also sees the k_len - q_len keys "
                                   "already in the cache"),
        (dict(gqa="mod"), "query head h read KV head h % num_kv_heads: with GQA it is h // (num_heads // "
                          "num_kv_heads)"),
        (dict(scale=1.0), "scores were not scaled: multiply q . k by scale = 1/sqrt(head_dim)"),
    ]
    for variant, message in mistakes:
        if torch.allclose(got, _sdpa_paged(*args, **variant), atol=1e-4):
            raise ExerciseFailed(message)
    q, k_cache, v_cache, tables, cu_q, cu_k = args
    decode = slice(int(cu_q[-2]), int(cu_q[-1]))
    if torch.allclose(got[decode], want[decode], atol=1e-4):
        raise ExerciseFailed("the decode row (one new token) is right, the prompts' rows are not: each row has "
                             "its own last visible key, k_len - q_len + i, and its query row at cu_seqlens_q[s] + i")
    raise ExerciseFailed(f"differs from scaled_dot_product_attention (max abs diff "
                         f"{(got - want).abs().nan_to_num(1.0).max():.2e}); check the block-table lookup and the "
                         "online-softmax rescaling")


@exercise("08", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers, smollm2_config

    block_size, table, position = 16, [7, 1, 4], 37
    smol = smollm2_config()
    return grade_answers(ns, {
        1: Number(table[position // block_size] * block_size + position % block_size,
                  "section 3: block id x block_size + offset"),
        2: Number(7 // (smol.num_heads // smol.num_kv_heads), "section 4, on GQA: h // (H / H_kv)"),
        3: Number(4 * smol.num_heads, "section 4: the grid of the decode kernel"),
        4: Choice("a", "the introduction, on the gather's cost"),
        5: Choice("a", "section 7, achieved memory bandwidth"),
    })
