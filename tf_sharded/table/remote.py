"""Shards held by other workers: a table sharded over the replicas of several processes.

Under MultiWorkerMirroredStrategy a `placement="sharded"` table has one shard
per replica (a dynamic table: one per worker), and each worker creates only
its own. The others are `RemoteShard`s, of either kind of table: they answer
what a table asks of a shard's metadata (shape, dtype, device, trainable,
name) and hold no memory. Every worker runs the
same program, so what needs another worker's rows is done by all of them at
once, over the strategy's collectives:

* a whole-table read (`read_value`, a checkpoint slice) sums each worker's
  contribution, its own rows in place and zeros elsewhere (`sum_over_workers`,
  the one reduction over the workers, which dynamic tables' sizes and reads
  use too);
* a write (assign, scatter, restore) applies, on each worker, the part that
  its own shard holds, and skips the rest;
* a lookup of fixed rows goes through `tf_sharded.exchange.workers`, a
  dynamic table's through `tf_sharded.table.dynamic.table` (its keys
  all-gathered, each owner's rows summed by `sum_over_workers`).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_sharded.table.segment import RowSegment


@dataclasses.dataclass(frozen=True, eq=False)
class RemoteShard:
    """Shard of a table held by another worker (a fixed table's variable, a dynamic table's row pool): its
    metadata only.

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


def first_of_worker(ctx) -> tf.Tensor:
    """Whether this replica is its worker's first (TensorFlow numbers a worker's `L` replicas `w * L + l`):
    with several replicas per worker, it speaks for the worker's shards in collectives over the replicas."""
    local = len(ctx.strategy.extended.worker_devices)
    return tf.equal(ctx.replica_id_in_sync_group % local, 0)


def sum_over_workers(strategy, value: tf.Tensor) -> tf.Tensor:
    """The sum over the workers of each one's `value`, on every worker: every worker must call it, in the
    same order.

    Each worker passes what it holds (its rows in place, zeros for the others'
    rows; its count of keys), so that the sum is the whole, everywhere. In a
    replica context it is the replicas' all-reduce (differentiable: the
    gradient is the all-reduce of the sum's gradients), in which a worker's
    first replica speaks for the worker and its others give zeros; outside,
    the strategy's reduce. A value of rank 1 or more travels with one row of
    zeros more: a collective to which every worker sends nothing never
    completes.
    """
    value = tf.convert_to_tensor(value)
    padded = value.shape.rank != 0
    if padded:
        value = tf.concat([value, tf.zeros(tf.concat([[1], tf.shape(value)[1:]], 0), value.dtype)], 0)
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and not tf.distribute.in_cross_replica_context() and ctx.num_replicas_in_sync > 1:
        if len(ctx.strategy.extended.worker_devices) > 1:
            value = tf.where(first_of_worker(ctx), value, tf.zeros_like(value))
        total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)
    else:
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
    return total[:-1] if padded else total
