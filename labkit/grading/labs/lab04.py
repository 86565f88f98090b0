"""Lab 04: decoding with a KV cache. Graders test the student's functions on fresh random inputs
against `labkit.worked_example`, and name the usual mistakes."""

import torch

from labkit import worked_example as ref
from labkit.grading import ExerciseFailed, exercise, expect_tensor, require
from labkit.grading.labs.lab03 import _close, _random


@exercise("04", "embed_token", forbidden=("labkit.worked_example.build_x",))
def embed_token(ns):
    fn = require(ns, "embed_token")
    embeddings, positional = _random(6, 3, seed=40), _random(8, 3, seed=41)
    for token_id, position in ((2, 5), (5, 3)):
        got = fn(embeddings, positional, token_id, position)
        if isinstance(got, torch.Tensor) and tuple(got.shape) == (3,):
            raise ExerciseFailed("return one row of shape (1, d_model), not a flat vector: add .unsqueeze(0)")
        got = expect_tensor(got, (1, 3), "the new token's input row (1 x d_model)")
        row = embeddings[token_id]
        if _close(got[0], row):
            raise ExerciseFailed("the positional encoding was not added: X[t] = E[token] + PE[t]")
        if _close(got[0], row + positional[position - 1]) or _close(got[0], row + positional[position + 1]):
            raise ExerciseFailed(f"PE of the wrong position (off by one): a token at position {position} "
                                 f"gets PE[{position}]")
        if _close(got[0], row + positional[0]):
            raise ExerciseFailed("PE[0] was used: a decoded token is at position t (the number of tokens "
                                 "before it), not 0")
        if _close(got[0], row + positional[token_id]):
            raise ExerciseFailed("PE was indexed by token id; it is indexed by position")
        if not _close(got, ref.build_x(embeddings, positional, [token_id], start=position)):
            raise ExerciseFailed("X[t] differs from E[token] + PE[t] on fresh inputs")
    return "X[t] = E[token] + PE[t], one 1 x d_model row"


@exercise("04", "append_and_attend", forbidden=("labkit.worked_example.attend",))
def append_and_attend(ns):
    fn = require(ns, "append_and_attend")
    cached, d_k = 4, 3
    cache_k, cache_v = _random(cached, d_k, seed=42), _random(cached, d_k, seed=43)
    q, k_new, v_new = _random(1, d_k, seed=44), _random(1, d_k, seed=45), _random(1, d_k, seed=46)
    result = fn(cache_k.clone(), cache_v.clone(), q, k_new, v_new)
    if not isinstance(result, tuple) or len(result) != 3:
        raise ExerciseFailed("return three things: (all keys, all values, attention output)")
    keys, values, out = result
    for value, what in ((keys, "keys"), (values, "values")):
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (1, d_k):
            raise ExerciseFailed(f"the cache was replaced instead of appended: {what} must keep the "
                                 f"{cached} cached rows and add the new one")
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (cached, 2 * d_k):
            raise ExerciseFailed(f"{what} were appended along the feature axis; rows are positions (dim 0)")
        expect_tensor(value, (cached + 1, d_k), f"all {what} after appending one token")
    if _close(keys, torch.cat([k_new, cache_k])):
        raise ExerciseFailed("the new K went in front: the cache keeps positions in order, the newest last")
    if not (_close(keys, torch.cat([cache_k, k_new])) and _close(values, torch.cat([cache_v, v_new]))):
        raise ExerciseFailed("all keys/values should be the cached rows followed by the new token's row")
    out = expect_tensor(out, (1, d_k), "the attention output of one query")
    expected = ref.attend(q, keys, values)[2]
    if _close(out, ref.attend(q, cache_k, cache_v)[2]):
        raise ExerciseFailed("attended over the old cache only: append first, a token attends to itself too")
    if _close(out, (q @ keys.T).softmax(-1) @ values):
        raise ExerciseFailed("scores were not divided by sqrt(d_k)")
    if _close(out, values[:1]):
        raise ExerciseFailed("a prefill-style causal mask hid the past: a decode query sees every cached position")
    if not _close(out, expected):
        raise ExerciseFailed("the output differs from softmax(q K_all^T / sqrt(d_k)) V_all")
    return "appended one row, attended over all cached positions and itself"


@exercise("04", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers

    model = ref.load_worked_example()
    _, cache = ref.generate(model, [model.token_id("I"), model.token_id("love")], steps=2)
    return grade_answers(ns, {
        1: Number(len(cache), "Step 3: each step appends one row per head"),
        2: Number(ref.projection_matvecs(512, 512, cached=True), "'The work, counted': with a cache each "
                  "token is projected once"),
        3: Choice("a", "Step 3, on attending over every position"),
        4: Choice("b", "'Proof: the cache changes the cost, not the answer'"),
        5: Choice("b", "the correction of the book's cost formula, after 'The work, counted'"),
    })
