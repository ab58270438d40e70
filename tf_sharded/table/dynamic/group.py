"""Dynamic tables that share one row pool per device: a collection's dynamic tables under every strategy
that has dynamic tables (parameter servers, the default strategy, MirroredStrategy, and
MultiWorkerMirroredStrategy, whose workers keep their copies equal as `dynamic.agree` says).

Each member stays a whole `DynamicTable`: its own key -> row index per
shard, policies, table step, `size()`, `export()` and checkpoint entry (its
live keys, rows and optimizer columns, layout-free as ever). What it shares
is where its rows live: shard `i` of every member draws rows from pool `i`
(`RowPool`), so a training step allocates, writes new rows, marks rows seen,
gathers and applies the optimizer once per device for all of them
(`dynamic.packed`), the dynamic counterpart of `batched`'s storage tables.

`PooledTables` is what Keras and the optimizer see for the group: the pools'
rows are the layer's weights and the variables the optimizer trains (their
owner, `owner_of`), and its slots are built once per pool while each member
keeps its own view of them for checkpoints and weight files.

Tables with a `max_rows` bound keep their own pools: it counts a shard's
rows, which a shared pool does not keep apart (`table.batched.pool_key`). A
capacity eviction counts each member's live keys in its own index, and a
pool of bounded members grows no further than their shares together.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_sharded.table.dynamic.agree import agreeing_context, gather_keys
from tf_sharded.table.dynamic.keys import shard_of_keys
from tf_sharded.table.dynamic.packed import Request, expand, resolve_by_device
from tf_sharded.table.dynamic.slots import DynamicSlot
from tf_sharded.table.protocol import register_shards

# member table -> the group holding its rows (kept while the member lives: the optimizer finds it by the pools)
_GROUP = weakref.WeakKeyDictionary()


def group_of(table) -> Optional[PooledTables]:
    """The group whose pools hold `table`'s rows, or None for a table with pools of its own."""
    return _GROUP.get(table)


class PooledTables:
    """The row pools several dynamic tables share, one per device: what the optimizer trains for them.

    Args:
      name: the group's name.
      members: the dynamic tables, in order, created with `pools`.
      pools: one `RowPool` per shard.
    """

    def __init__(self, name: str, members: Sequence, pools: Sequence):
        self.name, self._members, self._pools = name, tuple(members), tuple(pools)
        self._member_slots: Dict[str, List[DynamicSlot]] = {}
        first = self._members[0]
        self.dim, self.dtype, self.strategy = first.dim, first.dtype, first.strategy
        self.trainable = first.trainable
        # The pools' gradient is exchanged as each member's would be: not at all with one copy per ps or
        # device, all-gathered among the replicas of the Mirrored strategies (host copies).
        self.exchange, self.placement = first.exchange, first.placement
        self.kind, self.placement_type = first.kind, first.placement_type
        for member in self._members:
            _GROUP[member] = self
        register_shards(self, self.variables)

    shape = property(lambda self: tf.TensorShape([None, self.dim]))
    members = property(lambda self: self._members)

    @property
    def variables(self) -> tuple:
        """Each pool's rows: the variables Keras and the optimizer train."""
        return tuple(p.rows for p in self._pools)

    @property
    def trainable_variables(self) -> tuple:
        return self.variables if self.trainable else ()

    def make_slot(self, name: str, fill: float) -> DynamicSlot:
        """An optimizer slot: a column of `fill` in every pool, which each member saves as its own slot."""
        column = name.rsplit("/", 1)[-1]
        if column not in self._member_slots:
            self._member_slots[column] = [m.make_slot(f"{m.name}/{column}", fill) for m in self._members]
        return DynamicSlot(self, column, [p.columns[column].variable for p in self._pools])

    def member_slots(self, slots: Dict[str, DynamicSlot]) -> List[Dict[str, DynamicSlot]]:
        """For each member, its own view of the group's `slots` ({slot name: slot}), which it checkpoints."""
        return [{slot: self._member_slots[slot][i] for slot in slots} for i in range(len(self._members))]

    def update_exclusively(self, shard: int, fn) -> Optional[tf.Tensor]:
        """Runs an optimizer's writes to pool `shard` (rows and columns) under its lock."""
        return self._pools[shard].update_exclusively(fn)

    def shard_rows(self, shard: int) -> tf.Tensor:
        return self._pools[shard].capacity.read_value()

    def __repr__(self):
        return f"<PooledTables '{self.name}' of {[m.name for m in self._members]}>"


def lookup_groups(pairs, training: bool) -> list:
    """Rows of the `(table, rank-1 keys)` pairs whose tables share row pools, a group at a time
    (`lookup_pooled`), None for the others: those of a lookup that does not train, and a table met again."""
    groups: Dict[int, list] = {}
    for i, (table, _) in enumerate(pairs):
        group = group_of(table)
        if group is None or not (training and table.trainable):
            continue
        members = groups.setdefault(id(group), [])
        if all(pairs[j][0] is not table for j in members):
            members.append(i)
    out = [None] * len(pairs)
    for members in groups.values():
        for i, rows in zip(members, lookup_pooled([pairs[i] for i in members])):
            out[i] = rows
    return out


def _sizes(pairs):
    """Each pair's number of keys: a list of ints where the shapes say, else an int32 tensor."""
    static = [k.shape[0] for _, k in pairs]
    return tf.stack([tf.size(k, out_type=tf.int32) for _, k in pairs]) if None in static else static


def _distinct(pairs, sizes):
    """`(keys, table, idx)` of every table's keys as one tensor: the distinct `(table, key)` pairs' keys and
    tables (int32), and each caller key's position among them (`_distinct_pairs`)."""
    m = len(pairs)
    keys = tf.concat([k for _, k in pairs], 0)
    if m == 1:
        distinct, idx = tf.unique(keys, out_idx=tf.int32)
        return distinct, tf.zeros(tf.shape(distinct), tf.int32), idx
    if isinstance(sizes, list):
        table_of = tf.constant(np.repeat(np.arange(m, dtype=np.int64), sizes))
    else:
        table_of = tf.repeat(tf.range(m, dtype=tf.int64), sizes)
    return _distinct_pairs(keys, table_of, m)


def _distinct_pairs(keys, table_of, m: int):
    """The distinct `(table_of, keys)` pairs (`table_of` int64, below `m`) in order of first appearance, as
    `(keys, table (int32), each pair's position among them)`.

    Two `tf.unique`s over all the keys, not one per table: first the keys
    alone, then (that key's position, table) as one int64, which is
    collision-free. A `unique`, a count and an offset per table would be
    most of the ops the worker runs in a step.
    """
    distinct, first = tf.unique(keys, out_idx=tf.int64)
    pair, idx = tf.unique(first * m + table_of, out_idx=tf.int32)
    return tf.gather(distinct, pair // m), tf.cast(pair % m, tf.int32), idx


def lookup_pooled(pairs) -> List[tf.Tensor]:
    """Rows of `(member table, rank-1 keys)` pairs, distinct members of one group, in a training lookup.

    All the tables' keys are de-duplicated and routed as one tensor
    (`_distinct`): one shard hash, one partition by (shard, table), one
    stitch of the values that come back, one gather into the callers'
    order, and its gradient one segment sum, instead of each of these per
    table: with the pools shared, those per-table ops are most of what the
    worker executes in a step.

    Under MultiWorkerMirroredStrategy every worker inserts every replica's
    pairs, in replica order, into its own copy (`dynamic.agree`), so that
    the copies agree, and reads the values of its own.
    """
    tables = [t for t, _ in pairs]
    m, n = len(tables), tables[0].num_shards
    sizes = _sizes(pairs)
    keys, table, idx = _distinct(pairs, sizes)
    total = tf.size(keys)
    counts = tf.math.unsorted_segment_sum(tf.ones_like(idx, tf.int64), idx, total)
    position = tf.range(total)  # of each pair inserted, among this replica's pairs (-1: another replica's only)
    ctx = agreeing_context(tables[0].strategy)
    if ctx is not None:
        tags = tf.cast(table, tf.int64)
        every_keys, every_counts, start, every_table = gather_keys(ctx, keys, counts, tags, share=True)
        keys, table, at = _distinct_pairs(every_keys, every_table, m)
        counts = tf.math.unsorted_segment_sum(every_counts, at, tf.size(keys))
        mine = tf.slice(at, [start], [total])
        position = tf.tensor_scatter_nd_update(tf.fill(tf.shape(keys), -1), mine[:, None], position)
    where = shard_of_keys(keys, n) * m + table
    parts = [tf.dynamic_partition(t, where, m * n) for t in (keys, counts, position)]
    wanted = [None if ctx is None else tf.where(p >= 0)[:, 0] for p in parts[2]]
    positions = parts[2] if ctx is None else [tf.gather(p, w) for p, w in zip(parts[2], wanted)]
    steps = [t.advance_step() for t in tables]
    requests = [Request(t, s, parts[0][s * m + j], parts[1][s * m + j], steps[j], wanted[s * m + j])
                for s in range(n) for j, t in enumerate(tables)]  # fmt: skip
    by_device = resolve_by_device(requests)
    stitched = [tf.concat([positions[i] for i in members], 0) for members, _, _ in by_device]
    unique_rows = tf.dynamic_stitch(stitched, [values for _, values, _ in by_device])
    rows = expand(unique_rows, idx, total)
    return [rows] if m == 1 else tf.split(rows, sizes, num=m)
