"""`ShardedVariable`: one logical table stored as several `tf.Variable` shards.

Every operation on the training path (row lookup, gradient, scatter) is
routed shard by shard and runs on the device that holds the shard; only
`read_value()`, `numpy()` and checkpoint/export paths ever see the whole
table. Checkpoints store the logical table under one full-shape key as
contiguous row slices, so any layout can restore any other.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.layout import Layout, PartitionSpec
from tf_sharded.table import registry, saveable
from tf_sharded.table.ids import check_ids
from tf_sharded.table.protocol import MAX_IDS_RANK, implements_table, register_shards
from tf_sharded.table.remote import held_shards, is_remote, sum_over_workers
from tf_sharded.table.segment import RowSegment


def gather_rows(variable, ids) -> tf.Tensor:
    """`ResourceGather` of rows of one shard; a mirrored shard is read from this replica's own copy.

    A `DistributedVariable` has no `sparse_read`, so `tf.gather` on it reads
    the whole shard (`ReadVariableOp`) and gathers from that copy, every step.
    Its component shares the handle the tape watches, so gradients still reach
    the mirrored variable.
    """
    if isinstance(variable, RowSegment):
        return variable.sparse_read(ids)
    return tf.gather(_compat.local_component(variable), ids)


# Tables of rows [0, n), all created with the table: `ShardedVariable`, and the tables on table servers.
FIXED = registry.register_kind(registry.Kind("fixed", static_rows=True, vocabulary="static"))


@implements_table
class ShardedVariable(registry.TableClass, _compat.Trackable):
    """A table split along its rows into shard variables, possibly on many devices.

    Create one with `strategy.create_sharded_variable(...)` or
    `tfs.create_sharded_variable(...)`; the constructor is for strategy hooks.

    Example:

    >>> import tf_sharded as tfs
    >>> table = tfs.create_sharded_variable(
    ...     "doc_table", shape=[10, 2], initializer="ones", partitions=3)
    >>> table.num_shards, [v.shape[0] for v in table.variables]
    (3, [4, 3, 3])
    >>> tf.nn.embedding_lookup(table, [9, 0]).numpy().tolist()
    [[1.0, 1.0], [1.0, 1.0]]
    """

    def __init__(
        self,
        variables: Sequence[tf.Variable],
        layout: Layout,
        name: str,
        shape,
        dtype,
        strategy: Optional[tf.distribute.Strategy] = None,
        *,
        exchange=None,
        placement: Optional[str] = None,
        slot_factory: Optional[Callable[[ShardedVariable, str, float], ShardedVariable]] = None,
    ):
        self._variables = tuple(variables)
        self._layout = layout
        self._name = name
        self._shape = tf.TensorShape(shape)
        self._dtype = tf.as_dtype(dtype)
        self._strategy = strategy
        self._exchange = exchange
        self._placement = placement
        self._slot_factory = slot_factory
        for i, v in enumerate(self._variables):
            expected = [layout.shard_sizes[i]] + self._shape.as_list()[1:]
            if v.shape.as_list() != expected:
                raise ValueError(f"Shard {i} of '{name}' must have shape {expected}. Received: {v.shape.as_list()}")
        register_shards(self, self._variables)

    # -------------------------------------------------------------- metadata --

    @property
    def variables(self) -> tuple:
        """The shard variables, in shard order."""
        return self._variables

    @property
    def held_variables(self) -> tuple:
        """The shard variables held by this process: all of them, except for a table sharded over the workers
        of MultiWorkerMirroredStrategy, where `variables` lists the other workers' shards as `RemoteShard`s
        (metadata, no memory) and these are the shards of this worker's replicas, to train here."""
        return tuple(v for v in self._variables if not is_remote(v))

    @property
    def shape(self) -> tf.TensorShape:
        """Full logical shape."""
        return self._shape

    @property
    def dtype(self) -> tf.DType:
        return self._dtype

    @property
    def name(self) -> str:
        return self._name

    @property
    def partition(self) -> PartitionSpec:
        """The `PartitionSpec` this table was created with."""
        return self._layout.spec

    @property
    def layout(self) -> Layout:
        """The partition bound to this table's rows."""
        return self._layout

    @property
    def num_shards(self) -> int:
        return len(self._variables)

    @property
    def trainable(self) -> bool:
        return self._variables[0].trainable

    @property
    def devices(self) -> tuple:
        """Device of each shard."""
        return tuple(v.device for v in self._variables)

    @property
    def strategy(self):
        """The strategy whose hook created this table, if any."""
        return self._strategy

    @property
    def exchange(self):
        """The `tfs.exchange.ExchangePolicy` of a mirrored table (None elsewhere)."""
        return self._exchange

    @property
    def sharded_over_workers(self) -> bool:
        """Whether some shards are held by other workers (`placement="sharded"` across processes)."""
        return any(is_remote(v) for v in self._variables)

    @property
    def placement(self):
        """ "device", "host" or "sharded" under a mirrored strategy (None elsewhere)."""
        return self._placement

    kind = FIXED

    @property
    def placement_type(self) -> registry.PlacementType:
        """Where the rows live and how lookups reach them (`tf_sharded.table.registry`)."""
        return registry.placement_of_option(self._placement, self.sharded_over_workers)

    def __repr__(self):
        return (
            f"<tfs.ShardedVariable '{self._name}' shape={tuple(self._shape.as_list())} "
            f"dtype={self._dtype.name} partition={self.partition!r}>"
        )

    def __len__(self):
        return int(self._shape[0])

    # ----------------------------------------------------- row-level access --

    def check_ids(self, ids, arg: str = "ids", max_rank: Optional[int] = MAX_IDS_RANK):
        """Validated ids as `(int64 ids, flat int64 ids)`; see `tf_sharded.table.ids.check_ids`."""
        return check_ids(ids, int(self._shape[0]), self._name, arg, max_rank)

    def shard_rows(self, shard: int) -> int:
        """Rows held by shard `shard`."""
        return self._layout.shard_sizes[shard]

    def make_slot(self, name: str, fill: float) -> ShardedVariable:
        """A non-trainable table of `fill` with this table's layout, shard `i` placed beside shard `i`.

        Optimizer slots are made this way: same partition, same devices (the
        ps task, the mirrored devices or the worker's host), and checkpointed
        like any table, so they restore into another layout with it.
        """
        if self._slot_factory is None:
            raise ValueError(f"Table '{self._name}' was not created by a strategy hook and cannot build slots.")
        return self._slot_factory(self, name, fill)

    def _partition_rows(self, rows: tf.Tensor):
        """Splits int64 logical rows by owning shard.

        Returns `(shard_ids, local_parts, position_parts)`: for each shard the
        local row ids it must serve and their positions in `rows`.
        """
        n = self.num_shards
        shard, local = self._layout.route(rows)
        if n == 1:
            return shard, [local], [tf.range(tf.size(rows, out_type=tf.int32))]
        shard32 = tf.cast(shard, tf.int32)
        locals_ = tf.dynamic_partition(local, shard32, n)
        positions = tf.dynamic_partition(tf.range(tf.size(rows, out_type=tf.int32)), shard32, n)
        return shard32, locals_, positions

    def _gather_rows(self, rows: tf.Tensor) -> tf.Tensor:
        """Rows of the table at int64 logical ids (no gradient bookkeeping)."""
        if self.sharded_over_workers:  # every worker asks for the same rows; each gives those it holds
            return sum_over_workers(self._strategy, self._held_rows(rows))
        _, locals_, positions = self._partition_rows(rows)
        parts = []
        for v, local in zip(self._variables, locals_):
            with tf.device(v.device):
                parts.append(gather_rows(v, local))
        if len(parts) == 1:
            return parts[0]
        return tf.dynamic_stitch(positions, parts)

    def _held_rows(self, rows: tf.Tensor) -> tf.Tensor:
        """A table sharded over workers: its rows at `rows` that this worker holds, zeros for the others'."""
        shape = tf.concat([tf.shape(rows, out_type=tf.int64), tf.constant(self._shape[1:].as_list(), tf.int64)], 0)
        contribution = tf.zeros(shape, self._dtype)
        shard, local = self._layout.route(rows)
        for mine in held_shards(self._variables):
            where = tf.where(tf.equal(shard, mine))[:, 0]
            v = self._variables[mine]
            with tf.device(v.device):
                held = gather_rows(v, tf.gather(local, where))
            contribution = tf.tensor_scatter_nd_update(contribution, where[:, None], held)
        return contribution

    def sparse_read(self, ids, name: Optional[str] = None) -> tf.Tensor:
        """Rows at `ids` (any shape); same as `tfs.embedding_lookup(self, ids)` (dispatched by TensorFlow)."""
        return tf.nn.embedding_lookup(self, ids, name=name)

    def _scatter(self, method: str, sparse_delta: tf.IndexedSlices, use_locking=False, name=None):
        if not isinstance(sparse_delta, tf.IndexedSlices):
            raise TypeError(
                f"Argument `sparse_delta` of {method} must be a tf.IndexedSlices. Received: "
                f"{type(sparse_delta).__name__}"
            )
        _, indices = self.check_ids(sparse_delta.indices, arg="sparse_delta.indices", max_rank=1)
        values = tf.convert_to_tensor(sparse_delta.values, dtype=self._dtype)
        inner = self._shape[1:]
        if values.shape.rank is not None and not values.shape[1:].is_compatible_with(inner):
            raise ValueError(
                f"Argument `sparse_delta.values` of {method} must have shape [k] + {inner.as_list()}. "
                f"Received: values of shape {values.shape.as_list()}"
            )
        n_values = tf.shape(values)[0]
        same = tf.debugging.assert_equal(
            n_values,
            tf.size(indices, out_type=tf.int32),
            message=f"Argument `sparse_delta` of {method}: values and indices must have the same length",
        )
        with tf.control_dependencies([same]):
            shard, locals_, _ = self._partition_rows(indices)
            # Split the values where they are; each shard receives only its rows.
            parts = tf.dynamic_partition(values, shard, self.num_shards) if self.num_shards > 1 else [values]
        for v, local, part in zip(self._variables, locals_, parts):
            if is_remote(v):  # its owner applies its part
                continue
            with tf.device(v.device):
                getattr(v, method)(tf.IndexedSlices(part, local, v.shape), use_locking=use_locking)
        return self

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        """Adds `sparse_delta.values` to the rows `sparse_delta.indices`."""
        return self._scatter("scatter_add", sparse_delta, use_locking, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        """Subtracts `sparse_delta.values` from the rows `sparse_delta.indices`."""
        return self._scatter("scatter_sub", sparse_delta, use_locking, name)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        """Overwrites the rows `sparse_delta.indices`."""
        return self._scatter("scatter_update", sparse_delta, use_locking, name)

    def scatter_max(self, sparse_delta, use_locking=False, name=None):
        """Element-wise max of the rows `sparse_delta.indices` and the values."""
        return self._scatter("scatter_max", sparse_delta, use_locking, name)

    def scatter_min(self, sparse_delta, use_locking=False, name=None):
        """Element-wise min of the rows `sparse_delta.indices` and the values."""
        return self._scatter("scatter_min", sparse_delta, use_locking, name)

    # ----------------------------------------------------- whole-table access --

    def _check_full(self, value, arg: str = "value") -> tf.Tensor:
        value = tf.convert_to_tensor(value, dtype_hint=self._dtype)
        if value.dtype != self._dtype:
            raise TypeError(f"Argument `{arg}` must have dtype {self._dtype.name}. Received: {value.dtype.name}")
        if not value.shape.is_compatible_with(self._shape):
            raise ValueError(
                f"Argument `{arg}` must have the table's full shape {self._shape.as_list()}. "
                f"Received: shape {value.shape.as_list()}"
            )
        return value

    def _shard_rows_of(self, value: tf.Tensor, i: int) -> tf.Tensor:
        """The rows of a full-shape `value` that shard `i` holds, in local order."""
        if self._layout.scheme == "div" or self.num_shards == 1:
            start = self._layout.offsets[i]
            return value[start : start + self._layout.shard_sizes[i]]
        return tf.gather(value, self._layout.logical_rows_tf(i))

    def _assign_full(self, method: str, value, use_locking=False, read_value=True):
        value = self._check_full(value)
        for i, v in enumerate(self._variables):
            if is_remote(v):  # its owner assigns its rows
                continue
            with tf.device(v.device):
                getattr(v, method)(self._shard_rows_of(value, i), use_locking=use_locking)
        return self.read_value() if read_value else self

    def assign(self, value, use_locking=False, name=None, read_value=False):
        """Assigns a full-shape value (split to the shards; never concatenated).

        Returns `self` unless `read_value=True` (which materialises the table).
        """
        return self._assign_full("assign", value, use_locking, read_value)

    def assign_add(self, delta, use_locking=False, name=None, read_value=False):
        """Adds a full-shape `delta` shard by shard."""
        return self._assign_full("assign_add", delta, use_locking, read_value)

    def assign_sub(self, delta, use_locking=False, name=None, read_value=False):
        """Subtracts a full-shape `delta` shard by shard."""
        return self._assign_full("assign_sub", delta, use_locking, read_value)

    def read_value(self) -> tf.Tensor:
        """The whole table in logical row order: an explicit, full materialisation."""
        if self.sharded_over_workers:
            return self._gather_rows(tf.range(int(self._shape[0]), dtype=tf.int64))
        parts = [tf.convert_to_tensor(v) for v in self._variables]
        if len(parts) == 1:
            return parts[0]
        stacked = tf.concat(parts, axis=0)
        if self._layout.scheme == "div":
            return stacked
        shard, local = self._layout.route(tf.range(int(self._shape[0]), dtype=tf.int64))
        offsets = tf.constant(self._layout.offsets[:-1], tf.int64)
        return tf.gather(stacked, tf.gather(offsets, shard) + local)

    def numpy(self) -> np.ndarray:
        """The whole table as a NumPy array (eager only)."""
        if not tf.executing_eagerly():
            raise RuntimeError("ShardedVariable.numpy() is only available eagerly; use read_value().")
        return self.read_value().numpy()

    @property
    def __array_interface__(self) -> dict:
        # `np.asarray(table)` asks for the whole table by name, as `numpy()` does. Not `__array__`: TensorFlow
        # would then take a table passed to a tf.function for a tensor to convert. In a graph there is no
        # value, and `hasattr` must say so (an AttributeError).
        if not tf.executing_eagerly():
            raise AttributeError("__array_interface__: a ShardedVariable has no NumPy value inside a graph")
        value = self.numpy()  # owned by the arrays NumPy makes from it, freed with them
        return {"shape": value.shape, "typestr": value.dtype.str, "data": value, "version": 3}

    # ------------------------------------------------------------ checkpoints --

    def checkpoint_slices(self) -> list:
        """Contiguous logical row ranges saved from each shard's device: `(start, stop, shard)`."""
        if self._layout.scheme == "div" or self.num_shards == 1:
            return [(o, o + s, i) for i, (o, s) in enumerate(zip(self._layout.offsets, self._layout.shard_sizes))]
        even = PartitionSpec(self.num_shards).bind(int(self._shape[0]))
        return [(o, o + s, i) for i, (o, s) in enumerate(zip(even.offsets, even.shard_sizes))]

    def slice_device(self, shard: int) -> str:
        """Where the checkpoint slice of `shard` is read: the shard's device, or for a shard held by another
        worker, this worker's (which gathers it over the collectives)."""
        v = self._variables[shard]
        if not is_remote(v):
            return v.device
        mine = held_shards(self._variables)
        return self._variables[mine[0]].device if mine else ""

    def read_slice(self, start: int, stop: int, shard: int) -> tf.Tensor:
        if self.sharded_over_workers:
            return self._gather_rows(tf.range(start, stop, dtype=tf.int64))
        v = self._variables[shard]
        with tf.device(v.device):
            if self._layout.scheme == "div" or self.num_shards == 1:
                return _read_without_copy(v)
            return self._gather_rows(tf.range(start, stop, dtype=tf.int64))

    def _gather_saveables_for_checkpoint(self):
        # One SaveableObject with one slice per chunk: TensorFlow restores it
        # only once every slice has been read, so a failed read assigns nothing.
        return {_compat.VARIABLE_VALUE_KEY: lambda name: saveable.TableSaveable(self, name)}

    def restore_slices(self, values) -> list:
        """Ops writing the restored slices (in `checkpoint_slices()` order) to the shards that own their rows."""
        ops = []
        for (start, stop, shard), value in zip(self.checkpoint_slices(), values):
            if self._layout.scheme == "div" or self.num_shards == 1:
                v = self._variables[shard]
                if is_remote(v):
                    continue
                with tf.device(v.device):
                    ops.append(v.assign(value, read_value=False))
                continue
            rows = tf.range(start, stop, dtype=tf.int64)
            shard_ids, locals_, _ = self._partition_rows(rows)
            parts = tf.dynamic_partition(value, shard_ids, self.num_shards)
            for v, local, part in zip(self._variables, locals_, parts):
                if is_remote(v):
                    continue
                with tf.device(v.device):
                    ops.append(v.scatter_update(tf.IndexedSlices(part, local, v.shape)))
        return ops


def _read_without_copy(v) -> tf.Tensor:
    """A shard's value for a checkpoint, without a copy of the shard.

    A variable that a sparse op has touched (a gather or a scatter: every
    table shard) is in TensorFlow's copy-on-read mode, where each dense read
    copies the whole buffer, and a save reads every shard of a device at once
    (one `SaveV2`): that was a full second copy of a ps's shards and slots at
    every checkpoint. Turning the mode off makes the read share the buffer;
    the next sparse op copies it only if the read is still alive (copy on
    write), so a save between steps copies nothing.
    """
    if isinstance(v, RowSegment):
        # A segment's rows of its storage, read in place: a slice along the first axis shares the buffer.
        return _read_without_copy(v.storage)[v.offset : v.offset + int(v.shape[0])]
    if isinstance(v, tf.distribute.DistributedValues):  # a mirrored shard: the strategy's own read
        return tf.identity(v.read_value())
    with tf.control_dependencies([tf.raw_ops.DisableCopyOnRead(resource=v.handle)]):
        return v.read_value()


def _refuse_conversion(value, dtype=None, name=None, as_ref=False):
    raise TypeError(
        f"Converting ShardedVariable '{value.name}' to a dense Tensor would concatenate the whole "
        f"table {value.shape.as_list()} on one device, which tf_sharded never does implicitly. "
        "Use tfs.embedding_lookup(table, ids) (or tf.nn.embedding_lookup) to read rows, "
        "table.variables for the shards, or table.read_value() if you do mean the whole table."
    )


tf.register_tensor_conversion_function(ShardedVariable, _refuse_conversion)
