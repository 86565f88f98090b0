"""Lab 00: the warm-up exercise that shows how exercises and check cells work."""

import torch

from labkit.grading import ExerciseFailed, exercise, require


class _NoBuiltinSoftmax:
    """While active, torch's own softmax raises, so the exercise really is written by hand."""

    def __enter__(self):
        self.saved = torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax

        def refuse(*args, **kwargs):
            raise ExerciseFailed("write softmax with exp and sum: torch's softmax is what you are rebuilding")

        torch.softmax = torch.Tensor.softmax = torch.nn.functional.softmax = refuse

    def __exit__(self, *exc):
        torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax = self.saved


@exercise("00", "softmax")
def softmax(ns):
    fn = require(ns, "softmax")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=generator, dtype=torch.float64)
    with _NoBuiltinSoftmax():
        got = fn(logits.clone())
        large = fn(logits.clone() * 1000)
    if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
        raise ExerciseFailed(f"expected a tensor of shape {tuple(logits.shape)}, got "
                             f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    if torch.allclose(got.sum(0), torch.ones(7, dtype=got.dtype)) and not torch.allclose(
        got.sum(-1), torch.ones(3, dtype=got.dtype)
    ):
        raise ExerciseFailed("normalized over the wrong axis: each row (the last dimension) must sum to 1")
    if not torch.allclose(got, torch.softmax(logits, -1), atol=1e-6):
        raise ExerciseFailed("the values are not exp(x) / sum(exp(x)) along the last dimension")
    if not torch.isfinite(large).all():
        raise ExerciseFailed("exp overflowed on large logits: subtract each row's max before exponentiating")
    if not torch.allclose(large, torch.softmax(logits * 1000, -1), atol=1e-6):
        raise ExerciseFailed("large logits give wrong values: subtract each row's max before exponentiating")
    return "rows sum to 1, and large logits don't overflow"


@exercise("00", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers

    last = torch.softmax(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), -1)[-1].item()
    return grade_answers(ns, {
        1: Choice("b", "'Exercises and check cells'"),
        2: Choice("c", "the warm-up's paragraph on overflow"),
        3: Number(last, "the softmax formula, and try your own `softmax`", rel_tol=2e-3),
        4: Choice("b", "'The five source documents'"),
        5: Choice("a", "'How grading works'"),
    })
