"""Keys in Keras weight files, and a dynamic table's optimizer slots (columns saved with the table)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_sharded import _compat


def keys_to_file(store, entry: str, keys) -> None:
    """Writes keys to a Keras weight store (numeric arrays only): int64 as is, strings as UTF-8 bytes + lengths."""
    keys = keys.numpy() if hasattr(keys, "numpy") else np.asarray(keys)
    if keys.dtype != object:
        store[entry] = keys
        return
    encoded = [k if isinstance(k, bytes) else str(k).encode() for k in keys]
    store[entry] = np.frombuffer(b"".join(encoded), np.uint8) if encoded else np.zeros([0], np.uint8)
    store[entry + "_lengths"] = np.array([len(k) for k in encoded], np.int64)


def keys_from_file(store, entry: str, key_dtype: tf.DType) -> tf.Tensor:
    """The keys `keys_to_file` wrote, as a tensor of `key_dtype`."""
    stored = np.asarray(store[entry][...])
    if key_dtype != tf.string:
        return tf.constant(stored, key_dtype)
    lengths = np.asarray(store[entry + "_lengths"][...])
    ends, data = np.cumsum(lengths), stored.tobytes()
    return tf.constant([data[e - n : e] for e, n in zip(ends, lengths)], tf.string)


class DynamicSlot(_compat.Trackable):
    """An optimizer slot of a dynamic table: one column per shard, saved with the table (not on its own)."""

    def __init__(self, table, name: str, variables):
        self.table, self.name, self.variables = table, name, tuple(variables)

    def numpy(self):
        """The slot's rows of every live key, in `table.export()` order."""
        return self.table.export_columns([self.name])[2][self.name].numpy()

    def save_to(self, store, key: str) -> None:
        """Writes the slot to a Keras weight store as `key` (values) and `key + "_keys"` (their keys)."""
        keys, _, extra = self.table.export_columns([self.name])
        keys_to_file(store, key + "_keys", keys)
        store[key] = extra[self.name].numpy()

    def load_from(self, store, key: str) -> None:
        """Sets the slot's rows of the keys `save_to` wrote (keys the table does not hold are skipped)."""
        keys = keys_from_file(store, key + "_keys", self.table.key_dtype)
        self.table.set_column(self.name, keys, store[key][...])

    def _serialize_to_tensors(self):
        return {}
