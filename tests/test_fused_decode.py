"""The fused C decode step (labkit.model.fused_decode) against the eager model it replaces, when the
engine uses it, and its refusal of models and inputs it cannot run."""

import functools
from dataclasses import replace

import pytest
import torch

from labkit.attention.metadata import AttentionMetadata
from labkit.cache.paged_storage import PagedKVStorage
from labkit.engine import LLM
from labkit.model import load_model
from labkit.model.fused_decode import MAX_ROWS, FusedDecoder
from labkit.sampling import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def engine(request):
    llm = LLM("smollm2", device="cpu", weight_format="q4_1", dtype=request.param, max_num_seqs=4)
    if not isinstance(llm.runner.fast_path, FusedDecoder):
        pytest.skip(f"no fused decode here: {FusedDecoder.unsupported(llm.model, llm.storage)}")
    return llm


def test_fused_steps_are_as_close_to_the_fp32_model_as_the_eager_steps(engine):
    """Both paths run the same layers with int8-quantized activations, so neither equals the other:
    the fused step's float32 residual and its sums' order move an activation across a rounding edge
    now and then (layer 0 of SmolLM2 holds a value of ~21, so its group of 32 rounds in steps of
    ~0.17), and that difference grows through 30 layers. What must hold is that the fused step is no
    further than the eager one from the dequantized fp32 model, run on the same tokens, and that it
    picks the fp32 model's token wherever that choice is clear."""
    fused = engine.runner.fast_path
    steps = []

    def both(input_ids, positions, meta):
        with torch.inference_mode():
            hidden = engine.model.forward_hidden(input_ids, positions, meta, engine.runner.backend)
            eager = engine.model.compute_logits(hidden).float()
        logits = FusedDecoder.run(fused, input_ids, positions, meta).float()
        steps.append((logits[0], eager[0]))
        return logits

    fused.run = both
    try:
        out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    finally:
        del fused.run
    with torch.inference_mode():
        logits = dense_fp32()(torch.tensor(out.prompt_token_ids + out.token_ids))
    reference = logits[len(out.prompt_token_ids):][:len(steps)]  # the rows the decode steps computed
    fused_distance = sum((f - r).abs().mean() for (f, _), r in zip(steps, reference, strict=True)) / len(steps)
    eager_distance = sum((e - r).abs().mean() for (_, e), r in zip(steps, reference, strict=True)) / len(steps)
    assert fused_distance < 1.25 * eager_distance + 0.02 and fused_distance < 0.6, (fused_distance, eager_distance)
    top2 = reference.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    fused_tokens = torch.stack([f for f, _ in steps]).argmax(-1)
    assert clear.sum() >= 5 and (fused_tokens == reference.argmax(-1))[clear].all()


@functools.cache
def dense_fp32():
    return load_model("smollm2", device="cpu", dtype=torch.float32)


def test_the_engine_decodes_small_batches_fused_and_larger_ones_eagerly(engine):
    fused, calls = engine.runner.fast_path, []
    fused.run = lambda *args: calls.append(len(args[0])) or FusedDecoder.run(fused, *args)
    try:
        outputs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert calls == [3, 3, 3] and all(len(o.token_ids) == 4 for o in outputs)
        assert fused.fits(MAX_ROWS, 100) and not fused.fits(MAX_ROWS + 1, 100)
    finally:
        del fused.run
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


def dense_engine(dtype: torch.dtype) -> LLM:
    """The engine's own dense model in `dtype`, its linears packed for a C GEMM (float32: AVX-512; bf16:
    AMX or AVX512-BF16) where this CPU has that kernel; skips the test where it does not."""
    llm = LLM("smollm2", device="cpu", dtype=dtype, max_num_seqs=16)
    if not isinstance(llm.runner.fast_path, FusedDecoder):
        pytest.skip(f"no fused decode here: {FusedDecoder.unsupported(llm.model, llm.storage)}")
    return llm


@pytest.fixture(scope="module")
def float32_engine():
    return dense_engine(torch.float32)


def test_a_float32_models_fused_steps_match_its_eager_steps(float32_engine):
    """Same packed GEMM, same order of sums in every linear: only the norms', rotary's and SiLU's float32
    arithmetic differs from torch's, so the logits agree to ~1e-4 (transformers' parity bound is 1e-3)
    and greedy decoding picks the same tokens, in batches larger than the quantized limit."""
    llm, fused, distances = float32_engine, float32_engine.runner.fast_path, []

    def both(input_ids, positions, meta):
        with torch.inference_mode():
            eager = llm.model.compute_logits(llm.model.forward_hidden(input_ids, positions, meta,
                                                                      llm.runner.backend)).float()
        logits = FusedDecoder.run(fused, input_ids, positions, meta).float()
        distances.append((len(input_ids), (logits - eager).abs().max().item()))
        return logits

    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS][:MAX_ROWS + 3]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fused.run = both
    try:
        outputs = llm.generate(prompts, params)
    finally:
        del fused.run
    assert {rows for rows, _ in distances} == {MAX_ROWS + 3} and len(distances) == 5
    assert max(d for _, d in distances) < 1e-3, distances
    llm.runner.fast_path = None
    try:
        eager_outputs = llm.generate(prompts, params)
    finally:
        llm.runner.fast_path = fused
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager_outputs]
    assert fused.fits(1024, 100) and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_float32_models_prompt_chunk_and_mixed_steps_run_fused_as_its_eager_steps(float32_engine):
    """A dense model's fused step runs every step, each prompt row a decode row over its causal
    prefix: a fresh prompt, a later chunk over its cached first part, a prompt over a prefix-cache hit
    and decodes sharing a step all give the eager step's logits to 1e-3, row for row."""
    shared = float32_engine
    llm = LLM(shared.model, tokenizer=shared.tokenizer, max_num_seqs=5, max_num_batched_tokens=24)
    fused, kinds = llm.runner.fast_path, set()
    assert fused.runs_prompts

    def both(input_ids, positions, meta):
        with torch.inference_mode():
            eager = llm.model.compute_logits(llm.model.forward_hidden(input_ids, positions, meta,
                                                                      llm.runner.backend)).float()
            hidden = FusedDecoder.forward_hidden(fused, input_ids, positions, meta)
            assert (llm.model.compute_logits(hidden).float() - eager).abs().max() < 1e-3
        q_lens, k_lens = meta.cu_seqlens_q.diff(), meta.cu_seqlens_k.diff()
        kinds.update({"decode" if q == 1 else "prompt" if q == k else "over a cached prefix"
                      for q, k in zip(q_lens.tolist(), k_lens.tolist(), strict=True)}
                     | ({"mixed"} if (q_lens == 1).any() and (q_lens > 1).any() else set()))
        return hidden

    story = "Once upon a time, in a village by the sea, there lived an old fisherman who told stories"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fused.forward_hidden = both
    try:
        first = llm.generate([story], params)
        outputs = llm.generate([story + " to the children", *PROMPTS, story * 2], params)
    finally:
        del fused.forward_hidden
    assert {"prompt", "over a cached prefix", "decode", "mixed"} <= kinds, kinds
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    llm.runner.fast_path = None
    eager = llm.generate([story + " to the children", *PROMPTS, story * 2], params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager] and first[0].token_ids


@pytest.fixture(scope="module")
def bfloat16_engine():
    return dense_engine(torch.bfloat16)


def test_a_bfloat16_models_fused_steps_are_as_close_to_the_fp32_model_as_its_eager_steps(bfloat16_engine):
    """The eager bf16 step rounds its residual stream to bf16 after every layer, the fused one keeps it
    in float32 and rounds only the linears' inputs (the bf16 GEMM's operands): neither equals the
    other. What must hold, for every sequence of a batch larger than the quantized limit, over its
    prompt step and its decode steps: the fused step is no further than the eager one from the float32
    model on the same tokens, and it picks the float32 model's token wherever that choice is clear."""
    llm, fused, steps = bfloat16_engine, bfloat16_engine.runner.fast_path, []

    def both(input_ids, positions, meta):
        with torch.inference_mode():
            hidden = llm.model.forward_hidden(input_ids, positions, meta, llm.runner.backend)
            eager = llm.model.compute_logits(hidden).float()
        logits = FusedDecoder.run(fused, input_ids, positions, meta).float()
        steps.append((input_ids.clone(), logits, eager))
        return logits

    def prompt_step(input_ids, positions, meta):  # the prompts' last rows predict the first tokens
        last = meta.cu_seqlens_q[1:] - 1
        with torch.inference_mode():
            eager = llm.model.compute_logits(llm.model.forward_hidden(input_ids, positions, meta,
                                                                      llm.runner.backend)[last]).float()
            hidden = FusedDecoder.forward_hidden(fused, input_ids, positions, meta)
        steps.append((None, llm.model.compute_logits(hidden[last]).float(), eager))
        return hidden

    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS][:MAX_ROWS + 3]
    fused.run, fused.forward_hidden = both, prompt_step
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        del fused.run, fused.forward_hidden
    assert steps[0][0] is None and [len(ids) for ids, _, _ in steps[1:]] == [len(prompts)] * 7
    fused_distance = eager_distance = 0.0
    for row, out in enumerate(outputs):
        assert [ids[row].item() for ids, _, _ in steps[1:]] == out.token_ids[:7]  # row i is sequence i throughout
        with torch.inference_mode():
            logits = dense_fp32()(torch.tensor(out.prompt_token_ids + out.token_ids))
        reference = logits[len(out.prompt_token_ids) - 1:][:8]  # the prompt step's row, then 7 decode steps'
        fused_rows, eager_rows = (torch.stack([step[k][row] for step in steps]) for k in (1, 2))
        fused_distance += (fused_rows - reference).abs().mean().item() / len(outputs)
        eager_distance += (eager_rows - reference).abs().mean().item() / len(outputs)
        top2 = reference.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1.0
        assert (fused_rows.argmax(-1) == reference.argmax(-1))[clear].all()
    assert fused_distance <= 1.1 * eager_distance, (fused_distance, eager_distance)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_models_and_pools_it_cannot_run_are_named(engine):
    """The engine keeps its eager path for them (LLM asks `unsupported` before it builds one)."""
    c = engine.model.config
    assert FusedDecoder.unsupported(dense_fp32(), engine.storage).endswith(  # torch's nn.Linear, not packed
        "nor all packed for a C GEMM (PackedF32Linear, PackedBf16Linear), without biases")
    int8_pool = PagedKVStorage(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, dtype=engine.model.dtype,
                               kv_cache_dtype="int8")
    assert "KV pool is quantized" in FusedDecoder.unsupported(engine.model, int8_pool)
    with pytest.raises(ValueError, match="cannot decode fused: the KV pool is quantized"):
        FusedDecoder(engine.model, int8_pool, engine.runner.backend)
    assert LLM(dense_fp32(), tokenizer=engine.tokenizer, max_num_seqs=1).runner.fast_path is None


def test_bad_steps_are_refused_before_the_c_code_runs(engine):
    fused, ids, positions = engine.runner.fast_path, torch.tensor([1, 2]), torch.tensor([4, 4])
    meta = AttentionMetadata(torch.tensor([0, 1, 2]), torch.tensor([0, 5, 10]), 1, 5, torch.tensor([3, 7]),
                             torch.tensor([[0], [1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="slots outside the pool"):
        fused.run(ids, positions, replace(meta, slot_mapping=torch.tensor([3, 10 ** 9])))
    with pytest.raises(ValueError, match="need more than the block tables"):
        fused.run(ids, positions, replace(meta, cu_seqlens_k=torch.tensor([0, 5, 45])))
    with pytest.raises(ValueError, match=f"up to {MAX_ROWS} sequences adding one token each"):
        fused.run(torch.ones(MAX_ROWS + 1, dtype=torch.long), torch.ones(MAX_ROWS + 1, dtype=torch.long), meta)
    assert not fused.runs_prompts  # a quantized model's prompts multiply faster as the eager dense GEMMs
    eager = engine.model.forward_hidden(ids, positions, meta, engine.runner.backend)
    assert torch.equal(fused.forward_hidden(ids, positions, meta), eager)
