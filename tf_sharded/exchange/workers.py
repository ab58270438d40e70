"""Lookups of tables sharded over the workers of MultiWorkerMirroredStrategy: ids out, rows back, gradients home.

With `placement="sharded"` across processes, replica `r` holds shard `r`
of each table, and a worker only its replicas' shards
(`tf_sharded.table.remote`). A step's
lookup of a group of such tables (one id space: `tf_sharded.table.lookup`)
is an all-to-all made of two of TensorFlow's collectives, which run on CPU
and GPU alike:

* forward: the replicas all-gather their distinct ids; each owner reads the
  rows it holds among all of them, and an all-reduce of those rows (zeros
  where another worker owns the id) gives every replica its rows;
* backward: the replicas all-gather their rows' gradients; each owner keeps
  those of its own rows and sums them per distinct row. The shard's gradient
  is then already the global batch's sum: it goes to the optimizer as it is
  (`tfs.exchange.all_reduce_gradients` passes it through, or with several
  replicas on a worker hands every one of them the owner's), which updates
  each row once, on its owner.

One id gather, one row all-reduce and one gradient gather per group and
step carry every table of the group (three rendezvous, whatever the number
of tables). A replica's traffic is the global
batch's distinct ids and their rows, the same order as the mirrored
exchange's all-gather; `CollectiveAllToAllV2` would send each replica only
its own rows but needs equal splits (padding to the largest) and has no
gradient, and RFC.md says why this form was kept.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tf_sharded.table.remote import collective_rows


def _route(keys, starts, owners, shifts):
    """`(owner replica, shard, row in its variable)` of group keys; a marker key (-1) has owner -1."""
    shard = tf.searchsorted(starts[1:], keys, side="right", out_type=tf.int32) if starts.shape[0] > 1 else None
    if shard is None:
        shard = tf.zeros_like(keys, tf.int32)
    owner = tf.where(keys < 0, tf.constant(-1, tf.int32), tf.gather(owners, shard))
    return owner, shard, keys - tf.gather(shifts, shard)


def exchange_rows(
    uniq: tf.Tensor,
    starts,
    owners,
    shifts,
    read_held: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
    row_shape,
    dtype,
) -> tf.Tensor:
    """Rows at this replica's distinct group keys `uniq`, from the workers that hold them.

    Args:
      uniq: int64 distinct keys of the group's id space (this replica's).
      starts: first key of each shard of the group, in key order.
      owners: the replica that holds each shard.
      shifts: per shard, key minus row in its variable.
      read_held: `(shard, row) -> rows` of the shards held here (a gradient
        reaches those variables through it).
      row_shape, dtype: of the group's rows.

    Returns:
      `[size(uniq)] + row_shape` rows, with a gradient that sends each row's
      gradient to its owner.

    Each replica's keys end with a marker (-1): a collective to which every
    replica sends nothing never completes (a step whose feature has no id
    anywhere), and the markers tell where each replica's keys start.
    """
    ctx = tf.distribute.get_replica_context()
    starts = tf.constant(starts, tf.int64)
    owners, shifts = tf.constant(owners, tf.int32), tf.constant(shifts, tf.int64)
    me = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
    n = tf.size(uniq)
    every = ctx.all_gather(tf.concat([uniq, [-1]], 0), 0)  # every replica's keys and marker, in replica order
    ends = tf.where(every < 0)[:, 0]
    start = tf.concat([[-1], ends], 0)[me] + 1
    owner, _, _ = _route(every, starts, owners, shifts)
    asked = tf.where(tf.equal(owner, me))[:, 0]  # positions in `every` of the keys held here
    keys, which = tf.unique(tf.gather(every, asked), out_idx=tf.int32)
    _, shard, row = _route(keys, starts, owners, shifts)
    held = read_held(shard, row)
    total = tf.concat([tf.shape(every, out_type=tf.int64), tf.constant(list(row_shape), tf.int64)], 0)
    marker_row = tf.zeros([1] + list(row_shape), dtype)

    @tf.custom_gradient
    def to_replicas(held):
        answered = tf.scatter_nd(asked[:, None], tf.gather(held, which), total)
        rows = ctx.all_reduce(tf.distribute.ReduceOp.SUM, answered)[start : start + tf.cast(n, tf.int64)]

        def home(upstream):
            if isinstance(upstream, tf.IndexedSlices):
                upstream = tf.math.unsorted_segment_sum(upstream.values, upstream.indices, n)
            every_grad = ctx.all_gather(tf.concat([upstream, marker_row], 0), 0)
            return tf.math.unsorted_segment_sum(tf.gather(every_grad, asked), which, tf.size(keys))

        return rows, home

    with tf.name_scope("tfs_workers_exchange"):
        return tf.ensure_shape(to_replicas(tf.cast(held, dtype)), [None] + list(row_shape))


def gather_everywhere(uniq, starts, owners, shifts, read_held, row_shape, strategy, mine: range) -> tf.Tensor:
    """Rows at `uniq` outside a replica context: every worker asks for the same keys (it runs the same program),
    each gives the rows its replicas (`mine`, replica ids) hold and zeros for the others, and one all-reduce
    sums them (with one row more, so that it is never empty). No gradient."""
    starts = tf.constant(starts, tf.int64)
    owners, shifts = tf.constant(owners, tf.int32), tf.constant(shifts, tf.int64)
    owner, shard, row = _route(uniq, starts, owners, shifts)
    here = tf.where((owner >= mine.start) & (owner < mine.stop))[:, 0]
    held = read_held(tf.gather(shard, here), tf.gather(row, here))
    total = tf.concat([tf.shape(uniq, out_type=tf.int64) + 1, tf.constant(list(row_shape), tf.int64)], 0)
    contribution = tf.scatter_nd(here[:, None], tf.stop_gradient(held), total)
    return collective_rows(strategy, contribution)[:-1]
