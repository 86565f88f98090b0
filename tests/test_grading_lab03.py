"""Lab 03's graders: full marks for a correct answer, and a named misconception for each usual mistake."""

import math

import pytest
import torch

from labkit import worked_example as ref
from labkit.grading.core import get_exercise, run_exercise


def grade(name, fn):
    return run_exercise(get_exercise("03", name), {name: fn})


def not_implemented(*args):
    raise NotImplementedError()


FUTURE = lambda s: torch.ones_like(s, dtype=torch.bool).triu(1)  # noqa: E731


@pytest.mark.parametrize(
    ("name", "answer", "reason"),
    [
        ("build_x", ref.build_x, None),
        ("build_x", lambda e, pe, ids: ref.build_x(e.float(), pe.float(), ids), None),
        ("build_x", not_implemented, "not implemented yet"),
        ("build_x", lambda e, pe, ids: e[torch.tensor(ids)], "positional encodings were not added"),
        ("build_x", lambda e, pe, ids: e[torch.tensor(ids)] + pe[torch.tensor(ids)], "indexed by token id"),
        ("build_x", lambda e, pe, ids: e[torch.tensor(ids)] + pe[1:len(ids) + 1], "PE of the wrong position"),
        ("build_x", lambda e, pe, ids: e[torch.tensor(ids)][:1] + pe[:1], "should have shape (4, 3)"),
        ("scaled_scores", ref.scaled_scores, None),
        ("scaled_scores", not_implemented, "not implemented yet"),
        ("scaled_scores", lambda q, k: q @ k.T, "not divided by sqrt(d_k)"),
        ("scaled_scores", lambda q, k: q @ k.T / k.shape[-1], "divided by d_k"),
        ("scaled_scores", lambda q, k: q @ k.T / math.sqrt(2), "sqrt(2) is hard-coded"),
        ("scaled_scores", lambda q, k: k @ q.T / math.sqrt(k.shape[-1]), "should have shape (3, 5)"),
        ("scaled_scores", lambda q, k: q @ k.T / math.sqrt(q.shape[0]), "differ from Q K^T / sqrt(d_k)"),
        ("causal_softmax", ref.causal_softmax, None),
        ("causal_softmax", not_implemented, "not implemented yet"),
        ("causal_softmax", lambda s: s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(0),
                                                   float("-inf")).softmax(-1), "hides the diagonal"),
        ("causal_softmax", lambda s: s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(0), -1e9).softmax(-1),
         "hides the diagonal"),
        ("causal_softmax", lambda s: s.softmax(-1), "nothing was masked"),
        ("causal_softmax", lambda s: s.masked_fill(FUTURE(s), float("-inf")).softmax(0), "wrong axis"),
        ("causal_softmax", lambda s: s.masked_fill(FUTURE(s), 0.0).softmax(-1), "set to 0, not -inf"),
        ("causal_softmax", lambda s: s.softmax(-1).masked_fill(FUTURE(s), 0.0), "masked after the softmax"),
        ("causal_softmax", lambda s: s.masked_fill(FUTURE(s).T, float("-inf")).softmax(-1), "hides the past"),
    ],
)
def test_grader_names_the_mistake(name, answer, reason):
    outcome = grade(name, answer)
    if reason is None:
        assert outcome.passed, outcome.message
    else:
        assert not outcome.passed and reason in outcome.message, outcome.message
        assert "\n" not in outcome.message
