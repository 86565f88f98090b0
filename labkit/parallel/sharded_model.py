"""A decoder split across ranks by tensor parallelism, and the all-reduce it pays for.

Attention heads are the natural unit: q/k/v projections are column-parallel by whole heads, each
rank attends with its own heads (no communication: heads are independent), and o_proj is
row-parallel. The MLP splits its intermediate features the same way. Embeddings, norms and the LM
head stay replicated (small here; vLLM shards the vocabulary too). The layers' code does not change:
only their weights and head counts do, which is why `shard_decoder` edits a model in place.

With GQA a query head must stay on the rank of the K/V head it reads (query head h reads K/V head
h // group, group = num_heads // num_kv_heads), so the unit of the split is a K/V group: one K/V head
and its query heads. Groups that do not divide by world_size split unevenly: SmolLM2-135M's 3 groups
(9 query heads) over 2 ranks give rank 0 two groups (6 query, 2 K/V heads) and rank 1 one (3 and 1).
The MLP's intermediate features split as evenly as they can the same way. More ranks than K/V groups
leave a rank with no K/V head: vLLM then replicates K/V heads across ranks; labkit refuses.
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


def balanced_split(units: int, world_size: int, what: str) -> list[int]:
    """How many of `units` each rank takes: as equal as possible, the first ranks taking one more.

    Refuses more ranks than units: a rank with nothing would have no K/V head to attend with.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > units:
        raise ValueError(
            f"{what} ({units}) < world_size {world_size}: every rank needs at least one (a query head stays on "
            f"the rank of its K/V head); vLLM replicates K/V heads when ranks outnumber them, labkit does not"
        )
    base, extra = divmod(units, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


def shard_decoder(model: DecoderModel, rank: int, world_size: int, all_reduce) -> DecoderModel:
    """Turn `model` (the full weights, identical on every rank) into rank `rank`'s shard, in place.

    q/k/v columns and o_proj rows are cut at K/V-group boundaries, gate/up columns and down rows at
    a balanced split of the intermediate features.
    """
    cfg = model.config
    groups = balanced_split(cfg.num_kv_heads, world_size, "num_kv_heads")
    queries_per_group = cfg.num_heads // cfg.num_kv_heads
    kv_sizes = [g * cfg.head_dim for g in groups]
    q_sizes = [g * queries_per_group * cfg.head_dim for g in groups]
    mlp_sizes = balanced_split(cfg.intermediate_size, world_size, "intermediate_size")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(attn.q_proj, rank, world_size, q_sizes)
        attn.k_proj = ColumnParallelLinear(attn.k_proj, rank, world_size, kv_sizes)
        attn.v_proj = ColumnParallelLinear(attn.v_proj, rank, world_size, kv_sizes)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size, all_reduce, q_sizes)
        attn.num_heads = groups[rank] * queries_per_group
        attn.num_kv_heads = groups[rank]
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, rank, world_size, mlp_sizes)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, rank, world_size, mlp_sizes)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world_size, all_reduce, mlp_sizes)
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
