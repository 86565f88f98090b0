"""Lab 15: tensor parallelism (sharding weights, a row-parallel forward) and FlashAttention (the
online-softmax tile update, the memory traffic it saves)."""

import math

import torch

from labkit_course.grading import ExerciseFailed, exercise, expect_tensor, raised_type, require
from labkit_course.grading.core import seeded_generator, seeded_random

# ------------------------------------------------------------- Exercise 1: shard a linear layer's weight


def reference_shard_linear(weight, bias, rank, world_size, mode):
    """(weight shard, bias shard or None) of a torch Linear's [out, in] weight for rank `rank`."""
    dim = 0 if mode == "column" else 1
    if weight.shape[dim] % world_size:
        raise ValueError(f"{weight.shape[dim]} features do not split across {world_size} ranks")
    part = weight.shape[dim] // world_size
    shard = weight.narrow(dim, rank * part, part).clone()
    if bias is None:
        return shard, None
    if mode == "column":
        return shard, bias[rank * part:(rank + 1) * part].clone()
    return shard, bias.clone() if rank == 0 else None


def _shard_mistakes(weight, bias, rank, world_size, mode):
    other = "row" if mode == "column" else "column"
    if weight.shape[0 if other == "column" else 1] % world_size == 0:
        yield (f"torch stores a Linear's weight as [out_features, in_features]: {mode}-parallel splits "
               f"{'out_features (dim 0)' if mode == 'column' else 'in_features (dim 1)'}",
               reference_shard_linear(weight, bias, rank, world_size, other)[0])
    dim = 0 if mode == "column" else 1
    yield ("each rank takes one contiguous slice (rank * part .. (rank + 1) * part), not every world_size-th "
           "feature", weight[rank::world_size] if dim == 0 else weight[:, rank::world_size])


@exercise("15", "shard_linear", forbidden=("labkit.parallel.layers.shard_columns", "labkit.parallel.layers.shard_rows",
                                           "labkit.parallel.layers.shard_bounds",
                                           "labkit_course.grading.labs.lab15.reference_shard_linear"))
def shard_linear(ns):
    fn = require(ns, "shard_linear")
    gen = seeded_generator(15)
    for out_f, in_f, world_size in [(8, 6, 2), (6, 12, 3), (4, 4, 4), (12, 8, 2), (5, 3, 1)]:
        weight, bias = torch.randn(out_f, in_f, generator=gen), torch.randn(out_f, generator=gen)
        for mode in ("column", "row"):
            for rank in range(world_size):
                for b in (bias, None):
                    got = fn(weight.clone(), None if b is None else b.clone(), rank, world_size, mode)
                    if not (isinstance(got, tuple | list) and len(got) == 2):
                        raise ExerciseFailed(f"return a pair (weight_shard, bias_shard), got {type(got).__name__}")
                    want_w, want_b = reference_shard_linear(weight, b, rank, world_size, mode)
                    label = f"{mode}-parallel, rank {rank} of {world_size}, weight {out_f}x{in_f}"
                    if not (isinstance(got[0], torch.Tensor) and torch.equal(got[0], want_w)):
                        for why, wrong in _shard_mistakes(weight, b, rank, world_size, mode):
                            if isinstance(got[0], torch.Tensor) and got[0].shape == wrong.shape \
                                    and torch.equal(got[0], wrong):
                                raise ExerciseFailed(why)
                        expect_tensor(got[0], tuple(want_w.shape), f"the weight shard ({label})")
                        raise ExerciseFailed(f"{label}: wrong weight shard")
                    if want_b is None and got[1] is not None:
                        raise ExerciseFailed(
                            "row-parallel: every rank's partial output is summed, so a bias kept on every rank "
                            "is added world_size times; keep it on rank 0 only (None elsewhere)" if b is not None
                            else "a layer without bias has no bias shard: return None")
                    if want_b is not None and not (isinstance(got[1], torch.Tensor) and torch.equal(got[1], want_b)):
                        raise ExerciseFailed(
                            "column-parallel: each rank owns its out_features, so it takes their slice of the bias"
                            if mode == "column" else "row-parallel: rank 0 keeps the whole bias (added once, "
                            "after the sum), not a slice of it")
    for shape, mode, features in (((6, 4), "column", "out_features"), ((4, 6), "row", "in_features")):
        try:
            fn(torch.zeros(shape), None, 0, 4, mode)
        except (NotImplementedError, ExerciseFailed):
            raise
        except Exception as error:  # noqa: BLE001 - the student's code raised, as it should; which type?
            name = raised_type(error)  # the sandbox names the student's type
            if name != "ValueError":
                raise ExerciseFailed(f"uneven split: raise a ValueError, not {name}") from None
        else:
            raise ExerciseFailed(f"{mode}-parallel: 6 {features} across 4 ranks do not split evenly: raise a "
                                 "ValueError instead of handing ranks different shapes (or dropping features)")
    return "column: rows of W and the bias slice; row: columns of W, bias on rank 0 only"


# ------------------------------------------------ Exercise 2: a row-parallel forward, ranks simulated


def _row_partials(x, weight, world_size):
    part = weight.shape[1] // world_size
    return [x[..., r * part:(r + 1) * part] @ weight[:, r * part:(r + 1) * part].T for r in range(world_size)]


@exercise("15", "row_parallel_forward", forbidden=("labkit.parallel.layers.RowParallelLinear",
                                                   "labkit.parallel.layers.shard_rows"))
def row_parallel_forward(ns):
    fn = require(ns, "row_parallel_forward")
    gen = seeded_generator(1515)
    for tokens, in_f, out_f, world_size, has_bias in [(3, 8, 5, 2, True), (1, 12, 4, 3, True), (4, 6, 6, 1, True),
                                                      (5, 16, 3, 4, False), (2, 4, 7, 4, True)]:
        x = torch.randn(tokens, in_f, generator=gen, dtype=torch.float64)
        weight = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64)
        bias = torch.randn(out_f, generator=gen, dtype=torch.float64) if has_bias else None
        got = fn(x.clone(), weight.clone(), None if bias is None else bias.clone(), world_size)
        if not (isinstance(got, tuple | list) and len(got) == 2 and isinstance(got[1], list | tuple)):
            raise ExerciseFailed("return (output, partials): the summed output and the list of each rank's partial")
        output, partials = got
        want_partials = _row_partials(x, weight, world_size)
        label = f"{tokens} tokens, {in_f} -> {out_f} features over {world_size} ranks"
        if len(partials) != world_size:
            raise ExerciseFailed(f"{label}: one partial per rank, got {len(partials)}")
        for rank, (p, want) in enumerate(zip(partials, want_partials, strict=True)):
            if world_size > 1 and isinstance(p, torch.Tensor) and p.dim() == 2 and p.shape[1] < out_f:
                raise ExerciseFailed("a row-parallel rank produces a partial of the *full* output width "
                                     "(its slice of in_features times its columns of W), not a slice of the output")
            expect_tensor(p, (tokens, out_f), f"rank {rank}'s partial ({label})")
            if bias is not None and torch.allclose(p, want + bias):
                if world_size > 1 and all(isinstance(q, torch.Tensor) and q.shape == w.shape and torch.allclose(
                        q, w + bias) for q, w in zip(partials, want_partials, strict=True)):
                    raise ExerciseFailed("the bias is added once, after the sum; added to every partial it "
                                         "counts world_size times")
                raise ExerciseFailed(f"rank {rank}'s partial includes the bias: a partial is x[:, its slice] @ "
                                     "W[:, its slice].T only, and the bias is added once, to the summed output")
            if not torch.allclose(p, want):
                raise ExerciseFailed(f"{label}: rank {rank}'s partial must be x[:, its slice] @ W[:, its slice].T")
        want = sum(want_partials) + (0 if bias is None else bias)
        expect_tensor(output, (tokens, out_f), f"the output ({label})")
        if world_size > 1 and torch.allclose(output, sum(want_partials) / world_size + (0 if bias is None else bias)):
            raise ExerciseFailed("the all-reduce sums the partials: each holds part of every dot product; "
                                 "averaging them divides the result by world_size")
        if not torch.allclose(output, want):
            raise ExerciseFailed(f"{label}: output must be the sum of the partials plus the bias, once")
    return "every rank's partial has the full width; their sum (the all-reduce) plus the bias is the layer"


# ---------------------------------------------------------- Exercise 3: the online-softmax tile update


def reference_online_update(m, denom, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    p = torch.exp(scores - m_new[:, None])
    alpha = torch.exp(m - m_new)
    return m_new, denom * alpha + p.sum(1), acc * alpha[:, None] + p @ values


def _tiles(gen, rows, keys, dim, tile, scale, causal):
    q = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(keys, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(keys, dim, generator=gen, dtype=torch.float64)
    scores = q @ k.T * scale
    if causal:  # query i sits at position keys - rows + i
        scores = scores.masked_fill(torch.arange(keys)[None, :] > (keys - rows + torch.arange(rows))[:, None],
                                    float("-inf"))
    return scores, v


def _probe_rescale_factor(fn, gen):
    """One update from a finite running state to a tile with a larger max: the only step where the factor
    that carries the old sums over to the new max shows, so an inverted factor is named for what it is."""
    m, denom = torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([2.0, 1.5], dtype=torch.float64)
    acc = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    scores = torch.tensor([[1.0, 2.5, -0.5], [0.25, -2.0, 1.0]], dtype=torch.float64)
    values = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    got = fn(m.clone(), denom.clone(), acc.clone(), scores.clone(), values.clone())
    if not (isinstance(got, tuple | list) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        return  # the main loop says what the return value must be
    m_new = torch.maximum(m, scores.max(dim=1).values)
    p = torch.exp(scores - m_new[:, None])
    inverted = torch.exp(m_new - m)
    if got[1].shape == denom.shape and torch.allclose(got[1], denom * inverted + p.sum(1)) or (
            got[2].shape == acc.shape and torch.allclose(got[2], acc * inverted[:, None] + p @ values)):
        raise ExerciseFailed("the rescale factor is upside down: the old sums were weighted by exp(s - m_old), "
                             "and re-weighting them under the new, larger max multiplies by exp(m_old - m_new), "
                             "at most 1, not exp(m_new - m_old)")


@exercise("15", "online_softmax_update", forbidden=("torch.softmax", "torch.nn.functional.softmax",
                                                    "torch.Tensor.softmax",
                                                    "labkit_course.grading.labs.lab15.reference_online_update"))
def online_softmax_update(ns):
    fn = require(ns, "online_softmax_update")
    gen = seeded_generator(115)
    _probe_rescale_factor(fn, gen)
    # (rows, keys, head_dim, tile, score scale, causal): large scores overflow a softmax without the max
    for rows, keys, dim, tile, scale, causal in [(3, 12, 4, 4, 400.0, False), (2, 8, 4, 4, 1.0, False),
                                                 (3, 10, 5, 4, 1.0, True), (4, 16, 3, 16, 1.0, True),
                                                 (1, 7, 2, 1, 1.0, False), (5, 9, 6, 3, 60.0, True)]:
        scores, v = _tiles(gen, rows, keys, dim, tile, scale, causal)
        m = torch.full((rows,), float("-inf"), dtype=torch.float64)
        denom = torch.zeros(rows, dtype=torch.float64)
        acc = torch.zeros(rows, dim, dtype=torch.float64)
        for start in range(0, keys, tile):
            got = fn(m.clone(), denom.clone(), acc.clone(), scores[:, start:start + tile].clone(),
                     v[start:start + tile].clone())
            if not (isinstance(got, tuple | list) and len(got) == 3):
                raise ExerciseFailed("return the triple (m_new, denom_new, acc_new)")
            for name, t, shape in zip(("m_new", "denom_new", "acc_new"), got, ((rows,), (rows,), (rows, dim)),
                                      strict=True):
                expect_tensor(t, shape, name)
            want = reference_online_update(m, denom, acc, scores[:, start:start + tile], v[start:start + tile])
            if not torch.equal(got[0], want[0]):
                raise ExerciseFailed("m_new is the larger of the old running max and this tile's max, row by row")
            tile_scores = scores[:, start:start + tile]
            m_safe = torch.where(torch.isfinite(m), m, want[0])  # the old max where there is one
            p_old = torch.exp(tile_scores - m_safe[:, None])  # may overflow, as such an answer's sums do
            alpha = torch.exp(m - want[0])
            if not torch.allclose(got[1], want[1]) and any(
                    torch.allclose(got[1], d + p_old.sum(1)) for d in (denom, denom * alpha)):
                raise ExerciseFailed("this tile's weights were taken under the old max: p = exp(scores - m_new), "
                                     "with the new max, and the old sums rescaled by exp(m_old - m_new)")
            unshifted = not torch.allclose(got[1], want[1]) and torch.allclose(got[1], denom + tile_scores.exp().sum(1))
            if unshifted or not all(torch.isfinite(t).all() for t in got[1:]):
                raise ExerciseFailed("inf or NaN in denom or acc, or exp(scores) summed as they are: exponentiate "
                                     "scores minus the running max (exp(s - m_new)), so no exponent is positive")
            if not torch.allclose(got[1], want[1]):
                raise ExerciseFailed("denom was summed under the old max: scale it by exp(m_old - m_new) before "
                                     "adding this tile's sum")
            if not torch.allclose(got[2], want[2]):
                near = torch.allclose(got[2], acc + torch.exp(scores[:, start:start + tile] - want[0][:, None])
                                      @ v[start:start + tile])
                raise ExerciseFailed("acc must be rescaled by exp(m_old - m_new) too: it holds values weighted "
                                     "under the old max" if near else "acc_new = acc * exp(m_old - m_new) + "
                                     "exp(scores - m_new) @ values (keep it unnormalised; divide by denom at the end)")
            m, denom, acc = want
    return "running max, rescaled sum and accumulator: acc / denom equals softmax(scores) @ V"


# ------------------------------------------------- Exercise 4: HBM traffic of naive vs flash attention


def reference_attention_traffic(seq_len, head_dim, num_heads, dtype_bytes, block_m, *, mistake=None):
    n, d = seq_len, head_dim
    naive = 4 * n * d + (2 if mistake == "scores_once" else 4) * n * n
    if mistake == "kv_once":
        kv_rows = n
    elif mistake == "not_causal":
        kv_rows = n * math.ceil(n / block_m)
    else:
        kv_rows = sum(min(n, m0 + block_m) for m0 in range(0, n, block_m))
    flash = 2 * n * d + (1 if mistake == "k_only" else 2) * kv_rows * d
    scale = (1 if mistake == "no_heads" else num_heads) * (1 if mistake == "elements" else dtype_bytes)
    return {"naive": naive * scale, "flash": flash * scale}


_TRAFFIC_MISTAKES = {
    "scores_once": "the naive kernel writes S, reads it for the softmax, writes P and reads P for P V: 4 N^2, "
                   "not 2 N^2",
    "kv_once": "each query tile streams the keys again: K/V rows are read once per query tile that needs them",
    "not_causal": "causal: query tile i only needs keys up to its last row; later key tiles are skipped",
    "k_only": "the flash kernel streams V as well as K: 2 d bytes per key row read",
    "no_heads": "every head does the same work: multiply by num_heads",
    "elements": "count bytes, not elements: multiply by dtype_bytes",
}


@exercise("15", "attention_traffic", forbidden=("labkit.attention.flash.attention_hbm_bytes",
                                                "labkit_course.grading.labs.lab15.reference_attention_traffic"))
def attention_traffic(ns):
    fn = require(ns, "attention_traffic")
    rng = seeded_random(15)
    cases = [(128, 64, 1, 2, 64), (4096, 64, 9, 2, 128), (100, 32, 2, 4, 64), (1, 16, 1, 2, 16), (64, 64, 1, 2, 64)]
    cases += [(rng.randint(1, 3000), rng.choice([32, 64, 128]), rng.randint(1, 16), rng.choice([1, 2, 4]),
               rng.choice([16, 64, 128])) for _ in range(20)]
    for case in cases:
        got = fn(*case)
        if not isinstance(got, dict) or set(got) != {"naive", "flash"}:
            raise ExerciseFailed(f"return a dict with the keys 'naive' and 'flash', got {got!r}")
        if not all(type(v) is int for v in got.values()):
            raise ExerciseFailed(f"return the byte counts as ints (bytes are whole; use // or int arithmetic), "
                                 f"got {got!r}")
        want = reference_attention_traffic(*case)
        if got == want:
            continue
        for mistake, why in _TRAFFIC_MISTAKES.items():
            theirs = reference_attention_traffic(*case, mistake=mistake)
            if got == theirs and theirs != want:
                raise ExerciseFailed(why)
        raise ExerciseFailed(f"seq_len, head_dim, num_heads, dtype_bytes, block_m = {case}: expected {want}, got {got}")
    return "naive 4Nd + 4N^2, flash 2Nd + 2d x (keys each query tile reads), times heads and bytes"


# ----------------------------------------------------------------------------------- knowledge check

@exercise("15", "knowledge_check")
def knowledge_check(ns):
    from labkit.model.random_weights import SMOLLM2_135M as c
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    traffic = reference_attention_traffic(4096, 64, 1, 2, 128)
    return grade_answers(ns, {
        1: Number(2 * c.num_layers * 100 * c.hidden_size * 2, "'What the all-reduce costs'"),
        2: Choice("b", "'Which heads go where'"),
        3: Number(round(traffic["naive"] / traffic["flash"], 1), "'Memory traffic on paper'", rel_tol=0.01),
        4: Choice("c", "'Column, then row'"),
        5: Choice("a", "'The online softmax, one tile at a time'"),
    })
