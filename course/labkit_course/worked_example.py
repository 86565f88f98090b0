"""The book's tiny worked example (chapter 10, §10.3-10.4) as runnable reference code.

A 5-token vocabulary, d_model = 4, one layer with 2 attention heads of d_k = 2: the prompt "I love"
is prefilled and "AI" predicted, then tokens are decoded one at a time with a KV cache. The weights
and the numbers the book prints live in `datasets/worked_example.json`, each weight with its
provenance (printed by the book, or constructed to agree with what it prints). Labs 03 and 04 and
their graders compare against the functions here.

Everything runs in float64: the book's numbers are short decimals, and float64 keeps our own
rounding error near 1e-16, so any difference from the book is the book's rounding, not ours.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from labkit_course.data import WORKED_EXAMPLE, data_path

DATA_PATH = data_path(WORKED_EXAMPLE)
DTYPE = torch.float64


@dataclass(frozen=True)
class WorkedExample:
    """The tiny model's weights; projections are stacked per head: w_q[h] is head h+1's W_Q."""

    vocab: tuple[str, ...]
    embeddings: torch.Tensor  # E  [vocab, d_model]
    positional: torch.Tensor  # PE [max_positions, d_model]
    w_q: torch.Tensor  # [heads, d_model, d_k]
    w_k: torch.Tensor
    w_v: torch.Tensor
    w_o: torch.Tensor  # [heads * d_k, d_model]
    w_ff1: torch.Tensor  # [d_model, d_ff]
    w_ff2: torch.Tensor  # [d_ff, d_model]
    w_lm: torch.Tensor  # [d_model, vocab]

    @property
    def n_heads(self) -> int:
        return self.w_q.shape[0]

    @property
    def d_k(self) -> int:
        return self.w_q.shape[-1]

    def token_id(self, token: str) -> int:
        if token not in self.vocab:
            raise ValueError(f"token {token!r} is not in the vocabulary {self.vocab}")
        return self.vocab.index(token)


def load_data(path: Path = DATA_PATH) -> dict:
    """The JSON file as it is: weights with their provenance, and the numbers the book prints."""
    return json.loads(Path(path).read_text())


def load_worked_example(path: Path = DATA_PATH, device="cpu") -> WorkedExample:
    data = load_data(path)
    weights = data["weights"]

    def tensor(name):
        return torch.tensor(weights[name]["values"], dtype=DTYPE, device=device)

    heads = range(1, sum(name.startswith("W_Q") for name in weights) + 1)
    return WorkedExample(
        vocab=tuple(data["vocab"]),
        embeddings=tensor("E"),
        positional=tensor("PE"),
        w_q=torch.stack([tensor(f"W_Q{h}") for h in heads]),
        w_k=torch.stack([tensor(f"W_K{h}") for h in heads]),
        w_v=torch.stack([tensor(f"W_V{h}") for h in heads]),
        w_o=tensor("W_O"),
        w_ff1=tensor("W_FF1"),
        w_ff2=tensor("W_FF2"),
        w_lm=tensor("W_LM"),
    )


def book_values(path: Path = DATA_PATH, device="cpu") -> dict[str, torch.Tensor]:
    """Every number the book prints for the example, as float64 tensors keyed like the JSON."""
    return {name: torch.tensor(entry["values"], dtype=DTYPE, device=device)
            for name, entry in load_data(path)["book"].items()}


def sinusoidal_positions(n_positions: int, d_model: int = 4, base: float = 100.0, decimals: int = 1) -> torch.Tensor:
    """The rule behind the book's "simplified" PE: sin/cos pairs with base 100, rounded to 1 decimal.

    PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d)). With base 100 and one
    decimal this reproduces the three rows the book prints, and gives the positions it doesn't.
    """
    positions = torch.arange(n_positions, dtype=DTYPE)[:, None]
    angles = positions / base ** (torch.arange(0, d_model, 2, dtype=DTYPE) / d_model)
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(n_positions, d_model)
    return torch.round(table, decimals=decimals)


# --- the steps of one attention head, in the book's order -------------------------------------

def build_x(embeddings: torch.Tensor, positional: torch.Tensor, token_ids, start: int = 0) -> torch.Tensor:
    """X[i] = E[token_ids[i]] + PE[start + i]: the layer's input rows for tokens at start, start+1, ..."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=embeddings.device).reshape(-1)
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < embeddings.shape[0]):
        raise ValueError(f"token_ids {ids.tolist()} must lie in 0..{embeddings.shape[0] - 1} (rows of E)")
    if start < 0 or start + len(ids) > positional.shape[0]:
        raise ValueError(f"positions {start}..{start + len(ids) - 1} are outside PE's {positional.shape[0]} rows")
    return embeddings[ids] + positional[start:start + len(ids)]


def scaled_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Q K^T / sqrt(d_k): row i holds query i against every key."""
    return q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])


def causal_mask(n_queries: int, n_keys: int, device="cpu") -> torch.Tensor:
    """True where a query may NOT look: the queries are the last n_queries of the n_keys positions."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).triu(n_keys - n_queries + 1)


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Hide the future (-inf), then softmax each row: the attention weights."""
    n_queries, n_keys = scores.shape[-2:]
    hidden = causal_mask(n_queries, n_keys, scores.device)
    return scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores, weights and output of causal attention for one or more heads ([..., n, d_k])."""
    scores = scaled_scores(q, k)
    weights = causal_softmax(scores)
    return scores, weights, weights @ v


class KVCache:
    """The book's KVCache for one layer, all heads at once: K and V grow by one row per new token.

    Rows are positions: keys and values have shape [heads, cached_tokens, d_k].
    """

    def __init__(self, n_heads: int, d_k: int, device="cpu"):
        self.keys = torch.zeros(n_heads, 0, d_k, dtype=DTYPE, device=device)
        self.values = torch.zeros(n_heads, 0, d_k, dtype=DTYPE, device=device)

    def __len__(self) -> int:
        return self.keys.shape[1]

    def append(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V after the cached ones; return everything cached so far."""
        if new_keys.shape != new_values.shape or new_keys.shape[::2] != self.keys.shape[::2]:
            raise ValueError(f"new keys {tuple(new_keys.shape)} and values {tuple(new_values.shape)} must both "
                             f"be [heads={self.keys.shape[0]}, new_tokens, d_k={self.keys.shape[2]}]")
        self.keys = torch.cat([self.keys, new_keys], dim=1)
        self.values = torch.cat([self.values, new_values], dim=1)
        return self.keys, self.values


# --- the whole layer ---------------------------------------------------------------------------

@dataclass
class Trace:
    """Every intermediate of one forward pass over `x.shape[0]` new tokens (heads first)."""

    positions: list[int]
    x: torch.Tensor  # [new, d_model]
    q: torch.Tensor  # [heads, new, d_k]
    k: torch.Tensor  # [heads, new, d_k]  the new tokens' keys only
    v: torch.Tensor
    keys: torch.Tensor  # [heads, context, d_k]  every key attended over (cached + new)
    values: torch.Tensor
    scores: torch.Tensor  # [heads, new, context]
    weights: torch.Tensor
    head_outputs: torch.Tensor  # [heads, new, d_k]
    concat: torch.Tensor  # [new, heads * d_k]
    mha: torch.Tensor  # [new, d_model]
    layer_output: torch.Tensor  # [new, d_model]
    logits: torch.Tensor  # [new, vocab]

    @property
    def probs(self) -> torch.Tensor:
        return self.logits.softmax(dim=-1)

    @property
    def next_token(self) -> int:
        """Greedy choice from the last position's logits."""
        return int(self.logits[-1].argmax())

    @property
    def projection_matvecs(self) -> int:
        """Matrix-vector products this pass spent on the Q, K and V projections (all heads)."""
        return 3 * self.q.shape[0] * self.x.shape[0]


def block_after_attention(model: WorkedExample, x: torch.Tensor, mha: torch.Tensor) -> torch.Tensor:
    """The rest of the layer, a plain pre-norm block: h = x + MHA;  out = h + FFN(LayerNorm(h)).

    FFN(n) = ReLU(n W_FF1) W_FF2, LayerNorm without learned scale or shift.
    """
    h = x + mha
    normed = F.layer_norm(h, h.shape[-1:])
    return h + torch.relu(normed @ model.w_ff1) @ model.w_ff2


def forward(model: WorkedExample, token_ids, cache: KVCache | None = None) -> Trace:
    """Run the layer over new tokens: all of a prompt (prefill) or one token (decode).

    With a cache, the new tokens sit after the cached ones, their K/V are appended to it, and their
    queries attend over everything cached. Without one, the tokens are the whole sequence.
    """
    start = len(cache) if cache is not None else 0
    x = build_x(model.embeddings, model.positional, token_ids, start)
    q, k, v = x @ model.w_q, x @ model.w_k, x @ model.w_v  # [heads, new, d_k] each
    keys, values = cache.append(k, v) if cache is not None else (k, v)
    scores, weights, head_outputs = attend(q, keys, values)
    concat = head_outputs.transpose(0, 1).reshape(x.shape[0], -1)
    mha = concat @ model.w_o
    layer_output = block_after_attention(model, x, mha)
    return Trace(list(range(start, start + x.shape[0])), x, q, k, v, keys, values, scores, weights,
                 head_outputs, concat, mha, layer_output, layer_output @ model.w_lm)


def generate(model: WorkedExample, prompt_ids, steps: int) -> tuple[list[Trace], KVCache]:
    """Prefill the prompt, then decode `steps` greedy tokens one at a time with a KV cache."""
    cache = KVCache(model.n_heads, model.d_k, model.embeddings.device)
    traces = [forward(model, prompt_ids, cache)]
    for _ in range(steps):
        traces.append(forward(model, [traces[-1].next_token], cache))
    return traces, cache


def projection_matvecs(prompt_len: int, decode_steps: int, *, cached: bool, per_token: int = 3) -> int:
    """Projection matrix-vector products for one head over a whole generation.

    With a cache each token is projected once. Without one, decode step s re-projects the whole
    sequence of prompt_len + s tokens. per_token=3 counts Q, K and V; 2 counts K and V only.
    """
    if cached:
        return per_token * (prompt_len + decode_steps)
    recomputed = sum(prompt_len + step for step in range(1, decode_steps + 1))
    return per_token * (prompt_len + recomputed)


# --- the book's printed numbers against ours ---------------------------------------------------

@dataclass(frozen=True)
class Printed:
    """One quantity the book prints, beside the value computed from the example's inputs."""

    name: str
    where: str
    decimals: int
    printed: torch.Tensor
    computed: torch.Tensor

    @property
    def off(self) -> torch.Tensor:
        """Entries where the book's number is not ours rounded to the book's precision."""
        return (self.computed - self.printed).abs() > 0.5 * 10.0**-self.decimals + 1e-9

    @property
    def agrees(self) -> bool:
        return not bool(self.off.any())

    def __str__(self) -> str:
        count = int(self.off.sum())
        status = "✔ agrees" if self.agrees else f"✘ {count} {'differs' if count == 1 else 'differ'} beyond rounding"
        return (f"{self.name}\n  book: {fmt(self.printed, self.decimals)}\n"
                f"  ours: {fmt(self.computed, max(3, self.decimals + 1))}   {status}")


def fmt(values, decimals: int = 3) -> str:
    """A tensor (or number) as nested lists at fixed precision, the way the book prints them."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, list):
        return "[" + ", ".join(fmt(v, decimals) for v in values) + "]"
    return f"{values:.{decimals}f}" if round(values, decimals) else f"{0.0:.{decimals}f}"  # no "-0.000"


def computed_like_book(model: WorkedExample) -> dict[str, torch.Tensor]:
    """Everything the book prints, computed here (prefill of the prompt, then X[2] for "AI")."""
    t = forward(model, [model.token_id("I"), model.token_id("love")])
    x, w_q1 = t.x, model.w_q[0]
    return {
        "E": model.embeddings,
        "PE": model.positional[:3],
        "W_Q1": w_q1,
        "X": x,
        "Q1_products": (x[:, :, None] * w_q1).transpose(1, 2),  # [i, j, term]
        "Q1": t.q[0], "K1": t.k[0], "V1": t.v[0],
        "scores1_products": (t.q[0][:, None, :] * t.k[0][None, :, :]),  # [i, j, term]
        "sqrt_dk": torch.tensor(math.sqrt(model.d_k), dtype=DTYPE),
        "scores1": t.scores[0],
        "exp1_row1": t.scores[0][1].exp(),
        "exp1_row1_sum": t.scores[0][1].exp().sum(),
        "attn1": t.weights[0],
        "out1_row1_terms": t.weights[0][1][:, None] * t.v[0],
        "out1": t.head_outputs[0],
        "Q2": t.q[1], "K2": t.k[1], "V2": t.v[1],
        "attn2": t.weights[1],
        "out2": t.head_outputs[1],
        "concat": t.concat,
        "mha": t.mha,
        "layer_output": t.layer_output,
        "logits": t.logits[-1],
        "probs": t.probs[-1],
        "x2": build_x(model.embeddings, model.positional, [model.token_id("AI")], start=2)[0],
    }


def compare(name: str, computed: torch.Tensor, path: Path = DATA_PATH) -> Printed:
    """One of our values beside the number the book prints under `name` (a key of the JSON's "book")."""
    entries = load_data(path)["book"]
    if name not in entries:
        raise ValueError(f"the book prints no {name!r}; it prints {', '.join(entries)}")
    entry = entries[name]
    printed = torch.tensor(entry["values"], dtype=DTYPE)
    computed = torch.as_tensor(computed, dtype=DTYPE).detach().cpu()
    if computed.shape != printed.shape:
        raise ValueError(f"{name}: ours has shape {tuple(computed.shape)}, the book's {tuple(printed.shape)}")
    return Printed(name, entry["where"], entry["decimals"], printed, computed)


def compare_with_book(model: WorkedExample, path: Path = DATA_PATH) -> dict[str, Printed]:
    """Every printed number beside ours, computed from the example's inputs."""
    return {name: compare(name, value, path) for name, value in computed_like_book(model).items()}
