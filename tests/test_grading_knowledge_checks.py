"""The labs' knowledge checks: right answers pass in any reasonable spelling; each wrong answer is
named by its question number, with a pointer to re-read and without the right answer."""

import pytest

from labkit_course.grading.core import get_exercise, run_exercise

# The right answers, worked out by hand from each lab (the graders compute the numbers from labkit).
RIGHT = {
    "00": {1: "b", 2: "c", 3: 0.665, 4: "b", 5: "a"},
    "01": {1: "b", 2: 3, 3: 5, 4: 8064, 5: "b"},
    "02": {1: 22.5, 2: 0.034, 3: 8, 4: "a", 5: "b"},
    "03": {1: 0.498, 2: 1, 3: 0.257, 4: "a", 5: "c"},
    "04": {1: 4, 2: 3072, 3: "a", 4: "b", 5: "b", 6: 50},
    "05": {1: 3, 2: 46080, 3: "a", 4: "b", 5: "b", 6: 960},
    "06": {1: 3, 2: 3, 3: "a", 4: "b", 5: "b"},
    "07": {1: 4, 2: 14, 3: 8, 4: "b", 5: "a"},
    "08": {1: 69, 2: 2, 3: 36, 4: "a", 5: "a"},
    "09": {1: "b", 2: 224, 3: 2, 4: "b", 5: "b"},
    "10": {1: 7, 2: 2, 3: 1456, 4: "b", 5: "c"},
    "11": {1: 7, 2: 1, 3: 73, 4: "b", 5: "a"},
    "12": {1: 7680, 2: 299, 3: "a", 4: "c", 5: "b"},
    "13": {1: 271, 2: 5, 3: "b", 4: "c", 5: "a"},
    "14": {1: 3.36, 2: 1, 3: "c", 4: "a", 5: "b"},
    "15": {1: 6912000, 2: "b", 3: 7.4, 4: "c", 5: "a"},
    "16": {1: 150, 2: 1.3, 3: "a", 4: "b", 5: "c", 6: "b"},
}

# Wrong answers a student might give, each with the misconception behind it: {question: answer}.
WRONG = {
    "00": [
        ({1: "a"}, "thinks the printed example is what gets checked"),
        ({2: "b"}, "thinks the shift is what normalises"),
        ({3: 0.090}, "gave the first entry's probability"),
        ({3: 3.0}, "gave the logit, not a probability"),
        ({4: "a"}, "mixed up Text to Tensors and the book"),
        ({5: "b"}, "trusts out-of-order execution"),
    ],
    "01": [
        ({1: "a"}, "counts pairs while encoding"),
        ({2: 2}, "merged overlapping pairs"),
        ({2: 4}, "merged only one pair"),
        ({3: 6}, "counted a BOS token"),
        ({4: 14}, "forgot the hidden size"),
        ({4: 8064 * 49152 // 576}, "multiplied by the vocabulary"),
        ({5: "d"}, "believes the file is pre-scaled"),
    ],
    "02": [
        ({1: 0.703125}, "forgot the layers"),
        ({1: 11.25}, "counted K only"),
        ({1: 23.59}, "answered in MB, not MiB"),
        ({2: 1.0}, "thinks every kernel reaches the peak"),
        ({2: 0.0101}, "divided the intensity by the bandwidth"),
        ({3: 4}, "counted one moment"),
        ({4: "b"}, "thinks weights are re-read per sequence"),
        ({5: "a"}, "thinks GQA is quantisation"),
    ],
    "03": [
        ({1: 0.502}, "read the weight on 'love' itself"),
        ({1: 1.0}, "read row 0 (the masked row)"),
        ({2: 7}, "masked as if the chunk's queries were at positions 0 and 1"),
        ({2: 0}, "believes the mask is automatic at inference"),
        ({3: 0.5}, "guessed a uniform distribution"),
        ({4: "c"}, "blames rounding"),
        ({5: "d"}, "picks the wrong head"),
    ],
    "04": [
        ({1: 3}, "counted one decode step"),
        ({1: 2}, "counted the prompt only"),
        ({2: 2048}, "counted K and V only"),
        ({2: 787968}, "counted the uncached generation"),
        ({3: "d"}, "thinks decode needs a mask"),
        ({4: "a"}, "thinks the cache approximates"),
        ({5: "a"}, "kept the book's formula"),
        ({6: 37.5}, "divided the gaps by the number of tokens"),
        ({6: 112.5}, "counted the wait for the first token"),
    ],
    "05": [
        ({1: 9}, "counted query heads"),
        ({2: 23040}, "used 2-byte elements"),
        ({2: 138240}, "counted query heads, not KV heads"),
        ({3: "c"}, "thinks RMSNorm has no scale"),
        ({4: "a"}, "thinks rotary adds position vectors"),
        ({5: "a"}, "believes the cached step is flat"),
        ({6: 8640}, "wrote the hidden size for head_dim, as the nano-vLLM walk-through does"),
        ({6: 1728}, "gave every query head its own K and V"),
    ],
    "06": [
        ({1: 2}, "dropped the token that crosses the threshold"),
        ({1: 4}, "kept everything"),
        ({2: 2}, "broke ties"),
        ({3: "b"}, "follows Text to Tensors' error"),
        ({4: "a"}, "inverted the temperature"),
        ({5: "a"}, "assumes vLLM orders like transformers"),
    ],
    "07": [
        ({1: 3}, "rounded down"),
        ({2: 2}, "took L mod B"),
        ({3: 0.25}, "counted one layer"),
        ({3: 8.39}, "answered in MB"),
        ({4: "a"}, "thinks any block can be partial"),
        ({5: "b"}, "resets instead of rescaling"),
    ],
    "08": [
        ({1: 37}, "used the logical position"),
        ({1: 21}, "used the second table entry"),
        ({2: 1}, "used h % H_kv"),
        ({3: 12}, "one program per KV head"),
        ({4: "c"}, "thinks fusion changes the result"),
        ({5: "b"}, "thinks decode is compute-bound"),
    ],
    "09": [
        ({1: "a"}, "ignores the prefix"),
        ({2: 280}, "used blocks of 8"),
        ({2: 320}, "counted the first request too"),
        ({3: 1}, "forgot sharing"),
        ({4: "a"}, "lets a fully cached prompt run nothing"),
        ({5: "a"}, "frees shared blocks"),
    ],
    "10": [
        ({1: 12}, "ignored the budget"),
        ({1: 0}, "thinks C waits"),
        ({2: 3}, "adds a step after the prefill"),
        ({3: 728}, "counted 4-byte floats"),
        ({3: 2912}, "counted K but not V"),
        ({3: 1388}, "took 512 MiB for 512 MB"),
        ({4: "a"}, "thinks generated tokens are lost"),
        ({5: "d"}, "describes nano-vLLM"),
    ],
    "11": [
        ({1: 24}, "counted the decode's whole context"),
        ({1: 12}, "padded to the longest"),
        ({2: 2}, "samples mid-prompt chunks"),
        ({3: 17}, "used the logical position"),
        ({3: 9}, "used the block id"),
        ({4: "a"}, "confuses length with EOS"),
        ({5: "b"}, "thinks the cache skips decode"),
    ],
    "12": [
        ({1: 23040}, "kept SmolLM2's 3 K/V heads"),
        ({1: 3840}, "counted K only"),
        ({1: 256}, "counted one layer"),
        ({2: 298}, "rounded the ridge down: 298 is still below it"),
        ({2: 597}, "used float32 weights"),
        ({3: "b"}, "blames attention for a batch-1 step"),
        ({4: "a"}, "thinks repeating heads loses information"),
        ({5: "a"}, "forgets that K/V reads grow with the batch"),
    ],
    "13": [
        ({1: 273}, "forgot the scales' bytes"),
        ({1: 362}, "gave the int8 total, not the difference"),
        ({1: 91}, "sized against bf16"),
        ({2: 4}, "forgot d and m"),
        ({2: 4.5}, "counted Q4_0's 18 bytes"),
        ({3: "d"}, "thinks prefix caching fixes the scale"),
        ({4: "a"}, "thinks per-channel scales save bytes"),
        ({5: "b"}, "thinks quantization is lossless"),
    ],
    "14": [
        ({1: 2.95}, "forgot the bonus token: (1 - alpha^k) / (1 - alpha)"),
        ({1: 3.2}, "multiplied k by alpha"),
        ({1: 5}, "assumed every draft is accepted"),
        ({2: 4}, "thinks each draft needs its own target forward"),
        ({2: 5}, "counted a forward for the bonus token"),
        ({3: "a"}, "thinks the drafter must be a copy of the target"),
        ({3: "d"}, "confuses the KV rollback with what makes the tokens equal"),
        ({4: "c"}, "thinks the residual only avoids repeating the rejected token"),
        ({5: "a"}, "thinks the target runs faster on repetitive text"),
    ],
    "15": [
        ({1: 3456000}, "counted one all-reduce per layer"),
        ({1: 13824000}, "used fp32 bytes"),
        ({1: 230400}, "counted one layer"),
        ({2: "c"}, "thinks every query head needs its own rank"),
        ({3: 3.9}, "read every key tile (forgot the causal skip)"),
        ({3: 0.13}, "gave flash / naive"),
        ({4: "a"}, "thinks column-parallel layers communicate"),
        ({5: "c"}, "normalises the accumulator every tile"),
    ],
    "16": [
        ({1: 120}, "divided by the number of tokens, not the gaps between them"),
        ({1: 280}, "counted the wait for the first token in the pace"),
        ({1: 0.15}, "answered in seconds"),
        ({2: 1.9}, "took the nearest-rank value (the largest)"),
        ({2: 0.4}, "took the order statistic below the rank"),
        ({2: 1.0}, "forgot to sort the values"),
        ({3: "c"}, "thinks HTTP needs one thread"),
        ({4: "a"}, "thinks a closed connection keeps generating harmlessly"),
        ({5: "b"}, "blames the prefill for static batching's wait"),
        ({6: "a"}, "reads a long tail as saturation for everyone"),
    ],
}


def grade(lab, answers):
    return run_exercise(get_exercise(lab, "knowledge_check"), {"answers": answers})


def other_spelling(answers):
    """The same answers as a student might write them: "q1" keys, capitals, numbers as text."""
    return {f"q{n}": f"({a.upper()})" if isinstance(a, str) else str(a) for n, a in answers.items()}


@pytest.mark.parametrize("lab", sorted(RIGHT))
@pytest.mark.parametrize("spelling", [dict, other_spelling])
def test_right_answers_pass(lab, spelling):
    result = grade(lab, spelling(RIGHT[lab]))
    assert result.passed, result.message


@pytest.mark.parametrize(("lab", "wrong", "why"),
                         [(lab, wrong, why) for lab, cases in sorted(WRONG.items()) for wrong, why in cases])
def test_wrong_answer_is_named_without_the_answer(lab, wrong, why):
    result = grade(lab, {**RIGHT[lab], **wrong})
    assert not result.passed, why
    (number,) = wrong
    assert result.message.startswith(f"question {number}: "), result.message
    assert "re-read" in result.message
    assert result.message.count("question ") == 1, result.message  # the right ones are not flagged


def test_every_lab_has_enough_wrong_answers():
    assert sorted(WRONG) == sorted(RIGHT)
    assert all(len(cases) >= 5 for cases in WRONG.values())


def test_feedback_never_states_the_answer():
    from labkit_course.grading import ExerciseFailed
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    questions = {1: Number(123456.789, "part one"), 2: Choice("c", "part two")}
    with pytest.raises(ExerciseFailed) as failure:
        grade_answers({"answers": {1: 7, 2: "a"}}, questions)
    assert str(failure.value) == ("question 1: 7 is not it: re-read part one; "
                                  "question 2: not this one: re-read part two")


def test_missing_and_malformed_answers_are_explained():
    assert "`answers` is not defined" in run_exercise(get_exercise("07", "knowledge_check"), {}).message
    partial = grade("07", {1: 4, 2: 14})
    assert "question 3: no answer yet" in partial.message and "question 5: no answer yet" in partial.message
    assert "numbered 1 to 5" in grade("07", {**RIGHT["07"], 6: "a"}).message
    assert "one letter of a, b, c, d" in grade("07", {**RIGHT["07"], 4: "e"}).message
    assert "one letter" in grade("07", {**RIGHT["07"], 4: 2}).message
    assert "answer with a number" in grade("07", {**RIGHT["07"], 1: "four"}).message
    assert "answer with a number" in grade("07", {**RIGHT["07"], 1: True}).message
    assert "should be a dict" in run_exercise(get_exercise("07", "knowledge_check"), {"answers": [4, 14]}).message
