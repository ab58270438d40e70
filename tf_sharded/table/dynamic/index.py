"""A dynamic shard's key -> row index, in core TensorFlow lookup tables.

* int64 keys: a `tf.lookup.experimental.DenseHashTable` (open addressing in
  two tensors, int32 rows: 12 bytes per bucket, at most 0.8 of the buckets
  used, doubling), where a `MutableHashTable` of int64 rows takes about 43
  bytes per key (RFC.md, "Dynamic tables"). The dense table reserves two keys as its empty
  and deleted markers (the two smallest int64 values); those keys live in a
  small `MutableHashTable` of their own, one per row pool, keyed by a code
  (2 x the shard's slot in the pool, + 1 for the deleted marker), so every
  int64 is a key.
* string keys: a `MutableHashTable` (any string is a key; none is reserved).

The dense table marks an erased key's bucket deleted and grows by its count
of live keys only, so under eviction the deleted markers take the place of
the empty buckets until a lookup of an absent key, which stops only at an
empty bucket, probes every bucket and fails. `KeyIndex.remove` therefore
compacts the table once the deleted markers hold an eighth of its buckets:
the live keys are inserted into a second, empty dense table (`spare`) of
twice their count, rounded up to a power of two, whose buckets then replace
the index's in one import. A concurrent lookup sees the old buckets or the
new ones, never an empty table; each compaction is paid for by the removals
that made it necessary, and the buckets stay below four times the most keys
held at once (one insert's keys included).

Rows are int64 outside (-1: absent) and below 2**31 per shard (`MAX_ROWS`).

`find_many` and `insert_many` serve all shards (parts) of one insert body:
the reserved keys are picked out of all parts' keys at once, with no control
flow (a `tf.cond` here cost the B7 step about 2 ms with a process per task).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.dynamic.lock import settled

EMPTY, DELETED = -(2**63), -(2**63) + 1  # the dense table's markers; keys <= DELETED go to `reserved`
MAX_ROWS = 2**31 - 1
MIN_BUCKETS = 64  # TF's default (2**17 buckets, 1.5 MB) would dominate small tables
DELETED_SHARE = 8  # an index is compacted once its deleted markers hold 1/DELETED_SHARE of its buckets


class KeyIndex:
    """Key -> row (int64, -1 where absent) of one shard, created on the current device.

    Args:
      key_dtype: tf.int64 or tf.string.
      name: the tables' name.
      reserved: for int64 keys, the `reserved_table()` of the row pool this shard draws from (shared by the
        pool's shards), or None: one of its own.
      slot: this shard's slot among the shards sharing `reserved`.

    >>> import tensorflow as tf
    >>> index = KeyIndex(tf.int64, "example")
    >>> _ = index.insert(tf.constant([7, -2**63], tf.int64), tf.constant([0, 1], tf.int64))
    >>> index.find(tf.constant([-2**63, 7, 8], tf.int64)).numpy().tolist(), int(index.size())
    ([1, 0, -1], 2)
    """

    def __init__(self, key_dtype: tf.DType, name: str, reserved=None, slot: int = 0):
        self.key_dtype, self.slot = key_dtype, slot
        if key_dtype == tf.string:
            self.main = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, -1, name=f"{name}_index")
            self.reserved, self.row_dtype = None, tf.int64
        else:
            self.main, self.spare = [tf.lookup.experimental.DenseHashTable(
                tf.int64, tf.int32, -1, empty_key=EMPTY, deleted_key=DELETED,
                initial_num_buckets=MIN_BUCKETS, name=f"{name}_index{suffix}",
            ) for suffix in ("", "_spare")]  # fmt: skip
            _compat.local_table_default(self.spare)
            self.reserved = reserved_table(f"{name}_index") if reserved is None else reserved
            self.row_dtype = tf.int32
        _compat.local_table_default(self.main)  # what a step reads stays valid across a ps restart

    def find(self, keys) -> tf.Tensor:
        """Rows of `keys` (rank 1; int64, -1 where absent)."""
        return find_many([self], keys, tf.size(keys, out_type=tf.int64)[None])

    def insert(self, keys, rows) -> tf.Tensor:
        """Sets the rows of `keys` (rank 1, distinct)."""
        keys = tf.reshape(keys, [-1])  # a restore's tensors have no static rank
        return insert_many([self], keys, tf.reshape(rows, [-1]), tf.size(keys, out_type=tf.int64)[None])

    def remove(self, keys) -> tf.Tensor:
        """Removes `keys` (those absent are ignored), then compacts the dense table if it needs it (see the
        module doc); call under the shard's lock, which every writer of the index holds."""
        if self.reserved is None:
            return settled([tf.raw_ops.LookupTableRemoveV2(table_handle=self.main.resource_handle, keys=keys)])
        keys = tf.reshape(keys, [-1])
        ordinary, low = _ordinary_and_low(keys)
        removed = [
            tf.raw_ops.LookupTableRemoveV2(table_handle=self.main.resource_handle, keys=tf.gather(keys, ordinary)),
            tf.raw_ops.LookupTableRemoveV2(table_handle=self.reserved.resource_handle,
                                           keys=_codes([self], keys, low, None)),
        ]  # fmt: skip
        with tf.control_dependencies(removed):
            return settled([self.compact_if_needed()])

    def buckets(self) -> tf.Tensor | None:
        """The dense table's bucket count (int64; what its memory is proportional to), None for string keys."""
        if self.reserved is None:
            return None
        return tf.shape(self._buckets()[0], out_type=tf.int64)[0]

    def compact_if_needed(self) -> tf.Tensor:
        """Rebuilds the dense table from its live keys if deleted markers hold 1/DELETED_SHARE of its buckets."""
        keys, rows = self._buckets()
        count = tf.shape(keys, out_type=tf.int64)[0]
        live = self.main.size()
        deleted = count - live - tf.reduce_sum(tf.cast(tf.equal(keys, EMPTY), tf.int64))
        return tf.cond(deleted * DELETED_SHARE >= count, lambda: self._rebuild(keys, rows, live),
                       lambda: tf.constant(0, tf.int64))  # fmt: skip

    def _rebuild(self, keys, rows, live) -> tf.Tensor:
        """The dense table with only its live keys, in `_fitting(live)` buckets, swapped in by one import."""
        held = tf.where(keys[:, 0] > DELETED)[:, 0]
        spare = self.spare.resource_handle
        # Buckets of a shape computed at run time: a fresh buffer, which the spare table then writes in place.
        filled = _import(spare, _fitting(live))
        with tf.control_dependencies([filled]):
            inserted = tf.raw_ops.LookupTableInsertV2(
                table_handle=spare, keys=tf.gather(keys[:, 0], held), values=tf.gather(rows[:, 0], held)
            )
        with tf.control_dependencies([inserted]):
            new_keys, new_rows = tf.raw_ops.LookupTableExportV2(table_handle=spare, Tkeys=tf.int64, Tvalues=tf.int32)
            swapped = _import_buckets(self.main.resource_handle, new_keys, new_rows)
        # The spare lets go of the buckets the index now holds. Its small buckets may be a constant's: it never
        # writes them, since a rebuild first imports fresh ones.
        with tf.control_dependencies([swapped]):
            return settled([_import(spare, tf.constant(MIN_BUCKETS, tf.int64))])

    def _buckets(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """The dense table's `[buckets, 1]` keys (EMPTY and DELETED included) and rows, as it holds them."""
        return tf.raw_ops.LookupTableExportV2(table_handle=self.main.resource_handle, Tkeys=tf.int64,
                                              Tvalues=tf.int32)  # fmt: skip

    def export(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """`(keys, rows)` of every key held, rank 1."""
        keys, rows = tf.raw_ops.LookupTableExportV2(
            table_handle=self.main.resource_handle, Tkeys=self.key_dtype, Tvalues=self.row_dtype
        )
        keys, rows = tf.reshape(keys, [-1]), tf.cast(tf.reshape(rows, [-1]), tf.int64)
        if self.reserved is None:
            return keys, rows
        held = tf.where(keys > DELETED)[:, 0]  # the dense table exports its empty and deleted buckets too
        codes, low_rows = self._own_reserved()
        low_keys = tf.where(codes % 2 == 1, tf.constant(DELETED, tf.int64), tf.constant(EMPTY, tf.int64))
        return tf.concat([tf.gather(keys, held), low_keys], 0), tf.concat([tf.gather(rows, held), low_rows], 0)

    def size(self) -> tf.Tensor:
        if self.reserved is None:
            return self.main.size()
        return self.main.size() + tf.size(self._own_reserved()[0], out_type=tf.int64)

    def find_ordinary(self, keys) -> tf.Tensor:
        """Rows of `keys`, none of them reserved, in `row_dtype` (-1 where absent)."""
        return _find(self.main, keys, self.row_dtype)

    def insert_ordinary(self, keys, rows) -> tf.Tensor:
        """Sets the rows of `keys` (distinct, none of them reserved)."""
        rows = tf.cast(rows, self.row_dtype)
        return tf.raw_ops.LookupTableInsertV2(table_handle=self.main.resource_handle, keys=keys, values=rows)

    def _own_reserved(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """`(codes, rows)` of this shard's reserved keys."""
        codes, rows = self.reserved.export()
        codes, rows = tf.reshape(codes, [-1]), tf.reshape(rows, [-1])
        mine = tf.where(codes // 2 == self.slot)[:, 0]
        return tf.gather(codes, mine), tf.gather(rows, mine)


def reserved_table(name: str):
    """The table (code -> row) holding the reserved keys of the shards of one row pool (see the module doc)."""
    table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1, name=f"{name}_reserved")
    _compat.local_table_default(table)
    return table


def find_many(indexes: Sequence[KeyIndex], keys, sizes) -> tf.Tensor:
    """The rows (int64, -1 where absent) of `keys`, whose first `sizes[0]` are for `indexes[0]`, the next
    `sizes[1]` for `indexes[1]`, ...: one find per index, and one for the reserved keys of all of them."""
    if indexes[0].reserved is None:
        return tf.concat([x.find_ordinary(k) for x, k in zip(indexes, _split(keys, sizes, indexes))], 0)
    safe = tf.maximum(keys, DELETED + 1)  # a reserved key's result is replaced below
    rows = tf.concat([x.find_ordinary(k) for x, k in zip(indexes, _split(safe, sizes, indexes))], 0)
    rows = tf.cast(rows, tf.int64)
    low = tf.where(keys <= DELETED)
    codes = _codes(indexes, keys, low[:, 0], _part_of(low[:, 0], sizes, indexes))
    low_rows = _find(indexes[0].reserved, codes, tf.int64)
    rows = tf.tensor_scatter_nd_update(rows, low, low_rows)
    rows.set_shape(keys.shape)
    return rows


def insert_many(indexes: Sequence[KeyIndex], keys, rows, sizes) -> tf.Tensor:
    """Sets the rows of `keys` (distinct per index; split among `indexes` by `sizes` as in `find_many`)."""
    m = len(indexes)
    if indexes[0].reserved is None:
        parts = zip(indexes, _split(keys, sizes, indexes), _split(rows, sizes, indexes))
        return settled([x.insert_ordinary(k, r) for x, k, r in parts])
    ordinary, low = _ordinary_and_low(keys)
    low_parts = _part_of(low, sizes, indexes)
    low_codes = _codes(indexes, keys, low, low_parts)
    if low_parts is not None:
        sizes = tf.cast(sizes, tf.int32) - tf.math.bincount(low_parts, minlength=m, maxlength=m)
    kept_keys, kept_rows = tf.gather(keys, ordinary), tf.cast(tf.gather(rows, ordinary), indexes[0].row_dtype)
    parts = zip(indexes, _split(kept_keys, sizes, indexes), _split(kept_rows, sizes, indexes))
    writes = [x.insert_ordinary(k, r) for x, k, r in parts]
    low_rows = tf.cast(tf.gather(rows, low), tf.int64)
    writes.append(tf.raw_ops.LookupTableInsertV2(table_handle=indexes[0].reserved.resource_handle, keys=low_codes,
                                                 values=low_rows))  # fmt: skip
    return settled(writes)


def _ordinary_and_low(keys) -> Tuple[tf.Tensor, tf.Tensor]:
    """Positions of `keys`'s ordinary keys and of its reserved ones."""
    return tf.where(keys > DELETED)[:, 0], tf.where(keys <= DELETED)[:, 0]


def _fitting(live) -> tf.Tensor:
    """Buckets for `live` keys after a compaction: the power of two at or above 2 x `live` (and MIN_BUCKETS)."""
    need = tf.maximum(2 * live, MIN_BUCKETS)
    log2 = tf.math.log(tf.cast(need, tf.float64)) / tf.math.log(tf.constant(2.0, tf.float64))
    power = tf.cast(tf.math.ceil(log2), tf.int64)
    count = tf.bitwise.left_shift(tf.constant(1, tf.int64), power)
    return tf.where(count // 2 >= need, count // 2, count)  # the logarithm's rounding may overshoot by one


def _import(table, count) -> tf.Tensor:
    """Makes the dense `table` empty with `count` buckets."""
    shape = tf.stack([count, tf.constant(1, tf.int64)])
    keys, rows = tf.fill(shape, tf.constant(EMPTY, tf.int64)), tf.fill(shape, tf.constant(0, tf.int32))
    return _import_buckets(table, keys, rows)


def _import_buckets(table, keys, rows) -> tf.Tensor:
    """Gives the dense `table` the `[buckets, 1]` `keys` and `rows` as its buckets. The import op's static
    shape check wants rank-1 keys, where a dense table's kernel needs this layout (a checkpoint restore
    passes it tensors of unknown shape): the buckets go in with their static shape hidden."""
    hidden = [tf.raw_ops.PlaceholderWithDefault(input=t, shape=tf.TensorShape(None)) for t in (keys, rows)]
    return tf.raw_ops.LookupTableImportV2(table_handle=table, keys=hidden[0], values=hidden[1])


def _split(tensor, sizes, indexes) -> list:
    """`tensor` split into one part per index (by `sizes`)."""
    return tf.split(tensor, sizes, num=len(indexes)) if len(indexes) > 1 else [tensor]


def _part_of(positions, sizes, indexes):
    """Which part (of `sizes`, one per index) each of `positions` falls in; None for one index."""
    if len(indexes) == 1:
        return None
    ends = tf.cumsum(tf.cast(sizes, tf.int64))
    return tf.searchsorted(ends, tf.cast(positions, tf.int64), side="right")


def _codes(indexes: Sequence[KeyIndex], keys, low, parts) -> tf.Tensor:
    """The reserved table's codes of the reserved keys at positions `low` of `keys`, in `parts` (`_part_of`)."""
    deleted = tf.cast(tf.equal(tf.gather(keys, low), DELETED), tf.int64)
    if parts is None:
        return 2 * indexes[0].slot + deleted
    slots = tf.constant([2 * x.slot for x in indexes], tf.int64)
    return tf.gather(slots, parts) + deleted


def _find(table, keys, rows_dtype) -> tf.Tensor:
    """The table's rows of `keys`, its default (-1) made here: the table's own default is a tensor of the
    process that created it, which every lookup would fetch from there."""
    rows = tf.raw_ops.LookupTableFindV2(
        table_handle=table.resource_handle, keys=keys, default_value=tf.constant(-1, rows_dtype)
    )
    rows.set_shape(keys.shape)
    return rows
