"""KV-cache sizing the way vLLM does it, checked with made-up GPU numbers (this machine has no GPU):
what is left of gpu_memory_utilization x total after the profile run's peak, memory held outside
torch and the CUDA graphs' pool; an engine that cannot fit names the numbers. Also: which decode
batch sizes get a CUDA graph."""

import pytest
import torch

from labkit.engine.cuda_graph import capture_sizes
from labkit.engine.memory import MemoryProfile, kv_bytes_per_block, num_blocks_for_memory
from labkit.model.random_weights import SMOLLM2_135M

GIB = 2**30
BLOCK = 16
PER_BLOCK = kv_bytes_per_block(SMOLLM2_135M, BLOCK, torch.bfloat16)  # 30 layers x K,V x 16 x 3 x 64 x 2 bytes


def test_bytes_per_block_of_smollm2():
    assert PER_BLOCK == 30 * 2 * 16 * 3 * 64 * 2 == 368_640


def test_gpu_budget_is_utilization_times_total_less_peak_others_and_graphs():
    profile = MemoryProfile(total=16 * GIB, peak=2 * GIB, non_torch=GIB // 2, graph_pool=GIB // 4)
    budget = int(16 * GIB * 0.9) - 2 * GIB - GIB // 2 - GIB // 4
    assert profile.kv_cache_budget(0.9) == budget
    assert num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=profile,
                                 gpu_memory_utilization=0.9) == budget // PER_BLOCK


def test_a_larger_profile_peak_leaves_fewer_blocks():
    small = MemoryProfile(total=16 * GIB, peak=GIB, non_torch=0)
    large = MemoryProfile(total=16 * GIB, peak=4 * GIB, non_torch=0)
    n_small, n_large = (num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=p)
                        for p in (small, large))
    assert n_small - n_large == 3 * GIB // PER_BLOCK or n_small - n_large == 3 * GIB // PER_BLOCK + 1


def test_cpu_budget_is_fixed_and_ignores_gpu_settings():
    assert num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.float32, cpu_kv_cache_bytes=64 * 2**20) == \
        64 * 2**20 // kv_bytes_per_block(SMOLLM2_135M, BLOCK, torch.float32)


def test_an_engine_that_cannot_fit_says_why_with_the_numbers():
    crowded = MemoryProfile(total=16 * GIB, peak=14 * GIB, non_torch=GIB)  # 0.9 x 16 GiB < 15 GiB
    with pytest.raises(ValueError, match=r"does not fit.*0\.9 x 16\.00 GiB.*14\.00 GiB.*-0\.60 GiB.*"
                                         r"raise gpu_memory_utilization, lower max_num_batched_tokens"):
        num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=crowded)
    with pytest.raises(ValueError, match="one block of 16 tokens needs 737280 bytes; raise cpu_kv_cache_bytes"):
        num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.float32, cpu_kv_cache_bytes=1000)


def test_memory_another_process_holds_is_named_with_the_way_out():
    """Two servers on one GPU: the second finds the first's cache outside its torch (seen on an H100)."""
    shared = MemoryProfile(total=80 * GIB, peak=GIB // 4, non_torch=72 * GIB)
    with pytest.raises(ValueError, match=r"72\.00 GiB of this GPU is held outside this process's torch.*another "
                                         r"process.*fixed num_kvcache_blocks.*else raise gpu_memory_utilization"):
        num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=shared)
    alone = MemoryProfile(total=80 * GIB, peak=80 * GIB, non_torch=GIB // 2)  # only a CUDA context outside torch
    with pytest.raises(ValueError, match=r"bytes; raise gpu_memory_utilization") as error:
        num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=alone)
    assert "another process" not in str(error.value)


def test_a_cache_smaller_than_one_sequence_is_an_error():
    tight = MemoryProfile(total=GIB, peak=int(0.9 * GIB) - 10 * PER_BLOCK, non_torch=0)  # room for 10 blocks
    assert num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=tight, max_model_len=160) == 10
    with pytest.raises(ValueError, match=r"holds 10 blocks x 16 = 160 tokens, fewer than one sequence of "
                                         r"max_model_len=2048.*or lower max_model_len"):
        num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=tight, max_model_len=2048)


def test_gpu_memory_utilization_must_be_a_fraction():
    with pytest.raises(ValueError, match="gpu_memory_utilization must lie in"):
        num_blocks_for_memory(SMOLLM2_135M, BLOCK, torch.bfloat16, profile=MemoryProfile(GIB, 0, 0),
                              gpu_memory_utilization=1.5)


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens, num_blocks, expected", [
    (64, 1024, 10_000, [1, 2, 4, 8, 16, 32, 48, 64]),
    (40, 1024, 10_000, [1, 2, 4, 8, 16, 32, 40]),
    (256, 24, 10_000, [1, 2, 4, 8, 16, 24]),  # a step batches at most 24 tokens: no larger decode batch
    (64, 1024, 5, [1, 2, 4, 5]),              # 5 blocks: at most 5 running sequences
    (1, 1024, 100, [1]),
])
def test_only_reachable_decode_batch_sizes_are_captured(max_num_seqs, max_num_batched_tokens, num_blocks, expected):
    assert capture_sizes(max_num_seqs, max_num_batched_tokens, num_blocks) == expected


def test_capture_sizes_rejects_an_impossible_configuration():
    with pytest.raises(ValueError, match="no decode batch is possible"):
        capture_sizes(0, 1024, 100)


def test_the_profile_run_composes_its_measurements(monkeypatch):
    """profile_cuda_memory on a CPU model with torch.cuda's counters faked: it runs the dummy steps for
    real and builds the profile from peak, others' memory and the graphs' decode-step increment."""
    import dataclasses

    from labkit.engine import memory
    from labkit.model.random_weights import random_model

    peaks = iter([3 * GIB, GIB + GIB // 8])  # the largest step's peak, then the decode step's
    steps = []
    real_step = memory._dummy_step
    monkeypatch.setattr(memory, "_dummy_step", lambda model, t, s: (steps.append((t, s)), real_step(model, t, s)))
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: next(peaks))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: 4 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (11 * GIB, 16 * GIB))  # 5 GiB in use
    model = random_model(dataclasses.replace(SMOLLM2_135M, num_layers=1, vocab_size=512))
    profile = memory.profile_cuda_memory(model, max_num_batched_tokens=100, max_num_seqs=8, graph_batch_size=8)
    assert steps == [(100, 8), (8, 8)]
    assert profile == MemoryProfile(total=16 * GIB, peak=3 * GIB, non_torch=GIB, graph_pool=GIB // 8)
