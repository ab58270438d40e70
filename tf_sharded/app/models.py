"""CTR models on Criteo-shaped features, built from `tfs.layers`: DLRM and DeepFM.

Inputs are a dict: `"dense"` (`[batch, 13]` float) and `"C1"`..`"C26"`
(`[batch]` int64 ids). The 26 tables live in one `EmbeddingCollection`, so
each step sends one fused request per shard holder, and the same model code
shards under parameter servers and mirrors under mirrored strategies.
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras
import tensorflow as tf

from tf_sharded.app.data import CATEGORICAL_KEYS, NUM_DENSE
from tf_sharded.keras.collection import EmbeddingCollection

MODELS = ("dlrm", "deepfm")


def _inputs():
    inputs = {"dense": keras.Input((NUM_DENSE,), name="dense")}
    for key in CATEGORICAL_KEYS:
        inputs[key] = keras.Input((), dtype="int64", name=key)
    return inputs


EMBEDDINGS = ("tfs", "keras")


def _embed(ids: dict, vocab: Sequence[int], dim: int, name: str, table_options: Optional[dict], embeddings: str):
    """The 26 feature vectors: one `EmbeddingCollection` ("tfs"), or one `keras.layers.Embedding` per feature."""
    if embeddings == "keras":
        if table_options:
            raise ValueError(
                "Argument `table_options` applies to tf_sharded tables only. "
                f"Received: table_options={table_options!r} with embeddings='keras'"
            )
        return {
            key: keras.layers.Embedding(int(size), dim, name=f"{name}_{key}")(ids[key])
            for key, size in zip(CATEGORICAL_KEYS, vocab)
        }
    return _collection(vocab, dim, name, table_options)({key: ids[key] for key in CATEGORICAL_KEYS})


def _check_embeddings(embeddings: str) -> None:
    if embeddings not in EMBEDDINGS:
        raise ValueError(f"Argument `embeddings` must be one of {EMBEDDINGS}. Received: {embeddings!r}")


def _collection(vocab: Sequence[int], dim: int, name: str, table_options: Optional[dict]) -> EmbeddingCollection:
    tables = {
        key: {"input_dim": int(size), "output_dim": dim, "seed": i, **(table_options or {})}
        for i, (key, size) in enumerate(zip(CATEGORICAL_KEYS, vocab))
    }
    return EmbeddingCollection(tables, {key: key for key in CATEGORICAL_KEYS}, name=name)


def _mlp(x, units: Sequence[int], name: str, last_activation: Optional[str] = "relu"):
    for i, n in enumerate(units):
        last = i == len(units) - 1
        x = keras.layers.Dense(n, activation=last_activation if last else "relu", name=f"{name}_{i}")(x)
    return x


class DotInteraction(keras.layers.Layer):
    """DLRM's interaction: pairwise dot products of the feature vectors (upper triangle), then the dense vector."""

    def call(self, vectors):
        stacked = tf.stack(vectors, axis=1)  # [batch, n, dim]
        dots = tf.matmul(stacked, stacked, transpose_b=True)
        n = len(vectors)
        rows, cols = zip(*[(i, j) for i in range(n) for j in range(i + 1, n)])
        pairs = tf.gather(tf.reshape(dots, [-1, n * n]), [r * n + c for r, c in zip(rows, cols)], axis=1)
        return tf.concat([vectors[0], pairs], axis=1)


def dlrm(
    vocab: Sequence[int],
    embedding_dim: int = 16,
    bottom: Sequence[int] = (512, 256, 64),
    top: Sequence[int] = (512, 256),
    table_options: Optional[dict] = None,
    embeddings: str = "tfs",
) -> keras.Model:
    """DLRM: bottom MLP on the dense features, dot interaction with the 26 embeddings, top MLP, one logit.

    The bottom MLP ends in `embedding_dim` units (13-512-256-64-16 with the
    defaults, as in the reference DLRM for Criteo Kaggle). `embeddings="keras"`
    builds the same model with one `keras.layers.Embedding` per feature
    (TensorFlow's own path, the baseline of `bench e2e`).

    Example:

    >>> import tf_sharded as tfs
    >>> model = tfs.models.dlrm(tfs.data.vocab_sizes(100), embedding_dim=4, bottom=(8,), top=(8,))
    >>> features, labels = next(iter(tfs.data.synthetic_dataset(2, max_vocab=100)))
    >>> model(features).shape
    TensorShape([2, 1])
    """
    _check_embeddings(embeddings)
    inputs = _inputs()
    bottom_out = _mlp(inputs["dense"], list(bottom) + [embedding_dim], "bottom")
    embedded = _embed(inputs, vocab, embedding_dim, "embeddings", table_options, embeddings)
    interaction = DotInteraction(name="interaction")([bottom_out] + [embedded[k] for k in CATEGORICAL_KEYS])
    logit = _mlp(interaction, list(top) + [1], "top", last_activation=None)
    return keras.Model(inputs, logit, name="dlrm")


class FactorizationMachine(keras.layers.Layer):
    """Second-order FM term: 0.5 * sum over dims of ((sum v)^2 - sum v^2)."""

    def call(self, vectors):
        stacked = tf.stack(vectors, axis=1)
        square_of_sum = tf.square(tf.reduce_sum(stacked, axis=1))
        sum_of_square = tf.reduce_sum(tf.square(stacked), axis=1)
        return 0.5 * tf.reduce_sum(square_of_sum - sum_of_square, axis=1, keepdims=True)


def deepfm(
    vocab: Sequence[int],
    embedding_dim: int = 16,
    deep: Sequence[int] = (400, 400, 400),
    table_options: Optional[dict] = None,
    embeddings: str = "tfs",
) -> keras.Model:
    """DeepFM: first-order weights, an FM over the field embeddings, and an MLP on them, summed into one logit.

    `embeddings="keras"` builds it from `keras.layers.Embedding` layers instead.

    Example:

    >>> import tf_sharded as tfs
    >>> model = tfs.models.deepfm(tfs.data.vocab_sizes(100), embedding_dim=4, deep=(8,))
    >>> features, labels = next(iter(tfs.data.synthetic_dataset(2, max_vocab=100)))
    >>> model(features).shape
    TensorShape([2, 1])
    """
    _check_embeddings(embeddings)
    inputs = _inputs()
    first = _embed(inputs, vocab, 1, "first_order", table_options, embeddings)
    fields = _embed(inputs, vocab, embedding_dim, "embeddings", table_options, embeddings)
    vectors = [fields[k] for k in CATEGORICAL_KEYS]
    linear = keras.layers.Add(name="linear")(
        [first[k] for k in CATEGORICAL_KEYS] + [keras.layers.Dense(1, name="dense_linear")(inputs["dense"])]
    )
    fm = FactorizationMachine(name="fm")(vectors)
    deep_in = keras.layers.Concatenate(name="deep_input")(vectors + [inputs["dense"]])
    deep_out = _mlp(deep_in, list(deep) + [1], "deep", last_activation=None)
    logit = keras.layers.Add(name="logit")([linear, fm, deep_out])
    return keras.Model(inputs, logit, name="deepfm")


def build(
    name: str,
    vocab: Sequence[int],
    embedding_dim: int = 16,
    table_options: Optional[dict] = None,
    embeddings: str = "tfs",
):
    """`dlrm` or `deepfm` by name."""
    if name not in MODELS:
        raise ValueError(f"Argument `model` must be one of {MODELS}. Received: {name!r}")
    return (dlrm if name == "dlrm" else deepfm)(
        vocab, embedding_dim=embedding_dim, table_options=table_options, embeddings=embeddings
    )
