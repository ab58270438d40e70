"""A dynamic table as a SavedModel holds it: core TensorFlow only, updatable in place by a delta.

`ExportedDynamicTable` is what `tfs.export` writes for a `tfs.DynamicTable`:
a `MutableHashTable` from key to row, one plain variable of rows, and
traced functions (`lookup`, `update`) whose ops are all core TensorFlow (the
initial row of an unknown key is computed by the same hash arithmetic as in
training). A process that cannot import tf_sharded loads and serves it.

A delta (`tfs.export_delta`) is a directory with two files per table,
`<file stem>.keys` and `<file stem>.values`, each a serialized tensor
(`tf.io.serialize_tensor`); the SavedModel's `apply_delta(path)` reads them
with core ops and updates the tables: new keys are appended, known keys
overwritten.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import tensorflow as tf

from tf_sharded import _compat


def file_stem(table_name: str) -> str:
    """The file name (without suffix) of a table's part of a delta."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", table_name)


class ExportedDynamicTable(tf.Module):
    """A trained dynamic table for serving: its live keys and rows, unknown keys read their initial row.

    Args:
      table: the `tfs.DynamicTable` to copy (read once, wherever its shards live).
    """

    def __init__(self, table):
        super().__init__(name=file_stem(table.name))
        self.stem = file_stem(table.name)
        self.key_dtype, self.dim, self.dtype = table.key_dtype, table.dim, table.dtype
        initial_rows = table.initial_rows
        with tf.device("/cpu:0"):
            keys, values = table.export()
            self.index = tf.lookup.experimental.MutableHashTable(table.key_dtype, tf.int64, default_value=-1)
            self.index.insert(keys, tf.range(tf.size(keys, out_type=tf.int64)))
            self.rows = _compat.plain_variable(values, f"{self.stem}_rows", False, shape=tf.TensorShape(None))
        keys_spec = tf.TensorSpec([None], table.key_dtype)

        @tf.function(input_signature=[keys_spec])
        def lookup(keys):
            """Rows of rank-1 `keys`: stored rows, and the initial row for a key the table does not hold."""
            rows = self.index.lookup(keys)
            stored = tf.gather(self._values(), tf.maximum(rows, 0))
            out = tf.where((rows >= 0)[:, None], stored, initial_rows(keys))
            out.set_shape([None, self.dim])
            return out

        @tf.function(input_signature=[keys_spec, tf.TensorSpec([None, table.dim], table.dtype)])
        def update(keys, values):
            """Overwrites the rows of known `keys` and appends unknown ones; returns how many keys were new."""
            rows = self.index.lookup(keys)
            known = tf.where(rows >= 0)[:, 0]
            fresh = tf.where(rows < 0)[:, 0]
            current = self._values()
            current = tf.tensor_scatter_nd_update(current, tf.gather(rows, known)[:, None], tf.gather(values, known))
            start = tf.shape(current, out_type=tf.int64)[0]
            added = tf.size(fresh, out_type=tf.int64)
            write = self.rows.assign(tf.concat([current, tf.gather(values, fresh)], 0), read_value=False)
            with tf.control_dependencies([write]):
                insert = self.index.insert(tf.gather(keys, fresh), start + tf.range(added))
            with tf.control_dependencies([insert]):
                return tf.identity(added)

        self.lookup, self.update = lookup, update

    def _values(self) -> tf.Tensor:
        return tf.reshape(self.rows.read_value(), [-1, self.dim])

    def apply_delta(self, path) -> tf.Tensor:
        """Applies this table's part of the delta in directory `path` (a string tensor); core ops only."""
        prefix = tf.strings.join([path, "/", self.stem])
        keys = tf.io.parse_tensor(tf.io.read_file(prefix + ".keys"), self.key_dtype)
        values = tf.io.parse_tensor(tf.io.read_file(prefix + ".values"), self.dtype)
        return self.update(tf.reshape(keys, [-1]), tf.reshape(values, [-1, self.dim]))


def write_delta(tables: Sequence, path: str, since_step: int) -> dict:
    """Writes every table's rows updated after `since_step` into directory `path`; returns `{table: keys}`."""
    os.makedirs(path, exist_ok=True)
    written = {}
    for table in tables:
        keys, values = table.export(since_step=since_step)
        stem = os.path.join(path, file_stem(table.name))
        tf.io.write_file(stem + ".keys", tf.io.serialize_tensor(keys))
        tf.io.write_file(stem + ".values", tf.io.serialize_tensor(values))
        written[table.name] = int(tf.size(keys))
    return written
