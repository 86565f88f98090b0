"""Lab 08: Triton kernels — a tiled row softmax, the K/V store, paged decode and paged varlen prefill.

An answer is the `*_kernel()` factory the notebook defines; the grader launches the kernel it returns. The
kernels run in Triton's interpreter on a CPU. Each mistake is a switch (a global the kernel reads) of one
kernel per exercise; `variant` copies the kernel with its own switches, a `@triton.jit` function of its own
that the grader launches with the exercise's signature.
"""

import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

from catalogue import Right, Wrong  # noqa: E402
from labkit.attention.triton_kernels import jit_kernels  # noqa: E402


def variant(kernel, **switches):
    """A copy of the `@triton.jit` function `kernel` whose globals hold `switches` as constexprs (the interpreter
    runs a kernel's source in its function's globals, and Triton's compiler reads only constexpr globals)."""
    fn = kernel.fn
    constants = {name: tl.constexpr(value) for name, value in switches.items()}
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **constants}, fn.__name__)
    copy.__annotations__ = fn.__annotations__
    return triton.jit(copy)


def factory(kernel, **switches):
    made = variant(kernel, **switches)
    return lambda: made


# The switches' values in the lab's own answers (each variant sets all of its kernel's)
TAIL, SHIFT, ONE_TILE, DIVIDE, FIRST_MAX, MASK_STORE = map(
    tl.constexpr, (float("-inf"), True, False, True, False, True))
STORE_MASK, STORE_V, SWAP, STRIDE_PAD = map(tl.constexpr, ("where", True, False, False))
MASK, GQA, RESCALE, FIXED_BLOCK, WHOLE_BLOCKS, F32, EXP2, SCALED, ONE_MORE, HEAD_ELEMENTS, VISIBLE, MAX, GUARD = map(
    tl.constexpr, (True, "div", True, 0, False, True, False, True, 0, False, "causal", "running", True))


@triton.jit
def _softmax(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """Three passes over a row in tiles: max, sum of exp, write. The switches make typical mistakes; FIRST_MAX
    takes the max of the first tile only, MASK_STORE False stores every lane of the tail tile."""
    row = tl.program_id(0) * n_cols
    cols = tl.arange(0, BLOCK)
    last = BLOCK if ONE_TILE else n_cols  # ONE_TILE: treats the row as one tile of BLOCK lanes
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    for start in range(0, BLOCK if FIRST_MAX else last, BLOCK):
        m = tl.maximum(m, tl.max(tl.load(x_ptr + row + start + cols, mask=start + cols < n_cols, other=TAIL), 0))
    if not SHIFT:
        m = 0.0
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, last, BLOCK):
        x = tl.load(x_ptr + row + start + cols, mask=start + cols < n_cols, other=TAIL)
        total += tl.sum(tl.exp(x - m), 0)
    for start in range(0, last, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row + start + cols, mask=mask, other=float("-inf"))
        tl.store(out_ptr + row + start + cols, tl.exp(x - m) / total if DIVIDE else tl.exp(x - m),
                 mask=mask if MASK_STORE else None)


def softmax_variant(tail=float("-inf"), shift=True, one_tile=False, divide=True, first_max=False, mask_store=True):
    return factory(_softmax, TAIL=tail, SHIFT=shift, ONE_TILE=one_tile, DIVIDE=divide, FIRST_MAX=first_max,
                   MASK_STORE=mask_store)


@triton.jit
def _softmax_online(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """Two passes: a running max and a sum rescaled whenever the max grows (Lab 07's online softmax)."""
    row = tl.program_id(0) * n_cols
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row + start + cols, tl.exp(x - m) / total, mask=mask)


@triton.jit
def _softmax_tilewise(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """Each tile normalized by its own max and sum, as if tiles were separate rows."""
    row = tl.program_id(0) * n_cols
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, 0))
        tl.store(out_ptr + row + start + cols, e / tl.sum(e, 0), mask=mask)


@triton.jit
def _softmax_one_wide_tile(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """BLOCK ignored: one tile of 4096 lanes, wider than every row but the longest (the red team's)."""
    row = tl.program_id(0) * n_cols
    cols = tl.arange(0, 4096)
    x = tl.load(x_ptr + row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    tl.store(out_ptr + row + cols, e / tl.sum(e, 0), mask=cols < n_cols)


def softmax_rows_torch(x, block=128):
    """The wrapper rewritten in torch, the kernel never written: what the grader must not accept."""
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


@triton.jit
def _store(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """STORE_MASK: "where" (the lab's), "if" (skip the program), "and" (block & scalar, which the interpreter
    rejects), "row" (lanes only, slot -1 stored), "slot" (slot only, the ROW_PAD lanes all stored), "clamp"
    (lanes only, slot -1 stored into slot 0)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, ROW_PAD)
    if STORE_MASK == "and":
        mask = (offs < ROW) & (slot >= 0)
    elif STORE_MASK == "row" or STORE_MASK == "clamp":
        mask = offs < ROW
    elif STORE_MASK == "slot":
        mask = offs < tl.where(slot >= 0, ROW_PAD, 0)
    else:
        mask = offs < tl.where(slot >= 0, ROW, 0)
    if STORE_MASK == "clamp":
        slot = tl.maximum(slot, 0)
    start = slot * ROW_PAD if STRIDE_PAD else slot * ROW
    k_dst, v_dst = (v_cache_ptr, k_cache_ptr) if SWAP else (k_cache_ptr, v_cache_ptr)
    if STORE_MASK != "if" or slot >= 0:
        tl.store(k_dst + start + offs, tl.load(k_ptr + t * ROW + offs, mask=mask), mask=mask)
        if STORE_V:
            tl.store(v_dst + start + offs, tl.load(v_ptr + t * ROW + offs, mask=mask), mask=mask)


def store_variant(mask="where", store_v=True, swap=False, stride_pad=False):
    return factory(_store, STORE_MASK=mask, STORE_V=store_v, SWAP=swap, STRIDE_PAD=stride_pad)


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, first, last, scale, max_blocks,
            NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
            RESCALE: tl.constexpr, FIXED_BLOCK: tl.constexpr, WHOLE_BLOCKS: tl.constexpr, F32: tl.constexpr,
            EXP2: tl.constexpr, ONE_MORE: tl.constexpr, HEAD_ELEMENTS: tl.constexpr, MAX: tl.constexpr):
    """One query row against keys first..last of a sequence's blocks, online softmax. The switches make
    typical mistakes; FIXED_BLOCK > 0 assumes blocks of that many tokens whatever BLOCK_SIZE says, ONE_MORE
    lets key last + 1 in (pos <= context_len), HEAD_ELEMENTS offsets KV head kv by kv elements, not kv rows, MAX
    "none" takes exp(score) with no max, "first" the first block's max only, never rescaled."""
    B: tl.constexpr = FIXED_BLOCK if FIXED_BLOCK > 0 else BLOCK_SIZE
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, B)
    if F32:
        q = q.to(tl.float32)
    m = tl.max(tl.full([B], float("-inf"), tl.float32), 0)
    denom = tl.sum(tl.zeros([B], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32 if F32 else q.dtype)
    n_blocks = (last + 1) // B if WHOLE_BLOCKS else last // B + 1
    for b in range(first // B, n_blocks):
        block = tl.load(block_tables_ptr + seq * max_blocks + b).to(tl.int64)
        pos = b * B + j
        valid = ((pos <= last + ONE_MORE) & (pos >= first)) | (not MASK)
        if HEAD_ELEMENTS:
            rows = (block * B + j) * NUM_KV_HEADS * HEAD_DIM + kv_head
        else:
            rows = ((block * B + j) * NUM_KV_HEADS + kv_head) * HEAD_DIM
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :])
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :])
        if F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        if MAX == "none":
            m_new = tl.zeros_like(m_new)
        elif MAX == "first":
            m_new = tl.where(b == first // B, m_new, m)
        if EXP2:
            p = tl.exp2((s - m_new) * 1.4426950408889634)
        else:
            p = tl.exp(s - m_new)
        if RESCALE:
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        else:  # sums terms taken under different maxima
            denom = denom + tl.sum(p, 0)
            acc = acc + tl.sum(p[:, None] * v, 0)
        m = m_new
    return acc / denom


@triton.jit
def _kv_head(head, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GQA: tl.constexpr):
    if GQA == "mod":
        return head % NUM_KV_HEADS
    elif GQA == "same":
        return head
    else:
        return head // (NUM_HEADS // NUM_KV_HEADS)


@triton.jit
def _decode(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, scale, max_blocks,
            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    row = (seq * NUM_HEADS + head) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    out = _attend(tl.load(q_ptr + row), k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
                  _kv_head(head, NUM_HEADS, NUM_KV_HEADS, GQA), 0, tl.load(context_lens_ptr + seq) - 1,
                  scale if SCALED else 1.0, max_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, MASK, RESCALE,
                  FIXED_BLOCK, WHOLE_BLOCKS, F32, EXP2, ONE_MORE, HEAD_ELEMENTS, MAX)
    tl.store(out_ptr + row, out)


def decode_variant(mask=True, gqa="div", rescale=True, fixed_block=0, whole_blocks=False, f32=True, exp2=False,
                   scaled=True, one_more=0, head_elements=False, running_max="running"):
    return factory(_decode, MASK=mask, GQA=gqa, RESCALE=rescale, FIXED_BLOCK=fixed_block, WHOLE_BLOCKS=whole_blocks,
                   F32=f32, EXP2=exp2, SCALED=scaled, ONE_MORE=one_more, HEAD_ELEMENTS=head_elements, MAX=running_max)


@triton.jit
def _prefill(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_q_ptr, cu_k_ptr, scale, max_blocks,
             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """VISIBLE: "causal" (the lab's), "top_left" (key <= i), "all" (no causal mask), "new_only" (prefix skipped);
    GUARD False lets the programs with i >= q_len store too (past the sequence's rows)."""
    seq, head, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    if (i < q_len) | (not GUARD):
        if VISIBLE == "top_left":
            last = i
        elif VISIBLE == "all":
            last = k_len - 1
        else:
            last = k_len - q_len + i
        first = k_len - q_len if VISIBLE == "new_only" else 0
        row = ((q_start + i) * NUM_HEADS + head) * HEAD_DIM + tl.arange(0, HEAD_DIM)
        out = _attend(tl.load(q_ptr + row), k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
                      _kv_head(head, NUM_HEADS, NUM_KV_HEADS, GQA), first, last, scale if SCALED else 1.0,
                      max_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, True, True, 0, False, F32, EXP2, 0,
                      HEAD_ELEMENTS, MAX)
        tl.store(out_ptr + row, out)


def prefill_variant(visible="causal", gqa="div", f32=True, exp2=False, scaled=True, head_elements=False,
                    running_max="running", guard=True):
    return factory(_prefill, VISIBLE=visible, GQA=gqa, F32=f32, EXP2=exp2, SCALED=scaled, HEAD_ELEMENTS=head_elements,
                   MAX=running_max, GUARD=guard)


def torch_attention(*args):
    """A wrapper's attention in torch: the kind of answer a kernel exercise must not take."""
    return torch.zeros(1)


class TorchSoftmax(KernelInterface):
    """`kernel[grid](...)` with no kernel behind it: KernelInterface's launch calls run(), here torch code."""

    def run(self, x, out, n_cols, *, grid, warmup, **constexprs):
        out.copy_(x.float().softmax(-1))


@triton.jit
def _blank_decode(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, scale, max_blocks,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """Zeroes its output and the values in its sequence's blocks: attention over those values is zero too."""
    seq, head = tl.program_id(0), tl.program_id(1)
    tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + tl.arange(0, HEAD_DIM), tl.zeros([HEAD_DIM], tl.float32))
    rows: tl.constexpr = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
    offs = tl.arange(0, rows)
    for b in range(max_blocks):
        block = tl.load(block_tables_ptr + seq * max_blocks + b).to(tl.int64)
        tl.store(v_cache_ptr + block * rows + offs, tl.zeros([rows], tl.float32),
                 mask=offs < tl.where(block >= 0, rows, 0))


LABKIT_STORE = jit_kernels()[0]  # labkit's own store kernel, taken before any tripwire is armed


@triton.jit
def _store_by_labkit(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """Calls labkit's store kernel as a device function."""
    LABKIT_STORE(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ROW, ROW, ROW, ROW_PAD)


def labkit_kernel(index):
    def answer():
        return jit_kernels()[index]
    return answer


RIGHT = [
    Right("softmax_kernel", "three passes over tiles (max, sum, write)", softmax_variant()),
    Right("softmax_kernel", "online max and rescaled sum, then write", lambda: _softmax_online),
    Right("store_kv_kernel", "one program per token, slot -1 folded into the lanes' bound", store_variant()),
    Right("store_kv_kernel", "one program per token, `if slot >= 0` around the stores", store_variant(mask="if")),
    Right("paged_decode_kernel", "online softmax over blocks", decode_variant()),
    Right("paged_decode_kernel", "online softmax with exp2", decode_variant(exp2=True)),
    Right("paged_prefill_kernel", "one program per (sequence, head, new token)", prefill_variant()),
    Right("paged_prefill_kernel", "the same with exp2", prefill_variant(exp2=True)),
]

NOT_A_KERNEL = "not a Triton kernel"

WRONG = [
    Wrong("softmax_kernel", "tail lanes load 0, not -inf", softmax_variant(tail=0.0), "included lanes past its end"),
    Wrong("softmax_kernel", "no max subtracted", softmax_variant(shift=False), "exp overflowed"),
    Wrong("softmax_kernel", "one tile per row, no loop", softmax_variant(one_tile=True), "only the first 128 columns"),
    Wrong("softmax_kernel", "each tile normalized on its own", lambda: _softmax_tilewise, "normalized on its own"),
    Wrong("softmax_kernel", "one tile as wide as the rows, BLOCK ignored", lambda: _softmax_one_wide_tile,
          "more than a Triton tile can hold"),
    Wrong("softmax_kernel", "the first tile's max for the whole row", softmax_variant(first_max=True),
          "not the first tile's only"),
    Wrong("softmax_kernel", "tail tile stored unmasked", softmax_variant(mask_store=False),
          "mask the tail tile's store"),
    Wrong("softmax_kernel", "not divided by the sum", softmax_variant(divide=False), "not divided"),
    Wrong("softmax_kernel", "a torch wrapper, no kernel", lambda: softmax_rows_torch, NOT_A_KERNEL),
    Wrong("softmax_kernel", "a KernelInterface whose run() is torch code", TorchSoftmax, NOT_A_KERNEL),
    Wrong("store_kv_kernel", "slot -1 not masked", store_variant(mask="row"), "slot -1 was stored"),
    Wrong("store_kv_kernel", "slot -1 clamped to slot 0", store_variant(mask="clamp"), "slot -1 was stored in slot 0"),
    Wrong("store_kv_kernel", "the padding lanes past ROW stored", store_variant(mask="slot"), "mask the lanes >= ROW"),
    Wrong("store_kv_kernel", "mask as (offs < ROW) & (slot >= 0)", store_variant(mask="and"),
          "put the scalar condition into the bound"),
    Wrong("store_kv_kernel", "stores only K", store_variant(store_v=False), "store both"),
    Wrong("store_kv_kernel", "K and V swapped", store_variant(swap=True), "K went into the V cache"),
    Wrong("store_kv_kernel", "slot stride of ROW_PAD", store_variant(stride_pad=True), "starts at s * ROW"),
    Wrong("store_kv_kernel", "a torch wrapper, no kernel", lambda: torch_attention, NOT_A_KERNEL),
    Wrong("store_kv_kernel", "calls labkit's store kernel from its own", lambda: _store_by_labkit,
          "`store_kv_kernel` is labkit's answer to this exercise"),
    Wrong("store_kv_kernel", "returns labkit's kernel", labkit_kernel(0), "`jit_kernels`",
          calls="labkit.attention.triton_kernels.jit_kernels"),
    Wrong("paged_decode_kernel", "no mask past the context", decode_variant(mask=False), "past the context length"),
    Wrong("paged_decode_kernel", "GQA head by modulo", decode_variant(gqa="mod"), "h % NUM_KV_HEADS"),
    Wrong("paged_decode_kernel", "GQA ignored: KV head = query head", decode_variant(gqa="same"),
          "right when every query head has its own KV head"),
    Wrong("paged_decode_kernel", "no rescaling of the running sums", decode_variant(rescale=False), "rescale"),
    Wrong("paged_decode_kernel", "blocks assumed to hold 16 tokens", decode_variant(fixed_block=16),
          "right only with blocks of 16"),
    Wrong("paged_decode_kernel", "partial last block dropped", decode_variant(whole_blocks=True),
          "wrong when it ends inside one"),
    Wrong("paged_decode_kernel", "computes in the caches' dtype", decode_variant(f32=False),
          "would not compile for a GPU"),
    Wrong("paged_decode_kernel", "one key too many (pos <= context_len)", decode_variant(one_more=1),
          "one key past the context"),
    Wrong("paged_decode_kernel", "KV-head offset not multiplied by HEAD_DIM", decode_variant(head_elements=True),
          "not kv * HEAD_DIM"),
    Wrong("paged_prefill_kernel", "KV-head offset not multiplied by HEAD_DIM", prefill_variant(head_elements=True),
          "not kv * HEAD_DIM"),
    Wrong("paged_decode_kernel", "exp(score) with no max", decode_variant(running_max="none"), "exp overflows"),
    Wrong("paged_decode_kernel", "the first block's max only", decode_variant(running_max="first"),
          "not the first block's"),
    Wrong("paged_decode_kernel", "forgot the scale", decode_variant(scaled=False), "not scaled"),
    Wrong("paged_decode_kernel", "a torch wrapper, no kernel", lambda: torch_attention, NOT_A_KERNEL),
    Wrong("paged_decode_kernel", "zeroes the values it reads, and its output", lambda: _blank_decode,
          "your kernel wrote into v_cache"),
    Wrong("paged_decode_kernel", "returns labkit's kernel", labkit_kernel(1), "`jit_kernels`",
          calls="labkit.attention.triton_kernels.jit_kernels"),
    Wrong("paged_prefill_kernel", "causal diagonal from the top-left", prefill_variant(visible="top_left"),
          "as if the prompt started the context"),
    Wrong("paged_prefill_kernel", "no causal mask", prefill_variant(visible="all"), "no causal mask"),
    Wrong("paged_prefill_kernel", "cached prefix ignored", prefill_variant(visible="new_only"),
          "cached prefix was ignored"),
    Wrong("paged_prefill_kernel", "GQA head by modulo", prefill_variant(gqa="mod"), "h % NUM_KV_HEADS"),
    Wrong("paged_prefill_kernel", "GQA ignored: KV head = query head", prefill_variant(gqa="same"),
          "right when every query head has its own KV head"),
    Wrong("paged_prefill_kernel", "exp(score) with no max", prefill_variant(running_max="none"), "exp overflows"),
    Wrong("paged_prefill_kernel", "the first block's max only", prefill_variant(running_max="first"),
          "not the first block's"),
    Wrong("paged_prefill_kernel", "no `if i < q_len` guard", prefill_variant(guard=False), "if i < q_len"),
    Wrong("paged_prefill_kernel", "forgot the scale", prefill_variant(scaled=False), "not scaled"),
    Wrong("paged_prefill_kernel", "computes in the caches' dtype", prefill_variant(f32=False),
          "would not compile for a GPU"),
    Wrong("paged_prefill_kernel", "a torch wrapper, no kernel", lambda: torch_attention, NOT_A_KERNEL),
    Wrong("paged_prefill_kernel", "returns labkit's kernel", labkit_kernel(1), "`jit_kernels`",
          calls="labkit.attention.triton_kernels.jit_kernels"),
]
