"""`tf_sharded.config`: validated, frozen table and feature configs; the option enums."""

import dataclasses

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tf_sharded.config import Combiner, Exchange, FeatureConfig, Placement, Scheme, TableConfig


class ChoiceTest(tf.test.TestCase):
    def test_values_and_parsing(self):
        self.assertEqual(Scheme.values(), ("div", "mod", "balanced"))
        self.assertEqual(Exchange.values(), ("auto", "allgather", "dense"))
        self.assertEqual(Placement.values(), ("auto", "device", "host"))
        self.assertEqual(Combiner.values(), ("sum", "mean", "sqrtn"))
        self.assertEqual(Scheme.parse("mod", "scheme"), "mod")
        self.assertEqual(Scheme.parse(Scheme.MOD, "scheme"), "mod")
        self.assertIsNone(Combiner.parse_optional(None, "combiner"))
        # The enums are strings: dict configs and enum members compare equal.
        self.assertEqual(Scheme.BALANCED, "balanced")

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
