"""Lab 00: softmax written by hand."""

import math

import torch
import torch.nn.functional as F

from catalogue import Right, Wrong


def vectorised(x):
    e = (x - x.max(-1, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True)


def row_by_row(x):
    """A Python loop over the rows of a [rows, cols] view (a 1-D x is one row)."""
    rows = []
    for row in x.reshape(-1, x.shape[-1]).tolist():
        top = max(row)
        exps = [math.exp(v - top) for v in row]
        rows.append([e / sum(exps) for e in exps])
    return torch.tensor(rows, dtype=x.dtype).reshape(x.shape)


def via_logsumexp(x):
    return (x - x.logsumexp(-1, keepdim=True)).exp()


def in_place(x):
    x -= x.max(-1, keepdim=True).values
    x.exp_()
    return x.div_(x.sum(-1, keepdim=True))


def max_without_keepdim(x):
    e = (x - x.max(-1).values).exp()
    return e / e.sum(-1, keepdim=True)


def global_max(x):
    e = (x - x.max()).exp()
    return e / e.sum(-1, keepdim=True)


RIGHT = [
    Right("softmax", "vectorised, row max subtracted", vectorised),
    Right("softmax", "python loop over rows with math.exp", row_by_row),
    Right("softmax", "exp of x minus logsumexp", via_logsumexp),
]

WRONG = [
    Wrong("softmax", "normalised over the wrong axis", lambda x: vectorised(x.T).T, "wrong axis"),
    Wrong("softmax", "no max subtracted, exp overflows", lambda x: x.exp() / x.exp().sum(-1, keepdim=True),
          "exp overflowed"),
    Wrong("softmax", "subtracted the global max, not each row's", global_max, "each row's own max"),
    Wrong("softmax", "forgot keepdim on the row sums", lambda x: x.exp() / x.exp().sum(-1), "keepdim=True"),
    Wrong("softmax", "overwrote its input in place", in_place, "changed its input x in place"),
    Wrong("softmax", "row max without keepdim", max_without_keepdim, "without keepdim=True"),
    Wrong("softmax", "built the result from a list without dtype", lambda x: torch.tensor(vectorised(x).tolist()),
          "dtype"),
    Wrong("softmax", "cast to float32", lambda x: vectorised(x).float(), "came back as torch.float32"),
    Wrong("softmax", "written for [rows, cols] only (dim=1)", lambda x: (lambda e: e / e.sum(1, keepdim=True))(
        (x - x.max(1, keepdim=True).values).exp()), "dim=-1, not dim=1"),
    Wrong("softmax", "exp without normalising", lambda x: x.exp(), "not exp(x) / sum(exp(x))"),
    Wrong("softmax", "returned log-softmax", lambda x: x - x.logsumexp(-1, keepdim=True), "that is log-softmax"),
    Wrong("softmax", "returned a nested list", lambda x: vectorised(x).tolist(), "expected a tensor"),
    Wrong("softmax", "divided by the row max, not the sum", lambda x: x.exp() / x.exp().amax(-1, keepdim=True),
          "not exp(x) / sum(exp(x))"),
    Wrong("softmax", "called torch.softmax", lambda x: torch.softmax(x, -1), "`torch.softmax`", calls="torch.softmax"),
    Wrong("softmax", "called torch.special.softmax", lambda x: torch.special.softmax(x, -1), "`torch.special.softmax`",
          calls="torch.special.softmax"),
    Wrong("softmax", "exp of F.log_softmax", lambda x: F.log_softmax(x, -1).exp(), "`torch.nn.functional.log_softmax`",
          calls="torch.nn.functional.log_softmax"),
]
