"""Column- and row-parallel linear layers (Megatron-LM's split of a transformer's matrices).

A linear layer computes y = x W^T with W of shape [out_features, in_features] (torch's layout).
Column-parallel splits the output features: rank r keeps rows r of W (the "columns" of the maths
form y = x A, A = W^T), sees the whole input and produces its slice of y, no communication.
Row-parallel splits the input features: rank r keeps its slice of W's columns, reads its slice of
x and produces a *partial* y of full width; the true y is the sum over ranks, one all-reduce.
Chaining the two (q/k/v then o_proj, gate/up then down) keeps the in-between activation sharded,
so a transformer block needs exactly two all-reduces, one after attention and one after the MLP.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _check_split(size: int, world_size: int, rank: int, what: str) -> int:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if size % world_size:
        raise ValueError(f"{what} ({size}) does not split evenly across {world_size} ranks")
    return size // world_size


def shard_columns(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the output features: rows of a [out, in] weight (or a bias)."""
    part = _check_split(weight.shape[0], world_size, rank, "out_features")
    return weight[rank * part:(rank + 1) * part].clone()


def shard_rows(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the input features: columns of a [out, in] weight."""
    part = _check_split(weight.shape[1], world_size, rank, "in_features")
    return weight[:, rank * part:(rank + 1) * part].clone()


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a linear layer: full input in, sharded output out."""

    def __init__(self, linear: nn.Linear, rank: int, world_size: int):
        super().__init__()
        self.weight = nn.Parameter(shard_columns(linear.weight.detach(), rank, world_size), requires_grad=False)
        self.bias = (None if linear.bias is None else
                     nn.Parameter(shard_columns(linear.bias.detach(), rank, world_size), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of a linear layer: sharded input in, the all-reduced full output out.

    The bias is added once, after the sum (added on every rank before it, it would count world_size times).
    """

    def __init__(self, linear: nn.Linear, rank: int, world_size: int,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.weight = nn.Parameter(shard_rows(linear.weight.detach(), rank, world_size), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
