"""The wrong-answer catalogue: for every exercise, answers a half-understanding student writes, each
with the misconception the grader's feedback must name, and correct answers in different styles.

One module per lab (`labNN.py`) holds two lists, driven by tests/test_grading_catalogue.py:

    WRONG = [Wrong(exercise, misconception, answer, feedback), ...]   # must fail, naming `feedback`
    RIGHT = [Right(exercise, style, answer), ...]                     # must get full marks

`answer` is what the student's cell would define under the exercise's name (a function or a class).
A wrong answer that only calls a labkit reference or a forbidden built-in sets `calls`, the forbidden
path it leans on (its feedback names it: labkit's own by name, a torch built-in by its full path);
those fail through the grading runtime's forbidden-call tripwire.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Wrong:
    exercise: str
    misconception: str
    answer: Callable[..., Any]
    feedback: str  # a distinctive part of the message that names the misconception
    calls: str | None = None  # the forbidden reference this answer leans on, if that is its mistake


@dataclass(frozen=True)
class Right:
    exercise: str
    style: str
    answer: Callable[..., Any]
