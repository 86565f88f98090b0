"""Lab 14: prompt lookup, greedy verification, rejection sampling, choosing k."""

import torch

from catalogue import Right, Wrong
from labkit.engine.speculative import ngram_lookup
from labkit.engine.speculative import verify_greedy as labkit_verify_greedy
from labkit.engine.speculative import verify_sampled as labkit_verify_sampled
from labkit_course.grading.labs.lab14 import reference_best_k


# ---- propose_ngram ---------------------------------------------------------------------------
def ngram_loops(token_ids, k, max_n):
    for n in range(min(max_n, len(token_ids) - 1), 0, -1):
        for start in range(len(token_ids) - n):
            if token_ids[start:start + n] == token_ids[-n:]:
                return token_ids[start + n:start + n + k]
    return []


def ngram_tuples(token_ids, k, max_n):
    for n in range(min(max_n, len(token_ids) - 1), 0, -1):
        grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n)]
        tail = tuple(token_ids[-n:])
        if tail in grams:
            start = grams.index(tail)
            return list(token_ids[start + n:start + n + k])
    return []


def ngram_with(token_ids, k, max_n, *, latest=False, shortest=False, include_match=False, clip=True, fallback=True):
    sizes = list(range(min(max_n, len(token_ids) - 1), 0, -1))
    sizes = sizes[::-1] if shortest else sizes if fallback else sizes[:1]
    for n in sizes:
        stop = len(token_ids) - n
        starts = range(stop - 1, -1, -1) if latest else range(stop)
        for start in starts:
            if token_ids[start:start + n] == token_ids[-n:]:
                begin = start if include_match else start + n
                return token_ids[begin:begin + k] if clip else token_ids[begin:]
    return []


def ngram_matching_the_tail(token_ids, k, max_n):
    n = min(max_n, len(token_ids))
    for start in range(len(token_ids) - n + 1):
        if token_ids[start:start + n] == token_ids[-n:]:
            return token_ids[start + n:start + n + k]
    return []


def ngram_before_the_tail(token_ids, k, max_n):
    """"The context's own tail never counts" read as "a match may not overlap the tail"."""
    for n in range(min(max_n, len(token_ids) - 1), 0, -1):
        tail, hay = token_ids[-n:], token_ids[:-n]
        for s in range(len(hay) - n + 1):
            if hay[s:s + n] == tail:
                return token_ids[s + n:s + n + k]
    return []


def ngram_latest_with_k_after(token_ids, k, max_n):
    """The latest match that still leaves k tokens after it, else the first."""
    for n in range(min(max_n, len(token_ids) - 1), 0, -1):
        found = [s for s in range(len(token_ids) - n) if token_ids[s:s + n] == token_ids[-n:]]
        if found:
            full = [s for s in found if s + n + k <= len(token_ids)]
            s = full[-1] if full else found[0]
            return token_ids[s + n:s + n + k]
    return []


def ngram_eating_the_tail(token_ids, k, max_n):
    got = ngram_loops(token_ids, k, max_n)
    del token_ids[-1:]
    return got


# ---- verify_greedy ---------------------------------------------------------------------------
def greedy_loop(logits, draft):
    out = []
    for i, guess in enumerate(draft):
        best = int(torch.argmax(logits[i]))
        out.append(best)
        if best != guess:
            return out
    return out + [int(torch.argmax(logits[len(draft)]))]


def greedy_vectorized(logits, draft):
    choices = logits.argmax(-1)
    mismatch = (choices[:len(draft)] != torch.tensor(draft, dtype=torch.long)).nonzero()
    n = int(mismatch[0]) if len(mismatch) else len(draft)
    return choices[:n + 1].tolist()


def greedy_with(logits, draft, *, bonus=True, stop=True, correct=True, shift=0):
    """greedy_loop with one step done as a student half-remembers it: no bonus token, drafts kept after a
    mismatch, no correction at the mismatch, or draft i compared with row i + shift."""
    out = []
    for i, guess in enumerate(draft):
        compared = int(torch.argmax(logits[min(i + shift, len(logits) - 1)]))
        if guess == compared:
            out.append(guess)
        elif stop:
            return out + [int(torch.argmax(logits[i]))] if correct else out
    if bonus:
        out.append(int(torch.argmax(logits[len(draft)])))
    return out


def greedy_consuming_draft(logits, draft):
    choices, out = logits.argmax(-1).tolist(), []
    while draft:
        guess = draft.pop(0)
        if guess != choices[len(out)]:
            return out + [choices[len(out)]]
        out.append(guess)
    return out + [choices[len(out)]]


def greedy_tensor(logits, draft):
    return torch.tensor(greedy_loop(logits, draft))


# ---- verify_sampled --------------------------------------------------------------------------
def sampled_right(p, draft, q, generator, in_place=False):
    out = []
    for i, x in enumerate(draft):
        qi = q[i] if q is not None else torch.eye(p.shape[-1])[x]
        if torch.rand((), generator=generator) < torch.clamp(p[i][x] / qi[x], max=1):
            out.append(x)
            continue
        residual = p[i].sub_(qi).clamp_(min=0) if in_place else (p[i] - qi).clamp(min=0)
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(p[len(draft)], 1, generator=generator))]


def sampled_residual_in_place(p, draft, q, generator):
    """Right, but the residual is built in the caller's target_probs."""
    return sampled_right(p, draft, q, generator, in_place=True)


def sampled_numpy_style(p, draft, q, generator):
    """Uniforms drawn up front, the residual built with where: another correct way."""
    u = torch.rand(len(draft), generator=generator).tolist()
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else float(q[i][x])
        if u[i] * qx < float(p[i][x]):
            continue
        qi = torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).float() if q is None else q[i]
        residual = torch.where(p[i] > qi, p[i] - qi, torch.zeros_like(p[i]))
        return list(draft[:i]) + [int(torch.multinomial(residual, 1, generator=generator))]
    return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=generator))]


def sampled_with(p, draft, q, generator, *, rule="ratio", resample="residual", bonus=True, accept_row=None,
                 resample_row=None, one_uniform=False):
    """Rejection sampling with one step done as a student half-remembers it; `accept_row` / `resample_row`
    judge every draft by that row of p, `one_uniform` draws a single uniform number for all the drafts."""
    out = []
    shared = float(torch.rand((), generator=generator))
    for i, x in enumerate(draft):
        qi = q[i] if q is not None else torch.eye(p.shape[-1])[x]
        pa = p[i if accept_row is None else accept_row]
        chance = {"ratio": min(1.0, float(pa[x] / qi[x])), "always": 1.0, "p": float(pa[x]),
                  "inverse": min(1.0, float(qi[x] / pa[x])) if pa[x] > 0 else 1.0}[rule]
        if (shared if one_uniform else float(torch.rand((), generator=generator))) < chance:
            out.append(x)
            continue
        pr = p[i if resample_row is None else resample_row]
        weights = {"residual": (pr - qi).clamp(min=0), "p": pr, "q": qi}[resample]
        return out + [int(torch.multinomial(weights, 1, generator=generator))]
    return out + ([int(torch.multinomial(p[len(draft)], 1, generator=generator))] if bonus else [])


def sampled_global_rng(p, draft, q, generator):
    """Right but for the generator: torch's global random numbers, so a seed cannot replay a run."""
    return sampled_right(p, draft, q, None)


def sampled_own_seed(p, draft, q, generator):
    return sampled_right(p, draft, q, torch.Generator().manual_seed(0))


def sampled_q_is_p(p, draft, q, generator):
    """A deterministic drafter (q None) taken as q = p: every draft accepted, and max(0, p - p) is all zeros."""
    return sampled_right(p, draft, p[:len(draft)] if q is None else q, generator)


# ---- best_k ----------------------------------------------------------------------------------
def best_k_loop(alpha, draft_cost, max_k):
    best_k, best = 1, 0.0
    for k in range(1, max_k + 1):
        tokens = sum(alpha ** i for i in range(k + 1))
        speedup = tokens / (1 + k * draft_cost)
        if speedup > best + 1e-12:
            best_k, best = k, speedup
    return best_k, best


def best_k_closed_form(alpha, draft_cost, max_k):
    def speedup(k):
        tokens = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens / (1 + k * draft_cost)
    k = max(range(1, max_k + 1), key=lambda k: (round(speedup(k), 12), -k))
    return k, speedup(k)


def best_k_with(alpha, draft_cost, max_k, *, n_of=lambda k: k + 1, cost_of=lambda k, c: 1 + k * c, start=1):
    best = None
    for k in range(start, max_k + 1):
        n = n_of(k)
        tokens = float(n) if alpha == 1 else (1 - alpha ** n) / (1 - alpha)
        s = tokens / cost_of(k, draft_cost)
        if best is None or s > best[1] + 1e-12:
            best = (k, s)
    return best


def best_k_divides_by_zero(alpha, draft_cost, max_k):
    pairs = [(k, (1 - alpha ** (k + 1)) / (1 - alpha) / (1 + k * draft_cost)) for k in range(1, max_k + 1)]
    return max(pairs, key=lambda pair: pair[1])


def best_k_largest_on_a_tie(alpha, draft_cost, max_k):
    tok = (lambda k: k + 1) if alpha == 1 else (lambda k: (1 - alpha ** (k + 1)) / (1 - alpha))
    speedup, k = max((tok(k) / (1 + k * draft_cost), k) for k in range(1, max_k + 1))
    return k, speedup


def best_k_from_zero(alpha, draft_cost, max_k):
    return best_k_with(alpha, draft_cost, max_k, start=0)


RIGHT = [
    Right("propose_ngram", "nested loops", ngram_loops),
    Right("propose_ngram", "tuples and list.index", ngram_tuples),
    Right("verify_greedy", "a loop over drafts", greedy_loop),
    Right("verify_greedy", "vectorized first mismatch", greedy_vectorized),
    Right("verify_sampled", "one uniform per draft, clamp", sampled_right),
    Right("verify_sampled", "uniforms up front, u * q < p", sampled_numpy_style),
    Right("best_k", "a sum of powers", best_k_loop),
    Right("best_k", "closed form and max", best_k_closed_form),
]

WRONG = [
    Wrong("propose_ngram", "takes the latest match", lambda t, k, n: ngram_with(t, k, n, latest=True),
          "take the first one"),
    Wrong("propose_ngram", "tries short n-grams first", lambda t, k, n: ngram_with(t, k, n, shortest=True),
          "try the longest n-gram"),
    Wrong("propose_ngram", "proposes the matched n-gram", lambda t, k, n: ngram_with(t, k, n, include_match=True),
          "the matched n-gram itself"),
    Wrong("propose_ngram", "lets the tail match itself", ngram_matching_the_tail, "never the context's own tail"),
    Wrong("propose_ngram", "returns everything after the match", lambda t, k, n: ngram_with(t, k, n, clip=False),
          "propose at most k"),
    Wrong("propose_ngram", "no fallback to shorter n-grams", lambda t, k, n: ngram_with(t, k, n, fallback=False),
          "fall back to shorter n-grams"),
    Wrong("propose_ngram", "no match may overlap the tail", ngram_before_the_tail, "an earlier occurrence may overlap"),
    Wrong("propose_ngram", "the latest match leaving k tokens", ngram_latest_with_k_after, "take the first one"),
    Wrong("propose_ngram", "deletes from token_ids", ngram_eating_the_tail, "propose_ngram changed its arguments"),
    Wrong("propose_ngram", "calls labkit's ngram_lookup", lambda t, k, n: ngram_lookup(t, k, n), "`ngram_lookup`",
          calls="labkit.engine.speculative.ngram_lookup"),
    Wrong("verify_greedy", "no bonus token", lambda lg, d: greedy_with(lg, d, bonus=False), "the bonus"),
    Wrong("verify_greedy", "keeps drafts after a mismatch", lambda lg, d: greedy_with(lg, d, stop=False),
          "stop at the first mismatch"),
    Wrong("verify_greedy", "drops the correction", lambda lg, d: greedy_with(lg, d, correct=False),
          "the target's own choice at that row"),
    Wrong("verify_greedy", "compares draft i with row i + 1", lambda lg, d: greedy_with(lg, d, shift=1),
          "not draft i + 1"),
    Wrong("verify_greedy", "pops the caller's drafts", greedy_consuming_draft, "verify_greedy changed its arguments"),
    Wrong("verify_greedy", "returns a tensor", greedy_tensor, "return a list of token ids"),
    Wrong("verify_greedy", "calls labkit's verify_greedy", lambda lg, d: labkit_verify_greedy(lg, d),
          "`verify_greedy`", calls="labkit.engine.speculative.verify_greedy"),
    Wrong("verify_sampled", "accepts every draft", lambda p, d, q, g: sampled_with(p, d, q, g, rule="always"),
          "probability 0, so it is always rejected"),
    Wrong("verify_sampled", "accepts with probability p(x)", lambda p, d, q, g: sampled_with(p, d, q, g, rule="p"),
          "The acceptance rule is wrong: accept a draft x with probability min(1, p(x) / q(x)), not p(x)"),
    Wrong("verify_sampled", "the first draft's target row for every draft",
          lambda p, d, q, g: sampled_with(p, d, q, g, accept_row=0, resample_row=0),
          "The acceptance rule is wrong: draft i is judged by row i of target_probs"),
    Wrong("verify_sampled", "row 0 for the acceptance test only",
          lambda p, d, q, g: sampled_with(p, d, q, g, accept_row=0),
          "The acceptance rule is wrong: draft i is judged by row i of target_probs"),
    Wrong("verify_sampled", "row 0 for the replacement only",
          lambda p, d, q, g: sampled_with(p, d, q, g, resample_row=0),
          "The replacement step is wrong: the replacement for draft i comes from row i"),
    Wrong("verify_sampled", "one uniform draw for all the drafts",
          lambda p, d, q, g: sampled_with(p, d, q, g, one_uniform=True),
          "The acceptance rule is wrong: one uniform number was drawn for all the drafts"),
    Wrong("verify_sampled", "accepts with q(x) / p(x)", lambda p, d, q, g: sampled_with(p, d, q, g, rule="inverse"),
          "always rejected"),
    Wrong("verify_sampled", "resamples from p", lambda p, d, q, g: sampled_with(p, d, q, g, resample="p"),
          "The replacement step is wrong: draw from normalize(max(0, p - q)), not from p"),
    Wrong("verify_sampled", "resamples from q", lambda p, d, q, g: sampled_with(p, d, q, g, resample="q"),
          "always rejected"),
    Wrong("verify_sampled", "no bonus token", lambda p, d, q, g: sampled_with(p, d, q, g, bonus=False),
          "the bonus token"),
    Wrong("verify_sampled", "builds the residual in target_probs", sampled_residual_in_place,
          "verify_sampled changed its arguments"),
    Wrong("verify_sampled", "calls labkit's verify_sampled", lambda p, d, q, g: labkit_verify_sampled(p, d, q, g),
          "`verify_sampled`", calls="labkit.engine.speculative.verify_sampled"),
    Wrong("best_k", "forgets the bonus token", lambda a, c, m: best_k_with(a, c, m, n_of=lambda k: k),
          "k + 1 tokens (the bonus)"),
    Wrong("best_k", "a free drafter", lambda a, c, m: best_k_with(a, c, m, cost_of=lambda k, c: 1.0),
          "the drafter is not free"),
    Wrong("best_k", "k + 1 drafter runs", lambda a, c, m: best_k_with(a, c, m, cost_of=lambda k, c: 1 + (k + 1) * c),
          "runs k times"),
    Wrong("best_k", "divides by 1 - alpha at alpha = 1", best_k_divides_by_zero, "divided by zero"),
    Wrong("best_k", "searches from k = 0", best_k_from_zero, "k = 0 is no speculation"),
    Wrong("verify_sampled", "torch's global random numbers", sampled_global_rng, "seeded alike gave different tokens"),
    Wrong("verify_sampled", "a generator of its own", sampled_own_seed, "seeded differently gave the same tokens"),
    Wrong("verify_sampled", "a deterministic drafter taken as q = p", sampled_q_is_p, "q is one-hot on the draft"),
    Wrong("best_k", "the largest k on a tie", best_k_largest_on_a_tie, "on a tie return the smallest k"),
    Wrong("best_k", "calls the grader's reference", lambda a, c, m: reference_best_k(a, c, m), "`reference_best_k`",
          calls="labkit_course.grading.labs.lab14.reference_best_k"),
]
