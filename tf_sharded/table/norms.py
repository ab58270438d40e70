"""`max_norm` clipping of looked-up rows, as `tf.nn.embedding_lookup` does it.

>>> import tensorflow as tf
>>> from tf_sharded.table.norms import clip_rows
>>> print(clip_rows(tf.constant([[3.0, 4.0], [0.3, 0.4]]), 1.0).numpy().round(2))
[[0.6 0.8]
 [0.3 0.4]]
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf


def clip_rows(rows: tf.Tensor, max_norm: Optional[float], inner_axes: Optional[Sequence[int]] = None) -> tf.Tensor:
    """`rows` with each row's L2 norm over `inner_axes` (default: every axis after the first) clipped to
    `max_norm` (None: `rows` unchanged). Rank-1 tables clip each scalar row to |max_norm| (TF's `axes=[]`)."""
    if max_norm is None:
        return rows
    if inner_axes is None:
        inner_axes = list(range(1, rows.shape.rank))
    norms = tf.sqrt(tf.reduce_sum(tf.square(rows), axis=inner_axes, keepdims=True))
    return rows * tf.where(norms > max_norm, max_norm / tf.maximum(norms, 1e-30), tf.ones_like(norms))
