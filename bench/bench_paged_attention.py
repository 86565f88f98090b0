"""Speed of the torch paged-attention backend (the engine's CPU path) against SDPA on contiguous K/V.

The reference is what a contiguous cache would cost: torch's scaled_dot_product_attention on K/V
already laid out per sequence. The paged path pays for the gather through the block table and for
padding a mixed batch. It is timed as a layer runs it in the engine: the step's plan (indices,
masks, gather workspace) already made by the first layer. SmolLM2-135M's attention shape (9 query
heads, 3 KV heads, head_dim 64), fp32, on this machine's CPU. Prints ratios (paged time / SDPA
time); lower is better, 1.0 is parity.
"""

import time
from functools import partial

import torch
import torch.nn.functional as F

from labkit.attention import reference

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def best_of(fn, repeats=30):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def setup(k_lens, q_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in k_lens]
    k_cache = torch.randn(sum(blocks), BLOCK, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(sum(blocks), BLOCK, KV_HEADS, DIM, generator=g)
    perm = torch.randperm(sum(blocks), generator=g)
    tables = torch.full((len(k_lens), max(blocks)), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n].int()
        start += n
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=g)
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
    cases = [
        ("decode, 16 seqs x 512 tokens", [512] * 16, [1] * 16),
        ("decode, 16 seqs of 64..1024 tokens", list(range(64, 1025, 64)), [1] * 16),
        ("prefill over a 256-token cached prefix, 4 x 128 new", [384] * 4, [128] * 4),
        ("mixed: one 256-token prefill + 15 decodes of 512", [256] + [512] * 15, [256] + [1] * 15),
    ]
    print(f"{'case':<52} | paged torch | SDPA contiguous | ratio")
    for name, k_lens, q_lens in cases:
        q, k_cache, v_cache, tables, cu_q, cu_k, contiguous = setup(k_lens, q_lens)
        plan = reference.PagedAttentionPlan(cu_q, cu_k, tables, BLOCK, HEADS // KV_HEADS, always_read_cache=True)
        paged = best_of(partial(plan.run, q, None, None, k_cache, v_cache))
        dense = best_of(partial(sdpa_per_sequence, q, cu_q, contiguous))
        print(f"{name:<52} | {paged * 1e3:>8.2f} ms | {dense * 1e3:>12.2f} ms | {paged / dense:>5.2f}x")


if __name__ == "__main__":
    main()
