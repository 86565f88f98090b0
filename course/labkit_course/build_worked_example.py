"""Writes worked_example.json: the book's tiny model (chapter 10, §10.3-10.4) and every number it prints.

The book gives E, PE[0..2] and W_Q1 (its arithmetic spells out W_Q1's entries) but only results
for the rest: K1, V1 and head 2's Q2/K2/V2 without weights, MHA_output without W_O, Layer_output
without the block after attention, logits without W_LM. This script constructs weights that
reproduce those results and records how. Each missing matrix solves an underdetermined linear system
A W = B (two prompt rows, more unknowns), and we take its minimum-norm exact solution W = pinv(A) B:
the smallest weights that agree with the book.

Run:  python -m labkit_course.build_worked_example
"""

import json
import re

import torch
import torch.nn.functional as F

from labkit_course.worked_example import DATA_PATH, DTYPE, attend, build_x, sinusoidal_positions

VOCAB = ["<PAD>", "I", "love", "AI", "<EOS>"]
PROMPT = ["I", "love"]
D_FF = 8

# The book's printed numbers, each with the precision it prints and where it prints it.
BOOK = {
    "E": (1, "Step 1, embedding matrix", [[0.0, 0.0, 0.0, 0.0], [0.8, 0.3, -0.2, 0.5], [0.4, 0.6, 0.7, -0.3],
                                         [0.5, -0.4, 0.6, 0.8], [0.0, 0.0, 0.0, 0.0]]),
    "PE": (1, "Step 1, positional encodings (positions 0-2)", [[0.0, 1.0, 0.0, 1.0], [0.8, 0.5, 0.1, 1.0],
                                                               [0.9, -0.4, 0.2, 1.0]]),
    "W_Q1": (1, "Step 3, the factors in the Q1 arithmetic", [[0.2, 0.3], [0.1, 0.4], [0.3, 0.2], [0.4, 0.1]]),
    "X": (1, "Step 2, X = E[token] + PE[position]", [[0.8, 1.3, -0.2, 1.5], [1.2, 1.1, 0.8, 0.7]]),
    "Q1_products": (2, "Step 3, the four products behind each Q1[i, j]",
                    [[[0.16, 0.13, -0.06, 0.60], [0.24, 0.52, -0.04, 0.15]],
                     [[0.24, 0.11, 0.24, 0.28], [0.36, 0.44, 0.16, 0.07]]]),
    "Q1": (2, "Step 3, Q1", [[0.83, 0.87], [0.87, 1.03]]),
    "K1": (2, "Step 3, K1", [[0.73, 1.31], [0.93, 1.15]]),
    "V1": (2, "Step 3, V1", [[1.37, 0.79], [1.19, 0.95]]),
    "scores1_products": (3, "Step 4, the two products behind each Score[i, j]",
                         [[[0.606, 1.140], [0.772, 1.001]], [[0.635, 1.349], [0.809, 1.185]]]),
    "sqrt_dk": (3, "Step 4, sqrt(2)", 1.414),
    "scores1": (3, "Step 4, Scores (head 1)", [[1.235, 1.254], [1.403, 1.410]]),
    "exp1_row1": (3, "Step 5, exp(1.403), exp(1.410)", [4.067, 4.096]),
    "exp1_row1_sum": (3, "Step 5, their sum", 8.163),
    "attn1": (3, "Step 5, attention weights (head 1)", [[1.000, 0.000], [0.498, 0.502]]),
    "out1_row1_terms": (3, "Step 6, 0.498 V1[0] and 0.502 V1[1]", [[0.682, 0.393], [0.597, 0.477]]),
    "out1": (3, "Step 6, Output_Head1", [[1.370, 0.790], [1.279, 0.870]]),
    "Q2": (2, "Step 8, Q2", [[0.81, 0.93], [1.02, 0.89]]),
    "K2": (2, "Step 8, K2", [[0.95, 1.28], [1.08, 1.03]]),
    "V2": (2, "Step 8, V2", [[1.28, 0.92], [1.15, 1.07]]),
    "attn2": (3, "Step 8, Attn2", [[1.0, 0.0], [0.503, 0.497]]),
    "out2": (3, "Step 8, Output_Head2", [[1.280, 0.920], [1.215, 0.994]]),
    "concat": (3, "Step 8, Concat", [[1.370, 0.790, 1.280, 0.920], [1.279, 0.870, 1.215, 0.994]]),
    "mha": (3, "Step 8, MHA_output = Concat @ W_O", [[0.939, 1.082, 0.873, 1.011], [0.921, 1.054, 0.856, 0.989]]),
    "layer_output": (3, "Step 8, Layer_output after residual + LayerNorm + FFN",
                     [[0.856, 1.123, 0.945, 1.034], [0.834, 1.089, 0.921, 1.008]]),
    "logits": (3, "Step 8, logits at position 1", [0.933, 1.002, 0.919, 1.272, 0.933]),
    "probs": (3, "Step 8, softmax(logits)", [0.183, 0.196, 0.181, 0.257, 0.183]),
    "x2": (1, "§10.4 Step 1, X[2] = E[3] + PE[2]", [1.4, -0.8, 0.8, 1.8]),
}


def tensor(name):
    return torch.tensor(BOOK[name][2], dtype=DTYPE)


def min_norm_solution(a, b):
    """The smallest W with a @ W = b (a has full row rank, so the system is solved exactly)."""
    return torch.linalg.pinv(a) @ b


def build() -> dict:
    embeddings = tensor("E")
    positional = sinusoidal_positions(5)
    assert torch.equal(positional[:3], tensor("PE")), "the PE rule must reproduce the book's rows"
    x = build_x(embeddings, positional, [VOCAB.index(t) for t in PROMPT])

    weights = {
        "E": (embeddings, "book", "Step 1."),
        "PE": (positional, "book (rows 0-2), constructed (rows 3-4)",
               "The book's rows are sin/cos pairs with base 100 rounded to one decimal: PE[p] = "
               "round([sin p, cos p, sin(p/10), cos(p/10)], 1). That rule gives rows 0-2 exactly and "
               "rows 3-4, which the book never prints."),
        "W_Q1": (tensor("W_Q1"), "book", "The factors of the Q1 arithmetic in Step 3."),
    }
    for name in ("K1", "V1", "Q2", "K2", "V2"):
        weights[f"W_{name}"] = (min_norm_solution(x, tensor(name)), "constructed",
                                f"Minimum-norm W with X W = the printed {name} (W = pinv(X) {name}); the "
                                "book prints only the result.")

    heads = [attend(x @ weights[f"W_Q{h}"][0], x @ weights[f"W_K{h}"][0], x @ weights[f"W_V{h}"][0])[2]
             for h in (1, 2)]
    concat = torch.cat(heads, dim=-1)
    weights["W_O"] = (min_norm_solution(concat, tensor("mha")), "constructed",
                      "Minimum-norm W_O with Concat W_O = the printed MHA_output, where Concat is what "
                      "the heads compute from the weights above (head 2's differs from the book's, see "
                      "Attn2).")
    w_ff1 = torch.cat([torch.eye(4, dtype=DTYPE), -torch.eye(4, dtype=DTYPE)], dim=1)
    h = x + tensor("mha")
    features = torch.relu(F.layer_norm(h, (4,)) @ w_ff1)
    weights["W_FF1"] = (w_ff1, "constructed",
                        "The book names the block after attention but gives no weights. We use a plain "
                        "pre-norm block: h = X + MHA_output, out = h + ReLU(LayerNorm(h) W_FF1) W_FF2, with "
                        f"LayerNorm unscaled and W_FF1 = [I, -I] (d_ff = {D_FF}: the positive and negative "
                        "parts of each feature).")
    weights["W_FF2"] = (min_norm_solution(features, tensor("layer_output") - h), "constructed",
                        "Minimum-norm W_FF2 so that out equals the printed Layer_output at both positions.")
    weights["W_LM"] = (min_norm_solution(tensor("layer_output")[1:], tensor("logits")[None]), "constructed",
                       "Minimum-norm W_LM with Layer_output[1] W_LM = the printed logits. One printed row "
                       "leaves W_LM of rank 1: any position's logits are the printed ones times "
                       "(out . Layer_output[1]) / |Layer_output[1]|^2, so whenever that factor is positive "
                       "this toy ranks the tokens as the book does at position 1 and predicts \"AI\".")

    return {
        "description": "The tiny one-layer, two-head model of the book's chapter 10 worked example "
                       "(seed 002, §10.3-10.4), and every number the book prints for it.",
        "built_by": "course/labkit_course/build_worked_example.py",
        "vocab": VOCAB,
        "prompt": PROMPT,
        "weights": {name: {"source": source, "how": how, "values": value.tolist()}
                    for name, (value, source, how) in weights.items()},
        "book": {name: {"decimals": decimals, "where": where, "values": values}
                 for name, (decimals, where, values) in BOOK.items()},
    }


def to_json(data: dict) -> str:
    """Indented JSON with each innermost list of numbers on one line."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    return re.sub(r"\[[^\[\]\"{}]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)), text) + "\n"


if __name__ == "__main__":
    DATA_PATH.write_text(to_json(build()))
    print(f"wrote {DATA_PATH}")
