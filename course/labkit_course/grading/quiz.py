"""Knowledge checks: a lab's closing questions, answered in a dict and graded one question at a time.

The student writes `answers = {1: "b", 2: 48, ...}`. A multiple-choice question takes a letter; a
numeric one takes a number, which the lab's grader computes from labkit or the lab's own inputs
rather than typing it in. Feedback names each wrong question and the section to re-read, never
the answer itself.
"""

import functools
import math
from dataclasses import dataclass

from labkit_course.grading.core import ExerciseFailed, require


@dataclass(frozen=True)
class Choice:
    """A multiple-choice question: `answer` is one of `options` (letters)."""

    answer: str
    reread: str  # the section that teaches it, named in the feedback
    options: str = "abcd"


@dataclass(frozen=True)
class Number:
    """A question whose answer is a number, right within a relative tolerance."""

    answer: float
    reread: str
    rel_tol: float = 1e-9


def _question_number(key) -> int | None:
    """1, "1", "q1" and "Q1" all name question 1."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str):
        text = key.strip().lower().removeprefix("q")
        return int(text) if text.isdigit() else None
    return None


def _verdict(question: Choice | Number, given) -> str | None:
    """None when `given` is right; otherwise why it is not (without the answer)."""
    if isinstance(question, Choice):
        if not isinstance(given, str) or given.strip().strip("()").lower() not in question.options:
            return f"answer with one letter of {', '.join(question.options)} (got {given!r})"
        if given.strip().strip("()").lower() != question.answer:
            return f"not this one: re-read {question.reread}"
        return None
    if isinstance(given, str):
        try:
            given = float(given.replace(",", "").replace("_", ""))
        except ValueError:
            return f"answer with a number (got {given!r})"
    if isinstance(given, bool) or not isinstance(given, int | float):
        return f"answer with a number (got {type(given).__name__})"
    if not math.isclose(given, question.answer, rel_tol=question.rel_tol, abs_tol=1e-12):
        return f"{given:g} is not it: re-read {question.reread}"
    return None


def grade_answers(namespace: dict, questions: dict[int, Choice | Number]) -> str:
    """Grade the notebook's `answers` dict against `questions`, reporting every wrong one."""
    given = require(namespace, "answers", dict)
    by_number = {}
    for key, value in given.items():
        number = _question_number(key)
        if number not in questions:
            raise ExerciseFailed(f"`answers` has a key {key!r}, but the questions are numbered "
                                 f"{min(questions)} to {max(questions)}")
        by_number[number] = value
    problems = []
    for number, question in sorted(questions.items()):
        if number not in by_number:
            problems.append(f"question {number}: no answer yet")
            continue
        reason = _verdict(question, by_number[number])
        if reason:
            problems.append(f"question {number}: {reason}")
    if problems:
        raise ExerciseFailed("; ".join(problems))
    return f"all {len(questions)} answers are right"


@functools.cache
def smollm2_config():
    """SmolLM2's configuration, read once per process (questions derive their numbers from it)."""
    from labkit.model import load_config

    return load_config("smollm2")


@functools.cache
def smollm2_tokenizer():
    """SmolLM2's tokenizer, loaded once per process."""
    from labkit.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")
