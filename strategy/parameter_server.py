"""ParameterServerStrategy: shards round-robin over the parameter servers, steps scheduled on workers.

Shard variables are created through the strategy's own variable creator (so
TensorFlow sees them as created in its scope), pinned to their ps task by
colocation, which also stops the strategy's `variable_partitioner` from
splitting a shard a second time.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.layout import resolve_spec
from tf_sharded.strategy import FitLoop, StrategyFamily, register
from tf_sharded.strategy.common import refuse_mirrored_arguments
from tf_sharded.table.batched import build_batched
from tf_sharded.table.builder import ShardPlacement, build_sharded_variable, colocate_scope

# Per strategy: how many shards have been placed, so that tables start on
# different ps tasks and small tables do not all pile onto ps 0.
_PLACED = weakref.WeakKeyDictionary()


class _Anchor:
    """Stands in for a variable to colocate with: only `.device` is read."""

    def __init__(self, device: str):
        self.device = device
        self.name = device


def ps_device(task: int) -> str:
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


def default_num_shards(strategy, config) -> int:
    """From the strategy's `variable_partitioner`, else one shard per ps."""
    partitioner = _compat.ps_variable_partitioner(strategy)
    if partitioner is None:
        return _compat.ps_num_ps(strategy)
    result = partitioner(tf.TensorShape(config.shape), config.dtype)
    return int(list(result)[0])


def _next_tasks(strategy, num_shards: int) -> list:
    """The ps task of each of `num_shards` new shards: round-robin from where the last table stopped."""
    num_ps = _compat.ps_num_ps(strategy)
    start = _PLACED.get(strategy, 0)
    _PLACED[strategy] = start + num_shards
    return [(start + i) % num_ps for i in range(num_shards)]


def _spec(strategy, config):
    refuse_mirrored_arguments(config, "ParameterServerStrategy")
    return resolve_spec(
        config.partitions, config.shape, config.dtype, config.scheme, default_num_shards(strategy, config)
    )


def _colocated(device: str):
    return colocate_scope(_Anchor(device))


def create(strategy, config, variable_factory=None):
    spec = _spec(strategy, config)
    devices = [ps_device(task) for task in _next_tasks(strategy, spec.num_shards)]
    placement = ShardPlacement(devices, scope=lambda i: _colocated(devices[i]))
    with strategy.scope():
        return build_sharded_variable(config, spec, strategy, placement, variable_factory=variable_factory)


def create_group(strategy, configs, name, variable_factory=None):
    """Tables of one dtype and row shape in one storage variable per ps (table-batched storage).

    Each table's shards go round-robin over the ps exactly as `create` would place them; the storage on a
    ps holds that ps's shards of every table. Returns the tables, in order.
    """
    specs = [_spec(strategy, c) for c in configs]
    shard_tasks = [_next_tasks(strategy, spec.num_shards) for spec in specs]
    devices = [ps_device(task) for task in range(_compat.ps_num_ps(strategy))]
    with strategy.scope():
        return build_batched(
            name, configs, specs, shard_tasks, devices, strategy,
            lambda task: _colocated(devices[task]), variable_factory=variable_factory,
        )  # fmt: skip


def dynamic_devices(strategy, num_shards):
    """One shard per ps by default, round-robin from where the last table stopped."""
    return [ps_device(task) for task in _next_tasks(strategy, num_shards or _compat.ps_num_ps(strategy))]


FAMILY = register(
    StrategyFamily(
        name="parameter_server",
        create=create,
        fit_loop=lambda strategy, steps_per_execution: FitLoop.COORDINATOR,
        asynchronous_steps=True,
        dataset_function=True,
        dynamic_devices=dynamic_devices,
        create_group=create_group,
    ),
    tf.distribute.experimental.ParameterServerStrategy,
)
