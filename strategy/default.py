"""Default strategy and `OneDeviceStrategy`: one table, optionally in local shards."""

from __future__ import annotations

import tensorflow as tf

from tf_sharded import _compat, creation
from tf_sharded.strategy import register


@register(_compat.default_strategy_type(), tf.distribute.OneDeviceStrategy)
def create(strategy: tf.distribute.Strategy, request: creation.VariableRequest):
    """All shards on the strategy's device; one shard unless `partitions` says more."""
    request.reject_exchange(type(strategy).__name__)
    spec = request.resolve_spec(default_shards=1)
    with strategy.scope():
        return creation.build_sharded_variable(request, spec, [None] * spec.num_shards, strategy)
