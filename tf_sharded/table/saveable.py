"""A table's checkpoint entry: one full-shape key, saved and restored as contiguous row slices.

TensorFlow restores a `SaveableObject` only once every one of its slices has
been read, so a failed read assigns nothing; a restore whose full shape or
dtype differs is refused before anything is assigned
(`tfs.LayoutMismatchError`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.errors import LayoutMismatchError


def slice_spec(full_shape, start: int, length: int) -> str:
    dims = " ".join(str(int(d)) for d in full_shape)
    rest = "".join(":-" for _ in full_shape[1:])
    return f"{dims} {start},{length}{rest}"


class TableSaveable(_compat.SaveableObject):
    """Saves a table as contiguous slices of one full-shape checkpoint entry."""

    def __init__(self, table, name: str):
        pending = _compat.pending_restore(table)
        if pending is not None:
            key, saved_shape, saved_dtype = pending
            if saved_shape is not None and (list(saved_shape) != table.shape.as_list() or saved_dtype != table.dtype):
                raise LayoutMismatchError(table.name, key, saved_shape, saved_dtype, table.shape, table.dtype)
        specs = []
        for start, stop, shard in table.checkpoint_slices():
            specs.append(
                _compat.save_spec(
                    lambda a=start, b=stop, s=shard: table.read_slice(a, b, s),
                    slice_spec(table.shape, start, stop - start),
                    name,
                    table.dtype,
                    table.slice_device(shard),
                )
            )
        self._table = table
        super().__init__(table, specs, name)

    def restore(self, restored_tensors, restored_shapes):
        ops = self._table.restore_slices(restored_tensors)
        return tf.group(ops) if not tf.executing_eagerly() else tf.no_op()
