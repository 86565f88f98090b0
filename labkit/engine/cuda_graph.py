"""CUDA graphs for decode steps: replay one recorded kernel launch sequence instead of ~400 launches.

A decode step of a small model on a GPU is dominated by launch overhead, not arithmetic. A CUDA
graph records the whole forward pass for a fixed batch size once, over static input buffers; each
step then copies its inputs into those buffers and replays. A decode step uses the smallest recorded
size that fits, padding the batch with rows that store nothing (slot -1) and attend to block 0
(their output is discarded). Only the sizes the configuration can reach are recorded
(`capture_sizes`): each graph costs capture time and memory.

`DecodeGraphs` only runs on CUDA, so the CPU test suite cannot reach it: `make gpu-check` checks it
(greedy parity with transformers with graphs on; reports/gpu/ holds the runs). `capture_sizes` is
plain arithmetic, tested on the CPU. The engine uses graphs only on CUDA; if capturing fails it
warns and runs eagerly.
"""

import torch

from labkit.attention.metadata import AttentionMetadata
from labkit.model.layers import fused_elementwise


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int) -> list[int]:
    """The decode batch sizes worth a graph: 1, 2, 4, 8, then every 16, up to the largest reachable batch.

    A decode batch is bounded by the sequences the scheduler runs at once, by the tokens one step may
    batch (one per sequence), and by the KV blocks (every running sequence holds at least one).
    """
    largest = min(max_num_seqs, max_num_batched_tokens, num_blocks)
    if largest < 1:
        raise ValueError(f"no decode batch is possible with max_num_seqs={max_num_seqs}, "
                         f"max_num_batched_tokens={max_num_batched_tokens}, num_blocks={num_blocks}")
    return sorted(s for s in {1, 2, 4, 8, *range(16, largest + 1, 16), largest} if s <= largest)


class DecodeGraphs:
    """The CUDA `FastPath` (fast_path.py): decode steps replayed from graphs; other steps run eagerly."""

    @fused_elementwise()  # the recorded steps run the engine's fused element-wise kernels
    def __init__(self, model, backend, sizes: list[int], max_blocks_per_seq: int, max_model_len: int):
        dev = model.device
        self.model, self.backend = model, backend
        self.sizes = sorted(sizes)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int64, device=dev)
        self.cu_k = torch.arange(n + 1, dtype=torch.int64, device=dev)
        self.max_model_len = max_model_len
        self.graphs, self.logits = {}, {}
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            graph = torch.cuda.CUDAGraph()
            self._forward(size)  # warm-up outside the capture (allocations, autotuning)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(self.cu_q[: size + 1], self.cu_k[: size + 1], 1, self.max_model_len,
                                 self.slot_mapping[:size], self.block_tables[:size])
        hidden = self.model.forward_hidden(self.input_ids[:size], self.positions[:size], meta, self.backend)
        return self.model.compute_logits(hidden)

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.sizes[-1] and width <= self.block_tables.shape[1]

    def forward_hidden(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """A prompt or mixed step: its shapes vary from step to step, so it runs eagerly."""
        return self.model.forward_hidden(input_ids, positions, meta, self.backend)

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B sequences (every row is sampled)."""
        b = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:b] = meta.slot_mapping
        self.block_tables.zero_()
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width] = meta.block_tables.clamp(min=0)
        self.cu_k[: b + 1] = meta.cu_seqlens_k
        self.cu_k[b + 1:] = meta.cu_seqlens_k[-1] + torch.arange(1, self.cu_k.numel() - b, device=self.cu_k.device)
        self.graphs[size].replay()
        return self.logits[size][:b]
