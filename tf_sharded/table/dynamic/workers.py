"""Dynamic tables sharded over the workers of MultiWorkerMirroredStrategy (`placement="sharded"`).

Worker `r` holds shard `r` (the keys whose hash lands there, their rows and
optimizer columns, its policies' state); the other shards are
`RemoteShard`s (`table.remote`), metadata without memory. Every worker runs
the same program, so whatever needs another worker's keys is done by all at
once:

* a lookup in the replicas goes through the transport of every table sharded
  over workers (`table.transport`, the all-to-all of fixed-row tables):
  each replica sends its distinct keys and their counts to the first
  replica of the worker whose shard holds them, which inserts them (a
  training lookup) and answers with their rows; the gradients come back to
  it the same way, so its pool receives the global batch's sum at its rows,
  which the optimizer applies once, there (`lookup_over_workers`);
* a read outside the replicas, `size()`, `export()` and checkpoints sum or
  gather every worker's part over the collectives (`table.remote.sum_over_workers`;
  string keys as byte codes);
* a restore or `set_column` applies on each worker the keys of its shard.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Sequence

import tensorflow as tf

from tf_sharded.table.dynamic.keys import shard_of_keys
from tf_sharded.table.dynamic.lock import locked_together
from tf_sharded.table.dynamic.packed import expand, single
from tf_sharded.table.remote import first_of_worker, held_shards
from tf_sharded.table.transport import exchange, join_codes, string_codes


def lookup_over_workers(pairs, training: bool, ctx) -> List[tf.Tensor]:
    """Rows of `(table, rank-1 keys)` pairs of tables sharded over workers, in the replica context `ctx`: one
    exchange (`table.transport.exchange`) per key dtype, row dtype and width carries every table's keys, their
    counts and their rows.

    Each replica sends its distinct keys of each table, with their counts, to
    the first replica of the worker whose shard holds them (it speaks for the
    worker's shard, as in every collective over the replicas). That replica
    receives them in the order of the replicas, each one's in the order it
    met them, which is the order one lookup of the global batch on one device
    inserts them in; it sums each key's counts over the replicas, so that
    admission meets every occurrence once, inserts the keys of a training
    lookup and answers with their rows.
    """
    out: List[tf.Tensor] = [None] * len(pairs)
    groups: Dict[tuple, List[int]] = {}
    for i, (table, _) in enumerate(pairs):
        groups.setdefault((table.key_dtype, table.dtype, table.dim), []).append(i)
    for members in groups.values():
        for i, rows in zip(members, _lookup_group([pairs[i] for i in members], training, ctx)):
            out[i] = rows
    return out


def _lookup_group(pairs, training: bool, ctx) -> List[tf.Tensor]:
    """`lookup_over_workers` for tables of one key dtype, row dtype and width."""
    tables = [t for t, _ in pairs]
    local = []
    for _, flat in pairs:
        uniq, idx = tf.unique(flat, out_idx=tf.int32)
        n = tf.size(uniq, out_type=tf.int32)
        local.append((uniq, idx, n, tf.math.unsorted_segment_sum(tf.ones_like(idx, tf.int64), idx, n)))
    inserting = [training and t.trainable for t in tables]
    steps = [t.advance_step() if i else None for t, i in zip(tables, inserting)]
    keys = tf.concat([uniq for uniq, _, _, _ in local], 0)
    counts = tf.concat([c for _, _, _, c in local], 0)
    tags = tf.concat([tf.fill([n], tf.constant(t, tf.int64)) for t, (_, _, n, _) in enumerate(local)], 0)
    # Shard `w` is worker `w`'s, whose replicas TensorFlow numbers `w * L ...`: the first of them owns it.
    owner = shard_of_keys(keys, tables[0].num_shards) * len(ctx.strategy.extended.worker_devices)
    strings = keys if keys.dtype == tf.string else None
    columns = [counts, tags] if strings is not None else [counts, tags, keys]
    static = [flat.shape[0] for _, flat in pairs]

    def serve(got, got_strings):
        return _serve(tables, inserting, steps, got[0], got[1], got_strings if strings is not None else got[2])

    rows = exchange(columns, owner, serve, [tables[0].dim], tables[0].dtype, strings=strings,
                    bound=None if None in static else sum(static))  # fmt: skip
    parts = tf.split(rows, tf.stack([n for _, _, n, _ in local]), num=len(pairs)) if len(pairs) > 1 else [rows]
    return [expand(part, idx, n) for part, (_, idx, n, _) in zip(parts, local)]


def _serve(tables, inserting, steps, counts, tags, keys):
    """An owner's answer (`table.transport.Serve`) for the keys it received, `(counts, tags: the table of each,
    keys)`: per table, the distinct keys and their summed counts, inserted into the shard held here (all the
    tables' inserts in one critical section per device) where the lookup trains, and their rows."""
    m = tf.size(tags)
    received = []
    for t in range(len(tables)):
        mask = tf.equal(tags, t)
        distinct, at = tf.unique(tf.boolean_mask(keys, mask), out_idx=tf.int32)
        summed = tf.math.unsorted_segment_sum(tf.boolean_mask(counts, mask), at, tf.size(distinct))
        received.append((mask, distinct, at, summed))
    shards = [held_shards(table.variables)[0] for table in tables]
    inserts = [table.insert_part(s, distinct, summed, step)
               for table, s, step, ins, (_, distinct, _, summed) in zip(tables, shards, steps, inserting, received)
               if ins]  # fmt: skip
    found = iter(locked_together([(part.member.pool, single(part)) for part in inserts]))
    which, offset, values = tf.zeros([m], tf.int32), tf.constant(0, tf.int32), []
    for table, s, ins, (mask, distinct, at, _) in zip(tables, shards, inserting, received):
        rows = next(found) if ins else table.shards[s].find(distinct)
        values.append(table.shard_values(s, distinct, rows, ins and table.every_key_held))
        which += tf.scatter_nd(tf.where(mask), offset + at, tf.shape(tags, out_type=tf.int64))
        offset += tf.size(distinct)
    return which, offset, tf.concat(values, 0)


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
