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


def check_string_admission(check, strategy, per_replica, train_step, **table_options):
    """String keys admitted at their second occurrence, trained by SGD(0.1) on `sum((row - 1) ** 2)` over two
    replicas, two steps, checked against the closed form: a key met once on each replica has met its count.

    `per_replica(batches)` gives replica r `batches[r]`; `train_step(table, optimizer)` is the step; the table
    is created with `table_options` (e.g. `placement`). Returns the table.
    """
    import tf_sharded as tfs

    with strategy.scope():
        words = strategy.create_dynamic_table("words", dim=2, key_dtype=tf.string, seed=1,
                                              admission=tfs.policies.MinCountAdmission(2), **table_options)  # fmt: skip
        sgd = tfs.optimizers.SGD(0.1)
    step = train_step(words, sgd)
    first = [np.array([b"a", b"b"]), np.array([b"a", "\u00e9t\u00e9".encode()])]
    second = [np.array([b"b", b""]), np.array([b"", b"zz"])]
    initial = words.initial_rows(tf.constant([b"a", b"b", b""])).numpy()
    step(per_replica(first))
    check.assertEqual(sorted(words.export()[0].numpy().tolist()), [b"a"])
    step(per_replica(second))
    got = dict(zip(*[t.numpy().tolist() for t in words.export()]))
    check.assertEqual(sorted(got), [b"", b"a", b"b"])
    # Each occurrence of an admitted key adds 2 * (row - 1) to its gradient, and SGD(0.1) moves it by 0.1 times that.
    check.assertAllClose(got[b"a"], initial[0] - 0.1 * 2 * 2 * (initial[0] - 1), atol=1e-6)
    check.assertAllClose(got[b"b"], initial[1] - 0.1 * 2 * (initial[1] - 1), atol=1e-6)
    check.assertAllClose(got[b""], initial[2] - 0.1 * 2 * 2 * (initial[2] - 1), atol=1e-6)
    return words


def table_digest(table) -> str:
    """A short hash of a dynamic table's keys, rows, optimizer columns, "seen" and "hits" in key order: equal on
    workers whose copies are equal."""
    import hashlib

    keys, values, extra = table.export_columns(sorted(table._slots) + ["seen", "hits"])
    order = np.argsort(keys.numpy())
    parts = [keys.numpy()[order], values.numpy()[order]] + [extra[c].numpy()[order] for c in sorted(extra)]
    data = [b"".join(p.tolist()) if p.dtype == object else np.ascontiguousarray(p).tobytes() for p in parts]
    return hashlib.sha256(b"".join(data)).hexdigest()[:16]
