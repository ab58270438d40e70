"""Lookups of tables sharded over the workers of MultiWorkerMirroredStrategy: ids out, rows back, gradients home.

With `placement="sharded"` across processes, replica `r` holds shard `r`
of each table, and a worker only its replicas' shards
(`tf_sharded.table.remote`). A step's lookup of a group of such tables (one
id space: `tf_sharded.table.lookup`) sends each distinct key to the replica
that owns it and its row back; backward, each row's gradient goes to its
owner, which sums it per distinct row. The shard's gradient is then
already the global batch's sum: it goes to the optimizer as it is
(`tfs.exchange.all_reduce_gradients` passes it through, or with several
replicas on a worker hands every one of them the owner's), which updates
each row once, on its owner. One exchange per group and step carries every
table of the group.

The exchange is the one every table sharded over workers uses
(`tf_sharded.table.transport`: the all-to-all, or the gather form that
`transport_scope("gather")` forces); this module routes fixed rows through
it, and has the cost model (`tfs.exchange.cost.sharded_transport_costs`)
choose its transport. B12 times both.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.exchange.cost import sharded_transport_costs
from tf_sharded.table import registry, transport
from tf_sharded.table.lookup import device_rows, lookup_by_row_shape
from tf_sharded.table.norms import clip_rows
from tf_sharded.table.remote import is_remote, sum_over_workers
from tf_sharded.table.sharded_variable import FIXED
from tf_sharded.table.transport import ALLTOALL, GATHER, TRANSPORTS, transport_for, transport_scope  # noqa: F401

# The transport's choice is the cost model's.
transport.price_with(sharded_transport_costs)


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
    bound: Optional[int] = None,
) -> tf.Tensor:
    """Rows at this replica's distinct group keys `uniq`, from the replicas that hold them.

    Args:
      uniq: int64 distinct keys of the group's id space (this replica's).
      starts: first key of each shard of the group, in key order.
      owners: the replica that holds each shard.
      shifts: per shard, key minus row in its variable.
      read_held: `(shard, row) -> rows` of the shards held here (a gradient
        reaches those variables through it).
      row_shape, dtype: of the group's rows.
      bound: the number of keys before de-duplication, if static (the cost
        model's estimate of `size(uniq)`).

    Returns:
      `[size(uniq)] + row_shape` rows, with a gradient that sends each row's
      gradient to its owner (`table.transport.exchange`).
    """
    route = (tf.constant(starts, tf.int64), tf.constant(owners, tf.int32), tf.constant(shifts, tf.int64))
    owner, _, _ = _route(uniq, *route)

    def serve(columns, _):
        """The rows of the keys this replica received, each read once."""
        keys, which = tf.unique(columns[0], out_idx=tf.int32)
        _, shard, row = _route(keys, *route)
        return which, tf.size(keys), read_held(shard, row)

    return transport.exchange([uniq], owner, serve, row_shape, dtype, bound=bound)


def gather_everywhere(uniq, starts, owners, shifts, read_held, row_shape, strategy, mine: range) -> tf.Tensor:
    """Rows at `uniq` outside a replica context: every worker asks for the same keys (it runs the same program),
    each gives the rows its replicas (`mine`, replica ids) hold and zeros for the others, and one all-reduce
    sums them (`sum_over_workers`). No gradient."""
    starts = tf.constant(starts, tf.int64)
    owners, shifts = tf.constant(owners, tf.int32), tf.constant(shifts, tf.int64)
    owner, shard, row = _route(uniq, starts, owners, shifts)
    here = tf.where((owner >= mine.start) & (owner < mine.stop))[:, 0]
    held = read_held(tf.gather(shard, here), tf.gather(row, here))
    total = tf.concat([tf.shape(uniq, out_type=tf.int64), tf.constant(list(row_shape), tf.int64)], 0)
    contribution = tf.scatter_nd(here[:, None], tf.stop_gradient(held), total)
    return sum_over_workers(strategy, contribution)


def rows_over_workers(tables, uniq, starts, owners, shift, placed, max_norm, bound):
    """Rows at a lookup group's distinct keys `uniq` (`table.lookup.lookup_group`) when its shards are held by
    several workers: in a replica context by the exchange (`exchange_rows`), else `gather_everywhere`."""
    held = list({id(v): v for v, _ in placed if not is_remote(v)}.values())
    position = {id(v): i for i, v in enumerate(held)}
    slot = tf.constant([position.get(id(v), 0) for v, _ in placed], tf.int32)
    row_shape = tables[0].shape[1:].as_list()

    def read_held(shard, row):
        if not held:
            return tf.zeros(tf.concat([tf.shape(row), tf.constant(row_shape, tf.int32)], 0), tables[0].dtype)
        # Every shard this worker holds is read (each on its own device, the replica's asks only for its own):
        # its other replicas' shards get an empty gradient from this replica, and every local replica
        # trains the same variables, as Keras's optimizer asks.
        return clip_rows(device_rows(held, row, tf.gather(slot, shard)), max_norm, list(range(1, len(row_shape) + 1)))

    strategy = tables[0].strategy
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.strategy is strategy:
        return exchange_rows(uniq, starts, owners, shift, read_held, row_shape, tables[0].dtype, bound)
    first, local = _compat.cluster_replicas(strategy)[0], len(strategy.extended.worker_devices)
    return gather_everywhere(uniq, starts, owners, shift, read_held, row_shape, strategy, range(first, first + local))


registry.register_lookup(
    registry.WORKERS,
    FIXED,
    lambda pairs, max_norm, training: lookup_by_row_shape(pairs, max_norm, rows_over_workers, training),
)
