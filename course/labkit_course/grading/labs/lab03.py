"""Lab 03: the prefill worked example. Graders test the student's functions on fresh random inputs
against `labkit_course.worked_example`, and name the usual mistakes."""

import math

import torch

from labkit_course import worked_example as ref
from labkit_course.grading import ExerciseFailed, exercise, expect_tensor, expect_value_error, raised_type, require
from labkit_course.grading.core import close_at_precision as _close
from labkit_course.grading.core import float64_randn as _random


def _expect_float64(got, what):
    """The lab computes in float64 (its text says so); a float32 answer blurs the book's rounding."""
    if got.dtype != torch.float64:
        raise ExerciseFailed(f"{what} came back in {got.dtype} for float64 inputs: the lab computes in float64, "
                             "so keep the inputs' dtype (no .float())")



@exercise("03", "build_x", forbidden=("labkit_course.worked_example.build_x",))
def build_x(ns):
    fn = require(ns, "build_x")
    embeddings, positional = _random(7, 3, seed=30), _random(8, 3, seed=31)
    for token_ids in ([4, 1, 6, 4], [5, 0, 2, 2, 3, 1]):
        n = len(token_ids)
        given_e, given_pe = embeddings.clone(), positional.clone()
        got = expect_tensor(fn(given_e, given_pe, list(token_ids)), (n, 3), f"X for {n} tokens of d_model 3")
        if not (torch.equal(given_e, embeddings) and torch.equal(given_pe, positional)):
            raise ExerciseFailed(f"{'E' if not torch.equal(given_e, embeddings) else 'PE'} was modified in place "
                                 "(+=, add_): the model's tables are read, never written; return a new tensor")
        ids = torch.tensor(token_ids)
        if _close(got, embeddings[ids]):
            raise ExerciseFailed("the positional encodings were not added: X[i] = E[token_i] + PE[i]")
        if _close(got, embeddings[ids] + positional[ids]):
            raise ExerciseFailed("PE was indexed by token id; it is indexed by position: X[i] = E[token_i] + PE[i]")
        if _close(got, embeddings[ids] + positional[1:n + 1]):
            raise ExerciseFailed("PE of the wrong position: the first token is at position 0, so it gets PE[0]")
        if _close(got, embeddings[ids] + positional[0]):
            raise ExerciseFailed("every token got PE[start] (here PE[0]): token i sits at position start + i")
        if _close(got, embeddings[ids] * positional[:n]):
            raise ExerciseFailed("E and PE were multiplied: the positional encoding is added, "
                                 "X[i] = E[token_i] + PE[i]")
        _expect_float64(got, "X")
        if not _close(got, ref.build_x(embeddings, positional, token_ids)):
            raise ExerciseFailed(f"X differs from E[token_ids] + PE[0:len(token_ids)] for {n} fresh tokens")
    # tokens after `start` cached ones (a decode step); the last two reach PE's last row, position 7
    for token_ids, start in (([3], 5), ([2, 6, 0], 4), ([1, 5], 6), ([4], 7)):
        n = len(token_ids)
        try:
            got = fn(embeddings.clone(), positional.clone(), list(token_ids), start)  # the references read these
        except Exception as error:
            if start + n == len(positional):
                raise ExerciseFailed(f"{n} token(s) at positions {start}..{start + n - 1} with {len(positional)} "
                                     f"rows of PE raised {raised_type(error)}: the last row, PE[{start + n - 1}], "
                                     "is a valid position (off by one in the range check?)") from None
            raise
        got = expect_tensor(got, (n, 3), f"X for {n} tokens starting at position {start}")
        ids = torch.tensor(token_ids)
        if _close(got, embeddings[ids] + positional[:n]):
            raise ExerciseFailed(f"start={start} was ignored: tokens after {start} cached ones sit at positions "
                                 f"{start}, {start + 1}, ... and get those rows of PE")
        if n > 1 and _close(got, embeddings[ids] + positional[start]):
            raise ExerciseFailed("every token got PE[start]: token i sits at position start + i")
        if not _close(got, ref.build_x(embeddings, positional, token_ids, start)):
            raise ExerciseFailed(f"X differs from E[token_ids] + PE[start:start + n] for start={start}")
    expect_value_error(lambda: fn(embeddings, positional, [1, -1]), "token id -1",
                        "torch would silently take E's last row")
    expect_value_error(lambda: fn(embeddings, positional, [7]), "token id 7 for a 7-row E", "it has no such row")
    expect_value_error(lambda: fn(embeddings, positional, [1, 2, 3], 6), "positions 6..8 with 8 rows of PE",
                        "PE has no row for position 8")
    expect_value_error(lambda: fn(embeddings, positional, [2], -1), "start=-1",
                       "there is no position -1, and torch would silently take PE's last row")
    return "X[i] = E[token_i] + PE[start + i] in float64, and ids or positions out of range are refused"


@exercise("03", "scaled_scores", forbidden=("labkit_course.worked_example.scaled_scores",))
def scaled_scores(ns):
    fn = require(ns, "scaled_scores")
    for n_q, n_k, d_k, seed in ((3, 5, 4, 32), (2, 2, 2, 33)):
        q, k = _random(n_q, d_k, seed=seed), _random(n_k, d_k, seed=seed + 100)
        got = expect_tensor(fn(q.clone(), k.clone()), (n_q, n_k), f"scores of {n_q} queries against {n_k} keys")
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
        _expect_float64(got, "the scores")
        if not _close(got, ref.scaled_scores(q, k)):
            raise ExerciseFailed("scores differ from Q K^T / sqrt(d_k) (row i: query i against every key)")
    return "Q K^T / sqrt(d_k), for any number of queries, keys and d_k"


def _future(n_queries, n_keys):
    """True where query i (at position n_keys - n_queries + i) would see a later key."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool).triu(n_keys - n_queries + 1)


@exercise("03", "causal_softmax", forbidden=("labkit_course.worked_example.causal_softmax",
                                              "labkit_course.worked_example.causal_mask",
                                              "labkit_course.worked_example.attend"))
def causal_softmax(ns):
    fn = require(ns, "causal_softmax")
    scores = _random(4, 4, seed=34)
    given = scores.clone()
    got = expect_tensor(fn(given), (4, 4), "weights for 4x4 scores")
    if not torch.equal(given, scores):
        raise ExerciseFailed("causal_softmax changed its input scores in place (masked_fill_, softmax into it): the "
                             "caller's scores are still needed; use masked_fill, which returns a new tensor")
    if torch.isnan(got).any() or (got.diagonal()[1:].abs() < 1e-12).all():
        raise ExerciseFailed("the mask hides the diagonal: a token must attend to itself "
                             "(and row 0 would have nothing left to attend to)")
    future = _future(4, 4)
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
    _expect_float64(got, "the weights")
    if not _close(got, ref.causal_softmax(scores)):
        raise ExerciseFailed("weights differ from softmax over each row with j > i set to -inf")
    for n_queries, n_keys, seed in ((2, 5, 35), (1, 4, 36)):  # the last queries of a longer sequence
        scores = _random(n_queries, n_keys, seed=seed)
        got = expect_tensor(fn(scores.clone()), (n_queries, n_keys),
                            f"weights for {n_queries} queries against {n_keys} keys")
        if torch.isnan(got).any():
            raise ExerciseFailed(f"NaN for {n_queries} queries against {n_keys} keys: the queries are the LAST "
                                 f"{n_queries} positions, so query i sits at position {n_keys - n_queries} + i")
        if _close(got, scores.masked_fill(torch.ones_like(got, dtype=torch.bool).triu(1), float("-inf"))
                  .softmax(-1)):
            raise ExerciseFailed(f"with {n_queries} queries and {n_keys} keys the mask assumed query i is at "
                                 f"position i: the queries are the last ones, at positions "
                                 f"{n_keys - n_queries}..{n_keys - 1}, and see every key up to their own")
        if not _close(got, ref.causal_softmax(scores)):
            raise ExerciseFailed(f"weights for {n_queries} queries against {n_keys} keys differ from a softmax "
                                 "over every key up to each query's own position")
    return "future masked with -inf, rows sum to 1, also for the last queries of a longer sequence"


def _split_heads(x, n_heads):
    return x.view(x.shape[0], n_heads, -1).transpose(0, 1)


def _multi_head(x, w_q, w_k, w_v, w_o, n_heads):
    _, weights, out = ref.attend(_split_heads(x @ w_q, n_heads), _split_heads(x @ w_k, n_heads),
                                 _split_heads(x @ w_v, n_heads))
    return weights, out.transpose(0, 1).reshape(x.shape[0], -1) @ w_o


def _mha_mistake(got_w, got_out, x, w_q, w_k, w_v, w_o, h):
    """Name the misconception behind a wrong multi-head answer, if a known one explains it."""
    n, d_k = x.shape[0], w_q.shape[1] // h
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    right_w, right_out = _multi_head(x, w_q, w_k, w_v, w_o, h)
    bad_split = [t.reshape(h, n, d_k) for t in (q, k, v)]
    if _close(got_w, ref.causal_softmax(ref.scaled_scores(bad_split[0], bad_split[1]))):
        return ("the heads were split with a plain reshape to [heads, n, d_k]: that mixes tokens into heads; "
                "view as [n, heads, d_k], then transpose to [heads, n, d_k]")
    split = [_split_heads(t, h) for t in (q, k, v)]
    for scale, what in ((math.sqrt(x.shape[1]), "sqrt(d_model)"), (math.sqrt(h * d_k), "sqrt(heads x d_k)"),
                        (d_k, "d_k"), (math.sqrt(x.shape[1] / h), "sqrt(d_model / heads)")):
        scaled = (split[0] @ split[1].transpose(-2, -1)) / scale
        if not math.isclose(scale, math.sqrt(d_k)) and _close(
                got_w, scaled.masked_fill(_future(n, n), float("-inf")).softmax(-1)):
            if what == "sqrt(d_model / heads)":
                return (f"d_k was taken as d_model / heads = {x.shape[1] // h}, but here heads x d_k = {h * d_k} is "
                        f"not d_model = {x.shape[1]}: take d_k from the projections (W_Q's columns / heads)")
            return f"scores were scaled by {what}: each head divides by sqrt(d_k) of that head"
    if _close(got_w, (ref.scaled_scores(split[0], split[1])).softmax(-1)):
        return "no causal mask: in a prefill every query must be kept from later positions"
    if not _close(got_w, right_w):
        return None
    heads_out = right_w @ split[2]
    if _close(got_out, heads_out.reshape(n, h * d_k) @ w_o):
        return ("the heads were merged with a plain reshape of [heads, n, d_k]: transpose to [n, heads, d_k] "
                "first, so each row holds one token's heads side by side")
    if got_out.shape == (n, h * d_k) and _close(got_out, heads_out.transpose(0, 1).reshape(n, -1)):
        return "W_O was not applied: project the concatenated heads with W_O"
    return None


_MHA_CASES = ((5, 8, 2, 4, 37), (4, 6, 3, 3, 38))  # (tokens, d_model, heads, d_k, seed): h x d_k need not be d


@exercise("03", "multi_head_attention", forbidden=("labkit_course.worked_example.forward",
                                                    "labkit_course.worked_example.attend",
                                                    "labkit_course.worked_example.scaled_scores",
                                                    "labkit_course.worked_example.causal_softmax",
                                                    "torch.nn.functional.scaled_dot_product_attention",
                                                    "torch.nn.functional.multi_head_attention_forward"))
def multi_head_attention(ns):
    fn = require(ns, "multi_head_attention")
    for n, d, h, d_k, seed in _MHA_CASES:
        x = _random(n, d, seed=seed)
        w_q, w_k, w_v = (_random(d, h * d_k, seed=seed + 10 * i) for i in (1, 2, 3))
        w_o = _random(h * d_k, d, seed=seed + 40)
        got = fn(x.clone(), w_q, w_k, w_v, w_o, h)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed("return a pair: (attention weights [heads, n, n], output [n, d_model])")
        got_w = expect_tensor(got[0], (h, n, n), f"the weights of {h} heads over {n} tokens")
        got_out = got[1]
        if not isinstance(got_out, torch.Tensor):
            raise ExerciseFailed(f"the output should be a torch.Tensor, got {type(got_out).__name__}")
        right_w, right_out = _multi_head(x, w_q, w_k, w_v, w_o, h)
        if _close(got_w, right_w) and _close(got_out, right_out):
            continue
        why = _mha_mistake(got_w, got_out, x, w_q, w_k, w_v, w_o, h)
        if why:
            raise ExerciseFailed(why)
        expect_tensor(got_out, (n, d), f"the output of {n} tokens of d_model {d}")
        raise ExerciseFailed(f"{'weights' if not _close(got_w, right_w) else 'output'} differ for {h} heads of d_k "
                             f"{d_k}: split Q, K, V into heads, attend per head with the causal mask, merge, W_O")
    model = ref.load_worked_example()
    fused = [w.permute(1, 0, 2).reshape(w.shape[1], -1) for w in (model.w_q, model.w_k, model.w_v)]
    trace = ref.forward(model, [model.token_id("I"), model.token_id("love")])
    got_w, got_out = fn(trace.x.clone(), *fused, model.w_o, model.n_heads)
    if not (_close(got_w, trace.weights) and _close(got_out, trace.mha)):
        raise ExerciseFailed("on the worked example (\"I love\", fused W_Q = [W_Q1 | W_Q2]) the result differs "
                             "from the lab's MHA output")
    return "split into heads, causal attention per head, merged and projected by W_O"


def _leading_elsewhere(n, d, vocab, seed):
    """(layer_output, W_LM, logits) whose best token overall is not the last position's (where there are two
    positions), so an argmax over every position shows; drawn again until it is."""
    while True:
        layer_output, w_lm = _random(n, d, seed=seed), _random(d, vocab, seed=seed + 1)
        layer_output[0] *= 10  # the first position's logits dwarf the rest: its best token usually leads overall
        logits = layer_output @ w_lm
        if n == 1 or int(logits.argmax()) % vocab != int(logits[-1].argmax()):
            return layer_output, w_lm, logits
        seed += 1000


def _nearly_flat(seed):
    """(layer_output, W_LM, logits) whose last position spreads its probability over 64 tokens almost evenly, so a
    sampler picks the most probable one about once in 60 draws; the middle position leads overall, not the first."""
    layer_output, w_lm = _random(3, 4, seed=seed), _random(4, 64, seed=seed + 1)
    layer_output[[0, 2]] *= 0.05
    return layer_output, w_lm, layer_output @ w_lm


def _best_anywhere(logits):
    """The tokens an argmax over every position gives (flattened, or the best of each column)."""
    vocab = logits.shape[1]
    return {int(logits.argmax()), int(logits.argmax()) % vocab, int(logits.max(0).values.argmax())}


@exercise("03", "next_token")
def next_token(ns):
    fn = require(ns, "next_token")
    cases = [_leading_elsewhere(n, d, vocab, seed) for n, d, vocab, seed in ((3, 4, 7, 50), (1, 5, 11, 51),
                                                                             (6, 3, 5, 52))]
    cases += [_nearly_flat(seed) for seed in (80, 82, 84, 86)]  # seeds no other exercise of the lab draws from
    answers = [fn(layer_output.clone(), w_lm) for layer_output, w_lm, _ in cases]
    for (layer_output, w_lm, _), got in zip(cases, answers, strict=True):
        again = fn(layer_output.clone(), w_lm)
        tokens = [answer[0] for answer in (got, again) if isinstance(answer, tuple) and len(answer) == 2]
        if len(tokens) == 2 and all(isinstance(token, int) for token in tokens) and tokens[0] != tokens[1]:
            raise ExerciseFailed(f"the same input gave token {tokens[0]}, then {tokens[1]}: the next token is the "
                                 "most probable one (argmax, greedy decoding), not a sample")
    for (_, _, logits), got in zip(cases, answers, strict=True):
        n, vocab = logits.shape
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed("return a pair: (the next token's id, the last position's probabilities)")
        token, probs = got
        if isinstance(token, torch.Tensor):
            raise ExerciseFailed("return the token id as a Python int (int(...) or .item()), not a tensor")
        if isinstance(token, bool) or not isinstance(token, int):
            raise ExerciseFailed(f"the token id should be an int, got {type(token).__name__}")
        if isinstance(probs, torch.Tensor) and probs.shape == (n, vocab) and n > 1:
            raise ExerciseFailed("only the LAST position's logits choose the next token: return its "
                                 f"{vocab} probabilities, not every position's")
        probs = expect_tensor(probs, (vocab,), f"the probabilities over a vocabulary of {vocab}")
        if n > 1 and _close(probs, logits[0].softmax(-1)):
            raise ExerciseFailed("the first position's logits were used: the last position predicts what comes "
                                 "after the prompt")
        if _close(probs, logits[-1]):
            raise ExerciseFailed("those are logits: the probabilities are their softmax")
        if n > 1 and _close(probs, logits.softmax(0)[-1]):
            raise ExerciseFailed("the softmax ran over positions: take it over the vocabulary (the last dimension)")
        _expect_float64(probs, "the probabilities")
        if not _close(probs, logits[-1].softmax(-1)):
            raise ExerciseFailed("the probabilities differ from softmax(layer_output[-1] @ W_LM)")
    several = [(got[0], logits) for (_, _, logits), got in zip(cases, answers, strict=True) if len(logits) > 1]
    token, logits = next(((got[0], logits) for (_, _, logits), got in zip(cases, answers, strict=True)
                          if got[0] != int(logits[-1].argmax())), (None, None))
    if token is not None:
        if all(picked == int(each[0].argmax()) for picked, each in several):
            raise ExerciseFailed("the first position's logits chose the token: the last position predicts what "
                                 "comes after the prompt, so take the argmax of its probabilities")
        if all(picked in _best_anywhere(each) for picked, each in several):
            raise ExerciseFailed("argmax over every position's logits (flattened, or the best of each column): "
                                 "only the last position chooses the next token, so take it over the last row only")
        raise ExerciseFailed(f"token {token} is not the most probable one ({int(logits[-1].argmax())})")
    expect_value_error(lambda: fn(torch.zeros(0, 4, dtype=torch.float64), _random(4, 5, seed=53)),
                       "no positions at all", "there is no last position")
    return "the last position's logits, softmax over the vocabulary, argmax as an int"


@exercise("03", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    model = ref.load_worked_example()
    trace = ref.forward(model, [model.token_id("I"), model.token_id("love")])
    return grade_answers(ns, {
        1: Number(trace.weights[0, 1, 0].item(), "Step 4: row 1 of head 1's attention weights", rel_tol=2e-3),
        2: Number(int(ref.causal_mask(2, 5).sum()), "Step 4: query i of a chunk sits at position n_k - n_q + i"),
        3: Number(trace.probs[-1, trace.next_token].item(), "the last step: the softmax of the last position's "
                  "logits", rel_tol=4e-3),
        4: Choice("a", "'How W_K1 and W_V1 were built'"),
        5: Choice("c", "'Head 2: a printed number that does not follow'"),
    })
