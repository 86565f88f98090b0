"""Tensor parallelism: sharded layers in one process, then a 2-rank gloo run against the unsharded model."""

import multiprocessing
import os
import tempfile
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.model.random_weights import SMOLLM2_135M, random_model
from labkit.parallel import ColumnParallelLinear, RowParallelLinear, run_ranks, shard_columns, shard_decoder, shard_rows
from labkit.parallel.sharded_model import AllReduce, balanced_split, sharded_forward

# SmolLM2's layout, shrunk, with heads that split 2 ways (4 query heads, 2 KV heads).
TINY = replace(SMOLLM2_135M, vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
               num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)


def test_column_then_row_parallel_equals_the_two_full_layers():
    torch.manual_seed(0)
    up, down = nn.Linear(8, 12), nn.Linear(12, 8)
    x = torch.randn(5, 8)
    partials = []
    for rank in range(3):
        hidden = ColumnParallelLinear(up, rank, 3)(x)
        assert hidden.shape == (5, 4)
        partials.append(RowParallelLinear(down, rank, 3, all_reduce=lambda t: t)(hidden) - down.bias)
    torch.testing.assert_close(sum(partials) + down.bias, down(up(x)))


def test_shards_tile_the_weight_and_uneven_splits_are_refused():
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(torch.cat([shard_columns(w, r, 2) for r in range(2)], dim=0), w)
    assert torch.equal(torch.cat([shard_rows(w, r, 3) for r in range(3)], dim=1), w)
    with pytest.raises(ValueError, match=r"out_features \(4\) does not split evenly across 3"):
        shard_columns(w, 0, 3)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        shard_rows(w, 2, 2)


def test_uneven_sizes_tile_the_weight_and_bad_sizes_are_refused():
    w = torch.arange(30.0).view(5, 6)
    shards = [shard_columns(w, r, 2, sizes=[3, 2]) for r in range(2)]
    assert [s.shape[0] for s in shards] == [3, 2]
    assert torch.equal(torch.cat(shards, dim=0), w)
    assert torch.equal(torch.cat([shard_rows(w, r, 3, sizes=[4, 0, 2]) for r in range(3)], dim=1), w)
    with pytest.raises(ValueError, match=r"sizes \[3, 3\] must be 2 non-negative counts summing to out_features \(5\)"):
        shard_columns(w, 0, 2, sizes=[3, 3])
    with pytest.raises(ValueError, match=r"sizes \[6\] must be 2"):
        shard_rows(w, 0, 2, sizes=[6])


def test_balanced_split_spreads_units_and_refuses_more_ranks_than_units():
    assert balanced_split(3, 2, "num_kv_heads") == [2, 1]
    assert balanced_split(1536, 2, "intermediate_size") == [768, 768]
    assert balanced_split(7, 3, "x") == [3, 2, 2]
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) < world_size 4.*vLLM replicates K/V heads"):
        balanced_split(3, 4, "num_kv_heads")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        balanced_split(3, 0, "num_kv_heads")


def test_smollm2_splits_two_ways_by_kv_group_and_refuses_four():
    from labkit.model.decoder import DecoderModel
    with torch.device("meta"):
        ranks = [shard_decoder(DecoderModel(SMOLLM2_135M), r, 2, all_reduce=lambda t: t) for r in range(2)]
        with pytest.raises(ValueError, match=r"num_kv_heads \(3\) < world_size 4"):
            shard_decoder(DecoderModel(SMOLLM2_135M), 0, 4, all_reduce=lambda t: t)
    head_dim = SMOLLM2_135M.head_dim
    for model, (q_heads, kv_heads) in zip(ranks, [(6, 2), (3, 1)], strict=True):
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        assert (attn.num_heads, attn.num_kv_heads) == (q_heads, kv_heads)
        assert attn.q_proj.weight.shape == (q_heads * head_dim, 576)
        assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (kv_heads * head_dim, 576)
        assert attn.o_proj.weight.shape == (576, q_heads * head_dim)
        assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (768, 576)
        assert mlp.down_proj.weight.shape == (576, 768)


def fail_on_rank_one(rank, world_size):
    """Rank 0 waits in an all-reduce that rank 1 never joins: the launcher must not hang."""
    if rank == 1:
        raise RuntimeError("rank one broke")
    dist.all_reduce(torch.ones(1))


# SmolLM2's own head layout (9 query heads, 3 K/V heads) over 3 ranks, shrunk everywhere else.
SMOLLM2_HEADS = replace(TINY, hidden_size=72, num_heads=9, num_kv_heads=3, head_dim=8, attention_bias=False)


@pytest.mark.parametrize("config, world_size", [(TINY, 2), (SMOLLM2_HEADS, 3)],
                         ids=["2 ranks", "SmolLM2 heads, 3 ranks"])
def test_gloo_ranks_give_the_single_process_logits_and_count_the_all_reduces(config, world_size):
    input_ids = torch.tensor([1, 17, 42, 299, 5, 8, 77])
    expected = random_model(config, seed=3)(input_ids)
    # fork: no re-import of torch per rank (seconds on a loaded CI machine); Lab 15's notebook runs the
    # default spawn path of the same call under nbval.
    results = run_ranks(sharded_forward, world_size, config, 3, input_ids, 2, start_method="fork")
    for result in results:
        torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)
        # two all-reduces per layer (after attention, after the MLP), each of T x hidden fp32 values, 2 steps
        assert result["calls"] == 2 * config.num_layers * 2
        assert result["bytes"] == 2 * 2 * config.num_layers * len(input_ids) * config.hidden_size * 4
        assert result["wire_bytes"] == pytest.approx(2 * (world_size - 1) / world_size * result["bytes"])  # ring
        assert result["seconds"] > 0
    assert not multiprocessing.active_children()


def shard_and_forward(rank, world_size, model, input_ids):
    """Fork-only worker: `model` is the parent's, shared copy-on-write; this rank shards its own copy."""
    all_reduce = AllReduce()
    with torch.inference_mode():
        logits = shard_decoder(model, rank, world_size, all_reduce)(input_ids)
    return {"logits": logits, "calls": all_reduce.calls, "bytes": all_reduce.bytes}


def test_real_smollm2_over_two_uneven_ranks_gives_the_single_process_logits():
    from labkit.model import load_model

    model = load_model("smollm2", device="cpu", dtype=torch.float32)
    input_ids = torch.tensor([1, 504, 3458, 314, 253, 1789, 28, 2])
    with torch.inference_mode():
        expected = model(input_ids)
    # fork: each rank inherits the loaded model instead of reading the GGUF again
    results = run_ranks(shard_and_forward, 2, model, input_ids, start_method="fork", timeout=120)
    cfg = model.config
    for result in results:
        assert (result["logits"] - expected).abs().max().item() <= 1e-4
        assert result["calls"] == 2 * cfg.num_layers
        assert result["bytes"] == 2 * cfg.num_layers * len(input_ids) * cfg.hidden_size * 4  # full width on both
    assert not multiprocessing.active_children()


def test_a_failing_rank_is_reported_and_no_process_or_file_is_left():
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed first:.*rank one broke"):
        run_ranks(fail_on_rank_one, 2, timeout=30, start_method="fork")  # fork: no re-import, faster
    assert not multiprocessing.active_children()
    assert not {name for name in set(os.listdir(tempfile.gettempdir())) - before if name.startswith("labkit-tp-")}
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_ranks(fail_on_rank_one, 0)


def hang(rank, world_size):
    time.sleep(600)


def test_hung_ranks_are_killed_after_the_timeout():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="2 ranks still running after 2 s"):
        run_ranks(hang, 2, timeout=2, start_method="fork")
    assert time.monotonic() - started < 30
    assert not multiprocessing.active_children()
