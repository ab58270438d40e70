"""`all_reduce_gradients`: sums the gradients of mirrored tables' shards across replicas with each table's exchange.

Shards whose exchange is fixed when the step is traced (all-gather) are
exchanged together per dtype and row shape; the others go one by one. The
result is handed back to the caller (a Keras optimizer through
`tf_sharded.keras.routing`, or the user's own loop); nothing here updates a
variable.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import tensorflow as tf

from tf_sharded import trace
from tf_sharded.exchange.cost import row_bytes
from tf_sharded.exchange.owners import from_local_owners, reduce_to_owners, sharded_owner
from tf_sharded.exchange.policy import trace_time_choice
from tf_sharded.exchange.transports import (
    adaptive_exchange,
    allgather_exchange,
    dense_exchange,
    grouped_adaptive_exchange,
    in_process,
    local_slices,
    offsets,
    sent_bytes,
    split_by_offsets,
)
from tf_sharded.table import tally
from tf_sharded.table.protocol import owner_of
from tf_sharded.table.registry import placement_of


def owner(variable) -> Optional[Tuple[object, int]]:
    """`(table, shard)` of a shard of a mirrored table (one with an exchange policy), else None."""
    tag = owner_of(variable)
    return tag if tag is not None and tag[0].exchange is not None else None


def _trained_remotely(tag) -> bool:
    placement = placement_of(tag[0]) if tag is not None else None
    return placement is not None and placement.trained_remotely


def exchange_as(grad, table, shard: int, ctx, choice: str) -> tuple:
    """One shard's exchange once its trace-time `choice` is known: the summed gradient, and the bytes this
    replica sent (`transports.sent_bytes`)."""
    rows, per_row = table.shard_rows(shard), row_bytes(table)
    if choice == "dense":
        return dense_exchange(grad, ctx, rows), sent_bytes(0, rows, per_row, False)
    indices, values = local_slices(grad, trace.single_lookup(table))
    local = tf.IndexedSlices(values, indices, grad.dense_shape)
    if choice == "allgather":
        return allgather_exchange(local, ctx, premerged=True)[0], sent_bytes(tf.size(indices), rows, per_row)
    summed, gathered = adaptive_exchange(local, ctx, rows, True, decided="dense" if choice == "map" else None)
    # In process the slices travel either way (the densified merge happens where they meet).
    return summed, sent_bytes(tf.size(indices), rows, per_row, True if in_process(ctx) else gathered)


def grouped_allgather(grads: List[Tuple[tf.IndexedSlices, int, bool]], ctx) -> Tuple[List[tf.IndexedSlices], list]:
    """All-gathers several shards' slices as one: one collective (or one in-process merge) for all of them.

    `grads`: `(gradient, shard rows, premerged)` of shards with the same
    dtype and row shape. Each shard's local rows are offset by the rows of
    the shards before it, so the ids never collide; the merged result is
    split back by those offsets. A step over 26 tables then issues one
    gather instead of 26 (each a shape exchange plus the data over the
    network under `MultiWorkerMirroredStrategy`). Also returns the bytes this replica sent for each shard.
    """
    local = [local_slices(grad, premerged) for grad, _, premerged in grads]
    sent = [sent_bytes(tf.size(i), rows, row_bytes(values)) for (i, values), (_, rows, _) in zip(local, grads)]
    if len(grads) == 1:
        (indices, values), (grad, _, _) = local[0], grads[0]
        return [allgather_exchange(tf.IndexedSlices(values, indices, grad.dense_shape), ctx, premerged=True)[0]], sent
    bases = offsets([rows for _, rows, _ in grads])
    indices = tf.concat([local_indices + base for (local_indices, _), base in zip(local, bases)], 0)
    joint = tf.IndexedSlices(tf.concat([local_values for _, local_values in local], 0), indices)
    merged = allgather_exchange(joint, ctx, premerged=True)[0]
    parts = split_by_offsets(merged.indices, merged.values, bases)
    return [tf.IndexedSlices(v, i, grad.dense_shape) for (grad, _, _), (i, v) in zip(grads, parts)], sent


def all_reduce_gradients(
    grads_and_vars: List[tuple], fallback: Optional[Callable[[List[tuple]], List[tuple]]] = None
) -> List[tuple]:
    """Sums gradients across replicas; shards of mirrored tables go through their exchange.

    Call it in replica context (inside `strategy.run`) where you would call
    `ReplicaContext.all_reduce(SUM, grads)`. Keras 3 optimizers call it for you
    (`tf_sharded.keras.routing`). Shards of tables sharded over the replicas
    are summed on the replica that owns them (`tfs.exchange.owners`; across workers already in the
    lookup's backward pass, `tfs.exchange.workers`).

    Args:
      grads_and_vars: `(gradient, variable)` pairs; `None` gradients pass through.
      fallback: how the other pairs are reduced (default: `all_reduce(SUM)`).

    Returns:
      The pairs with summed gradients, in the same order.

    Example:

    >>> import tf_sharded as tfs
    >>> v = tf.Variable([1.0])
    >>> tfs.exchange.all_reduce_gradients([(tf.constant([2.0]), v)])[0][0].numpy()
    array([2.], dtype=float32)
    """
    pairs = list(grads_and_vars)
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return _one_replica(pairs, fallback)
    ours, others, sharded, over_workers = [], [], [], []
    for i, (g, v) in enumerate(pairs):
        if g is not None and _trained_remotely(owner_of(v)):
            continue  # e.g. a table on table servers: its rows' gradients go to them in the optimizer step, unsummed
        tag = sharded_owner(v) if g is not None else None
        if tag is not None:
            # Spread over workers, a shard's gradient was summed on its owner in the lookup's backward pass.
            (over_workers if tag[0].sharded_over_workers else sharded).append((i, tag))
            continue
        tag = owner(v) if g is not None else None
        (ours if tag is not None else others).append((i, tag))
    result = list(pairs)
    if over_workers and len(ctx.strategy.extended.worker_devices) > 1:
        for (i, _), grad in zip(over_workers, from_local_owners([pairs[i] for i, _ in over_workers], ctx)):
            result[i] = (grad, pairs[i][1])
    exchanged = []  # (table, bytes this replica sent for one of its shards)
    if sharded:
        summed, sent = reduce_to_owners([(pairs[i][0], table, shard) for i, (table, shard) in sharded], ctx)
        exchanged.extend(sent)
        for (i, _), grad in zip(sharded, summed):
            result[i] = (grad, pairs[i][1])
    rest = [pairs[i] for i, _ in others]
    if not rest:
        reduced_rest = []
    elif fallback is not None:
        reduced_rest = fallback(rest)
    else:
        present = [g for g, _ in rest if g is not None]
        summed = iter(ctx.all_reduce(tf.distribute.ReduceOp.SUM, present) if present else [])
        reduced_rest = [(None if g is None else next(summed), v) for g, v in rest]
    for (i, _), pair in zip(others, reduced_rest):
        result[i] = pair
    auto = []
    for _, (table, _) in ours:
        if table.exchange.mode == "auto" and table.exchange.ids_per_step is None and table not in auto:
            auto.append(table)
    bounds = _agree_on_bounds(ctx, auto) if auto else {}
    replicas, local = ctx.num_replicas_in_sync, in_process(ctx)
    # (choice, dtype, row shape) -> [(pair index, table, shard)]: exchanged together. All-gathers always; the
    # per-step "auto" exchange across processes, where each of its rendezvous is a round trip.
    grouped = {}
    for i, (table, shard) in ours:
        g, v = pairs[i]
        choice = trace_time_choice(g, table, shard, replicas, local, bounds.get(id(table)))
        row_shape = g.values.shape[1:] if isinstance(g, tf.IndexedSlices) else None
        # Grouping offsets each shard's rows by the shards before it: only for a fixed row count.
        groupable = choice == "allgather" or (choice == "auto" and not local)
        if groupable and row_shape.is_fully_defined() and table.shape[0] is not None:
            grouped.setdefault((choice, g.values.dtype, tuple(row_shape.as_list())), []).append((i, table, shard))
        else:
            summed, sent = exchange_as(g, table, shard, ctx, choice)
            result[i] = (summed, v)
            exchanged.append((table, sent))
    for (choice, _, _), members in grouped.items():
        grads = [(pairs[i][0], table.shard_rows(shard), trace.single_lookup(table)) for i, table, shard in members]
        if choice == "allgather":
            summed, sent = grouped_allgather(grads, ctx)
        else:
            summed, _, sent = grouped_adaptive_exchange(grads, ctx)
            sent = tf.unstack(sent, num=len(members))
        exchanged.extend((table, n) for (_, table, _), n in zip(members, sent))
        for (i, _, _), grad in zip(members, summed):
            result[i] = (grad, pairs[i][1])
    if exchanged:
        tally.add_exchanged(_replica_device(ctx), exchanged)
    return result


def _replica_device(ctx) -> str:
    """This replica's device (its counters live there)."""
    devices = ctx.strategy.extended.worker_devices
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    return devices[int(replica) % len(devices)] if replica is not None else devices[0]


def _one_replica(pairs: List[tuple], fallback) -> List[tuple]:
    """The sum over one replica: the gradients themselves. Tables' shards keep theirs as they are (Keras's
    reduction would pass each through an identity on the replica's device: for a shard on a parameter
    server, a transfer to the worker and back); the rest go to `fallback`."""
    if fallback is None:
        return pairs
    rest = [i for i, (g, v) in enumerate(pairs) if g is None or owner_of(v) is None]
    result = list(pairs)
    for i, pair in zip(rest, fallback([pairs[i] for i in rest]) if rest else []):
        result[i] = pair
    return result


def _agree_on_bounds(ctx, tables) -> dict:
    """Largest static id count per table over this worker's replicas, the same on all of them.

    Replicas can trace different static shapes (one replica's batch may be
    statically empty); deciding on their own would send them down different
    collectives. `merge_call` here runs at trace time only and adds no op.
    Across workers, per-replica batch shapes are equal in a normal input
    pipeline; `ids_per_step` removes any doubt.
    """
    local = tuple(-1 if trace.traced_ids(t) is None else trace.traced_ids(t) for t in tables)

    def merge(strategy, counts):
        per_replica = strategy.experimental_local_results(counts)
        agreed = []
        for i in range(len(tables)):
            values = [c[i] for c in per_replica]
            agreed.append(None if min(values) < 0 else max(values))
        return tuple(agreed)

    if tf.executing_eagerly():
        return {}
    agreed = ctx.merge_call(merge, args=(local,))
    return {id(t): n for t, n in zip(tables, agreed)}
