"""Beam search: hand-checked on a toy scorer, and equal to transformers' `generate(num_beams=...)` on SmolLM2."""

import math

import pytest
import torch

from labkit.model.transformers_oracle import load_transformers_model
from labkit.sampling import beam_search


def table_scorer(table: dict[tuple[int, ...], list[float]], vocab_size: int):
    """A toy model: next-token probabilities looked up by the tokens generated so far (after the prompt [0])."""

    def step_logits(sequences):
        rows = []
        for sequence in sequences:
            probs = table.get(tuple(sequence[1:]), [1 / vocab_size] * vocab_size)
            rows.append(torch.log(torch.tensor(probs)))
        return torch.stack(rows)

    return step_logits


# Greedy takes token 1 (p=0.5) and then at best 0.4; beam search finds 2 (p=0.4) then 0.9: 0.36 > 0.2.
TREE = {(): [0.1, 0.5, 0.4], (1,): [0.3, 0.3, 0.4], (2,): [0.05, 0.9, 0.05]}


def test_beam_search_finds_the_sequence_greedy_misses():
    result = beam_search(table_scorer(TREE, 3), [0], num_beams=2, max_new_tokens=2, length_penalty=0.0)
    assert result.best.token_ids == (2, 1)
    assert math.isclose(result.best.sum_logprobs, math.log(0.4 * 0.9), rel_tol=1e-6)
    assert math.isclose(result.best.score, result.best.sum_logprobs, rel_tol=1e-6)  # length_penalty 0: no division
    assert [h.token_ids for h in result.hypotheses] == [(2, 1), (1, 2)]
    greedy = beam_search(table_scorer(TREE, 3), [0], num_beams=1, max_new_tokens=2, length_penalty=0.0)
    assert greedy.best.token_ids == (1, 2)


def test_length_penalty_divides_by_generated_length_including_eos():
    # token 0 is EOS: ending at once: log(0.45) = -0.80; continuing, log(0.55 * 0.7) = -0.95 (lp 0), -0.48 (lp 1)
    table = {(): [0.45, 0.55, 0.0], (1,): [0.15, 0.7, 0.15]}
    for length_penalty, best in [(0.0, (0,)), (1.0, (1, 1))]:
        result = beam_search(table_scorer(table, 3), [0], num_beams=2, max_new_tokens=2,
                             length_penalty=length_penalty, eos_token_id=0)
        assert result.best.token_ids == best
        assert math.isclose(result.best.score, result.best.sum_logprobs / len(best) ** length_penalty, rel_tol=1e-6)


def test_the_trace_records_every_step_for_drawing_the_tree():
    result = beam_search(table_scorer(TREE, 3), [0], num_beams=2, max_new_tokens=2, length_penalty=0.0)
    first, second = result.steps
    assert [(c.token_id, c.status) for c in first] == [(1, "running"), (2, "running"), (0, "dropped")]
    assert all(c.parent == 0 for c in first)
    assert [(c.parent, c.token_id, c.status) for c in second][:2] == [(1, 1, "finished"), (0, 2, "finished")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_beams": 0}, "num_beams must be an integer >= 1"), ({"max_new_tokens": 0}, "max_new_tokens must be"),
     ({"early_stopping": "sometimes"}, "early_stopping must be True, False or 'never'"),
     ({"prompt_ids": []}, "prompt_ids must hold at least one token")],
)
def test_bad_arguments_are_rejected(kwargs, message):
    arguments = {"prompt_ids": [0], "num_beams": 2, "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        beam_search(table_scorer(TREE, 3), **arguments)


def test_a_scorer_returning_the_wrong_shape_is_reported():
    with pytest.raises(ValueError, match=r"step_logits_fn must return logits \[1, vocab\], got \(2, 3\)"):
        beam_search(lambda sequences: torch.zeros(2, 3), [0], num_beams=2, max_new_tokens=2)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct in transformers, from the course's GGUF file (offline)."""
    return load_transformers_model("smollm2", with_tokenizer=True)


def hf_scorer(model):
    @torch.no_grad()
    def step_logits(sequences):
        return model(torch.tensor(sequences)).logits[:, -1, :]

    return step_logits


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CASES = [  # prompt, num_beams, max_new_tokens, length_penalty, early_stopping, a hypothesis must end with EOS
    ("The capital of France is", 3, 8, 1.0, False, False),
    (CHAT.format("Is the sky blue? Answer yes or no."), 3, 8, 1.0, True, True),
    (CHAT.format("What is 2+2? Answer with a number."), 4, 10, 2.0, "never", False),
    (CHAT.format("What is 2+2?"), 2, 8, 0.0, False, False),
]


@pytest.mark.parametrize(("prompt", "num_beams", "max_new_tokens", "length_penalty", "early_stopping", "eos"), CASES)
def test_equals_transformers_generate_on_smollm2(smollm2, prompt, num_beams, max_new_tokens, length_penalty,
                                                 early_stopping, eos):
    model, tokenizer = smollm2
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(
            prompt_ids, num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens,
            length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=num_beams,
            return_dict_in_generate=True, output_scores=True,
        )
    generated_lengths = (expected.beam_indices != -1).sum(-1)
    expected_ids = [tuple(row[prompt_ids.shape[1]: prompt_ids.shape[1] + n].tolist())
                    for row, n in zip(expected.sequences, generated_lengths, strict=True)]

    result = beam_search(hf_scorer(model), prompt_ids[0].tolist(), num_beams, max_new_tokens,
                         length_penalty=length_penalty, eos_token_id=tokenizer.eos_token_id,
                         early_stopping=early_stopping)
    assert [h.token_ids for h in result.hypotheses] == expected_ids
    if eos:  # this case exercises finishing by EOS, not only by the length limit
        assert any(h.token_ids[-1] == tokenizer.eos_token_id for h in result.hypotheses)
    assert torch.allclose(torch.tensor([h.score for h in result.hypotheses]), expected.sequences_scores, atol=1e-4)
