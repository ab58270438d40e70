"""One shard of a dynamic table: a key -> row index, a row pool that grows in place, and columns beside it.

Everything here is core TensorFlow, on the shard's device:

* `index`: a `tf.lookup.experimental.MutableHashTable` from key (int64 or
  string, any value) to the key's row in the pool (-1 when absent);
* `rows`: the trainable `[capacity, dim]` pool, a variable of unknown shape
  that grows by reassignment (by `growth`, so at most that fraction of the
  pool is spare); `columns`: the optimizer's slots, one pool each, grown with
  it; `capacity` and `count` (rows handed out) as int64 variables;
* `lock`: a `tf.CriticalSection`. Inserting keys (look up, allocate, grow,
  write initial rows, index) and every optimizer write run under it, so two
  workers' steps inserting at once on a parameter server neither lose nor
  duplicate a key, and no row update is lost to a concurrent growth (a growth
  copies the pool; a write landing between that read and the reassignment
  would be dropped). Lookups gather outside the lock: a key's row exists in
  the pool before the key is in the index.

Within one traced function every shard's critical sections run one after
another (`_locked`): TensorFlow 2.16 hangs when a function holds two
independent `MutexLock`s at once.

The pool's shape is never read from the variable (`capacity` says it): the
shape of an unknown-shape variable read inside a function scheduled on a
parameter-server worker comes back empty.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional, Tuple

import tensorflow as tf

from tf_sharded import _compat

MIN_GROWTH_ROWS = 64

# Per traced graph: the output of the last critical section it executes, which the next one waits for.
_LAST_RELEASE = weakref.WeakKeyDictionary()


def _fill(count, dim: int, dtype, fill) -> tf.Tensor:
    return tf.fill(tf.stack([tf.cast(count, tf.int32), dim]), tf.constant(fill, dtype))


def _settled(ops) -> tf.Tensor:
    """A scalar that is ready only after every op in `ops` ran (what a critical section waits for)."""
    with tf.control_dependencies([op for op in ops if op is not None]):
        return tf.constant(0, tf.int64)


class DynamicShard:
    """Keys of one shard, their rows and optimizer columns, on one device.

    Args:
      name: the table's name (variables are `name/rows_i`, ...).
      shard: this shard's index in the table.
      device: where its state lives (None: the current device).
      key_dtype: tf.int64 or tf.string.
      dim: row width.
      dtype: row dtype.
      trainable: whether the row pool is trainable.
      growth: capacity grows by this factor (> 1) when keys arrive.
      max_rows: None (unbounded) or the most rows this shard may hold.
    """

    def __init__(self, name, shard, device, key_dtype, dim, dtype, trainable, growth=1.25, max_rows=None):
        self.name, self.shard, self.dim, self.dtype = name, shard, dim, dtype
        self.key_dtype, self.growth, self.max_rows = key_dtype, float(growth), max_rows
        self.columns: Dict[str, Tuple[tf.Variable, float]] = {}
        self._pending_columns: Dict[str, tf.Tensor] = {}
        self._column_capacity: Dict[str, tf.Variable] = {}
        with tf.init_scope(), tf.device(device):
            self.index = tf.lookup.experimental.MutableHashTable(
                key_dtype, tf.int64, default_value=-1, name=f"{name}_index_{shard}"
            )
            self.rows = _compat.plain_variable(
                tf.zeros([0, dim], dtype), name=f"{name}/rows_{shard}", trainable=trainable, shape=tf.TensorShape(None)
            )
            self.capacity = _compat.plain_variable(tf.constant(0, tf.int64), f"{name}/capacity_{shard}", False)
            self.count = _compat.plain_variable(tf.constant(0, tf.int64), f"{name}/count_{shard}", False)
            self.lock = tf.CriticalSection(name=f"{name}_lock_{shard}")
        self.device = self.rows.device

    # --------------------------------------------------------------- state --

    def add_column(self, name: str, fill: float) -> tf.Variable:
        """A pool beside the rows (an optimizer slot), `fill` for every row, or its restored values if pending.

        A column has its own capacity: functions traced before it existed grow
        only the rows, and every optimizer write first extends the column to
        the rows' capacity (`update_exclusively`).
        """
        if name in self.columns:
            return self.columns[name][0]
        with tf.init_scope(), tf.device(self.device):
            capacity = self.capacity.read_value()
            value = _fill(capacity, self.dim, self.dtype, fill)
            pending = self._pending_columns.pop(name, None)
            if pending is not None:
                n = tf.shape(pending, out_type=tf.int64)[0]
                value = tf.tensor_scatter_nd_update(value, tf.range(n)[:, None], tf.cast(pending, self.dtype))
            variable = _compat.plain_variable(
                value, name=f"{self.name}/{name}_{self.shard}", trainable=False, shape=tf.TensorShape(None)
            )
            rows = _compat.plain_variable(capacity, f"{self.name}/{name}_capacity_{self.shard}", False)
        self.columns[name] = (variable, fill)
        self._column_capacity[name] = rows
        return variable

    def _extend_column(self, name: str, target) -> tf.Tensor:
        """Grows column `name` to `target` rows of its fill if it is shorter (under the lock)."""
        variable, fill = self.columns[name]
        have = self._column_capacity[name]
        current = have.read_value()

        def extend():
            extra = _fill(target - current, self.dim, self.dtype, fill)
            grown = variable.assign(tf.concat([self.read(variable), extra], 0), read_value=False)
            with tf.control_dependencies([grown]):
                return _settled([grown, have.assign(target, read_value=False)])

        return tf.cond(current < target, extend, lambda: tf.constant(0, tf.int64))

    def _locked(self, body) -> tf.Tensor:
        """`body()` under the shard's lock, after every critical section the traced function ran before."""
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        previous = _LAST_RELEASE.get(graph) if graph is not None else None

        def after_previous():
            with tf.control_dependencies([previous] if previous is not None else []):
                return body()

        with tf.device(self.device):
            released = self.lock.execute(after_previous, exclusive_resource_access=False)
        if graph is not None:
            _LAST_RELEASE[graph] = released
        return released

    def read(self, variable) -> tf.Tensor:
        return tf.reshape(variable.read_value(), [-1, self.dim])

    # ------------------------------------------------------------- lookups --

    def find(self, keys) -> tf.Tensor:
        """Rows of `keys` (int64, -1 where absent); reads only the index."""
        with tf.device(self.device):
            rows = self.index.lookup(keys)
            rows.set_shape(keys.shape)
            return rows

    def gather(self, rows) -> tf.Tensor:
        """The pool's `rows` (differentiable: the pool's gradient is an `IndexedSlices` of these rows)."""
        with tf.device(self.device):
            values = tf.gather(self.rows, rows)
            values.set_shape([rows.shape[0], self.dim])
            return values

    def find_or_insert(self, keys, initial_rows: Callable, admit: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Rows of distinct `keys`, giving absent ones a row with `initial_rows(keys)` first (atomically).

        `admit` (bool per key) limits which absent keys are inserted; the
        others stay absent (-1).
        """

        def body():
            rows = self.index.lookup(keys)
            rows.set_shape(keys.shape)
            missing = rows < 0 if admit is None else tf.logical_and(rows < 0, admit)
            positions = tf.where(missing)
            new_keys = tf.gather_nd(keys, positions)
            added = tf.size(new_keys, out_type=tf.int64)
            start = self.count.read_value()
            need = start + added
            checks = []
            if self.max_rows is not None:
                checks.append(
                    tf.debugging.assert_less_equal(
                        need,
                        tf.constant(self.max_rows, tf.int64),
                        message=f"Dynamic table '{self.name}' shard {self.shard} is full ({self.max_rows} rows) and "
                        "has no eviction policy to make room; raise `max_rows` or pass an eviction policy",
                    )
                )
            with tf.control_dependencies(checks):
                grown = self._grow_to(need)
            new_rows = start + tf.range(added)
            with tf.control_dependencies([grown]):
                writes = self._write_new(new_rows, initial_rows(new_keys))
                writes += [self.count.assign(need, read_value=False), self.index.insert(new_keys, new_rows)]
            with tf.control_dependencies(writes):
                return tf.tensor_scatter_nd_update(rows, positions, new_rows)

        return self._locked(body)

    def _write_new(self, new_rows, values) -> list:
        writes = [self.rows.scatter_update(tf.IndexedSlices(tf.cast(values, self.dtype), new_rows))]
        n = tf.size(new_rows)
        for variable, fill in self.columns.values():
            writes.append(variable.scatter_update(tf.IndexedSlices(_fill(n, self.dim, self.dtype, fill), new_rows)))
        return writes

    def _grow_to(self, need) -> tf.Tensor:
        """Grows every pool to at least `need` rows (by `growth`, at least MIN_GROWTH_ROWS); call under the lock."""
        capacity = self.capacity.read_value()

        def grow():
            target = tf.cast(tf.math.ceil(tf.cast(capacity, tf.float64) * self.growth), tf.int64)
            target = tf.maximum(need, tf.maximum(target, capacity + MIN_GROWTH_ROWS))
            if self.max_rows is not None:
                target = tf.minimum(target, tf.maximum(need, tf.constant(self.max_rows, tf.int64)))
            extra = _fill(target - capacity, self.dim, self.dtype, 0.0)
            ops = [self.rows.assign(tf.concat([self.read(self.rows), extra], 0), read_value=False)]
            ops += [self._extend_column(name, target) for name in self.columns]
            with tf.control_dependencies(ops):
                return _settled(ops + [self.capacity.assign(target, read_value=False)])

        return tf.cond(need > capacity, grow, lambda: tf.constant(0, tf.int64))

    def update_exclusively(self, fn: Callable[[], object]) -> tf.Tensor:
        """Runs `fn` (writes to this shard's pools) under the shard's lock; returns once its writes are done."""

        def body():
            if tf.executing_eagerly():
                capacity = self.capacity.read_value()
                for name in self.columns:
                    self._extend_column(name, capacity)
                fn()
                return tf.constant(0, tf.int64)
            capacity = self.capacity.read_value()
            extended = [self._extend_column(name, capacity) for name in self.columns]
            graph = tf.compat.v1.get_default_graph()
            with tf.control_dependencies(extended):
                before = set(graph.get_operations())
                fn()
            created = [op for op in graph.get_operations() if op not in before and op.type != "Const"]
            return _settled(created)

        return self._locked(body)

    # -------------------------------------------------- export and restore --

    def export(self, columns=()) -> Tuple[tf.Tensor, tf.Tensor, Dict[str, tf.Tensor]]:
        """`(keys, rows' values, {column: values})` of every live key, in the index's order."""
        with tf.device(self.device):
            keys, rows = self.index.export()
            values = tf.gather(self.read(self.rows), rows)
            extra = {
                name: tf.gather(self.read(self.columns[name][0]), rows) for name in columns if name in self.columns
            }
            return keys, values, extra

    def set_column(self, name: str, keys, values) -> tf.Tensor:
        """Writes `values` into column `name` at the rows of `keys` this shard holds (others are skipped)."""

        def body():
            rows = self.index.lookup(keys)
            held = tf.where(rows >= 0)
            variable = self.columns[name][0]
            update = tf.IndexedSlices(tf.gather_nd(values, held), tf.gather_nd(rows, held))
            return _settled([variable.scatter_update(update)])

        return self._locked(body)

    def size(self) -> tf.Tensor:
        with tf.device(self.device):
            return self.index.size()

    def replace(self, keys, values, columns: Dict[str, tf.Tensor]) -> tf.Tensor:
        """Makes `keys` (distinct) this shard's whole content, rows `0..n-1`; columns not built yet wait here."""

        def body():
            old_keys, _ = self.index.export()
            n = tf.size(keys, out_type=tf.int64)
            ops = [self.index.remove(old_keys)]
            with tf.control_dependencies(ops):
                ops.append(self.index.insert(keys, tf.range(n)))
            ops.append(self.rows.assign(tf.cast(values, self.dtype), read_value=False))
            for name, (variable, fill) in self.columns.items():
                value = columns.get(name)
                value = _fill(n, self.dim, self.dtype, fill) if value is None else tf.cast(value, self.dtype)
                ops.append(variable.assign(value, read_value=False))
            ops += [self.count.assign(n, read_value=False), self.capacity.assign(n, read_value=False)]
            ops += [have.assign(n, read_value=False) for have in self._column_capacity.values()]
            return _settled(ops)

        for name, value in columns.items():
            if name not in self.columns:
                self._pending_columns[name] = value
        return self._locked(body)
