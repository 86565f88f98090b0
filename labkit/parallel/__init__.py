"""Tensor parallelism: one model's weight matrices split across processes that all-reduce partial sums."""

from labkit.parallel.launch import run_ranks
from labkit.parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_columns, shard_rows
from labkit.parallel.sharded_model import AllReduce, shard_decoder

__all__ = ["AllReduce", "ColumnParallelLinear", "RowParallelLinear", "run_ranks", "shard_columns",
           "shard_decoder", "shard_rows"]
