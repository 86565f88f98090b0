"""The ModelRunner turns one scheduled step into tensors, runs the model over the paged KV cache and
samples the next tokens (seed 001, "Preparation before each iteration").

Each step, for the scheduled sequences and the number of new tokens each computes:

- `input_ids`, `positions`: the new tokens of all sequences, concatenated (no padding);
- `cu_seqlens_q` / `cu_seqlens_k`: where each sequence's new tokens start in that flat batch, and
  its whole context length (cached + new), as cumulative sums;
- `slot_mapping`: the KV-cache slot (block_id * block_size + offset) each new token's K/V goes to;
- `block_tables`: every sequence's block ids, padded with -1, where attention finds the context.

Only the last new token of a sequence that completes its prompt (or decodes) gets logits: the
final projection onto 49,152 vocabulary entries is the step's largest matmul, and a chunk in the
middle of a prompt needs none.
"""

import torch

from labkit.attention.metadata import AttentionMetadata
from labkit.cache.paged_storage import PagedKVStorage
from labkit.engine.sequence import Sequence
from labkit.sampling import Sampler, SamplingMetadata


class StepInputs:
    """The tensors of one step, plus which rows of the flat batch get logits."""

    def __init__(self, input_ids, positions, meta: AttentionMetadata, sample_rows: torch.Tensor,
                 sampled_seqs: list[Sequence]):
        self.input_ids, self.positions, self.meta = input_ids, positions, meta
        self.sample_rows, self.sampled_seqs = sample_rows, sampled_seqs


class ModelRunner:
    def __init__(self, model, storage: PagedKVStorage, backend, decode_graphs=None):
        """`decode_graphs` (CUDA only, see cuda_graph.py) replays recorded decode steps."""
        self.model = model
        self.storage = storage
        self.block_size = storage.block_size
        self.backend = backend
        self.device = model.device
        self.sampler = Sampler()
        self.decode_graphs = decode_graphs

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepInputs:
        """Flatten one scheduled step into the model's inputs and the attention metadata."""
        input_ids: list[int] = []
        starts, ends, tables, sampled_seqs, is_sampled = [], [], [], [], []
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_cached_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            starts.append(start)
            ends.append(start + n)
            tables.append(seq.block_table)
            is_sampled.append(start + n == seq.num_tokens)  # reaches the end: the next token is sampled
            if is_sampled[-1]:
                sampled_seqs.append(seq)
        dev = self.device
        q_lens = torch.tensor(num_new_tokens, dtype=torch.int64)
        cu_q = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=cu_q[1:])
        cu_k = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(ends, dtype=torch.int64), 0, out=cu_k[1:])
        # positions: start_i, start_i + 1, ... for each sequence, without a Python loop over tokens.
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        offset = torch.tensor(starts, dtype=torch.int64) - cu_q[:-1]
        positions = torch.arange(int(cu_q[-1])) + offset[seq_index]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
        blocks = block_tables[seq_index, positions // self.block_size].to(torch.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        sample_rows = (cu_q[1:] - 1)[torch.tensor(is_sampled)]
        meta = AttentionMetadata(
            cu_seqlens_q=cu_q.to(dev), cu_seqlens_k=cu_k.to(dev),
            max_seqlen_q=max(num_new_tokens), max_seqlen_k=max(ends),
            slot_mapping=slot_mapping.to(dev), block_tables=block_tables.to(dev),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev)
        return StepInputs(ids, positions.to(dev), meta, sample_rows.to(dev), sampled_seqs)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[list[Sequence], list[int]]:
        """One forward step. Returns the sequences that got a next token, and those tokens."""
        step = self.prepare(seqs, num_new_tokens)
        graphs = self.decode_graphs
        if (graphs is not None and step.meta.max_seqlen_q == 1 and len(step.sampled_seqs) == len(seqs)
                and graphs.fits(len(seqs), step.meta.block_tables.shape[1])):
            logits = graphs.run(step.input_ids, step.positions, step.meta)
        else:
            hidden = self.model.forward_hidden(step.input_ids, step.positions, step.meta, self.backend)
            if not step.sampled_seqs:
                return [], []
            logits = self.model.compute_logits(hidden[step.sample_rows])
        # Sampling works in fp32 whatever the weights: a bf16 softmax over 49,152 entries loses the
        # small probabilities, and argmax over bf16 is several times slower on a CPU.
        return step.sampled_seqs, self.sample(logits.float(), step.sampled_seqs)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Next token of each sequence; an all-greedy batch is one argmax, nothing else to pack."""
        if all(seq.params.greedy and not _penalized(seq.params) for seq in seqs):
            return logits.argmax(-1).tolist()
        metadata = SamplingMetadata.from_requests([seq.params for seq in seqs],
                                                  [seq.prompt_token_ids for seq in seqs],
                                                  [seq.output_token_ids for seq in seqs], device=logits.device)
        return self.sampler(logits, metadata).tolist()


def _penalized(params) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0
