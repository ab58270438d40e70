"""`create_sharded_variable`: validates a table request and hands it to the current strategy's family.

Also installs the same function as a method of every `tf.distribute.Strategy`
(`strategy.create_sharded_variable(...)`), the extension point the 2019
sharded-variable RFC proposed and TensorFlow never shipped.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import tensorflow as tf

from tf_sharded import policies
from tf_sharded.config import ExchangePolicy, TableConfig
from tf_sharded.errors import UnsupportedStrategyError, positive_int
from tf_sharded.strategy import family_of, registered_families
from tf_sharded.table.builder import VariableFactory, draw_seed
from tf_sharded.table.dynamic.group import PooledTables
from tf_sharded.table.dynamic.pool import GROWTH, RowPool
from tf_sharded.table.dynamic.table import DynamicTable
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
        "host" (one copy per worker in host memory), "sharded" (split along
        the rows over the replicas: replica `r` holds shard `r`;
        MirroredStrategy) or "auto" (by size).
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


def _strategy_method(function, build):
    """`function` as a `tf.distribute.Strategy` method: arguments bound (and errors named) as for `function`,
    then `build(strategy, arguments)`."""
    signature = inspect.signature(function)
    name = function.__name__

    def method(self, *args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{name}(): {e}. Signature: {name}{signature}") from None
        bound.apply_defaults()
        return build(self, dict(bound.arguments))

    method.__doc__ = function.__doc__.split("Example:")[0]
    method.__name__ = name
    method.__signature__ = signature.replace(
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *signature.parameters.values()]
    )
    return method


def _build_sharded(strategy, a):
    return create_table(strategy, TableConfig(a.pop("name"), a.pop("shape"), **a))


def create_dynamic_table(
    name: str,
    dim: int,
    key_dtype=tf.int64,
    initializer: Any = "uniform",
    partitions: Optional[int] = None,
    seed: Optional[int] = None,
    admission: Any = None,
    eviction: Any = None,
    *,
    dtype=tf.float32,
    trainable: bool = True,
    max_rows: Optional[int] = None,
    growth: float = GROWTH,
    placement: Optional[str] = None,
) -> DynamicTable:
    """Creates a `tfs.DynamicTable` (raw int64 or string keys) under the current `tf.distribute` strategy.

    Same as `tf.distribute.get_strategy().create_dynamic_table(...)`.

    Args:
      name: table name.
      dim: row width.
      key_dtype: tf.int64 (any value, negative or beyond 2**53) or tf.string.
      initializer: a Keras-style name ("uniform", "normal", "zeros", ...) or a
        Keras random / constant initializer; a key's initial row depends on
        (seed, key) only.
      partitions: None (the strategy's default: one shard per ps under
        ParameterServerStrategy, else one) or a number of shards. Under
        MirroredStrategy the shards are on the host, shared by the replicas;
        under MultiWorkerMirroredStrategy each worker (one replica each) has
        its own copy, kept identical to the others'.
      seed: seed of the initial rows (drawn from TF's global seed if None).
      admission: None (every key met in training gets a row) or
        `tfs.policies.MinCountAdmission` / `tfs.policies.ProbabilityAdmission`.
      eviction: None, `tfs.policies.StepsSinceSeenEviction`,
        `tfs.policies.CapacityEviction`, or a list with one of each.
      dtype: row dtype (floating).
      trainable: whether lookups insert keys and gradients reach the rows.
      max_rows: None (grow without bound) or the most live keys it may hold;
        an insert past it fails with an error naming the table.
      growth: factor by which a shard's row pool grows when full.
      placement: None (the strategy's layout) or "sharded": under
        MultiWorkerMirroredStrategy, shard `r` (the keys whose hash lands
        there, their rows and optimizer columns) on worker `r` only.

    Returns:
      A `tfs.DynamicTable`.

    Raises:
      tfs.UnsupportedStrategyError: the strategy has no dynamic tables.
      ValueError / TypeError: an argument is invalid (the message names it).

    Example:

    >>> import tf_sharded as tfs
    >>> words = tfs.create_dynamic_table("words_doc", dim=4, key_dtype=tf.string, seed=3)
    >>> tfs.embedding_lookup(words, ["cat", "dog", "cat"]).shape.as_list(), int(words.size())
    ([3, 4], 2)
    """
    strategy = tf.distribute.get_strategy()
    if placement not in (None, "auto", "sharded"):
        raise ValueError(
            f"Argument `placement` of dynamic table '{name}' must be None or 'sharded' (the strategy places a "
            f"dynamic table otherwise). Received: placement={placement!r}"
        )
    return create_dynamic_in(strategy, name, dim, key_dtype, initializer, partitions, seed, admission, eviction,
                             dtype=dtype, trainable=trainable, max_rows=max_rows, growth=growth,
                             placement=None if placement == "auto" else placement)  # fmt: skip


def create_dynamic_in(strategy, name, dim, key_dtype, initializer, partitions, seed, admission, eviction, **options):
    """`create_dynamic_table` under `strategy` (its family says where the shards go)."""
    family = family_of(strategy)
    if family.dynamic_devices is None and family.create_dynamic is None:
        raise UnsupportedStrategyError(strategy, dynamic_strategies(), what="dynamic tables")
    if partitions is not None:
        partitions = positive_int("partitions", getattr(partitions, "num_shards", partitions))
    if family.create_dynamic is not None:
        return family.create_dynamic(strategy, name, dim, key_dtype, initializer, partitions, seed, admission,
                                     eviction, **options)  # fmt: skip
    if options.get("placement") == "sharded":
        if family.sharded_dynamic is None:
            raise ValueError(
                f"Argument `placement` of dynamic table '{name}': placement='sharded' needs "
                f"MultiWorkerMirroredStrategy (a shard per worker; in one process the replicas already share one "
                f"copy in host memory, split by `partitions`). Received: {type(strategy).__name__}"
            )
        if partitions is not None:
            raise ValueError(
                f"Argument `partitions` of dynamic table '{name}' does not apply to placement='sharded' (a shard per "
                f"worker). Received: partitions={partitions}"
            )
        devices, remote = family.sharded_dynamic(strategy, name)
        seed = draw_seed() if seed is None else seed
        with strategy.scope():
            return DynamicTable(name, dim, key_dtype, initializer=initializer, seed=seed, devices=devices,
                                strategy=strategy, admission=admission, eviction=eviction, remote=remote,
                                **options)  # fmt: skip
    options.pop("placement", None)
    devices = family.dynamic_devices(strategy, partitions)
    if family.mirrors_tables:
        # One host copy shared by the replicas; their gradients (rows of that copy) are all-gathered and
        # applied once, as for host-placed sharded tables. A dense exchange needs a fixed row count.
        options.update(exchange=ExchangePolicy("allgather"), placement="host")
    seed = draw_seed() if seed is None else seed
    with strategy.scope():
        return DynamicTable(name, dim, key_dtype, initializer=initializer, seed=seed, devices=devices,
                            strategy=strategy, admission=admission, eviction=eviction, **options)  # fmt: skip


def create_dynamic_group(strategy, name: str, tables, dtype, trainable: bool):
    """Dynamic tables sharing one row pool per device (`tf_sharded.table.dynamic.group`), under every strategy
    that has dynamic tables; None under any other.

    `tables`: per table, `create_dynamic_table`'s arguments (`name`, `dim`,
    `key_dtype`, `initializer`, `partitions`, `seed`, `admission`,
    `eviction`); all of one `dim` and `partitions`, none with `max_rows`. Where every table has a
    capacity eviction, a pool grows no further than their shares of it together.
    """
    family = family_of(strategy)
    # Tables sharded over workers keep a pool each (their shards hold different keys on each worker).
    if family.dynamic_devices is None or any(t.get("placement") == "sharded" for t in tables):
        return None
    partitions = tables[0]["partitions"]
    devices = family.dynamic_devices(strategy, None if partitions is None else positive_int("partitions", partitions))
    shares = [_capacity_share(t, len(devices)) for t in tables]
    bound = None if None in shares else sum(shares)
    with strategy.scope():
        pools = [
            RowPool(name, i, d, tables[0]["dim"], tf.as_dtype(dtype), trainable, bound=bound)
            for i, d in enumerate(devices)
        ]
    members = [
        create_dynamic_in(strategy, t["name"], t["dim"], t["key_dtype"], t["initializer"], t["partitions"],
                          t["seed"], t["admission"], t["eviction"], dtype=dtype, trainable=trainable, pools=pools)
        for t in tables
    ]  # fmt: skip
    PooledTables(name, members, pools)
    return members


def _capacity_share(table: dict, shards: int) -> Optional[int]:
    """A shard's share of the table's capacity eviction, or None (no capacity bound)."""
    _, evictions = policies.parse(table["name"], table["admission"], table["eviction"])
    bounded = [e for e in evictions if isinstance(e, policies.CapacityEviction)]
    return bounded[0].per_shard(shards) if bounded else None


def dynamic_strategies() -> list:
    """Names of the strategy types whose family creates dynamic tables."""
    families = registered_families().items()
    return sorted({t.__name__ for t, f in families if f.dynamic_devices is not None or f.create_dynamic is not None})


def _build_dynamic(strategy, a):
    positional = [a.pop(k) for k in ("name", "dim", "key_dtype", "initializer", "partitions", "seed")]
    return create_dynamic_in(strategy, *positional, a.pop("admission"), a.pop("eviction"), **a)


def install() -> None:
    """Adds `create_sharded_variable` and `create_dynamic_table` to every `tf.distribute.Strategy`."""
    for cls in {tf.distribute.Strategy, tf.compat.v1.distribute.Strategy}:
        cls.create_sharded_variable = _strategy_method(create_sharded_variable, _build_sharded)
        cls.create_dynamic_table = _strategy_method(create_dynamic_table, _build_dynamic)
