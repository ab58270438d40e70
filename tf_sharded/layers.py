"""Keras 3 layers backed by sharded tables.

`Embedding` takes the arguments of `keras.layers.Embedding` and creates its
table through the current strategy's `create_sharded_variable` hook, so the
same model code shards under `ParameterServerStrategy` and mirrors under the
mirrored strategies. Its shards are Keras variables owned by the layer (what
Keras 3 trains, saves and counts), while lookups go straight to the shards
and never concatenate the table.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_sharded import _compat, creation
from tf_sharded.errors import positive_int
from tf_sharded.lookup import COMBINERS, _components, combine, embedding_lookup, embedding_lookup_sparse, lookup_many
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
        with _compat.outside_keras_stateless_scope():
            self.embeddings = creation._create(
                tf.distribute.get_strategy(), arguments, variable_factory=_weight_factory(self, "embeddings")
            )
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
            ids = _multi_hot(inputs, self.combiner, self.mask_zero, f"Layer '{self.name}'")
            out = embedding_lookup_sparse(table, ids, combiner=self.combiner)
            rows = out
        if self.embeddings_regularizer is not None:
            self.add_loss(self.embeddings_regularizer(rows))
        return out

    def save_own_variables(self, store):
        # The logical table, whatever the layout, under the key keras.layers.Embedding uses: files load into
        # any other layout, and weights move between this layer and Keras's in both directions.
        store["0"] = self.embeddings.numpy()

    def load_own_variables(self, store):
        _load_table(self.embeddings, store, "0", self.name)

    def compute_mask(self, inputs, mask=None):
        if not self.supports_masking:
            return None
        return keras.ops.not_equal(inputs, 0)

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


_TABLE_KEYS = (
    "input_dim",
    "output_dim",
    "embeddings_initializer",
    "partitions",
    "scheme",
    "exchange",
    "placement",
    "seed",
)


@keras.saving.register_keras_serializable(package="tf_sharded")
class EmbeddingCollection(keras.layers.Layer):
    """Many features over many sharded tables, looked up together: one fused request per shard holder.

    Tables are declared by config; features name the table they read (several
    features may share one) and optionally a combiner for multi-hot input.
    Per step, each table's ids from all its features are de-duplicated once,
    and the requests of every table to one device (a parameter server, or a
    replica's device) travel as one tensor of ids and come back as one tensor
    of rows: the counterpart of a grouped embedding-bag collection.

    Args:
      tables: `{table name: {"input_dim": int, "output_dim": int, and
        optionally "embeddings_initializer", "partitions", "scheme",
        "exchange", "placement", "seed"}}`.
      features: `{feature name: table name}` or `{feature name: {"table":
        table name, "combiner": None | "sum" | "mean" | "sqrtn"}}`.
      **kwargs: standard layer arguments.

    Call it on a dict `{feature name: ids}` (every declared feature); it
    returns `{feature name: embeddings}`: `ids.shape + [dim]` without a
    combiner, `[batch, dim]` with one (multi-hot ids as `tf.RaggedTensor`,
    `tf.SparseTensor` or padded dense ids, negative = padding).

    Example:

    >>> import tf_sharded as tfs
    >>> layer = tfs.layers.EmbeddingCollection(
    ...     tables={"user": {"input_dim": 100, "output_dim": 4, "seed": 0},
    ...             "item": {"input_dim": 50, "output_dim": 4, "partitions": 2, "seed": 1}},
    ...     features={"user_id": "user", "clicked": {"table": "item", "combiner": "mean"},
    ...               "candidate": "item"})
    >>> out = layer({"user_id": tf.constant([3, 7]), "candidate": tf.constant([1, 2]),
    ...              "clicked": tf.ragged.constant([[1, 2, 3], [4]])})
    >>> {name: tuple(value.shape) for name, value in sorted(out.items())}
    {'candidate': (2, 4), 'clicked': (2, 4), 'user_id': (2, 4)}
    """

    def __init__(self, tables: dict, features: dict, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(tables, dict) or not tables:
            raise ValueError(f"Argument `tables` must be a non-empty dict of table configs. Received: {tables!r}")
        self.table_configs = {}
        for name, config in tables.items():
            if not isinstance(config, dict) or "input_dim" not in config or "output_dim" not in config:
                raise ValueError(
                    f"Argument `tables['{name}']` must be a dict with 'input_dim' and 'output_dim'. "
                    f"Received: {config!r}"
                )
            unknown = sorted(set(config) - set(_TABLE_KEYS))
            if unknown:
                raise ValueError(f"Argument `tables['{name}']` has unknown keys {unknown}; allowed: {_TABLE_KEYS}")
            positive_int(f"tables['{name}']['input_dim']", config["input_dim"])
            positive_int(f"tables['{name}']['output_dim']", config["output_dim"])
            self.table_configs[name] = dict(config)
        if not isinstance(features, dict) or not features:
            raise ValueError(f"Argument `features` must be a non-empty dict. Received: {features!r}")
        self.feature_configs = {}
        for feature, spec in features.items():
            spec = {"table": spec} if isinstance(spec, str) else dict(spec)
            if spec.get("table") not in self.table_configs:
                raise ValueError(
                    f"Argument `features['{feature}']` must name one of the tables {sorted(self.table_configs)}. "
                    f"Received: {spec.get('table')!r}"
                )
            if spec.get("combiner") not in (None,) + COMBINERS:
                raise ValueError(
                    f"Argument `features['{feature}']['combiner']` must be None or one of {COMBINERS}. "
                    f"Received: {spec.get('combiner')!r}"
                )
            self.feature_configs[feature] = {"table": spec["table"], "combiner": spec.get("combiner")}
        self.tables: dict = {}

    def build(self, input_shape=None):
        if self.built:
            return
        for name, config in self.table_configs.items():
            initializer = config.get("embeddings_initializer", "uniform")
            if isinstance(initializer, dict):
                initializer = keras.initializers.deserialize(initializer)
            elif isinstance(initializer, str) and not _is_tfs_name(initializer):
                initializer = keras.initializers.get(initializer)
            arguments = dict(
                name=f"{self.name}/{name}",
                shape=[config["input_dim"], config["output_dim"]],
                dtype=self.variable_dtype,
                initializer=initializer,
                partitions=config.get("partitions"),
                trainable=self.trainable,
                scheme=config.get("scheme"),
                seed=config.get("seed"),
                exchange=config.get("exchange"),
                placement=config.get("placement"),
            )
            with _compat.outside_keras_stateless_scope():
                self.tables[name] = creation._create(
                    tf.distribute.get_strategy(), arguments, variable_factory=_weight_factory(self, name)
                )
            # Keras wraps `self.tables` in its own container, which TensorFlow checkpoints do not follow.
            self._track_trackable(self.tables[name], name=f"tables_{name}", overwrite=True)
        self.built = True

    def call(self, inputs):
        if not isinstance(inputs, dict) or set(inputs) != set(self.feature_configs):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(
                f"Layer '{self.name}' needs a dict with exactly the features {sorted(self.feature_configs)}. "
                f"Received: {got}"
            )
        # Per feature: its flat ids, and how to shape or combine the rows.
        flat, how = {}, {}
        for feature, spec in self.feature_configs.items():
            table = self.tables[spec["table"]]
            ids = inputs[feature]
            if spec["combiner"] is None:
                if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
                    raise ValueError(
                        f"Feature '{feature}' of layer '{self.name}' received multi-hot input "
                        f"({type(ids).__name__}) but has no combiner."
                    )
                ids64, flat[feature] = table._check(ids, arg=f"inputs['{feature}']")
                how[feature] = ("reshape", ids64)
            else:
                ids = _multi_hot(ids, spec["combiner"], False, f"Feature '{feature}' of layer '{self.name}'")
                values, row_ids, num_rows, _ = _components(ids, f"inputs['{feature}']")
                _, flat[feature] = table._check(values, arg=f"inputs['{feature}']", max_rank=1)
                how[feature] = ("combine", (tf.cast(row_ids, tf.int32), tf.cast(num_rows, tf.int32)))
        # One lookup per table over all of its features, fused across tables per device.
        by_table = {}
        for feature, spec in self.feature_configs.items():
            by_table.setdefault(spec["table"], []).append(feature)
        names = list(by_table)
        rows = lookup_many([(self.tables[n], tf.concat([flat[f] for f in by_table[n]], 0)) for n in names])
        out = {}
        for name, table_rows in zip(names, rows):
            sizes = [tf.size(flat[f]) for f in by_table[name]]
            pieces = tf.split(table_rows, tf.stack(sizes), num=len(sizes)) if len(sizes) > 1 else [table_rows]
            dim = self.table_configs[name]["output_dim"]
            for feature, piece in zip(by_table[name], pieces):
                kind, arg = how[feature]
                if kind == "reshape":
                    out[feature] = tf.reshape(piece, tf.concat([tf.shape(arg), [dim]], 0))
                    if arg.shape.rank is not None:
                        out[feature].set_shape(arg.shape.concatenate([dim]))
                else:
                    weights = tf.ones([tf.shape(piece)[0]], piece.dtype)
                    out[feature] = combine(piece, arg[0], arg[1], weights, self.feature_configs[feature]["combiner"])
        return out

    def compute_output_shape(self, input_shape):
        shapes = {}
        for feature, spec in self.feature_configs.items():
            dim = self.table_configs[spec["table"]]["output_dim"]
            shape = tuple(input_shape[feature]) if isinstance(input_shape, dict) else (None,)
            shapes[feature] = (shape[0], dim) if spec["combiner"] else shape + (dim,)
        return shapes

    def save_own_variables(self, store):
        for name, table in self.tables.items():
            store[name] = table.numpy()

    def load_own_variables(self, store):
        for name, table in self.tables.items():
            _load_table(table, store, name, self.name)

    def get_config(self):
        config = super().get_config()
        tables = {}
        for name, table_config in self.table_configs.items():
            table_config = dict(table_config)
            init = table_config.get("embeddings_initializer")
            if init is not None and not isinstance(init, (str, dict)):
                table_config["embeddings_initializer"] = keras.initializers.serialize(init)
            if isinstance(table_config.get("partitions"), PartitionSpec):
                table_config["partitions"] = table_config["partitions"].to_config()
            tables[name] = table_config
        config.update({"tables": tables, "features": {f: dict(s) for f, s in self.feature_configs.items()}})
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for table_config in config["tables"].values():
            if isinstance(table_config.get("partitions"), dict):
                table_config["partitions"] = PartitionSpec.from_config(table_config["partitions"])
        return cls(**config)


def _weight_factory(layer: keras.layers.Layer, prefix: str):
    """Shards created as the layer's own Keras variables, so Keras trains, counts and saves them."""

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


def _multi_hot(ids, combiner: str, mask_zero: bool, who: str):
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
    if (
        not isinstance(model, keras.Model)
        or not isinstance(model, (keras.Sequential,))
        and not getattr(model, "_is_graph_network", hasattr(model, "_operations") and hasattr(model, "_inputs_struct"))
    ):
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
    ('tf_sharded.layers', TensorShape([1, 3]))
    >>> type(keras.layers.Embedding(10, 3)).__module__
    'keras.src.layers.core.embedding'
    """
    import importlib

    names = inspect.signature(_KERAS_EMBEDDING.__init__).parameters

    def make(*args, **kwargs):
        positional = [n for n in names if n not in ("self", "kwargs")]
        return _from_keras_arguments({**dict(zip(positional, args)), **kwargs}, options)

    modules = [keras.layers]
    try:
        modules.append(importlib.import_module("keras._tf_keras.keras.layers"))  # tf.keras
    except ImportError:
        pass
    saved = [(m, m.Embedding) for m in modules]
    for m in modules:
        m.Embedding = make
    try:
        yield
    finally:
        for m, original in saved:
            m.Embedding = original
