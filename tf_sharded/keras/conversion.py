"""Switching Keras 3 models to sharded tables: `shard_embeddings` (a copy) and `sharded_embeddings` (a block)."""

from __future__ import annotations

import contextlib
import inspect

import keras
import numpy as np

from tf_sharded import _compat
from tf_sharded.keras.embedding import Embedding


def shard_embeddings(model: keras.Model, **options) -> keras.Model:
    """Returns a copy of `model` with every `keras.layers.Embedding` replaced by `tfs.layers.Embedding`.

    The one-line switch for an existing Keras 3 model: the copy has the same
    structure, names and weights (each embedding matrix becomes a sharded
    table holding the same rows), so it predicts exactly what `model` does.
    Call it inside `strategy.scope()` to shard or mirror the tables there.

    Args:
      model: a Functional or Sequential Keras 3 model.
      **options: `tfs.layers.Embedding` arguments applied to every replaced
        layer (`partitions`, `scheme`, `exchange`, `placement`, `combiner`, ...).

    Returns:
      The new model (not compiled).

    Raises:
      ValueError: `model` is a subclassed model, which Keras cannot clone
        layer by layer; or an embedding uses a constraint.

    Example:

    >>> import keras, tf_sharded as tfs
    >>> inp = keras.Input((2,), dtype="int64")
    >>> model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Embedding(10, 3)(inp)))
    >>> sharded = tfs.layers.shard_embeddings(model, partitions=2)
    >>> type(sharded.layers[1]).__name__, sharded.layers[1].embeddings.num_shards
    ('Embedding', 2)
    >>> bool(np.allclose(sharded(np.array([[1, 9]])), model(np.array([[1, 9]]))))
    True
    """
    if not _compat.is_functional_or_sequential(model):
        raise ValueError(
            "Argument `model` must be a Functional or Sequential keras.Model (Keras cannot clone a subclassed "
            f"model layer by layer). Received: {type(model).__name__}. For a subclassed model, build it inside "
            "`with tfs.layers.sharded_embeddings(...):` and load the old weights into it."
        )

    def clone(layer):
        if type(layer) is not _KERAS_EMBEDDING:
            return layer.__class__.from_config(layer.get_config())
        config = layer.get_config()
        if isinstance(config.get("embeddings_initializer"), dict):
            config["embeddings_initializer"] = keras.initializers.deserialize(config["embeddings_initializer"])
        return _from_keras_arguments(config, options)

    new = keras.models.clone_model(model, clone_function=clone)
    for old_layer, new_layer in zip(model.layers, new.layers):
        if isinstance(new_layer, Embedding) and type(old_layer) is _KERAS_EMBEDDING:
            new_layer.embeddings.assign(old_layer.embeddings.numpy())
        elif old_layer.weights:
            new_layer.set_weights(old_layer.get_weights())
    return new


_KERAS_EMBEDDING = keras.layers.Embedding
_KERAS_ONLY = {"lora_rank": None, "lora_alpha": None, "quantization_config": None, "weights": None}


def _from_keras_arguments(arguments: dict, options: dict) -> Embedding:
    """A `tfs.layers.Embedding` from `keras.layers.Embedding`'s arguments (or config) plus tf_sharded options."""
    arguments = dict(arguments)
    for key, neutral in _KERAS_ONLY.items():
        value = arguments.pop(key, neutral)
        if key == "weights" and value is not None:
            arguments["embeddings_initializer"] = np.asarray(value[0] if isinstance(value, (list, tuple)) else value)
        elif value is not neutral and value != neutral:
            raise ValueError(
                f"Argument `{key}` of keras.layers.Embedding is not supported by tfs.layers.Embedding. "
                f"Received: {key}={value!r}"
            )
    if arguments.get("embeddings_constraint") is not None:
        raise ValueError(
            f"Layer '{arguments.get('name')}' has an embeddings_constraint, which tfs.layers.Embedding does not "
            f"support. Received: {arguments['embeddings_constraint']!r}"
        )
    arguments.pop("embeddings_constraint", None)
    keep = set(inspect.signature(Embedding.__init__).parameters) | {
        "name",
        "dtype",
        "trainable",
        "activity_regularizer",
    }
    return Embedding(**{k: v for k, v in arguments.items() if k in keep}, **options)


@contextlib.contextmanager
def sharded_embeddings(**options):
    """Inside this block, `keras.layers.Embedding(...)` builds a `tfs.layers.Embedding`.

    The one-line switch for model code you do not want to edit, subclassed
    models included: wrap the code that builds the model, then load its old
    weights (`model.load_weights(...)`); tables are stored under the key
    `keras.layers.Embedding` uses, so weights move in both directions.

    Args:
      **options: `tfs.layers.Embedding` arguments for every embedding built
        in the block (`partitions`, `scheme`, `exchange`, `placement`, ...).

    Example:

    >>> import keras, tf_sharded as tfs
    >>> with tfs.layers.sharded_embeddings(partitions=2):
    ...     layer = keras.layers.Embedding(10, 3)
    >>> type(layer).__module__, layer(np.array([1])).shape
    ('tf_sharded.keras.embedding', TensorShape([1, 3]))
    >>> type(keras.layers.Embedding(10, 3)).__module__
    'keras.src.layers.core.embedding'
    """
    names = inspect.signature(_KERAS_EMBEDDING.__init__).parameters

    def make(*args, **kwargs):
        positional = [n for n in names if n not in ("self", "kwargs")]
        return _from_keras_arguments({**dict(zip(positional, args)), **kwargs}, options)

    modules = [m for m in (keras.layers, _compat.tf_keras_layers_module()) if m is not None]
    saved = [(m, m.Embedding) for m in modules]
    for m in modules:
        m.Embedding = make
    try:
        yield
    finally:
        for m, original in saved:
            m.Embedding = original
