"""A mirrored table's exchange policy, and the part of the choice that is made when a step is traced."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_sharded.config import Exchange, optional_positive_int
from tf_sharded.exchange.cost import choose, row_bytes


class ExchangePolicy:
    """What a mirrored table does with its sparse gradients.

    Args:
      mode: "auto", "allgather" or "dense".
      ids_per_step: optional declared bound on the distinct ids one replica
        looks up in this table per step; "auto" then decides once, at trace
        time, instead of every step.

    Example:

    >>> ExchangePolicy("auto", ids_per_step=4096)
    ExchangePolicy(mode='auto', ids_per_step=4096)
    >>> ExchangePolicy("fast")
    Traceback (most recent call last):
    ...
    ValueError: Argument `exchange` must be one of ('auto', 'allgather', 'dense'). Received: exchange='fast'
    """

    def __init__(self, mode: str = "auto", ids_per_step: Optional[int] = None):
        self.mode = Exchange.parse(mode, "exchange")
        self.ids_per_step = optional_positive_int("ids_per_step", ids_per_step)

    def __repr__(self):
        return f"ExchangePolicy(mode={self.mode!r}, ids_per_step={self.ids_per_step})"


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
