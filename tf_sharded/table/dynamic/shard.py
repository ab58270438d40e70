"""One shard of a dynamic table: a key -> row index, its policies' state, and the row pool its rows live in.

Everything here is core TensorFlow, on the shard's device:

* `index`: a `KeyIndex` (`dynamic.index`) from key (int64 or string, any
  value) to the key's row in the pool (-1 when absent);
* `pool`: a `RowPool` (`dynamic.pool`): the trainable rows, the optimizer's
  columns, each row's "last seen" step and hit count, capacity and free
  list. A shard usually has a pool of its own; the dynamic tables of an
  `EmbeddingCollection` under parameter servers share one per device.
* `lock`: the pool's device's `tf.CriticalSection` (`device_lock`).
  Inserting keys (look up, allocate, grow, write initial rows, index) and
  every optimizer write run under it, so two workers' steps inserting at
  once on a parameter server neither lose nor duplicate a key, and no row
  update is lost to a concurrent growth. Lookups gather outside the lock: a
  key's row exists in the pool before the key is in the index. (With
  eviction, a row freed and given to another key between a step's lookup and
  its update receives that update: the policies evict the least recently
  seen keys and never the current batch's, so this needs a key in flight on
  another worker to be the eviction victim.)

A training lookup inserts through the pool: one `RowPool.inserting` body per
pool, with one `Insert` per shard (`dynamic.packed`); the shard answers for
its index and policies (`absent`, `expire`).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.dynamic.index import KeyIndex
from tf_sharded.table.dynamic.lock import settled
from tf_sharded.table.dynamic.pool import EVENTS, GROWTH, Insert, RowPool, capacity_room


class DynamicShard:
    """Keys of one shard, the row pool holding their rows, and its policies' state, on one device.

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
      capacity_eviction: a `tfs.policies.CapacityEviction` or None (its share is `max_keys`).
      max_keys: this shard's share of the capacity policy's `max_keys`.
      pool: a `RowPool` on `device` shared with other shards, or None (a pool of its own).
    """

    def __init__(self, name, shard, device, key_dtype, dim, dtype, trainable, growth=GROWTH, max_rows=None,
                 admission=None, capacity_eviction=None, max_keys=None, pool: Optional[RowPool] = None):  # fmt: skip
        self.name, self.shard, self.dim, self.dtype = name, shard, dim, dtype
        self.key_dtype = key_dtype
        self.admission, self.capacity_eviction, self.max_keys = admission, capacity_eviction, max_keys
        self._pending_columns: Dict[str, Tuple[tf.Tensor, tf.Tensor]] = {}
        if pool is None:
            pool = RowPool(name, shard, device, dim, dtype, trainable, growth, max_rows, max_keys)
        self.pool = pool
        self.slot = pool.enlist(self)
        with tf.init_scope(), tf.device(pool.device):
            reserved = None if key_dtype == tf.string else pool.reserved_keys()
            self.index = KeyIndex(key_dtype, f"{name}_index_{shard}", reserved, slot=self.slot)
        self.admission_state = admission.make_state(self) if admission is not None else None

    rows = property(lambda self: self.pool.rows)
    seen = property(lambda self: self.pool.seen)
    hits = property(lambda self: self.pool.hits)
    columns = property(lambda self: self.pool.columns)
    capacity = property(lambda self: self.pool.capacity)
    count = property(lambda self: self.pool.count)
    free_count = property(lambda self: self.pool.free_count)
    device = property(lambda self: self.pool.device)
    lock = property(lambda self: self.pool.lock)

    def add_column(self, name: str, fill: float) -> tf.Variable:
        """The pool's column `name` (an optimizer slot), `fill` for new rows; a restore's values wait until it
        exists (`apply_pending`)."""
        return self.pool.add_column(name, fill)

    def apply_pending(self, name: str) -> None:
        """Writes the values a restore left for column `name` (created since) at the rows of their keys."""
        pending = self._pending_columns.pop(name, None)
        if pending is not None:
            self.set_column(name, *[tf.convert_to_tensor(t) for t in pending])

    def _kept(self, name: str, keys, values) -> tuple:
        """`(keys, values)` of a column not built yet, readable when it is: as they are eagerly; in variables
        of this shard's device when restored inside a function (whose tensors do not outlive it)."""
        if tf.executing_eagerly():
            return keys, values
        kept = []
        for what, tensor, shape in (("keys", keys, [0]), ("values", values, [0, self.dim])):
            with tf.init_scope(), tf.device(self.device):
                empty = tf.zeros(shape, tensor.dtype)
                variable = _compat.plain_variable(empty, f"{self.name}/restored_{name}_{what}_{self.shard}", False,
                                                  shape=tf.TensorShape(None))  # fmt: skip
            variable.assign(tensor, read_value=False)
            kept.append(variable)
        return tuple(kept)

    def read(self, variable) -> tf.Tensor:
        return self.pool.read(variable)

    # ------------------------------------------------------------- lookups --

    def find(self, keys) -> tf.Tensor:
        """Rows of `keys` (int64, -1 where absent); reads only the index."""
        with tf.device(self.device):
            return self.index_rows(keys)

    def index_rows(self, keys) -> tf.Tensor:
        """The index's rows of `keys` (-1 where absent)."""
        return self.index.find(keys)

    def gather(self, rows) -> tf.Tensor:
        """The pool's `rows` (differentiable: the pool's gradient is an `IndexedSlices` of these rows)."""
        return self.pool.gather(rows)

    def absent(self, part: Insert) -> Tuple[tf.Tensor, tf.Tensor]:
        """`(rows of part.keys, positions of the keys to give a row)`: the absent keys the admission policy
        admits and a capacity bound fits (evicting to make room); call under the lock."""
        found = self.index_rows(part.keys)
        missing = found < 0
        if self.admission is not None:
            missing = self.admission.admit(
                self.admission_state, part.fingerprints, part.counts, part.step, missing, part.seed
            )
            # Only a batch that meets a key admits it (a worker's other replicas insert its keys with no count).
            missing = tf.logical_and(missing, part.counts > 0)
        positions = tf.where(missing)
        if self.capacity_eviction is not None:
            positions = self._make_room(positions, found)
        return found, positions

    # ------------------------------------------------------------ eviction --

    def evict(self, victims) -> tf.Tensor:
        """Removes the keys at rows `victims` and puts the rows on the free list; call under the lock."""
        keys, rows = self._live()
        chosen = tf.scatter_nd(victims[:, None], tf.ones_like(victims, tf.bool), self.pool.capacity_shape())
        gone = tf.gather(keys, tf.where(tf.gather(chosen, rows))[:, 0])
        evicted = tf.tensor_scatter_nd_update(
            tf.zeros([1, len(EVENTS)], tf.int64), [[0, EVENTS.index("evicted")]], tf.size(gone, out_type=tf.int64)[None]
        )
        counted = self.pool.count_events([self.slot], evicted)
        return settled([self.index.remove(gone), self.pool.free_rows(victims), counted])

    def dense_shape(self) -> tf.Tensor:
        """`[capacity, dim]` (int64): the pool's shape, for its gradients."""
        return self.pool.dense_shape()

    def _live(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """`(keys, rows)` of the live keys, as rank-1 tensors."""
        return self.index.export()

    def _live_rows(self) -> tf.Tensor:
        return self._live()[1]

    def expire(self, step, policy) -> tf.Tensor:
        """Evicts the keys last seen at a step `<= step - max_steps` (the caller asks `policy.every`)."""
        rows = self._live_rows()
        old = tf.gather(self.seen.read(), rows) <= step - policy.max_steps
        return self.evict(tf.boolean_mask(rows, old))

    def _make_room(self, positions, rows) -> tf.Tensor:
        """Evicts what the new keys at `positions` need (and the headroom); returns the positions that fit."""
        wanted, present = tf.size(positions, out_type=tf.int64), tf.math.count_nonzero(rows >= 0)
        evicted, fits = (t[0] for t in capacity_room([self], wanted[None], present[None]))
        done = tf.cond(evicted > 0, lambda: self.evict_lowest(evicted, rows), lambda: tf.constant(0, tf.int64))
        with tf.control_dependencies([done]):
            return positions[: tf.cast(fits, tf.int32)]

    def evict_lowest(self, count, rows) -> tf.Tensor:
        """Evicts the `count` live keys the capacity policy scores lowest, never those at the batch's `rows`."""
        batch_rows = tf.boolean_mask(rows, rows >= 0)
        candidates = self._live_rows()
        protected = tf.scatter_nd(batch_rows[:, None], tf.ones_like(batch_rows, tf.bool), self.pool.capacity_shape())
        candidates = tf.boolean_mask(candidates, tf.logical_not(tf.gather(protected, candidates)))
        scores = self.capacity_eviction.scores(
            tf.gather(self.seen.read(), candidates), tf.gather(self.hits.read(), candidates)
        )
        _, lowest = tf.math.top_k(-scores, k=tf.cast(count, tf.int32))
        return self.evict(tf.gather(candidates, lowest))

    def update_exclusively(self, fn: Callable[[], object]) -> Optional[tf.Tensor]:
        """Runs `fn` (writes to this shard's pool) under the lock (`RowPool.update_exclusively`)."""
        return self.pool.update_exclusively(fn)

    def reset_lost(self) -> int:
        """After this shard's task restarted (its variables renewed, uninitialised, its index empty): the
        state of an empty shard, which a checkpoint restore then fills. Returns how many variables it set;
        a shard whose task kept its state is left as it is."""
        done = self.pool.reset_lost()
        state = self.admission_state
        if state is not None and not bool(state.is_initialized()):
            with tf.device(self.device):
                state.assign(tf.zeros(state.shape, state.dtype), read_value=False)
            done += 1
        return done

    # -------------------------------------------------- export and restore --

    def export(self, columns=(), since_step=None):
        """`(keys, rows' values, {column: values})` of live keys (seen after `since_step` if given)."""
        with tf.device(self.device):
            keys, rows = self._live()
            if since_step is not None:
                recent = tf.where(tf.gather(self.seen.read(), rows) > since_step)[:, 0]
                keys, rows = tf.gather(keys, recent), tf.gather(rows, recent)
            values = tf.gather(self.read(self.rows), rows)
            pools = self.pool.named_columns()
            extra = {name: self.pool.column_values(name, rows) for name in columns if name in pools}
            return keys, values, extra

    def set_column(self, name: str, keys, values) -> tf.Tensor:
        """Writes `values` into column `name` at the rows of `keys` this shard holds (others are skipped)."""

        def body():
            rows = self.index_rows(keys)
            held = tf.where(rows >= 0)
            update = tf.IndexedSlices(tf.gather_nd(values, held), tf.gather_nd(rows, held))
            return settled([self.columns[name].variable.scatter_update(update)])

        return self.pool.locked(body)

    def size(self) -> tf.Tensor:
        with tf.device(self.device):
            return self.index.size()

    def events(self) -> tf.Tensor:
        """This shard's `EVENTS` counters so far (int64 vector), read on its device."""
        with tf.device(self.device):
            return tf.reshape(self.pool.events.read_value(), [-1, len(EVENTS)])[self.slot]

    def buckets(self) -> Optional[tf.Tensor]:
        """The index's bucket count (`KeyIndex.buckets`), None for string keys."""
        with tf.device(self.device):
            return self.index.buckets()

    def replace(self, keys, values, columns: Dict[str, tf.Tensor]) -> tf.Tensor:
        """Makes `keys` (distinct) this shard's whole content; columns not built yet wait for `apply_pending`.

        `columns` may hold "seen" and "hits" (int64 per key) besides optimizer
        columns. A pool of its own is refilled as rows `0..n-1` (its capacity
        then fits the keys); in a shared pool the shard's old rows are freed
        and new ones allocated.
        """
        pool = self.pool
        for name, value in columns.items():
            if name not in pool.columns and name not in ("seen", "hits"):
                self._pending_columns[name] = self._kept(name, keys, value)

        def body():
            old_keys, old_rows = self._live()
            n = tf.size(keys, out_type=tf.int64)
            removed = self.index.remove(old_keys)
            if len(pool.members) == 1:
                with tf.control_dependencies([removed]):
                    inserted = self.index.insert(keys, tf.range(n))
                return settled([removed, inserted] + pool.refill(values, columns, n))
            with tf.control_dependencies([removed]):
                freed = pool.free_rows(old_rows)
            with tf.control_dependencies([freed]):
                rows, ready = pool.allocate_caught_up(n)
            with tf.control_dependencies(ready):
                writes = pool.write_new(rows, values, columns)
                writes.append(self.index.insert(keys, rows))
            return settled(writes)

        return pool.locked(body)
