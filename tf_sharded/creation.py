"""`create_sharded_variable`: validates a table request and hands it to the current strategy's family.

Also installs the same function as a method of every `tf.distribute.Strategy`
(`strategy.create_sharded_variable(...)`), the extension point the 2019
sharded-variable RFC proposed and TensorFlow never shipped.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import tensorflow as tf

from tf_sharded.config import TableConfig
from tf_sharded.strategy import family_of
from tf_sharded.table.builder import VariableFactory
from tf_sharded.table.sharded_variable import ShardedVariable


def create_sharded_variable(
    name: str,
    shape,
    dtype=tf.float32,
    initializer: Any = "uniform",
    partitions: Any = None,
    trainable: bool = True,
    *,
    scheme: Optional[str] = None,
    seed: Optional[int] = None,
    exchange: Optional[str] = None,
    placement: Optional[str] = None,
    ids_per_step: Optional[int] = None,
) -> ShardedVariable:
    """Creates a `tfs.ShardedVariable` under the current `tf.distribute` strategy.

    Same as `tf.distribute.get_strategy().create_sharded_variable(...)`.

    Args:
      name: table name (shards are named `name/part_i`).
      shape: full logical shape `[rows, ...]`.
      dtype: element dtype.
      initializer: a Keras initializer name or object, a callable
        `(shape, dtype[, partition_offset])`, or a full-shape array. Named and
        Keras initializers give the same logical table for every layout.
      partitions: None (the strategy's default), an int shard count, a
        `tfs.PartitionSpec`, or a partitioner (`tfs.partitioners.*` or TF's).
      trainable: whether gradients flow to the table.
      scheme: "div", "mod" or "balanced" (`tfs.Scheme`) when `partitions` is
        not a `PartitionSpec`.
      seed: seed of the initializer (drawn from TF's global seed if None).
      exchange: gradient exchange under mirrored strategies ("auto",
        "allgather", "dense"); an explicit mode elsewhere is an error.
      placement: mirrored strategies only: "device" (a copy per replica),
        "host" (one copy per worker in host memory) or "auto" (by size).
      ids_per_step: mirrored strategies only: declared bound on the distinct
        ids one replica looks up per step (feeds the "auto" cost model).

    Returns:
      A `tfs.ShardedVariable`.

    Raises:
      tfs.UnsupportedStrategyError: the current strategy has no hook.
      ValueError / TypeError: an argument is invalid (the message names it).

    Example:

    >>> import tf_sharded as tfs
    >>> t = tfs.create_sharded_variable("create_doc", [100, 8], partitions=4, scheme="balanced", seed=1)
    >>> t.partition
    PartitionSpec(num_shards=4, scheme='balanced')
    >>> u = tfs.create_sharded_variable("create_doc2", [100, 8], partitions=1, seed=1)
    >>> bool(np.array_equal(t.numpy(), u.numpy()))
    True
    """
    config = TableConfig(
        name,
        shape,
        dtype,
        initializer,
        partitions,
        trainable,
        scheme=scheme,
        seed=seed,
        exchange=exchange,
        placement=placement,
        ids_per_step=ids_per_step,
    )
    return create_table(tf.distribute.get_strategy(), config)


def create_table(strategy, config: TableConfig, variable_factory: Optional[VariableFactory] = None):
    """Creates the table `config` under `strategy` through its family's hook.

    `variable_factory(index, initial_value_fn, shape, dtype, trainable)`, if
    given, creates each shard variable (Keras layers make them their weights).
    """
    return family_of(strategy).create(strategy, config, variable_factory)


_SIGNATURE = inspect.signature(create_sharded_variable)


def _strategy_method(self, *args, **kwargs) -> ShardedVariable:
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"create_sharded_variable(): {e}. Signature: create_sharded_variable{_SIGNATURE}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    config = TableConfig(arguments.pop("name"), arguments.pop("shape"), **arguments)
    return create_table(self, config)


_strategy_method.__doc__ = create_sharded_variable.__doc__.split("Example:")[0]
_strategy_method.__name__ = "create_sharded_variable"
_strategy_method.__signature__ = _SIGNATURE.replace(
    parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *_SIGNATURE.parameters.values()]
)


def install() -> None:
    """Adds `create_sharded_variable` to every `tf.distribute.Strategy`."""
    for cls in {tf.distribute.Strategy, tf.compat.v1.distribute.Strategy}:
        cls.create_sharded_variable = _strategy_method
