"""Column- and row-parallel linear layers (Megatron-LM's split of a transformer's matrices).

A linear layer computes y = x W^T with W of shape [out_features, in_features] (torch's layout).
Column-parallel splits the output features: rank r keeps rows r of W (the "columns" of the maths
form y = x A, A = W^T), sees the whole input and produces its slice of y, no communication.
Row-parallel splits the input features: rank r keeps its slice of W's columns, reads its slice of
x and produces a *partial* y of full width; the true y is the sum over ranks, one all-reduce.
Chaining the two (q/k/v then o_proj, gate/up then down) keeps the in-between activation sharded,
so a transformer block needs exactly two all-reduces, one after attention and one after the MLP.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def shard_bounds(size: int, rank: int, world_size: int, what: str,
                 sizes: Sequence[int] | None = None) -> tuple[int, int]:
    """[start, end) of rank `rank`'s slice of `size` features: an even split, or `sizes[r]` features for rank r.

    Uneven sizes let a shard follow a unit larger than one feature (whole K/V groups of heads) when the
    units do not divide by world_size.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if sizes is None:
        if size % world_size:
            raise ValueError(f"{what} ({size}) does not split evenly across {world_size} ranks")
        sizes = [size // world_size] * world_size
    elif len(sizes) != world_size or sum(sizes) != size or min(sizes) < 0:
        raise ValueError(f"sizes {list(sizes)} must be {world_size} non-negative counts summing to {what} ({size})")
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def shard_columns(weight: torch.Tensor, rank: int, world_size: int,
                  sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the output features: rows of a [out, in] weight (or a bias)."""
    start, end = shard_bounds(weight.shape[0], rank, world_size, "out_features", sizes)
    return weight[start:end].clone()


def shard_rows(weight: torch.Tensor, rank: int, world_size: int,
               sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the input features: columns of a [out, in] weight."""
    start, end = shard_bounds(weight.shape[1], rank, world_size, "in_features", sizes)
    return weight[:, start:end].clone()


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a linear layer: full input in, sharded output out."""

    def __init__(self, linear: nn.Linear, rank: int, world_size: int, sizes: Sequence[int] | None = None):
        super().__init__()
        self.weight = nn.Parameter(shard_columns(linear.weight.detach(), rank, world_size, sizes),
                                   requires_grad=False)
        self.bias = (None if linear.bias is None else
                     nn.Parameter(shard_columns(linear.bias.detach(), rank, world_size, sizes), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of a linear layer: sharded input in, the all-reduced full output out.

    The bias is added once, after the sum (added on every rank before it, it would count world_size times).
    However uneven the input slices, every rank's partial output has the full width, so each all-reduce
    carries the same payload on every rank.
    """

    def __init__(self, linear: nn.Linear, rank: int, world_size: int,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor], sizes: Sequence[int] | None = None):
        super().__init__()
        self.weight = nn.Parameter(shard_rows(linear.weight.detach(), rank, world_size, sizes), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
