"""A row pool on one device: the rows of one or several dynamic tables' shards there, and the columns beside them.

A `RowPool` holds `rows` (the trainable `[capacity, dim]` pool, a variable of
unknown shape that grows by reassignment, by `growth`, so at most that
fraction is spare), the optimizer's `columns` (one pool per slot, grown with
it), `seen` (the table step of each row's last training lookup) and `hits`
(its occurrences), which delta export and the eviction policies read, and
`capacity`, `count` (rows handed out) and a free list of evicted rows, which
new keys take first.

A row handed to a new key starts with every column's fill. A function traced
before a column existed (the usual first training step, whose optimizer
builds its slots while it is traced) cannot write that column: it lists the
rows it handed out as `stale` instead, whenever the pool has more columns
than it knew, and the next body traced with every column (`caught_up`, which
every optimizer write runs first) fills those columns there. Without it, a
row freed by eviction would carry its old key's optimizer state to the next.

Each `DynamicShard` keeps its own key -> row index, policies and step and
draws its rows from a pool. A table's shards usually have a pool each; the
dynamic tables of an `EmbeddingCollection` under parameter servers share one
pool per device (`dynamic.group`), so a step allocates, writes new rows,
marks them seen, gathers and updates once per device for all of them, not
once per table: with a pool per table, that per-table work on the
parameter servers, not the index reads, is what a dynamic step costs
beside a static one (docs/benchmarks.md, B7).

Everything here runs on the pool's device, under its lock (`device_lock`)
where it writes: inserts, optimizer writes and growth (a growth copies the
pool, and a write landing between that read and the reassignment would be
dropped). The pool's shape is never read from the variable (`capacity`
says it): the shape of an unknown-shape variable read inside a function
scheduled on a parameter-server worker comes back empty.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.dynamic.index import MAX_ROWS, find_many, insert_many, reserved_table
from tf_sharded.table.dynamic.keys import key_fingerprints
from tf_sharded.table.dynamic.lock import defer, device_lock, locked_on, settled

MIN_GROWTH_ROWS = 64
# A pool grows by a tenth: at most that share of its rows is spare (B7's memory bound leaves 30% for the
# spare rows and the index together), for about ten row copies per key ever inserted (docs/benchmarks.md, B7).
GROWTH = 1.1
# What each member of a pool counts as it trains, one int64 each (`RowPool.events`): the ids its training lookups
# looked up, those whose key was already present, the keys given a row, the absent keys turned away (admission or
# a capacity bound), and the keys evicted. Only ever added to; readers take differences.
EVENTS = ("lookups", "hits", "admitted", "rejected", "evicted")


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: it holds a variable, compared by identity
class Column:
    """A pool beside the rows: `[capacity]` or `[capacity, width]` of `dtype`, new rows set to `fill`."""

    variable: Any
    fill: Any
    dtype: tf.DType
    width: Optional[int]

    def inner(self) -> list:
        return [] if self.width is None else [self.width]

    def filled(self, count) -> tf.Tensor:
        return tf.fill(tf.stack([tf.cast(count, tf.int32)] + self.inner()), tf.constant(self.fill, self.dtype))

    def read(self) -> tf.Tensor:
        return tf.reshape(self.variable.read_value(), [-1] + self.inner())


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: it holds tensors, compared by identity
class Insert:
    """One shard's part of an insert into its pool: its distinct `keys`, their fingerprints and counts, the
    table step (`given_step`: a scalar, or `(steps, j)`: element `j` of a vector of table steps, read when
    first used), and the table's initial rows, eviction policies and seed."""

    member: Any
    keys: tf.Tensor
    fingerprints: tf.Tensor
    counts: tf.Tensor
    given_step: Any
    initial_rows: Callable
    evictions: tuple = ()
    seed: int = 0
    initializer: Any = None  # the `RowInitializer` behind `initial_rows`, if there is one

    @functools.cached_property
    def step(self) -> tf.Tensor:
        if isinstance(self.given_step, tuple):
            steps, j = self.given_step
            return steps[j]
        return self.given_step

    @property
    def step_position(self) -> Optional[tuple]:
        """`(steps, j)` where the step came as element `j` of the vector `steps`, else None."""
        return self.given_step if isinstance(self.given_step, tuple) else None

    @staticmethod
    def steps(parts: Sequence[Insert]) -> tf.Tensor:
        """The parts' table steps as one vector: the vector they were given in, where they all index one
        in order, rather than a slice and a re-stack per part."""
        given = [p.step_position for p in parts]
        if given[0] is not None and all(g is not None and g[0] is given[0][0] for g in given):
            steps = given[0][0]
            positions = [j for _, j in given]
            in_order = steps.shape[0] == len(positions) and positions == list(range(len(positions)))
            return steps if in_order else tf.gather(steps, positions)
        return tf.stack([p.step for p in parts])

    @property
    def plain(self) -> bool:
        """Whether every absent key is given a row (no admission; a capacity bound makes room or limits them)
        from a `RowInitializer`."""
        return self.member.admission is None and self.initializer is not None


class RowPool:
    """Rows, optimizer columns and row metadata on one device, for one or several dynamic shards.

    Args:
      name: variables are `name/rows_i`, ... (the table's name, or a group's).
      shard: the shard index `i` in those names.
      device: where the pool lives (None: the current device).
      dim: row width.
      dtype: row dtype.
      trainable: whether the row pool is trainable.
      growth: capacity grows by this factor (> 1) when keys arrive.
      max_rows: None (unbounded) or the most rows the pool may hold (an error past it).
      bound: None or the capacity growth stops at (a capacity eviction's share of keys).
    """

    def __init__(self, name, shard, device, dim, dtype, trainable, growth=GROWTH, max_rows=None, bound=None):
        self.name, self.shard, self.dim, self.dtype = name, shard, dim, dtype
        self.growth, self.max_rows, self.bound = float(growth), max_rows, bound
        self.members: List = []  # the shards drawing rows from this pool
        self.columns: Dict[str, Column] = {}
        self._column_capacity: Dict[str, tf.Variable] = {}
        with tf.init_scope(), tf.device(device):
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
            self.stale = new(tf.zeros([0], tf.int64), "stale")
            self.stale_count = new(tf.constant(0, tf.int64), "stale_count")
            self.column_count = new(tf.constant(0, tf.int64), "column_count")
            self.events = new(tf.zeros([0, len(EVENTS)], tf.int64), "events")
        self.device = self.rows.device
        self.lock = device_lock(self.device)
        self._reserved = None

    def enlist(self, member) -> int:
        """Adds `member` (a shard drawing rows from this pool) and a row of `EVENTS` counters for it; returns
        its slot (its row there, and its index's slot)."""
        self.members.append(member)
        with tf.init_scope(), tf.device(self.device):
            self.events.assign(tf.concat([self.events.read_value(), tf.zeros([1, len(EVENTS)], tf.int64)], 0))
        return len(self.members) - 1

    def count_events(self, slots: Sequence[int], counts) -> tf.Tensor:
        """Adds `counts` (`[len(slots), len(EVENTS)]` int64) to the members' counters at `slots`: one op."""
        # scatter_add, not scatter_nd_add: the variable's shape is unknown, which an eager scatter_nd_add (a
        # lookup outside a function on a parameter server) takes for a scalar.
        return self.events.scatter_add(tf.IndexedSlices(counts, tf.constant(list(slots), tf.int64)))

    def reserved_keys(self):
        """The table of its int64 shards' reserved keys (`dynamic.index.reserved_table`), made with the first."""
        if self._reserved is None:
            with tf.init_scope(), tf.device(self.device):
                self._reserved = reserved_table(f"{self.name}_{self.shard}")
        return self._reserved

    def _pools(self):
        """Every pool that grows with the rows in `_grow_to` (optimizer columns catch up on their own)."""
        return [self._rows, self.seen, self.hits]

    def named_columns(self) -> Dict[str, Column]:
        """ "seen", "hits" and the optimizer's columns, by name."""
        return {"seen": self.seen, "hits": self.hits, **self.columns}

    # --------------------------------------------------------------- state --

    def add_column(self, name: str, fill: float) -> tf.Variable:
        """A pool beside the rows (an optimizer slot), `fill` for every row; then each member's restored
        values of it, if a restore left them waiting.

        A column has its own capacity: functions traced before it existed grow
        only the rows, and every optimizer write first extends the column to
        the rows' capacity (`exclusive_body`).
        """
        if name in self.columns:
            return self.columns[name].variable
        with tf.init_scope(), tf.device(self.device):
            capacity = self.capacity.read_value()
            empty = Column(None, fill, self.dtype, self.dim)
            column = dataclasses.replace(empty, variable=_compat.plain_variable(
                empty.filled(capacity), name=f"{self.name}/{name}_{self.shard}", trainable=False,
                shape=tf.TensorShape(None),
            ))  # fmt: skip
            rows = _compat.plain_variable(capacity, f"{self.name}/{name}_capacity_{self.shard}", False)
        self.columns[name] = column
        self._column_capacity[name] = rows
        with tf.init_scope():
            self.column_count.assign(len(self.columns), read_value=False)
        with tf.init_scope():
            for member in self.members:
                member.apply_pending(name)
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

    def caught_up(self) -> list:
        """Columns created after the last growth (by a function traced before them) grown to the rows' capacity,
        then the `stale` rows given their fill in every column, where this function knows them all."""
        capacity = self.capacity.read_value()
        extended = [self._extend_column(name, capacity) for name in self.columns]
        with tf.control_dependencies(extended):
            return extended + [self._fill_stale()]

    def _fill_stale(self) -> tf.Tensor:
        """Writes each column's fill at the `stale` rows and empties the list, if the pool has no column
        this function was traced without."""
        known = list(self.columns.values())

        def fill():
            rows = tf.reshape(self.stale.read_value(), [-1])[: self.stale_count.read_value()]
            writes = [c.variable.scatter_update(tf.IndexedSlices(c.filled(tf.size(rows)), rows)) for c in known]
            with tf.control_dependencies(writes):
                return settled([self.stale_count.assign(0, read_value=False)])

        due = tf.logical_and(tf.equal(self.column_count.read_value(), len(known)), self.stale_count.read_value() > 0)
        return tf.cond(due, fill, lambda: tf.constant(0, tf.int64))

    def _mark_stale(self, new_rows) -> tf.Tensor:
        """Lists `new_rows` as `stale` if the pool has columns this function was traced without."""

        def mark():
            count = self.stale_count.read_value()
            kept = tf.reshape(self.stale.read_value(), [-1])[:count]
            return settled([
                self.stale.assign(tf.concat([kept, new_rows], 0), read_value=False),
                self.stale_count.assign_add(tf.size(new_rows, out_type=tf.int64), read_value=False),
            ])  # fmt: skip

        return tf.cond(self.column_count.read_value() > len(self.columns), mark, lambda: tf.constant(0, tf.int64))

    def column_values(self, name: str, rows) -> tf.Tensor:
        """Column `name` at `rows`, a `stale` row's read as the column's fill (what it holds once filled)."""
        column = self.named_columns()[name]
        values = tf.gather(column.read(), rows)
        if name in ("seen", "hits"):  # made with the pool: no function was traced without them
            return values
        stale = tf.reshape(self.stale.read_value(), [-1])[: self.stale_count.read_value()]
        flagged = tf.scatter_nd(stale[:, None], tf.ones_like(stale, tf.bool), self.capacity_shape())
        fill = tf.fill(tf.shape(values), tf.constant(column.fill, column.dtype))
        return tf.where(tf.reshape(tf.gather(flagged, rows), [-1] + [1] * len(column.inner())), fill, values)

    def locked(self, body) -> tf.Tensor:
        """`body()` under the pool's lock, after every critical section the traced function ran before."""
        return locked_on(self.lock, self.device, body)

    def read(self, variable) -> tf.Tensor:
        return tf.reshape(variable.read_value(), [-1, self.dim])

    def gather(self, rows) -> tf.Tensor:
        """The pool's `rows` (differentiable: the pool's gradient is an `IndexedSlices` of these rows)."""
        with tf.device(self.device):
            values = tf.gather(self.rows, rows)
            values.set_shape([rows.shape[0], self.dim])
            return values

    def dense_shape(self) -> tf.Tensor:
        """`[capacity, dim]` (int64): the pool's shape, for its gradients."""
        return tf.stack([self.capacity.read_value(), tf.constant(self.dim, tf.int64)])

    def capacity_shape(self) -> tf.Tensor:
        """`[capacity]`, from the variable that holds it (never the shape of a pool: see the module doc)."""
        return tf.reshape(self.capacity.read_value(), [1])

    # ------------------------------------------------------------- inserts --

    def inserting(self, parts: Sequence[Insert]) -> Callable[[], List[tf.Tensor]]:
        """The body (to run under the lock) that gives the admitted absent keys of every part a row and returns
        each part's rows (-1 for keys a policy turned away), marking them seen at the part's step.

        One allocation, one write of new rows and one mark for all parts; the
        indexes and policies are each part's own.
        """
        first = parts[0].initializer
        if first is not None and all(p.plain and first.same_draws(p.initializer) for p in parts):
            return lambda: self._insert_plain(parts)

        def body():
            found, positions, new_keys = [], [], []
            for p in parts:
                rows, where = p.member.absent(p)
                found.append(rows)
                positions.append(where)
                new_keys.append(tf.gather_nd(p.keys, where))
            sizes = [tf.size(k, out_type=tf.int64) for k in new_keys]
            new_rows, ready = self.allocate_caught_up(tf.add_n(sizes))
            new_parts = tf.split(new_rows, tf.stack(sizes), num=len(parts)) if len(parts) > 1 else [new_rows]
            with tf.control_dependencies(ready):
                values = tf.concat([p.initial_rows(k) for p, k in zip(parts, new_keys)], 0)
                writes = self.write_new(new_rows, values)
                writes.append(insert_many([p.member.index for p in parts], tf.concat(new_keys, 0), new_rows,
                                          tf.stack(sizes)))  # fmt: skip
            with tf.control_dependencies(writes):
                rows = [tf.tensor_scatter_nd_update(f, w, r) for f, w, r in zip(found, positions, new_parts)]
                held, steps, counts = [], [], []
                for p, r in zip(parts, rows):
                    present = tf.where(r >= 0)
                    held.append(tf.gather_nd(r, present))
                    steps.append(tf.fill(tf.shape(held[-1]), p.step))
                    counts.append(tf.gather_nd(p.counts, present))
                done = self._mark_and_expire(parts, tf.concat(held, 0), tf.concat(steps, 0), tf.concat(counts, 0))
                events = [self._events_of(p.counts, f, r, tf.size(k, out_type=tf.int64))
                          for p, f, r, k in zip(parts, found, rows, new_keys)]  # fmt: skip
                done.append(self.count_events([p.member.slot for p in parts], tf.stack(events)))
            with tf.control_dependencies(done):
                return [tf.identity(r) for r in rows]

        return body

    def _insert_plain(self, parts: Sequence[Insert]) -> List[tf.Tensor]:
        """`inserting`'s body where every part is `plain` with initializers of the `same_draws`: the parts'
        keys handled as one tensor (one test for absent keys, one initial-row draw with each key's table
        seed, one index update per part), not part by part."""
        m = len(parts)
        sizes = tf.stack([tf.size(p.keys, out_type=tf.int32) for p in parts])
        keys = tf.concat([p.keys for p in parts], 0)
        indexes = [p.member.index for p in parts]
        found = find_many(indexes, keys, sizes)
        missing, room = self._make_room(parts, found, sizes)
        positions = tf.where(missing)
        new_keys = tf.gather_nd(keys, positions)
        part_of = tf.gather_nd(tf.repeat(tf.range(m), sizes), positions)
        with tf.control_dependencies(room):
            new_rows, ready = self.allocate_caught_up(tf.size(new_keys, out_type=tf.int64))
        with tf.control_dependencies(ready):
            # From a uint64 array: in a graph, TF on NumPy 2 converts a list of ints beyond int64 through float64.
            seeds = tf.constant(np.array([p.initializer.stream_key() for p in parts], np.uint64))
            counters = key_fingerprints(new_keys)
            values = parts[0].initializer.rows(counters, (1, self.dim), self.dtype, keys=tf.gather(seeds, part_of))
            writes = self.write_new(new_rows, values)
            added = tf.math.bincount(part_of, minlength=m, maxlength=m)
            writes.append(insert_many(indexes, new_keys, new_rows, added))
        with tf.control_dependencies(writes):
            rows = tf.tensor_scatter_nd_update(found, positions, new_rows)
            counts = tf.concat([p.counts for p in parts], 0)
            marked = [rows, tf.repeat(Insert.steps(parts), sizes), counts]
            if room:  # a capacity bound left some keys without a row (-1): only the held are marked
                held = tf.where(rows >= 0)[:, 0]
                marked = [tf.gather(t, held) for t in marked]
            done = self._mark_and_expire(parts, *marked)
            events = self._events_of(counts, found, rows, tf.cast(added, tf.int64), tf.repeat(tf.range(m), sizes), m)
            done.append(self.count_events([p.member.slot for p in parts], events))
        with tf.control_dependencies(done):
            return tf.split(rows, sizes, num=m)

    @staticmethod
    def _events_of(counts, found, rows, admitted, part_of=None, parts: int = 1) -> tf.Tensor:
        """`EVENTS` of an insert (per part where `part_of` gives each key's part): the occurrences `counts` of the
        keys looked up, those of keys `found` before it, the `admitted` keys, the absent keys met in the batch
        and left without a row (-1 in `rows`), and no evictions (counted where they run)."""
        hit = tf.where(found >= 0, counts, tf.zeros_like(counts))
        turned_away = tf.cast(tf.logical_and(rows < 0, counts > 0), tf.int64)
        met = tf.stack([counts, hit, turned_away], 1)
        if part_of is None:
            looked, found_, rejected = tf.unstack(tf.reduce_sum(met, 0))
            zero = tf.constant(0, tf.int64)
            return tf.stack([looked, found_, admitted, rejected, zero])
        summed = tf.math.unsorted_segment_sum(met, part_of, parts)
        zeros = tf.zeros([parts, 1], tf.int64)
        return tf.concat([summed[:, :2], admitted[:, None], summed[:, 2:], zeros], 1)

    @staticmethod
    def _make_room(parts: Sequence[Insert], found, sizes) -> Tuple[tf.Tensor, list]:
        """`(which keys get a row, what the allocation waits for)` for `_insert_plain`: the absent keys, where
        a part's capacity bound takes only the first that fit, after evicting what they need. The bounds are
        reckoned for all parts at once, under one `tf.cond`: a step that needs no room runs no eviction op and
        no control flow per part."""
        missing = found < 0
        bounded = [j for j, p in enumerate(parts) if p.member.capacity_eviction is not None]
        if not bounded:
            return missing, []
        m = len(parts)
        part_of = tf.repeat(tf.range(m), sizes)
        wanted = tf.math.unsorted_segment_sum(tf.cast(missing, tf.int64), part_of, m)
        present = tf.cast(sizes, tf.int64) - wanted
        evicted, fits = capacity_room(
            [parts[j].member for j in bounded], *(tf.gather(t, bounded) for t in (wanted, present))
        )
        no_bound = tf.fill([m], tf.constant(np.iinfo(np.int64).max, tf.int64))
        fits = tf.tensor_scatter_nd_update(no_bound, [[j] for j in bounded], fits)

        def evict():
            found_parts = tf.split(found, sizes, num=m) if m > 1 else [found]
            done = []
            for k, j in enumerate(bounded):
                run = functools.partial(parts[j].member.evict_lowest, evicted[k], found_parts[j])
                none = lambda: tf.constant(0, tf.int64)  # noqa: E731
                done.append(run() if len(bounded) == 1 else tf.cond(evicted[k] > 0, run, none))
            return settled(done)

        room = tf.cond(tf.reduce_any(evicted > 0), evict, lambda: tf.constant(0, tf.int64))
        # A missing key's rank among its part's missing keys: the first `fits` of a part's get a row.
        rank = tf.cumsum(tf.cast(missing, tf.int64), exclusive=True) - tf.gather(
            tf.cumsum(wanted, exclusive=True), part_of
        )
        return tf.logical_and(missing, rank < tf.gather(fits, part_of)), [room]

    def _mark_and_expire(self, parts: Sequence[Insert], held, steps, counts) -> list:
        """Marks rows `held` seen at `steps` and adds `counts` to their hits (one scatter each for all parts),
        then runs each part's age eviction; returns what the body's result waits for."""
        marks = [
            self.seen.variable.scatter_update(tf.IndexedSlices(steps, held)),
            self.hits.variable.scatter_add(tf.IndexedSlices(counts, held)),
        ]
        # A capacity eviction ran before the allocation (`_make_room`); an age eviction scans its shard at the
        # steps its `every` divides: one `tf.cond` for all parts, so the other steps run no control flow per part.
        aged = [(p, e) for p in parts for e in p.evictions if not hasattr(e, "per_shard")]
        if not aged:
            return marks
        due = [tf.equal(tf.math.floormod(p.step, e.every), 0) for p, e in aged]
        none = lambda: tf.constant(0, tf.int64)  # noqa: E731

        def expire():
            if len(aged) == 1:
                return aged[0][0].member.expire(aged[0][0].step, aged[0][1])
            runs = [functools.partial(p.member.expire, p.step, e) for p, e in aged]
            return settled([tf.cond(d, run, none) for d, run in zip(due, runs)])

        with tf.control_dependencies(marks):
            return [tf.cond(tf.reduce_any(tf.stack(due)), expire, none)]

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

    def allocate_caught_up(self, added) -> Tuple[tf.Tensor, list]:
        """`_allocate`, then every column grown to the new capacity: `(rows, what writes to them wait for)`."""
        rows, allocated = self._allocate(added)
        with tf.control_dependencies([allocated]):
            return rows, self.caught_up() + [allocated]

    def write_new(self, new_rows, values, given: Optional[Dict[str, tf.Tensor]] = None) -> list:
        """Writes `values` at `new_rows`, and each column's `given` values (else its fill) there."""
        given = given or {}
        writes = [self.rows.scatter_update(tf.IndexedSlices(tf.cast(values, self.dtype), new_rows))]
        n = tf.size(new_rows)
        for name, column in self.named_columns().items():
            value = column.filled(n) if given.get(name) is None else tf.cast(given[name], column.dtype)
            writes.append(column.variable.scatter_update(tf.IndexedSlices(value, new_rows)))
        writes.append(self._mark_stale(new_rows))
        return writes

    def _grow_to(self, need) -> tf.Tensor:
        """Grows every pool to at least `need` rows (by `growth`, at least MIN_GROWTH_ROWS); call under the lock."""
        capacity = self.capacity.read_value()

        def grow():
            fits = tf.debugging.assert_less_equal(
                need, tf.constant(MAX_ROWS, tf.int64),
                message=f"Dynamic table '{self.name}' shard {self.shard} needs more than {MAX_ROWS} rows (its index "
                "holds int32 rows); give it more partitions",
            )  # fmt: skip
            with tf.control_dependencies([fits]):
                target = tf.cast(tf.math.ceil(tf.cast(capacity, tf.float64) * self.growth), tf.int64)
            target = tf.minimum(tf.maximum(need, tf.maximum(target, capacity + MIN_GROWTH_ROWS)), MAX_ROWS)
            bound = self.max_rows if self.bound is None else self.bound
            if bound is not None:
                target = tf.minimum(target, tf.maximum(need, tf.constant(bound, tf.int64)))
            ops = [self._extend(pool, capacity, target) for pool in self._pools()]
            ops += [self._extend_column(name, target) for name in self.columns]
            with tf.control_dependencies(ops):
                return settled(ops + [self.capacity.assign(target, read_value=False)])

        return tf.cond(need > capacity, grow, lambda: tf.constant(0, tf.int64))

    def free_rows(self, victims) -> tf.Tensor:
        """Puts rows `victims` on the free list (their keys already left their index); call under the lock."""
        free_count = self.free_count.read_value()
        kept = tf.reshape(self.free.read_value(), [-1])[:free_count]
        ops = [self.free.assign(tf.concat([kept, victims], 0), read_value=False)]
        ops.append(self.free_count.assign_add(tf.size(victims, out_type=tf.int64), read_value=False))
        return settled(ops)

    def refill(self, values, columns: Dict[str, tf.Tensor], n) -> list:
        """Makes `values` (and `columns`) rows `0..n-1` of a pool with one member, nothing free; under the lock."""
        ops = [self.rows.assign(tf.cast(values, self.dtype), read_value=False)]
        for name, column in self.named_columns().items():
            value = columns.get(name)
            value = column.filled(n) if value is None else tf.cast(value, column.dtype)
            ops.append(column.variable.assign(value, read_value=False))
        ops += [self.count.assign(n, read_value=False), self.capacity.assign(n, read_value=False)]
        ops += [self.free_count.assign(0, read_value=False), self.free.assign(tf.zeros([0], tf.int64))]
        ops.append(self.stale_count.assign(0, read_value=False))
        ops += [have.assign(n, read_value=False) for have in self._column_capacity.values()]
        return ops

    # -------------------------------------------------------------- updates --

    def update_exclusively(self, fn: Callable[[], object]) -> Optional[tf.Tensor]:
        """Runs `fn` (writes to this pool's rows and columns) under the lock; returns once its writes are done.

        Inside `grouped_updates` the writes wait for the block's end and this returns None.
        """
        body = lambda: self.exclusive_body(fn)  # noqa: E731
        return None if defer(self, body) else self.locked(body)

    def exclusive_body(self, fn: Callable[[], object]) -> tf.Tensor:
        """`fn()` after the optimizer's columns caught up with the rows' capacity; call under the lock."""
        if tf.executing_eagerly():
            self.caught_up()
            fn()
            return tf.constant(0, tf.int64)
        extended = self.caught_up()
        graph = tf.compat.v1.get_default_graph()
        with tf.control_dependencies(extended):
            before = set(graph.get_operations())
            fn()
        created = [op for op in graph.get_operations() if op not in before and op.type != "Const"]
        return settled(created)

    def reset_lost(self) -> int:
        """After the pool's task restarted (its variables renewed, uninitialised): an empty pool's state.
        Returns how many variables it set; a pool whose task kept its state is left as it is."""
        with tf.device(self.device):
            empty = [(self.rows, self._rows.filled(0)), (self.free, tf.zeros([0], tf.int64))]
            empty += [(self.stale, tf.zeros([0], tf.int64))]
            empty += [(c.variable, c.filled(0)) for c in self.named_columns().values()]
            scalars = [self.capacity, self.count, self.free_count, self.stale_count, *self._column_capacity.values()]
            empty += [(v, tf.constant(0, tf.int64)) for v in scalars]
            empty += [(self.column_count, tf.constant(len(self.columns), tf.int64))]
            empty += [(self.events, tf.zeros([len(self.members), len(EVENTS)], tf.int64))]
            lost = [(v, value) for v, value in empty if not bool(v.is_initialized())]
            for variable, value in lost:
                variable.assign(value, read_value=False)
        return len(lost)


def capacity_room(shards, wanted, present) -> Tuple[tf.Tensor, tf.Tensor]:
    """`(evicted, fits)`, int64 vectors over `shards` (members with a capacity eviction): how many live keys each
    evicts for its `wanted` new keys (with the headroom, never one of its `present` batch keys), and how many of
    them then fit."""
    live = tf.stack([s.index.size() for s in shards])
    limit = tf.constant([s.max_keys for s in shards], tf.int64)
    extra = tf.constant([int(s.capacity_eviction.headroom * s.max_keys) for s in shards], tf.int64)
    over = live + wanted - limit
    evicted = tf.where(over > 0, tf.minimum(tf.maximum(over + extra, 0), live - present), 0)
    return evicted, tf.maximum(tf.minimum(wanted, limit - (live - evicted)), 0)
