"""Lab 00: the warm-up exercise that shows how exercises and check cells work."""

import torch

from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.core import seeded_generator

FORBIDDEN = (
    "torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax", "torch.special.softmax",
    "torch.nn.Softmax", "torch.log_softmax", "torch.Tensor.log_softmax", "torch.nn.functional.log_softmax",
    "torch.special.log_softmax", "torch.nn.LogSoftmax", "torch.sparse.softmax", "torch.sparse.log_softmax",
    "torch.nn.functional.softmin", "torch.nn.Softmin", "torch.nn.Softmax2d",
)


def _spread(logits: torch.Tensor) -> torch.Tensor:
    """Large logits whose rows sit far apart (exp overflows float64 beyond about 709)."""
    return logits * 1000 + torch.tensor([[0.0], [3000.0], [-3000.0]], dtype=logits.dtype)


def _rowwise(e: torch.Tensor) -> torch.Tensor:
    return e / e.sum(-1, keepdim=True)


@exercise("00", "softmax", forbidden=FORBIDDEN)
def softmax(ns):
    fn = require(ns, "softmax")
    generator = seeded_generator(0)
    logits = torch.randn(3, 7, generator=generator, dtype=torch.float64)
    square = torch.randn(4, 4, generator=generator, dtype=torch.float64)
    got_square = _call(fn, square)
    if torch.allclose(got_square, square.exp() / square.exp().sum(-1)):
        raise ExerciseFailed("each row was divided by the wrong row's sum: keep the summed dimension "
                             "(sum(-1, keepdim=True)) so it broadcasts along rows")
    got = _call(fn, logits)
    large = _call(fn, _spread(logits))
    if torch.allclose(got.sum(0), torch.ones(7, dtype=got.dtype)) and not torch.allclose(
        got.sum(-1), torch.ones(3, dtype=got.dtype)
    ):
        raise ExerciseFailed("normalized over the wrong axis: each row (the last dimension) must sum to 1")
    if torch.allclose(got, logits - logits.logsumexp(-1, keepdim=True), atol=1e-6):
        raise ExerciseFailed("that is log-softmax (log-probabilities): exponentiate, so each row sums to 1")
    if not torch.allclose(got, _rowwise(logits.exp()), atol=1e-6):
        raise ExerciseFailed("the values are not exp(x) / sum(exp(x)) along the last dimension")
    if not torch.allclose(got_square, _rowwise(square.exp()), atol=1e-6):
        raise ExerciseFailed("a square input [4, 4] gives wrong rows: a row's max or sum taken without "
                             "keepdim=True has shape [rows] and broadcasts along the columns; keep the dimension")
    if torch.allclose(large, _rowwise((_spread(logits) - _spread(logits).max()).exp()), equal_nan=True):
        raise ExerciseFailed("subtracted the largest value of the whole tensor: subtract each row's own max "
                             "(max(-1, keepdim=True)), or rows far below it underflow to 0/0")
    if not torch.isfinite(large).all():
        raise ExerciseFailed("exp overflowed on large logits: subtract each row's max before exponentiating")
    expected = _rowwise((_spread(logits) - _spread(logits).amax(-1, keepdim=True)).exp())
    if not torch.allclose(large, expected, atol=1e-6):
        raise ExerciseFailed("large logits give wrong values: subtract each row's max before exponentiating")
    _call(fn, logits.float())  # the dtype follows the input's, whichever it is
    row = logits[1]
    try:
        one_row = _call(fn, row)
    except ExerciseFailed:
        raise
    except Exception as error:
        if raised_type(error) == "NotImplementedError":
            raise
        raise ExerciseFailed(f"on one row [{len(row)}] (as in the lab's example) your softmax raised "
                             f"{raised_type(error)}: a 1-D x is one row; reduce over the last dimension, dim=-1, "
                             "not dim=1") from None
    if not torch.allclose(one_row, _rowwise(row.exp()), atol=1e-6):
        raise ExerciseFailed("one row [cols] (as in the lab's example) gives wrong values: reduce over dim=-1")
    return "rows sum to 1, and large logits don't overflow"


def _call(fn, x: torch.Tensor):
    """The student's softmax of a copy of `x`, checked for shape and dtype; fails if it wrote into its
    input, or if a row reduction without keepdim could not broadcast."""
    given = x.clone()
    try:
        got = fn(given)
    except Exception as error:
        if raised_type(error) == "RuntimeError" and "must match the size" in str(error):
            raise ExerciseFailed(f"RuntimeError on a {tuple(x.shape)} input (\"{str(error).splitlines()[0]}\"): a "
                                 "row's max or sum taken without keepdim=True has shape [rows], which does not "
                                 "broadcast against [rows, cols]; keep the dimension") from None
        raise
    if not torch.equal(given, x):
        raise ExerciseFailed("softmax changed its input x in place (x -= ..., exp_(), div_()): the caller's logits "
                             "are still needed (for logprobs, for another sample); compute into a new tensor")
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        raise ExerciseFailed(f"expected a tensor of shape {tuple(x.shape)}, got "
                             f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    if got.dtype != x.dtype:
        raise ExerciseFailed(f"a {x.dtype} input came back as {got.dtype}: return x's dtype (no .float(), and a "
                             "tensor built from a list needs dtype=x.dtype)")
    return got


@exercise("00", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    last = torch.softmax(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), -1)[-1].item()
    return grade_answers(ns, {
        1: Choice("b", "'Exercises and check cells'"),
        2: Choice("c", "the warm-up's paragraph on overflow"),
        3: Number(last, "the softmax formula, and try your own `softmax`", rel_tol=2e-3),
        4: Choice("b", "'The five source documents'"),
        5: Choice("a", "'How grading works'"),
    })
