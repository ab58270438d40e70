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

Two transports, the cost model's choice (`tfs.exchange.cost.sharded_transport_costs`):

* `"alltoall"`: TensorFlow's `CollectiveAllToAllV2` (kernels on CPU and GPU;
  across workers its generic implementation, NCCL's on GPUs with the NCCL
  hint), on the strategy's own collective group. The collective needs equal
  chunks, so the replicas first agree on the largest per-owner bucket (one
  scalar all-reduce) and pad to it; each owner then receives only its own
  keys and sends back only their rows. It has no gradient in TensorFlow:
  the backward pass is the same all-to-all of the gradients, in the same
  slots. Four rendezvous per step.
* `"gather"`: the replicas all-gather their distinct ids; each owner reads
  the rows it holds among all of them, and an all-reduce of those rows
  (zeros where another replica owns the id) gives every replica its rows;
  backward, the gradients are all-gathered and each owner keeps its own.
  Every replica receives the global batch's ids and rows, and each
  all-gather of unequal parts is two rendezvous: five per step.

The all-to-all moves fewer bytes in fewer rendezvous at every size, so
`transport_for` takes it in traced steps; `transport_scope` forces either
(B12 times both).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.exchange.cost import sharded_transport_costs
from tf_sharded.table import registry
from tf_sharded.table.lookup import device_rows, lookup_by_row_shape
from tf_sharded.table.norms import clip_rows
from tf_sharded.table.remote import is_remote, sum_over_workers
from tf_sharded.table.sharded_variable import FIXED

ALLTOALL, GATHER = "alltoall", "gather"
TRANSPORTS = (ALLTOALL, GATHER)
_FORCED = []  # the innermost transport_scope's transport (module-wide: replica functions run in other threads)


@contextlib.contextmanager
def transport_scope(transport: str):
    """Steps traced inside the block look sharded tables up across workers by `transport` ("alltoall" or
    "gather") instead of the cost model's choice."""
    if transport not in TRANSPORTS:
        raise ValueError(f"Argument `transport` must be one of {TRANSPORTS}. Received: transport={transport!r}")
    _FORCED.append(transport)
    try:
        yield
    finally:
        _FORCED.pop()


def transport_for(replicas: int, row_bytes: int, bound: Optional[int]) -> str:
    """The transport of one group's lookup: a `transport_scope`'s, else the cheaper by the cost model at
    `bound` distinct keys per replica (1 if unknown), keys spread evenly over the owners.

    Executed eagerly by several replicas of one worker, the all-to-all did not
    complete here, so an eager step takes the gather form (whose all-gather
    TensorFlow refuses in eager mode with its own error).
    """
    if tf.executing_eagerly():
        return GATHER
    if _FORCED:
        return _FORCED[-1]
    costs = sharded_transport_costs(replicas, bound or 1, row_bytes)
    return min(costs, key=costs.get)


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
      gradient to its owner. The transport is `transport_for`'s choice.
    """
    ctx = tf.distribute.get_replica_context()
    route = (tf.constant(starts, tf.int64), tf.constant(owners, tf.int32), tf.constant(shifts, tf.int64))
    row_bytes = tf.as_dtype(dtype).size * (tf.TensorShape(row_shape).num_elements() or 1)
    transport = transport_for(ctx.num_replicas_in_sync, row_bytes, bound)
    exchange = _all_to_all if transport == ALLTOALL else _gather_reduce
    with tf.name_scope(f"tfs_workers_{transport}"):
        return tf.ensure_shape(exchange(ctx, uniq, route, read_held, list(row_shape), dtype), [None] + list(row_shape))


def _read_owned(candidates, asked, route, read_held):
    """`(which, count, rows)` of the keys at positions `asked` of `candidates`, all held here: each one's
    position among their distinct keys, how many distinct keys, and those keys' rows (read once each)."""
    keys, which = tf.unique(tf.gather(candidates, asked), out_idx=tf.int32)
    _, shard, row = _route(keys, *route)
    return which, tf.size(keys), read_held(shard, row)


def _dense(upstream, n):
    """The gradient of `n` rows as one dense tensor (an `IndexedSlices` summed per row)."""
    if isinstance(upstream, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(upstream.values, upstream.indices, n)
    return upstream


def _all_to_all(ctx, uniq, route, read_held, row_shape, dtype):
    """`exchange_rows` over `CollectiveAllToAllV2`: each owner receives only its own keys, sends back only their rows.

    Forward: the keys are bucketed by owner into `replicas` chunks of one
    length, the largest bucket of any replica (one scalar all-reduce; the
    collective needs equal chunks), padded with -1; one all-to-all sends
    chunk `r` to replica `r`, which reads the rows of the keys it received
    (zeros at padding), and a second one returns them in the same slots.
    Backward: the row gradients travel in those slots to the owners, which
    sum them per distinct row.
    """
    replicas = ctx.num_replicas_in_sync
    strategy = ctx.strategy
    owner, _, _ = _route(uniq, *route)
    bucket = tf.math.bincount(owner, minlength=replicas, maxlength=replicas)
    # Every replica's largest bucket, by one all-reduce of each at its replica's position (the strategies
    # reduce by SUM or MEAN only); at least one slot: a collective to which every replica sends nothing never
    # completes.
    me = ctx.replica_id_in_sync_group
    largest = tf.one_hot(me, replicas, on_value=tf.reduce_max(bucket), off_value=0, dtype=tf.int32)
    chunk = tf.maximum(tf.reduce_max(ctx.all_reduce(tf.distribute.ReduceOp.SUM, largest)), 1)
    order = tf.argsort(owner, stable=True)
    first = tf.math.cumsum(bucket, exclusive=True)
    sorted_owner = tf.gather(owner, order)
    in_bucket = tf.range(tf.size(uniq)) - tf.gather(first, sorted_owner)
    slot = tf.scatter_nd(order[:, None], sorted_owner * chunk + in_bucket, tf.shape(owner))  # uniq[i]'s slot
    slots = replicas * chunk
    sent = tf.tensor_scatter_nd_update(tf.fill([slots], tf.constant(-1, tf.int64)), slot[:, None], uniq)
    received = tf.reshape(_compat.collective_all_to_all(strategy, tf.reshape(sent, [replicas, chunk])), [-1])
    asked = tf.where(received >= 0)[:, 0]  # slots that carry a key held here
    which, owned, held = _read_owned(received, asked, route, read_held)
    slots_shape = tf.concat([[slots], tf.constant(row_shape, tf.int32)], 0)

    def travel(rows):
        """`[slots] + row_shape` rows exchanged chunk for chunk."""
        out = _compat.collective_all_to_all(strategy, tf.reshape(rows, [replicas, -1]))
        return tf.reshape(out, slots_shape)

    @tf.custom_gradient
    def to_replicas(held):
        answered = tf.scatter_nd(asked[:, None], tf.gather(held, which), tf.cast(slots_shape, tf.int64))
        rows = tf.gather(travel(answered), slot)

        def home(upstream):
            grads = travel(tf.scatter_nd(slot[:, None], _dense(upstream, tf.size(uniq)), slots_shape))
            return tf.math.unsorted_segment_sum(tf.gather(grads, asked), which, owned)

        return rows, home

    return to_replicas(tf.cast(held, dtype))


def _gather_reduce(ctx, uniq, route, read_held, row_shape, dtype):
    """`exchange_rows` over an all-gather of ids, an all-reduce of rows and an all-gather of gradients.

    Forward: the replicas all-gather their distinct keys; each owner reads
    its rows among all of them, and an all-reduce of those rows (zeros
    where another replica owns the key) gives every replica its rows.
    Backward: the gradients are all-gathered and each owner sums its own per
    distinct row. Each replica's keys end with a marker (-1): a collective to
    which every replica sends nothing never completes (a step whose feature
    has no id anywhere), and the markers tell where each replica's keys
    start.
    """
    me = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
    n = tf.size(uniq)
    every = ctx.all_gather(tf.concat([uniq, [-1]], 0), 0)  # every replica's keys and marker, in replica order
    ends = tf.where(every < 0)[:, 0]
    start = tf.concat([[-1], ends], 0)[me] + 1
    owner, _, _ = _route(every, *route)
    asked = tf.where(tf.equal(owner, me))[:, 0]  # positions in `every` of the keys held here
    which, owned, held = _read_owned(every, asked, route, read_held)
    total = tf.concat([tf.shape(every, out_type=tf.int64), tf.constant(row_shape, tf.int64)], 0)
    marker_row = tf.zeros([1] + row_shape, dtype)

    @tf.custom_gradient
    def to_replicas(held):
        answered = tf.scatter_nd(asked[:, None], tf.gather(held, which), total)
        rows = ctx.all_reduce(tf.distribute.ReduceOp.SUM, answered)[start : start + tf.cast(n, tf.int64)]

        def home(upstream):
            every_grad = ctx.all_gather(tf.concat([_dense(upstream, n), marker_row], 0), 0)
            return tf.math.unsorted_segment_sum(tf.gather(every_grad, asked), which, owned)

        return rows, home

    return to_replicas(tf.cast(held, dtype))


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
    lambda pairs, max_norm, training: lookup_by_row_shape(pairs, max_norm, remote_rows=rows_over_workers),
)
