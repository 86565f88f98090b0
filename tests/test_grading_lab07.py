"""Lab 07 graders (each typical mistake is named) and the lesson's numbers the lab recomputes."""

import math

import pytest
import torch

from labkit.grading.core import get_exercise, run_exercise
from labkit.grading.labs.lab07 import _reference_gather, _reference_savings


def grade(name, obj):
    return run_exercise(get_exercise("07", name), {name: obj})


class Allocator:
    def __init__(self, total_blocks, block_size, eager=False, leak=False):
        self.total, self.bs, self.free = total_blocks, block_size, list(range(total_blocks))
        self.tables, self.lens = {}, {}
        self.eager, self.leak = eager, leak

    def allocate_sequence(self, seq_id, length):
        self.tables[seq_id], self.lens[seq_id] = [], 0
        self.append_tokens(seq_id, length)
        return list(self.tables[seq_id])

    def append_tokens(self, seq_id, num_tokens):
        if self.eager and self.lens[seq_id]:  # a new block per append, ignoring the partial last block
            needed = -(-num_tokens // self.bs)
        else:
            needed = -(-(self.lens[seq_id] + num_tokens) // self.bs) - len(self.tables[seq_id])
        self.lens[seq_id] += num_tokens
        new = [self.free.pop(0) for _ in range(needed)]
        self.tables[seq_id] += new
        return new or None

    def free_sequence(self, seq_id):
        blocks = self.tables.pop(seq_id)
        if not self.leak:
            self.free += blocks
        return len(blocks)

    def get_utilization(self):
        return 1 - len(self.free) / self.total


def savings(num_sequences, avg_length, max_length, block_size, memory_per_token, unrounded=False,
            relative_to_paged=False, fraction=False):
    r = _reference_savings(num_sequences, avg_length, max_length, block_size, memory_per_token)
    if unrounded:
        r["paged_memory"] = num_sequences * avg_length * memory_per_token
    if relative_to_paged:
        r["savings_percent"] = 100 * r["savings_bytes"] / r["paged_memory"]
    if fraction:
        r["savings_percent"] /= 100
    return r


def gather(kv, table, lens, layer, kv_idx, mode="ok"):
    if mode == "all_layers":
        return torch.stack([_reference_gather(kv, table, lens, i, kv_idx) for i in range(kv.shape[1])], 1)
    if mode == "keys":
        return _reference_gather(kv, table, lens, layer, 0)
    out = kv[table.clamp(min=0), layer, kv_idx].flatten(1, 2)
    if mode == "whole_blocks":
        return out[:, :32]
    out = out[:, : int(lens.max())]
    if mode == "no_zero":
        return out
    if mode == "order":
        out = kv[table.clamp(min=0).flip(1), layer, kv_idx].flatten(1, 2)[:, : int(lens.max())]
    return out * (torch.arange(out.shape[1])[None] < lens[:, None])[..., None, None]


def online(q, kb, vb, rescale=True, per_block=False):
    out, den = torch.zeros_like(q), torch.zeros(q.shape[:1], dtype=q.dtype)
    m = torch.full(q.shape[:1], -math.inf, dtype=q.dtype)
    if per_block:
        for k, v in zip(kb, vb, strict=True):
            p = torch.softmax(torch.einsum("hd,bhd->hb", q, k) / q.shape[-1] ** 0.5, -1)
            out = out + torch.einsum("hb,bhd->hd", p, v)
        return out
    for k, v in zip(kb, vb, strict=True):
        s = torch.einsum("hd,bhd->hb", q, k) / q.shape[-1] ** 0.5
        m_new = torch.maximum(m, s.max(-1).values)
        p = torch.exp(s - m_new[:, None])
        a = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        den, out, m = a * den + p.sum(-1), a[:, None] * out + torch.einsum("hb,bhd->hd", p, v), m_new
    return out / den[:, None]


def stub(*args, **kwargs):
    raise NotImplementedError()


class StubAllocator:
    def __init__(self, total_blocks, block_size):
        raise NotImplementedError()


class EagerAllocator(Allocator):
    def __init__(self, total_blocks, block_size):
        super().__init__(total_blocks, block_size, eager=True)


class LeakyAllocator(Allocator):
    def __init__(self, total_blocks, block_size):
        super().__init__(total_blocks, block_size, leak=True)


@pytest.mark.parametrize("name, obj, passed, message", [
    ("SimpleBlockAllocator", Allocator, True, "blocks allocated on demand"),
    ("SimpleBlockAllocator", StubAllocator, False, "not implemented yet"),
    ("SimpleBlockAllocator", EagerAllocator, False, "14 free slots"),
    ("SimpleBlockAllocator", LeakyAllocator, False, "not back in the free pool"),
    ("calculate_memory_savings", savings, True, "rounds each up to whole blocks"),
    ("calculate_memory_savings", stub, False, "not implemented yet"),
    ("calculate_memory_savings", lambda **kw: savings(**kw, unrounded=True), False, "round each sequence up"),
    ("calculate_memory_savings", lambda **kw: savings(**kw, relative_to_paged=True), False, "relative to the paged"),
    ("calculate_memory_savings", lambda **kw: savings(**kw, fraction=True), False, "percent means 0..100"),
    ("gather_kv_from_blocks", gather, True, "zero-padded to the longest"),
    ("gather_kv_from_blocks", stub, False, "not implemented yet"),
    ("gather_kv_from_blocks", lambda *a: gather(*a, mode="all_layers"), False, "layer dimension"),
    ("gather_kv_from_blocks", lambda *a: gather(*a, mode="keys"), False, "gathered the keys"),
    ("gather_kv_from_blocks", lambda *a: gather(*a, mode="whole_blocks"), False, "trim to the longest"),
    ("gather_kv_from_blocks", lambda *a: gather(*a, mode="no_zero"), False, "zero padding"),
    ("gather_kv_from_blocks", lambda *a: gather(*a, mode="order"), False, "wrong places"),
    ("online_softmax_attention", online, True, "equals softmax over all keys"),
    ("online_softmax_attention", stub, False, "not implemented yet"),
    ("online_softmax_attention", lambda *a: online(*a, rescale=False), False, "rescale"),
    ("online_softmax_attention", lambda *a: online(*a, per_block=True), False, "its own softmax"),
])
def test_lab07_graders(name, obj, passed, message):
    outcome = grade(name, obj)
    assert message in outcome.message and outcome.passed == passed


def test_lab07_claims():
    assert 32 * 2 * 16 * 32 * 128 * 2 == 8_388_608
    r = _reference_savings(100, 1000, 2048, 16, 1)
    assert f"{r['utilization_traditional']:.1%}" == "48.8%" and f"{r['utilization_paged']:.1%}" == "99.2%"
    assert f"{r['savings_percent']:.1f}" == "50.8"
    lengths = torch.randint(1, 4000, (20_000,), generator=torch.Generator().manual_seed(0)).tolist()
    for b in (8, 16, 32, 64):
        mean_waste = sum(-n % b for n in lengths) / len(lengths)
        assert abs(mean_waste - (b - 1) / 2) < 0.1 * b / 4 + 0.25 and abs(mean_waste - b / 2) > 0.3
    tokens = (80e9 - 6.74e9 * 2) / (2 * 32 * 32 * 128 * 2)
    assert int(tokens // 2048) == 61 and int(tokens // 4096) == 30 and int(tokens // 1008) == 125
