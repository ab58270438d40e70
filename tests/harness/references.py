"""Single-device references: the same computation with a plain `tf.Variable` or Keras layer on one device."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def table_values(rows: int, dim: int, seed: int = 0) -> np.ndarray:
    """Distinct, reproducible table contents."""
    return np.random.RandomState(seed).uniform(-1, 1, size=(rows, dim)).astype(np.float32)


def squared_norm_sgd(values: np.ndarray, id_batches, learning_rate: float) -> np.ndarray:
    """The table after plain SGD on `sum(lookup(ids) ** 2)` for each batch (every replica's ids in one batch)."""
    reference = tf.Variable(values)
    for ids in id_batches:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(reference, ids) ** 2)
        grad = tape.gradient(loss, reference)
        reference.scatter_sub(tf.IndexedSlices(learning_rate * grad.values, grad.indices))
    return reference.numpy()
