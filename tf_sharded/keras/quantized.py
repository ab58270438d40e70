"""int8 tables of `tfs.layers.Embedding` (Keras's `layer.quantize("int8")`), sharded as the float table was.

The int8 rows and the per-row scales are two tables with the float table's
partition, so each shard of rows keeps its scales beside it and a lookup
reads both for the same ids: `rows = q / scale`. As Keras's layer, the scale
of a row comes from the configured weight quantizer (by default
`keras.quantizers.AbsMaxQuantizer(axis=-1)`: `127 / max|row|`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tf_sharded.config import TableConfig
from tf_sharded.keras.layer_tables import create_layer_table

MODES = ("int8",)
# Keras 3.15's other quantization modes: refused as not supported (any other name is an invalid mode).
KERAS_MODES = ("int4", "float8", "gptq", "awq")


def quantize_rows(values: np.ndarray, config=None):
    """`(int8 rows, float scale per row)` of `values` by `config`'s weight quantizer (Keras's default if none).

    Rows of rank above 1 are scaled as one vector each."""
    quantizer = getattr(config, "weight_quantizer", None) or keras.quantizers.AbsMaxQuantizer(axis=-1)
    rows, scale = quantizer(np.reshape(values, (len(values), -1)), to_numpy=True)
    return np.asarray(rows, np.int8).reshape(np.shape(values)), np.asarray(scale).reshape(len(values))


def create_int8_tables(layer, partitions, scheme=None, rows=None, scale=None):
    """The layer's int8 table and scale table (zeros / ones unless given), partitioned by `partitions`."""
    shape = (layer.input_dim, layer.output_dim)
    common = dict(partitions=partitions, scheme=scheme, seed=layer.seed, exchange=layer.exchange,
                  placement=layer.placement)  # fmt: skip
    rows = np.zeros(shape, np.int8) if rows is None else rows
    scale = np.ones(shape[:1], layer.variable_dtype) if scale is None else scale.astype(layer.variable_dtype)
    table = create_layer_table(
        layer, TableConfig(f"{layer.name}_int8", shape, initializer=rows, **common), "embeddings", "int8", False
    )
    scales = create_layer_table(
        layer, TableConfig(f"{layer.name}_scale", shape[:1], initializer=scale, **common), "embeddings_scale",
        trainable=False,
    )  # fmt: skip
    return table, scales


def dequantized(rows: tf.Tensor, scale: tf.Tensor, dtype) -> tf.Tensor:
    """`rows / scale`, each row by its scale, in `dtype`."""
    extra = rows.shape.rank - scale.shape.rank
    scale = tf.reshape(scale, tf.concat([tf.shape(scale), tf.ones([extra], tf.int32)], 0))
    return tf.cast(rows, dtype) / tf.cast(scale, dtype)
