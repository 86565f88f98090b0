"""A faster way to run the engine's steps than the eager model: the `FastPath` protocol.

The eager model runs a step as tens of small torch operations per layer, and at small batches that
overhead, not arithmetic, sets the speed. Two fast paths cut it, one per kind of machine:

- on CUDA, `DecodeGraphs` (cuda_graph.py) replays a recorded decode step in one launch;
- on a CPU, `FusedDecoder` (labkit/model/fused_decode.py) runs every layer of a step in one C call.

`ModelRunner.forward` gives a decode-only step to `run` when the fast path `fits` it, and every
other step to `forward_hidden`, which falls back to the eager model where it has nothing faster.
"""

from typing import Protocol

import torch

from labkit.attention.metadata import AttentionMetadata


class FastPath(Protocol):
    def fits(self, num_seqs: int, width: int) -> bool:
        """Whether `run` takes a decode step of `num_seqs` sequences whose block tables are `width` wide."""

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B sequences (every row is sampled)."""

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of any step's T new tokens."""
