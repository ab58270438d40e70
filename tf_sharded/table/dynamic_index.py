"""A dynamic shard's key -> row index, in core TensorFlow lookup tables.

* int64 keys: a `tf.lookup.experimental.DenseHashTable` (open addressing in
  two tensors, int32 rows: 12 bytes per bucket, at most 0.8 of the buckets
  used, doubling) beside a small `MutableHashTable` for the two keys the
  dense table reserves as its empty and deleted markers (the two smallest
  int64 values), so every int64 is a key. It holds a key in 15 to 30 bytes
  where a `MutableHashTable` of int64 rows takes about 43 (RFC §11 B7).
* string keys: a `MutableHashTable` (any string is a key; it has no reserved
  values).

Rows are int64 outside (-1: absent) and below 2**31 per shard (`MAX_ROWS`).

The lookups of one pool's parts (`find_many`, `insert_many`) test once
whether any key is reserved, so a step whose keys are all ordinary runs one
find and one insert per part and no routing.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.dynamic_lock import settled

EMPTY, DELETED = -(2**63), -(2**63) + 1  # the dense table's markers; keys <= DELETED go to `reserved`
MAX_ROWS = 2**31 - 1
MIN_BUCKETS = 64  # TF's default (2**17 buckets, 1.5 MB) would dominate small tables


class KeyIndex:
    """Key -> row (int64, -1 where absent) of one shard, created on the current device.

    >>> import tensorflow as tf
    >>> index = KeyIndex(tf.int64, "example")
    >>> _ = index.insert(tf.constant([7, -2**63], tf.int64), tf.constant([0, 1], tf.int64))
    >>> index.find(tf.constant([-2**63, 7, 8], tf.int64)).numpy().tolist(), int(index.size())
    ([1, 0, -1], 2)
    """

    def __init__(self, key_dtype: tf.DType, name: str):
        self.key_dtype = key_dtype
        if key_dtype == tf.string:
            self.main = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, -1, name=f"{name}_index")
            self.reserved = None
            self.row_dtype = tf.int64
        else:
            self.main = tf.lookup.experimental.DenseHashTable(
                tf.int64, tf.int32, -1, empty_key=EMPTY, deleted_key=DELETED,
                initial_num_buckets=MIN_BUCKETS, name=f"{name}_index",
            )  # fmt: skip
            self.reserved = tf.lookup.experimental.MutableHashTable(
                tf.int64, tf.int64, -1, name=f"{name}_index_reserved"
            )
            self.row_dtype = tf.int32
        for table in self.tables():
            _compat.local_table_default(table)  # what a step reads stays valid across a ps restart

    def tables(self) -> list:
        return [self.main] if self.reserved is None else [self.main, self.reserved]

    # ---------------------------------------------------- single key sets --

    def find(self, keys) -> tf.Tensor:
        """Rows of `keys` (int64; -1 where absent)."""
        if self.reserved is None:
            return self.find_ordinary(keys)
        reserved = keys <= DELETED
        return tf.cond(tf.reduce_any(reserved), lambda: self._find_routed(keys, reserved),
                       lambda: tf.cast(self.find_ordinary(keys), tf.int64))  # fmt: skip

    def insert(self, keys, rows) -> tf.Tensor:
        """Sets the rows of `keys` (distinct)."""
        if self.reserved is None:
            return self.insert_ordinary(keys, rows)
        keys, rows = tf.reshape(keys, [-1]), tf.reshape(rows, [-1])  # a restore's tensors have no static rank
        reserved = keys <= DELETED
        return tf.cond(tf.reduce_any(reserved), lambda: self._insert_routed(keys, rows, reserved),
                       lambda: self.insert_ordinary(keys, rows))  # fmt: skip

    def remove(self, keys) -> tf.Tensor:
        """Removes `keys` (those absent are ignored)."""
        if self.reserved is None:
            return settled([tf.raw_ops.LookupTableRemoveV2(table_handle=self.main.resource_handle, keys=keys)])
        keys = tf.reshape(keys, [-1])
        reserved = keys <= DELETED
        return settled([
            tf.raw_ops.LookupTableRemoveV2(table_handle=self.main.resource_handle,
                                           keys=tf.boolean_mask(keys, tf.logical_not(reserved))),
            tf.raw_ops.LookupTableRemoveV2(table_handle=self.reserved.resource_handle,
                                           keys=tf.boolean_mask(keys, reserved)),
        ])  # fmt: skip

    def export(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """`(keys, rows)` of every key held, rank 1."""
        keys, rows = tf.raw_ops.LookupTableExportV2(
            table_handle=self.main.resource_handle, Tkeys=self.key_dtype, Tvalues=self.row_dtype
        )
        keys, rows = tf.reshape(keys, [-1]), tf.cast(tf.reshape(rows, [-1]), tf.int64)
        if self.reserved is None:
            return keys, rows
        held = tf.where(keys > DELETED)[:, 0]  # the dense table exports its empty and deleted buckets too
        more_keys, more_rows = self.reserved.export()
        keys = tf.concat([tf.gather(keys, held), tf.reshape(more_keys, [-1])], 0)
        return keys, tf.concat([tf.gather(rows, held), tf.reshape(more_rows, [-1])], 0)

    def size(self) -> tf.Tensor:
        if self.reserved is None:
            return self.main.size()
        return self.main.size() + self.reserved.size()

    # ------------------------------------------------------------ helpers --

    def find_ordinary(self, keys) -> tf.Tensor:
        """Rows of `keys`, none of them reserved, in `row_dtype` (-1 where absent)."""
        return _find(self.main, keys, self.row_dtype)

    def insert_ordinary(self, keys, rows) -> tf.Tensor:
        """Sets the rows of `keys` (distinct, none of them reserved)."""
        rows = tf.cast(rows, self.row_dtype)
        return settled([tf.raw_ops.LookupTableInsertV2(table_handle=self.main.resource_handle, keys=keys, values=rows)])

    def _find_routed(self, keys, reserved) -> tf.Tensor:
        ordinary = tf.cast(self.find_ordinary(tf.where(reserved, tf.zeros_like(keys), keys)), tf.int64)
        return tf.where(reserved, _find(self.reserved, keys, tf.int64), ordinary)

    def _insert_routed(self, keys, rows, reserved) -> tf.Tensor:
        ordinary = tf.logical_not(reserved)
        low_keys, low_rows = tf.boolean_mask(keys, reserved), tf.cast(tf.boolean_mask(rows, reserved), tf.int64)
        return settled([
            self.insert_ordinary(tf.boolean_mask(keys, ordinary), tf.boolean_mask(rows, ordinary)),
            tf.raw_ops.LookupTableInsertV2(table_handle=self.reserved.resource_handle, keys=low_keys, values=low_rows),
        ])  # fmt: skip


def find_many(indexes: Sequence[KeyIndex], keys: Sequence[tf.Tensor], every: tf.Tensor) -> tf.Tensor:
    """The rows (int64) of `keys[i]` in `indexes[i]`, concatenated, given `every` = the keys concatenated: one
    test for reserved keys among all of them, one cast."""
    if indexes[0].reserved is None:
        return tf.concat([x.find(k) for x, k in zip(indexes, keys)], 0)

    def routed():
        return tf.concat([x.find(k) for x, k in zip(indexes, keys)], 0)

    def plain():
        return tf.cast(tf.concat([x.find_ordinary(k) for x, k in zip(indexes, keys)], 0), tf.int64)

    return tf.cond(tf.reduce_any(every <= DELETED), routed, plain)


def insert_many(indexes: Sequence[KeyIndex], keys: Sequence[tf.Tensor], rows: Sequence[tf.Tensor]) -> List:
    """`indexes[i].insert(keys[i], rows[i])` for every i: one test for reserved keys among all of them."""
    if indexes[0].reserved is None:
        return [x.insert(k, r) for x, k, r in zip(indexes, keys, rows)]

    def routed():
        return settled([x.insert(k, r) for x, k, r in zip(indexes, keys, rows)])

    def plain():
        return settled([x.insert_ordinary(k, r) for x, k, r in zip(indexes, keys, rows)])

    return [tf.cond(tf.reduce_any(tf.concat(list(keys), 0) <= DELETED), routed, plain)]


def _find(table, keys, rows_dtype) -> tf.Tensor:
    """The table's rows of `keys`, its default (-1) made here: the table's own default is a tensor
    of the process that created it, which every lookup would fetch from there."""
    rows = tf.raw_ops.LookupTableFindV2(
        table_handle=table.resource_handle, keys=keys, default_value=tf.constant(-1, rows_dtype)
    )
    rows.set_shape(keys.shape)
    return rows
