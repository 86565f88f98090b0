"""Lab 15: sharding a linear layer, a row-parallel forward, the online-softmax tile update, attention traffic."""

import math

import torch

from catalogue import Right, Wrong
from labkit.attention.flash import attention_hbm_bytes
from labkit.parallel.layers import shard_bounds, shard_columns, shard_rows
from labkit_course.grading.labs.lab15 import reference_attention_traffic, reference_shard_linear

# --------------------------------------------------------------------------------------- shard_linear


def shard_by_slices(weight, bias, rank, world_size, mode):
    """The rank's contiguous range of features as plain slices, copied (a view would keep the whole weight alive)."""
    features = weight.shape[0] if mode == "column" else weight.shape[1]
    if features % world_size:
        raise ValueError("features do not split evenly")
    start, stop = rank * features // world_size, (rank + 1) * features // world_size
    if mode == "column":
        return weight[start:stop].clone(), None if bias is None else bias[start:stop].clone()
    return weight[:, start:stop].clone(), bias.clone() if bias is not None and rank == 0 else None


def shard_by_chunk(weight, bias, rank, world_size, mode):
    """torch.chunk, after checking the split is even (chunk alone would hand out ragged shards)."""
    if mode == "row":
        if weight.shape[1] % world_size:
            raise ValueError("in_features do not split evenly")
        return weight.chunk(world_size, dim=1)[rank], (bias if rank == 0 else None)
    if weight.shape[0] % world_size:
        raise ValueError("out_features do not split evenly")
    return weight.chunk(world_size, dim=0)[rank], None if bias is None else bias.chunk(world_size)[rank]


def shard_with(**changes):
    """The right answer with one decision switched to what a student half-remembers."""
    def answer(weight, bias, rank, world_size, mode):
        if changes.get("swap_dims"):
            mode = "row" if mode == "column" else "column"
        w, b = shard_by_slices(weight, bias, rank, world_size, mode)
        if changes.get("strided"):
            w = weight[rank::world_size] if mode == "column" else weight[:, rank::world_size]
        if changes.get("swap_dims"):
            mode = "row" if mode == "column" else "column"
            b = shard_by_slices(weight.T.contiguous(), bias, rank, world_size, mode)[1] if bias is not None else None
        if changes.get("bias_everywhere") and mode == "row":
            b = bias
        if changes.get("row_bias_sliced") and mode == "row" and bias is not None:
            part = bias.shape[0] // world_size
            b = bias[rank * part:(rank + 1) * part] if bias.shape[0] % world_size == 0 else bias
        return w, b
    return answer


def shard_asserting(weight, bias, rank, world_size, mode):
    dim = 0 if mode == "column" else 1
    assert weight.shape[dim] % world_size == 0, "uneven split"
    return shard_by_slices(weight, bias, rank, world_size, mode)


def shard_checking_out_features_only(weight, bias, rank, world_size, mode):
    """Checks the even split on out_features whatever the mode: a row split of uneven in_features drops columns."""
    if weight.shape[0] % world_size:
        raise ValueError("uneven")
    even = weight.shape[1] - weight.shape[1] % world_size  # a row split: the columns past an even split dropped
    return shard_by_slices(weight if mode == "column" else weight[:, :even], bias, rank, world_size, mode)


def shard_by_labkit_bounds(weight, bias, rank, world_size, mode):
    dim = 0 if mode == "column" else 1
    start, end = shard_bounds(weight.shape[dim], rank, world_size, "features")
    w = weight.narrow(dim, start, end - start).clone()
    if mode == "column":
        return w, None if bias is None else bias[start:end].clone()
    return w, (bias.clone() if bias is not None and rank == 0 else None)


def shard_ragged(weight, bias, rank, world_size, mode):
    dim = 0 if mode == "column" else 1
    w = weight.tensor_split(world_size, dim=dim)[rank]
    if mode == "column":
        return w, None if bias is None else bias.tensor_split(world_size)[rank]
    return w, bias if rank == 0 else None


# ------------------------------------------------------------------------------- row_parallel_forward


def row_forward_slices(x, weight, bias, world_size):
    part = weight.shape[1] // world_size
    partials = [x[:, r * part:(r + 1) * part] @ weight[:, r * part:(r + 1) * part].T for r in range(world_size)]
    out = sum(partials)
    return (out if bias is None else out + bias), partials


def row_forward_bias_rank0(x, weight, bias, world_size):
    """Rank 0 keeps the bias (as sharding does), so its partial carries it into the sum."""
    out, partials = row_forward_slices(x, weight, None, world_size)
    if bias is not None:
        partials[0] = partials[0] + bias
    return sum(partials), partials


def row_forward_chunks(x, weight, bias, world_size):
    partials = [xs @ ws.T for xs, ws in zip(x.chunk(world_size, dim=-1), weight.chunk(world_size, dim=1),
                                            strict=True)]
    out = torch.stack(partials).sum(0)  # the all-reduce
    if bias is not None:
        out = out + bias
    return out, partials


def row_forward_bias_each(x, weight, bias, world_size):
    _, partials = row_forward_slices(x, weight, None, world_size)
    partials = [p + bias if bias is not None else p for p in partials]
    return sum(partials), partials


def row_forward_mean(x, weight, bias, world_size):
    _, partials = row_forward_slices(x, weight, None, world_size)
    out = torch.stack(partials).mean(0)
    return (out if bias is None else out + bias), partials


def row_forward_output_slices(x, weight, bias, world_size):
    """Column-parallel thinking: each rank computes a slice of the output."""
    partials = [x @ w.T for w in weight.chunk(world_size, dim=0)]
    out = torch.cat(partials, dim=-1)
    return (out if bias is None else out + bias), partials


def row_forward_full_x(x, weight, bias, world_size):
    """Keeps x whole and zero-pads the other ranks' columns of W (same partial), but adds the bias in each."""
    part = weight.shape[1] // world_size
    partials = []
    for r in range(world_size):
        w = torch.zeros_like(weight)
        w[:, r * part:(r + 1) * part] = weight[:, r * part:(r + 1) * part]
        partials.append(x @ w.T + (bias if bias is not None else 0))
    return sum(partials), partials


def row_forward_labkit_shards(x, weight, bias, world_size):
    partials = [xs @ shard_rows(weight, r, world_size).T for r, xs in enumerate(x.chunk(world_size, dim=-1))]
    return sum(partials) + (0 if bias is None else bias), partials


def row_forward_no_partials(x, weight, bias, world_size):
    out, _ = row_forward_slices(x, weight, bias, world_size)
    return out, []


# ------------------------------------------------------------------------------ online_softmax_update


def online_update(m, denom, acc, scores, values):
    m_new = torch.maximum(m, scores.amax(dim=1))
    p = torch.exp(scores - m_new[:, None])
    alpha = torch.exp(m - m_new)
    return m_new, denom * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values


def online_update_row_loop(m, denom, acc, scores, values):
    """Row by row, in plain Python over the rows."""
    m_new, denom_new, acc_new = m.clone(), denom.clone(), acc.clone()
    for i in range(scores.shape[0]):
        top = max(m[i], scores[i].max())
        weights = torch.exp(scores[i] - top)
        scale = torch.exp(m[i] - top)
        m_new[i] = top
        denom_new[i] = denom[i] * scale + weights.sum()
        acc_new[i] = acc[i] * scale + weights @ values
    return m_new, denom_new, acc_new


def online_no_rescale_acc(m, denom, acc, scores, values):
    m_new, denom_new, _ = online_update(m, denom, acc, scores, values)
    return m_new, denom_new, acc + torch.exp(scores - m_new[:, None]) @ values


def online_no_rescale_denom(m, denom, acc, scores, values):
    m_new, _, acc_new = online_update(m, denom, acc, scores, values)
    return m_new, denom + torch.exp(scores - m_new[:, None]).sum(1), acc_new


def online_old_max_weights(m, denom, acc, scores, values):
    """The tile's weights taken under the old max (the new one where there is none yet)."""
    m_new = torch.maximum(m, scores.amax(dim=1))
    p = torch.exp(scores - torch.where(torch.isfinite(m), m, m_new)[:, None])
    alpha = torch.exp(m - m_new)
    return m_new, denom * alpha + p.sum(1), acc * alpha[:, None] + p @ values


def online_no_max(m, denom, acc, scores, values):
    p = torch.exp(scores)
    return torch.maximum(m, scores.amax(dim=1)), denom + p.sum(1), acc + p @ values


def online_tile_max_only(m, denom, acc, scores, values):
    m_tile = scores.amax(dim=1)
    p = torch.exp(scores - m_tile[:, None])
    alpha = torch.exp(m - m_tile)
    return m_tile, denom * alpha + p.sum(1), acc * alpha[:, None] + p @ values


def online_inverted_alpha(m, denom, acc, scores, values):
    m_new = torch.maximum(m, scores.amax(dim=1))
    p = torch.exp(scores - m_new[:, None])
    alpha = torch.exp(m_new - m)
    alpha = torch.where(torch.isfinite(alpha), alpha, torch.zeros_like(alpha))
    return m_new, denom * alpha + p.sum(1), acc * alpha[:, None] + p @ values


def online_inverted_alpha_raw(m, denom, acc, scores, values):
    m_new = torch.maximum(m, scores.amax(dim=1))
    p = torch.exp(scores - m_new[:, None])
    alpha = torch.exp(m_new - m)
    return m_new, denom * alpha + p.sum(1), acc * alpha[:, None] + p @ values


def online_normalised_acc(m, denom, acc, scores, values):
    m_new, denom_new, acc_new = online_update(m, denom * 0 + 1, acc, scores, values)
    m_new, denom_new, _ = online_update(m, denom, acc, scores, values)
    return m_new, denom_new, acc_new / denom_new[:, None]


def online_softmax_builtin(m, denom, acc, scores, values):
    m_new, denom_new, _ = online_update(m, denom, acc, scores, values)
    return m_new, denom_new, acc * torch.exp(m - m_new)[:, None] + torch.softmax(scores, 1) * \
        (torch.exp(scores - m_new[:, None]).sum(1, keepdim=True)) @ values


# ---------------------------------------------------------------------------------- attention_traffic


def traffic_formula(seq_len, head_dim, num_heads, dtype_bytes, block_m):
    n, d = seq_len, head_dim
    tiles = math.ceil(n / block_m)
    # tile i reads (i + 1) * block_m keys, the last one only up to n
    kv_rows = sum(min(n, (i + 1) * block_m) for i in range(tiles))
    return {"naive": (4 * n * d + 4 * n * n) * num_heads * dtype_bytes,
            "flash": (2 * n * d + 2 * kv_rows * d) * num_heads * dtype_bytes}


def traffic_by_kernel_steps(seq_len, head_dim, num_heads, dtype_bytes, block_m):
    """Add up every load and store, kernel by kernel and tile by tile."""
    n, d = seq_len, head_dim
    naive = 0
    naive += 2 * n * d + n * n  # S = Q K^T: read Q and K, write S
    naive += n * n + n * n      # softmax: read S, write P
    naive += n * n + n * d + n * d  # O = P V: read P and V, write O
    flash = 0
    for m0 in range(0, n, block_m):
        rows = min(block_m, n - m0)
        flash += 2 * rows * d  # load this tile of Q, store its O
        flash += 2 * min(n, m0 + block_m) * d  # stream K and V up to the diagonal
    return {"naive": naive * num_heads * dtype_bytes, "flash": flash * num_heads * dtype_bytes}


def traffic_half_right(seq_len, head_dim, num_heads, dtype_bytes, block_m, *, score_passes=4, causal=True,
                       kv_per_tile=True, tensors=2, heads=True, in_bytes=True):
    """The closed form with one term switched to what a student half-remembers."""
    n, d = seq_len, head_dim
    if not kv_per_tile:
        kv_rows = n
    elif causal:
        kv_rows = sum(min(n, m0 + block_m) for m0 in range(0, n, block_m))
    else:
        kv_rows = n * math.ceil(n / block_m)
    scale = (num_heads if heads else 1) * (dtype_bytes if in_bytes else 1)
    return {"naive": (4 * n * d + score_passes * n * n) * scale, "flash": (2 * n * d + tensors * kv_rows * d) * scale}


def traffic_with(**mistake):
    return lambda *args: traffic_half_right(*args, **mistake)


RIGHT = [
    Right("shard_linear", "slices of the rank's range, cloned", shard_by_slices),
    Right("shard_linear", "torch.chunk after a divisibility check", shard_by_chunk),
    Right("row_parallel_forward", "explicit slices", row_forward_slices),
    Right("row_parallel_forward", "chunk, then stack and sum", row_forward_chunks),
    Right("online_softmax_update", "vectorised over rows", online_update),
    Right("online_softmax_update", "a loop over rows", online_update_row_loop),
    Right("attention_traffic", "closed form", traffic_formula),
    Right("attention_traffic", "kernel by kernel, tile by tile", traffic_by_kernel_steps),
]

WRONG = [
    Wrong("shard_linear", "column and row swapped (maths layout)", shard_with(swap_dims=True),
          "torch stores a Linear's weight as [out_features, in_features]"),
    Wrong("shard_linear", "strided shards", shard_with(strided=True), "one contiguous slice"),
    Wrong("shard_linear", "row-parallel bias on every rank", shard_with(bias_everywhere=True),
          "added world_size times"),
    Wrong("shard_linear", "row-parallel bias sliced", shard_with(row_bias_sliced=True), "not a slice of it"),
    Wrong("shard_linear", "ragged shards for uneven splits", shard_ragged, "raise a ValueError"),
    Wrong("shard_linear", "an assert for the uneven split", shard_asserting, "raise a ValueError, not AssertionError"),
    Wrong("shard_linear", "returns only the weight", lambda w, b, r, p, mode: shard_by_slices(w, b, r, p, mode)[0],
          "return a pair"),
    Wrong("shard_linear", "calls labkit's shard_columns",
          lambda w, b, r, p, mode: (shard_columns(w, r, p) if mode == "column" else shard_rows(w, r, p),
                                    shard_by_slices(w, b, r, p, mode)[1]),
          "`shard_columns`", calls="labkit.parallel.layers.shard_columns"),
    Wrong("shard_linear", "the even split checked on out_features in row mode too", shard_checking_out_features_only,
          "6 in_features across 4 ranks do not split evenly"),
    Wrong("shard_linear", "calls labkit's shard_bounds", shard_by_labkit_bounds, "`shard_bounds`",
          calls="labkit.parallel.layers.shard_bounds"),
    Wrong("shard_linear", "imports the grader's reference", lambda *a: reference_shard_linear(*a),
          "`reference_shard_linear`", calls="labkit_course.grading.labs.lab15.reference_shard_linear"),
    Wrong("row_parallel_forward", "bias added on every rank", row_forward_bias_each, "added once, after the sum"),
    Wrong("row_parallel_forward", "bias in rank 0's partial", row_forward_bias_rank0,
          "rank 0's partial includes the bias"),
    Wrong("row_parallel_forward", "partials averaged", row_forward_mean, "averaging them divides"),
    Wrong("row_parallel_forward", "output sliced like column-parallel", row_forward_output_slices,
          "the *full* output width"),
    Wrong("row_parallel_forward", "W padded instead of x sliced, bias in each", row_forward_full_x,
          "added once, after the sum"),
    Wrong("row_parallel_forward", "no partials returned", row_forward_no_partials, "one partial per rank"),
    Wrong("row_parallel_forward", "calls labkit's shard_rows", row_forward_labkit_shards, "`shard_rows`",
          calls="labkit.parallel.layers.shard_rows"),
    Wrong("row_parallel_forward", "returns only the output", lambda *a: row_forward_slices(*a)[0],
          "return (output, partials)"),
    Wrong("online_softmax_update", "acc not rescaled", online_no_rescale_acc, "acc must be rescaled"),
    Wrong("online_softmax_update", "denominator not rescaled", online_no_rescale_denom,
          "denom was summed under the old max"),
    Wrong("online_softmax_update", "the tile's weights under the old max", online_old_max_weights,
          "taken under the old max"),
    Wrong("online_softmax_update", "no max subtracted", online_no_max, "exponentiate scores minus the running max"),
    Wrong("online_softmax_update", "the tile's max, not the running max", online_tile_max_only,
          "larger of the old running max"),
    Wrong("online_softmax_update", "rescale factor inverted, its inf guarded", online_inverted_alpha,
          "the rescale factor is upside down"),
    Wrong("online_softmax_update", "rescale factor inverted", online_inverted_alpha_raw,
          "the rescale factor is upside down"),
    Wrong("online_softmax_update", "acc normalised every tile", online_normalised_acc, "keep it unnormalised"),
    Wrong("online_softmax_update", "calls torch.softmax", online_softmax_builtin, "torch.softmax",
          calls="torch.softmax"),
    Wrong("attention_traffic", "scores counted once", traffic_with(score_passes=2), "4 N^2, not 2 N^2"),
    Wrong("attention_traffic", "K/V read once", traffic_with(kv_per_tile=False), "once per query tile"),
    Wrong("attention_traffic", "every key tile read (not causal)", traffic_with(causal=False),
          "later key tiles are skipped"),
    Wrong("attention_traffic", "K but not V", traffic_with(tensors=1), "V as well as K"),
    Wrong("attention_traffic", "one head", traffic_with(heads=False), "multiply by num_heads"),
    Wrong("attention_traffic", "elements, not bytes", traffic_with(in_bytes=False), "multiply by dtype_bytes"),
    Wrong("attention_traffic", "imports the grader's reference", lambda *a: reference_attention_traffic(*a),
          "`reference_attention_traffic`", calls="labkit_course.grading.labs.lab15.reference_attention_traffic"),
    Wrong("attention_traffic", "float byte counts", lambda *a: {k: float(v) for k, v in traffic_formula(*a).items()},
          "as ints"),
    Wrong("attention_traffic", "returns a tuple", lambda *a: tuple(traffic_formula(*a).values()), "return a dict"),
    Wrong("attention_traffic", "calls labkit's attention_hbm_bytes", lambda *a: attention_hbm_bytes(*a),
          "`attention_hbm_bytes`", calls="labkit.attention.flash.attention_hbm_bytes"),
]
