"""The ModelRunner turns one scheduled step into tensors, runs the model over the paged KV cache and
samples the next tokens (the nano-vLLM walk-through, "Preparation before each iteration").

Each step, for the scheduled sequences and the number of new tokens each computes:

- `input_ids`, `positions`: the new tokens of all sequences, concatenated (no padding);
- `cu_seqlens_q` / `cu_seqlens_k`: where each sequence's new tokens start in that flat batch, and
  its whole context length (cached + new), as cumulative sums;
- `slot_mapping`: the KV-cache slot (block_id * block_size + offset) each new token's K/V goes to;
- `block_tables`: every sequence's block ids, padded with -1, where attention finds the context.

Only the last new token of a sequence that completes its prompt (or decodes) gets logits: the
final projection onto 49,152 vocabulary entries is the step's largest matmul, and a chunk in the
middle of a prompt needs none. The exception is a request that asked for `prompt_logprobs`: every
prompt position it computes gets logits too.

`forward` returns fp32 logits and leaves sampling to `sample`, so the engine can sample several
tokens from one row (the n samples of a prompt) and read the logprobs of the raw logits.
"""

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from labkit.attention.metadata import AttentionMetadata
from labkit.cache.paged_storage import PagedKVStorage
from labkit.cache.sequence_blocks import SequenceBlocks
from labkit.device import upload
from labkit.engine.fast_path import FastPath
from labkit.engine.sequence import Sequence
from labkit.model.layers import fused_elementwise
from labkit.sampling import Sampler, SamplingMetadata, greedy_tokens


@dataclass
class PromptLogits:
    """Logits of a run of prompt positions: row i predicts the prompt token at `first_target + i`."""

    seq: Sequence
    first_target: int
    logits: torch.Tensor  # [rows, vocab] fp32


@dataclass
class ForwardOutput:
    sampled_seqs: list[Sequence]  # the sequences whose step reached their end: their next token is due
    logits: torch.Tensor | None  # [len(sampled_seqs), vocab] fp32, None if no sequence is sampled
    prompt_logits: list[PromptLogits]


def padded_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """The sequences' block ids as one [B, longest] int32 tensor, padded with -1.

    Built in numpy from one flat pass over the lists: at 256 sequences of ~60 blocks, padding each
    list in Python and handing torch the nested lists took 2 ms a step, five times this."""
    lengths = np.fromiter(map(len, tables), np.int64, len(tables))
    padded = np.full((len(tables), int(lengths.max())), -1, np.int32)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), np.int32, int(lengths.sum()))
    return torch.from_numpy(padded)


class StepTensors(NamedTuple):
    input_ids: torch.Tensor  # [T] the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T]
    cu_seqlens_q: torch.Tensor  # [B + 1] where each sequence's new tokens start
    cu_seqlens_k: torch.Tensor  # [B + 1] running sum of each sequence's context (cached + new)
    slot_mapping: torch.Tensor  # [T] the KV-cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [B, longest] int32, padded with -1


def flatten_step(seqs: list[SequenceBlocks], num_new_tokens: list[int], block_size: int) -> StepTensors:
    """One step's tensors, on the CPU: sequence i computes its tokens num_cached_tokens .. + num_new_tokens[i]."""
    input_ids: list[int] = []
    starts, ends, tables = [], [], []
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        start = seq.num_cached_tokens
        input_ids.extend(seq.token_ids[start:start + n])
        starts.append(start)
        ends.append(start + n)
        tables.append(seq.block_table)
    q_lens = torch.tensor(num_new_tokens, dtype=torch.int64)
    cu_q = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu_q[1:])
    cu_k = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(ends, dtype=torch.int64), 0, out=cu_k[1:])
    # positions: start_i, start_i + 1, ... for each sequence, without a Python loop over tokens.
    seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    offset = torch.tensor(starts, dtype=torch.int64) - cu_q[:-1]
    positions = torch.arange(int(cu_q[-1])) + offset[seq_index]
    block_tables = padded_block_tables(tables)
    blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    slot_mapping = blocks * block_size + positions % block_size
    return StepTensors(torch.tensor(input_ids, dtype=torch.int64), positions, cu_q, cu_k, slot_mapping, block_tables)


def fill_placeholders(input_ids: torch.Tensor, pending_tokens: torch.Tensor) -> torch.Tensor:
    """`input_ids` with each placeholder (-1 - row, overlap.py) replaced, on the device, by row `row`
    of `pending_tokens`."""
    rows = (-1 - input_ids).clamp(min=0)  # a real token's row is 0, unused; one past the end is a bug (an error)
    return torch.where(input_ids < 0, pending_tokens[rows], input_ids)


class StepInputs:
    """The tensors of one step, plus which rows of the flat batch get logits."""

    def __init__(self, input_ids, positions, meta: AttentionMetadata, sample_rows: torch.Tensor,
                 sampled_seqs: list[Sequence]):
        self.input_ids, self.positions, self.meta = input_ids, positions, meta
        self.sample_rows, self.sampled_seqs = sample_rows, sampled_seqs


class ModelRunner:
    def __init__(self, model, storage: PagedKVStorage, backend, fast_path: FastPath | None = None):
        """`fast_path` (fast_path.py), if any, runs the steps instead of the eager model."""
        self.model = model
        self.storage = storage
        self.block_size = storage.block_size
        self.backend = backend
        self.device = model.device
        self.sampler = Sampler()
        self.fast_path = fast_path

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int],
                num_scored: list[int] | None = None) -> StepInputs:
        """Flatten one scheduled step into the model's inputs and the attention metadata.

        `num_scored[i]`: how many of seqs[i]'s last rows get logits if it is sampled (default 1;
        speculative decoding scores every draft)."""
        return self.step_inputs(seqs, *flatten_step(seqs, num_new_tokens, self.block_size), num_scored)

    def step_inputs(self, seqs: list[Sequence], input_ids, positions, cu_seqlens_q, cu_seqlens_k, slot_mapping,
                    block_tables, num_scored: list[int] | None = None) -> StepInputs:
        """The step's tensors on the model's device, and the rows that get logits: the last new row
        (the last `num_scored[i]` rows) of each sequence whose step reaches its end (its next token is due)."""
        ends = cu_seqlens_k.diff().tolist()
        is_sampled = [end == seq.num_tokens for seq, end in zip(seqs, ends, strict=True)]
        sampled_seqs = [seq for seq, sampled in zip(seqs, is_sampled, strict=True) if sampled]
        if num_scored is None:
            sample_rows = (cu_seqlens_q[1:] - 1)[torch.tensor(is_sampled, dtype=torch.bool)]
        else:
            sample_rows = torch.tensor([row for i, m in enumerate(num_scored) if is_sampled[i]
                                        for row in range(int(cu_seqlens_q[i + 1]) - m, int(cu_seqlens_q[i + 1]))],
                                       dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata(
            cu_seqlens_q=upload(cu_seqlens_q, dev), cu_seqlens_k=upload(cu_seqlens_k, dev),
            max_seqlen_q=int(cu_seqlens_q.diff().max()), max_seqlen_k=max(ends),
            slot_mapping=upload(slot_mapping, dev), block_tables=upload(block_tables, dev),
        )
        return StepInputs(upload(input_ids, dev), upload(positions, dev), meta, upload(sample_rows, dev), sampled_seqs)

    @torch.inference_mode()
    @fused_elementwise()
    def forward(self, seqs: list[Sequence], num_new_tokens: list[int],
                num_scored: list[int] | None = None, pending_tokens: torch.Tensor | None = None) -> ForwardOutput:
        """One forward step: fp32 logits of the sequences due a next token (`num_scored` rows each,
        see `prepare`), and any prompt logits asked for. On a GPU in half precision the model's
        element-wise chains run fused (labkit.model.layers.fused_elementwise).

        `pending_tokens`: the tokens, still on the device, of the step in flight, which the sequences'
        placeholder tokens stand for (overlap.py)."""
        step = self.prepare(seqs, num_new_tokens, num_scored)
        if pending_tokens is not None:
            step.input_ids = fill_placeholders(step.input_ids, pending_tokens)
        fast = self.fast_path
        if (fast is not None and step.meta.max_seqlen_q == 1 and len(step.sampled_seqs) == len(seqs)
                and fast.fits(len(seqs), step.meta.block_tables.shape[1])
                and not any(seq.needs_prompt_logprobs for seq in seqs)):
            logits = fast.run(step.input_ids, step.positions, step.meta)
            return ForwardOutput(step.sampled_seqs, logits.float(), [])
        if fast is not None:
            hidden = fast.forward_hidden(step.input_ids, step.positions, step.meta)
        else:
            hidden = self.model.forward_hidden(step.input_ids, step.positions, step.meta, self.backend)
        # Sampling works in fp32 whatever the weights: a bf16 softmax over 49,152 entries loses the
        # small probabilities, and argmax over bf16 is several times slower on a CPU.
        logits = self.model.compute_logits(hidden[step.sample_rows]).float() if step.sampled_seqs else None
        return ForwardOutput(step.sampled_seqs, logits, self._prompt_logits(seqs, num_new_tokens, hidden))

    def _prompt_logits(self, seqs, num_new_tokens, hidden) -> list[PromptLogits]:
        """For requests that want prompt_logprobs: logits of their computed positions that predict a prompt token."""
        result, row = [], 0
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_cached_tokens
            first_target = max(start + 1, len(seq.prompt_logprobs or ()))  # positions already done are skipped
            end_target = min(start + n, seq.num_prompt_tokens - 1) + 1  # the last row predicts the first output
            if seq.needs_prompt_logprobs and first_target < end_target:
                rows = hidden[row + first_target - 1 - start: row + end_target - 1 - start]
                result.append(PromptLogits(seq, first_target, self.model.compute_logits(rows).float()))
            row += n
        return result

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None = None) -> list[int]:
        """Next token of each sequence (row i of `logits` is seqs[i]'s); an all-greedy batch is one argmax.

        `eos_token_id` is what min_tokens masks until enough tokens were generated.
        """
        return self.sample_on_device(logits, seqs, eos_token_id).tolist()

    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence],
                         eos_token_id: int | None = None) -> torch.Tensor:
        """`sample`'s tokens as a tensor on the logits' device, without waiting for them."""
        if all(seq.params.greedy and not seq.params.changes_logits for seq in seqs):
            return greedy_tokens(logits)
        # Only a penalty reads the prompts (changes_logits covers every penalty): copying 256 prompts' ids out
        # of their sequences each step costs more than the rest of the sampler's host work.
        penalized = any(seq.params.changes_logits for seq in seqs)
        metadata = SamplingMetadata.from_requests([seq.params for seq in seqs],
                                                  [seq.prompt_token_ids if penalized else () for seq in seqs],
                                                  [seq.output_token_ids for seq in seqs], device=logits.device,
                                                  eos_token_id=eos_token_id, vocab_size=logits.shape[-1])
        return self.sampler(logits, metadata)
