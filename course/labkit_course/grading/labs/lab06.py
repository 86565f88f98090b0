"""Lab 06: temperature, top-k, top-p, and greedy vs sampled, graded against labkit.sampling."""

import torch

from labkit.sampling import apply_penalties as ref_apply_penalties
from labkit.sampling import filter_logits
from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.core import seeded_generator
from labkit_course.grading.remote import RemoteError


def _logits(seed: int, rows: int = 4, vocab: int = 12) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=seeded_generator(seed)) * 2


def _call_without_mutation(fn, logits, *args):
    """Call the student's function on a copy and fail if it wrote into its input."""
    given = logits.clone()
    got = fn(given, *args)
    if not torch.equal(given, logits):
        raise ExerciseFailed("your function changed its input logits in place: work on a copy "
                             "(the engine may still need the raw logits, e.g. for logprobs)")
    if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ExerciseFailed(f"expected a tensor of shape {tuple(logits.shape)}, got {shape}")
    if got.dtype != logits.dtype:
        raise ExerciseFailed(f"returned {got.dtype} for {logits.dtype} logits: keep the logits' dtype (the engine "
                             "samples from what you return; a float64 copy doubles its memory)")
    return got


def _filter(fn, logits, arg):
    """The student's filter on `logits` ([vocab] or [batch, vocab]); an error names the shape it failed on."""
    try:
        return _call_without_mutation(fn, logits, arg)
    except Exception as error:
        if raised_type(error) not in ("RuntimeError", "IndexError", "ValueError", "TypeError"):
            raise
        shape = "one row [vocab] (as this lab's own cells call it)" if logits.dim() == 1 else "a batch [batch, vocab]"
        raise ExerciseFailed(f"on {shape}, your function raised {raised_type(error)}: the filters take [vocab] and "
                             "[batch, vocab] alike, so work along the last dimension (dim=-1, [..., -1:])") from None


def _reference(logits, **setting):
    """labkit's filter on [vocab] or [batch, vocab]."""
    return filter_logits(logits[None], **setting)[0] if logits.dim() == 1 else filter_logits(logits, **setting)


def _filter_cases(fn, name, settings, seed, row):
    """(logits, setting, the student's filter, labkit's) on a batch of logits, then on one of its rows: a filter
    takes [batch, vocab] and [vocab] alike."""
    batch = _logits(seed)
    for logits in (batch, batch[row]):
        for setting in settings:
            yield logits, setting, _filter(fn, logits, setting), _reference(logits, **{name: setting})


def _kept(logits: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits)


SEEDED_DRAWS = 100  # seeds per temperature compared with torch.multinomial's draws
_FILTER_LOGITS = ("labkit.sampling.filter_logits", "labkit.sampling.filters.filter_logits")
_WARPERS = "transformers.generation.logits_process."
_SAMPLER = ("labkit.sampling.Sampler.__call__", "labkit.sampling.Sampler.draw", "labkit.sampling.sampler.gumbel_max",
            "labkit.sampling.sampler.gumbel_scores")


def _per_row_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The reference: each row's own softmax(logits / T), and a one-hot argmax where T = 0."""
    return torch.stack([filter_logits(row[None], temperature=float(t)).softmax(-1)[0] if t == 0
                        else (row / t).softmax(-1) for row, t in zip(logits, temperatures, strict=True)])


@exercise("06", "temperature_probs", forbidden=(*_FILTER_LOGITS, "labkit.sampling.filters.apply_temperature",
                                                "labkit.sampling.filters.keep_argmax"))
def temperature_probs(ns):
    fn = require(ns, "temperature_probs")
    square, wide = _logits(1, rows=4, vocab=4), _logits(1)
    cases = [  # (logits, per-row temperatures); the square batch shows a division along the wrong axis
        (square, torch.tensor([0.5, 1.0, 2.0, 1.5])),
        (wide, torch.tensor([0.5, 1.0, 2.0, 1.5])),
        (wide, torch.tensor([0.7, 0.0, 1.3, 0.0])),
        (wide, torch.tensor([0.0, 0.0, 0.0, 0.0])),
    ]
    tied = torch.tensor([[1.0, 1.0, 0.0], [3.0, 2.999, 0.0], [0.0, 2.0, 2.0]])
    cases.append((tied, torch.tensor([0.0, 0.0, 0.0])))  # greedy with a tie and a near tie at the maximum
    for logits, temperatures in cases:
        greedy_rows = temperatures == 0
        given = temperatures.clone()
        try:
            got = _call_without_mutation(fn, logits, given)
        except NotImplementedError:
            raise
        except (RuntimeError, ZeroDivisionError, TypeError, ValueError, IndexError, RemoteError) as error:
            what = "a temperature of 0 (dividing by 0)" if greedy_rows.any() else "per-row temperatures"
            raise ExerciseFailed(f"raised {type(error).__name__} on {what}: `temperatures` is one value per row "
                                 "([batch]); divide by temperatures[:, None], and treat T = 0 rows as greedy") from None
        if not torch.equal(given, temperatures):
            raise ExerciseFailed("your function changed the temperatures it was given: the engine still reads them "
                                 "(which rows are greedy); work on a copy")
        expected = _per_row_temperature(logits, temperatures)
        if torch.allclose(got, expected, atol=1e-6):
            continue
        sampled = ~greedy_rows
        if not greedy_rows.any():
            by_column = (logits / temperatures[None, :]).softmax(-1)
            if torch.allclose(got, by_column, atol=1e-6):
                raise ExerciseFailed("temperatures divided the columns, not the rows: temperature b belongs to row b "
                                     "(temperatures[:, None] broadcasts along the row)")
            if torch.allclose(got, (logits / temperatures[0]).softmax(-1), atol=1e-6):
                raise ExerciseFailed("every row used the first row's temperature: each request brings its own")
            if torch.allclose(got, (logits * temperatures[:, None]).softmax(-1), atol=1e-6):
                raise ExerciseFailed("you multiplied the logits by the temperature: divide them "
                                     "(a low temperature must sharpen the distribution)")
            if torch.allclose(got, logits.softmax(-1), atol=1e-6):
                raise ExerciseFailed("the temperature has no effect: divide the logits by it before the softmax")
            if torch.allclose(got, logits.softmax(-1) / temperatures[:, None], atol=1e-6):
                raise ExerciseFailed("the probabilities were divided by the temperature: divide the logits, "
                                     "then take the softmax")
            if not torch.allclose(got.sum(-1), torch.ones(len(logits)), atol=1e-5):
                raise ExerciseFailed("each row must be a probability distribution (sum to 1 over the last dimension)")
            raise ExerciseFailed("the probabilities differ from softmax(logits / temperature) row by row")
        if torch.isnan(got).any():
            raise ExerciseFailed("a temperature-0 row gives NaN (0/0 after dividing by 0): treat it as greedy, "
                                 "all the probability on the argmax")
        if logits is tied:
            raise ExerciseFailed(_tie_mistake(got, logits))
        if sampled.any() and torch.allclose(got[sampled], expected[sampled], atol=1e-6):
            raise ExerciseFailed("the rows with T > 0 are right, the T = 0 rows are not: put probability 1 on each "
                                 "such row's argmax and 0 elsewhere")
        if sampled.any() and torch.equal(got, filter_logits(logits, temperature=0).softmax(-1)):
            raise ExerciseFailed("every row became greedy because some request asked for T = 0: decide per row")
        raise ExerciseFailed(f"with temperatures {temperatures.tolist()} the rows differ from softmax(logits / T) "
                             "(one-hot argmax where T = 0)")
    half, temperatures = wide.bfloat16(), torch.tensor([0.7, 0.0, 1.3, 0.0], dtype=torch.bfloat16)
    got = _call_without_mutation(fn, half, temperatures)  # an engine's logits are bf16: they stay bf16
    if not torch.allclose(got.float(), _per_row_temperature(half.float(), temperatures.float()), atol=1e-2):
        raise ExerciseFailed("on bfloat16 logits the rows differ from softmax(logits / T) (one-hot argmax where T = 0)")
    return "each row's own softmax(logits / T), and T = 0 rows are greedy"


def _tie_mistake(got: torch.Tensor, logits: torch.Tensor) -> str:
    """Name what a temperature-0 row did with [1, 1, 0] (a tie), [3, 2.999, 0] (a near tie) and [0, 2, 2]."""
    rows = [[round(float(x), 2) for x in row] for row in got]
    if not torch.allclose(got.sum(-1), torch.ones(len(got)), atol=1e-5):
        return (f"at T = 0, logits {logits.tolist()} gave {rows}: a row whose maximum is tied put probability 1 on "
                "every tied token, so it no longer sums to 1; greedy is one token, the first maximum (torch.argmax)")
    if float(got[1, 0]) < 0.99:
        return (f"at T = 0, logits [3, 2.999, 0] gave {rows[1]}, not [1, 0, 0]: a tiny temperature (a clamp) in "
                "place of 0 still leaves the runner-up its share; a T = 0 row is exactly one-hot on the argmax")
    return (f"at T = 0, logits [1, 1, 0] and [0, 2, 2] gave {rows[0]} and {rows[2]}: with a tie at the maximum, "
            "greedy still picks one token, the first of them (what torch.argmax returns), with probability 1")


@exercise("06", "top_k_filter", forbidden=(*_FILTER_LOGITS, "labkit.sampling.filters.apply_top_k",
                                        "labkit_course.engine_parts.labkit_top_k_filter",
                                        _WARPERS + "TopKLogitsWarper.__call__"))
def top_k_filter(ns):
    fn = require(ns, "top_k_filter")
    for logits, k, got, expected in _filter_cases(fn, "top_k", (1, 3, 12), seed=2, row=1):
        if torch.equal(got, expected):
            continue  # what follows names the mistake of an answer that is wrong (some coincide on some logits)
        if (got == 0).any() and not (expected == 0).any():
            raise ExerciseFailed("removed tokens were set to 0, which is still a likely logit: set them to -inf")
        smallest = logits.masked_fill(~_kept(_reference(-logits, top_k=k)), float("-inf"))
        if k < logits.shape[-1] and torch.equal(got, smallest):
            raise ExerciseFailed(f"top_k={k} kept the k smallest logits: keep the k largest (topk's default)")
        kept = _kept(got).sum(-1)
        if (kept == k - 1).all() or (kept == k + 1).all():
            raise ExerciseFailed(f"top_k={k} kept {int(kept.flatten()[0])} tokens per row: an off-by-one at "
                                 "the k-th largest")
        for which, row in (("last", -1), ("first", 0)):
            threshold = logits.topk(k).values[row, -1] if logits.dim() == 2 else None
            if threshold is not None and torch.equal(got, logits.masked_fill(logits < threshold, float("-inf"))):
                raise ExerciseFailed(f"top_k={k}: every row was cut at the {which} row's k-th largest logit: each "
                                     "row has its own (topk(k, dim=-1).values[..., -1:])")
        raise ExerciseFailed(f"top_k={k}: each row must keep its k largest logits unchanged and set the rest to -inf")
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    if not torch.equal(_filter(fn, tied, 2), filter_logits(tied, top_k=2)):
        raise ExerciseFailed("with a tie at the k-th largest logit, keep every tied token "
                             "(compare with the k-th largest value, as transformers does)")
    return "keeps each row's k largest logits (ties included), the rest -inf, on [vocab] and [batch, vocab]"


def _unscattered(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, ...]:
    """What a top-p that never puts its sorted-order mask back in vocabulary order returns."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    remove = probs.cumsum(-1) - probs >= top_p
    inf = float("-inf")
    return (logits.masked_fill(remove, inf), logits.masked_fill(remove.gather(-1, order), inf),
            sorted_logits.masked_fill(remove, inf), probs.masked_fill(remove, 0.0), probs.masked_fill(remove, inf))


@exercise("06", "top_p_filter", forbidden=(*_FILTER_LOGITS, "labkit.sampling.filters.apply_top_p",
                                        "labkit_course.engine_parts.labkit_top_p_filter",
                                        _WARPERS + "TopPLogitsWarper.__call__"))
def top_p_filter(ns):
    fn = require(ns, "top_p_filter")
    for logits, top_p, got, expected in _filter_cases(fn, "top_p", (0.3, 0.7, 0.95), seed=3, row=2):
        if torch.equal(got, expected):
            continue
        if any(torch.allclose(got, wrong, atol=1e-6) for wrong in _unscattered(logits, top_p)):
            raise ExerciseFailed(f"top_p={top_p}: the mask (or the result) was left in sorted order: sorting "
                                 "permutes the tokens, so put the mask back in vocabulary order with "
                                 "remove.scatter(-1, order, remove) before applying it to logits")
        if not _kept(got).any(-1).all():
            raise ExerciseFailed("a row lost every token: the most likely token must always survive")
        probs = logits.softmax(-1)
        kept_mass = torch.where(_kept(got), probs, 0).sum(-1)
        if (kept_mass < top_p - 1e-6).any():
            raise ExerciseFailed(f"top_p={top_p}: the kept tokens hold less than top_p of the probability; "
                                 "keep the token that crosses the threshold too")
        if not torch.equal(_kept(got), _kept(expected)):
            raise ExerciseFailed(f"top_p={top_p}: keep the smallest set of most likely tokens whose "
                                 "probability reaches top_p (sort descending, cumulative sum)")
        raise ExerciseFailed("the kept logits must be returned unchanged (and the removed ones set to -inf)")
    boundary = torch.tensor([0.125, 0.5, 0.125, 0.25]).log()  # float32-exact: 0.5 + 0.25 is exactly 0.75
    kept = _kept(_filter(fn, boundary, 0.75)).nonzero().flatten().tolist()
    if kept != [1, 3]:
        raise ExerciseFailed(f"top_p=0.75 on probabilities 0.125, 0.5, 0.125, 0.25 kept tokens {kept}, not [1, 3]: "
                             "0.5 + 0.25 already reaches 0.75, so the smallest set is those two; remove a token "
                             "when the mass before it is >= top_p (reaches it, not only exceeds it)")
    return "keeps the smallest most-likely set reaching top_p, in vocabulary order, on [vocab] and [batch, vocab]"


@exercise("06", "sample_next", forbidden=(*_FILTER_LOGITS, *_SAMPLER, "labkit.sampling.filters.apply_temperature",
                                          "labkit.sampling.filters.keep_argmax"))
def sample_next(ns):
    fn = require(ns, "sample_next")
    logits = torch.tensor([1.5, 0.2, 1.0, -0.5, 0.8])
    given = logits.clone()
    first = fn(given, 0.7, seeded_generator(0))
    if not isinstance(first, int) or isinstance(first, bool):
        raise ExerciseFailed(f"return the token id as a Python int (use .item()), got {type(first).__name__}")
    if not torch.equal(given, logits):
        raise ExerciseFailed("sample_next changed its input logits in place: work on a copy")
    try:
        greedy = {fn(logits.clone(), 0.0, seeded_generator(seed)) for seed in range(20)}
    except Exception as error:
        raise ExerciseFailed(f"temperature 0 raised {type(error).__name__} (dividing by 0): at temperature 0 "
                             "return the argmax without sampling") from None
    if greedy != {int(logits.argmax())}:
        raise ExerciseFailed(f"temperature 0 must always return the argmax ({int(logits.argmax())}), got {greedy}")
    tied = torch.tensor([0.3, 1.5, 1.5, -0.5, 0.8])
    greedy = {fn(tied.clone(), 0.0, seeded_generator(seed)) for seed in range(20)}
    if greedy != {1}:
        raise ExerciseFailed(f"temperature 0 on logits {tied.tolist()} gave tokens {sorted(greedy)}, not always 1: "
                             "temperature 0 is the argmax (torch.argmax, the first maximum), not a draw at a tiny "
                             "temperature")
    draws = [fn(logits.clone(), 1.0, seeded_generator(seed)) for seed in range(3000)]
    if len(set(draws)) == 1:
        raise ExerciseFailed("at temperature 1 every draw is the same token: sample (torch.multinomial) "
                             "instead of taking the argmax")
    again = [fn(logits.clone(), 1.0, seeded_generator(seed)) for seed in range(60)]
    if again != draws[:60]:
        raise ExerciseFailed("the same seeded generator gave different tokens: the generator was ignored. "
                             "Pass generator=generator to torch.multinomial, so a seeded request reproduces")
    counts = torch.bincount(torch.tensor(draws), minlength=len(logits)).double()
    expected = logits.softmax(-1).double() * len(draws)
    statistic = float(((counts - expected) ** 2 / expected).sum())
    if statistic > 40.0:  # chi-square, 4 degrees of freedom: P(> 40) < 1e-7 when the draws are right
        raise ExerciseFailed(f"draw frequencies {(counts / len(draws)).tolist()} don't follow softmax(logits) "
                             f"{logits.softmax(-1).tolist()}: sample from the probabilities, not the logits")
    cold = [fn(logits.clone(), 0.3, seeded_generator(seed)) for seed in range(300)]
    if abs(cold.count(0) / 300 - float((logits / 0.3).softmax(-1)[0])) > 0.15:  # 6 standard deviations
        raise ExerciseFailed("at temperature 0.3 the draws should concentrate on the argmax: divide the "
                             "logits by the temperature before the softmax")

    def multinomial_draws(row, temperature):
        return [int(torch.multinomial((row / temperature).softmax(-1), 1, generator=seeded_generator(seed)))
                for seed in range(SEEDED_DRAWS)]

    def differ(a, b):  # a rounding difference may flip a rare draw
        return sum(x != y for x, y in zip(a, b, strict=True)) > 2

    for row, temperature in ((logits, 1.0), (logits, 0.7), (logits, 1.5), (logits / 10, 0.1)):
        seeded = [fn(row.clone(), temperature, seeded_generator(seed)) for seed in range(SEEDED_DRAWS)]
        wrong = differ(seeded, multinomial_draws(row, temperature))
        if set(seeded) == {int(row.argmax())}:
            raise ExerciseFailed(f"at temperature {temperature} every draw was the argmax: only T = 0 is greedy, "
                                 "a small T > 0 still samples from softmax(logits / T)")
        if wrong and temperature > 1 and not differ(seeded, multinomial_draws(row, 1.0)):
            raise ExerciseFailed(f"at temperature {temperature} the draws are those of T = 1: don't clamp the "
                                 "temperature, T > 1 flattens the distribution")
        if wrong:
            raise ExerciseFailed(f"at temperature {temperature}, seeds 0..{SEEDED_DRAWS - 1} gave other tokens than "
                                 "torch.multinomial(softmax(logits / T), 1, generator=generator): the exercise asks "
                                 "for that draw (a Gumbel-max or an inverse-CDF draw of your own follows the same "
                                 "distribution with other tokens per seed, so a seeded request would not reproduce)")
    return "greedy (the first argmax) at temperature 0, torch.multinomial's seeded draws from softmax(logits / T)"


def _padded(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long).view(len(rows), width)


def _penalized(logits, prompt_ids, output_ids, repetition, presence, frequency, *, divides_negatives=False,
               per_occurrence=False, repetition_output_only=False, counts_prompt=False, frequency_once=False,
               first_row=False, adds_presence=False, subtract_first=False, presence_counts=False, whole_row=False,
               pads_zero=False):
    """Each row's penalties applied with loops, the readable way; each keyword, set, makes one of
    _PENALTY_MISTAKES."""
    if pads_zero:  # a batched answer's histories padded to one width with token 0, then used as they are
        prompt_ids, output_ids = (_padded(ids).clamp(min=0).tolist() for ids in (prompt_ids, output_ids))
    out = logits.clone()
    for b, row in enumerate(out):
        r = 0 if first_row else b
        history = output_ids[b] if repetition_output_only else prompt_ids[b] + output_ids[b]
        generated = prompt_ids[b] + output_ids[b] if counts_prompt else output_ids[b]
        subtracted = {token: frequency[r] * (1 if frequency_once else generated.count(token))
                      - (1 if adds_presence else -1) * presence[r] * (generated.count(token) if presence_counts else 1)
                      for token in set(generated)}
        if subtract_first:
            row[list(subtracted)] -= torch.tensor(list(subtracted.values()), dtype=row.dtype)
        for token in range(len(row)) if whole_row else set(history):
            for _ in range(history.count(token) if per_occurrence else 1):
                row[token] = row[token] / repetition[r] if row[token] > 0 or divides_negatives \
                    else row[token] * repetition[r]
        if not subtract_first:
            row[list(subtracted)] -= torch.tensor(list(subtracted.values()), dtype=row.dtype)
    return out


_PENALTY_MISTAKES = {  # _penalized's keyword that re-creates the mistake: what that answer got wrong
    "divides_negatives": "a negative logit was divided by the penalty, which moves it toward 0 and makes the token "
                         "MORE likely: multiply negative logits, divide positive ones",
    "per_occurrence": "repetition_penalty was applied once per occurrence: it applies once to every distinct token "
                      "seen, however often",
    "repetition_output_only": "the prompt's tokens escaped repetition_penalty: it covers the prompt and the output "
                              "so far",
    "counts_prompt": "presence and frequency penalties counted the prompt's tokens: they count only generated (output) "
                     "tokens",
    "frequency_once": "frequency_penalty was subtracted once per token: it is subtracted once per occurrence (times "
                      "the count)",
    "adds_presence": "presence_penalty was added: subtract it, so that a positive penalty discourages",
    "first_row": "every row used the first row's penalties: each request brings its own",
    "presence_counts": "presence_penalty was subtracted once per occurrence: it is subtracted once from each generated "
                       "token, however often it was generated (the count is frequency_penalty's)",
    "whole_row": "repetition_penalty was applied to the whole row: it applies only to the tokens seen so far (prompt "
                 "and output)",
    "pads_zero": "the histories were padded with token 0, a real token id: rows that never saw token 0 penalized it; "
                 "pad with a value you mask out (or use each row's own list)",
    "subtract_first": "the penalties were applied in the wrong order: repetition_penalty first, on the raw logits (its "
                      "sign test reads them), then subtract frequency and presence",
}


@exercise("06", "apply_penalties", forbidden=("labkit.sampling.apply_penalties",
                                              "labkit.sampling.penalties.apply_penalties",
                                              "labkit.sampling.penalties.token_counts"))
def apply_penalties(ns):
    fn = require(ns, "apply_penalties")
    logits = _logits(6, rows=4, vocab=10)
    prompt_ids = [[1, 2, 2, 3], [4, 5], [1, 1, 7], [0, 9]]
    output_ids = [[3, 3, 6, 2], [5, 8, 8, 8], [], [9, 9, 4]]
    settings = [[1.3, 2.0, 1.0, 1.5], [0.5, 0.0, 0.0, 0.7], [0.2, 0.0, 0.4, 0.3]]  # repetition, presence, frequency
    want = ref_apply_penalties(logits, _padded(prompt_ids), _padded(output_ids),
                               *(torch.tensor(s) for s in settings))
    given = logits.clone()
    got = fn(given, [list(r) for r in prompt_ids], [list(r) for r in output_ids], *(list(s) for s in settings))
    if not torch.equal(given, logits):
        raise ExerciseFailed("your function changed its input logits in place: work on a copy "
                             "(the engine still needs the raw logits, e.g. for logprobs)")
    if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
        raise ExerciseFailed(f"expected a tensor of shape {tuple(logits.shape)}")
    if torch.allclose(got, want, atol=1e-5):
        return ("repetition first, on prompt + output (once per token, by sign); then presence and frequency on "
                "the output")
    for mistake, why in _PENALTY_MISTAKES.items():
        if torch.allclose(got, _penalized(logits, prompt_ids, output_ids, *settings, **{mistake: True}), atol=1e-5):
            raise ExerciseFailed(why)
    if torch.allclose(got, logits):
        raise ExerciseFailed("the logits came back unchanged: apply the penalties to the tokens each row has seen")
    row = int((got - want).abs().amax(-1).argmax())
    raise ExerciseFailed(f"row {row} differs from the expected penalized logits (max abs diff "
                         f"{(got - want).abs().max():.3g})")


@exercise("06", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    def kept(logits, **settings):
        return int(torch.isfinite(filter_logits(logits, **settings)).sum())

    return grade_answers(ns, {
        1: Number(kept(torch.tensor([0.4, 0.3, 0.2, 0.1]).log(), top_p=0.75), "section 4: the token that "
                  "crosses the threshold is kept"),
        2: Number(kept(torch.tensor([2.0, 1.0, 1.0, 0.0]), top_k=2), "Exercise 2: ties with the k-th largest"),
        3: Choice("a", "section 7 (a), on temperature 0"),
        4: Choice("b", "section 2, on temperature"),
        5: Choice("b", "the summary, on the order of the filters"),
    })
