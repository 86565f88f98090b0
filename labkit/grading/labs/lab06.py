"""Lab 06: temperature, top-k, top-p, and greedy vs sampled, graded against labkit.sampling."""

import torch

from labkit.grading import ExerciseFailed, exercise, require
from labkit.sampling import filter_logits


def _logits(seed: int, rows: int = 4, vocab: int = 12) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


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
    return got


def _kept(logits: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits)


_FILTER_LOGITS = ("labkit.sampling.filter_logits", "labkit.sampling.filters.filter_logits")
_SAMPLER = ("labkit.sampling.Sampler.__call__", "labkit.sampling.sampler.gumbel_max")


@exercise("06", "temperature_probs", forbidden=(*_FILTER_LOGITS, "labkit.sampling.filters.apply_temperature",
                                                "labkit.sampling.filters.keep_argmax"))
def temperature_probs(ns):
    fn = require(ns, "temperature_probs")
    logits = _logits(1)
    for temperature in (0.5, 1.0, 2.0):
        got = _call_without_mutation(fn, logits, temperature)
        expected = (logits / temperature).softmax(-1)
        if torch.allclose(got, (logits * temperature).softmax(-1), atol=1e-6) and temperature != 1.0:
            raise ExerciseFailed("you multiplied the logits by the temperature: divide them "
                                 "(a low temperature must sharpen the distribution)")
        if torch.allclose(got, logits.softmax(-1), atol=1e-6) and temperature != 1.0:
            raise ExerciseFailed("the temperature has no effect: divide the logits by it before the softmax")
        if temperature != 1.0 and torch.allclose(got, logits.softmax(-1) / temperature, atol=1e-6):
            raise ExerciseFailed("the probabilities were divided by the temperature: divide the logits, "
                                 "then take the softmax")
        if not torch.allclose(got.sum(-1), torch.ones(len(logits)), atol=1e-5):
            raise ExerciseFailed("each row must be a probability distribution (sum to 1 over the last dimension)")
        if not torch.allclose(got, expected, atol=1e-6):
            raise ExerciseFailed(f"at temperature {temperature} the probabilities differ from "
                                 "softmax(logits / temperature)")
    try:
        greedy = _call_without_mutation(fn, logits, 0.0)
    except ExerciseFailed:
        raise
    except Exception as error:
        raise ExerciseFailed(f"temperature 0 raised {type(error).__name__} (dividing by 0): treat it as greedy, "
                             "all the probability on the argmax") from None
    if torch.isnan(greedy).any():
        raise ExerciseFailed("temperature 0 gives NaN (0/0 after dividing by 0): treat it as greedy, "
                             "all the probability on the argmax")
    if not torch.equal(greedy, filter_logits(logits, temperature=0).softmax(-1)):
        raise ExerciseFailed("temperature 0 should put probability 1 on the argmax of each row and 0 elsewhere")
    return "softmax(logits / T), and T = 0 is greedy"


@exercise("06", "top_k_filter", forbidden=(*_FILTER_LOGITS, "labkit.sampling.filters.apply_top_k"))
def top_k_filter(ns):
    fn = require(ns, "top_k_filter")
    logits = _logits(2)
    for k in (1, 3, 12):
        got = _call_without_mutation(fn, logits, k)
        expected = filter_logits(logits, top_k=k)
        if (got == 0).any() and not (expected == 0).any():
            raise ExerciseFailed("removed tokens were set to 0, which is still a likely logit: set them to -inf")
        smallest = logits.masked_fill(~_kept(filter_logits(-logits, top_k=k)), float("-inf"))
        if k < logits.shape[-1] and torch.equal(got, smallest):
            raise ExerciseFailed(f"top_k={k} kept the k smallest logits: keep the k largest (topk's default)")
        kept = _kept(got).sum(-1)
        if (kept == k - 1).all() or (kept == k + 1).all():
            raise ExerciseFailed(f"top_k={k} kept {int(kept[0])} tokens per row: an off-by-one at the k-th largest")
        if not torch.equal(got, expected):
            raise ExerciseFailed(f"top_k={k}: each row must keep its k largest logits unchanged and set "
                                 "the rest to -inf")
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    if not torch.equal(_call_without_mutation(fn, tied, 2), filter_logits(tied, top_k=2)):
        raise ExerciseFailed("with a tie at the k-th largest logit, keep every tied token "
                             "(compare with the k-th largest value, as transformers does)")
    return "keeps each row's k largest logits (ties included), the rest -inf"


@exercise("06", "top_p_filter", forbidden=(*_FILTER_LOGITS, "labkit.sampling.filters.apply_top_p"))
def top_p_filter(ns):
    fn = require(ns, "top_p_filter")
    logits = _logits(3)
    for top_p in (0.3, 0.7, 0.95):
        got = _call_without_mutation(fn, logits, top_p)
        expected = filter_logits(logits, top_p=top_p)
        if not _kept(got).any(-1).all():
            raise ExerciseFailed("a row lost every token: the most likely token must always survive")
        probs = logits.softmax(-1)
        kept_mass = torch.where(_kept(got), probs, 0).sum(-1)
        if (kept_mass < top_p - 1e-6).any():
            raise ExerciseFailed(f"top_p={top_p}: the kept tokens hold less than top_p of the probability; "
                                 "keep the token that crosses the threshold too")
        if not torch.equal(_kept(got), _kept(expected)):
            raise ExerciseFailed(f"top_p={top_p}: keep the smallest set of most likely tokens whose probability "
                                 "reaches top_p (sort descending, cumulative sum)")
        if not torch.equal(got, expected):
            raise ExerciseFailed("the kept logits must be returned unchanged (and the removed ones set to -inf)")
    return "keeps the smallest most-likely set reaching top_p"


@exercise("06", "sample_next", forbidden=(*_FILTER_LOGITS, *_SAMPLER, "labkit.sampling.filters.apply_temperature",
                                          "labkit.sampling.filters.keep_argmax"))
def sample_next(ns):
    fn = require(ns, "sample_next")
    logits = torch.tensor([1.5, 0.2, 1.0, -0.5, 0.8])
    given = logits.clone()
    first = fn(given, 0.7, torch.Generator().manual_seed(0))
    if not isinstance(first, int) or isinstance(first, bool):
        raise ExerciseFailed(f"return the token id as a Python int (use .item()), got {type(first).__name__}")
    if not torch.equal(given, logits):
        raise ExerciseFailed("sample_next changed its input logits in place: work on a copy")
    try:
        greedy = {fn(logits.clone(), 0.0, torch.Generator().manual_seed(seed)) for seed in range(20)}
    except Exception as error:
        raise ExerciseFailed(f"temperature 0 raised {type(error).__name__} (dividing by 0): at temperature 0 "
                             "return the argmax without sampling") from None
    if greedy != {int(logits.argmax())}:
        raise ExerciseFailed(f"temperature 0 must always return the argmax ({int(logits.argmax())}), got {greedy}")
    draws = [fn(logits.clone(), 1.0, torch.Generator().manual_seed(seed)) for seed in range(3000)]
    if len(set(draws)) == 1:
        raise ExerciseFailed("at temperature 1 every draw is the same token: sample (torch.multinomial) "
                             "instead of taking the argmax")
    again = [fn(logits.clone(), 1.0, torch.Generator().manual_seed(seed)) for seed in range(60)]
    if again != draws[:60]:
        raise ExerciseFailed("the same seeded generator gave different tokens: the generator was ignored. "
                             "Pass generator=generator to torch.multinomial, so a seeded request reproduces")
    counts = torch.bincount(torch.tensor(draws), minlength=len(logits)).double()
    expected = logits.softmax(-1).double() * len(draws)
    statistic = float(((counts - expected) ** 2 / expected).sum())
    if statistic > 25.0:  # chi-square, 4 degrees of freedom: P(> 25) < 1e-4 when the draws are right
        raise ExerciseFailed(f"draw frequencies {(counts / len(draws)).tolist()} don't follow softmax(logits) "
                             f"{logits.softmax(-1).tolist()}: sample from the probabilities, not the logits")
    cold = [fn(logits.clone(), 0.3, torch.Generator().manual_seed(seed)) for seed in range(300)]
    if abs(cold.count(0) / 300 - float((logits / 0.3).softmax(-1)[0])) > 0.1:
        raise ExerciseFailed("at temperature 0.3 the draws should concentrate on the argmax: divide the "
                             "logits by the temperature before the softmax")
    return "greedy at temperature 0, seeded draws that follow softmax(logits / T)"


@exercise("06", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers

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
