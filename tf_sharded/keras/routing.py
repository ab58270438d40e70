"""Keras 3 optimizers under mirrored strategies: table gradients go through the exchange, host shards update once.

Keras sums replica gradients itself and applies them with
`extended.update`, which takes only distributed variables. Installed when
the process creates its first table (`tf_sharded.keras` registers it with
`table.protocol.on_first_table`), this routes both steps (see
`_compat.route_keras_gradient_reduction`): the reduction through
`tfs.exchange.all_reduce_gradients`, and the update of single-copy shards
(host-placed: one plain variable per worker; sharded over the replicas: one
on its owner) through `apply_updates`, where the writes to
dynamic tables wait and run in one critical section per device. Everything
else is handed back to Keras unchanged.
"""

from __future__ import annotations

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.exchange.reduce import all_reduce_gradients
from tf_sharded.table.dynamic.lock import grouped_updates
from tf_sharded.table.protocol import owner_of
from tf_sharded.table.registry import placement_of


def apply_updates(optimizer, distribution, grads_and_vars, learning_rate, fallback) -> None:
    """Keras update step: single-copy shards (host-placed, or sharded over the replicas) are updated once, the rest
    by `fallback`.

    After the exchange every replica holds the same gradient for such a shard
    (for a sharded table, the sum made on its owner), so it takes the first
    replica's and applies it once, on the shard's device.
    """
    host, rest, remote = [], [], {}
    for g, v in grads_and_vars:
        tag = owner_of(v)
        placement = placement_of(tag[0]) if tag is not None else None
        if placement is not None and placement.trained_remotely:
            remote.setdefault(placement, []).append(tag[0])
            continue
        is_host = placement is not None and placement.single_copy and g is not None
        (host if is_host else rest).append((g, v))
    # A dynamic table's writes take its device's lock: one critical section per device for the whole step.
    with grouped_updates():
        if rest:
            fallback(rest)
        for g, v in host:
            local = distribution.experimental_local_results(g)[0]
            with tf.device(v.device):
                optimizer.update_step(local, v, learning_rate)
    for placement, tables in remote.items():  # e.g. tables on table servers: the rows go to their servers
        placement.after_update(optimizer, tables)


def install() -> None:
    """Routes Keras 3 optimizers (idempotent)."""
    _compat.route_keras_gradient_reduction(all_reduce_gradients, apply_updates)
