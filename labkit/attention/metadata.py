"""What one forward step tells every attention layer, passed explicitly (no hidden global context).

The model runs on a flat batch: the new tokens of all sequences in a step are concatenated into
one [T] tensor, with no padding. `cu_seqlens_q` says where each sequence's new tokens start in that
flat batch; `cu_seqlens_k` counts each sequence's whole context (tokens already cached plus the
new ones), so a prefill has equal q and k lengths, a decode step has q length 1, and a prefill
over a cached prefix or a chunk of a long prompt lies in between. Names follow vLLM / nano-vLLM.
"""

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B + 1] int64, cumulative count of new tokens per sequence
    cu_seqlens_k: torch.Tensor  # [B + 1] int64, cumulative context length (cached + new) per sequence
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor | None = None  # [T] int64, KV-cache slot of each new token; -1: not stored
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32, physical block ids; -1: unused

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    @property
    def context_lens(self) -> torch.Tensor:
        return self.cu_seqlens_k.diff()

    @classmethod
    def causal(cls, seq_lens: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for a plain prefill of whole sequences with nothing cached."""
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"every sequence needs at least one token, got lengths {seq_lens}")
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64, device=device)
        cu[1:] = torch.tensor(seq_lens, dtype=torch.int64, device=device).cumsum(0)
        return cls(cu, cu, max(seq_lens), max(seq_lens))


class AttentionBackend(Protocol):
    """Stores the new tokens' K/V (if it keeps a cache) and attends over each sequence's context.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens of the step.
    Returns [T, num_heads, head_dim]. Causal within each sequence; scale 1/sqrt(head_dim).
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...
