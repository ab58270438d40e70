"""The part of a mirrored table's exchange choice that is made when a step is traced (its `ExchangePolicy`, a
setting of the table, lives with the other settings in `tf_sharded.config`)."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_sharded.config import ExchangePolicy  # noqa: F401  (its home for `tfs.exchange`)
from tf_sharded.exchange.cost import choose, row_bytes


def trace_time_choice(grad, table, shard: int, replicas: int, in_process: bool, static_ids: Optional[int]) -> str:
    """A shard's exchange as far as tracing decides it: "dense", "allgather", "map" or "auto".

    "map": in process, the densified merge, fixed by a declared
    `ids_per_step`; "auto": decided every step. `static_ids`: a bound on any
    replica's distinct ids that every replica agrees on.
    """
    policy = table.exchange
    if policy.mode == "dense" or not isinstance(grad, tf.IndexedSlices):
        return "dense"
    if policy.mode == "allgather":
        return "allgather"
    args = (table.shard_rows(shard), row_bytes(table), replicas)
    if policy.ids_per_step is not None:
        if choose(*args, policy.ids_per_step, in_process=in_process) == "allgather":
            return "allgather"
        return "map" if in_process else "dense"
    if static_ids is not None and choose(*args, static_ids, in_process=in_process) == "allgather":
        return "allgather"
    return "auto"
