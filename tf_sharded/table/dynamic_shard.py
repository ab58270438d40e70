"""One shard of a dynamic table: a key -> row index, a row pool that grows in place, and columns beside it.

Everything here is core TensorFlow, on the shard's device:

* `index`: a `tf.lookup.experimental.MutableHashTable` from key (int64 or
  string, any value) to the key's row in the pool (-1 when absent);
* `rows`: the trainable `[capacity, dim]` pool, a variable of unknown shape
  that grows by reassignment (by `growth`, so at most that fraction of the
  pool is spare); `columns`: the optimizer's slots, one pool each, grown with
  it; `seen` (the table step of each row's last training lookup) and `hits`
  (its occurrences), which delta export and the eviction policies read;
  `capacity`, `count` (rows handed out) and a free list of evicted rows,
  which new keys take first;
* `lock`: a `tf.CriticalSection` shared by every dynamic shard on the same
  device (`device_lock`). Inserting keys (look up, allocate, grow, write
  initial rows, index) and every optimizer write run under it, so two
  workers' steps inserting at once on a parameter server neither lose nor
  duplicate a key, and no row update is lost to a concurrent growth (a growth
  copies the pool; a write landing between that read and the reassignment
  would be dropped). Lookups gather outside the lock: a key's row exists in
  the pool before the key is in the index. (With eviction, a row freed and
  given to another key between a step's lookup and its update receives that
  update: the policies evict the least recently seen keys and never the
  current batch's, so this needs a key in flight on another worker to be the
  eviction victim.)

Because the lock is per device, one critical section can serve every table
on that device (`dynamic_lock`): `inserting` is the body a lookup of many
tables runs there for this shard, and `exclusive_body` the body of its
optimizer writes.

The pool's shape is never read from the variable (`capacity` says it): the
shape of an unknown-shape variable read inside a function scheduled on a
parameter-server worker comes back empty.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.dynamic_lock import defer, device_lock, locked_on, settled

MIN_GROWTH_ROWS = 64


class Column:
    """A pool beside the rows: `[capacity]` or `[capacity, width]` of `dtype`, new rows set to `fill`."""

    def __init__(self, variable, fill, dtype, width: Optional[int]):
        self.variable, self.fill, self.dtype, self.width = variable, fill, dtype, width

    def inner(self) -> list:
        return [] if self.width is None else [self.width]

    def filled(self, count) -> tf.Tensor:
        return tf.fill(tf.stack([tf.cast(count, tf.int32)] + self.inner()), tf.constant(self.fill, self.dtype))

    def read(self) -> tf.Tensor:
        return tf.reshape(self.variable.read_value(), [-1] + self.inner())


class DynamicShard:
    """Keys of one shard, their rows, optimizer columns and metadata, on one device.

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
      admission: a `tfs.policies.Admission` or None.
      capacity_eviction: a `tfs.CapacityEviction` or None (its share is `max_keys`).
      max_keys: this shard's share of the capacity policy's `max_keys`.
    """

    def __init__(self, name, shard, device, key_dtype, dim, dtype, trainable, growth=1.25, max_rows=None,
                 admission=None, capacity_eviction=None, max_keys=None):  # fmt: skip
        self.name, self.shard, self.dim, self.dtype = name, shard, dim, dtype
        self.key_dtype, self.growth, self.max_rows = key_dtype, float(growth), max_rows
        self.admission, self.capacity_eviction, self.max_keys = admission, capacity_eviction, max_keys
        self.columns: Dict[str, Column] = {}
        self._pending_columns: Dict[str, tf.Tensor] = {}
        self._column_capacity: Dict[str, tf.Variable] = {}
        with tf.init_scope(), tf.device(device):
            self.index = tf.lookup.experimental.MutableHashTable(
                key_dtype, tf.int64, default_value=-1, name=f"{name}_index_{shard}"
            )
            _compat.local_table_default(self.index)  # what a step reads stays valid across a ps restart
            unknown = tf.TensorShape(None)
            new = lambda value, what, trainable=False: _compat.plain_variable(  # noqa: E731
                value, f"{name}/{what}_{shard}", trainable, shape=unknown if value.shape.rank else None
            )
            self.rows = new(tf.zeros([0, dim], dtype), "rows", trainable)
            self._rows = Column(self.rows, 0.0, dtype, dim)
            self.seen = Column(new(tf.zeros([0], tf.int64), "seen"), 0, tf.int64, None)
            self.hits = Column(new(tf.zeros([0], tf.int64), "hits"), 0, tf.int64, None)
            self.free = new(tf.zeros([0], tf.int64), "free")
            self.capacity = new(tf.constant(0, tf.int64), "capacity")
            self.count = new(tf.constant(0, tf.int64), "count")
            self.free_count = new(tf.constant(0, tf.int64), "free_count")
        self.device = self.rows.device
        self.lock = device_lock(self.device)
        self.admission_state = admission.make_state(self) if admission is not None else None

    def _pools(self):
        """Every pool that grows with the rows in `_grow_to` (optimizer columns catch up on their own)."""
        return [self._rows, self.seen, self.hits]

    # --------------------------------------------------------------- state --

    def add_column(self, name: str, fill: float) -> tf.Variable:
        """A pool beside the rows (an optimizer slot), `fill` for every row, or its restored values if pending.

        A column has its own capacity: functions traced before it existed grow
        only the rows, and every optimizer write first extends the column to
        the rows' capacity (`update_exclusively`).
        """
        if name in self.columns:
            return self.columns[name].variable
        with tf.init_scope(), tf.device(self.device):
            capacity = self.capacity.read_value()
            column = Column(None, fill, self.dtype, self.dim)
            value = column.filled(capacity)
            pending = self._pending_columns.pop(name, None)
            if pending is not None:
                n = tf.shape(pending, out_type=tf.int64)[0]
                value = tf.tensor_scatter_nd_update(value, tf.range(n)[:, None], tf.cast(pending, self.dtype))
            column.variable = _compat.plain_variable(
                value, name=f"{self.name}/{name}_{self.shard}", trainable=False, shape=tf.TensorShape(None)
            )
            rows = _compat.plain_variable(capacity, f"{self.name}/{name}_capacity_{self.shard}", False)
        self.columns[name] = column
        self._column_capacity[name] = rows
        return column.variable

    def _extend(self, column: Column, current, target) -> tf.Tensor:
        grown = column.variable.assign(tf.concat([column.read(), column.filled(target - current)], 0), read_value=False)
        with tf.control_dependencies([grown]):
            return tf.identity(target)

    def _extend_column(self, name: str, target) -> tf.Tensor:
        """Grows column `name` to `target` rows of its fill if it is shorter (under the lock)."""
        have = self._column_capacity[name]
        current = have.read_value()

        def extend():
            with tf.control_dependencies([self._extend(self.columns[name], current, target)]):
                return settled([have.assign(target, read_value=False)])

        return tf.cond(current < target, extend, lambda: tf.constant(0, tf.int64))

    def _locked(self, body) -> tf.Tensor:
        """`body()` under the shard's lock, after every critical section the traced function ran before."""
        return locked_on(self.lock, self.device, body)

    def read(self, variable) -> tf.Tensor:
        return tf.reshape(variable.read_value(), [-1, self.dim])

    # ------------------------------------------------------------- lookups --

    def find(self, keys) -> tf.Tensor:
        """Rows of `keys` (int64, -1 where absent); reads only the index."""
        with tf.device(self.device):
            return self._index_rows(keys)

    def _index_rows(self, keys) -> tf.Tensor:
        """The index's rows of `keys`, its default (-1) made here: the table's own default is a tensor of the
        process that created it, which every lookup would fetch from there."""
        rows = tf.raw_ops.LookupTableFindV2(
            table_handle=self.index.resource_handle, keys=keys, default_value=tf.constant(-1, tf.int64)
        )
        rows.set_shape(keys.shape)
        return rows

    def gather(self, rows) -> tf.Tensor:
        """The pool's `rows` (differentiable: the pool's gradient is an `IndexedSlices` of these rows)."""
        with tf.device(self.device):
            values = tf.gather(self.rows, rows)
            values.set_shape([rows.shape[0], self.dim])
            return values

    def find_or_insert(self, keys, fingerprints, counts, step, initial_rows: Callable, evictions=(), seed=0):
        """Rows of distinct `keys` at table step `step`, giving admitted absent keys a row first (atomically).

        `counts`: occurrences of each key in the batch. Keys the admission
        policy turns away, or that do not fit a capacity bound, stay -1.
        Marks the found and inserted rows as seen at `step`, then applies the
        steps-since-seen eviction if it is due.
        """
        return self._locked(self.inserting(keys, fingerprints, counts, step, initial_rows, evictions, seed))

    def inserting(self, keys, fingerprints, counts, step, initial_rows: Callable, evictions=(), seed=0):
        """The body of `find_or_insert`, to run under the shard's lock (`locked_together`)."""

        def body():
            found = self._index_rows(keys)
            missing = found < 0
            if self.admission is not None:
                missing = self.admission.admit(self.admission_state, fingerprints, counts, step, missing, seed)
            positions = tf.where(missing)
            if self.capacity_eviction is not None:
                positions = self._make_room(positions, found)
            new_keys = tf.gather_nd(keys, positions)
            new_rows, allocated = self._allocate(tf.size(new_keys, out_type=tf.int64))
            with tf.control_dependencies([allocated]):
                # A column created after the last growth (by a function traced before it) catches up first.
                capacity = self.capacity.read_value()
                caught_up = [self._extend_column(name, capacity) for name in self.columns]
            with tf.control_dependencies(caught_up + [allocated]):
                writes = self._write_new(new_rows, initial_rows(new_keys))
                writes.append(self.index.insert(new_keys, new_rows))
            with tf.control_dependencies(writes):
                rows = tf.tensor_scatter_nd_update(found, positions, new_rows)
                present = tf.where(rows >= 0)
                held = tf.gather_nd(rows, present)
                marks = [
                    self.seen.variable.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(held), step), held)),
                    self.hits.variable.scatter_add(tf.IndexedSlices(tf.gather_nd(counts, present), held)),
                ]
            with tf.control_dependencies(marks):
                expired = [self._expire(step, e) for e in evictions if not hasattr(e, "per_shard")]
            with tf.control_dependencies(expired):
                return tf.identity(rows)

        return body

    def _allocate(self, added) -> Tuple[tf.Tensor, tf.Tensor]:
        """`added` rows for new keys (freed rows first, then fresh ones, growing the pools); call under the lock."""
        free_count = self.free_count.read_value()
        reused = tf.minimum(added, free_count)
        taken = tf.reshape(self.free.read_value(), [-1])[free_count - reused : free_count]
        start = self.count.read_value()
        need = start + added - reused
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
        new_rows = tf.concat([taken, start + tf.range(added - reused)], 0)
        with tf.control_dependencies([grown]):
            done = settled(
                [self.count.assign(need, read_value=False), self.free_count.assign_sub(reused, read_value=False)]
            )
        return new_rows, done

    def _write_new(self, new_rows, values) -> list:
        writes = [self.rows.scatter_update(tf.IndexedSlices(tf.cast(values, self.dtype), new_rows))]
        n = tf.size(new_rows)
        for column in [self.seen, self.hits] + list(self.columns.values()):
            writes.append(column.variable.scatter_update(tf.IndexedSlices(column.filled(n), new_rows)))
        return writes

    def _grow_to(self, need) -> tf.Tensor:
        """Grows every pool to at least `need` rows (by `growth`, at least MIN_GROWTH_ROWS); call under the lock."""
        capacity = self.capacity.read_value()

        def grow():
            target = tf.cast(tf.math.ceil(tf.cast(capacity, tf.float64) * self.growth), tf.int64)
            target = tf.maximum(need, tf.maximum(target, capacity + MIN_GROWTH_ROWS))
            bound = self.max_rows if self.max_keys is None else self.max_keys
            if bound is not None:
                target = tf.minimum(target, tf.maximum(need, tf.constant(bound, tf.int64)))
            ops = [self._extend(pool, capacity, target) for pool in self._pools()]
            ops += [self._extend_column(name, target) for name in self.columns]
            with tf.control_dependencies(ops):
                return settled(ops + [self.capacity.assign(target, read_value=False)])

        return tf.cond(need > capacity, grow, lambda: tf.constant(0, tf.int64))

    # ------------------------------------------------------------ eviction --

    def evict(self, victims) -> tf.Tensor:
        """Removes the keys at rows `victims` and puts the rows on the free list; call under the lock."""
        keys, rows = self._live()
        chosen = tf.scatter_nd(victims[:, None], tf.ones_like(victims, tf.bool), self._capacity_shape())
        gone = tf.gather(keys, tf.where(tf.gather(chosen, rows))[:, 0])
        free_count = self.free_count.read_value()
        kept = tf.reshape(self.free.read_value(), [-1])[:free_count]
        ops = [self.index.remove(gone), self.free.assign(tf.concat([kept, victims], 0), read_value=False)]
        ops.append(self.free_count.assign_add(tf.size(victims, out_type=tf.int64), read_value=False))
        return settled(ops)

    def dense_shape(self) -> tf.Tensor:
        """`[capacity, dim]` (int64): the pool's shape, for its gradients."""
        return tf.stack([self.capacity.read_value(), tf.constant(self.dim, tf.int64)])

    def _capacity_shape(self) -> tf.Tensor:
        """`[capacity]`, from the variable that holds it (never the shape of a pool: see the module doc)."""
        return tf.reshape(self.capacity.read_value(), [1])

    def _live(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """`(keys, rows)` of the live keys, as rank-1 tensors."""
        keys, rows = self.index.export()
        return tf.reshape(keys, [-1]), tf.reshape(rows, [-1])

    def _live_rows(self) -> tf.Tensor:
        return self._live()[1]

    def _expire(self, step, policy) -> tf.Tensor:
        """Evicts the keys last seen at a step `<= step - max_steps`, if `step` is a multiple of `every`."""

        def run():
            rows = self._live_rows()
            old = tf.gather(self.seen.read(), rows) <= step - policy.max_steps
            return self.evict(tf.boolean_mask(rows, old))

        return tf.cond(tf.equal(tf.math.floormod(step, policy.every), 0), run, lambda: tf.constant(0, tf.int64))

    def _make_room(self, positions, rows) -> tf.Tensor:
        """Evicts what the new keys at `positions` need (and the headroom); returns the positions that fit."""
        policy, limit = self.capacity_eviction, self.max_keys
        wanted = tf.size(positions, out_type=tf.int64)
        live = self.index.size()
        batch_rows = tf.boolean_mask(rows, rows >= 0)
        evictable = live - tf.size(batch_rows, out_type=tf.int64)
        over = live + wanted - limit
        extra = int(policy.headroom * limit)
        evicted = tf.clip_by_value(over + extra, 0, evictable)
        evicted = tf.where(over > 0, evicted, 0)

        def run():
            candidates = self._live_rows()
            protected = tf.scatter_nd(batch_rows[:, None], tf.ones_like(batch_rows, tf.bool), self._capacity_shape())
            candidates = tf.boolean_mask(candidates, tf.logical_not(tf.gather(protected, candidates)))
            scores = policy.scores(tf.gather(self.seen.read(), candidates), tf.gather(self.hits.read(), candidates))
            _, lowest = tf.math.top_k(-scores, k=tf.cast(evicted, tf.int32))
            return self.evict(tf.gather(candidates, lowest))

        done = tf.cond(evicted > 0, run, lambda: tf.constant(0, tf.int64))
        fits = tf.maximum(tf.minimum(wanted, limit - (live - evicted)), 0)
        with tf.control_dependencies([done]):
            return positions[: tf.cast(fits, tf.int32)]

    def update_exclusively(self, fn: Callable[[], object]) -> Optional[tf.Tensor]:
        """Runs `fn` (writes to this shard's pools) under the shard's lock; returns once its writes are done.

        Inside `grouped_updates` the writes wait for the block's end and this returns None.
        """
        body = lambda: self.exclusive_body(fn)  # noqa: E731
        return None if defer(self, body) else self._locked(body)

    def exclusive_body(self, fn: Callable[[], object]) -> tf.Tensor:
        """`fn()` after the optimizer's columns caught up with the rows' capacity; call under the lock."""
        capacity = self.capacity.read_value()
        if tf.executing_eagerly():
            for name in self.columns:
                self._extend_column(name, capacity)
            fn()
            return tf.constant(0, tf.int64)
        extended = [self._extend_column(name, capacity) for name in self.columns]
        graph = tf.compat.v1.get_default_graph()
        with tf.control_dependencies(extended):
            before = set(graph.get_operations())
            fn()
        created = [op for op in graph.get_operations() if op not in before and op.type != "Const"]
        return settled(created)

    def reset_lost(self) -> int:
        """After this shard's task restarted (its variables renewed, uninitialised, its index empty): the
        state of an empty shard, which a checkpoint restore then fills. Returns how many variables it set;
        a shard whose task kept its state is left as it is."""
        with tf.device(self.device):
            empty = [(self.rows, self._rows.filled(0)), (self.free, tf.zeros([0], tf.int64))]
            empty += [(c.variable, c.filled(0)) for c in (self.seen, self.hits, *self.columns.values())]
            scalars = [self.capacity, self.count, self.free_count, *self._column_capacity.values()]
            empty += [(v, tf.constant(0, tf.int64)) for v in scalars]
            if self.admission_state is not None:
                empty.append((self.admission_state, tf.zeros(self.admission_state.shape, self.admission_state.dtype)))
            lost = [(v, value) for v, value in empty if not bool(v.is_initialized())]
            for variable, value in lost:
                variable.assign(value, read_value=False)
        return len(lost)

    # -------------------------------------------------- export and restore --

    def export(self, columns=(), since_step=None):
        """`(keys, rows' values, {column: values})` of live keys (seen after `since_step` if given)."""
        with tf.device(self.device):
            keys, rows = self.index.export()
            if since_step is not None:
                recent = tf.where(tf.gather(self.seen.read(), rows) > since_step)[:, 0]
                keys, rows = tf.gather(keys, recent), tf.gather(rows, recent)
            values = tf.gather(self.read(self.rows), rows)
            pools = {"seen": self.seen, "hits": self.hits, **self.columns}
            extra = {name: tf.gather(pools[name].read(), rows) for name in columns if name in pools}
            return keys, values, extra

    def set_column(self, name: str, keys, values) -> tf.Tensor:
        """Writes `values` into column `name` at the rows of `keys` this shard holds (others are skipped)."""

        def body():
            rows = self._index_rows(keys)
            held = tf.where(rows >= 0)
            update = tf.IndexedSlices(tf.gather_nd(values, held), tf.gather_nd(rows, held))
            return settled([self.columns[name].variable.scatter_update(update)])

        return self._locked(body)

    def size(self) -> tf.Tensor:
        with tf.device(self.device):
            return self.index.size()

    def replace(self, keys, values, columns: Dict[str, tf.Tensor]) -> tf.Tensor:
        """Makes `keys` (distinct) this shard's whole content, rows `0..n-1`; columns not built yet wait here.

        `columns` may hold "seen" and "hits" (int64 per key) besides optimizer columns.
        """

        def body():
            old_keys, _ = self.index.export()
            n = tf.size(keys, out_type=tf.int64)
            ops = [self.index.remove(old_keys)]
            with tf.control_dependencies(ops):
                ops.append(self.index.insert(keys, tf.range(n)))
            ops.append(self.rows.assign(tf.cast(values, self.dtype), read_value=False))
            pools = {"seen": self.seen, "hits": self.hits, **self.columns}
            for name, column in pools.items():
                value = columns.get(name)
                value = column.filled(n) if value is None else tf.cast(value, column.dtype)
                ops.append(column.variable.assign(value, read_value=False))
            ops += [self.count.assign(n, read_value=False), self.capacity.assign(n, read_value=False)]
            ops += [self.free_count.assign(0, read_value=False), self.free.assign(tf.zeros([0], tf.int64))]
            ops += [have.assign(n, read_value=False) for have in self._column_capacity.values()]
            return settled(ops)

        for name, value in columns.items():
            if name not in self.columns and name not in ("seen", "hits"):
                self._pending_columns[name] = value
        return self._locked(body)
