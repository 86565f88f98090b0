"""The packed fp32 GEMM (labkit/kernels/gemm_f32.c) against torch's nn.Linear (F.linear) on SmolLM2's linear shapes,
one thread, GFLOP/s of both measured in the same run (best of several calls each).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_gemm.py [--rows 1 8 32 64 256 2048]
"""

import argparse
import time
from functools import partial

import torch
from torch import nn

from labkit.kernels import gemm
from labkit.model.packed_linear import PackedF32Linear
from labkit.timing import measure

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out, in): q/o, k/v, gate/up, down, head


def best_seconds(layers: list, x: torch.Tensor, budget: float = 0.3) -> list[float]:
    """Each layer's best time on x, the layers called in turns (a busy moment slows them all): one
    `measure` of one call per layer per round, rather than all of one layer's runs in a row."""
    best = [float("inf")] * len(layers)
    start, rounds = time.perf_counter(), 0
    while rounds < 4 or (time.perf_counter() - start < budget and rounds < 60):
        for i, layer in enumerate(layers):
            best[i] = min(best[i], measure(partial(layer, x), repeats=1, warmup=0).best)
        rounds += 1
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 2048])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"kernel: {gemm.load_f32().name}; GFLOP/s, one thread")
    print(f"{'out x in':>12} {'rows':>5} {'F.linear':>9} {'packed':>8} {'ratio':>6}")
    with torch.inference_mode():
        for out_features, in_features in SHAPES:
            linear = nn.Linear(in_features, out_features, bias=False)
            packed = PackedF32Linear(linear)
            for rows in args.rows:
                x = torch.randn(rows, in_features)
                flops = 2 * rows * in_features * out_features
                torch_s, packed_s = best_seconds([linear, packed], x)
                print(f"{out_features:>5} x {in_features:<4} {rows:>5} {flops / torch_s / 1e9:>9.1f} "
                      f"{flops / packed_s / 1e9:>8.1f} {torch_s / packed_s:>6.2f}")


if __name__ == "__main__":
    main()
