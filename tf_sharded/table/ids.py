"""Row-id validation shared by every table: dtype and rank at once, values by an assertion every use depends on."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tf_sharded.table.protocol import MAX_IDS_RANK


def check_ids(ids, num_rows: int, table_name: str, arg: str = "ids", max_rank: Optional[int] = MAX_IDS_RANK):
    """Validates row ids and returns `(ids_int64, flat_ids_int64)`.

    Static problems (dtype, rank) raise at once; value problems (negative or
    out-of-range ids) raise `tf.errors.InvalidArgumentError` from an assertion
    that every use of the ids depends on, eagerly and inside `tf.function`.
    """
    if isinstance(ids, (tf.SparseTensor, tf.RaggedTensor)):
        raise TypeError(
            f"Argument `{arg}` must be a dense integer tensor. Received: a "
            f"{type(ids).__name__}. For multi-hot ids use tfs.embedding_lookup_sparse."
        )
    if not isinstance(ids, tf.Tensor):
        array = np.asarray(ids)
        if array.dtype.kind not in "iu":
            raise TypeError(
                f"Argument `{arg}` must hold integers (int32 or int64). Received: {arg} of "
                f"dtype {array.dtype} for table '{table_name}'"
            )
        ids = tf.convert_to_tensor(array.astype(np.int64) if array.dtype.kind == "u" else array)
    if ids.dtype not in (tf.int32, tf.int64):
        raise TypeError(
            f"Argument `{arg}` must be an int32 or int64 tensor. Received: {arg} of dtype "
            f"{ids.dtype.name} for table '{table_name}'"
        )
    rank = ids.shape.rank
    if max_rank is not None and rank is not None and rank > max_rank:
        raise ValueError(
            f"Argument `{arg}` must have rank 0 to {max_rank}. Received: {arg} of rank {rank} "
            f"(shape {ids.shape.as_list()}) for table '{table_name}'"
        )
    ids = tf.cast(ids, tf.int64)
    flat = tf.reshape(ids, [-1])
    if tf.executing_eagerly():
        values = flat.numpy()
        if values.size and (values.min() < 0 or values.max() >= num_rows):
            bad = values[(values < 0) | (values >= num_rows)]
            raise tf.errors.InvalidArgumentError(
                None,
                None,
                f"Argument `{arg}` must hold row ids in [0, {num_rows}) for table '{table_name}'. "
                f"Received: {bad.size} id(s) outside it, e.g. {bad[:5].tolist()}",
            )
        return ids, flat
    low = tf.reduce_min(tf.concat([flat, [0]], 0))
    high = tf.reduce_max(tf.concat([flat, [0]], 0))
    ok = tf.logical_and(low >= 0, high < num_rows)
    # The raw op: `tf.debugging.Assert` wraps int64 data in a `cond` (an `If` per check, costly per step).
    check = tf.raw_ops.Assert(
        condition=ok,
        data=[
            f"Argument `{arg}` must hold row ids in [0, {num_rows}) for table '{table_name}'. Received: smallest id",
            low,
            "largest id",
            high,
        ],
        summarize=4,
    )
    with tf.control_dependencies([check]):
        return tf.identity(ids), tf.identity(flat)
