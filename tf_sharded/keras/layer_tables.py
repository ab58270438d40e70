"""What the Keras layers share: tables created as the layer's own weights, multi-hot input, weight files."""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tf_sharded import _compat, initializers
from tf_sharded.config import TableConfig
from tf_sharded.creation import create_table
from tf_sharded.strategy import family_of


def keras_initializer(initializer):
    """A Keras initializer object for names tf_sharded does not resolve per row itself; anything else as is."""
    if isinstance(initializer, dict):
        return keras.initializers.deserialize(initializer)
    if isinstance(initializer, str) and not initializers.is_named(initializer):
        return keras.initializers.get(initializer)
    return initializer


def options_config(initializer, regularizer) -> dict:
    """The `embeddings_initializer` / `embeddings_regularizer` entries of a layer's config."""
    if not isinstance(initializer, str):
        initializer = keras.initializers.serialize(initializer)
    return {
        "embeddings_initializer": initializer,
        "embeddings_regularizer": None if regularizer is None else keras.regularizers.serialize(regularizer),
    }


def options_from_config(config: dict) -> dict:
    """A copy of a layer's config with its initializer deserialized (the inverse of `options_config`)."""
    config = dict(config)
    if isinstance(config.get("embeddings_initializer"), dict):
        config["embeddings_initializer"] = keras.initializers.deserialize(config["embeddings_initializer"])
    return config


def create_layer_table(layer: keras.layers.Layer, config: TableConfig, prefix: str, dtype=None, trainable=None):
    """Creates `config`'s table under the current strategy with its shards as `layer`'s own Keras variables.

    Keras then trains, counts and saves them. Created outside Keras's
    StatelessScope, where a new variable would only be deferred. All or
    nothing: if a shard fails, the shards made before it leave the layer.
    The shards take the layer's variable dtype and trainability unless
    `dtype` / `trainable` say otherwise (a quantized table's int8 rows).
    """
    config = layer_config(layer, config, dtype, trainable)
    with _compat.outside_keras_stateless_scope(), _compat.keras_weights_rollback(layer):
        return create_table(tf.distribute.get_strategy(), config, variable_factory=_weight_factory(layer, prefix))


def layer_config(layer: keras.layers.Layer, config: TableConfig, dtype=None, trainable=None) -> TableConfig:
    """`config` with the layer's variable dtype and trainability (unless given) and a Keras initializer."""
    return dataclasses.replace(
        config,
        dtype=dtype or layer.variable_dtype,
        trainable=layer.trainable if trainable is None else trainable,
        initializer=keras_initializer(config.initializer),
    )


def _weight_factory(layer: keras.layers.Layer, prefix: str):
    def factory(index, initial_value_fn, shape, dtype, trainable):
        weight = layer.add_weight(
            shape=tuple(shape),
            initializer=lambda shape, dtype: initial_value_fn(),
            dtype=dtype,
            trainable=trainable,
            name=f"{prefix}_part_{index}",
            # Without autocast `.value` is the variable itself even when built inside a call's autocast
            # scope; lookups gather rows and cast nothing.
            autocast=False,
        )
        return weight.value

    return factory


def create_layer_group(layer: keras.layers.Layer, configs, name: str, prefix: str) -> list:
    """Tables of one dtype and row shape, stored together when the strategy batches tables (parameter
    servers: one variable per ps for all of them, `tf_sharded.table.batched`), whose variables become the
    layer's weights; returns the tables, in order. None if the strategy does not batch tables."""
    strategy = tf.distribute.get_strategy()
    group = family_of(strategy).create_group
    if group is None:
        return None
    configs = [layer_config(layer, c) for c in configs]
    with _compat.outside_keras_stateless_scope(), _compat.keras_weights_rollback(layer):
        return group(strategy, configs, name, variable_factory=_weight_factory(layer, prefix))


def create_layer_dynamic_table(layer: keras.layers.Layer, name: str, dim: int, prefix: str, **options):
    """Creates a dynamic table under the current strategy with its row pools as `layer`'s Keras weights.

    The weights stand for the pools (which grow); Keras trains and counts
    them, and TensorFlow checkpoints hold the table once, as its live keys.
    """
    from tf_sharded.creation import create_dynamic_table

    options["initializer"] = keras_initializer(options.get("initializer", "uniform"))
    with _compat.outside_keras_stateless_scope(), _compat.keras_weights_rollback(layer):
        table = create_dynamic_table(name, dim, dtype=layer.variable_dtype, trainable=layer.trainable, **options)
        _adopt_pools(layer, table.held_variables, dim, prefix)
    return table


def create_layer_dynamic_group(layer: keras.layers.Layer, tables, name: str, prefix: str):
    """Dynamic tables sharing one row pool per device (`tf_sharded.table.dynamic.group`), the pools as
    `layer`'s Keras weights (once for all the tables).

    `tables`: per table, `create_dynamic_table`'s arguments. None if the strategy has no dynamic tables.
    """
    from tf_sharded.creation import create_dynamic_group
    from tf_sharded.table.dynamic.group import group_of

    tables = [dict(t, initializer=keras_initializer(t["initializer"])) for t in tables]
    strategy = tf.distribute.get_strategy()
    with _compat.outside_keras_stateless_scope(), _compat.keras_weights_rollback(layer):
        members = create_dynamic_group(strategy, name, tables, layer.variable_dtype, layer.trainable)
        if members is not None:
            _adopt_pools(layer, group_of(members[0]).variables, tables[0]["dim"], prefix)
    return members


def _adopt_pools(layer: keras.layers.Layer, pools, dim: int, prefix: str) -> None:
    """Makes each row pool in `pools` one of `layer`'s Keras weights (which stand for it as it grows)."""
    for i, pool in enumerate(pools):
        weight = layer.add_weight(
            shape=(0, dim), initializer="zeros", dtype=layer.variable_dtype, trainable=layer.trainable,
            name=f"{prefix}_{i}", autocast=False,
        )  # fmt: skip
        _compat.keras_adopt_variable(weight, pool)


def dense_keys_to_ragged(table, keys):
    """Dense `[batch, n]` keys of a dynamic table as ragged, every key counted (any key value is valid)."""
    if isinstance(keys, (tf.RaggedTensor, tf.SparseTensor)):
        return keys
    return tf.RaggedTensor.from_tensor(table.check_ids(keys, arg="inputs", max_rank=2)[0])


def padded_to_ragged(ids, combiner: str, mask_zero: bool, who: str):
    """Ragged / sparse ids as they are; padded dense ids [batch, n] as ragged (negative, or 0 with mask_zero, = pad)."""
    if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
        return ids
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank != 2:
        raise ValueError(
            f"{who} with combiner={combiner!r} needs multi-hot ids of shape [batch, ids] (padded dense, ragged "
            f"or sparse). Received: shape {ids.shape.as_list()}"
        )
    keep = ids >= 0
    if mask_zero:
        keep = tf.logical_and(keep, tf.not_equal(ids, 0))
    return tf.ragged.boolean_mask(ids, keep)


def refuse_multi_hot(ids, who: str) -> None:
    """Multi-hot ids where the feature has no combiner: a TypeError, as for `tfs.embedding_lookup`."""
    if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
        raise TypeError(
            f"{who} received multi-hot input ({type(ids).__name__}) but has combiner=None. "
            "Pass combiner='sum', 'mean' or 'sqrtn' to combine each example's ids."
        )


def load_table(table, store, key: str, layer: str) -> None:
    """Assigns a weight file's entry `key` to `table`, as the table's kind saved it (errors name `layer`)."""
    table.kind.load_weights(table, store, key, layer)
