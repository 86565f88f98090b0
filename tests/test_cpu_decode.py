"""The C decode kernel (labkit/kernels/paged_decode.c, through labkit.attention.cpu_decode) against
torch's SDPA and the gather path, its fallback when there is no compiler, its build cache, and its
refusal of bad input."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from labkit import kernels
from labkit.attention import cpu_decode, reference
from labkit.attention.metadata import AttentionMetadata
from labkit.attention.paged import PagedAttentionBackend
from labkit.cache.paged_storage import PagedKVStorage
from labkit.kernels import build, decode_attention


@pytest.fixture(scope="module")
def compiled():
    if decode_attention.load() is None:
        pytest.skip(f"no C kernel here: {decode_attention.load.why_not()}")


def sdpa_decode(q, k_cache, v_cache, tables, lens):
    """The oracle: per sequence, its blocks concatenated in table order, then torch's SDPA in float32."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    outs = []
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, :-(-n // block_size)].long()
        k, v = (cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1).transpose(0, 1)
                for cache in (k_cache, v_cache))
        outs.append(F.scaled_dot_product_attention(q[i, :, None].float(), k, v)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (6, 6, 16, 8), (8, 1, 128, 32), (4, 2, 48, 16), (10, 2, 64, 16)])
def test_kernel_matches_sdpa_and_the_gather_path(compiled, dtype, num_heads, num_kv_heads, head_dim, block_size):
    """Sequences of 1 token, a partly filled last block, exactly full blocks and many blocks, in
    shuffled blocks; GQA groups of 3, 1 (MHA), 8 (MQA), 2 and 5: the (group, head_dim) pairs compiled
    with both fixed, (3, 64) and (8, 128), and the general path, (1, 16), (2, 48) and (5, 64)."""
    k_lens = [1, 5, block_size, block_size + 1, 3 * block_size - 2, 200]
    q, k_cache, v_cache, tables, _, cu_k = reference.random_paged_inputs(
        k_lens, [1] * len(k_lens), num_kv_heads, head_dim, block_size, num_heads, seed=3, dtype=dtype)
    lens = cu_k.diff()
    got = cpu_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]  # bf16: the output's own rounding
    torch.testing.assert_close(got.float(), sdpa_decode(q, k_cache, v_cache, tables, lens), atol=tolerance, rtol=0)
    gathered = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(got.float(), gathered.float(), atol=2 * tolerance, rtol=0)


@pytest.mark.parametrize("target", [("AVX2", ["-march=x86-64-v3", "-DLANES=8"]), ("generic", ["-DLANES=4"])])
def test_the_narrower_vector_builds_match_sdpa(compiled, monkeypatch, fresh_build, target):
    """CPUs without AVX-512 get 8- or 4-float builds, which sum each token's score on its own (the
    AVX-512 build sums 16 at once): the same attention, for every GQA shape and a partial block."""
    if target[0] == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU cannot run an AVX2 build")
    monkeypatch.setattr(build, "cpu_target", lambda: target)
    assert decode_attention.load().name == f"C/{target[0]}"
    for dtype in (torch.float32, torch.bfloat16):
        k_lens = [1, 7, 16, 40, 150]
        q, k_cache, v_cache, tables, _, cu_k = reference.random_paged_inputs(
            k_lens, [1] * len(k_lens), 3, 64, 16, 9, seed=4, dtype=dtype)
        lens = cu_k.diff()
        got = cpu_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens)
        tolerance = {torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(got.float(), sdpa_decode(q, k_cache, v_cache, tables, lens), atol=tolerance, rtol=0)


def test_extreme_scores_stay_finite_and_exact(compiled):
    """Scores far apart (a max that grows block after block, others e^-1000 below it) must neither
    overflow nor underflow into NaN: the online softmax rescales instead."""
    q, k_cache, v_cache, tables, _, cu_k = reference.random_paged_inputs([40, 33], [1, 1], 1, 16, 8, 2, seed=1)
    k_cache *= torch.linspace(0, 30, k_cache.shape[0])[:, None, None, None]  # blocks of growing scale
    lens = cu_k.diff()
    got = cpu_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, sdpa_decode(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)


def test_a_mixed_step_serves_its_decode_rows_with_the_kernel(compiled):
    """A prefill over a cached prefix, a decode and a fresh prefill in one step: the decode rows go to
    the kernel, the others keep the gather, and the step equals the all-gather plan."""
    k_lens, q_lens = [40, 23, 17, 9], [8, 1, 17, 1]
    q, k_cache, v_cache, tables, cu_q, cu_k = reference.random_paged_inputs(k_lens, q_lens, 3, 64, 16, 9, seed=2)
    direct = reference.PagedAttentionPlan(cu_q, cu_k, tables, 16, 3, always_read_cache=True,
                                          decode_group=cpu_decode.DecodePlan)
    gather = reference.PagedAttentionPlan(cu_q, cu_k, tables, 16, 3, always_read_cache=True)
    assert isinstance(direct.groups[0], cpu_decode.DecodePlan) and direct.groups[0].tokens.tolist() == [8, 26]
    torch.testing.assert_close(direct.run(q, None, None, k_cache, v_cache), gather.run(q, None, None, k_cache, v_cache),
                               atol=2e-6, rtol=0)


def test_every_row_as_a_decode_row_equals_the_padded_causal_attention(compiled):
    """The same mixed step with each query row of every prefill made a decode row over its causal
    prefix (the float32 engine's prefills): one kernel group, the gather plan's result."""
    k_lens, q_lens = [40, 23, 17, 9, 96], [8, 1, 17, 1, 96]
    q, k_cache, v_cache, tables, cu_q, cu_k = reference.random_paged_inputs(k_lens, q_lens, 3, 64, 16, 9, seed=3)
    rows = reference.PagedAttentionPlan(cu_q, cu_k, tables, 16, 3, decode_group=cpu_decode.DecodePlan,
                                        every_row_as_decode=True)
    gather = reference.PagedAttentionPlan(cu_q, cu_k, tables, 16, 3, always_read_cache=True)
    assert len(rows.groups) == 1 and rows.groups[0].context_lens[:9].tolist() == list(range(33, 41)) + [23]
    torch.testing.assert_close(rows.run(q, None, None, k_cache, v_cache), gather.run(q, None, None, k_cache, v_cache),
                               atol=2e-6, rtol=0)


def test_rows_are_taken_only_where_padding_would_over_double_the_work(compiled, monkeypatch):
    """One whole prompt (its box is just under twice the causal work) keeps the padded SDPA; a
    decode-only step (the engine's hot path) goes straight to the decode group, without weighing
    the padding at all, however uneven its contexts."""
    one_prompt = torch.tensor([0, 96])
    plan = reference.PagedAttentionPlan(one_prompt, one_prompt, torch.arange(6)[None], 16, 3,
                                        decode_group=cpu_decode.DecodePlan, every_row_as_decode=True)
    assert isinstance(plan.groups[0], reference._PaddedGroup) and not plan.reads_cache
    monkeypatch.setattr(reference, "_padding_dominates", lambda *_: pytest.fail("weighed a decode-only step"))
    decodes = reference.PagedAttentionPlan(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 200, 209, 218]),
                                           torch.arange(39).view(3, 13), 16, 3,
                                           decode_group=cpu_decode.DecodePlan, every_row_as_decode=True)
    assert len(decodes.groups) == 1 and decodes.groups[0].context_lens.tolist() == [200, 9, 9]


def test_the_engine_backend_plans_the_kernel_once_per_step(compiled):
    torch.manual_seed(0)
    storage = PagedKVStorage(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=3, head_dim=64)
    storage.kv.normal_()
    backend = PagedAttentionBackend(storage, "torch")
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    tables = torch.tensor([[5, 1], [2, -1]], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor([0, 1, 2]), torch.tensor([0, 20, 27]), 1, 20, None, tables)
    outs = [backend(layer, q, k, k, meta) for layer in range(2)]
    plan = backend._plan[1]
    assert len(plan.groups) == 1 and isinstance(plan.groups[0], cpu_decode.DecodePlan)
    for layer, out in enumerate(outs):
        k_cache, v_cache = storage.layer(layer)
        torch.testing.assert_close(out, sdpa_decode(q, k_cache, v_cache, tables, meta.context_lens), atol=2e-6,
                                   rtol=0)


def test_the_kernel_is_named_for_this_cpu():
    name = kernels.describe().attention
    assert re.fullmatch(r"C/(AVX-512 VNNI|AVX-512|AVX2|NEON|generic)|torch gather \(.+\)", name)
    assert kernels.describe("cuda").attention == "torch gather (cuda)"


def test_without_a_compiler_attention_falls_back_to_the_gather_and_says_so(monkeypatch, fresh_build):
    monkeypatch.setattr(build, "find_c_compiler", lambda: None)
    assert kernels.describe().attention == "torch gather (no C compiler)"
    storage = PagedKVStorage(num_layers=1, num_blocks=4, block_size=8, num_kv_heads=1, head_dim=16)
    storage.kv.normal_()
    backend = PagedAttentionBackend(storage, "torch")
    assert backend._decode_group is None
    q = torch.randn(1, 2, 16)
    tables = torch.tensor([[3, 0]], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor([0, 1]), torch.tensor([0, 11]), 1, 11, None, tables)
    out = backend(0, q, q[:, :1], q[:, :1], meta)
    assert isinstance(backend._plan[1].groups[0], reference._PaddedGroup)
    torch.testing.assert_close(out, sdpa_decode(q, *storage.layer(0), tables, meta.context_lens))
    with pytest.raises(RuntimeError, match="unavailable: no C compiler"):
        cpu_decode.DecodePlan(tables, meta.context_lens, 8)
    assert list(fresh_build.iterdir()) == []


def test_a_failing_compiler_falls_back_with_its_reason(monkeypatch, fresh_build):
    monkeypatch.setattr(build, "find_c_compiler", lambda: "/bin/false")
    assert kernels.describe().attention.startswith("torch gather (compiling paged_decode.c failed")
    assert list(fresh_build.iterdir()) == []  # no half-written library is left behind


def test_the_build_is_cached_per_source_and_flags_and_written_whole(compiled, fresh_build):
    assert decode_attention.load().name.startswith("C/")
    (library,) = fresh_build.iterdir()
    assert re.fullmatch(r"paged_decode-[0-9a-f]{16}\.so", library.name)
    stamp = library.stat().st_mtime_ns
    decode_attention.load.cache_clear()
    assert decode_attention.load() is not None and library.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert list(fresh_build.iterdir()) == [library]


def test_the_build_is_keyed_by_every_file_the_source_includes(compiled, tmp_path, monkeypatch):
    """An edited header (simd.h, included by paged_decode.c) builds a new library, never the stale one."""
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("paged_decode.c", "simd.h"):
        (tmp_path / name).write_text((decode_attention.SOURCE.parent / name).read_text())
    assert build.sources(tmp_path / "paged_decode.c") == [tmp_path / "paged_decode.c", tmp_path / "simd.h"]
    build.build(tmp_path / "paged_decode.c")
    with open(tmp_path / "simd.h", "a") as header:
        header.write("/* edited */\n")
    build.build(tmp_path / "paged_decode.c")
    assert len(list((tmp_path / "cache").glob("paged_decode-*.so"))) == 2


def test_bad_inputs_raise_clear_errors_before_the_kernel_runs(compiled):
    q, k_cache, v_cache, tables, _, cu_k = reference.random_paged_inputs([20, 9], [1, 1], 2, 16, 8, 4, seed=0)
    lens = cu_k.diff()
    plan = cpu_decode.DecodePlan(tables, lens, 8)
    plan.attend(q, k_cache, v_cache)  # a layer that passed: the next layers' different inputs are still checked
    cases = [
        ((q.half(), k_cache.half(), v_cache.half()), "share one dtype of"),
        ((q, k_cache.bfloat16(), v_cache), "share one dtype of"),
        ((q, k_cache.transpose(2, 3), v_cache.transpose(2, 3)), "does not fit|must be contiguous"),
        ((q, k_cache[:, ::2], v_cache[:, ::2]), "blocks of 4 tokens, the plan 8"),
        ((q[:1], k_cache, v_cache), r"does not fit 2 sequences"),
        ((q[:, :3], k_cache, v_cache), "multiple of num_kv_heads"),
        ((q, k_cache[:2], v_cache[:2]), "block id .* is outside the pool's 2 blocks"),
        ((q, k_cache, v_cache[:, :, :1]), r"need \[B, H, D\] and two pools"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            plan.attend(*args)
    noncontiguous = torch.empty(k_cache.shape[0], 8, 2, 2, 16)[:, :, :, 0]
    with pytest.raises(ValueError, match="must be contiguous"):
        plan.attend(q, noncontiguous, noncontiguous)
    q20, k20, v20, t20, _, cu20 = reference.random_paged_inputs([5], [1], 1, 20, 8, 1)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        cpu_decode.paged_decode_attention(q20, k20, v20, t20, cu20.diff())
    with pytest.raises(ValueError, match="unused \\(-1\\) entry inside"):
        cpu_decode.DecodePlan(torch.tensor([[0, -1, 2]], dtype=torch.int32), torch.tensor([20]), 8)
    with pytest.raises(ValueError, match="need more than the block tables' 1 blocks"):
        cpu_decode.DecodePlan(tables[:, :1], lens, 8)
    with pytest.raises(ValueError, match="at least one token"):
        cpu_decode.DecodePlan(tables, torch.tensor([3, 0]), 8)
    with pytest.raises(ValueError, match=r"need \[B, max_blocks\] and \[B\]"):
        cpu_decode.DecodePlan(tables, lens[:1], 8)


def test_two_processes_building_at_once_leave_one_whole_library(compiled, tmp_path):
    """Both compile into the same empty cache; each renames its own temporary file into place, so
    both load a whole library and exactly one file remains."""
    code = "from labkit.kernels import decode_attention; print(decode_attention.load().name)"
    env = {**os.environ, "LABKIT_CACHE_DIR": str(tmp_path)}
    processes = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
    names = [process.communicate(timeout=120)[0].strip() for process in processes]
    assert names == [decode_attention.load().name] * 2
    assert len(list(tmp_path.iterdir())) == 1


def test_blocks_longer_than_the_kernel_takes_are_read_by_the_gather(compiled):
    """An engine with blocks past MAX_BLOCK_SIZE attends through torch instead of failing every step."""
    fits = PagedKVStorage(num_layers=1, num_blocks=1, block_size=decode_attention.MAX_BLOCK_SIZE, num_kv_heads=1,
                          head_dim=16)
    too_long = PagedKVStorage(num_layers=1, num_blocks=1, block_size=2 * decode_attention.MAX_BLOCK_SIZE,
                              num_kv_heads=1, head_dim=16)
    assert cpu_decode.supports(fits) and not cpu_decode.supports(too_long)
    assert PagedAttentionBackend(fits, "torch").reads_pool_in_c
    assert not PagedAttentionBackend(too_long, "torch").reads_pool_in_c
