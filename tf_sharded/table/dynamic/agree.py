"""Dynamic tables under MultiWorkerMirroredStrategy: every worker inserts the same keys, so all copies agree.

Each worker holds its own host copy of a dynamic table. Copies stay equal
if every worker applies the same operations in the same order: a training
lookup first all-gathers the distinct keys (and their counts) of every
replica, then each worker inserts the gathered keys, in replica order, into
its own copy. Admission counts, eviction, the rows handed out and the free
list then evolve identically everywhere, so a key has the same row in every
copy and the sparse gradients (rows of the pool) go through the ordinary
all-gather exchange.

Collectives carry numbers only, so string keys travel as their bytes
(int64 codes) and lengths and are joined again after the gather
(`table.transport.string_codes`). Every
payload carries one marker entry per replica (count -1, code -1): a
collective to which every participant sends nothing never completes, and the
markers also tell where each replica's keys start.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_sharded.table.transport import join_codes, string_codes


def agreeing_context(strategy):
    """The replica context whose replicas must agree on inserts (several workers, one copy each), else None."""
    if strategy is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1 or tf.distribute.in_cross_replica_context():
        return None
    return ctx


def gather_keys(ctx, keys: tf.Tensor, counts: tf.Tensor, tags: Optional[tf.Tensor] = None, share: bool = False):
    """All replicas' distinct `keys` and their `counts`, in replica order, and where this replica's keys start.

    Returns `(keys, counts, start)`, or `(keys, counts, start, tags)` when
    `tags` (int64, one per key: the table of a key in a group of tables)
    travel with them; the same on every replica, and
    `keys[start : start + len(keys)]` are this replica's.

    `share`: with several replicas on each worker (one copy per worker, shared
    by them), whether this replica's occurrences count: the worker's first
    replica (local index 0, TensorFlow's numbering) inserts every key with
    its counts, and the others insert the same keys with counts of zero,
    after it (their critical sections on the copy's device run in the order
    they are traced, the first replica's first, the same on every worker).
    Every key then meets its admission once with all its occurrences, as with
    one replica per worker, and each replica gets the rows of its own keys.
    """
    marker = tf.constant([-1], tf.int64)
    if keys.dtype == tf.string:
        lengths, codes = string_codes(keys)
        word = lengths
    else:
        word = keys
    columns = [word, counts] if tags is None else [word, counts, tags]
    first = [tf.zeros([1], tf.int64), marker] + [tf.zeros([1], tf.int64)] * (len(columns) - 2)
    meta = ctx.all_gather(tf.concat([tf.stack(first, 1), tf.stack(columns, 1)], 0), 0)
    valid = meta[:, 1] >= 0
    markers = tf.cast(tf.where(tf.logical_not(valid))[:, 0], tf.int32)
    rid = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
    start = tf.gather(markers, rid) - rid  # the markers before it (its own included) drop out
    words, all_counts = tf.boolean_mask(meta[:, 0], valid), tf.boolean_mask(meta[:, 1], valid)
    extra = () if tags is None else (tf.boolean_mask(meta[:, 2], valid),)
    if keys.dtype == tf.string:
        all_codes = ctx.all_gather(tf.concat([marker, codes], 0), 0)
        words = join_codes(words, tf.boolean_mask(all_codes, all_codes >= 0))
    local = len(ctx.strategy.extended.worker_devices)
    if share and local > 1:
        all_counts = tf.where(tf.equal(rid % local, 0), all_counts, tf.zeros_like(all_counts))
    return (words, all_counts, start) + extra
