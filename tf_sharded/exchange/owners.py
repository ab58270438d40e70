"""Gradients of tables sharded over the replicas (`placement="sharded"`): each shard's rows summed on its owner.

A sharded table's shard `r` is a plain variable on replica `r`'s device, and
every replica's lookup reads the rows it needs from their owners (the
forward half of the all-to-all: ids out, rows back). Backward, each replica
holds gradient rows for the shards it read; here they travel to the shard's
owner and are summed there (the backward half), so the optimizer updates
each row once, on the device that holds it, and no replica receives rows it
does not own.

Shards on one device that share a dtype and row shape go as one payload:
each shard's local rows are offset by the rows of the shards before it (as
the all-gather groups shards, `tf_sharded.exchange.reduce`), so a step over
a collection of sharded tables moves one tensor per pair of replicas and
merges once per owner, not once per table. The replicas meet in one
`merge_call` per step for all of them.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import tensorflow as tf

from tf_sharded.config import Placement
from tf_sharded.exchange.cost import row_bytes
from tf_sharded.exchange.transports import hash_merge, offsets, sent_bytes, split_by_offsets
from tf_sharded.table.batched import rows_per_member
from tf_sharded.table.protocol import owner_of


def sharded_owner(variable):
    """`(table, shard)` of a shard of a table sharded over the replicas, else None."""
    tag = owner_of(variable)
    return tag if tag is not None and tag[0].placement == Placement.SHARDED else None


def _as_slices(grad, rows: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """`(int64 local rows, values)` of a shard's gradient; a dense gradient gives every row of the shard."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.cast(grad.indices, tf.int64), grad.values
    return tf.range(rows, dtype=tf.int64), tf.convert_to_tensor(grad)


def reduce_to_owners(grads: List[Tuple[object, object, int]], ctx) -> Tuple[List[tf.IndexedSlices], list]:
    """Sums each shard's gradient over the replicas on the shard's own device.

    Args:
      grads: `(gradient, table, shard)` of shards of sharded tables, this
        replica's gradients (`IndexedSlices` or dense).
      ctx: the replica context (replicas of one process, meeting in
        `merge_call`).

    Returns:
      For each entry, the summed `IndexedSlices` (distinct rows, on the
      shard's device), the same tensors on every replica; and the bytes this
      replica sent, as `(table, int64 bytes)` per table whose rows they are
      (a storage table's members, `batched.rows_per_member`).
    """
    groups: Dict[tuple, List[int]] = {}
    for k, (grad, table, shard) in enumerate(grads):
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        key = (table.variables[shard].device, values.dtype, tuple(values.shape[1:].as_list()))
        groups.setdefault(key, []).append(k)
    keys = list(groups)
    bases = {key: offsets([grads[k][1].shard_rows(grads[k][2]) for k in groups[key]]) for key in keys}
    payloads, sent = [], []
    for key in keys:
        parts = [_as_slices(grads[k][0], grads[k][1].shard_rows(grads[k][2])) for k in groups[key]]
        for k, (rows, _) in zip(groups[key], parts):
            per_row = row_bytes(grads[k][1])
            sent.extend((table, sent_bytes(n, 0, per_row)) for table, n in rows_per_member(*grads[k][1:], rows))
        indices = tf.concat([rows + base for (rows, _), base in zip(parts, bases[key])], 0)
        payloads.append((indices, tf.concat([values for _, values in parts], 0)))

    def on_owners(strategy, payloads):
        merged = []
        for key, (indices, values) in zip(keys, payloads):
            with tf.device(key[0]):
                every_indices = tf.concat(strategy.experimental_local_results(indices), 0)
                every_values = tf.concat(strategy.experimental_local_results(values), 0)
                merged.append(tuple(split_by_offsets(*hash_merge(every_indices, every_values), bases[key])))
        return merged

    with tf.name_scope("tfs_to_owners"):
        merged = ctx.merge_call(on_owners, args=(payloads,))
    out: List[tf.IndexedSlices] = [None] * len(grads)
    for key, parts in zip(keys, merged):
        for k, (indices, values) in zip(groups[key], parts):
            table, shard = grads[k][1], grads[k][2]
            shape = tf.constant([table.shard_rows(shard)] + table.shape[1:].as_list(), tf.int64)
            out[k] = tf.IndexedSlices(values, indices, shape)
    return out, sent


def from_local_owners(grads: List[Tuple[object, object]], ctx) -> list:
    """The gradients of shards sharded over workers, each summed over the worker's replicas, on all of them.

    Across workers the lookup's backward pass already summed each shard's
    gradient on the replica that owns it (`tfs.exchange.workers`), or for a
    dynamic table's shard on the worker's first replica; the worker's other
    replicas hold an empty or zero gradient for it. With several replicas on
    a worker they meet here, in one `merge_call`, and each gets the sum (the
    owner's gradient), so that every replica holds the same gradient, which
    Keras's update applies once.

    Args:
      grads: `(gradient, shard variable)` of shards held by this worker.
      ctx: the replica context.
    """
    payloads = [
        (tf.convert_to_tensor(g.indices), g.values) if isinstance(g, tf.IndexedSlices) else (g,) for g, _ in grads
    ]

    def on_owners(strategy, payloads):
        summed = []
        for (_, variable), parts in zip(grads, payloads):
            with tf.device(variable.device):
                every = [strategy.experimental_local_results(t) for t in parts]
                summed.append(tuple(tf.concat(e, 0) for e in every) if len(parts) == 2 else (tf.add_n(every[0]),))
        return summed

    with tf.name_scope("tfs_from_owners"):
        chosen = ctx.merge_call(on_owners, args=(payloads,))
    out = []
    for (g, _), parts in zip(grads, chosen):
        out.append(tf.IndexedSlices(parts[1], parts[0], g.dense_shape) if isinstance(g, tf.IndexedSlices) else parts[0])
    return out
