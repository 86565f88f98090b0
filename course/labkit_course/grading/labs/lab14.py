"""Lab 14: speculative decoding. Prompt-lookup drafting, greedy verification of k drafts, rejection
sampling that keeps the target's distribution, and the choice of k from the acceptance rate."""

import math

import torch

from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.core import seeded_generator, seeded_random

_SPEC = "labkit.engine.speculative."


def _unchanged(name: str, same: bool, what: str) -> None:
    if not same:
        raise ExerciseFailed(f"{name} changed its arguments: {what}; leave them as they are (work on a copy)")


# ---- exercise 1: prompt lookup ---------------------------------------------------------------
def reference_propose_ngram(token_ids, k, max_n, *, no_overlap=False, latest=False, shortest_first=False,
                            include_match=False, unclipped=False, no_fallback=False):
    """labkit's `ngram_lookup` with min_n = 1; each keyword, set, makes one of _NGRAM_MISTAKES."""
    sizes = range(min(max_n, len(token_ids) - 1), 0, -1)
    if shortest_first:
        sizes = reversed(list(sizes))
    if no_fallback:
        sizes = [n for n in sizes if n == min(max_n, len(token_ids) - 1)]
    for n in sizes:
        tail = token_ids[-n:]
        last = len(token_ids) - n - (n if no_overlap else 1)  # never the tail itself
        starts = range(last, -1, -1) if latest else range(last + 1)
        for start in starts:
            if token_ids[start:start + n] == tail:
                begin = start if include_match else start + n
                return token_ids[begin:] if unclipped else token_ids[begin:begin + k]
    return []


_NGRAM_CASES = [
    ([1, 2, 3, 9, 4, 1, 2, 3], 3, 3),
    ([5, 5, 5, 5, 5], 3, 2),
    ([1, 2, 3, 4, 5], 2, 3),
    ([7, 1, 8, 2, 9, 1], 4, 3),
    ([4, 2, 4, 3, 1, 2, 4, 2, 4], 2, 3),
    ([1, 2, 1, 2, 3, 1, 2], 5, 2),
    ([3], 2, 2),
    ([6, 6], 4, 3),
    ([1, 5, 5, 5], 2, 2),  # the only earlier 5 5 overlaps the tail: it counts
    ([2, 2, 2], 3, 3),
    ([3, 1, 2, 1, 2, 1, 2], 4, 4),
    ([1, 2, 1, 3, 1, 4, 1], 1, 1),  # three earlier matches: the first, even though later ones leave k tokens too
]
_NGRAM_MISTAKES = {  # reference_propose_ngram's keyword that re-creates the mistake: what that answer got wrong
    "no_overlap": "you searched only before the tail: an earlier occurrence may overlap the tail, only the tail's "
                  "own position is excluded (in x x x the bigram x x at position 0 counts)",
    "latest": "you took the latest earlier match; take the first one: it leaves the most tokens after it (in a run "
              "x x x x the latest match is followed by one token)",
    "shortest_first": "you tried short n-grams first: try the longest n-gram (max_n) first, a longer match predicts "
                      "better",
    "include_match": "you proposed the matched n-gram itself: the context already ends with it, propose the tokens "
                     "that followed it",
    "unclipped": "you returned every token after the match: propose at most k",
    "no_fallback": "no match of length max_n and you gave up: fall back to shorter n-grams, down to 1 (and only an "
                   "earlier occurrence counts, never the context's own tail)",
}


def _drawn_ngram_cases(rng, count):
    """Contexts no notebook can know ahead, from a few token ids so that n-grams recur; half end with a copy of
    an earlier stretch, the repetition prompt lookup feeds on."""
    cases = []
    for _ in range(count):
        vocab = rng.randint(2, 6)
        token_ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        if rng.random() < 0.5:
            start = rng.randrange(len(token_ids))
            token_ids += token_ids[start:start + rng.randint(1, 4)]
        cases.append((token_ids, rng.randint(1, 6), rng.randint(1, 4)))
    return cases


@exercise("14", "propose_ngram", forbidden=(_SPEC + "ngram_lookup", _SPEC + "NgramDrafter.propose",
                                            "labkit_course.grading.labs.lab14.reference_propose_ngram"))
def propose_ngram(ns):
    fn = require(ns, "propose_ngram")
    for token_ids, k, max_n in _NGRAM_CASES + _drawn_ngram_cases(seeded_random(1401), 8):
        given = list(token_ids)
        got = fn(given, k, max_n)
        _unchanged("propose_ngram", given == token_ids, "token_ids is the sequence's own token list")
        if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
            raise ExerciseFailed(f"return a list of token ids (ints), got {type(got).__name__}")
        want = reference_propose_ngram(token_ids, k, max_n)
        if got != want:
            for mistake, why in _NGRAM_MISTAKES.items():
                if got == reference_propose_ngram(token_ids, k, max_n, **{mistake: True}):
                    raise ExerciseFailed(f"propose_ngram({token_ids}, k={k}, max_n={max_n}) gave {got}: {why}")
            raise ExerciseFailed(f"propose_ngram({token_ids}, k={k}, max_n={max_n}) gave {got}, expected {want}")
    return "the first earlier match of the longest recurring n-gram, at most k tokens"


# ---- exercise 2: greedy verification ---------------------------------------------------------
def reference_verify_greedy(logits, draft, *, no_bonus=False, keeps_going=False, no_correction=False,
                            shifted=False):
    """labkit's `verify_greedy`; each keyword, set, makes one of _GREEDY_MISTAKES."""
    choices = logits.argmax(-1).tolist()
    out = []
    for i, guess in enumerate(draft):
        if guess != choices[min(i + 1, len(choices) - 1) if shifted else i]:
            if keeps_going:
                continue
            return out + ([] if no_correction else [choices[i]])
        out.append(guess)
    return out + ([] if no_bonus else [choices[len(draft)]])


_GREEDY_MISTAKES = {  # reference_verify_greedy's keyword that re-creates the mistake: what that answer got wrong
    "no_bonus": "all k drafts matched and you stopped: the last row predicts one more token, the bonus",
    "keeps_going": "you kept drafts after a mismatch: once a draft is wrong, every later row was computed on a wrong "
                   "context; stop at the first mismatch",
    "no_correction": "at the first mismatch you returned nothing new: the target's own choice at that row is a "
                     "correct token, keep it",
    "shifted": "row i of the logits predicts the token at draft position i (it reads the context up to draft i - 1), "
               "not draft i + 1",
}


@exercise("14", "verify_greedy", forbidden=(_SPEC + "verify_greedy",
                                            "labkit_course.grading.labs.lab14.reference_verify_greedy"))
def verify_greedy(ns):
    fn = require(ns, "verify_greedy")
    g = seeded_generator(1414)
    vocab = 7
    for k, agree in [(3, 3), (3, 1), (4, 0), (1, 1), (0, 0), (5, 2), (2, 2)]:
        logits = torch.randn(k + 1, vocab, generator=g)
        for i in range(1, k + 1):  # consecutive rows choose different tokens: judging by the next row always shows
            logits[i, logits[i - 1].argmax()] = logits[i].min() - 1
        choices = logits.argmax(-1).tolist()
        draft = [choices[i] if i < agree else (choices[i] + 1) % vocab for i in range(k)]
        if agree < k - 1:  # a later draft that happens to match: only the first mismatch counts
            draft[-1] = choices[k - 1]
        given = logits.clone(), list(draft)
        got = fn(*given)
        _unchanged("verify_greedy", torch.equal(given[0], logits) and given[1] == draft,
                   "target_logits and draft are the engine's own, it rolls back the rejected drafts afterwards")
        want = reference_verify_greedy(logits, draft)
        if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
            raise ExerciseFailed(f"return a list of token ids (ints), got {type(got).__name__}")
        if got != want:
            for mistake, why in _GREEDY_MISTAKES.items():
                if got == reference_verify_greedy(logits, draft, **{mistake: True}):
                    raise ExerciseFailed(f"draft {draft} against argmaxes {choices} gave {got}: {why}")
            raise ExerciseFailed(f"draft {draft} against argmaxes {choices} gave {got}, expected {want}")
    return "accepted prefix, then the correction or the bonus token"


# ---- exercise 3: rejection sampling ----------------------------------------------------------
# Graded, the draws differ for every notebook, so a right answer must fail by chance almost never: about 50
# tests a grading, each at 1e-7. Upper 1 - 1e-7 quantiles of chi-square with 1..4 degrees of freedom:
CHI2_LIMIT = {1: 28.37, 2: 32.24, 3: 35.41, 4: 38.24}
Z_LIMIT = 5.5  # an acceptance count this many standard deviations off its expectation is not chance (4e-8)

# (target_probs [k + 1, 5], draft_probs [k, 5] or None, how drafts are drawn [k, 5], trials). Rows differ, so
# a draft judged by the wrong row is accepted at the wrong rate; each case reaches every position often.
_SAMPLED_CASES = (
    (torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.2, 0.2, 0.2]]),
     torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2]]), None, 1500),
    (torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.2, 0.2, 0.2]]), None,
     torch.full((1, 5), 0.2), 1500),
    (torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.05, 0.05, 0.1, 0.2, 0.6], [0.25, 0.05, 0.3, 0.1, 0.3]]),
     torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2], [0.1, 0.2, 0.4, 0.2, 0.1]]), None, 3000),
    (torch.tensor([[0.7, 0.1, 0.1, 0.05, 0.05], [0.1, 0.7, 0.05, 0.1, 0.05], [0.05, 0.1, 0.7, 0.1, 0.05],
                   [0.3, 0.2, 0.1, 0.2, 0.2]]), None,
     torch.tensor([[0.7, 0.1, 0.1, 0.05, 0.05], [0.1, 0.7, 0.05, 0.1, 0.05], [0.05, 0.1, 0.7, 0.1, 0.05]]), 2000),
)


def _as_tokens(got, what: str) -> list[int]:
    if not isinstance(got, list) or not got or not all(isinstance(t, int) for t in got):
        raise ExerciseFailed(f"{what}: return the list of emitted token ids (at least one), got {got!r}")
    return got


def _q_row(draft_probs, i: int, x: int, vocab: int) -> torch.Tensor:
    """Draft i's q: the draft model's row, or one-hot on the draft for a deterministic drafter."""
    return draft_probs[i] if draft_probs is not None else torch.eye(vocab)[x]


def _ratio(p_row, q_row, x) -> float:
    return min(1.0, float(p_row[x] / q_row[x]))


def _shared_uniform(ratios, i) -> float:
    """P(u < r_i | u < r_0, ..., u < r_(i-1)) for one uniform u shared by all drafts."""
    reached = min(ratios[:i], default=1.0)
    return min(reached, ratios[i]) / reached


# The chance that draft i is accepted, given drafts 0..i-1 were: the right rule first, then typical wrong ones.
# Each takes (target_probs, q of (position, token), draft, i, the right min(1, p/q) of every draft).
_ACCEPTANCE_RULES = {
    None: lambda p, q, draft, i, ratios: ratios[i],
    "accept a draft x with probability min(1, p(x) / q(x)), not p(x)":
        lambda p, q, draft, i, ratios: float(p[i][draft[i]]),
    "draft i is judged by row i of target_probs, not row 0 for every draft":
        lambda p, q, draft, i, ratios: _ratio(p[0], q(i, draft[i]), draft[i]),
    "one uniform number was drawn for all the drafts: draw a fresh one per draft, or a draft that follows an "
    "accepted one is accepted more often than min(1, p/q)": lambda p, q, draft, i, ratios: _shared_uniform(ratios, i),
}
# What a rejection at position i is drawn from (unnormalized): the residual first, then typical wrong ones.
_REPLACEMENTS = {
    None: lambda p, q_row, i: torch.clamp(p[i] - q_row, min=0),
    "draw from normalize(max(0, p - q)), not from p": lambda p, q_row, i: p[i],
    "draw from normalize(max(0, p - q)), not from q": lambda p, q_row, i: q_row,
    "the replacement for draft i comes from row i of target_probs, not row 0":
        lambda p, q_row, i: torch.clamp(p[0] - q_row, min=0),
}


def _fits(counts: torch.Tensor, expected: torch.Tensor) -> bool:
    """Pearson's chi-square test at 0.999 over the tokens `expected` can give; any other token fails."""
    live = expected > 0
    if (counts[~live] > 0).any():
        return False
    dof = int(live.sum()) - 1
    return dof < 1 or float(((counts[live] - expected[live]) ** 2 / expected[live]).sum()) <= CHI2_LIMIT[dof]


def _worst_acceptance(trials, p, q, i: int, rule) -> tuple[float, int, int, int, float]:
    """Over the draft values at position i: the largest |z| of the acceptance count against `rule`,
    with that value's (token, tries, acceptances, expected acceptances)."""
    worst = (0.0, -1, 0, 0, 0.0)
    for x in range(p.shape[1]):
        reached = [(draft, ratios, accepted) for draft, ratios, accepted in trials
                   if accepted >= i and draft[i] == x]
        chances = [rule(p, q, draft, i, ratios) for draft, ratios, _ in reached]
        hits = sum(accepted > i for _, _, accepted in reached)
        mean, var = sum(chances), sum(c * (1 - c) for c in chances)
        z = abs(hits - mean) / math.sqrt(var) if var > 0 else (0.0 if abs(hits - mean) < 0.5 else math.inf)
        if z > worst[0]:
            worst = (z, x, len(reached), hits, mean)
    return worst


def _run_sampled(fn, g, drafts_from, p, draft_probs, draft_dist, trials):
    """The student's verify_sampled, given `g`, on `trials` fresh drafts drawn from `drafts_from` (the
    student may reseed `g`: it must not choose the drafts): per trial (draft, right ratios, drafts accepted),
    and the counts of the token emitted after a rejection at each position (row k: the bonus tokens)."""
    k, vocab = p.shape[0] - 1, p.shape[1]
    sampler = draft_probs if draft_probs is not None else draft_dist
    records, after = [], torch.zeros(k + 1, vocab)
    for _ in range(trials):
        draft = [int(torch.multinomial(sampler[i], 1, generator=drafts_from)) for i in range(k)]
        given = p.clone(), list(draft), None if draft_probs is None else draft_probs.clone()
        tokens = _as_tokens(fn(*given, g), f"drafts {draft}")
        _unchanged("verify_sampled", torch.equal(given[0], p) and given[1] == draft
                   and (draft_probs is None or torch.equal(given[2], draft_probs)),
                   "target_probs, draft and draft_probs are the engine's own, it rolls back the rejected drafts "
                   "afterwards")
        if not all(0 <= t < vocab for t in tokens):
            raise ExerciseFailed(f"drafts {draft} gave {tokens}: token ids are rows' indices, 0..{vocab - 1}")
        # drafts accepted: the common prefix, less the last token when every token is a draft (a replacement
        # that equals its draft, which the residual never draws)
        accepted = next((i for i, (t, d) in enumerate(zip(tokens, draft, strict=False)) if t != d),
                        min(len(tokens) - 1, k))
        if len(tokens) != accepted + 1:
            raise ExerciseFailed(f"drafts {draft} gave {tokens}: the step ends at the first rejection (one "
                                 "replacement token, nothing after it), and k drafts give at most k + 1 tokens")
        records.append((draft, [_ratio(p[i], _q_row(draft_probs, i, draft[i], vocab), draft[i]) for i in range(k)],
                        accepted))
        after[accepted, tokens[accepted]] += 1
    return records, after


def _check_acceptance(label, records, p, q, k):
    """Each draft's acceptance count against min(1, p_i(x) / q_i(x)), naming a wrong rule that fits."""
    right, *wrong = _ACCEPTANCE_RULES.items()
    for i in range(k):
        z, x, tries, hits, mean = _worst_acceptance(records, p, q, i, right[1])
        if z <= Z_LIMIT:
            continue
        seen = f"{label}: draft {i} = token {x} was accepted {hits} times in {tries}, min(1, p/q) expects {mean:.0f}"
        for why, rule in wrong:
            if _worst_acceptance(records, p, q, i, rule)[0] <= Z_LIMIT:
                raise ExerciseFailed(f"{seen}. The acceptance rule is wrong: {why}")
        raise ExerciseFailed(f"{seen}. The acceptance rule is wrong: accept draft i with probability "
                             "min(1, p_i(x) / q_i(x)), on its own uniform number")


def _check_replacements(label, records, after, p, q, k):
    """The tokens drawn after a rejection at each position, and the bonus tokens, against their distributions."""
    right, *wrong = _REPLACEMENTS.items()
    for i in range(k):
        rejected = [draft[i] for draft, _, accepted in records if accepted == i]
        if not rejected:
            continue

        def expected(rule, rejected=rejected, i=i):
            rows = [rule[1](p, q(i, x), i) for x in rejected]
            return sum(row / row.sum() for row in rows)
        if _fits(after[i], expected(right)):
            continue
        seen = f"{label}: after rejecting draft {i} the tokens drawn were {after[i].int().tolist()}"
        why = next((why for why, rule in wrong if _fits(after[i], expected((why, rule)))),
                   "draw from normalize(max(0, p_i - q_i)), the rejected draft's own row")
        raise ExerciseFailed(f"{seen}. The replacement step is wrong: {why}")
    bonus = after[k]
    if bonus.sum() and not _fits(bonus, p[k] * bonus.sum()):
        raise ExerciseFailed(f"{label}: the bonus tokens {bonus.int().tolist()} do not follow the last row "
                             f"{p[k].tolist()}: after all k drafts are accepted, draw from target_probs[k]")


def _draws(fn, seed: int) -> list:
    """What the student's verify_sampled emits over a run of calls that share one generator seeded `seed`."""
    g = seeded_generator(seed)
    p, q, _, _ = _SAMPLED_CASES[2]
    return [fn(p.clone(), [0, 4], q.clone(), g) for _ in range(24)]


def _reproducible(fn) -> None:
    """Every random number must come from the generator: the same seed gives the same tokens, another seed others."""
    if _draws(fn, 7) != _draws(fn, 7):
        raise ExerciseFailed("two runs with generators seeded alike gave different tokens: draw every random number "
                             "from the generator you are given (torch.rand(..., generator=generator), "
                             "torch.multinomial(..., generator=generator)), not from torch's global one")
    if _draws(fn, 7) == _draws(fn, 8):
        raise ExerciseFailed("generators seeded differently gave the same tokens: draw every random number from the "
                             "generator you are given, not from a source you seed yourself")


@exercise("14", "verify_sampled", forbidden=(_SPEC + "verify_sampled",))
def verify_sampled(ns):
    fn = require(ns, "verify_sampled")
    g = seeded_generator(14)
    # Certain cases first: p(x) >= q(x) always accepts; p(x) = 0 never does.
    certain = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for _ in range(5):
        if _as_tokens(fn(certain.clone(), [1], None, g), "p = one-hot on the draft") != [1, 0]:
            raise ExerciseFailed("the target gives the draft probability 1: accept it (min(1, p/q) = 1), then draw "
                                 "the bonus token from the last row")
        try:
            got = _as_tokens(fn(certain.clone(), [2], None, g), "p(draft) = 0")
        except ExerciseFailed:
            raise
        except Exception as error:  # noqa: BLE001 - q = p makes the residual all zeros, which multinomial refuses
            raise ExerciseFailed(f"draft_probs None, a draft the target gives probability 0: your code raised "
                                 f"{raised_type(error)}. None means a deterministic drafter: q is one-hot on the "
                                 "draft (q(x) = 1), not p, so the residual max(0, p - q) is p without the draft "
                                 "token") from None
        if got != [1]:
            raise ExerciseFailed(f"the target gives the draft probability 0, so it is always rejected and the "
                                 f"replacement comes from max(0, p - q), which is token 1; got {got}")
    _reproducible(fn)
    # Then statistics, position by position: how often each draft is accepted (the acceptance rule), and
    # what is drawn after a rejection (the replacement), two separate diagnoses.
    drafts_from = seeded_generator(141)
    for p, draft_probs, draft_dist, trials in _SAMPLED_CASES:
        k, vocab = p.shape[0] - 1, p.shape[1]
        label = f"{k} draft{'s' if k > 1 else ''} " + ("with a draft model's q" if draft_probs is not None
                                                       else "from a deterministic drafter (q one-hot)")

        def q(i, x, draft_probs=draft_probs, vocab=vocab):
            return _q_row(draft_probs, i, x, vocab)
        records, after = _run_sampled(fn, g, drafts_from, p, draft_probs, draft_dist, trials)
        _check_acceptance(label, records, p, q, k)
        _check_replacements(label, records, after, p, q, k)
    return "each draft i accepted with min(1, p_i/q_i) on its own draw; a rejection resampled from max(0, p_i - q_i)"


# ---- exercise 4: choosing k ------------------------------------------------------------------
def reference_best_k(alpha, draft_cost, max_k, *, off_by_one=False, no_cost=False, cost_k1=False, start=1):
    best = None
    for k in range(start, max_k + 1):
        n = k if off_by_one else k + 1
        tokens = float(n) if alpha == 1 else (1 - alpha ** n) / (1 - alpha)
        cost = 1.0 if no_cost else 1 + (k + 1 if cost_k1 else k) * draft_cost
        speedup = tokens / cost
        if best is None or speedup > best[1] + 1e-12:
            best = (k, speedup)
    return best


_K_CASES = [(0.8, 0.05, 8), (0.5, 0.1, 6), (0.9, 0.02, 10), (1.0, 0.1, 5), (0.0, 0.1, 4), (0.7, 0.3, 6),
            (0.95, 0.0, 3), (0.0, 0.0, 4), (1.0, 1.0, 3)]  # the last two: every k ties
_K_MISTAKES = {  # reference_best_k's keyword that re-creates the mistake: what that answer got wrong
    "off_by_one": "k drafts give up to k + 1 tokens (the bonus): E = (1 - alpha^(k+1)) / (1 - alpha)",
    "no_cost": "the drafter is not free: a step costs 1 + k * draft_cost target forwards",
    "cost_k1": "the drafter runs k times (one per draft), not k + 1: cost 1 + k * draft_cost",
}


@exercise("14", "best_k", forbidden=("labkit_course.grading.labs.lab14.reference_best_k",))
def best_k(ns):
    fn = require(ns, "best_k")
    rng = seeded_random(1402)  # then rates and costs no notebook can know ahead
    drawn = [(rng.uniform(0.3, 0.99), rng.uniform(0.005, 0.4), rng.randint(2, 12)) for _ in range(5)]
    for alpha, cost, max_k in _K_CASES + drawn:
        try:
            got = fn(alpha, cost, max_k)
        except ZeroDivisionError:
            raise ExerciseFailed(f"best_k({alpha}, {cost}, {max_k}) divided by zero: with alpha = 1 every draft "
                                 "is accepted and a step yields k + 1 tokens") from None
        if not isinstance(got, tuple | list) or len(got) != 2:
            raise ExerciseFailed(f"return (k, speed-up), got {got!r}")
        k, speedup = got
        want_k, want_speedup = reference_best_k(alpha, cost, max_k)
        if k == want_k and math.isclose(float(speedup), want_speedup, rel_tol=1e-6):
            continue
        if k == 0:
            raise ExerciseFailed("k = 0 is no speculation; search k from 1 to max_k")
        if k > want_k and math.isclose(float(speedup), want_speedup, rel_tol=1e-6):
            raise ExerciseFailed(f"best_k({alpha}, {cost}, {max_k}) gave {got}: k = {want_k} reaches the same "
                                 "speed-up; on a tie return the smallest k (fewer drafts to compute and throw away)")
        for mistake, why in _K_MISTAKES.items():  # on _K_CASES none gives k = 0, or the same speed-up at a larger k
            wk, ws = reference_best_k(alpha, cost, max_k, **{mistake: True})
            if k == wk and math.isclose(float(speedup), ws, rel_tol=1e-6):
                raise ExerciseFailed(f"best_k({alpha}, {cost}, {max_k}) gave {got}: {why}")
        raise ExerciseFailed(f"best_k({alpha}, {cost}, {max_k}) gave {got}, expected ({want_k}, {want_speedup:.4f})")
    return "expected tokens (1 - alpha^(k+1)) / (1 - alpha) over cost 1 + k c, maximised over k"


@exercise("14", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    return grade_answers(ns, {
        1: Number(round((1 - 0.8 ** 5) / (1 - 0.8), 2), "'How many tokens a step yields'", rel_tol=0.01),
        2: Number(1, "'Verifying k drafts in one forward'"),
        3: Choice("c", "'Greedy: the same tokens, fewer forwards'"),
        4: Choice("a", "'Sampling: rejection keeps p'"),
        5: Choice("b", "'Measuring it: repetitive and open text'"),
    })
