"""Batched Sampler vs a Python loop over rows (one set of transformers warpers and one Generator per row).

Both pick one token for each of `BATCH` rows of SmolLM2-sized logits, every row with its own
temperature, top-k, top-p and seed, as an engine step does. Prints milliseconds per step and the
ratio, measured in the same run.
"""


import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from labkit.device import describe_device, pick_device
from labkit.sampling import Sampler, SamplingMetadata, SamplingParams
from labkit.timing import measure

BATCH, VOCAB, REPEATS = 32, 49_152, 10


def per_row_loop(logits, params):
    """What an engine without a batched sampler does: one row at a time, one Generator per seed."""
    tokens = []
    for row, p in zip(logits, params, strict=True):
        scores = row[None]
        for warper in (TemperatureLogitsWarper(p.temperature), TopKLogitsWarper(p.top_k), TopPLogitsWarper(p.top_p)):
            scores = warper(None, scores)
        generator = torch.Generator(device=logits.device).manual_seed(p.seed)
        tokens.append(int(torch.multinomial(scores.softmax(-1), 1, generator=generator)))
    return tokens


def median_ms(fn, device):
    return 1000 * measure(fn, REPEATS, device=device).median


def main():
    device = pick_device()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(BATCH, VOCAB, generator=g) * 3).to(device)
    params = [SamplingParams(temperature=0.5 + (i % 4) / 4, top_k=20 + i, top_p=0.8 + (i % 3) / 20, seed=i)
              for i in range(BATCH)]
    sampler = Sampler()
    step = lambda: sampler(logits, SamplingMetadata.from_requests(params, [[]] * BATCH, [[]] * BATCH, device))
    batched = median_ms(step, device)
    looped = median_ms(lambda: per_row_loop(logits, params), device)
    print(f"sampling {BATCH} rows x {VOCAB} vocab, per-row temperature/top-k/top-p/seed, on "
          f"{describe_device(device)} ({torch.get_num_threads()} CPU threads)")
    print(f"  labkit Sampler (batched):         {batched:8.2f} ms/step")
    print(f"  per-row loop (transformers warpers): {looped:8.2f} ms/step")
    print(f"  speed-up: {looped / batched:.2f}x")


if __name__ == "__main__":
    main()
