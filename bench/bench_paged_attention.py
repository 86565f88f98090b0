"""Speed of the engine's CPU paged attention against SDPA on contiguous K/V.

The reference is what a contiguous cache would cost: torch's scaled_dot_product_attention on K/V
already laid out per sequence. The torch gather path pays for copying each sequence's context out
of the block pool and for padding a mixed batch; the engine's decode rows instead go to the C kernel
that reads the pool through the block tables (`labkit.attention.cpu_decode`, named in the first
line). Both are timed as a layer runs them in the engine: the step's plan (indices, masks, gather
workspace, int32 tables) already made by the first layer. SmolLM2-135M's attention shape (9 query
heads, 3 KV heads, head_dim 64) on this machine's CPU, one thread in the kernel. Prints times and
ratios: gather / SDPA (lower is better, 1.0 is parity) and gather / engine (the kernel's speed-up;
"-" where a step has no decode rows, which keep the gather).

Those cases rerun one layer, whose pools then sit in the caches. In an engine step they never do:
the step's weights sweep the caches between one layer's attention and the next. So the C kernel is
also timed over LAYERS layers' pools in turn, a decode step of the bench workload's average shape,
and its K/V read rate is printed against the streaming read bandwidth measured in the same run.
"""

from functools import partial

import torch
import torch.nn.functional as F

from labkit import kernels
from labkit.attention import cpu_decode, reference
from labkit.timing import measure
from labkit_course.roofline import measure_read_bandwidth

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30  # SmolLM2-135M's
REPEATS = 30  # each case's time is the best of this many runs, after one warm-up run
STEP_SEQS, STEP_CONTEXT = 38, 106  # bench_engine.py's workload: its decode steps' mean batch and context


def setup(k_lens, q_lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in k_lens]
    k_cache = torch.randn(sum(blocks), BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    v_cache = torch.randn(sum(blocks), BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    perm = torch.randperm(sum(blocks), generator=g)
    tables = torch.full((len(k_lens), max(blocks)), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n].int()
        start += n
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=g).to(dtype)
    cu_q, cu_k = torch.tensor([0, *q_lens]).cumsum(0), torch.tensor([0, *k_lens]).cumsum(0)
    contiguous = [tuple(reference.gather_kv(cache, tables[i:i + 1], n)[0] for cache in (k_cache, v_cache))
                  for i, n in enumerate(k_lens)]
    return q, k_cache, v_cache, tables, cu_q, cu_k, contiguous


def sdpa_per_sequence(q, cu_q, contiguous):
    group = HEADS // KV_HEADS
    outs = []
    for i, (k, v) in enumerate(contiguous):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
        lq, lk = qs.shape[1], k.shape[0]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        outs.append(F.scaled_dot_product_attention(qs, k.transpose(0, 1).repeat_interleave(group, 0),
                                                   v.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask))
    return outs


def main():
    float32, bfloat16 = torch.float32, torch.bfloat16
    cases = [
        ("decode, 16 seqs x 512 tokens", [512] * 16, [1] * 16, float32),
        ("decode, 16 seqs of 64..1024 tokens", list(range(64, 1025, 64)), [1] * 16, float32),
        ("decode, 64 seqs x 128 tokens", [128] * 64, [1] * 64, float32),
        ("decode, 16 seqs x 512 tokens, bf16", [512] * 16, [1] * 16, bfloat16),
        ("prefill over a 256-token cached prefix, 4 x 128 new", [384] * 4, [128] * 4, float32),
        ("mixed: one 256-token prefill + 15 decodes of 512", [256] + [512] * 15, [256] + [1] * 15, float32),
    ]
    kernel = kernels.describe().attention
    decode_group = cpu_decode.DecodePlan if kernel.startswith("C/") else None
    print(f"decode attention kernel: {kernel}")
    print(f"{'case':<52} | torch gather | engine (decode: {kernel}) | SDPA contiguous | gather/SDPA | gather/engine")
    for name, k_lens, q_lens, dtype in cases:
        q, k_cache, v_cache, tables, cu_q, cu_k, contiguous = setup(k_lens, q_lens, dtype)
        plans = [reference.PagedAttentionPlan(cu_q, cu_k, tables, BLOCK, HEADS // KV_HEADS, always_read_cache=True,
                                              decode_group=group) for group in (None, decode_group)]
        gather, engine = (measure(partial(plan.run, q, None, None, k_cache, v_cache), REPEATS).best for plan in plans)
        dense = measure(partial(sdpa_per_sequence, q, cu_q, contiguous), REPEATS).best
        speedup = f"{gather / engine:>12.2f}x" if decode_group and 1 in q_lens else f"{'-':>13}"
        print(f"{name:<52} | {gather * 1e3:>9.2f} ms | {engine * 1e3:>{len(kernel) + 14}.2f} ms | "
              f"{dense * 1e3:>12.2f} ms | {gather / dense:>10.2f}x | {speedup}")
    if decode_group is not None:
        report_from_memory()



def from_memory(seqs: int, context: int, dtype: torch.dtype, pool_blocks: int = 2048) -> tuple[float, float]:
    """(seconds per layer, K/V bytes read per second) of the C kernel over LAYERS layers' pools, each
    layer's blocks scattered over its pool as an allocator leaves them, the pools run in turn."""
    g = torch.Generator().manual_seed(1)
    pools = [tuple(torch.randn(pool_blocks, BLOCK, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(2))
             for _ in range(LAYERS)]
    blocks = -(-context // BLOCK)
    tables = torch.randperm(pool_blocks, generator=g)[:seqs * blocks].view(seqs, blocks).int()
    plan = cpu_decode.DecodePlan(tables, torch.full((seqs,), context, dtype=torch.int32), BLOCK)
    q = torch.randn(seqs, HEADS, DIM, generator=g).to(dtype)
    per_layer = measure(lambda: [plan.attend(q, k, v) for k, v in pools], repeats=5).best / LAYERS
    return per_layer, seqs * context * 2 * KV_HEADS * DIM * dtype.itemsize / per_layer


def report_from_memory() -> None:
    bandwidth = measure_read_bandwidth()
    print(f"decode over {LAYERS} layers' pools in turn, as a step reads them (from memory; streaming read "
          f"{bandwidth / 1e9:.1f} GB/s):")
    for dtype in (torch.float32, torch.bfloat16):
        seconds, rate = from_memory(STEP_SEQS, STEP_CONTEXT, dtype)
        print(f"  {STEP_SEQS} seqs x {STEP_CONTEXT} tokens, {str(dtype).removeprefix('torch.'):<8}: "
              f"{seconds * 1e3:.2f} ms a layer, "
              f"K/V read at {rate / 1e9:.1f} GB/s ({rate / bandwidth:.0%} of the streaming read)")


if __name__ == "__main__":
    main()
