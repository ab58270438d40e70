"""Building a sharded table: shard variables created where a strategy hook says, initialised chunk by chunk.

Strategy hooks decide the partition and where each shard goes; this module
creates the shards (through the strategy's own variable creator, so
TensorFlow sees them as made in its scope), fills them from the
initializer's chunks on the shard's own device, and wraps them in a
`ShardedVariable` that can build optimizer slots with the same placement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, List, Optional

import tensorflow as tf

from tf_sharded import initializers
from tf_sharded.config import TableConfig
from tf_sharded.layout import PartitionSpec
from tf_sharded.table.remote import RemoteShard
from tf_sharded.table.sharded_variable import ShardedVariable

# Shards above this many elements are initialised chunk by chunk. The random generator's temporaries are several
# times a chunk and TensorFlow's CPU allocator keeps freed memory pooled: with 2**20-element chunks a parameter
# server holds its shards within a few percent (`bench memory`; RFC.md, "Local clusters and parameter-server
# processes").
CHUNK_ELEMENTS = 1 << 20

# `factory(index, initial_value_fn, shape, dtype, trainable)` -> the shard's tf.Variable; Keras layers pass one
# so that the shards are their own Keras variables.
VariableFactory = Callable[[int, Callable[[], tf.Tensor], List[int], tf.DType, bool], Any]


def colocate_scope(anchor):
    """A variable-creator scope that hands the strategy's creator `colocate_with=anchor`.

    Strategies place (and never partition) colocated variables: the PS
    strategy puts them on `anchor.device`, mirrored strategies on the
    anchor's devices, or on one device for TF's `SingleDevice` marker.
    """

    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = anchor
        return next_creator(**kwargs)

    return tf.variable_creator_scope(creator)


def draw_seed() -> int:
    """A seed drawn with a TF op, so that `tf.random.set_seed` / `keras.utils.set_random_seed` fix it."""
    with tf.init_scope():
        return int(tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64).numpy())


def _write_rows(var, rows: tf.Tensor, values: tf.Tensor) -> None:
    """Scatters rows into each copy of `var` separately.

    A mirrored variable's own scatter in cross-replica context reads the
    variable back, so every chunk would copy the whole shard.
    """
    copies = var.values if isinstance(var, tf.distribute.DistributedValues) else (var,)
    for copy in copies:
        with tf.device(copy.device):
            copy.scatter_update(tf.IndexedSlices(values, rows))


@dataclasses.dataclass(frozen=True)
class ShardPlacement:
    """Where a hook puts each shard: a device per shard (None: the strategy's default) and an optional scope.

    `scope(i)` is a context manager entered around the creation of shard `i`
    (hooks use it to colocate). `remote(i)`, if given, names the device of
    another worker that holds shard `i`: this process then creates no
    variable for it, only a `RemoteShard`. Slots of the table are placed the
    same way.
    """

    devices: List[Optional[str]]
    scope: Optional[Callable[[int], Any]] = None
    remote: Optional[Callable[[int], Optional[str]]] = None

    def enter(self, i: int):
        stack = contextlib.ExitStack()
        if self.scope is not None:
            stack.enter_context(self.scope(i))
        if self.devices[i] is not None:
            stack.enter_context(tf.device(self.devices[i]))
        return stack


def build_sharded_variable(
    config: TableConfig,
    spec: PartitionSpec,
    strategy: Optional[tf.distribute.Strategy],
    placement: ShardPlacement,
    *,
    variable_factory: Optional[VariableFactory] = None,
    exchange=None,
    mirrored_placement: Optional[str] = None,
) -> ShardedVariable:
    """Creates the shard variables of `config` with partition `spec` and initialises each on its own device.

    `exchange` and `mirrored_placement` are recorded on the table (mirrored
    strategies only).
    """
    layout = spec.bind(config.shape[0])
    full_shape = list(config.shape)
    dtype = config.dtype
    seed = config.seed if config.seed is not None else draw_seed()
    init = initializers.resolve(config.initializer, full_shape, dtype, seed)
    chunk_rows = max(1, CHUNK_ELEMENTS // max(1, math.prod(full_shape[1:])))
    shards = []
    with tf.init_scope():
        for i in range(spec.num_shards):
            shard_shape = [layout.shard_sizes[i]] + full_shape[1:]
            elsewhere = placement.remote(i) if placement.remote is not None else None
            if elsewhere is not None:
                shards.append(RemoteShard(shard_shape, dtype, elsewhere, config.trainable, f"{config.name}/part_{i}"))
                continue
            chunks = init.chunks(layout, i, full_shape, dtype, chunk_rows)
            whole = len(chunks) == 1 and chunks[0].whole
            with placement.enter(i):
                if whole:
                    initial = lambda c=chunks[0]: c.compute()[1]  # noqa: E731
                else:
                    initial = lambda s=shard_shape: tf.zeros(s, dtype)  # noqa: E731
                if variable_factory is None:
                    var = tf.Variable(
                        initial_value=initial,
                        trainable=config.trainable,
                        name=f"{config.name}/part_{i}",
                        dtype=dtype,
                        shape=shard_shape,
                    )
                else:
                    var = variable_factory(i, initial, shard_shape, dtype, config.trainable)
            if not whole:
                with tf.device(var.device):
                    for chunk in chunks:
                        _write_rows(var, *chunk.compute())
            shards.append(var)

    def slot_factory(table: ShardedVariable, name: str, fill: float) -> ShardedVariable:
        slot = TableConfig(
            name=name,
            shape=config.shape,
            dtype=dtype,
            initializer=lambda shape, dtype: tf.fill(shape, tf.constant(fill, dtype)),
            trainable=False,
            seed=0,
        )
        with (strategy or tf.distribute.get_strategy()).scope():
            return build_sharded_variable(slot, spec, strategy, placement)

    return ShardedVariable(
        shards,
        layout,
        config.name,
        full_shape,
        dtype,
        strategy,
        exchange=exchange,
        placement=mirrored_placement,
        slot_factory=slot_factory,
    )
