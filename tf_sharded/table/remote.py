"""Shards held by other workers: a table sharded over the replicas of several processes.

Under MultiWorkerMirroredStrategy a `placement="sharded"` table has one shard
per replica, and each worker creates only those of its own replicas. The others are
`RemoteShard`s: they answer what a table asks of a shard's metadata (shape,
dtype, device, trainable, name) and hold no memory. Every worker runs the
same program, so what needs another worker's rows is done by all of them at
once, over the strategy's collectives:

* a whole-table read (`read_value`, a checkpoint slice) sums each worker's
  contribution, its own rows in place and zeros elsewhere (`collective_rows`);
* a write (assign, scatter, restore) applies, on each worker, the part that
  its own shard holds, and skips the rest;
* a lookup goes through `tf_sharded.exchange.workers`.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_sharded.table.segment import RowSegment


@dataclasses.dataclass(frozen=True, eq=False)
class RemoteShard:
    """Shard of a table held by another worker: its metadata only.

    `device` is the owner's (another process's; nothing here is placed on it).
    """

    shape: tf.TensorShape
    dtype: tf.DType
    device: str
    trainable: bool
    name: str

    def __post_init__(self):
        object.__setattr__(self, "shape", tf.TensorShape(self.shape))
        object.__setattr__(self, "dtype", tf.as_dtype(self.dtype))


def is_remote(shard) -> bool:
    """Whether `shard` (a variable, a segment of one, or a stand-in) lives in another worker."""
    if isinstance(shard, RowSegment):
        shard = shard.storage
    return isinstance(shard, RemoteShard)


def held_shards(variables) -> list:
    """Indices of the shards held here among the `variables` of a table sharded over workers (one per local replica)."""
    return [i for i, v in enumerate(variables) if not is_remote(v)]


def collective_rows(strategy, contribution: tf.Tensor) -> tf.Tensor:
    """The sum over the workers of `contribution`: every worker must call it, in the same order.

    Each worker passes the rows it holds and zeros for the others, so the sum
    is the rows themselves, on every worker.
    """
    return strategy.reduce(tf.distribute.ReduceOp.SUM, contribution, axis=None)
