"""A dynamic table's optimizer slots: columns of its shards' row pools, saved with the table."""

from __future__ import annotations

from tf_sharded import _compat
from tf_sharded.table.dynamic.keys import keys_from_file, keys_to_file


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
        keys = keys_from_file(
            store, key + "_keys", self.table.key_dtype, f"Slot '{self.name}' of dynamic table '{self.table.name}'"
        )
        self.table.set_column(self.name, keys, store[key][...])

    def _serialize_to_tensors(self):
        return {}
