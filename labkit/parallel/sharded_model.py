"""A decoder split across ranks by tensor parallelism, and the all-reduce it pays for.

Attention heads are the natural unit: q/k/v projections are column-parallel by whole heads, each
rank attends with its own heads (no communication: heads are independent), and o_proj is
row-parallel. The MLP splits its intermediate features the same way. Embeddings, norms and the LM
head stay replicated (small here; vLLM shards the vocabulary too). The layers' code does not change:
only their weights and head counts do, which is why `shard_decoder` edits a model in place.

Heads must split evenly, and query heads must stay with their KV head (GQA): so num_kv_heads and
num_heads must both be multiples of world_size. SmolLM2-135M (9 query heads, 3 KV heads) splits
3 ways but not 2; engines then replicate KV heads (vLLM does when world_size > num_kv_heads) or
refuse. This module refuses with a clear error, and the tests use a random-weights model of a
TP-friendly shape: the arithmetic is the same for any shape that splits.
"""

import time

import torch
import torch.distributed as dist

from labkit.model.decoder import DecoderModel
from labkit.parallel.layers import ColumnParallelLinear, RowParallelLinear


class AllReduce:
    """Sums a tensor over all ranks in place (torch.distributed), counting calls, bytes and seconds.

    `bytes` is the payload each rank hands in; a ring all-reduce sends about 2 (p - 1) / p times that
    per rank over the wire (see `wire_bytes`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.calls = 0
        self.bytes = 0
        self.seconds = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += x.numel() * x.element_size()
        return x

    def wire_bytes(self) -> float:
        """Bytes one rank sends in a ring all-reduce of the counted payloads."""
        p = dist.get_world_size(self.group)
        return 2 * (p - 1) / p * self.bytes


def check_splittable(num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int) -> None:
    """Raise a ValueError naming what does not split evenly across `world_size` ranks."""
    problems = [f"{name} ({n})" for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                                               ("intermediate_size", intermediate_size)) if n % world_size]
    if problems:
        raise ValueError(
            f"{', '.join(problems)} not divisible by world_size {world_size}: tensor parallelism splits whole "
            f"heads (each query head staying with its KV head) and MLP features evenly across ranks"
        )


def shard_decoder(model: DecoderModel, rank: int, world_size: int, all_reduce) -> DecoderModel:
    """Turn `model` (the full weights, identical on every rank) into rank `rank`'s shard, in place."""
    cfg = model.config
    check_splittable(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, world_size)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(attn.q_proj, rank, world_size)
        attn.k_proj = ColumnParallelLinear(attn.k_proj, rank, world_size)
        attn.v_proj = ColumnParallelLinear(attn.v_proj, rank, world_size)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size, all_reduce)
        attn.num_heads //= world_size
        attn.num_kv_heads //= world_size
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, rank, world_size)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, rank, world_size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world_size, all_reduce)
    return model


def sharded_forward(rank: int, world_size: int, config, seed: int, input_ids: torch.Tensor, steps: int = 1) -> dict:
    """A rank's part of a tensor-parallel run (for `run_ranks`): build the seeded random model, keep this
    rank's shard, run `steps` forwards of `input_ids`; return the logits and the all-reduce counters.

    Every rank draws the same full model from `seed` and slices it, as a loader slicing one checkpoint would.
    """
    from labkit.model.random_weights import random_model

    all_reduce = AllReduce()
    model = shard_decoder(random_model(config, seed=seed), rank, world_size, all_reduce)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids)
    return {"logits": logits, "calls": all_reduce.calls, "bytes": all_reduce.bytes,
            "seconds": all_reduce.seconds, "wire_bytes": all_reduce.wire_bytes()}
