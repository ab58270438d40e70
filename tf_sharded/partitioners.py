"""Partitioners: policies that pick a shard count from a table's size.

They follow TensorFlow's partitioner protocol (`partitioner(shape, dtype)`
returns per-axis shard counts, only axis 0 split), so each one can also be
passed as `ParameterServerStrategy(variable_partitioner=...)`, and TF's own
`tf.distribute.experimental.partitioners.*` objects are accepted wherever
these are.
"""

from __future__ import annotations

import math
from typing import Optional

import tensorflow as tf

from tf_sharded.errors import positive_int

_TFPartitioner = tf.distribute.experimental.partitioners.Partitioner


def _row_bytes(shape: tf.TensorShape, dtype: tf.DType, bytes_per_string: int) -> int:
    elem = bytes_per_string if dtype == tf.string else tf.as_dtype(dtype).size
    return max(1, elem * math.prod(int(d) for d in shape[1:]))


def _as_result(shape: tf.TensorShape, num_shards: int) -> list:
    rows = int(shape[0])
    return [max(1, min(num_shards, rows))] + [1] * (len(shape) - 1)


class FixedShards(_TFPartitioner):
    """Always `num_shards` shards (fewer if the table has fewer rows).

    Example:

    >>> FixedShards(3)(tf.TensorShape([10, 4]), tf.float32)
    [3, 1]
    """

    def __init__(self, num_shards: int):
        self.num_shards = positive_int("num_shards", num_shards)

    def __call__(self, shape, dtype, axis=0):
        return _as_result(tf.TensorShape(shape), self.num_shards)

    def __repr__(self):
        return f"FixedShards(num_shards={self.num_shards})"


class MinSize(_TFPartitioner):
    """As many shards as possible with every shard at least `min_shard_bytes`.

    Args:
      min_shard_bytes: lower bound on a shard's size in bytes.
      max_shards: upper bound on the shard count.
      bytes_per_string: assumed size of one string element.

    Example:

    >>> MinSize(min_shard_bytes=64, max_shards=8)(tf.TensorShape([10, 4]), tf.float32)
    [2, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        self.min_shard_bytes = positive_int("min_shard_bytes", min_shard_bytes)
        self.max_shards = positive_int("max_shards", max_shards)
        self.bytes_per_string = positive_int("bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype, axis=0):
        shape = tf.TensorShape(shape)
        total = int(shape[0]) * _row_bytes(shape, dtype, self.bytes_per_string)
        return _as_result(shape, min(self.max_shards, max(1, total // self.min_shard_bytes)))

    def __repr__(self):
        return f"MinSize(min_shard_bytes={self.min_shard_bytes}, max_shards={self.max_shards})"


class MaxSize(_TFPartitioner):
    """The fewest shards that keep every shard at most `max_shard_bytes`.

    Args:
      max_shard_bytes: upper bound on a shard's size in bytes.
      max_shards: optional cap on the shard count (wins over the byte bound).
      bytes_per_string: assumed size of one string element.

    Example:

    >>> MaxSize(max_shard_bytes=64)(tf.TensorShape([10, 4]), tf.float32)
    [3, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: Optional[int] = None, bytes_per_string: int = 16):
        self.max_shard_bytes = positive_int("max_shard_bytes", max_shard_bytes)
        self.max_shards = None if max_shards is None else positive_int("max_shards", max_shards)
        self.bytes_per_string = positive_int("bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype, axis=0):
        shape = tf.TensorShape(shape)
        row = _row_bytes(shape, dtype, self.bytes_per_string)
        rows_per_shard = max(1, self.max_shard_bytes // row)
        num = math.ceil(int(shape[0]) / rows_per_shard)
        if self.max_shards is not None:
            num = min(num, self.max_shards)
        return _as_result(shape, num)

    def __repr__(self):
        return f"MaxSize(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards})"
