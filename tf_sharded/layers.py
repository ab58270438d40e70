"""Keras 3 layers backed by sharded tables.

`Embedding` takes the arguments of `keras.layers.Embedding` and creates its
table through the current strategy's `create_sharded_variable` hook, so the
same model code shards under `ParameterServerStrategy` and mirrors under the
mirrored strategies. Its shards are Keras variables owned by the layer (what
Keras 3 trains, saves and counts), while lookups go straight to the shards
and never concatenate the table.
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from tf_sharded import creation
from tf_sharded.errors import positive_int
from tf_sharded.lookup import COMBINERS, embedding_lookup, embedding_lookup_sparse
from tf_sharded.partition import PartitionSpec
from tf_sharded.sharded_variable import ShardedVariable


@keras.saving.register_keras_serializable(package="tf_sharded")
class Embedding(keras.layers.Layer):
    """Drop-in `keras.layers.Embedding` whose table is a `tfs.ShardedVariable`.

    Args:
      input_dim: vocabulary size.
      output_dim: embedding dimension.
      embeddings_initializer: Keras initializer (name or object) or any
        initializer `tfs.create_sharded_variable` accepts; named and Keras
        initializers give the same table for every layout.
      embeddings_regularizer: optional Keras regularizer, applied to the rows
        a batch looks up (a whole-table penalty would read every row each step).
      mask_zero: as in Keras (single-hot input); with a `combiner`, id 0 is
        treated as padding instead.
      combiner: None (one vector per id) or "sum" / "mean" / "sqrtn" to combine
        multi-hot input given as `tf.RaggedTensor`, `tf.SparseTensor`, or padded
        dense ids (negative ids are padding).
      partitions, scheme, exchange, placement, seed: passed to
        `create_sharded_variable`.
      **kwargs: standard layer arguments (`name`, `dtype`, `trainable`, ...).

    Example:

    >>> import keras, tf_sharded as tfs
    >>> layer = tfs.layers.Embedding(100, 4, partitions=2, seed=0)
    >>> layer(tf.constant([[1, 2], [3, 99]])).shape
    TensorShape([2, 2, 4])
    >>> [tuple(w.shape) for w in layer.trainable_weights]
    [(50, 4), (50, 4)]
    >>> bags = tfs.layers.Embedding(100, 4, combiner="mean", seed=0)
    >>> bags(tf.ragged.constant([[1, 2, 3], [7]])).shape
    TensorShape([2, 4])
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        embeddings_constraint: Any = None,
        mask_zero: bool = False,
        combiner: Optional[str] = None,
        partitions: Any = None,
        scheme: Optional[str] = None,
        exchange: Optional[str] = None,
        placement: Optional[str] = None,
        seed: Optional[int] = None,
        **kwargs,
    ):
        kwargs.pop("input_length", None)  # accepted by Keras 2; meaningless here too
        super().__init__(**kwargs)
        self.input_dim = positive_int("input_dim", input_dim)
        self.output_dim = positive_int("output_dim", output_dim)
        if combiner is not None and combiner not in COMBINERS:
            raise ValueError(f"Argument `combiner` must be None or one of {COMBINERS}. Received: combiner={combiner!r}")
        if embeddings_constraint is not None:
            raise ValueError(
                "Argument `embeddings_constraint` is not supported by tfs.layers.Embedding: a constraint "
                "projects the whole table after every step. Received: "
                f"embeddings_constraint={embeddings_constraint!r}. Use max_norm on the lookup instead."
            )
        if isinstance(partitions, dict):
            partitions = PartitionSpec.from_config(partitions)
        self.embeddings_initializer = embeddings_initializer
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.mask_zero = bool(mask_zero)
        self.combiner = combiner
        self.partitions = partitions
        self.scheme = scheme
        self.exchange = exchange
        self.placement = placement
        self.seed = seed
        self.supports_masking = self.mask_zero and combiner is None
        self.embeddings: Optional[ShardedVariable] = None

    def build(self, input_shape=None):
        if self.built:
            return
        initializer = self.embeddings_initializer
        if isinstance(initializer, str) and not _is_tfs_name(initializer):
            initializer = keras.initializers.get(initializer)

        def factory(index, initial_value_fn, shape, dtype, trainable):
            weight = self.add_weight(
                shape=tuple(shape),
                initializer=lambda shape, dtype: initial_value_fn(),
                dtype=dtype,
                trainable=trainable,
                name=f"embeddings_part_{index}",
            )
            return weight.value

        arguments = dict(
            name=self.name,
            shape=[self.input_dim, self.output_dim],
            dtype=self.variable_dtype,
            initializer=initializer,
            partitions=self.partitions,
            trainable=self.trainable,
            scheme=self.scheme,
            seed=self.seed,
            exchange=self.exchange,
            placement=self.placement,
        )
        self.embeddings = creation._create(tf.distribute.get_strategy(), arguments, variable_factory=factory)
        self.built = True

    def call(self, inputs):
        table = self.embeddings
        if self.combiner is None:
            if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
                raise ValueError(
                    f"Layer '{self.name}' received multi-hot input ({type(inputs).__name__}) but has "
                    "combiner=None. Pass combiner='sum', 'mean' or 'sqrtn' to combine each example's ids."
                )
            out = embedding_lookup(table, inputs)
            rows = out
        else:
            ids = inputs
            if not isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
                ids = tf.convert_to_tensor(ids)
                if ids.shape.rank != 2:
                    raise ValueError(
                        f"Layer '{self.name}' with combiner={self.combiner!r} needs multi-hot ids of shape "
                        f"[batch, ids] (padded dense, ragged or sparse). Received: shape {ids.shape.as_list()}"
                    )
                keep = ids >= 0
                if self.mask_zero:
                    keep = tf.logical_and(keep, tf.not_equal(ids, 0))
                ids = tf.ragged.boolean_mask(ids, keep)
            out = embedding_lookup_sparse(table, ids, combiner=self.combiner)
            rows = out
        if self.embeddings_regularizer is not None:
            self.add_loss(self.embeddings_regularizer(rows))
        return out

    def save_own_variables(self, store):
        # The logical table, whatever the layout: a .keras file loads into any other.
        store["embeddings"] = self.embeddings.numpy()

    def load_own_variables(self, store):
        _load_table(self.embeddings, store, "embeddings", self.name)

    def compute_mask(self, inputs, mask=None):
        if not self.supports_masking:
            return None
        return tf.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape):
        if self.combiner is not None:
            return (input_shape[0], self.output_dim)
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        config = super().get_config()
        partitions = self.partitions.to_config() if isinstance(self.partitions, PartitionSpec) else self.partitions
        initializer = self.embeddings_initializer
        if not isinstance(initializer, str):
            initializer = keras.initializers.serialize(initializer)
        config.update(
            {
                "input_dim": self.input_dim,
                "output_dim": self.output_dim,
                "embeddings_initializer": initializer,
                "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer)
                if self.embeddings_regularizer is not None
                else None,
                "mask_zero": self.mask_zero,
                "combiner": self.combiner,
                "partitions": partitions,
                "scheme": self.scheme,
                "exchange": self.exchange,
                "placement": self.placement,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        initializer = config.get("embeddings_initializer")
        if isinstance(initializer, dict):
            config["embeddings_initializer"] = keras.initializers.deserialize(initializer)
        return cls(**config)


def _load_table(table: ShardedVariable, store, key: str, layer: str) -> None:
    if key not in store:
        raise ValueError(f"Layer '{layer}': the saved file has no '{key}' entry. Received keys: {list(store.keys())}")
    value = store[key]
    shape = list(value.shape)
    if shape != table.shape.as_list():
        raise ValueError(
            f"Layer '{layer}': saved '{key}' has shape {shape}, the layer's table has shape "
            f"{table.shape.as_list()}. Received a file saved from another model configuration."
        )
    table.assign(value[...])


def _is_tfs_name(name: str) -> bool:
    from tf_sharded.initializers import _NAMED, _SCALING

    return name.lower() in _NAMED or name.lower() in _SCALING
