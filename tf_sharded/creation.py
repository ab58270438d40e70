"""Creating sharded variables: the request, the strategy method, the shard builder."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from typing import Any, Callable, List, Optional

import numpy as np
import tensorflow as tf

from tf_sharded import initializers
from tf_sharded.exchange import ExchangePolicy
from tf_sharded.partition import PartitionSpec, resolve_spec
from tf_sharded.sharded_variable import ShardedVariable

PLACEMENTS = ("auto", "device", "host")
# Shards above this many elements are initialised chunk by chunk. The random
# generator's temporaries are several times a chunk, and TensorFlow's CPU
# allocator (with oneDNN, the default) keeps freed memory pooled instead of
# returning it: 2**22-element chunks left each 340 MB parameter server ~25%
# above its shards (`bench memory`); 2**20 keeps it to a few percent.
CHUNK_ELEMENTS = 1 << 20


@dataclasses.dataclass
class VariableRequest:
    """A validated `create_sharded_variable` call, handed to the strategy hook."""

    name: str
    shape: List[int]
    dtype: tf.DType
    initializer: Any
    partitions: Any
    trainable: bool
    scheme: Optional[str]
    seed: Optional[int]
    exchange: Optional[str]
    placement: Optional[str] = None
    ids_per_step: Optional[int] = None
    # Not user-facing: `factory(index, initial_value_fn, shape, dtype, trainable)`
    # returns the shard's tf.Variable; Keras layers use it to own their shards.
    variable_factory: Optional[Callable] = None

    def resolve_spec(self, default_shards: int) -> PartitionSpec:
        return resolve_spec(self.partitions, self.shape, self.dtype, self.scheme, default_shards)

    def reject_exchange(self, strategy_name: str) -> None:
        """Refuses mirrored-only arguments where there is nothing to exchange or mirror."""
        for arg, value, neutral in (
            ("exchange", self.exchange, (None, "auto")),
            ("placement", self.placement, (None, "auto")),
            ("ids_per_step", self.ids_per_step, (None,)),
        ):
            if value not in neutral:
                raise ValueError(
                    f"Argument `{arg}` only applies under MirroredStrategy and "
                    f"MultiWorkerMirroredStrategy. Received: {arg}={value!r} under "
                    f"{strategy_name}, where gradients are applied on the shard that owns the row. "
                    "Please drop the argument."
                )


def _validate(
    name, shape, dtype, initializer, partitions, trainable, scheme, seed, exchange, placement=None, ids_per_step=None
) -> VariableRequest:
    if not isinstance(name, str) or not name:
        raise ValueError(f"Argument `name` must be a non-empty string. Received: name={name!r}")
    try:
        dims = [int(d) for d in tf.TensorShape(shape).as_list()]
    except (TypeError, ValueError) as e:
        raise ValueError(f"Argument `shape` must be a fully defined shape. Received: shape={shape!r}") from e
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"Argument `shape` must have rank >= 1 and positive dimensions. Received: shape={shape!r}")
    try:
        dtype = tf.as_dtype(dtype)
    except TypeError as e:
        raise TypeError(f"Argument `dtype` must be a TensorFlow dtype. Received: dtype={dtype!r}") from e
    if not isinstance(trainable, bool):
        raise TypeError(f"Argument `trainable` must be a bool. Received: trainable={trainable!r}")
    if scheme is not None and scheme not in ("div", "mod", "balanced"):
        raise ValueError(f"Argument `scheme` must be one of ('div', 'mod', 'balanced'). Received: scheme={scheme!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"Argument `seed` must be an int or None. Received: seed={seed!r}")
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"Argument `placement` must be one of {PLACEMENTS}. Received: placement={placement!r}")
    ExchangePolicy(exchange or "auto", ids_per_step)  # validates both
    return VariableRequest(
        name, dims, dtype, initializer, partitions, trainable, scheme, seed, exchange, placement, ids_per_step
    )


def colocate_scope(anchor):
    """A variable-creator scope that hands the strategy's creator `colocate_with=anchor`.

    Strategies place (and never partition) colocated variables: the PS
    strategy puts them on `anchor.device`, mirrored strategies on
    `anchor._devices`, or on one device for TF's `SingleDevice` marker.
    """

    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = anchor
        return next_creator(**kwargs)

    return tf.variable_creator_scope(creator)


def _draw_seed() -> int:
    # A TF op so that tf.random.set_seed / keras.utils.set_random_seed make it
    # reproducible.
    with tf.init_scope():
        return int(tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64).numpy())


def _shard_value(init, layout, shard: int, full_shape, dtype, start: int, stop: int) -> tf.Tensor:
    """Initial value of local rows [start, stop) of `shard`."""
    inner = list(full_shape[1:])
    if isinstance(init, initializers.CallableInitializer):
        if layout.scheme == "div" or layout.num_shards == 1 or not init.takes_offset:
            offset = layout.offsets[shard] + start if init.takes_offset else None
            return init.call([stop - start] + inner, dtype, offset)
        raise AssertionError("handled by _fill_scattered")
    rows = layout.logical_rows_tf(shard, start, stop)
    return init.rows(rows, full_shape, dtype)


def _write_rows(var, rows: tf.IndexedSlices) -> None:
    """`var.scatter_update(rows)`, on each copy of a mirrored variable separately.

    A mirrored variable's own scatter in cross-replica context reads the
    variable back, so the next chunk's write copies the whole shard
    (copy-on-write) once per chunk: in B3 that left ~2 shard copies pooled
    by the allocator per table.
    """
    copies = var.values if isinstance(var, tf.distribute.DistributedValues) else (var,)
    for copy in copies:
        with tf.device(copy.device):
            copy.scatter_update(rows)


def _fill_scattered(var, init, layout, shard: int, full_shape, dtype) -> None:
    """A callable with `partition_offset` on a non-contiguous layout.

    The callable is evaluated on contiguous logical chunks and each shard keeps
    the rows it owns, so the table matches the div layout's exactly.
    """
    inner = list(full_shape[1:])
    chunk_rows = max(1, CHUNK_ELEMENTS // max(1, math.prod(inner)))
    num_rows = int(full_shape[0])
    for start in range(0, num_rows, chunk_rows):
        stop = min(num_rows, start + chunk_rows)
        values = init.call([stop - start] + inner, dtype, start)
        shard_of, local = layout.route(tf.range(start, stop, dtype=tf.int64))
        mine = tf.where(tf.equal(shard_of, shard))[:, 0]
        _write_rows(var, tf.IndexedSlices(tf.gather(values, mine), tf.gather(local, mine), var.shape))


def build_sharded_variable(
    request: VariableRequest,
    spec: PartitionSpec,
    devices: List[Optional[str]],
    strategy: Optional[tf.distribute.Strategy],
    placement: Optional[Callable[[int], Any]] = None,
) -> ShardedVariable:
    """Creates the shard variables and initialises each on its own device.

    Args:
      request: the validated request.
      spec: the partition to use.
      devices: device of each shard (None: the strategy's default placement).
      strategy: the strategy creating it (recorded on the result).
      placement: optional `placement(i)` context manager entered around the
        creation of shard `i` (strategy hooks use it to steer placement).
    """
    layout = spec.bind(request.shape[0])
    full_shape = request.shape
    dtype = request.dtype
    seed = request.seed if request.seed is not None else _draw_seed()
    init = initializers.resolve(request.initializer, full_shape, dtype, seed)
    inner = full_shape[1:]
    row_elems = max(1, math.prod(inner))
    chunk_rows = max(1, CHUNK_ELEMENTS // row_elems)
    shards = []
    with tf.init_scope():
        for i in range(spec.num_shards):
            rows = layout.shard_sizes[i]
            shard_shape = [rows] + inner
            scattered = (
                isinstance(init, initializers.CallableInitializer)
                and init.takes_offset
                and layout.scheme != "div"
                and layout.num_shards > 1
            )
            chunked = scattered or rows > chunk_rows
            ctx = placement(i) if placement is not None else contextlib.nullcontext()
            dev = tf.device(devices[i]) if devices[i] is not None else contextlib.nullcontext()
            with ctx, dev:
                if chunked:
                    initial = lambda s=shard_shape: tf.zeros(s, dtype)  # noqa: E731
                else:
                    initial = lambda i=i, r=rows: _shard_value(init, layout, i, full_shape, dtype, 0, r)  # noqa: E731
                if request.variable_factory is None:
                    var = tf.Variable(
                        initial_value=initial,
                        trainable=request.trainable,
                        name=f"{request.name}/part_{i}",
                        dtype=dtype,
                        shape=shard_shape,
                    )
                else:
                    var = request.variable_factory(i, initial, shard_shape, dtype, request.trainable)
            with tf.device(var.device):
                if scattered:
                    _fill_scattered(var, init, layout, i, full_shape, dtype)
                elif chunked:
                    for start in range(0, rows, chunk_rows):
                        stop = min(rows, start + chunk_rows)
                        chunk = _shard_value(init, layout, i, full_shape, dtype, start, stop)
                        _write_rows(var, tf.IndexedSlices(chunk, tf.range(start, stop, dtype=tf.int64)))
            shards.append(var)
    table = ShardedVariable(shards, layout, request.name, full_shape, dtype, strategy)
    # Kept so that optimizer slots can be built beside each shard (`build_like`).
    table._shard_devices = list(devices)
    table._shard_placement = placement
    return table


def build_like(table: ShardedVariable, name: str, fill: float) -> ShardedVariable:
    """A non-trainable table of `fill` with `table`'s layout, shard `i` placed beside shard `i`.

    Optimizer slots are made this way: same partition, same devices (the
    ps task, the mirrored devices or the worker's host), and checkpointed
    like any table, so they restore into another layout with it.
    """
    request = VariableRequest(
        name=name,
        shape=table.shape.as_list(),
        dtype=table.dtype,
        initializer=lambda shape, dtype: tf.fill(shape, tf.constant(fill, dtype)),
        partitions=table.partition,
        trainable=False,
        scheme=None,
        seed=0,
        exchange=None,
    )
    strategy = table.strategy or tf.distribute.get_strategy()
    placement = getattr(table, "_shard_placement", None)
    devices = getattr(table, "_shard_devices", [None] * table.num_shards)
    with strategy.scope():
        return build_sharded_variable(request, table.partition, devices, strategy, placement)


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
      scheme: "div", "mod" or "balanced" when `partitions` is not a
        `PartitionSpec`.
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
    arguments = dict(
        name=name,
        shape=shape,
        dtype=dtype,
        initializer=initializer,
        partitions=partitions,
        trainable=trainable,
        scheme=scheme,
        seed=seed,
        exchange=exchange,
        placement=placement,
        ids_per_step=ids_per_step,
    )
    return _create(tf.distribute.get_strategy(), arguments)


def _create(strategy, arguments: dict, variable_factory: Optional[Callable] = None) -> ShardedVariable:
    """Validates `create_sharded_variable`'s arguments and calls the strategy's hook."""
    from tf_sharded.strategy import hook_for

    request = _validate(**arguments)
    request.variable_factory = variable_factory
    return hook_for(strategy)(strategy, request)


_SIGNATURE = inspect.signature(create_sharded_variable)


def _strategy_method(self, *args, **kwargs) -> ShardedVariable:
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"create_sharded_variable(): {e}. Signature: create_sharded_variable{_SIGNATURE}") from None
    bound.apply_defaults()
    return _create(self, dict(bound.arguments))


_strategy_method.__doc__ = create_sharded_variable.__doc__.split("Example:")[0]
_strategy_method.__name__ = "create_sharded_variable"
_strategy_method.__signature__ = _SIGNATURE.replace(
    parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *_SIGNATURE.parameters.values()]
)


def install() -> None:
    """Adds `create_sharded_variable` to every `tf.distribute.Strategy`."""
    for cls in {tf.distribute.Strategy, tf.compat.v1.distribute.Strategy}:
        cls.create_sharded_variable = _strategy_method
