"""Default strategy and `OneDeviceStrategy`: one table, optionally in local shards, on the strategy's device."""

from __future__ import annotations

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.layout import resolve_spec
from tf_sharded.strategy import StrategyFamily, register
from tf_sharded.strategy.common import refuse_mirrored_arguments
from tf_sharded.table.builder import ShardPlacement, build_sharded_variable


def create(strategy: tf.distribute.Strategy, config, variable_factory=None):
    """All shards on the strategy's device; one shard unless `partitions` says more."""
    refuse_mirrored_arguments(config, type(strategy).__name__)
    spec = resolve_spec(config.partitions, config.shape, config.dtype, config.scheme, default_shards=1)
    with strategy.scope():
        return build_sharded_variable(
            config, spec, strategy, ShardPlacement([None] * spec.num_shards), variable_factory=variable_factory
        )


def dynamic_devices(strategy, num_shards):
    """Every shard on the strategy's device (OneDeviceStrategy's, else the current one)."""
    device = strategy.extended.worker_devices[0] if isinstance(strategy, tf.distribute.OneDeviceStrategy) else None
    return [device] * (num_shards or 1)


FAMILY = register(
    StrategyFamily(name="default", create=create, dynamic_devices=dynamic_devices),
    _compat.default_strategy_type(),
    tf.distribute.OneDeviceStrategy,
)
