"""Lab 04's graders: full marks for a correct answer, and a named misconception for each usual mistake."""

import pytest
import torch

from labkit import worked_example as ref
from labkit.grading.core import get_exercise, run_exercise


def grade(name, fn):
    return run_exercise(get_exercise("04", name), {name: fn})


def not_implemented(*args):
    raise NotImplementedError()


def correct_append_and_attend(cache_k, cache_v, q, k_new, v_new):
    keys, values = torch.cat([cache_k, k_new]), torch.cat([cache_v, v_new])
    return keys, values, ref.attend(q, keys, values)[2]


def attend_with(keys, values, q, scale=True, mask=False):
    scores = q @ keys.T / (keys.shape[-1] ** 0.5 if scale else 1.0)
    if mask:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ values


def appended(cache_k, cache_v, k_new, v_new):
    return torch.cat([cache_k, k_new]), torch.cat([cache_v, v_new])


@pytest.mark.parametrize(
    ("name", "answer", "reason"),
    [
        ("embed_token", lambda e, pe, t, p: ref.build_x(e, pe, [t], start=p), None),
        ("embed_token", lambda e, pe, t, p: (e[t] + pe[p])[None], None),
        ("embed_token", not_implemented, "not implemented yet"),
        ("embed_token", lambda e, pe, t, p: e[t][None], "positional encoding was not added"),
        ("embed_token", lambda e, pe, t, p: (e[t] + pe[p - 1])[None], "PE of the wrong position"),
        ("embed_token", lambda e, pe, t, p: (e[t] + pe[p + 1])[None], "PE of the wrong position"),
        ("embed_token", lambda e, pe, t, p: (e[t] + pe[0])[None], "PE[0] was used"),
        ("embed_token", lambda e, pe, t, p: (e[t] + pe[t])[None], "indexed by token id"),
        ("embed_token", lambda e, pe, t, p: e[t] + pe[p], "not a flat vector"),
        ("embed_token", lambda e, pe, t, p: (e[t] + pe[p]).float()[None], None),
        ("append_and_attend", correct_append_and_attend, None),
        ("append_and_attend", not_implemented, "not implemented yet"),
        ("append_and_attend", lambda ck, cv, q, k, v: (k, v, attend_with(k, v, q)), "replaced instead of appended"),
        ("append_and_attend", lambda ck, cv, q, k, v: (torch.cat([ck, k.expand_as(ck)], 1),
                                                       torch.cat([cv, v.expand_as(cv)], 1), q),
         "along the feature axis"),
        ("append_and_attend", lambda ck, cv, q, k, v: (torch.cat([k, ck]), torch.cat([v, cv]),
                                                       attend_with(torch.cat([k, ck]), torch.cat([v, cv]), q)),
         "went in front"),
        ("append_and_attend", lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), attend_with(ck, cv, q)),
         "old cache only"),
        ("append_and_attend", lambda ck, cv, q, k, v: (*appended(ck, cv, k, v),
                                                       attend_with(*appended(ck, cv, k, v), q, scale=False)),
         "not divided by sqrt(d_k)"),
        ("append_and_attend", lambda ck, cv, q, k, v: (*appended(ck, cv, k, v),
                                                       attend_with(*appended(ck, cv, k, v), q, mask=True)),
         "prefill-style causal mask"),
        ("append_and_attend", lambda ck, cv, q, k, v: appended(ck, cv, k, v), "return three things"),
    ],
)
def test_grader_names_the_mistake(name, answer, reason):
    outcome = grade(name, answer)
    if reason is None:
        assert outcome.passed, outcome.message
    else:
        assert not outcome.passed and reason in outcome.message, outcome.message
        assert "\n" not in outcome.message
