"""Recommendation models built from `tfs.layers`: DLRM, DeepFM and an embedding MLP, for a feature schema.

Inputs are a dict: `"dense"` (`[batch, numeric columns]` float, when the
schema has numeric columns), and per categorical feature `[batch]` int64 ids,
per multi-hot feature `[batch, None]` ragged ids (`readers.parse_record`
makes them). The tables live in one `EmbeddingCollection`, so each step sends
one fused request per shard holder, and the same model code shards under
parameter servers and mirrors under mirrored strategies. `dlrm(vocab)` and
`deepfm(vocab)` are the models for Criteo's layout (`schema.criteo`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import keras
import tensorflow as tf

from tf_sharded.app.schema import FeatureType, Schema, criteo
from tf_sharded.keras.collection import EmbeddingCollection

MODELS = ("dlrm", "deepfm", "mlp")


def _inputs(schema: Schema):
    inputs = {}
    if schema.numeric:
        inputs["dense"] = keras.Input((len(schema.numeric),), name="dense")
    for f in schema.embedded:
        ragged = f.type == FeatureType.MULTI_HOT
        dtype = "string" if f.vocabulary == "dynamic" else "int64"
        inputs[f.name] = keras.Input((None,) if ragged else (), dtype=dtype, name=f.name, ragged=ragged)
    return inputs


EMBEDDINGS = ("tfs", "keras")


def _embed(ids: dict, schema: Schema, dim: int, name: str, table_options: Optional[dict], embeddings: str, plan=None):
    """One vector per embedded feature: one `EmbeddingCollection` ("tfs"), or one `keras.layers.Embedding`
    per categorical feature ("keras": TensorFlow's own path, the baseline of `bench e2e`). `plan(tables,
    name)`, if given, makes the collection's `tfs.plan`."""
    features = schema.embedded
    if embeddings == "keras":
        if table_options:
            raise ValueError(
                "Argument `table_options` applies to tf_sharded tables only. "
                f"Received: table_options={table_options!r} with embeddings='keras'"
            )
        if any(f.vocabulary == "dynamic" for f in features):
            raise ValueError("Argument `embeddings='keras'` has fixed vocabularies only, not dynamic ones")
        if any(f.type != FeatureType.CATEGORICAL for f in features):
            raise ValueError("Argument `embeddings='keras'` supports categorical features only, not multi_hot")
        if plan is not None:
            raise ValueError("Argument `plan` applies to tf_sharded tables only, not with embeddings='keras'")
        return {f.name: keras.layers.Embedding(f.buckets, dim, name=f"{name}_{f.name}")(ids[f.name]) for f in features}
    bounds = schema.table_policies()
    tables = {
        table: _table_config(rows, dim, i, table_options, bounds.get(table))
        for i, (table, rows) in enumerate(schema.tables().items())
    }
    specs = {
        f.name: {"table": f.table_name, "combiner": f.combiner.value if f.type == FeatureType.MULTI_HOT else None}
        for f in features
    }
    collection = EmbeddingCollection(tables, specs, name=name, plan=None if plan is None else plan(tables, name))
    return collection({f.name: ids[f.name] for f in features})


def _table_config(
    rows: Optional[int], dim: int, seed: int, options: Optional[dict], bounds: Optional[dict] = None
) -> dict:
    """An `EmbeddingCollection` table: `rows` hashed ids, or (rows None) a dynamic table of string keys, with the
    policies of its schema `bounds` (`Feature.policies`)."""
    if rows is None:
        # Of the sharded-table options, a dynamic table takes its shard count, and a shard per worker.
        extra = {k: v for k, v in (options or {}).items() if k == "partitions" or (k, v) == ("placement", "sharded")}
        return {"vocabulary": "dynamic", "output_dim": dim, "key_dtype": "string", "seed": seed, **extra,
                **policies(bounds or {})}  # fmt: skip
    return {"input_dim": int(rows), "output_dim": dim, "seed": seed, **(options or {})}


def policies(bounds: dict) -> dict:
    """A dynamic table's `admission` and `eviction` for a schema's bounds (`schema.POLICY_KEYS`), as
    `tfs.layers` table options ({} without bounds)."""
    from tf_sharded import policies as p

    evictions = []
    if "evict_after_steps" in bounds:
        evictions.append(p.StepsSinceSeenEviction(bounds["evict_after_steps"]))
    if "max_keys" in bounds:
        evictions.append(p.CapacityEviction(bounds["max_keys"]))
    out = {"eviction": evictions} if evictions else {}
    if "min_count" in bounds:
        out["admission"] = p.MinCountAdmission(bounds["min_count"])
    return out


def _check_embeddings(embeddings: str) -> None:
    if embeddings not in EMBEDDINGS:
        raise ValueError(f"Argument `embeddings` must be one of {EMBEDDINGS}. Received: {embeddings!r}")


def _schema(vocab_or_schema) -> Schema:
    return vocab_or_schema if isinstance(vocab_or_schema, Schema) else criteo(vocab_or_schema)


def _mlp(x, units: Sequence[int], name: str, last_activation: Optional[str] = "relu", last_bias: float = 0.0):
    for i, n in enumerate(units):
        last = i == len(units) - 1
        bias = keras.initializers.Constant(last_bias) if last else "zeros"
        x = keras.layers.Dense(
            n, activation=last_activation if last else "relu", bias_initializer=bias, name=f"{name}_{i}"
        )(x)
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
    vocab: Union[Sequence[int], Schema],
    embedding_dim: int = 16,
    bottom: Sequence[int] = (512, 256, 64),
    top: Sequence[int] = (512, 256),
    table_options: Optional[dict] = None,
    embeddings: str = "tfs",
    output_bias: float = 0.0,
    plan=None,
) -> keras.Model:
    """DLRM: bottom MLP on the dense features, dot interaction with the embeddings, top MLP, one output.

    `vocab` is a `Schema`, or the table sizes of Criteo's 26 categorical
    columns. The bottom MLP ends in `embedding_dim` units (13-512-256-64-16
    with the defaults, as in the reference DLRM for Criteo Kaggle); without
    numeric columns there is no bottom MLP. `embeddings="keras"`
    builds the same model with one `keras.layers.Embedding` per feature
    (TensorFlow's own path, the baseline of `bench e2e`).

    Example:

    >>> from tf_sharded.app import data, models
    >>> model = models.dlrm(data.vocab_sizes(100), embedding_dim=4, bottom=(8,), top=(8,))
    >>> features, labels = next(iter(data.synthetic_dataset(2, max_vocab=100)))
    >>> model(features).shape
    TensorShape([2, 1])
    """
    _check_embeddings(embeddings)
    schema = _schema(vocab)
    inputs = _inputs(schema)
    vectors = [_mlp(inputs["dense"], list(bottom) + [embedding_dim], "bottom")] if "dense" in inputs else []
    embedded = _embed(inputs, schema, embedding_dim, "embeddings", table_options, embeddings, plan)
    vectors += [embedded[f.name] for f in schema.embedded]
    interaction = DotInteraction(name="interaction")(vectors)
    logit = _mlp(interaction, list(top) + [1], "top", last_activation=None, last_bias=output_bias)
    return keras.Model(inputs, logit, name="dlrm")


class FactorizationMachine(keras.layers.Layer):
    """Second-order FM term: 0.5 * sum over dims of ((sum v)^2 - sum v^2)."""

    def call(self, vectors):
        stacked = tf.stack(vectors, axis=1)
        square_of_sum = tf.square(tf.reduce_sum(stacked, axis=1))
        sum_of_square = tf.reduce_sum(tf.square(stacked), axis=1)
        return 0.5 * tf.reduce_sum(square_of_sum - sum_of_square, axis=1, keepdims=True)


def deepfm(
    vocab: Union[Sequence[int], Schema],
    embedding_dim: int = 16,
    deep: Sequence[int] = (400, 400, 400),
    table_options: Optional[dict] = None,
    embeddings: str = "tfs",
    output_bias: float = 0.0,
    plan=None,
) -> keras.Model:
    """DeepFM: first-order weights, an FM over the field embeddings, and an MLP on them, summed into one logit.

    `embeddings="keras"` builds it from `keras.layers.Embedding` layers instead.

    Example:

    >>> from tf_sharded.app import data, models
    >>> model = models.deepfm(data.vocab_sizes(100), embedding_dim=4, deep=(8,))
    >>> features, labels = next(iter(data.synthetic_dataset(2, max_vocab=100)))
    >>> model(features).shape
    TensorShape([2, 1])
    """
    _check_embeddings(embeddings)
    schema = _schema(vocab)
    inputs = _inputs(schema)
    first = _embed(inputs, schema, 1, "first_order", table_options, embeddings, plan)
    fields = _embed(inputs, schema, embedding_dim, "embeddings", table_options, embeddings, plan)
    vectors = [fields[f.name] for f in schema.embedded]
    dense = [inputs["dense"]] if "dense" in inputs else []
    linear_terms = [first[f.name] for f in schema.embedded]
    linear_terms += [keras.layers.Dense(1, name="dense_linear")(d) for d in dense]
    linear = keras.layers.Add(name="linear")(linear_terms) if len(linear_terms) > 1 else linear_terms[0]
    fm = FactorizationMachine(name="fm")(vectors)
    deep_in = keras.layers.Concatenate(name="deep_input")(vectors + dense)
    deep_out = _mlp(deep_in, list(deep) + [1], "deep", last_activation=None, last_bias=output_bias)
    logit = keras.layers.Add(name="logit")([linear, fm, deep_out])
    return keras.Model(inputs, logit, name="deepfm")


def mlp(
    vocab: Union[Sequence[int], Schema],
    embedding_dim: int = 16,
    hidden: Sequence[int] = (256, 128),
    table_options: Optional[dict] = None,
    embeddings: str = "tfs",
    output_bias: float = 0.0,
    plan=None,
) -> keras.Model:
    """An embedding MLP: the embeddings and the numeric columns, concatenated, through an MLP to one output.

    The plain model for a regression label (ratings, watch time).

    Example:

    >>> from tf_sharded.app import data, models
    >>> model = models.mlp(data.vocab_sizes(100), embedding_dim=4, hidden=(8,))
    >>> features, labels = next(iter(data.synthetic_dataset(2, max_vocab=100)))
    >>> model(features).shape
    TensorShape([2, 1])
    """
    _check_embeddings(embeddings)
    schema = _schema(vocab)
    inputs = _inputs(schema)
    embedded = _embed(inputs, schema, embedding_dim, "embeddings", table_options, embeddings, plan)
    parts = [embedded[f.name] for f in schema.embedded] + ([inputs["dense"]] if "dense" in inputs else [])
    joined = keras.layers.Concatenate(name="joined")(parts) if len(parts) > 1 else parts[0]
    output = _mlp(joined, list(hidden) + [1], "hidden", last_activation=None, last_bias=output_bias)
    return keras.Model(inputs, output, name="mlp")


def output_bias(scanned, binary: bool) -> float:
    """Where a model's output starts: the training labels' mean (regression) or log-odds (binary).

    `scanned` is the pass over the training files (`app/scan.py`), or None (synthetic data: 0). Without it a
    rating model spends its first hundred steps learning the ratings' offset, and how well it ends then
    depends on how asynchronous those steps were.
    """
    mean = None if scanned is None else scanned.label_mean
    if mean is None:
        return 0.0
    if not binary:
        return float(mean)
    p = min(max(mean, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def build(
    name: str,
    vocab: Union[Sequence[int], Schema],
    embedding_dim: int = 16,
    table_options: Optional[dict] = None,
    embeddings: str = "tfs",
    output_bias: float = 0.0,
    plan=None,
):
    """`dlrm`, `deepfm` or `mlp` by name, for a `Schema` or Criteo's table sizes.

    `output_bias`: where the output starts (the bias of the last layer): the label's mean for a
    regression, its log-odds for a binary label, so that training does not spend its first steps
    learning the label's offset. `plan`: optional `plan(tables, name) -> tfs.plan(...)` called for
    each `EmbeddingCollection` (`name`) with its `tables` (e.g. `lambda tables, name: tfs.plan(tables,
    strategy, ids=sample)`); the collection applies the result.
    """
    if name not in MODELS:
        raise ValueError(f"Argument `model` must be one of {MODELS}. Received: {name!r}")
    return {"dlrm": dlrm, "deepfm": deepfm, "mlp": mlp}[name](
        vocab, embedding_dim=embedding_dim, table_options=table_options, embeddings=embeddings,
        output_bias=output_bias, plan=plan,
    )  # fmt: skip
