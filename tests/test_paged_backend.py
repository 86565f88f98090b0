"""PagedAttentionBackend in a tiny Llama: paged torch and paged Triton (interpreter) give the dense tokens.

A miniature engine loop drives it: BlockManager blocks, prefix caching (the second prompt shares the
first one's prefix and joins one step later, so steps mix a prefill over a cached prefix with a decode).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.attention import reference  # noqa: E402
from labkit.attention.metadata import AttentionMetadata  # noqa: E402
from labkit.attention.paged import PagedAttentionBackend, resolve_backend  # noqa: E402
from labkit.cache.block_manager import BlockManager  # noqa: E402
from labkit.cache.paged_storage import PagedKVStorage, slot_mapping  # noqa: E402
from labkit.cache.sequence_blocks import BlockSequence  # noqa: E402
from labkit.model import DecoderModel, ModelConfig, generate  # noqa: E402

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    return DecoderModel(config).eval()


def step(model, backend, bm, seqs):
    """One engine step over `seqs`: run each one's uncached tokens, return the next greedy token of each."""
    ids, positions, slots, q_lens, k_lens = [], [], [], [], []
    for seq in seqs:
        start, end = seq.num_cached_tokens, len(seq.token_ids)
        ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += slot_mapping(seq.block_table, start, end, BLOCK_SIZE)
        q_lens.append(end - start)
        k_lens.append(end)
    tables = torch.full((len(seqs), max(len(s.block_table) for s in seqs)), -1, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
    meta = AttentionMetadata(torch.tensor([0, *q_lens]).cumsum(0), torch.tensor([0, *k_lens]).cumsum(0),
                             max(q_lens), max(k_lens), torch.tensor(slots), tables)
    hidden = model.forward_hidden(torch.tensor(ids), torch.tensor(positions), meta, backend)
    last = meta.cu_seqlens_q[1:] - 1
    tokens = model.compute_logits(hidden[last]).argmax(-1).tolist()
    for seq, token in zip(seqs, tokens, strict=True):
        seq.num_cached_tokens = len(seq.token_ids)
        seq.token_ids.append(token)
        bm.append(seq)
    return tokens


@torch.no_grad()
def paged_generate(model, prompts, backend_name, max_new_tokens):
    cfg = model.config
    storage = PagedKVStorage(cfg.num_layers, 16, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    backend = PagedAttentionBackend(storage, backend_name)
    bm = BlockManager(16, BLOCK_SIZE)
    seqs = [BlockSequence(i, list(p)) for i, p in enumerate(prompts)]
    bm.allocate(seqs[0])
    running = [seqs[0]]
    step(model, backend, bm, running)  # the first prompt alone: its prefix gets cached
    for seq in seqs[1:]:
        bm.allocate(seq)
        running.append(seq)
    while running:
        step(model, backend, bm, running)
        running = [s for s in running if len(s.token_ids) < len(prompts[s.seq_id]) + max_new_tokens]
    hits = bm.stats.hit_tokens
    for seq in seqs:
        bm.deallocate(seq)
    assert bm.num_free_blocks == 16
    return [s.token_ids[len(p):len(p) + max_new_tokens] for s, p in zip(seqs, prompts, strict=True)], hits


PROMPTS = [list(range(3, 22)), list(range(3, 22))[:17] + [50, 51, 52, 53]]  # 16 shared tokens = 2 blocks


@pytest.fixture(scope="module")
def dense_tokens(tiny_model):
    return [generate(tiny_model, torch.tensor(p), 6).tolist() for p in PROMPTS]


def test_paged_torch_backend_gives_the_dense_tokens(tiny_model, dense_tokens):
    tokens, hits = paged_generate(tiny_model, PROMPTS, "torch", 6)
    assert hits == 16  # the shared prefix was served from the cache
    assert tokens == dense_tokens


def test_paged_triton_backend_in_a_tiny_model_gives_the_torch_tokens(tiny_model, dense_tokens):
    tokens, hits = paged_generate(tiny_model, PROMPTS, "triton", 6)
    assert hits == 16 and tokens == dense_tokens


def test_triton_backend_logits_match_torch_backend(tiny_model):
    cfg = tiny_model.config
    outs = []
    for name in ("torch", "triton"):
        storage = PagedKVStorage(cfg.num_layers, 4, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        backend = PagedAttentionBackend(storage, name)
        meta = AttentionMetadata(torch.tensor([0, 11]), torch.tensor([0, 11]), 11, 11,
                                 torch.tensor(slot_mapping([2, 0], 0, 11, BLOCK_SIZE)), torch.tensor([[2, 0]]))
        outs.append(tiny_model(torch.arange(5, 16), attn_metadata=meta, backend=backend))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_backend_choice_and_errors(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("flash", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))
    backend = PagedAttentionBackend(PagedKVStorage(1, 2, 8, 1, 4), "torch")
    q = torch.randn(3, 2, 4)
    meta = AttentionMetadata(torch.tensor([0, 3]), torch.tensor([0, 5]), 3, 5)
    with pytest.raises(ValueError, match="needs block tables"):
        backend(0, q, q[:, :1], q[:, :1], meta)
    k = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        backend(0, torch.randn(3, 3, 4), k, k, AttentionMetadata.causal([3]))


def test_torch_backend_plans_each_step_once_and_never_reuses_a_stale_plan():
    """Two steps with the same lengths but different block tables: the second must not attend over
    the first one's blocks, and a step's layers share one plan."""
    torch.manual_seed(0)
    storage = PagedKVStorage(num_layers=2, num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=16)
    storage.kv.normal_()
    backend = PagedAttentionBackend(storage, "torch")
    q, k, v = torch.randn(2, 6, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    cu_q, cu_k = torch.tensor([0, 1, 2]), torch.tensor([0, 5, 10])
    plans = []
    for tables in (torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([[2], [3]], dtype=torch.int32)):
        meta = AttentionMetadata(cu_q, cu_k, 1, 5, None, tables)
        for layer in range(2):
            got = backend(layer, q, k, v, meta)
            k_cache, v_cache = storage.layer(layer)
            torch.testing.assert_close(got, reference.paged_attention(q, k_cache, v_cache, tables, cu_q, cu_k))
            plans.append(backend._plan[1])
    assert plans[0] is plans[1] and plans[2] is plans[3] and plans[1] is not plans[2]
