"""Quantized tables of `tfs.layers.Embedding` (Keras's `layer.quantize("int8" | "int4")`) and of int8 / int4
exports, sharded as the float table was.

The quantized rows and their scales (and, for grouped int4, their zero
points) are tables with the float table's row partition, so each shard of
rows keeps its scales beside it and a lookup reads all of them for the same
ids. The forms are Keras's own:

* `int8`: one int8 value per column and one scale per row (by default
  `keras.quantizers.abs_max_quantize` on the last axis: `127 / max|row|`);
  `row = q / scale`.
* `int4` per row (`block_size` None or -1): values in [-8, 7] packed two
  per byte along the row (`keras.quantizers.pack_int4`), one scale per
  row; `row = unpack(q) / scale`.
* `int4` grouped (`block_size` > 0, Keras's default 128 from Keras 3.14):
  the row's columns in groups of `block_size`, each with a scale and an
  int8 zero point (asymmetric: the group's range `[min, max]`, the last
  group's padded with zeros, mapped onto [-8, 7]);
  `row[c] = (unpack(q)[c] - zero[g(c)]) * scale[g(c)]` with
  `g(c) = c // block_size` (Keras's `g_idx`). `grouped_int4` computes it
  here, so an export can take this form whatever the Keras release; a
  layer takes it only where Keras has it (`Int4QuantizationConfig`).

Every form is row-local: a row's quantized values depend on that row only,
so the layout of the table does not change them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_sharded.config import TableConfig
from tf_sharded.keras.layer_tables import create_layer_table

MODES = ("int8", "int4")
# Keras 3.15's other quantization modes: refused as not supported (any other name is an invalid mode).
KERAS_MODES = ("float8", "gptq", "awq")
INT4_RANGE = (-8, 7)


@dataclasses.dataclass(frozen=True)
class Form:
    """How a table of `dim` columns is quantized: `mode` and, for int4, `block_size` (None or -1: per row)."""

    mode: str
    dim: int
    block_size: Optional[int] = None

    @property
    def grouped(self) -> bool:
        return self.mode == "int4" and self.block_size is not None and self.block_size > 0

    @property
    def groups(self) -> int:
        return math.ceil(self.dim / self.block_size) if self.grouped else 1

    @property
    def stored_dim(self) -> int:
        """Columns of the stored rows: int4 packs two values a byte."""
        return (self.dim + 1) // 2 if self.mode == "int4" else self.dim

    @property
    def scale_shape(self) -> tuple:
        """A row's scales (and zero points): one, or one per group."""
        return (self.groups,) if self.grouped else ()

    def g_idx(self) -> np.ndarray:
        """Keras's `g_idx`: each column's group, as float32."""
        return (np.arange(self.dim) // self.block_size).astype(np.float32)


def keras_groups_int4() -> bool:
    """Whether the installed Keras quantizes int4 in groups (`Int4QuantizationConfig`, `int4/<block>_from_*`
    dtype policies; Keras 3.14 on). Before, its int4 is per row and its policies are named `int4_from_*`."""
    return hasattr(keras.quantizers, "Int4QuantizationConfig")


def policy_name(form: Form, source: str) -> str:
    """The dtype policy Keras names a layer quantized in `form` from the `source` policy."""
    if form.mode == "int4" and keras_groups_int4():
        return f"int4/{-1 if form.block_size is None else form.block_size}_from_{source}"
    return f"{form.mode}_from_{source}"


def int4_block_size(layer, config) -> Optional[int]:
    """Keras's rule for a layer's int4 block size: the config's, else the dtype policy's (`int4/128_from_...`),
    else None (per row; what a legacy `int4_from_...` policy and a Keras before 3.14 mean)."""
    if keras_groups_int4() and isinstance(config, keras.quantizers.Int4QuantizationConfig):
        return config.block_size
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        policy = policy[layer.path]
    block_size = getattr(policy, "block_size", None)
    return None if block_size == -1 else block_size


@dataclasses.dataclass
class Quantized:
    """A table's quantized arrays: `rows` (int8; int4 packed), `scale` and, grouped int4 only, `zero`."""

    rows: np.ndarray
    scale: np.ndarray
    zero: Optional[np.ndarray] = None


def quantize_rows(values: np.ndarray, form: Form, config=None) -> Quantized:
    """`values` (`[rows, dim]`) quantized in `form`, by `config`'s weight quantizer where it has one (Keras's
    default otherwise)."""
    custom = getattr(config, "weight_quantizer", None)
    if form.grouped:
        rows, scale, zero = grouped_int4(values, form.block_size)
    else:
        value_range = INT4_RANGE if form.mode == "int4" else (-127, 127)
        if custom is not None:
            rows, scale = custom(values, to_numpy=True)
        else:
            rows, scale = keras.quantizers.abs_max_quantize(values, axis=-1, value_range=value_range, to_numpy=True)
        rows, scale, zero = np.asarray(rows, np.int8), np.asarray(scale).reshape(len(values)), None
    if form.mode == "int8":
        return Quantized(rows, scale)
    packed, _, _ = keras.quantizers.pack_int4(rows, axis=-1)
    return Quantized(np.asarray(packed, np.int8), scale, zero)


def grouped_int4(values: np.ndarray, block_size: int):
    """Asymmetric int4 of `values` (`[rows, dim]`) in groups of `block_size` columns: each group's range
    `[min, max]` (the last group's padded with zeros to `block_size`) mapped onto [-8, 7] by a scale and an
    integer zero point, `q = round(x / scale) + zero`. Returns the int8 values `[rows, dim]` and the float
    scales and int8 zero points `[rows, groups]`; the same numbers as Keras's grouped quantizer gives the
    columns of a kernel."""
    values = np.asarray(values)
    rows, dim = values.shape
    groups = math.ceil(dim / block_size)
    padded = np.zeros((rows, groups * block_size), values.dtype)
    padded[:, :dim] = values
    blocks = padded.reshape(rows, groups, block_size)
    low, high = INT4_RANGE
    least, most = blocks.min(axis=-1, keepdims=True), blocks.max(axis=-1, keepdims=True)
    scale = np.divide(np.subtract(most, least) + keras.config.epsilon(), high - low)
    zero = np.clip(np.round(np.divide(-least, scale)) + low, low, high)
    q = np.clip(np.round(np.divide(blocks, scale)) + zero, low, high).astype(np.int8)
    return q.reshape(rows, -1)[:, :dim], scale[..., 0], zero[..., 0].astype(np.int8)


def create_quantized_tables(layer, form: Form, partitions, scheme=None, arrays: Optional[Quantized] = None) -> list:
    """The layer's quantized tables, partitioned by `partitions`: rows and scales, and for grouped int4 the
    zero points and Keras's `g_idx` weight (each column's group, not sharded); `arrays` if given, else zeros,
    ones and zeros (what loading fills)."""
    n = layer.input_dim
    if arrays is None:
        arrays = Quantized(
            np.zeros((n, form.stored_dim), np.int8),
            np.ones((n, *form.scale_shape), np.float32),
            np.zeros((n, *form.scale_shape), np.int8) if form.grouped else None,
        )
    common = dict(partitions=partitions, scheme=scheme, seed=layer.seed, exchange=layer.exchange,
                  placement=layer.placement)  # fmt: skip

    def table(suffix, prefix, values, dtype):
        config = TableConfig(f"{layer.name}_{suffix}", values.shape, initializer=values, **common)
        return create_layer_table(layer, config, prefix, dtype, trainable=False)

    tables = [table(form.mode, "embeddings", arrays.rows, "int8")]
    tables.append(table("scale", "embeddings_scale", arrays.scale.astype(layer.variable_dtype), None))
    if form.grouped:
        tables.append(table("zero", "embeddings_zero", arrays.zero, "int8"))
        tables.append(
            layer.add_weight(
                name="g_idx", shape=(form.dim,), initializer=lambda shape, dtype: form.g_idx(), dtype="float32",
                trainable=False, autocast=False,
            )
        )  # fmt: skip
    return tables


def save_entries(form: Form, tables: list, store, lora_delta=None, config=None) -> None:
    """Keras's weight-file entries of a quantized layer: rows and scales ("0", "1"), for grouped int4 the zero
    points and `g_idx` ("2", "3"). With a LoRA term (`lora_delta`, the float update of every row), the rows
    are dequantized, merged and quantized again, as Keras's layer saves them."""
    arrays = Quantized(*[t.numpy() for t in tables])
    if lora_delta is not None:
        rows = dequantized(form, arrays.rows, arrays.scale, tf.float32, zero=arrays.zero).numpy()
        arrays = quantize_rows(rows + lora_delta, form, config)
    store["0"], store["1"] = arrays.rows, arrays.scale
    if form.grouped:
        store["2"], store["3"] = arrays.zero, form.g_idx()


def dequantized(form: Form, rows: tf.Tensor, scale: tf.Tensor, dtype, zero: Optional[tf.Tensor] = None):
    """Float rows in `dtype` from looked-up quantized `rows` and the same rows' `scale` (and `zero`)."""
    rows, scale = tf.convert_to_tensor(rows), tf.convert_to_tensor(scale)
    if form.mode == "int4":
        rows = keras.quantizers.unpack_int4(rows, form.dim, axis=-1)
    rows = tf.cast(rows, dtype)
    if form.grouped:
        groups = tf.constant(form.g_idx().astype(np.int32))
        scale = tf.gather(tf.cast(scale, dtype), groups, axis=-1)
        return (rows - tf.gather(tf.cast(zero, dtype), groups, axis=-1)) * scale
    extra = rows.shape.rank - scale.shape.rank
    scale = tf.reshape(scale, tf.concat([tf.shape(scale), tf.ones([extra], tf.int32)], 0))
    return rows / tf.cast(scale, dtype)
