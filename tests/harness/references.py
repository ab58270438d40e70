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


def mixed_width_collection(rows: int, placement: str):
    """`(tables, features)` of an EmbeddingCollection: two tables of width 4 (stored together where batched) and
    one of width 8 read by a ragged `mean` feature; `fa`, `fb`, `fc` read tables a, b, c."""
    tables = {
        "a": {"input_dim": rows, "output_dim": 4, "placement": placement},
        "b": {"input_dim": rows + 2, "output_dim": 4, "placement": placement},
        "c": {"input_dim": rows + 5, "output_dim": 8, "placement": placement},
    }
    return tables, {"fa": "a", "fb": "b", "fc": {"table": "c", "combiner": "mean"}}


def squared_norm_adagrad_collection(start: dict, steps, learning_rate: float = 0.1, accumulator: float = 0.1):
    """`mixed_width_collection`'s tables after Adagrad steps on `sum(rows ** 2)`, in NumPy.

    `start`: `{table: array}`; `steps`: per step `{feature: [ids of each replica]}` (ragged ids for `fc`). Each
    step's gradient is the sum over the replicas; untouched rows keep their accumulator.
    """
    accumulators = {name: np.full_like(values, accumulator) for name, values in start.items()}
    want = {name: values.copy() for name, values in start.items()}
    for arrays in steps:
        grads = {name: np.zeros_like(values) for name, values in want.items()}
        for name, feature in (("a", "fa"), ("b", "fb")):
            for ids in arrays[feature]:
                np.add.at(grads[name], ids, 2 * want[name][ids])
        for bag in arrays["fc"]:
            for ids in bag.to_list():
                if ids:
                    np.add.at(grads["c"], ids, 2 * want["c"][ids].mean(axis=0) / len(ids))
        for name in want:
            touched = np.any(grads[name] != 0, axis=1)
            accumulators[name][touched] += grads[name][touched] ** 2
            want[name] = want[name] - learning_rate * grads[name] / np.sqrt(accumulators[name])
    return want
