"""`DynamicTable`: an embedding table keyed by raw int64 or string ids, with no `[0, rows)` bound.

A key's shard is a hash of the key (SplitMix64 of an int64 key, the 64-bit
fingerprint of a string) modulo the number of shards; its initial row is a
pure function of (seed, key) (`tf_sharded.initializers.per_key`). Neither
depends on insertion order or on the layout, so a table saved from 2 shards
restores into 3, and a key never inserted reads the value it would have been
given. Each shard is a `DynamicShard` (an index, a row pool that grows, the
optimizer's columns, a lock) on the device its strategy hook chose; a table
sharded over workers holds one and stands in for the others'
(`dynamic.workers`, whose lookups take the one transport of every table sharded
over workers, `table.transport`).

Training lookups insert the keys they meet; the gradient reaches each shard's
row pool (`table.variables[i]`) as `tf.IndexedSlices` of the looked-up rows,
so `tfs.optimizers` and Keras train it like any variable. Checkpoints hold
the live keys, their rows and their optimizer columns, never the capacity.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_sharded import _compat, initializers, policies
from tf_sharded.errors import positive_int
from tf_sharded.table import registry
from tf_sharded.table.dynamic.agree import agreeing_context, gather_keys
from tf_sharded.table.dynamic.group import lookup_groups
from tf_sharded.table.dynamic.keys import (
    key_fingerprints,
    keys_from_file,
    keys_to_file,
    parse_key_dtype,
    shard_of_keys,
)
from tf_sharded.table.dynamic.lock import locked_together
from tf_sharded.table.dynamic.packed import Request, expand, resolve, single
from tf_sharded.table.dynamic.pool import EVENTS, GROWTH, Insert
from tf_sharded.table.dynamic.serving import ExportedDynamicTable
from tf_sharded.table.dynamic.shard import DynamicShard
from tf_sharded.table.dynamic.slots import DynamicSlot
from tf_sharded.table.dynamic.workers import gather_over_workers, lookup_over_workers, max_over_workers
from tf_sharded.table.norms import clip_rows
from tf_sharded.table.protocol import MAX_IDS_RANK, register_shards
from tf_sharded.table.remote import RemoteShard, is_remote, sum_over_workers


class _DynamicKind(registry.Kind):
    """Tables keyed by raw int64 or string keys, their rows created as keys arrive and freed as they are
    evicted: saved as their live keys and rows, served by an `ExportedDynamicTable`."""

    def save_weights(self, table, store, key: str) -> None:
        keys, values = table.export()
        keys_to_file(store, f"{key}__keys", keys)
        store[f"{key}__values"] = values.numpy()

    def load_weights(self, table, store, key: str, layer: str) -> None:
        keys = keys_from_file(store, f"{key}__keys", table.key_dtype, f"Layer '{layer}'")
        table.assign_keys(keys, store[f"{key}__values"][...])

    def checkpoint_difference(self, table, key: str, shapes: dict, dtypes: dict):
        # Saved as attributes of its own (keys, values, counters, optimizer columns), not one value.
        prefix = key[: -len(_compat.VARIABLE_VALUE_KEY)]
        keys, values = prefix + "keys", prefix + "values"
        if keys not in shapes or values not in shapes:
            return prefix, "in the model, not in the checkpoint"
        if dtypes[keys] != table.key_dtype:
            return prefix, f"{dtypes[keys].name} keys in the checkpoint, {table.key_dtype.name} in the model"
        if list(shapes[values])[1:] != [table.dim]:
            return prefix, f"rows of {shapes[values][1]} in the checkpoint, {table.dim} in the model"
        return prefix, ""

    def exported(self, table):
        return ExportedDynamicTable(table)

    def reset_lost(self, table) -> int:
        return table.reset_lost()

    def shard_rows(self, table) -> List[int]:
        return [int(n) for n in np.asarray(table.shard_sizes())]

    def shard_events(self, table) -> np.ndarray:
        return np.asarray(table.shard_events(), np.int64)

    def shard_lookups(self, table) -> None:
        return None  # counted in `shard_events`


DYNAMIC = registry.register_kind(
    _DynamicKind("dynamic", static_rows=False, vocabulary="dynamic", noun="dynamic table", deltas=True)
)


class DynamicTable(registry.TableClass, _compat.Trackable):
    """An embedding table keyed by raw int64 or string ids; rows are created as keys arrive.

    Create one with `strategy.create_dynamic_table(...)` or
    `tfs.create_dynamic_table(...)`; the constructor is for strategy hooks.

    Example:

    >>> import tf_sharded as tfs
    >>> users = tfs.create_dynamic_table("users_doc", dim=2, key_dtype=tf.int64, partitions=2, seed=1)
    >>> rows = tfs.embedding_lookup(users, [-7, 2**60, -7])
    >>> rows.shape.as_list(), int(users.size())
    ([3, 2], 2)
    >>> bool(tf.reduce_all(rows[0] == rows[2]))
    True
    """

    def __init__(
        self,
        name: str,
        dim: int,
        key_dtype=tf.int64,
        dtype=tf.float32,
        initializer: Any = "uniform",
        seed: int = 0,
        devices: Sequence[Optional[str]] = (None,),
        trainable: bool = True,
        strategy: Optional[tf.distribute.Strategy] = None,
        growth: float = GROWTH,
        max_rows: Optional[int] = None,
        admission: Any = None,
        eviction: Any = None,
        exchange: Any = None,
        placement: Optional[str] = None,
        pools: Optional[Sequence[Any]] = None,
        remote: Sequence[bool] = (),
    ):
        self._settings(name, dim, key_dtype, dtype, initializer, seed, trainable, strategy, admission, eviction)
        self._exchange, self._placement = exchange, placement
        max_rows = self._check_growth(growth, max_rows)
        bounded = [e for e in self._evictions if isinstance(e, policies.CapacityEviction)]
        max_keys = bounded[0].per_shard(len(devices)) if bounded else None
        per_shard = None if max_rows is None else -(-max_rows // len(devices))
        pools = [None] * len(devices) if pools is None else list(pools)
        # Sharded over workers (`remote[i]`: shard i is another worker's): a stand-in for its row pool there.
        remote = list(remote) or [False] * len(devices)
        self._shards = [
            RemoteShard([None, self._dim], self._dtype, d, trainable, f"{name}/rows_{i}") if remote[i] else
            DynamicShard(name, i, d, self._key_dtype, self._dim, self._dtype, trainable, growth, per_shard,
                         self._admission, bounded[0] if bounded else None, max_keys, pool)
            for i, (d, pool) in enumerate(zip(devices, pools))
        ]  # fmt: skip
        self._held = [s for s in self._shards if not is_remote(s)]
        with tf.init_scope(), tf.device(self._held[0].device):
            # Training lookups so far: what "last seen", eviction by age and `export(since_step=)` count in.
            self._step = _compat.plain_variable(tf.constant(0, tf.int64), f"{name}/step", False)
        register_shards(self, list(self.variables))

    def _settings(self, name, dim, key_dtype, dtype, initializer, seed, trainable, strategy, admission, eviction):
        """The table's validated description (what any form of the table holds, wherever its shards are)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"Argument `name` must be a non-empty string. Received: name={name!r}")
        self._name = name
        self._dim = positive_int("dim", dim)
        self._key_dtype = parse_key_dtype(key_dtype, name)
        self._dtype = tf.as_dtype(dtype)
        if not self._dtype.is_floating:
            raise TypeError(f"Dynamic table '{name}': argument `dtype` must be a float dtype. Received: {dtype!r}")
        self._seed = int(seed)
        self._initializer = initializers.per_key(initializer, self._dim, self._dtype, self._seed, name)
        self._trainable = bool(trainable)
        self._strategy = strategy
        self._admission, self._evictions = policies.parse(name, admission, eviction)
        bounded = [e for e in self._evictions if isinstance(e, policies.CapacityEviction)]
        # Admission and a capacity bound leave some keys without a row (they read their initial row).
        self._turns_keys_away = self._admission is not None or bool(bounded)
        self._slots: Dict[str, Any] = {}

    def _check_growth(self, growth, max_rows) -> Optional[int]:
        """`max_rows` (None or a positive int), after checking it and `growth` (the row pools' growth factor)."""
        if not isinstance(growth, (int, float)) or not 1.0 < growth <= 4.0:
            raise ValueError(f"Dynamic table '{self._name}': argument `growth` must be in (1, 4]. Received: {growth!r}")
        return None if max_rows is None else positive_int("max_rows", max_rows)

    # -------------------------------------------------------------- metadata --

    name = property(lambda self: self._name)
    dim = property(lambda self: self._dim)
    dtype = property(lambda self: self._dtype)
    key_dtype = property(lambda self: self._key_dtype)
    seed = property(lambda self: self._seed)
    trainable = property(lambda self: self._trainable)
    strategy = property(lambda self: self._strategy)
    shards = property(lambda self: tuple(self._shards))
    num_shards = property(lambda self: len(self._shards))
    devices = property(lambda self: tuple(s.device for s in self._shards))
    # Under MirroredStrategy: one host copy ("host") whose replicas' gradients are all-gathered; else None.
    exchange = property(lambda self: self._exchange)
    placement = property(lambda self: self._placement)
    kind = DYNAMIC

    @property
    def placement_type(self) -> registry.PlacementType:
        """Where the rows live and how lookups reach them (`tf_sharded.table.registry`)."""
        return registry.placement_of_option(self._placement, self.sharded_over_workers)

    # Unknown row count: the logical table is as long as its live keys.
    shape = property(lambda self: tf.TensorShape([None, self._dim]))
    admission = property(lambda self: self._admission)
    eviction = property(lambda self: self._evictions)

    @property
    def slot_columns(self) -> Tuple[str, ...]:
        """The optimizer columns (slots) the table holds beside its rows."""
        return tuple(sorted(self._slots))

    @property
    def step(self) -> tf.Variable:
        """The table's step: how many training lookups it served (its rows' "last seen" steps count in it)."""
        return self._step

    @property
    def variables(self) -> Tuple[tf.Variable, ...]:
        """Each shard's row pool (`[capacity, dim]`, unknown static shape): what gradients and optimizers see
        (another worker's: its `RemoteShard`)."""
        return tuple(s if is_remote(s) else s.rows for s in self._shards)

    @property
    def held_variables(self) -> Tuple[tf.Variable, ...]:
        """The row pools held by this process: all of them, except for a table sharded over the workers of
        MultiWorkerMirroredStrategy, whose `variables` list the other workers' shards as stand-ins."""
        return tuple(s.rows for s in self._held)

    @property
    def sharded_over_workers(self) -> bool:
        """Whether some shards are held by other workers (`placement="sharded"` across processes)."""
        return len(self._held) < len(self._shards)

    @property
    def trainable_variables(self) -> Tuple[tf.Variable, ...]:
        return self.held_variables if self._trainable else ()

    def __repr__(self):
        return (
            f"<tfs.DynamicTable '{self._name}' dim={self._dim} key_dtype={self._key_dtype.name} "
            f"dtype={self._dtype.name} num_shards={self.num_shards}>"
        )

    # ---------------------------------------------------------------- keys --

    def check_ids(self, ids, arg: str = "ids", max_rank: Optional[int] = MAX_IDS_RANK):
        """Validated keys as `(keys, flat keys)` of the table's key dtype; errors name the table and `arg`."""
        if isinstance(ids, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(
                f"Argument `{arg}` of dynamic table '{self._name}' must be a dense tensor of keys. Received: a "
                f"{type(ids).__name__}. For multi-hot keys use tfs.embedding_lookup_sparse."
            )
        if not isinstance(ids, (tf.Tensor, tf.Variable)):
            array = np.asarray(ids)
            if array.dtype.kind in "iu" and self._key_dtype == tf.int64:
                array = array.astype(np.int64)
            ids = tf.convert_to_tensor(array)
        wanted = "int32 or int64" if self._key_dtype == tf.int64 else "string"
        ok = ids.dtype in (tf.int32, tf.int64) if self._key_dtype == tf.int64 else ids.dtype == tf.string
        if not ok:
            raise TypeError(
                f"Argument `{arg}` of dynamic table '{self._name}' (key_dtype={self._key_dtype.name}) must hold "
                f"{wanted} keys. Received: {arg} of dtype {ids.dtype.name}"
            )
        rank = ids.shape.rank
        if max_rank is not None and rank is not None and rank > max_rank:
            raise ValueError(
                f"Argument `{arg}` must have rank 0 to {max_rank}. Received: {arg} of rank {rank} "
                f"(shape {ids.shape.as_list()}) for table '{self._name}'"
            )
        ids = tf.cast(ids, self._key_dtype) if self._key_dtype == tf.int64 else ids
        return ids, tf.reshape(ids, [-1])

    def initial_rows(self, keys) -> tf.Tensor:
        """The rows keys start with (and read until inserted): a function of (seed, key) only."""
        counters = key_fingerprints(tf.convert_to_tensor(keys, self._key_dtype))
        return self._initializer.rows(counters, (1, self._dim), self._dtype)

    def shard_of(self, keys) -> tf.Tensor:
        """The shard each key belongs to (int32)."""
        return shard_of_keys(tf.convert_to_tensor(keys, self._key_dtype), self.num_shards)

    # -------------------------------------------------------------- lookups --

    def _partition(self, keys, *tensors):
        """`keys` and tensors aligned with them, split by the keys' shards (one list per tensor)."""
        if self.num_shards == 1:
            return [[t] for t in (keys, *tensors)]
        shard = self.shard_of(keys)
        return [tf.dynamic_partition(t, shard, self.num_shards) for t in (keys, *tensors)]

    def shard_requests(self, uniq, counts, inserting: bool, step=None):
        """Per shard: `(keys, their positions in uniq)`, and a `Request` for their rows at table step `step`
        when `inserting`, else their rows (-1 where absent; the index alone is read)."""
        keys, where, counts = self._partition(uniq, tf.range(tf.size(uniq, out_type=tf.int32)), counts)
        # Another worker's shard (a table sharded over workers) is resolved there: None here.
        if not inserting:
            return keys, where, [None if is_remote(s) else s.find(k) for s, k in zip(self._shards, keys)]
        requests = [None if is_remote(self._shards[i]) else Request(self, i, k, c, step)
                    for i, (k, c) in enumerate(zip(keys, counts))]  # fmt: skip
        return keys, where, requests

    def insert_part(self, shard: int, keys, counts, step) -> Insert:
        """Shard `shard`'s part of an insert of distinct `keys` into its pool (`RowPool.inserting`)."""
        return Insert(self._shards[shard], keys, key_fingerprints(keys), counts, step, self.initial_rows,
                      self._evictions, self._seed, self._initializer)  # fmt: skip

    @property
    def every_key_held(self) -> bool:
        """Whether a training lookup gives every key a row (no policy turns keys away)."""
        return not self._turns_keys_away

    def shard_values(self, shard: int, keys, rows, held: bool) -> tf.Tensor:
        """On shard `shard`'s device: the values of `rows` of `keys` there (the initial row where a row is -1;
        `held`: none is)."""
        if held:
            return self._shards[shard].gather(rows)
        stored, absent = tf.where(rows >= 0), tf.where(rows < 0)
        values = self._shards[shard].gather(tf.gather_nd(rows, stored))
        fresh = self.initial_rows(tf.gather_nd(keys, absent))
        shape = tf.stack([tf.size(keys, out_type=tf.int64), self._dim])
        return tf.scatter_nd(stored, values, shape) + tf.scatter_nd(absent, fresh, shape)

    def lookup(self, flat_keys, training: bool = True) -> tf.Tensor:
        """Rows of rank-1 `flat_keys`; `training` inserts absent keys (if trainable), else they read their initial row.

        Distinct keys are routed once to their shard; the gradient reaches each
        shard's pool as `IndexedSlices` of the rows looked up, summed per key.
        """
        return lookup_many([(self, flat_keys)], training)[0]

    def plan_lookup(self, flat_keys, training: bool) -> _Lookup:
        """`lookup_many`'s first half for this table: distinct keys routed to shards, and the bodies that
        resolve their rows under the shards' locks (or the rows themselves, read from the index alone)."""
        uniq, idx = tf.unique(flat_keys, out_idx=tf.int32)
        num_unique = tf.size(uniq, out_type=tf.int32)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(idx, tf.int64), idx, num_unique)
        # A table sharded over workers is planned here only outside the replicas (in them its keys go to their
        # owners: `dynamic.workers.lookup_over_workers`): a read every worker makes alike, which inserts nothing.
        inserting = training and self._trainable and not self.sharded_over_workers
        plan = _Lookup(self, idx, num_unique, inserting)
        ctx = agreeing_context(self._strategy) if inserting else None
        if ctx is not None:
            # Several workers, one copy each: every worker inserts everyone's keys, then reads its own.
            all_keys, all_counts, start = gather_keys(ctx, uniq, counts, share=True)
            every, at = tf.unique(all_keys, out_idx=tf.int32)
            summed = tf.math.unsorted_segment_sum(all_counts, at, tf.size(every, out_type=tf.int32))
            plan.agreed = (uniq, every, tf.slice(at, [start], [num_unique]))
            plan.keys, plan.where, plan.resolved = self.shard_requests(every, summed, True, self.advance_step())
        else:
            step = self.advance_step() if inserting else None
            plan.keys, plan.where, plan.resolved = self.shard_requests(uniq, counts, inserting, step)
        return plan

    def advance_step(self) -> tf.Tensor:
        """The table step after one more training step. Replicas of a worker share its copy of the table:
        they count one step together (once, in a merge call, whose result every one of them reads), not one
        each, so that an age bound counts steps and a step's keys are all seen at that step."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1 or len(ctx.strategy.extended.worker_devices) <= 1:
            return self._step.assign_add(1)
        return ctx.merge_call(lambda _: self._step.assign_add(1))

    def finish_lookup(self, plan: _Lookup, rows_per_shard) -> tf.Tensor:
        """`lookup_many`'s second half: the looked-up rows in the caller's order, from each shard's rows
        of its keys (-1: the key's initial row)."""
        keys, where = plan.keys, plan.where
        if self.sharded_over_workers:
            return self._finish_over_workers(plan, rows_per_shard)
        if plan.agreed is not None:
            uniq, every, mine = plan.agreed
            rows = tf.add_n(
                [tf.scatter_nd(w[:, None], r, tf.shape(every, tf.int32)) for w, r in zip(where, rows_per_shard)]
            )
            keys, where, rows_per_shard = self._partition(uniq, tf.range(plan.num_unique), tf.gather(rows, mine))
        held = plan.inserting and self.every_key_held
        parts = [self.shard_values(i, k, r, held) for i, (k, r) in enumerate(zip(keys, rows_per_shard))]
        return self.assemble(plan, where, parts)

    def _finish_over_workers(self, plan: _Lookup, rows_per_shard) -> tf.Tensor:
        """A lookup of a table sharded over workers outside the replicas, where every worker asks for the same
        keys: this worker's values of the keys of its shard, zeros for the others', summed over the workers."""
        shape = tf.stack([plan.num_unique, self._dim])
        parts = [tf.zeros(shape, self._dtype)]
        for i, (k, w, r) in enumerate(zip(plan.keys, plan.where, rows_per_shard)):
            if r is not None:
                parts.append(tf.scatter_nd(w[:, None], self.shard_values(i, k, r, False), shape))
        return expand(sum_over_workers(self._strategy, tf.add_n(parts)), plan.idx, plan.num_unique)

    def assemble(self, plan: _Lookup, where, parts) -> tf.Tensor:
        """The looked-up rows in the caller's order, from each shard's values of its keys at `where`."""
        shape = tf.stack([plan.num_unique, self._dim])
        unique_rows = tf.add_n([tf.zeros(shape, self._dtype)] + [tf.scatter_nd(w[:, None], p, shape)
                                                                 for w, p in zip(where, parts)])  # fmt: skip
        return expand(unique_rows, plan.idx, plan.num_unique)

    # ------------------------------------------------------------- contents --

    def size(self) -> tf.Tensor:
        """Live keys (int64 scalar)."""
        here = tf.add_n([tf.cast(s.size(), tf.int64) for s in self._held])
        return sum_over_workers(self._strategy, here) if self.sharded_over_workers else here

    def shard_sizes(self) -> tf.Tensor:
        """Live keys of each shard (int64 vector). Sharded over workers, every worker must call it (each
        worker's shards are summed over the collectives)."""
        sizes = [tf.constant(0, tf.int64) if is_remote(s) else tf.cast(s.size(), tf.int64) for s in self._shards]
        here = tf.stack(sizes)
        return sum_over_workers(self._strategy, here) if self.sharded_over_workers else here

    def shard_events(self) -> tf.Tensor:
        """Each shard's counters of what its training lookups did (`[shards, len(EVENTS)]` int64, columns as
        `tf_sharded.table.dynamic.pool.EVENTS`: ids looked up, ids found, keys admitted, rejected, evicted),
        totals since the shard was made (or its task restarted). Sharded over workers, every worker must call it."""
        zeros = tf.zeros([len(EVENTS)], tf.int64)
        here = tf.stack([zeros if is_remote(s) else s.events() for s in self._shards])
        return sum_over_workers(self._strategy, here) if self.sharded_over_workers else here

    def index_buckets(self) -> tf.Tensor:
        """Buckets of its shards' key indexes (int64 scalar), what an int64 index's memory is proportional to
        (12 bytes each); 0 for string keys, whose index TensorFlow does not measure."""
        counts = [c for c in (s.buckets() for s in self._held) if c is not None]
        here = tf.add_n([tf.constant(0, tf.int64)] + counts)
        return sum_over_workers(self._strategy, here) if self.sharded_over_workers else here

    def export(self, since_step: Optional[int] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        """`(keys, rows)` of every live key, or of those looked up in training after table step `since_step`.

        An explicit full read (order unspecified). `since_step=S` gives the
        rows updated in steps `S+1 ..` `table.step` (a delta for serving).
        """
        keys, values, _ = self.export_columns((), since_step)
        return keys, values

    def export_columns(self, columns: Sequence[str] = (), since_step: Optional[int] = None):
        """`(keys, rows, {column: values})` of live keys, columns aligned with the keys.

        Columns are optimizer slot names, "seen" (last training step) and "hits" (occurrences).
        """
        parts = [s.export(columns, since_step) for s in self._held]
        keys = tf.concat([p[0] for p in parts], 0)
        values = tf.concat([tf.reshape(p[1], [-1, self._dim]) for p in parts], 0)
        extra = {c: tf.concat([p[2][c] for p in parts], 0) for c in columns}
        if self.sharded_over_workers:  # every worker's keys, in worker order
            keys, values, *gathered = gather_over_workers(self._strategy, [keys, values] + [extra[c] for c in columns])
            extra = dict(zip(columns, gathered))
        return keys, values, extra

    def assign_keys(self, keys, values, columns: Optional[Dict[str, Any]] = None) -> None:
        """Makes `(keys, values)` (and optimizer columns aligned with them) the table's whole content."""
        keys = tf.convert_to_tensor(keys)
        if keys.dtype != self._key_dtype:
            raise TypeError(
                f"Dynamic table '{self._name}' has key_dtype={self._key_dtype.name}; the keys to load are "
                f"{keys.dtype.name}. Received keys saved from another table."
            )
        values = tf.convert_to_tensor(values)
        if values.shape.rank is not None and (values.shape.rank != 2 or values.shape[1] != self._dim):
            raise ValueError(
                f"Dynamic table '{self._name}' has dim={self._dim}; the rows to load have shape "
                f"{values.shape.as_list()}. Received rows saved from another table configuration."
            )
        counts = (keys.shape[0] if keys.shape.rank == 1 else None, values.shape[0] if values.shape.rank else None)
        if keys.shape.rank not in (None, 1) or (None not in counts and counts[0] != counts[1]):
            raise ValueError(
                f"Dynamic table '{self._name}': the keys to load must be one per row of values. Received keys of "
                f"shape {keys.shape.as_list()} and rows of shape {values.shape.as_list()}."
            )
        names = list(columns or {})
        key_parts, value_parts, *column_parts = self._partition(keys, values, *[columns[k] for k in names])
        for i, s in enumerate(self._shards):
            if not is_remote(s):  # another worker's shard: that worker loads it
                s.replace(key_parts[i], value_parts[i], {k: parts[i] for k, parts in zip(names, column_parts)})

    def reset_lost(self) -> int:
        """After a parameter server restarted: the shards it held (and the table step, if it held that) set
        to an empty table's state, which a checkpoint restore then fills. Returns how many variables it set."""
        done = sum(s.reset_lost() for s in self._held)
        if not bool(self._step.is_initialized()):
            self._step.assign(0)
            done += 1
        return done

    # ---------------------------------------------------------- optimizers --

    def make_slot(self, name: str, fill: float) -> DynamicSlot:
        """An optimizer slot: a column of `fill` beside every shard's rows, grown and saved with them."""
        column = name.rsplit("/", 1)[-1]
        if column not in self._slots:
            columns = [s if is_remote(s) else s.add_column(column, fill) for s in self._shards]
            self._slots[column] = DynamicSlot(self, column, columns)
        return self._slots[column]

    def update_exclusively(self, shard: int, fn) -> tf.Tensor:
        """Runs an optimizer's writes to shard `shard` (rows and columns) under the shard's lock."""
        return self._shards[shard].update_exclusively(fn)

    def set_column(self, column: str, keys, values) -> None:
        """Sets optimizer column `column` of `keys` that the table holds to `values` (others are skipped)."""
        keys = tf.convert_to_tensor(keys, self._key_dtype)
        for s, k, v in zip(self._shards, *self._partition(keys, tf.convert_to_tensor(values, self._dtype))):
            if not is_remote(s):
                s.set_column(column, k, v)

    def shard_rows(self, shard: int) -> tf.Tensor:
        return self._shards[shard].capacity.read_value()

    # ---------------------------------------------------------- checkpoints --

    def _serialize_to_tensors(self):
        saved = _compat.restoring_attributes(self)
        if saved is not None:
            self._check_restore(saved)
        columns = sorted(self._slots)
        keys, values, extra = self.export_columns(columns + ["seen", "hits"])
        tensors = {"keys": keys, "values": values, "seen": extra["seen"], "hits": extra["hits"], "step": self.step}
        tensors.update({f"slot-{c}": extra[c] for c in columns})
        if self._admission is not None and (saved is None or "sketch" in saved):
            sketch = self._saved_sketch()
            if sketch is not None:
                tensors["sketch"] = sketch
        # A restore reads only the names declared here: the checkpoint's optimizer columns too, even for a
        # table whose optimizer is not built yet (they wait in the shards for it).
        for name in saved or ():
            if name.startswith("slot-") and name not in tensors:
                tensors[name] = tf.zeros([0, self._dim], self._dtype)
        return tensors

    def _saved_sketch(self) -> Optional[tf.Tensor]:
        """The admission sketch a checkpoint holds (None without one). Layout-free: each key's counts are in its
        shard's sketch, and the elementwise maximum over shards never underestimates a key (restored into every
        shard, saving it again does not inflate it)."""
        sketches = [s.admission_state for s in self._held if s.admission_state is not None]
        if not sketches:
            return None
        sketch = tf.reduce_max(tf.stack([v.read_value() for v in sketches]), 0)
        return max_over_workers(self._strategy, sketch) if self.sharded_over_workers else sketch

    def _sketch_shape(self) -> Optional[list]:
        """The shape of each shard's admission sketch (None without one)."""
        states = [s.admission_state for s in self._held if s.admission_state is not None]
        return states[0].shape.as_list() if states else None

    def _check_restore(self, saved) -> None:
        """Refuses a checkpoint of another key dtype or row width before anything is read or assigned."""
        if "keys" not in saved or "values" not in saved:
            raise ValueError(
                f"Dynamic table '{self._name}': the checkpoint entry restored into it is not a dynamic table's "
                f"(it holds {sorted(saved)}). Received a checkpoint of another model."
            )
        key_dtype, shape = saved["keys"][2], saved["values"][1]
        if key_dtype is not None and tf.as_dtype(key_dtype) != self._key_dtype:
            raise TypeError(
                f"Dynamic table '{self._name}' has key_dtype={self._key_dtype.name}; the checkpoint's table has "
                f"{tf.as_dtype(key_dtype).name} keys. Received a checkpoint of another table."
            )
        sketch = self._sketch_shape()
        if "sketch" in saved and sketch is not None and saved["sketch"][1] is not None:
            if list(saved["sketch"][1]) != sketch:
                raise ValueError(
                    f"Dynamic table '{self._name}': the admission sketch is {sketch}; the "
                    f"checkpoint's is {list(saved['sketch'][1])}. Use the same sketch_width and sketch_depth."
                )
        if shape is not None and list(shape)[1:] != [self._dim]:
            raise ValueError(
                f"Dynamic table '{self._name}' has dim={self._dim}; the checkpoint's rows have shape "
                f"{list(shape)}. Received a checkpoint of another table configuration."
            )

    def _restore_from_tensors(self, restored_tensors):
        columns = {k[len("slot-") :]: v for k, v in restored_tensors.items() if k.startswith("slot-")}
        columns.update({k: restored_tensors[k] for k in ("seen", "hits") if k in restored_tensors})
        self.assign_keys(restored_tensors["keys"], restored_tensors["values"], columns)
        if "step" in restored_tensors:
            self._step.assign(restored_tensors["step"])
        if "sketch" in restored_tensors:
            for shard in self._held:
                if shard.admission_state is not None:
                    shard.admission_state.assign(restored_tensors["sketch"])
        return tf.no_op() if not tf.executing_eagerly() else None


class _Lookup:
    """One table's part of `lookup_many`: its distinct keys, per shard, and how their rows are resolved."""

    def __init__(self, table: DynamicTable, idx, num_unique, inserting: bool):
        self.table, self.idx, self.num_unique, self.inserting = table, idx, num_unique, inserting
        self.keys = self.where = self.resolved = self.agreed = None


def lookup_many(pairs, training: bool = True) -> list:
    """Rows for several `(DynamicTable, rank-1 keys)` pairs; a training lookup's inserts into every table's
    shards on one device run in one critical section, its keys and rows travel as one tensor each way per
    device (`dynamic.packed`), not one per table and shard."""
    out = lookup_groups(pairs, training)  # tables sharing row pools, a group at a time
    rest = [i for i, rows in enumerate(out) if rows is None]
    for i, rows in zip(rest, _lookup_each([pairs[i] for i in rest], training)):
        out[i] = rows
    return out


def _lookup_each(pairs, training: bool) -> list:
    """`lookup_many` table by table (the inserts still in one critical section per device; tables sharded over
    workers exchange their keys and rows together, `dynamic.workers`)."""
    out = [None] * len(pairs)
    over_workers = [i for i, (table, _) in enumerate(pairs) if table.sharded_over_workers]
    ctx = agreeing_context(pairs[over_workers[0]][0].strategy) if over_workers else None
    if ctx is not None:
        for i, rows in zip(over_workers, lookup_over_workers([pairs[i] for i in over_workers], training, ctx)):
            out[i] = rows
    rest = [i for i, rows in enumerate(out) if rows is None]
    plans = [pairs[i][0].plan_lookup(pairs[i][1], training) for i in rest]
    packed = [request for plan in plans if plan.inserting and plan.agreed is None for request in plan.resolved]
    values = iter(resolve(packed))
    # Several workers' copies agree (every worker inserts everyone's keys): the rows, not values, come back.
    agreed = [r.table.insert_part(r.shard, r.keys, r.counts, r.step)
              for plan in plans if plan.inserting and plan.agreed is not None for r in plan.resolved]  # fmt: skip
    rows = iter(locked_together([(p.member.pool, single(p)) for p in agreed]))
    for i, plan in zip(rest, plans):
        if plan.inserting and plan.agreed is None:
            out[i] = plan.table.assemble(plan, plan.where, [next(values) for _ in plan.resolved])
            continue
        resolved = plan.resolved
        if plan.inserting:
            resolved = [next(rows) for _ in plan.resolved]
        out[i] = plan.table.finish_lookup(plan, resolved)
    return out


# Dynamic tables in this process's memory, whatever their placement (sharded over workers included: their
# exchange is `dynamic.workers.lookup_over_workers`); tables on table servers have a route of their own.
registry.register_lookup(
    None, DYNAMIC, lambda pairs, max_norm, training: [clip_rows(r, max_norm) for r in lookup_many(pairs, training)]
)
