"""`tfs.layers.DynamicEmbedding`: a Keras 3 embedding layer over raw int64 or string keys (a `tfs.DynamicTable`).

There is no `input_dim`: a key gets a row the first time a training call
meets it. The table is created through the current strategy's
`create_dynamic_table` hook; each shard's row pool is one of the layer's
Keras weights, so Keras trains it with `tfs.optimizers` (whose slots are
per-key columns beside the rows), and TensorFlow checkpoints hold the table
once, as its live keys.
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from tf_sharded.config import Combiner
from tf_sharded.errors import positive_int
from tf_sharded.keras.layer_tables import (
    create_layer_dynamic_table,
    dense_keys_to_ragged,
    options_config,
    options_from_config,
    refuse_multi_hot,
)
from tf_sharded.policies import deserialize_policies, serialize_policies
from tf_sharded.table.dynamic.keys import keys_from_file, keys_to_file, parse_key_dtype
from tf_sharded.table.dynamic.pool import GROWTH
from tf_sharded.table.dynamic.table import DynamicTable
from tf_sharded.table.lookup import FeatureLookup, lookup_features


@keras.saving.register_keras_serializable(package="tf_sharded")
class DynamicEmbedding(keras.layers.Layer):
    """Keras 3 embedding layer over raw keys: any int64 value or any string, no vocabulary to build.

    Args:
      output_dim: embedding dimension.
      key_dtype: "int64" or "string" (the dtype of the layer's input).
      combiner: None (one vector per key) or "sum" / "mean" / "sqrtn" to
        combine multi-hot keys given as `tf.RaggedTensor` or `tf.SparseTensor`
        (or dense `[batch, n]` keys, every one counted).
      embeddings_initializer: a name or Keras initializer; a key's initial row
        depends on (seed, key) only, for every layout.
      embeddings_regularizer: optional Keras regularizer on the rows a batch
        looks up.
      partitions, seed, admission, eviction, max_rows, growth, placement:
        passed to `create_dynamic_table` (`placement="sharded"`: a shard per
        worker under MultiWorkerMirroredStrategy).
      **kwargs: standard layer arguments (`name`, `dtype`, `trainable`, ...).

    Calls with `training=True` (the default, and what `model.fit` passes)
    give unseen keys a row; `training=False` (`predict`, `evaluate`) reads
    their initial row without storing anything. Train it with a
    `tfs.optimizers` optimizer: Keras's own optimizers build slots shaped
    like a variable, and a dynamic table's pools change size.

    Example:

    >>> import tf_sharded as tfs
    >>> layer = tfs.layers.DynamicEmbedding(4, key_dtype="string", seed=0)
    >>> layer(tf.constant([["cat"], ["dog"]])).shape
    TensorShape([2, 1, 4])
    >>> int(layer.table.size())
    2
    >>> bags = tfs.layers.DynamicEmbedding(4, combiner="mean", seed=0)
    >>> bags(tf.ragged.constant([[2**60, -3], [7]], dtype=tf.int64)).shape
    TensorShape([2, 4])
    """

    def __init__(
        self,
        output_dim: int,
        key_dtype: Any = "int64",
        combiner: Optional[str] = None,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        partitions: Optional[int] = None,
        seed: Optional[int] = None,
        admission: Any = None,
        eviction: Any = None,
        max_rows: Optional[int] = None,
        growth: float = GROWTH,
        placement: Optional[str] = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.output_dim = positive_int("output_dim", output_dim)
        self.key_dtype = parse_key_dtype(key_dtype, self.name).name
        self.combiner = Combiner.parse_optional(combiner, "combiner", say_none=True)
        self.embeddings_initializer = embeddings_initializer
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.partitions = partitions
        self.seed = seed
        self.admission = admission
        self.eviction = eviction
        self.max_rows = max_rows
        self.growth = growth
        self.placement = placement
        self.table: Optional[DynamicTable] = None

    def build(self, input_shape=None):
        if self.built:
            return
        self.table = create_layer_dynamic_table(
            self,
            self.name,
            self.output_dim,
            "rows",
            key_dtype=self.key_dtype,
            initializer=self.embeddings_initializer,
            partitions=self.partitions,
            seed=self.seed,
            admission=self.admission,
            eviction=self.eviction,
            max_rows=self.max_rows,
            growth=self.growth,
            placement=self.placement,
        )
        self.built = True

    def call(self, inputs, training=None):
        who = f"Layer '{self.name}'"
        if self.combiner is None:
            refuse_multi_hot(inputs, who)
            request = FeatureLookup(self.table, inputs, arg="inputs")
        else:
            request = FeatureLookup(self.table, dense_keys_to_ragged(self.table, inputs), self.combiner, arg="inputs")
        out = lookup_features([request], training=training is not False)[0]
        if self.embeddings_regularizer is not None:
            self.add_loss(self.embeddings_regularizer(out))
        return tf.cast(out, self.compute_dtype)

    # ------------------------------------------------------------- shapes --

    def compute_output_shape(self, input_shape):
        if self.combiner is not None:
            return (input_shape[0], self.output_dim)
        return tuple(input_shape) + (self.output_dim,)

    def compute_output_spec(self, inputs, training=None):
        shape = self.compute_output_shape(tuple(inputs.shape))
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    # ------------------------------------------------------- weight files --

    def save_own_variables(self, store):
        # Live keys and their rows, not the pools: a file loads into any layout. Strings as bytes (HDF5).
        keys, values = self.table.export()
        keys_to_file(store, "keys", keys)
        store["values"] = values.numpy()

    def load_own_variables(self, store):
        if "keys" not in store or "values" not in store:
            raise ValueError(
                f"Layer '{self.name}': the saved file has no 'keys' and 'values' entries (a DynamicEmbedding's). "
                f"Received keys: {list(store.keys())}"
            )
        keys = keys_from_file(store, "keys", self.table.key_dtype, f"Layer '{self.name}'")
        self.table.assign_keys(keys, store["values"][...])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "output_dim": self.output_dim,
                "key_dtype": self.key_dtype,
                "combiner": self.combiner,
                **options_config(self.embeddings_initializer, self.embeddings_regularizer),
                "partitions": self.partitions,
                "seed": self.seed,
                "admission": serialize_policies(self.admission),
                "eviction": serialize_policies(self.eviction),
                "max_rows": self.max_rows,
                "placement": self.placement,
                "growth": self.growth,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = options_from_config(config)
        for arg in ("admission", "eviction"):
            config[arg] = deserialize_policies(config.get(arg))
        return cls(**config)
