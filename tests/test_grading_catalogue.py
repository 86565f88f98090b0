"""Every grader proven against the wrong-answer catalogue (tests/catalogue/labNN.py): each typical
wrong answer fails with feedback that names its misconception, each correct style gets full marks."""

import importlib
import pkgutil
from collections import Counter

import catalogue
import pytest

from labkit_course.grading.core import exercises, get_exercise, run_exercise

LABS = {m.name[3:]: importlib.import_module(f"catalogue.{m.name}")
        for m in pkgutil.iter_modules(catalogue.__path__) if m.name.startswith("lab")}
WRONG = [(lab, w) for lab, module in LABS.items() for w in module.WRONG]
RIGHT = [(lab, r) for lab, module in LABS.items() for r in module.RIGHT]


# Exercises answered by a function or a class. Knowledge checks (an `answers` dict) have their own
# catalogue in test_grading_knowledge_checks.py, and Lab 16's wrong answers live in test_grading_lab16.py.
CODE_EXERCISES = [ex for ex in exercises() if ex.name != "knowledge_check"]
CATALOGUED = [ex for ex in CODE_EXERCISES if ex.lab in LABS]


def grade(lab, name, answer):
    return run_exercise(get_exercise(lab, name), {name: answer})


@pytest.mark.parametrize(
    ("lab", "wrong"),
    [pytest.param(lab, w, id=f"{lab}/{w.exercise}/{w.misconception}") for lab, w in WRONG],
)
def test_wrong_answer_fails_naming_its_misconception(lab, wrong):
    outcome = grade(lab, wrong.exercise, wrong.answer)
    assert not outcome.passed, f"passed: {outcome.message}"
    assert wrong.feedback in outcome.message, outcome.message
    assert "\n" not in outcome.message


@pytest.mark.parametrize(("lab", "right"), [pytest.param(lab, r, id=f"{lab}/{r.exercise}/{r.style}")
                                            for lab, r in RIGHT])
def test_correct_answer_gets_full_marks(lab, right):
    outcome = grade(lab, right.exercise, right.answer)
    assert outcome.passed, outcome.message


@pytest.mark.parametrize(("lab", "right"), [pytest.param(lab, r, id=f"{lab}/{r.exercise}")
                                            for lab, r in {(lab, r.exercise): (lab, r) for lab, r in RIGHT}.values()])
def test_graded_inputs_come_from_the_secret_and_a_right_answer_passes_on_them(lab, right, secret_inputs):
    """Graded, no notebook can know the inputs in advance (so none can hand in a table of labkit's answers):
    every exercise draws them from seeds mixed with the grading run's secret."""
    outcome = grade(lab, right.exercise, right.answer)
    assert outcome.passed, outcome.message
    assert secret_inputs, "nothing was drawn from the secret: every input of this grader is public"


def test_every_exercise_has_five_wrong_answers_and_two_right_styles():
    known = {(ex.lab, ex.name) for ex in CATALOGUED}
    wrong = Counter((lab, w.exercise) for lab, w in WRONG if not w.calls)
    right = Counter((lab, r.exercise) for lab, r in RIGHT)
    assert set(wrong) | set(right) <= known, "catalogue entries for exercises that do not exist"
    thin = {key: (wrong[key], right[key]) for key in sorted(known) if wrong[key] < 5 or right[key] < 2}
    assert not thin, f"(wrong, right) answers below (5, 2): {thin}"


def test_every_exercise_with_forbidden_references_has_a_wrong_answer_calling_one():
    leaning = {(lab, w.exercise) for lab, w in WRONG if w.calls}
    for ex in CATALOGUED:
        if ex.forbidden:
            assert (ex.lab, ex.name) in leaning, f"{ex.lab}/{ex.name} forbids {ex.forbidden} but nothing calls them"
    for lab, w in WRONG:
        if w.calls:
            forbidden = get_exercise(lab, w.exercise).forbidden
            assert w.calls in forbidden, f"{w.calls} is not forbidden in {lab}/{w.exercise}"


@pytest.mark.parametrize("ex", CODE_EXERCISES, ids=lambda ex: f"{ex.lab}/{ex.name}")
def test_unfinished_and_undefined_answers_fail(ex):
    class Unfinished:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError()

    def unfinished(*args, **kwargs):
        raise NotImplementedError()

    answer = Unfinished if ex.name[0].isupper() else unfinished
    assert "not implemented yet" in grade(ex.lab, ex.name, answer).message
    missing = run_exercise(ex, {})
    assert not missing.passed and missing.missing == ex.name


def resolve(path: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(path)


@pytest.mark.parametrize("ex", [ex for ex in exercises() if ex.forbidden], ids=lambda ex: f"{ex.lab}/{ex.name}")
def test_every_forbidden_path_names_a_real_callable(ex):
    for path in ex.forbidden:
        assert callable(resolve(path)), path
