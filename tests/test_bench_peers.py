"""bench/bench_peers.py's pure-Python parts, run without llama.cpp: the continuous batcher that drives
llama.cpp's batch API (against a fake engine whose KV cache is keyed by sequence id), the agreement
counts, labkit's scores along a fixed text, and the message when llama-cpp-python is not built."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench_peers imports bench_engine as a sibling script does
spec = importlib.util.spec_from_file_location("bench_peers", BENCH / "bench_peers.py")
bench_peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_peers)
ContinuousBatcher = bench_peers.ContinuousBatcher


def next_token(context: list[int]) -> int:
    """A fake model's greedy choice: depends on every token before it and on their order."""
    h = 0
    for t in context:
        h = (h * 31 + t) % 1009
    return h


class FakeEngine:
    """A KV cache per sequence id that checks what llama.cpp would need: positions continue the cached
    ones, a finished id is cleared before reuse, and no step exceeds the batch or the sequence ids."""

    def __init__(self, max_seqs: int, max_batch_tokens: int):
        self.max_seqs, self.max_batch_tokens = max_seqs, max_batch_tokens
        self.cache: dict[int, list[int]] = {}
        self.steps = 0

    def decode(self, entries) -> dict[int, int]:
        assert 0 < len(entries) <= self.max_batch_tokens
        self.steps += 1
        sampled = {}
        for e in entries:
            assert 0 <= e.seq_id < self.max_seqs
            cached = self.cache.setdefault(e.seq_id, [])
            assert e.pos == len(cached), f"sequence {e.seq_id}: token at {e.pos} after {len(cached)} cached"
            cached.append(e.token)
            if e.logits:
                sampled[e.request] = next_token(cached)
        return sampled

    def run(self, batcher: ContinuousBatcher):
        while not batcher.done:
            for seq_id in batcher.advance(self.decode(batcher.next_batch())):
                del self.cache[seq_id]
        assert not self.cache  # every finished sequence was cleared
        return [r.output for r in batcher.requests]


def reference(prompt: list[int], n: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(context))
        context.append(out[-1])
    return out


@pytest.mark.parametrize("max_seqs, max_batch_tokens", [(1, 10), (3, 10), (3, 64), (8, 12)])
def test_every_request_generates_its_own_greedy_tokens_exactly_to_its_length(max_seqs, max_batch_tokens):
    prompts = [[5, 7, 9], [1] * 10, [2, 3], [8], [4, 4, 4, 4], [6, 1, 6], [9] * 7]
    lengths = [4, 1, 6, 3, 2, 5, 1]
    engine = FakeEngine(max_seqs, max_batch_tokens)
    outputs = engine.run(ContinuousBatcher(prompts, lengths, max_seqs, max_batch_tokens))
    assert outputs == [reference(p, n) for p, n in zip(prompts, lengths, strict=True)]
    if max_seqs == 1:  # one at a time: a prefill step, then one step per further token
        assert engine.steps == sum(lengths)


def test_running_sequences_are_not_starved_by_waiting_prompts():
    """Decode tokens go in first: a step that admits a prompt still advances every running sequence."""
    batcher = ContinuousBatcher([[1, 2, 3], [4, 5, 6, 7]], [3, 3], max_seqs=2, max_batch_tokens=5)
    first = batcher.next_batch()
    assert [e.request for e in first] == [0, 0, 0]  # request 1's 4 tokens would overflow 5
    batcher.advance({0: 11})
    second = batcher.next_batch()
    assert [(e.request, e.token, e.pos, e.logits) for e in second] == [
        (0, 11, 3, True), (1, 4, 0, False), (1, 5, 1, False), (1, 6, 2, False), (1, 7, 3, True)]
    assert second[0].seq_id != second[1].seq_id


@pytest.mark.parametrize("prompts, lengths, seqs, budget, message", [
    ([[1] * 9], [2], 2, 8, "prompt 0 has 9 tokens, more than a batch holds (8)"),
    ([[1], []], [2, 2], 2, 8, "prompt 1 is empty"),
    ([[1], [2]], [2, 0], 2, 8, "request 1 asks for 0 tokens"),
    ([[1], [2]], [2], 2, 8, "2 prompts but 1 output lengths"),
    ([[1]], [2], 0, 8, "max_seqs (0)"),
])
def test_requests_that_could_never_run_are_refused_at_once(prompts, lengths, seqs, budget, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ContinuousBatcher(prompts, lengths, seqs, budget)


def test_sampled_tokens_must_cover_exactly_the_running_requests():
    batcher = ContinuousBatcher([[1, 2], [3]], [2, 2], max_seqs=2, max_batch_tokens=8)
    batcher.next_batch()
    with pytest.raises(ValueError, match=r"sampled tokens for requests \[0\], but \[0, 1\] run"):
        batcher.advance({0: 5})


def test_matching_prefix_counts_until_the_first_difference():
    assert bench_peers.matching_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert bench_peers.matching_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert bench_peers.matching_prefix([1, 2], [1, 2, 3, 4]) == 2
    assert bench_peers.matching_prefix([], [1]) == 0


def test_without_llama_cpp_the_bench_says_how_to_build_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(SystemExit, match="make bench-peers` builds it from source"):
        bench_peers.LlamaCpp("model.gguf", threads=1, n_ctx=64, n_batch=64)


def test_make_bench_leaves_llama_cpp_to_make_bench_peers():
    """`make bench` runs every bench script but this one, which needs llama.cpp built first."""
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", "bench"], cwd=BENCH.parent,
                         capture_output=True, text=True, check=True).stdout
    assert "bench/bench_engine.py" in out and "bench_peers" not in out


def test_top2_margin_and_agreement_note():
    import numpy as np
    assert bench_peers.top2_margin(np.array([1.0, 5.0, 4.5, -2.0], dtype=np.float32)) == pytest.approx(0.5)
    assert bench_peers.top2_margin(np.array([3.0, 3.0])) == 0.0
    assert bench_peers.agreement_note(48, 48, None) == "48/48"
    assert bench_peers.agreement_note(0, 48, 0.0432) == "0/48 (gap 0.04)"


def test_agreement_counts_same_tops_and_the_reference_gaps_where_they_split():
    import torch
    reference = torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.9, 0.0], [0.0, 3.0, 1.0]])
    logits = torch.tensor([[4.0, 1.0, 0.0], [1.9, 2.0, 0.0], [0.0, 3.5, 1.0]])
    a = bench_peers.Agreement()
    a.add(reference, reference)
    assert (a.same_top, a.positions, a.split_gaps, a.max_logit_diff) == (3, 3, [], 0.0)
    assert a.kl_sum == pytest.approx(0.0, abs=1e-12)
    a.add(reference, logits)
    assert (a.same_top, a.positions) == (5, 6)
    assert a.split_gaps == [pytest.approx(0.1)]
    assert a.max_logit_diff == pytest.approx(1.0)
    p, q = reference.double().softmax(-1), logits.double().softmax(-1)
    assert a.kl_sum == pytest.approx(float((p * (p / q).log()).sum()))
    assert str(a).startswith("same top 5/6 (reference gaps there 0.10; median over all 2.00), mean KL ")


def test_forced_logits_are_the_full_sequence_scores_at_those_positions():
    """Fed a fixed continuation one token a step through a KV cache, a float32 model gives the scores a
    single pass over the whole text gives at the same positions."""
    import torch

    from labkit.model.config import ModelConfig
    from labkit.model.random_weights import random_model
    config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = random_model(config, seed=3)
    prompt, continuation = [1, 5, 9, 40], [7, 7, 96, 3, 12]
    got = bench_peers.forced_logits(model, prompt, continuation)
    with torch.inference_mode():
        whole = model(torch.tensor(prompt + continuation[:-1]))
    assert got.shape == (len(continuation), config.vocab_size)
    torch.testing.assert_close(got, whole[len(prompt) - 1:], rtol=1e-5, atol=1e-5)


def test_taps_read_contiguous_float32_tensors_by_name_and_skip_the_rest():
    """A ggml tensor laid out as llama.cpp's eval callback hands it over: the wanted names are asked
    for, a contiguous float32 one is copied as [tokens, features], anything else is passed over."""
    import ctypes

    import numpy as np
    import torch
    taps = bench_peers.Taps(lambda name: bool(bench_peers.STAGE_NAME.fullmatch(name)))
    values = np.arange(2 * 3 * 4, dtype=np.float32)  # 4 tokens of 3 heads x 2 dims

    def tensor(name, ne, type_=0):
        t = bench_peers._GgmlTensor(type=type_, name=name.encode())
        t.ne[:] = ne
        t.nb[:] = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]]
        t.data = values.ctypes.data
        return t

    def observe(t, ask):  # t stays alive until observe returns
        return taps.observe(ctypes.addressof(t), ask, None)

    assert observe(tensor("Vcur-3", (2, 3, 4, 1)), True)
    assert not observe(tensor("Vcur-3 (view)", (2, 3, 4, 1)), True)
    assert not observe(tensor("cache_k_l3", (2, 3, 4, 1)), True)
    assert observe(tensor("Vcur-3", (6, 4, 1, 1)), False)  # the projection
    assert observe(tensor("Vcur-3", (2, 3, 4, 1)), False)  # its reshape
    observe(tensor("Kcur-3", (2, 3, 4, 1), type_=1), False)  # float16: skipped
    values[0] = -1.0  # copied, not a view of llama.cpp's buffer
    expected = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert [t.tolist() for t in taps.tensors["Vcur-3"]] == [expected.tolist()] * 2
    assert set(taps.tensors) == {"Vcur-3"}
