"""`tfs.layers.EmbeddingCollection`: many features over many sharded tables, looked up together."""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.config import BaseTableConfig, DynamicTableConfig, FeatureConfig
from tf_sharded.keras.layer_tables import (
    create_layer_dynamic_group,
    create_layer_dynamic_table,
    create_layer_group,
    create_layer_table,
    dense_keys_to_ragged,
    padded_to_ragged,
    refuse_multi_hot,
)
from tf_sharded.layout import PartitionSpec
from tf_sharded.planning.plans import Plan
from tf_sharded.policies import deserialize_policies, serialize_policies
from tf_sharded.table import registry
from tf_sharded.table.batched import storage_runs
from tf_sharded.table.lookup import FeatureLookup, lookup_features


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
        "exchange", "placement", "seed"}}`, or `{table name:
        tfs.TableConfig or tfs.DynamicTableConfig}`. A table with `"vocabulary": "dynamic"` is a
        `tfs.DynamicTable` over raw keys: `{"vocabulary": "dynamic",
        "output_dim": int, and optionally "key_dtype" ("int64" / "string"),
        "embeddings_initializer", "partitions", "seed", "admission",
        "eviction", "max_rows"}`; its features take raw keys (multi-hot as
        ragged or sparse; dense `[batch, n]` keys are all counted).
      features: `{feature name: table name}`, `{feature name: {"table":
        table name, "combiner": None | "sum" | "mean" | "sqrtn"}}`, or
        `{feature name: tfs.FeatureConfig}`.
      partitions: the default `partitions` of every table that does not set
        its own; an int is capped at each table's rows (a 2-row table gets
        2 shards of a default of 8).
      scheme: the default `scheme` of every table that does not set its own.
      batch_tables: under parameter servers (and for tables sharded over a
        mirrored strategy's replicas), store consecutive tables of one
        dtype and row shape together, one variable per ps (or replica) for
        all of them (table-batched storage: one gather and one update per
        ps and step instead of one per shard). Each table keeps its own layout,
        checkpoint key, weight-file entry and export; `layer.weights` are
        the storage variables. Consecutive dynamic tables of one
        `output_dim`, shard count and key dtype, without `max_rows` or a
        `CapacityEviction`, likewise share one row pool per ps (each keeps
        its own keys, policies and checkpoint entry). Other strategies
        ignore it.
      plan: optional `tfs.plan(...)` result (or its `to_config()`) for these
        tables: each table gets the plan's shards, scheme, placement and
        exchange when the layer is built under the strategy the plan was made
        for (under the default strategy, e.g. loading the model to serve it,
        only its shards and scheme); under another strategy building fails.
      **kwargs: standard layer arguments.

    After the layer is built, `collection.tables[name]` is table `name` (a
    `tfs.ShardedVariable` or the strategy's table) for reading, checkpoints
    or `optimizer.table_slot(...)`.

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

    def __init__(
        self, tables: dict, features: dict, partitions=None, scheme=None, batch_tables: bool = True, plan=None, **kwargs
    ):
        super().__init__(**kwargs)
        if not isinstance(batch_tables, bool):
            raise TypeError(f"Argument `batch_tables` must be a bool. Received: batch_tables={batch_tables!r}")
        self.batch_tables = batch_tables
        if not isinstance(tables, dict) or not tables:
            raise ValueError(f"Argument `tables` must be a non-empty dict of table configs. Received: {tables!r}")
        if not isinstance(features, dict) or not features:
            raise ValueError(f"Argument `features` must be a non-empty dict. Received: {features!r}")
        if partitions is not None and not isinstance(partitions, (int, PartitionSpec)) or isinstance(partitions, bool):
            raise ValueError(
                f"Argument `partitions` must be None, a positive int or a tfs.PartitionSpec. Received: {partitions!r}"
            )
        self.partitions, self.scheme = partitions, scheme
        self.table_configs = {
            name: self._with_defaults(BaseTableConfig.from_layer_config(name, config))
            for name, config in tables.items()
        }
        self.feature_configs = {
            feature: FeatureConfig.parse(feature, spec, self.table_configs) for feature, spec in features.items()
        }
        self.plan = None if plan is None else Plan.from_config(plan)
        if self.plan is not None:
            self.plan.configs(self.table_configs, f"layer '{self.name}'")  # the plan is for these tables
        self.tables: dict = {}

    def _with_defaults(self, config):
        """`config` with the collection's `partitions` / `scheme` where it sets none (validated, naming the
        table); a table without static rows (dynamic) takes neither (its shards follow the strategy)."""
        if not registry.kind_of_config(config).static_rows:
            return config
        changes = {}
        if config.partitions is None and self.partitions is not None:
            p = self.partitions
            changes["partitions"] = min(p, config.shape[0]) if isinstance(p, int) and p > 0 else p
        if config.scheme is None and self.scheme is not None:
            changes["scheme"] = self.scheme
        if not changes:
            return config
        try:
            return dataclasses.replace(config, **changes)
        except (ValueError, TypeError) as e:
            kind = ValueError if isinstance(e, ValueError) else TypeError
            raise kind(f"Table '{config.name}' of layer '{self.name}' (collection defaults {changes}): {e}") from None

    def build(self, input_shape=None):
        if self.built:
            return
        created = {}
        configs = self._planned_configs()
        # All or nothing: a table that fails takes the weights of the tables made before it off the layer.
        with _compat.keras_weights_rollback(self):
            for names in self._storage_groups():
                if len(names) > 1 and self._create_group(names, created, configs):
                    continue
                for name in names:
                    config = configs[name]
                    with self._naming(name):
                        if registry.kind_of_config(config).static_rows:
                            config = dataclasses.replace(config, name=f"{self.name}/{name}")
                            created[name] = create_layer_table(self, config, name)
                        else:
                            created[name] = self._create_dynamic(name, config)
        for name, table in created.items():
            self.tables[name] = table
            # Keras wraps `self.tables` in its own container, which TensorFlow checkpoints do not follow.
            _compat.keras_track(self, table, f"tables_{name}")
        self.built = True

    @contextlib.contextmanager
    def _naming(self, name: str):
        try:
            yield
        except (ValueError, TypeError) as e:
            kind = ValueError if isinstance(e, ValueError) else TypeError
            raise kind(f"Table '{name}' of layer '{self.name}': {e}") from None

    def _storage_groups(self) -> list:
        """The tables in order, cut into the runs that are stored together where the strategy batches tables."""
        return storage_runs(self.table_configs, self.batch_tables)

    def _planned_configs(self) -> dict:
        """The table configs with the plan's arguments, for the strategy the layer is built under: all of them
        under the plan's kind of strategy, the layout alone under the default one (a saved model loaded to
        evaluate or serve)."""
        if self.plan is None:
            return self.table_configs
        who = f"layer '{self.name}'"
        layout_only = not self.plan.applies_to(tf.distribute.get_strategy(), who)
        return self.plan.configs(self.table_configs, who, layout_only)

    def _create_group(self, names, created, configs) -> bool:
        """Creates the tables `names` in one storage (dynamic ones: sharing row pools); False where the
        strategy does not batch tables."""
        group, prefix = f"{self.name}/batched_{names[0]}", f"batched_{names[0]}"
        with self._naming(", ".join(names)):
            if registry.kind_of_config(configs[names[0]]).static_rows:
                statics = [dataclasses.replace(configs[n], name=f"{self.name}/{n}") for n in names]
                tables = create_layer_group(self, statics, group, prefix)
            else:
                specs = [dict(self._dynamic_options(configs[n]), name=f"{self.name}/{n}") for n in names]
                tables = create_layer_dynamic_group(self, specs, group, prefix)
        if tables is None:
            return False
        created.update(zip(names, tables))
        return True

    @staticmethod
    def _dynamic_options(config: DynamicTableConfig) -> dict:
        """`create_dynamic_table`'s arguments for `config`, its name and `max_rows` aside."""
        keys = ("dim", "key_dtype", "initializer", "partitions", "seed", "admission", "eviction")
        options = {k: getattr(config, k) for k in keys}
        if config.placement is not None:
            options["placement"] = str(config.placement)
        return options

    def _create_dynamic(self, name: str, config: DynamicTableConfig):
        options = self._dynamic_options(config)
        dim = options.pop("dim")
        return create_layer_dynamic_table(self, f"{self.name}/{name}", dim, name, max_rows=config.max_rows, **options)

    def call(self, inputs, training=None):
        if not isinstance(inputs, dict) or set(inputs) != set(self.feature_configs):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(
                f"Layer '{self.name}' needs a dict with exactly the features {sorted(self.feature_configs)}. "
                f"Received: {got}"
            )
        requests = []
        for feature, spec in self.feature_configs.items():
            ids, who = inputs[feature], f"Feature '{feature}' of layer '{self.name}'"
            table = self.tables[spec.table]
            if spec.combiner is None:
                refuse_multi_hot(ids, who)
            elif table.kind.static_rows:  # ids outside [0, rows) pad
                ids = padded_to_ragged(ids, spec.combiner, False, who)
            else:  # any key is one
                ids = dense_keys_to_ragged(table, ids)
            requests.append(FeatureLookup(table, ids, spec.combiner, arg=f"inputs['{feature}']"))
        # `training` matters to dynamic tables only: a training call gives unseen keys a row.
        return dict(zip(self.feature_configs, lookup_features(requests, training=training is not False)))

    def compute_output_shape(self, input_shape):
        shapes = {}
        for feature, spec in self.feature_configs.items():
            dim = self.table_configs[spec.table].shape[1]
            shape = tuple(input_shape[feature]) if isinstance(input_shape, dict) else (None,)
            shapes[feature] = (shape[0], dim) if spec.combiner else shape + (dim,)
        return shapes

    def save_own_variables(self, store):
        for name, table in self.tables.items():
            table.kind.save_weights(table, store, name)

    def load_own_variables(self, store):
        for name, table in self.tables.items():
            table.kind.load_weights(table, store, name, self.name)

    def get_config(self):
        config = super().get_config()
        tables = {}
        for name, table_config in self.table_configs.items():
            table_config = table_config.to_layer_config()
            for policy in ("admission", "eviction"):
                if table_config.get(policy) is not None:
                    table_config[policy] = serialize_policies(table_config[policy])
            init = table_config.get("embeddings_initializer")
            if init is not None and not isinstance(init, (str, dict)):
                table_config["embeddings_initializer"] = keras.initializers.serialize(init)
            if isinstance(table_config.get("partitions"), PartitionSpec):
                table_config["partitions"] = table_config["partitions"].to_config()
            tables[name] = table_config
        config.update({"tables": tables, "features": {f: s.to_config() for f, s in self.feature_configs.items()}})
        partitions = self.partitions.to_config() if isinstance(self.partitions, PartitionSpec) else self.partitions
        config.update({"partitions": partitions, "scheme": self.scheme, "batch_tables": self.batch_tables})
        config["plan"] = None if self.plan is None else self.plan.to_config()
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for table_config in config["tables"].values():
            for policy in ("admission", "eviction"):
                if table_config.get(policy) is not None:
                    table_config[policy] = deserialize_policies(table_config[policy])
            if isinstance(table_config.get("partitions"), dict):
                table_config["partitions"] = PartitionSpec.from_config(table_config["partitions"])
        if isinstance(config.get("partitions"), dict):
            config["partitions"] = PartitionSpec.from_config(config["partitions"])
        return cls(**config)
