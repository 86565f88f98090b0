"""Lab 03: the prefill worked example. Graders test the student's functions on fresh random inputs
against `labkit.worked_example`, and name the usual mistakes."""

import math

import torch

from labkit import worked_example as ref
from labkit.grading import ExerciseFailed, exercise, expect_tensor, require


def _random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(a, b):
    """Same shape and values (a student's float32 answer is compared at float32 precision)."""
    if a.shape != b.shape:
        return False
    atol = 1e-9 if a.dtype == torch.float64 else 1e-5
    return torch.allclose(a.to(torch.float64), b.to(torch.float64), atol=atol)


@exercise("03", "build_x", forbidden=("labkit.worked_example.build_x",))
def build_x(ns):
    fn = require(ns, "build_x")
    embeddings, positional = _random(7, 3, seed=30), _random(8, 3, seed=31)
    for token_ids in ([4, 1, 6, 4], [5, 0, 2, 2, 3, 1]):
        n = len(token_ids)
        got = expect_tensor(fn(embeddings, positional, list(token_ids)), (n, 3), f"X for {n} tokens of d_model 3")
        ids = torch.tensor(token_ids)
        if _close(got, embeddings[ids]):
            raise ExerciseFailed("the positional encodings were not added: X[i] = E[token_i] + PE[i]")
        if _close(got, embeddings[ids] + positional[ids]):
            raise ExerciseFailed("PE was indexed by token id; it is indexed by position: X[i] = E[token_i] + PE[i]")
        if _close(got, embeddings[ids] + positional[1:n + 1]):
            raise ExerciseFailed("PE of the wrong position: the first token is at position 0, so it gets PE[0]")
        if _close(got, embeddings[ids] * positional[:n]):
            raise ExerciseFailed("E and PE were multiplied: the positional encoding is added, "
                                 "X[i] = E[token_i] + PE[i]")
        if not _close(got, ref.build_x(embeddings, positional, token_ids)):
            raise ExerciseFailed(f"X differs from E[token_ids] + PE[0:len(token_ids)] for {n} fresh tokens")
    return "X[i] = E[token_i] + PE[i]"


@exercise("03", "scaled_scores", forbidden=("labkit.worked_example.scaled_scores",))
def scaled_scores(ns):
    fn = require(ns, "scaled_scores")
    for n_q, n_k, d_k, seed in ((3, 5, 4, 32), (2, 2, 2, 33)):
        q, k = _random(n_q, d_k, seed=seed), _random(n_k, d_k, seed=seed + 100)
        got = expect_tensor(fn(q, k), (n_q, n_k), f"scores of {n_q} queries against {n_k} keys")
        raw = q @ k.T
        if _close(got, raw):
            raise ExerciseFailed("scores were not divided by sqrt(d_k)")
        if _close(got, raw / d_k):
            raise ExerciseFailed("scores were divided by d_k; divide by sqrt(d_k)")
        if _close(got, (raw / math.sqrt(d_k)).softmax(-1)):
            raise ExerciseFailed("the softmax was applied: scaled_scores returns the raw scaled scores (the "
                                 "softmax comes in the next step, after the mask)")
        if _close(got, raw / math.sqrt(2)) and d_k != 2:
            raise ExerciseFailed("sqrt(2) is hard-coded: take d_k from the keys' last dimension")
        if not _close(got, ref.scaled_scores(q, k)):
            raise ExerciseFailed("scores differ from Q K^T / sqrt(d_k) (row i: query i against every key)")
    return "Q K^T / sqrt(d_k), for any number of queries, keys and d_k"


@exercise("03", "causal_softmax", forbidden=("labkit.worked_example.causal_softmax",
                                              "labkit.worked_example.attend"))
def causal_softmax(ns):
    fn = require(ns, "causal_softmax")
    scores = _random(4, 4, seed=34)
    got = expect_tensor(fn(scores.clone()), (4, 4), "weights for 4x4 scores")
    if torch.isnan(got).any() or (got.diagonal()[1:].abs() < 1e-12).all():
        raise ExerciseFailed("the mask hides the diagonal: a token must attend to itself "
                             "(and row 0 would have nothing left to attend to)")
    future = torch.ones(4, 4, dtype=torch.bool).triu(1)
    if _close(got, scores.softmax(-1)):
        raise ExerciseFailed("nothing was masked: position i must not see positions after i")
    if _close(got, scores.softmax(0).masked_fill(future, 0.0)) or _close(
        got, scores.masked_fill(future, float("-inf")).softmax(0)
    ):
        raise ExerciseFailed("softmax taken over the wrong axis: each row (one query) must sum to 1")
    if _close(got, scores.masked_fill(future, 0.0).softmax(-1)):
        raise ExerciseFailed("masked scores were set to 0, not -inf: exp(0) still gives future tokens weight")
    if _close(got, scores.softmax(-1).masked_fill(future, 0.0)):
        raise ExerciseFailed("masked after the softmax: mask the scores with -inf first, so rows still sum to 1")
    if got.masked_select(future).abs().max() > 0:
        past = future.T
        if _close(got, scores.masked_fill(past, float("-inf")).softmax(-1)):
            raise ExerciseFailed("the mask hides the past instead of the future: hide j > i (above the diagonal)")
        raise ExerciseFailed("future positions (j > i) got non-zero weight")
    if not _close(got, ref.causal_softmax(scores)):
        raise ExerciseFailed("weights differ from softmax over each row with j > i set to -inf")
    return "future masked with -inf, each row a softmax that sums to 1"


@exercise("03", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers

    model = ref.load_worked_example()
    trace = ref.forward(model, [model.token_id("I"), model.token_id("love")])
    return grade_answers(ns, {
        1: Number(trace.weights[0, 1, 0].item(), "Step 4: row 1 of head 1's attention weights", rel_tol=2e-3),
        2: Choice("a", "Step 4: which positions j > i the mask hides"),
        3: Number(trace.probs[-1, trace.next_token].item(), "the last step: the softmax of the last position's "
                  "logits", rel_tol=4e-3),
        4: Choice("a", "'How W_K1 and W_V1 were built'"),
        5: Choice("c", "'Head 2: a printed number that does not follow'"),
    })
