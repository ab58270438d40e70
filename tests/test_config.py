"""`tf_sharded.config`: validated, frozen table and feature configs; the option enums."""

import dataclasses
import json

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tf_sharded.config import (
    BaseTableConfig,
    Combiner,
    DynamicTableConfig,
    Exchange,
    FeatureConfig,
    Placement,
    Scheme,
    TableConfig,
    TopologyKind,
    Vocabulary,
)


class ChoiceTest(tf.test.TestCase):
    def test_values_and_parsing(self):
        self.assertEqual(Scheme.values(), ("div", "mod", "balanced"))
        self.assertEqual(Exchange.values(), ("auto", "allgather", "dense"))
        self.assertEqual(Placement.values(), ("auto", "device", "host", "sharded"))
        self.assertEqual(Combiner.values(), ("sum", "mean", "sqrtn"))
        self.assertEqual(Scheme.parse("mod", "scheme"), "mod")
        self.assertEqual(Scheme.parse(Scheme.MOD, "scheme"), "mod")
        self.assertIsNone(Combiner.parse_optional(None, "combiner"))
        # The enums are strings: dict configs and enum members compare equal.
        self.assertEqual(Scheme.BALANCED, "balanced")
        self.assertEqual(Vocabulary.values(), ("static", "dynamic"))
        self.assertEqual(TopologyKind.values(), ("default", "parameter_server", "mirrored", "multi_worker_mirrored"))

    def test_parsed_values_are_members_that_read_as_strings(self):
        mod = Scheme.parse("mod", "scheme")
        self.assertIs(mod, Scheme.MOD)
        # Printed, formatted, hashed and serialised as the plain string, so outputs and dict lookups do not change.
        self.assertEqual((str(mod), repr(mod), f"{mod}", hash(mod)), ("mod", "'mod'", "mod", hash("mod")))
        self.assertEqual({"mod": 1}[mod], 1)
        self.assertEqual(json.dumps({"scheme": mod}), '{"scheme": "mod"}')
        self.assertEqual(repr(TableConfig("t", [4, 2], scheme="mod").scheme), "'mod'")

    def test_bad_values_name_the_argument(self):
        with self.assertRaisesRegex(
            ValueError, r"Argument `exchange` must be one of \('auto', 'allgather', 'dense'\). Received: exchange='all'"
        ):
            Exchange.parse("all", "exchange")
        with self.assertRaisesRegex(ValueError, "Argument `x` must be one of .* Received: x=3"):
            Placement.parse(3, "x")


class TableConfigTest(tf.test.TestCase):
    def test_normalised_and_frozen(self):
        config = TableConfig("t", [10, np.int64(4)], "float16", scheme="mod", exchange="dense", seed=np.int32(3))
        self.assertEqual(config.shape, (10, 4))
        self.assertEqual(config.dtype, tf.float16)
        self.assertEqual((config.scheme, config.exchange), (Scheme.MOD, Exchange.DENSE))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            config.shape = (3, 3)
        self.assertEqual(dataclasses.replace(config, seed=9).seed, 9)

    def test_mirrored_only_arguments(self):
        self.assertEqual(TableConfig("t", [4, 2]).mirrored_only, {})
        self.assertEqual(TableConfig("t", [4, 2], exchange="auto", placement="auto").mirrored_only, {})
        self.assertEqual(
            TableConfig("t", [4, 2], exchange="dense", ids_per_step=8).mirrored_only,
            {"exchange": "dense", "ids_per_step": 8},
        )

    def test_bad_arguments(self):
        cases = [
            (ValueError, "Argument `name` must be a non-empty string", dict(name="", shape=[2, 2])),
            (ValueError, "Argument `shape` must be a fully defined shape", dict(name="t", shape=[None, 2])),
            (ValueError, "Argument `shape` must have rank >= 1 and positive dimensions", dict(name="t", shape=[0, 2])),
            (TypeError, "Argument `dtype` must be a TensorFlow dtype", dict(name="t", shape=[2], dtype="float99")),
            (TypeError, "Argument `trainable` must be a bool", dict(name="t", shape=[2], trainable=1)),
            (TypeError, "Argument `seed` must be an int or None", dict(name="t", shape=[2], seed=1.5)),
            (ValueError, "Argument `scheme` must be one of", dict(name="t", shape=[2], scheme="range")),
            (ValueError, "Argument `placement` must be one of", dict(name="t", shape=[2], placement="gpu")),
            (ValueError, "Argument `ids_per_step` must be a positive int", dict(name="t", shape=[2], ids_per_step=0)),
        ]
        for error, message, kwargs in cases:
            with self.assertRaisesRegex(error, message, msg=str(kwargs)):
                TableConfig(**kwargs)

    def test_layer_config_round_trip(self):
        layer_config = {"input_dim": 30, "output_dim": 4, "partitions": 3, "scheme": "mod", "seed": 1}
        config = TableConfig.from_layer_config("user", layer_config)
        self.assertEqual((config.name, config.shape, config.partitions, config.seed), ("user", (30, 4), 3, 1))
        self.assertEqual(config.to_layer_config(), layer_config)
        self.assertIs(TableConfig.from_layer_config("user", config), config)
        with self.assertRaisesRegex(ValueError, r"Argument `tables\['u'\]` must be a dict with 'input_dim'"):
            TableConfig.from_layer_config("u", {"output_dim": 4})
        with self.assertRaisesRegex(ValueError, r"Argument `tables\['u'\]` has unknown keys \['rows'\]"):
            TableConfig.from_layer_config("u", {"input_dim": 3, "output_dim": 4, "rows": 3})
        with self.assertRaisesRegex(ValueError, r"Argument `tables\['u'\]\['input_dim'\]` must be a positive int"):
            TableConfig.from_layer_config("u", {"input_dim": -3, "output_dim": 4})

    def test_collection_accepts_configs_and_dicts_alike(self):
        tables = {"a": TableConfig("a", (9, 2), seed=4, partitions=2), "b": {"input_dim": 9, "output_dim": 2}}
        features = {"x": "a", "y": FeatureConfig("b", combiner="sum"), "z": {"table": "a", "combiner": Combiner.MEAN}}
        layer = tfs.layers.EmbeddingCollection(tables, features)
        out = layer({"x": tf.constant([1, 2]), "y": tf.constant([[1, 2], [3, -1]]), "z": tf.constant([[4, 4], [5, 6]])})
        a, b = layer.tables["a"].numpy(), layer.tables["b"].numpy()
        self.assertEqual(layer.tables["a"].num_shards, 2)
        self.assertAllClose(out["x"], a[[1, 2]])
        self.assertAllClose(out["y"], [b[1] + b[2], b[3]])
        self.assertAllClose(out["z"], [a[4], (a[5] + a[6]) / 2])


class TableConfigFamilyTest(tf.test.TestCase):
    def test_both_kinds_share_the_base_fields(self):
        shared = [f.name for f in dataclasses.fields(BaseTableConfig)]
        self.assertEqual(shared, ["name", "dim", "dtype", "initializer", "partitions", "seed", "exchange", "placement"])
        static = TableConfig("items", [100, 8], "float16", "zeros", 2, seed=3)
        dynamic = DynamicTableConfig("users", 8, dtype="float16", initializer="zeros", partitions=2, seed=3)
        for config in (static, dynamic):
            self.assertIsInstance(config, BaseTableConfig)
            self.assertEqual([f.name for f in dataclasses.fields(config)][: len(shared)], shared)
            values = {name: getattr(config, name) for name in shared if name != "name"}
            expected = dict(dim=8, dtype=tf.float16, initializer="zeros", partitions=2, seed=3, exchange=None)
            self.assertEqual(values, dict(expected, placement=None))
        self.assertEqual((static.vocabulary, static.rows), (Vocabulary.STATIC, 100))
        self.assertEqual((dynamic.vocabulary, dynamic.rows, dynamic.shape), (Vocabulary.DYNAMIC, None, (None, 8)))
        # `dim` follows `shape` (elements per row) and is not an argument of its own.
        self.assertEqual(dataclasses.replace(static, shape=(5, 2, 3)).dim, 6)
        self.assertEqual(TableConfig("t", [7]).dim, 1)
        with self.assertRaisesRegex(TypeError, "Please make a TableConfig or a DynamicTableConfig"):
            BaseTableConfig("t", 4)

    def test_table_config_keeps_create_sharded_variables_argument_order(self):
        config = TableConfig("t", [4, 2], tf.float64, "zeros", 2, False, scheme=Scheme.MOD, ids_per_step=8)
        names = ("dtype", "initializer", "partitions", "trainable", "scheme", "ids_per_step")
        self.assertEqual([getattr(config, n) for n in names], [tf.float64, "zeros", 2, False, "mod", 8])
        self.assertIsInstance(config.scheme, Scheme)

    def test_layer_config_round_trip_for_both_kinds(self):
        static = {"input_dim": 30, "output_dim": 4, "embeddings_initializer": "zeros", "partitions": 3, "seed": 1,
                  "exchange": "dense", "placement": "host", "scheme": "mod"}  # fmt: skip
        dynamic = {"vocabulary": "dynamic", "output_dim": 4, "embeddings_initializer": "zeros", "partitions": 2,
                   "seed": 1, "key_dtype": "string", "max_rows": 50}  # fmt: skip
        for layer_config, kind in ((static, TableConfig), (dynamic, DynamicTableConfig)):
            for reader in (BaseTableConfig, TableConfig, kind):
                config = reader.from_layer_config("t", layer_config)
                self.assertIsInstance(config, kind)
                self.assertEqual(config.to_layer_config(), layer_config)
                self.assertEqual(reader.from_layer_config("t", config.to_layer_config()), config)
        # Without "vocabulary", each kind reads its own; the base reads a static table.
        self.assertIsInstance(DynamicTableConfig.from_layer_config("t", {"output_dim": 4}), DynamicTableConfig)
        self.assertIsInstance(BaseTableConfig.from_layer_config("t", {"input_dim": 3, "output_dim": 4}), TableConfig)
        self.assertEqual(TableConfig("t", [3, 4]).to_layer_config(), {"input_dim": 3, "output_dim": 4})
        with self.assertRaisesRegex(ValueError, r"Table 't' of shape \(3, 4, 2\) has no EmbeddingCollection"):
            TableConfig("t", [3, 4, 2]).to_layer_config()

    def test_layer_dict_errors_name_the_key(self):
        cases = [
            ({"vocabulary": "open", "output_dim": 2}, ValueError,
             r"Argument `tables\['u'\]\['vocabulary'\]` must be 'static' \(ids in \[0, input_dim\)\) or 'dynamic' "
             r"\(raw keys\). Received: tables\['u'\]\['vocabulary'\]='open'"),
            ({"vocabulary": 3, "output_dim": 2}, ValueError, r"`tables\['u'\]\['vocabulary'\]` must be 'static'"),
            ({"vocabulary": "dynamic"}, ValueError, r"Argument `tables\['u'\]` must be a dict with 'output_dim'"),
            ({"vocabulary": "dynamic", "output_dim": 2, "scheme": "mod"}, ValueError,
             r"Argument `tables\['u'\]` has unknown keys \['scheme'\] for a dynamic table"),
            ({"vocabulary": "dynamic", "output_dim": 2, "max_rows": 0}, ValueError,
             r"Argument `tables\['u'\]\['max_rows'\]` must be a positive int or None. "
             r"Received: tables\['u'\]\['max_rows'\]=0"),
            ({"vocabulary": "dynamic", "output_dim": 2, "key_dtype": "int32"}, TypeError,
             r"Argument `tables\['u'\]\['key_dtype'\]` must be 'int64' or 'string'"),
            ({"input_dim": 3, "output_dim": 2, "scheme": "zigzag"}, ValueError,
             r"Argument `tables\['u'\]\['scheme'\]` must be one of .* Received: tables\['u'\]\['scheme'\]='zigzag'"),
            ({"input_dim": 3, "output_dim": 2.5}, ValueError,
             r"Argument `tables\['u'\]\['output_dim'\]` must be a positive"),
            ("3x2", ValueError, r"Argument `tables\['u'\]` must be a dict with 'input_dim' and 'output_dim'"),
        ]  # fmt: skip
        for layer_config, error, message in cases:
            with self.assertRaisesRegex(error, message, msg=str(layer_config)):
                BaseTableConfig.from_layer_config("u", layer_config)

    def test_dynamic_tables_refuse_what_the_strategy_decides(self):
        for arg, value in (("exchange", "dense"), ("placement", "host"), ("exchange", "auto")):
            with self.assertRaisesRegex(
                ValueError, f"Argument `{arg}` does not apply to a dynamic table.*Received: {arg}='{value}'"
            ):
                DynamicTableConfig("u", 4, **{arg: value})
            with self.assertRaisesRegex(ValueError, rf"Argument `tables\['u'\]\['{arg}'\]` does not apply"):
                DynamicTableConfig.from_layer_config("u", {"output_dim": 4, arg: value})
        with self.assertRaisesRegex(ValueError, "Argument `placement` must be one of"):
            DynamicTableConfig("u", 4, placement="gpu")
        # A shard per worker under MultiWorkerMirroredStrategy is the one placement a dynamic table takes.
        self.assertEqual(DynamicTableConfig("u", 4, placement="sharded").placement, "sharded")
        self.assertEqual(DynamicTableConfig.from_layer_config("u", {"output_dim": 4, "placement": "sharded"}).placement,
                         "sharded")  # fmt: skip
        with self.assertRaisesRegex(ValueError, "Argument `dim` must be a positive integer"):
            DynamicTableConfig("u", 0)


class FeatureConfigTest(tf.test.TestCase):
    def test_parse_forms(self):
        tables = {"items": None}
        self.assertEqual(FeatureConfig.parse("f", "items", tables), FeatureConfig("items"))
        self.assertEqual(FeatureConfig.parse("f", {"table": "items", "combiner": "mean"}, tables).combiner, "mean")
        self.assertEqual(FeatureConfig("items", "sqrtn").to_config(), {"table": "items", "combiner": "sqrtn"})

    def test_bad_features_name_the_feature(self):
        tables = {"items": None}
        with self.assertRaisesRegex(ValueError, r"Argument `features\['f'\]` must name one of the tables \['items'\]"):
            FeatureConfig.parse("f", "users", tables)
        with self.assertRaisesRegex(ValueError, r"Argument `features\['f'\]\['combiner'\]` must be None or one of"):
            FeatureConfig.parse("f", {"table": "items", "combiner": "max"}, tables)
        with self.assertRaisesRegex(ValueError, r"Argument `features\['f'\]` has unknown keys \['weights'\]"):
            FeatureConfig.parse("f", {"table": "items", "weights": 1}, tables)
        with self.assertRaisesRegex(ValueError, r"Argument `features\['f'\]` must be a table name, a dict"):
            FeatureConfig.parse("f", 3, tables)
        with self.assertRaisesRegex(ValueError, "Argument `table` must be a table name"):
            FeatureConfig("")
