"""Lab 08: Triton kernels — a tiled row softmax, store K/V into slots, paged decode with online softmax,
and paged varlen prefill checked against torch's scaled_dot_product_attention.

The graders launch the student's kernels themselves (the `@triton.jit` function each `*_kernel()` factory
returns), with their own grids and inputs, on several shapes (GQA groups, block sizes, head dims, ragged
lengths) in fp32, fp16 and bf16: a torch wrapper around an unwritten kernel grades nothing. Under `make check`
the launch runs in the student's kernel (`kernel[grid](...)` on a proxy, see labkit_course.grading.remote) and only
the output tensors come back; on a CPU the student's notebook has switched on Triton's interpreter.
"""

import torch
import torch.nn.functional as F

from labkit.attention.reference import random_paged_inputs
from labkit.cache.paged_storage import store_kv
from labkit.device import pick_device
from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.codec import Handle
from labkit_course.grading.core import seeded_generator
from labkit_course.grading.kernels import NotTriton, check_triton_kernel

# |got - want| <= atol + rtol * |want| against fp32 arithmetic on the same (rounded) inputs: what rounding the
# output to its dtype costs (the same bounds labkit's kernel meets, section 6 of the lab)
TOLERANCE = {torch.float32: (1e-5, 2e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 8e-3)}
NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
OWN_KERNELS = ("labkit.attention.triton_kernels.jit_kernels",)  # labkit's kernels: its answer to these exercises
TRITON_MAX_TILE = 2**20  # the most elements one Triton tensor (a tile) may hold: triton's TRITON_MAX_TENSOR_NUMEL
ROOM = 2**16  # the most elements `_in_buffer` puts on each side of a tensor: the widest tile a case launches


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    rtol, atol = TOLERANCE[dtype]
    return torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol)


def _kernel(make_kernel, factory: str):
    """The kernel `factory()` returns: exactly a `@triton.jit` function calling none of labkit's kernels (in the
    student's kernel, where a proxy stands for it here, its agent checks the same before it launches)."""
    kernel = make_kernel()
    if isinstance(kernel, Handle):
        return kernel
    try:
        check_triton_kernel(kernel)
    except TypeError:
        raise ExerciseFailed(_not_a_kernel(factory, type(kernel).__name__)) from None
    return kernel


def _not_a_kernel(factory: str, type_name: str) -> str:
    return (f"`{factory}()` returned a {type_name}, not a Triton kernel: it must return a @triton.jit function "
            "itself, which the grader launches with its own grid and inputs (a torch wrapper, or any other object "
            "with kernel[grid](...), is not graded)")


def _in_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into the middle of a buffer holding as many elements (at most ROOM) before and after it,
    all -1 (a block table entry past the end names no block): a load or store out of bounds lands in the buffer,
    not in memory the process uses (Triton's interpreter checks no bounds: such a store kills the kernel), and
    `_launch` finds what was stored there."""
    room = min(tensor.numel(), ROOM)
    buffer = torch.full((2 * room + tensor.numel(),), -1, dtype=tensor.dtype, device=tensor.device)
    inside = buffer[room:room + tensor.numel()].view(tensor.shape)
    inside.copy_(tensor)
    return inside


def _stored_outside(tensor: torch.Tensor) -> str | None:
    """Where a kernel stored around `tensor`, a tensor `_in_buffer` made: "before" or "past the end of"."""
    buffer, start = tensor._base, tensor.storage_offset()
    for where, room in (("before", buffer[:start]), ("past the end of", buffer[start + tensor.numel():])):
        if (room != -1).any():
            return where
    return None


def _launch(kernel, factory: str, case: str, grid: tuple, *args, read_only: dict, written: dict,
            outside: str = "", **constexprs) -> None:
    """kernel[grid](*args, **constexprs); a failure becomes feedback that says what to change. The tensors in
    `read_only` (by parameter name) must come back unchanged: a kernel that writes its inputs could make the
    grader's reference agree with its output. Those in `written` come from `_in_buffer`: a store around one
    fails with `outside`, what to change."""
    before = {name: tensor.clone() for name, tensor in read_only.items()}
    try:
        if not isinstance(kernel, Handle):  # graded, the student's kernel checks it before the launch
            check_triton_kernel(kernel, args, constexprs)
        kernel[grid](*args, **constexprs)
    except NotTriton as error:
        raise ExerciseFailed(_launch_failure(factory, case, "NotTriton", str(error))) from None
    except (ExerciseFailed, NotImplementedError):
        raise
    except Exception as error:  # noqa: BLE001 - whatever the student's kernel raised
        raise ExerciseFailed(_launch_failure(factory, case, raised_type(error), str(error))) from None
    for name, tensor in written.items():
        where = _stored_outside(tensor)
        if where:
            raise ExerciseFailed(f"your kernel stored {where} {name} ({case}), out of its bounds: {outside}")
    for name, tensor in read_only.items():
        if not torch.equal(tensor, before[name]):
            raise ExerciseFailed(f"your kernel wrote into {name} ({case}), which it only reads: store only into "
                                 "the output")


def _launch_failure(factory: str, case: str, type_name: str, message: str) -> str:
    if "is not a Triton kernel" in message:
        return _not_a_kernel(factory, message.split()[1])
    if type_name == "ForbiddenCall":  # the agent found one of labkit's kernels inside the student's
        return message
    if "mask has unsupported dtype" in message:
        return ("Triton's interpreter cannot use a mask made by `&` of a block of lanes and a scalar condition, "
                "such as `(offs < ROW) & (slot >= 0)`: put the scalar condition into the bound instead, "
                "`offs < tl.where(slot >= 0, ROW, 0)` (every lane off when the condition is false)")
    if "Expected dtype ['fp32', 'fp64']" in message:
        return (f"on {case}: tl.exp and Triton's other math functions take fp32, and the caches here are not: "
                "convert what you load with .to(tl.float32), compute in fp32, and store (the store converts "
                "back to the output's dtype)")
    if type_name == "NotTriton":  # not Triton a GPU could compile: the message says why
        return message
    if type_name == "TypeError" and ("argument" in message or "positional" in message):
        return (f"the grader could not launch your kernel ({message.splitlines()[0][:200]}): keep the signature "
                f"the exercise gives for `{factory}`, parameter names and constexprs included")
    first = (message.strip().splitlines() or [""])[0][:300]
    return f"your kernel raised {type_name} on {case}: {first}"


def _precision_failure(dtypes) -> str:
    names = " and ".join(NAME[d] for d in dtypes)
    return (f"right in fp32, wrong in {names}: compute in fp32 (convert each load with .to(tl.float32), keep the "
            "max, the sum and the accumulator in fp32) and convert only when storing; bf16 keeps only 8 bits of "
            "mantissa, and Triton's CPU interpreter cannot do arithmetic in bf16 at all")


def _device():
    return pick_device()


# --- softmax over rows wider than a tile ---------------------------------------------------------------------

def _softmax_cases(dev):
    """(x, BLOCK): a narrow batch (fits any tile); a vocabulary-wide one, several tiles and a partial last one,
    with a row whose logits past its first tiles are huge (exp overflows without the max of every tile) and a row
    of filtered (-inf) logits; rows an exact number of tiles; the wide one again in fp16 and bf16; a row longer
    than Triton's largest tile, so that one tile as wide as every other row (BLOCK ignored) does not pass. Each
    sits in a buffer (`_in_buffer`), as its output does."""
    g = seeded_generator(81)
    narrow = torch.randn(3, 5, generator=g)
    wide = torch.randn(4, 1000, generator=g) * 3
    wide[1, 700:] += 2000.0
    wide[2, ::7] = float("-inf")
    exact = torch.randn(2, 256, generator=g) * 2
    longest = torch.randn(1, TRITON_MAX_TILE + 4099, generator=g)  # no tile, however wide, holds this row
    cases = [(narrow, 8), (wide, 128), (exact, 64), (wide.half(), 256), (wide.bfloat16(), 64), (longest, 2**16)]
    return [(_in_buffer(x.to(dev)), block) for x, block in cases]


@exercise("08", "softmax_kernel")
def softmax_kernel(ns):
    kernel = _kernel(require(ns, "softmax_kernel"), "softmax_kernel")
    wrong_dtypes = []
    for x, block in _softmax_cases(_device()):
        out = _in_buffer(torch.full_like(x, float("nan")))
        case = f"{NAME[x.dtype]} rows of {x.shape[1]} in tiles of {block}"
        want = x.float().softmax(-1)
        _launch(kernel, "softmax_kernel", case, (x.shape[0],), x, out, x.shape[1], BLOCK=block, read_only={"x": x},
                written={"out": out}, outside="a store writes every lane of its tile, those past the row's end "
                "too: mask the tail tile's store as its load (`mask=start + cols < n_cols`)")
        if _close(out, want, x.dtype):
            continue
        if x.dtype != torch.float32:
            wrong_dtypes.append(x.dtype)
            continue
        raise ExerciseFailed(_softmax_mistake(x, block, out, want))
    if wrong_dtypes:
        raise ExerciseFailed(_precision_failure(wrong_dtypes))
    return ("rows of one tile, many tiles, a partial tail, longer than any tile, in fp32, fp16 and bf16, sum to 1; "
            "large and -inf logits handled")


def _softmax_mistake(x, block, got, want) -> str:
    if x.shape[1] > TRITON_MAX_TILE:  # the last case: every row that fits one tile was right
        return (f"right on every row that fits in one tile, wrong on a row of {x.shape[1]} columns, more than a Triton "
                f"tile can hold ({TRITON_MAX_TILE} elements): loop over each row in tiles of BLOCK columns")
    if x.shape[1] < block and torch.allclose(got, x.softmax(0), atol=1e-6):
        return "normalized over the wrong axis: each row (one token's logits) must sum to 1"
    if x.shape[0] == 4 and not torch.isfinite(got[1]).all() and torch.isfinite(got[[0, 3]]).all():
        return ("exp overflowed on a row of large logits: subtract the row's max over all its tiles (not the first "
                "tile's only) before exponentiating")
    if torch.allclose(got, (x - x.amax(-1, keepdim=True)).exp(), atol=1e-6):
        return "not divided by the row's sum: a softmax row must sum to 1"
    sums = got.sum(-1, keepdim=True)
    if torch.isfinite(got).all() and torch.allclose(got / sums, want, atol=1e-6):
        return (f"right shape of distribution, but rows sum to {sums.min():.3f}..{sums.max():.3f}: the row's sum "
                "included lanes past its end; masked loads of the tail tile must give -inf (other=float('-inf')), "
                "whose exp is 0")
    if x.shape[1] > block:
        if torch.isnan(got[:, block:]).all():
            return (f"only the first {block} columns (one tile) were written: a vocabulary row is wider than one "
                    "tile; loop over it tile by tile (max, then sum, then write)")
        if torch.allclose(got[:, :block], x[:, :block].softmax(-1), atol=1e-6, equal_nan=True):
            return ("every tile was normalized on its own: the max and the sum must cover the whole row, every "
                    "tile, before any value is written")
        return (f"right on rows narrower than a tile, wrong on rows of several tiles of {block}: the max and the "
                "sum must cover the whole row, every tile, before any value is written")
    diff = (got - want).abs().nan_to_num(1.0).max()
    return f"differs from exp(x - max) / sum along each row (max abs diff {diff:.2e})"


# --- store K/V into the slots -------------------------------------------------------------------------------

def _store_cases(dev):
    """(k, v, k_buf, v_buf, slots): each cache sits in a buffer between guard rows, where a stray slot -1
    (before) or a lane past ROW at the last slot (after) would land. Rows of
    num_kv_heads * head_dim = 32 (a power of two), 24 (padded to 32 lanes) and 64, in fp32, fp16, bf16."""
    g = seeded_generator(8)
    cases = []
    for kv_heads, head_dim, block_size, blocks, slots, dtype in (
            (2, 16, 8, 4, [9, -1, 31, 0, -1], torch.float32),
            (3, 8, 4, 5, [19, 2, -1, 7, 3, 12], torch.float16),
            (1, 64, 16, 2, [-1, 31, 16, 5], torch.bfloat16)):
        shape = (2 * blocks + 2, block_size, kv_heads, head_dim)  # guard, cache, guard (as long: a slot stride
        k_buf, v_buf = (torch.randn(*shape, generator=g).to(dtype) for _ in "kv")  # of ROW_PAD lands there)
        for buf in (k_buf, v_buf):
            buf[0], buf[blocks + 1:] = 0, 0
        k, v = (torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
        cases.append([t.to(dev) for t in (k, v, k_buf, v_buf, torch.tensor(slots))])
    return cases


@exercise("08", "store_kv_kernel", forbidden=OWN_KERNELS)
def store_kv_kernel(ns):
    kernel = _kernel(require(ns, "store_kv_kernel"), "store_kv_kernel")
    for k, v, k_buf, v_buf, slots in _store_cases(_device()):
        blocks = (k_buf.shape[0] - 2) // 2
        k_cache, v_cache, after = k_buf[1:blocks + 1], v_buf[1:blocks + 1], slice(blocks + 1, None)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        store_kv(k, v, want_k, want_v, slots)
        before_k, row = k_cache.clone(), k.shape[1] * k.shape[2]
        case = f"{NAME[k.dtype]}, rows of {k.shape[1]} KV heads x {k.shape[2]}"
        _launch(kernel, "store_kv_kernel", case, (k.shape[0],), k, v, k_cache, v_cache, slots,
                ROW=row, ROW_PAD=1 << (row - 1).bit_length(), read_only={"k": k, "v": v, "slot": slots},
                written={})  # the caches sit between guard rows of their own, checked here
        if torch.equal(k_cache, before_k):
            raise ExerciseFailed("the cache did not change: the kernel stored nothing")
        if k_buf[0].any() or v_buf[0].any():
            raise ExerciseFailed("a token with slot -1 was stored (just before the cache, out of bounds): mask it out")
        strays = k_buf[after].any() or v_buf[after].any()
        if torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v) and not strays:
            continue
        stored = slots >= 0
        k_rows, v_rows = k_cache.reshape(-1, row)[slots[stored]], v_cache.reshape(-1, row)[slots[stored]]
        if torch.equal(k_rows, v[stored].flatten(1)) and torch.equal(v_rows, k[stored].flatten(1)):
            raise ExerciseFailed("K went into the V cache and V into the K cache: keep the argument order "
                                 "(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr)")
        if torch.equal(k_rows, k[stored].flatten(1)) and torch.equal(v_rows, v[stored].flatten(1)):
            raise ExerciseFailed(f"every token's row is right, but values past it changed ({case}, ROW = {row} "
                                 f"padded to {1 << (row - 1).bit_length()} lanes): mask the lanes >= ROW")
        if torch.equal(k_cache, want_k):
            raise ExerciseFailed("K is right but V is not: store both")
        if any(torch.equal(k_cache.reshape(-1, row)[0], k[t].flatten()) for t in range(len(slots)) if slots[t] < 0):
            raise ExerciseFailed("a token with slot -1 was stored in slot 0: slot -1 means store nothing (mask the "
                                 "token's store off), not the nearest slot")
        wrong = int((k_cache != want_k).any(-1).any(-1).sum())
        raise ExerciseFailed(f"{wrong} cache rows differ from storing token t's K/V row at slot_mapping[t] ({case}); "
                             "the row of slot s starts at s * ROW, ROW = num_kv_heads * head_dim")
    return "every token's K/V row is in its slot, rows of 24, 32 and 64 in fp32, fp16 and bf16; slot -1 skipped"


# --- paged attention: decode and prefill ----------------------------------------------------------------------

def _paged_case(q_lens, k_lens, heads, kv_heads, head_dim, block_size, dtype, seed, dev, large=False):
    """random_paged_inputs with the caches inside a buffer of junk blocks (a read through a -1 table entry or
    past the last block reads junk, not memory beyond the tensor), and junk in every slot past a context; q,
    the block tables and the offsets inside buffers too (`_in_buffer`). `large`: q x 100 and the keys of each
    sequence's first block 0, so that scores are 0 there and ~N(0, 100^2) past it, where exp overflows fp32."""
    q, k_cache, v_cache, tables, cu_q, cu_k = random_paged_inputs(
        k_lens, q_lens, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, num_heads=heads,
        seed=seeded_generator(seed))
    if large:
        q *= 100.0
        k_cache[tables[:, 0].long()] = 0.0
    for s, n in enumerate(k_lens):
        for t in range(n, block_size * tables.shape[1]):
            block = int(tables[s, t // block_size])
            if block >= 0:
                k_cache[block, t % block_size], v_cache[block, t % block_size] = 30.0, 30.0
    blocks = k_cache.shape[0]  # junk after the cache, 4 caches long: a kernel striding by 16-token blocks over
    # blocks of 4 stays inside the buffer
    bufs = [torch.full((1 + 5 * blocks, *k_cache.shape[1:]), 30.0) for _ in "kv"]
    for buf, cache in zip(bufs, (k_cache, v_cache), strict=True):
        buf[1:1 + blocks] = cache
    k_cache, v_cache = (b.to(dtype).to(dev)[1:1 + blocks] for b in bufs)
    q, tables, cu_q, cu_k = (_in_buffer(t.to(dev)) for t in (q.to(dtype), tables, cu_q, cu_k))
    desc = (f"{NAME[dtype]}, {heads} query heads on {kv_heads} KV heads, blocks of {block_size}, head_dim {head_dim}, "
            f"context lengths {k_lens}")
    return desc, q, k_cache, v_cache, tables, cu_q, cu_k


# (q_lens, k_lens, heads, kv_heads, head_dim, block_size, dtype, seed): groups of 3, 1 and 8 query heads per KV
# head, blocks of 8, 4 and 16, contexts that end inside a block and on its edge; then fp16 and bf16
DECODE = [([1] * 3, [1, 13, 20], 6, 2, 16, 8, torch.float32, 80),
          ([1] * 3, [9, 4, 16], 4, 4, 32, 4, torch.float32, 81),
          ([1] * 2, [33, 16], 8, 1, 16, 16, torch.float32, 82),
          ([1] * 3, [20, 1, 31], 6, 2, 32, 8, torch.float16, 83),
          ([1] * 2, [12, 7], 4, 2, 16, 4, torch.bfloat16, 84)]
PREFILL = [([5, 4, 1], [5, 19, 13], 4, 2, 16, 8, torch.float32, 82),  # a prompt, one after a cached prefix, a decode
           ([3, 8], [12, 8], 3, 1, 32, 4, torch.float32, 85),
           ([4, 1], [20, 16], 2, 2, 16, 16, torch.float32, 86),
           ([5, 4, 1], [5, 19, 13], 4, 2, 16, 8, torch.float16, 87),
           ([3, 2], [9, 2], 4, 2, 16, 4, torch.bfloat16, 88)]
# graded once every case above is right: large scores past each sequence's first block (see _paged_case)
DECODE_LARGE = ([1] * 2, [20, 29], 4, 2, 16, 8, torch.float32, 89)
PREFILL_LARGE = ([4, 3], [20, 27], 4, 2, 16, 8, torch.float32, 90)
# what a kernel stores past its rows: in prefill the grid runs max(q_len) programs for every sequence
OUTSIDE = {True: "store each (sequence, head) row at (seq * NUM_HEADS + head) * HEAD_DIM, HEAD_DIM values",
           False: "the grid runs max(q_len) programs for every sequence, so the programs with i >= q_len (rows past "
                  "the sequence's own) must store nothing: guard the body with `if i < q_len:`"}


def _sdpa_paged(q, k_cache, v_cache, block_tables, cu_q, cu_k, *, visible="causal", gqa="div", scale=None,
                in_order=False, head_offset="rows"):
    """Per sequence: gather its keys through the block table, then torch's scaled_dot_product_attention with
    an explicit mask, in fp32. The keywords other than their defaults reproduce typical mistakes."""
    q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    out, block_size = torch.empty_like(q), k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    tables = torch.arange(block_tables.numel(), device=q.device).view_as(block_tables) if in_order else block_tables
    if tables.max() >= k_cache.shape[0]:  # blocks in order run past the cache: no answer reads them the same
        return torch.full_like(q, float("nan"))
    for s in range(len(cu_q) - 1):
        q0, q1, n_k = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s + 1] - cu_k[s])
        n_seen = {"padded": -(-n_k // block_size) * block_size,
                  "one_more": min(n_k + 1, -(-n_k // block_size) * block_size)}.get(visible, n_k)
        blocks = tables[s, : -(-n_k // block_size)].long()
        keys, values = (c[blocks].flatten(0, 1)[:n_seen] for c in (k_cache, v_cache))
        if head_offset == "elements":  # KV head j read from element j of a token's row, not j * head_dim
            d = keys.shape[-1]
            keys, values = (torch.stack([x.flatten(1)[:, j:j + d] for j in range(x.shape[1])], 1)
                            for x in (keys, values))
        expand = (lambda x: x.repeat_interleave(group, 1)) if gqa == "div" else (lambda x: x.repeat(1, group, 1))
        rows, cols = torch.arange(q1 - q0, device=q.device)[:, None], torch.arange(n_seen, device=q.device)[None]
        last = n_k - (q1 - q0) + rows  # the last key row i may see: the new tokens end the context
        mask = {"causal": cols <= last, "top_left": cols <= rows, "all": cols >= 0, "padded": cols >= 0,
                "one_more": cols >= 0,
                "new_only": (cols <= last) & (cols > n_k - (q1 - q0) - 1)}[visible]
        out[q0:q1] = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), expand(keys).transpose(0, 1),
                                                    expand(values).transpose(0, 1), attn_mask=mask,
                                                    scale=scale).transpose(0, 1)
    return out


def _run_paged(kernel, factory: str, case, decode: bool, large=False):
    """Launch the kernel on one case: its description, output, the reference's and the reference's arguments."""
    q_lens, k_lens, heads, kv_heads, head_dim, block_size, dtype, seed = case
    desc, q, k_cache, v_cache, tables, cu_q, cu_k = _paged_case(
        q_lens, k_lens, heads, kv_heads, head_dim, block_size, dtype, seed, _device(), large)
    out = _in_buffer(torch.full_like(q, float("nan")))
    meta = (_in_buffer(cu_k.diff()),) if decode else (cu_q, cu_k)
    grid = (len(k_lens), heads) if decode else (len(k_lens), heads, max(q_lens))
    args = (q, k_cache, v_cache, tables, cu_q, cu_k)
    read_only = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                     **(dict(context_lens=meta[0]) if decode else dict(cu_q=cu_q, cu_k=cu_k)))
    _launch(kernel, factory, desc, grid, q, k_cache, v_cache, out, tables, *meta, head_dim ** -0.5,
            tables.shape[1], NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
            read_only=read_only, written={"out": out}, outside=OUTSIDE[decode])
    return desc, out, _sdpa_paged(*args), args


def _grade_paged(make_kernel, factory: str, cases, large_case, decode: bool, mistakes) -> None:
    """Launch the kernel on every case; on the first wrong fp32 case name the mistake from what it got right
    (GQA group, block size, sequences whose context fills its blocks, a typical mistake's output); wrong only
    in fp16/bf16 is a precision mistake. Right on them all, it must be right on `large_case` too, whose scores
    overflow exp without the running max."""
    kernel = _kernel(make_kernel, factory)
    results, per_seq, wrong_dtypes, failed = [], [], [], None
    for q_lens, k_lens, *shape, dtype, seed in cases:
        desc, out, want, args = _run_paged(kernel, factory, (q_lens, k_lens, *shape, dtype, seed), decode)
        cu_q, block_size = args[4], shape[3]
        if _close(out, want, dtype):
            results.append((shape, True))
            per_seq.extend((n, block_size, True) for n in k_lens)
            continue
        if dtype != torch.float32:
            wrong_dtypes.append(dtype)
            continue
        results.append((shape, False))
        for s in range(len(k_lens)):
            rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
            per_seq.append((k_lens[s], block_size, _close(out[rows], want[rows], dtype)))
        for variant, message in mistakes:
            if torch.allclose(out.float(), _sdpa_paged(*args, **variant), atol=1e-4, equal_nan=True):
                raise ExerciseFailed(message)
        failed = failed or (desc, out, want)
    if not all(ok for _, ok in results):
        raise ExerciseFailed(_paged_mistake(results, per_seq, *failed))
    if wrong_dtypes:
        raise ExerciseFailed(_precision_failure(wrong_dtypes))
    desc, out, want, _ = _run_paged(kernel, factory, large_case, decode, large=True)
    if not torch.allclose(out, want, rtol=1e-3, atol=1e-3):  # scores of hundreds: fp32 rounds them by ~1e-5
        raise ExerciseFailed(
            f"right while scores are small, wrong when they reach hundreds past a sequence's first block ({desc}): "
            "exp overflows fp32 past ~88; subtract the running max, the largest score of every block so far (not "
            "the first block's only), and rescale the sum and the accumulator by exp(m_old - m_new) when it grows")


def _paged_mistake(results, per_seq, desc, out, want) -> str:
    """What the kernel got right names its mistake: one GQA group, one block size, or the sequences (over every
    fp32 case) whose context fits one block, fills its last block, or ends inside it."""
    right = [shape for shape, ok in results if ok]
    if any(kv == heads for heads, kv, _, _ in right) and all(heads > kv for (heads, kv, _, _), ok in results if not ok):
        return ("right when every query head has its own KV head, wrong with grouped heads (GQA): query head h "
                "reads KV head h // (NUM_HEADS // NUM_KV_HEADS)")
    sizes = {block for *_, block in right}
    if len(sizes) == 1 and all(block not in sizes for (*_, block), ok in results if not ok):
        return (f"right only with blocks of {sizes.pop()}: use BLOCK_SIZE, never a fixed number, for the positions "
                "in a block, the loop over blocks and the slot arithmetic")
    across_blocks = ("right when the context fits in one block, wrong across blocks: look up block b in "
                     "block_tables[s, b], and rescale the running sum and accumulator by alpha = exp(m_old - m_new) "
                     "whenever the max grows")
    if any(ok for *_, ok in per_seq):
        for rule, message in (
                (lambda n, b: n <= b, across_blocks),
                (lambda n, b: n % b == 0, "right when a context fills its last block, wrong when it ends inside one: "
                                          "read the partial last block too (cdiv(length, BLOCK_SIZE) blocks), its "
                                          "keys past the last visible position masked"),
                (lambda n, b: n % b != 0, "wrong when a context ends exactly at a block's edge: loop over "
                                          "cdiv(length, BLOCK_SIZE) blocks; past them the block table holds -1")):
            if all(ok == rule(n, b) for n, b, ok in per_seq):
                return message
        wrong = [(n, b) for n, b, ok in per_seq if not ok]  # a context whose max sits in its first block
        if wrong and all(n > b for n, b in wrong):  # needs no rescaling: it can come out right regardless
            return across_blocks
    return f"differs from the reference on {desc} (max abs diff {(out.float() - want).abs().nan_to_num(1.0).max():.2e})"


LAYOUT_MISTAKES = [  # reading the cache's layout and the kernel's arguments: the same in decode and prefill
    (dict(head_offset="elements"), "KV head kv was read from element kv of a token's row, not kv * HEAD_DIM (right "
                                   "only where there is one KV head): a row holds NUM_KV_HEADS heads of HEAD_DIM "
                                   "values, so the K row of slot block * BLOCK_SIZE + i for head kv starts at "
                                   "((block * BLOCK_SIZE + i) * NUM_KV_HEADS + kv) * HEAD_DIM"),
    (dict(gqa="mod"), "query head h read KV head h % NUM_KV_HEADS: with GQA it is h // (NUM_HEADS // NUM_KV_HEADS)"),
    (dict(scale=1.0), "scores were not scaled: multiply q . k by scale (1/sqrt(head_dim), the kernel's `scale` "
                      "argument)"),
]


@exercise("08", "paged_decode_kernel", forbidden=OWN_KERNELS)
def paged_decode_kernel(ns):
    _grade_paged(require(ns, "paged_decode_kernel"), "paged_decode_kernel", DECODE, DECODE_LARGE, True, [
        (dict(visible="padded"), "keys past the context length were attended to: mask positions >= context_len"),
        (dict(visible="one_more"), "one key past the context was attended to (pos <= context_len): the context "
                                   "holds positions 0 .. context_len - 1, so keep pos < context_len"),
        *LAYOUT_MISTAKES,
        (dict(in_order=True), "the block table was ignored (blocks assumed to be 0, 1, 2, ...): load block b "
                                  "of sequence s from block_tables[s, b]"),
    ])
    return "matches the gather-then-attend reference: GQA groups of 1, 3, 8; blocks of 4, 8, 16; fp32, fp16, bf16"


@exercise("08", "paged_prefill_kernel", forbidden=OWN_KERNELS)
def paged_prefill_kernel(ns):
    _grade_paged(require(ns, "paged_prefill_kernel"), "paged_prefill_kernel", PREFILL, PREFILL_LARGE, False, [
        (dict(visible="top_left"), "row i saw keys 0..i only, as if the prompt started the context: the new tokens "
                                   "end it, so row i sees keys up to k_len - q_len + i (the cached prefix too)"),
        (dict(visible="all"), "no causal mask: row i saw keys after its own position (up to k_len - q_len + i)"),
        (dict(visible="new_only"), "the cached prefix was ignored: row i also sees the k_len - q_len keys "
                                   "already in the cache"),
        *LAYOUT_MISTAKES,
    ])
    return ("matches torch's scaled_dot_product_attention: whole prompts, cached prefixes and decodes in one launch, "
            "GQA groups of 1, 2, 3, blocks of 4, 8, 16, in fp32, fp16 and bf16")


@exercise("08", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers, smollm2_config

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
