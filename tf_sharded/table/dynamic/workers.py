"""Dynamic tables sharded over the workers of MultiWorkerMirroredStrategy (`placement="sharded"`).

Worker `r` holds shard `r` (the keys whose hash lands there, their rows and
optimizer columns, its policies' state); the other shards are
`RemoteShard`s (`table.remote`), metadata without memory. Every worker runs the same
program, so whatever needs another worker's keys is done by all at once:

* a training lookup all-gathers the replicas' distinct keys and counts (as
  `dynamic.agree` does for copies), each owner inserts and reads the keys of
  its shard, and one all-reduce of those rows (zeros for other owners' keys)
  gives every replica its rows. The all-reduce's gradient is the all-reduce
  of the rows' gradients, so each owner's pool receives the global batch's
  sum at its rows, which the optimizer applies once, there;
* `size()`, `export()` and checkpoints gather every worker's live keys, rows
  and columns over the collectives (string keys as byte codes);
* a restore or `set_column` applies on each worker the keys of its shard.
"""

from __future__ import annotations

import weakref
from typing import List, Sequence

import tensorflow as tf

from tf_sharded.table.dynamic.agree import join_codes, string_codes
from tf_sharded.table.remote import first_of_worker

# Per (strategy, dtype, rank): one function gathering any first-axis length over the workers. TensorFlow's
# `strategy.gather` traces a new function for every new shape, and a save gathers tensors of every size.
_GATHERS = weakref.WeakKeyDictionary()


def _worker_value(ctx, value: tf.Tensor) -> tf.Tensor:
    """`value` from a worker's first replica, nothing (no rows) from its others: an all-gather over the
    replicas then holds each worker's value once."""
    if len(ctx.strategy.extended.worker_devices) == 1:
        return value
    return value[: tf.where(first_of_worker(ctx), tf.shape(value)[0], 0)]


def _gather(strategy, value: tf.Tensor) -> tf.Tensor:
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and not tf.distribute.in_cross_replica_context() and ctx.num_replicas_in_sync > 1:
        return ctx.all_gather(_worker_value(ctx, value), 0)
    functions = _GATHERS.setdefault(strategy, {})
    key = (value.dtype, value.shape.rank)
    if key not in functions:
        spec = tf.TensorSpec([None] * value.shape.rank, value.dtype)

        @tf.function(input_signature=[spec])
        def gather(v):
            # The identity places the value on the replica device (an argument has none, which a collective needs).
            def each(x):
                ctx = tf.distribute.get_replica_context()
                return ctx.all_gather(_worker_value(ctx, tf.identity(x)), 0)

            out = strategy.run(each, args=(v,))
            return strategy.experimental_local_results(out)[0]

        functions[key] = gather
    return functions[key](value)


def gather_over_workers(strategy, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """Each worker's `tensors` (aligned along their first axis, possibly of no rows), concatenated in worker
    order, on every worker.

    The tensors of one dtype travel as one `[n, columns]` block (a save of a
    table with its optimizer columns is then a few collectives, not one per
    column); string tensors as their byte lengths (in the int64 block) and
    their bytes as codes. Every block travels with one extra row per worker,
    dropped after: a collective to which every participant sends nothing
    never completes.
    """
    n = tf.shape(tensors[0], out_type=tf.int64)[0]
    sizes = _gather(strategy, tf.reshape(n, [1]))  # one per worker, in worker order
    marker_at = tf.cumsum(sizes + 1) - 1  # each worker's extra row, after its own
    columns, codes = [], {}
    for i, t in enumerate(tensors):
        if t.dtype == tf.string:
            lengths, codes[i] = string_codes(t)
            t = lengths
        columns.append(tf.reshape(t, tf.stack([n, -1])))
    gathered = [None] * len(tensors)
    for dtype in dict.fromkeys(c.dtype for c in columns):
        members = [i for i, c in enumerate(columns) if c.dtype == dtype]
        block = tf.concat([columns[i] for i in members], 1)
        block = tf.concat([block, tf.zeros(tf.stack([1, tf.shape(block)[1]]), dtype)], 0)
        every = _drop(_gather(strategy, block), marker_at)
        widths = tf.stack([tf.shape(columns[i])[1] for i in members])
        for i, part in zip(members, tf.split(every, widths, axis=1, num=len(members))):
            gathered[i] = part
    out = []
    for i, t in enumerate(tensors):
        part = gathered[i]
        if i in codes:
            all_codes = _gather(strategy, tf.concat([codes[i], [-1]], 0))
            out.append(join_codes(tf.reshape(part, [-1]), tf.boolean_mask(all_codes, all_codes >= 0)))
        elif t.shape.rank == 1:
            out.append(tf.reshape(part, [-1]))
        else:
            whole = tf.reshape(part, tf.concat([[-1], tf.shape(t)[1:]], 0))
            whole.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
            out.append(whole)
    return out


def _drop(gathered: tf.Tensor, positions: tf.Tensor) -> tf.Tensor:
    keep = tf.scatter_nd(positions[:, None], tf.ones_like(positions, tf.bool), tf.shape(gathered, tf.int64)[:1])
    return tf.boolean_mask(gathered, tf.logical_not(keep))


def max_over_workers(strategy, value: tf.Tensor) -> tf.Tensor:
    """The elementwise maximum over the workers of each one's `value` (same shape everywhere)."""
    return tf.reduce_max(tf.reshape(_gather(strategy, value[None]), tf.concat([[-1], tf.shape(value)], 0)), 0)
