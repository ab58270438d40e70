"""`tfs.layers.Embedding`: a drop-in `keras.layers.Embedding` whose table is a `tfs.ShardedVariable`.

It creates its table through the current strategy's `create_sharded_variable`
hook, so the same model code shards under `ParameterServerStrategy` and
mirrors under the mirrored strategies. Its shards are Keras variables owned by
the layer (what Keras 3 trains, saves and counts), while lookups go straight
to the shards and never concatenate the table.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.config import Combiner, TableConfig
from tf_sharded.errors import positive_int
from tf_sharded.keras import quantized
from tf_sharded.keras.layer_tables import (
    create_layer_table,
    load_table,
    options_config,
    options_from_config,
    padded_to_ragged,
)
from tf_sharded.layout import PartitionSpec
from tf_sharded.table.lookup import FeatureLookup, combine, lookup_features, multi_hot_components
from tf_sharded.table.sharded_variable import ShardedVariable


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
      (Without a `combiner`, ragged ids give ragged rows and `tf.SparseTensor`
        ids dense rows, an absent entry read as id 0, as Keras's layer does.)
      combiner: None (one vector per id) or "sum" / "mean" / "sqrtn" to combine
        multi-hot input given as `tf.RaggedTensor`, `tf.SparseTensor`, or padded
        dense ids (negative ids are padding).
      partitions, scheme, exchange, placement, seed: passed to
        `create_sharded_variable`.
      weights: optional initial table, `[array]` or `array` of shape
        `[input_dim, output_dim]` (as Keras's); builds the layer at once.
      lora_rank, lora_alpha: as Keras's: when building, `enable_lora(lora_rank,
        lora_alpha)` (see there).
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
        weights: Any = None,
        lora_rank: Optional[int] = None,
        lora_alpha: Optional[float] = None,
        **kwargs,
    ):
        kwargs.pop("input_length", None)  # accepted by Keras 2; meaningless here too
        quantization_config = kwargs.pop("quantization_config", None)
        super().__init__(**kwargs)
        self.quantization_config = quantization_config
        self.input_dim = positive_int("input_dim", input_dim)
        self.output_dim = positive_int("output_dim", output_dim)
        combiner = Combiner.parse_optional(combiner, "combiner", say_none=True)
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
        _compat.set_untracked(self, "_sharded_table", None)
        # As Keras's: a rank of 0 (or None) means no LoRA.
        self.lora_rank = positive_int("lora_rank", lora_rank) if lora_rank not in (None, 0) else None
        self.lora_alpha = lora_alpha if lora_alpha is not None else self.lora_rank
        self.lora_enabled = False
        if weights is not None:
            value = np.asarray(weights[0] if isinstance(weights, (list, tuple)) and len(weights) == 1 else weights)
            if value.shape != (self.input_dim, self.output_dim):
                raise ValueError(
                    f"Argument `weights` must be one array of shape ({self.input_dim}, {self.output_dim}) (or a list "
                    f"holding it). Received: an array of shape {value.shape}"
                )
            self.build()
            self._table.assign(value)

    def build(self, input_shape=None):
        if self.built:
            return
        # LoRA factors and int8 tables added later go where the table went, even from outside the scope.
        _compat.set_untracked(self, "_built_under", tf.distribute.get_strategy())
        if self.quantization_mode is not None:  # a quantized dtype policy: the quantized rows, filled by loading
            self.quantized_build(input_shape, self.quantization_mode, self.quantization_config)
            self.built = True
            if self.lora_rank:
                self.enable_lora(self.lora_rank, self.lora_alpha)
            return
        config = TableConfig(
            self.name,
            (self.input_dim, self.output_dim),
            initializer=self.embeddings_initializer,
            partitions=self.partitions,
            scheme=self.scheme,
            seed=self.seed,
            exchange=self.exchange,
            placement=self.placement,
        )
        self._set_table(create_layer_table(self, config, "embeddings"))
        self.built = True
        if self.lora_rank:
            self.enable_lora(self.lora_rank, self.lora_alpha)

    @property
    def embeddings(self):
        """The table (a `tfs.ShardedVariable`; int8 once quantized, and for int4, as Keras's, its values
        unpacked as a tensor); with LoRA enabled, as Keras's, the merged table as a tensor (`table +
        lora_alpha / lora_rank * lora_embeddings_a @ lora_embeddings_b`: every row is read)."""
        if self.quantization_mode == "int4":
            return keras.quantizers.unpack_int4(self._table.read_value(), self.output_dim, axis=-1)
        if not self.lora_enabled or self.quantization_mode is not None:
            return self._table
        return self._table.read_value() + self._lora_scale * tf.matmul(
            self.lora_embeddings_a.read_value(), self.lora_embeddings_b
        )

    @property
    def _lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def _lora_term(self, a_rows):
        """`lora_alpha / lora_rank * a_rows @ lora_embeddings_b` for rows of `lora_embeddings_a`."""
        return self._lora_scale * tf.einsum("...r,rd->...d", a_rows, self.lora_embeddings_b)

    def call(self, inputs, training=None):
        # `training=False` (evaluate, predict): the lookups are not counted in the tables' tallies.
        who, counted = f"Layer '{self.name}'", training is not False
        if tf.as_dtype(inputs.dtype).is_floating:
            inputs = tf.cast(inputs, tf.int32)  # as Keras: float ids (keras.Input's default dtype) are cast
        if self.combiner is not None:
            ids = padded_to_ragged(inputs, self.combiner, self.mask_zero, who)
            return self._rows(ids, self.combiner, counted)
        if isinstance(inputs, tf.SparseTensor):
            inputs = tf.sparse.to_dense(inputs)  # as Keras: a dense result, an absent entry looked up as id 0
        if isinstance(inputs, tf.RaggedTensor):  # as Keras: one row per id, ragged as the ids
            return inputs.with_flat_values(self._rows(inputs.flat_values, None, counted))
        return self._rows(inputs, None, counted)

    @property
    def _table(self) -> Optional[ShardedVariable]:
        return self._sharded_table

    def _set_table(self, table: ShardedVariable) -> None:
        # TensorFlow checkpoints keep the table under `embeddings` (Keras's name; quantized rows once quantized).
        _compat.set_untracked(self, "_sharded_table", table)
        _compat.keras_track(self, table, "embeddings")

    @property
    def _embeddings(self):
        # Keras's private name for the stored table (int8, or int4 packed two a byte, once quantized), which
        # Keras's own code and tests read as its variable's value: the whole table, read. Nothing here reads it.
        return self._table.read_value()

    def _rows(self, ids, combiner=None, training: bool = True):
        if self.quantization_mode is not None:
            return self._quantized_rows(ids, combiner)
        tables = [self._table] + ([self.lora_embeddings_a] if self.lora_enabled else [])
        # With LoRA, the table's rows and lora_embeddings_a's rows in one batched lookup; the combiners are
        # linear, so a bag's LoRA term is its combined A-rows times B.
        rows = lookup_features([FeatureLookup(t, ids, combiner, arg="inputs") for t in tables], training=training)
        out = rows[0]
        if self.lora_enabled:
            out = out + self._lora_term(rows[1])
        if self.embeddings_regularizer is not None:
            self.add_loss(self.embeddings_regularizer(out))
        return tf.cast(out, self.compute_dtype)  # mixed precision: rows kept in the variable dtype

    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"):
        """Keras's LoRA on a sharded table: the table is frozen and a low-rank update trains instead.

        `lora_embeddings_a` (`[input_dim, rank]`) is a `tfs.ShardedVariable`
        with the table's partition, looked up with the same ids (sparse
        gradients, sharded as the table); `lora_embeddings_b` (`[rank,
        output_dim]`) is one small dense weight. A row reads `table[i] +
        lora_alpha / rank * lora_embeddings_a[i] @ lora_embeddings_b`.
        Weight files hold the merged table, as Keras's; loading one resets
        the LoRA factors to zeros.

        Example:

        >>> import tf_sharded as tfs
        >>> layer = tfs.layers.Embedding(100, 8, partitions=2, seed=0)
        >>> layer.build()
        >>> layer.enable_lora(4)
        >>> [w.path.split("/")[1] for w in layer.trainable_weights]
        ['lora_embeddings_a_part_0', 'lora_embeddings_a_part_1', 'lora_embeddings_b']
        """
        if not self.built:
            raise ValueError("Cannot enable lora on a layer that isn't yet built.")
        if self.lora_enabled:
            raise ValueError("lora is already enabled. This can only be done once per layer.")
        rank = positive_int("rank", rank)
        table = self._table
        config = TableConfig(
            f"{self.name}_lora_a",
            (self.input_dim, rank),
            initializer=a_initializer,
            partitions=table.partition,
            seed=self.seed,
            exchange=self.exchange,
            placement=self.placement,
        )
        with self._build_scope(), _compat.keras_unlocked(self), _compat.keras_weights_rollback(self):
            self.lora_embeddings_a = create_layer_table(self, config, "lora_embeddings_a")
            self.lora_embeddings_b = self.add_weight(
                name="lora_embeddings_b", shape=(rank, self.output_dim), initializer=b_initializer,
                trainable=True, autocast=False,
            )  # fmt: skip
        for weight in self._table_weights(table):
            weight.trainable = False
        self.lora_enabled = True
        self.lora_rank = rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else rank

    @property
    def _form(self) -> quantized.Form:
        return quantized.Form(self.quantization_mode, self.output_dim, getattr(self, "_int4_block_size", None))

    def _quantized_tables(self) -> list:
        """The quantized rows, their scales and (grouped int4) zero points: what a lookup reads per id."""
        return [self._table, self.embeddings_scale] + ([self.embeddings_zero] if self._form.grouped else [])

    def _quantized_rows(self, ids, combiner=None):
        # Quantized rows, their scales (and zero points) for the same ids (one batched lookup), dequantized,
        # then combined: a combiner would otherwise weigh quantized values.
        flat = ids
        if combiner is not None:
            flat, row_ids, num_rows, _ = multi_hot_components(ids, "inputs")
        tables = self._quantized_tables() + ([self.lora_embeddings_a] if self.lora_enabled else [])
        rows = lookup_features([FeatureLookup(t, flat, arg="inputs") for t in tables])
        form = self._form
        out = quantized.dequantized(form, rows[0], rows[1], self.compute_dtype, zero=rows[2] if form.grouped else None)
        if self.lora_enabled:
            out = out + tf.cast(self._lora_term(rows[-1]), out.dtype)
        if combiner is not None:
            out = combine(out, tf.cast(row_ids, tf.int32), tf.cast(num_rows, tf.int32), tf.ones_like(out[:, 0]),
                          combiner)  # fmt: skip
        return out

    def quantize(self, mode=None, type_check=True, config=None):
        """Keras's `quantize`, on the shards: `"int8"` replaces the table by int8 rows and a scale per row;
        `"int4"` by int4 values packed two a byte and a scale per row, or (Keras's default from Keras 3.14,
        `block_size=128` in an `Int4QuantizationConfig`) a scale and a zero point per group of columns. All of
        them sharded as the table was (the float table is read once, whole).

        Example:

        >>> import tf_sharded as tfs
        >>> layer = tfs.layers.Embedding(100, 8, partitions=2, seed=0)
        >>> layer.build()
        >>> layer.quantize("int4")
        >>> [(w.path.split("/")[1], w.dtype, tuple(w.shape)) for w in layer.weights][:2]
        [('embeddings_part_0', 'int8', (50, 4)), ('embeddings_part_1', 'int8', (50, 4))]
        >>> layer.quantization_mode
        'int4'
        """
        if type_check and type(self) is not Embedding:
            raise self._not_implemented_error(self.quantize)
        self._check_mode(mode)
        self.quantization_config = config
        form = self._new_form(mode, config)
        self._replace_table(form, quantized.quantize_rows(self._table.numpy(), form, config))
        if self.dtype_policy.quantization_mode is None:
            self.dtype_policy = keras.dtype_policies.get(quantized.policy_name(form, self.dtype_policy.name))

    def quantized_build(self, input_shape, mode, config=None):
        """The quantized tables (rows zero, scales one) a quantized layer loads its weights into."""
        self._check_mode(mode)
        self._replace_table(self._new_form(mode, config))

    def _new_form(self, mode, config) -> quantized.Form:
        # As Keras's layer: the block size as configured (-1 kept), which the dtype policy's name repeats.
        block_size = quantized.int4_block_size(self, config) if mode == "int4" else None
        _compat.set_untracked(self, "_int4_block_size", block_size)
        return quantized.Form(mode, self.output_dim, block_size)

    def _check_mode(self, mode):
        if mode not in quantized.MODES:
            if mode in quantized.KERAS_MODES:
                raise NotImplementedError(
                    f"Layer '{self.name}': tfs.layers.Embedding quantizes to {quantized.MODES} only. "
                    f"Received: mode={mode!r}"
                )
            raise self._quantization_mode_error(mode)

    def _replace_table(self, form: quantized.Form, arrays: Optional[quantized.Quantized] = None):
        old = self._table
        partitions, scheme = (old.partition, None) if old is not None else (self.partitions, self.scheme)
        with self._build_scope(), _compat.keras_unlocked(self), _compat.keras_weights_rollback(self):
            tables = quantized.create_quantized_tables(self, form, partitions, scheme, arrays)
        table, self.embeddings_scale = tables[:2]
        if form.grouped:  # Keras's names: the zero points sharded with the rows, and each column's group
            self.embeddings_zero, self.g_idx = tables[2:]
        self._set_table(table)
        if old is not None:
            _compat.keras_untrack(self, self._table_weights(old))
        self._is_quantized = True

    def _build_scope(self):
        """The scope of the strategy the layer was built under, unless a strategy's scope is entered."""
        built_under = getattr(self, "_built_under", None)
        if built_under is None or tf.distribute.has_strategy():
            return contextlib.nullcontext()
        return built_under.scope()

    def _int8_call(self, inputs, training=None):
        return self.call(inputs, training)

    def _int4_call(self, inputs, training=None):
        return self.call(inputs, training)

    def _table_weights(self, table):
        """The layer's Keras variables that are `table`'s shards."""
        shards = {id(v) for v in table.variables}
        return [w for w in self.weights if id(w.value) in shards]

    def save_own_variables(self, store):
        # The logical table, whatever the layout, under the key keras.layers.Embedding uses: files load into
        # any other layout, and weights move between this layer and Keras's in both directions. With LoRA,
        # the merged table, as Keras's; quantized, Keras's entries: the quantized rows and the scales ("0",
        # "1"), for grouped int4 also the zero points and g_idx ("2", "3").
        if self.quantization_mode is None:
            store["0"] = np.asarray(self.embeddings.numpy())
            return
        delta = None
        if self.lora_enabled:
            delta = self._lora_scale * (self.lora_embeddings_a.numpy() @ self.lora_embeddings_b.numpy())
        quantized.save_entries(self._form, self._quantized_tables(), store, delta, self.quantization_config)

    def load_own_variables(self, store):
        tables = self._quantized_tables() if self.quantization_mode is not None else [self._table]
        for i, table in enumerate(tables):
            load_table(table, store, str(i), self.name)
        if self._form.grouped:
            self.g_idx.assign(store["3"])
        if self.lora_enabled:
            self.lora_embeddings_a.assign(np.zeros(self.lora_embeddings_a.shape, self.variable_dtype))
            self.lora_embeddings_b.assign(np.zeros(self.lora_embeddings_b.shape, self.variable_dtype))

    def compute_mask(self, inputs, mask=None):
        if not self.supports_masking:
            return None
        return keras.ops.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape):
        if self.combiner is not None:
            return (input_shape[0], self.output_dim)
        return tuple(input_shape) + (self.output_dim,)

    def compute_output_spec(self, inputs, training=None):
        ragged = bool(getattr(inputs, "ragged", False)) and self.combiner is None
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=self.compute_dtype, ragged=ragged)

    def get_config(self):
        config = super().get_config()
        partitions = self.partitions.to_config() if isinstance(self.partitions, PartitionSpec) else self.partitions
        config.update(
            {
                "input_dim": self.input_dim,
                "output_dim": self.output_dim,
                **options_config(self.embeddings_initializer, self.embeddings_regularizer),
                "mask_zero": self.mask_zero,
                "combiner": self.combiner,
                "partitions": partitions,
                "scheme": self.scheme,
                "exchange": self.exchange,
                "placement": self.placement,
                "seed": self.seed,
            }
        )
        if self.lora_rank:
            config.update({"lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha})
        config["quantization_config"] = keras.saving.serialize_keras_object(self.quantization_config)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["quantization_config"] = keras.saving.deserialize_keras_object(config.get("quantization_config"))
        try:
            return cls(**options_from_config(config))
        except (ValueError, TypeError) as error:  # as Keras's layers report a config they cannot rebuild
            raise TypeError(
                f"Error when deserializing class '{cls.__name__}' using config={config}.\n\nException encountered: "
                f"{error}"
            ) from error
