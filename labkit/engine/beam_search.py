"""Beam search inside the engine: the beams are Sequences in the paged KV cache that share blocks.

`labkit.sampling.beam_search` decides which beams live (transformers' rules); it asks a scorer for
next-token logits of each running beam, given as token lists. Here every running beam is a
Sequence whose K/V is already in the cache, so the scorer only has to work out where each
requested list came from: each one is a live beam plus one token. A beam extended once keeps its
Sequence and appends the token; a beam extended k times first forks k - 1 new Sequences that share
its blocks (BlockManager.fork), and the partial last block is copied when each writes into it
(copy-on-write); a beam not extended releases its blocks. Then one decode step computes the new
token of every beam. The prompt is prefilled once (or served from the prefix cache).
"""

import torch

from labkit.engine.outputs import BeamSearchOutput, BeamSearchSequence
from labkit.engine.sequence import Sequence
from labkit.sampling import BeamSearchParams, SamplingParams, beam_search


class EngineBeamSearch:
    def __init__(self, block_manager, storage, runner, max_model_len: int):
        self.block_manager, self.storage, self.runner = block_manager, storage, runner
        self.max_model_len = max_model_len

    def run(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_id: int | None,
            tokenizer) -> BeamSearchOutput:
        """The `beam_width` best hypotheses for one prompt; every block is released before returning."""
        live: dict[tuple[int, ...], Sequence] = {}  # a running beam's tokens (prompt included) -> its Sequence
        made: list[Sequence] = []  # every Sequence of this search, to release whatever still holds blocks
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))

        def step_logits(token_lists: list[list[int]]) -> torch.Tensor:
            beams = self._advance(live, token_lists, made)
            live.clear()
            live.update((tuple(seq.token_ids), seq) for seq in beams)
            logits = self._forward(beams)
            return logits / params.temperature if params.temperature > 0 else logits

        try:
            result = beam_search(step_logits, prompt_ids, params.beam_width, max_new,
                                 length_penalty=params.length_penalty, eos_token_id=eos_token_id)
        finally:
            for seq in made:
                if seq.block_table:
                    self.block_manager.deallocate(seq)
        sequences = []
        for h in result.hypotheses:
            ended_on_eos = eos_token_id is not None and h.token_ids[-1] == eos_token_id
            text = tokenizer.decode(list(h.token_ids[:-1] if ended_on_eos else h.token_ids))
            sequences.append(BeamSearchSequence(list(prompt_ids) + list(h.token_ids), text, h.sum_logprobs, h.score,
                                                "stop" if ended_on_eos else "length"))
        return BeamSearchOutput(sequences)

    def _advance(self, live: dict, token_lists: list[list[int]], made: list[Sequence]) -> list[Sequence]:
        """One Sequence per requested token list: the prompt (first call), or a live beam plus one token."""
        bm = self.block_manager
        if not live:  # the first call: the prompt itself
            (prompt,) = token_lists
            seq = Sequence(prompt, SamplingParams(temperature=0))
            made.append(seq)
            bm.allocate(seq)
            return [seq]
        beams, copies, extended = [], [], set()
        for tokens in token_lists:
            parent = live[tuple(tokens[:-1])]
            if id(parent) in extended:  # a second extension of one beam: a new Sequence sharing its blocks
                seq = Sequence(tokens[:-1], parent.params)
                made.append(seq)
                bm.fork(parent, seq)
            else:
                seq = parent
            beams.append((seq, tokens[-1]))
            extended.add(id(parent))
        for seq in live.values():  # beams that no candidate extends end here
            if id(seq) not in extended:
                bm.deallocate(seq)
        for seq, token in beams:  # appended only after every fork: forks copy the parent's tokens
            seq.append_token(token)
            copies += bm.append(seq)
        self.storage.copy_blocks(copies)
        return [seq for seq, _ in beams]

    def _forward(self, beams: list[Sequence]) -> torch.Tensor:
        num_new = [seq.num_uncomputed_tokens for seq in beams]
        forward = self.runner.forward(beams, num_new)
        for seq in beams:
            seq.num_cached_tokens = seq.num_tokens
        return forward.logits
