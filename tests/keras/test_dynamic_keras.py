"""`tfs.layers.DynamicEmbedding` under the default strategy: model.fit and tfs.fit against plain Keras, files."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.models import (
    IDS,
    LABELS,
    RAW_KEYS,
    assert_matches_dynamic_reference,
    dynamic_reference,
    make_dynamic_model,
)
from tests.table.dynamic.test_dynamic import by_key


def string_model(seed=3):
    inp = keras.Input((None,), dtype="string", ragged=True, name="tag_keys")
    x = tfs.layers.DynamicEmbedding(4, key_dtype="string", combiner="sum", partitions=3, seed=seed, name="tags")(inp)
    out = keras.layers.Dense(1, name="dense")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=tfs.optimizers.Adagrad(0.2), loss="mse")
    return model


def tags_data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    words = [f"tag-{i}" for i in range(40)]
    tags = tf.ragged.constant([list(rng.choice(words, rng.integers(1, 5))) for _ in range(n)])
    labels = rng.normal(size=(n, 1)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((tags, labels)).batch(16)


class DynamicEmbeddingTest(tf.test.TestCase):
    def test_fit_on_raw_keys_matches_keras_embedding_on_ids(self):
        model = make_dynamic_model(partitions=2)
        steps = 5
        history = model.fit(RAW_KEYS[IDS], LABELS, batch_size=len(IDS), epochs=steps, shuffle=False, verbose=0)
        self.assertLess(history.history["loss"][-1], history.history["loss"][0])
        assert_matches_dynamic_reference(self, model, steps)

    def test_tfs_fit_trains_weights_keras_sees(self):
        model = make_dynamic_model()
        layer = model.get_layer("emb")
        self.assertEqual([w.value for w in layer.trainable_weights], list(layer.table.variables))
        data = tf.data.Dataset.from_tensors((RAW_KEYS[IDS], LABELS)).repeat(4)
        tfs.fit(model, data, epochs=1, verbose=0)
        expected, _ = dynamic_reference(model, 4)
        rows = by_key(layer.table)
        for key, row in expected.items():
            self.assertAllClose(rows[key], row, atol=1e-5)

    def test_predict_and_evaluate_store_no_keys(self):
        model = make_dynamic_model()
        unseen = RAW_KEYS[IDS] + 1
        first = model.predict(unseen, verbose=0)
        model.evaluate(unseen, LABELS, verbose=0)
        self.assertEqual(int(model.get_layer("emb").table.size()), 0)
        self.assertAllClose(model.predict(unseen, verbose=0), first)  # initial rows, read, not stored
        model.fit(unseen, LABELS, verbose=0)
        self.assertEqual(int(model.get_layer("emb").table.size()), len(np.unique(IDS)))

    @pytest.mark.slow  # over 4 s here
    def test_string_keys_ragged_fit_and_keras_file_round_trip(self):
        model = string_model()
        model.fit(tags_data(), epochs=2, verbose=0)
        layer = model.get_layer("tags")
        seen = {t.decode() for tags, _ in tags_data() for t in tags.flat_values.numpy()}
        self.assertEqual(set(by_key(layer.table)), seen)
        path = os.path.join(self.get_temp_dir(), "tags.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(by_key(loaded.get_layer("tags").table).keys(), by_key(layer.table).keys())
        # Rows and optimizer state came back: one more epoch moves both models the same way.
        accumulators = by_key(layer.table, "accumulator")
        loaded_accumulators = by_key(loaded.get_layer("tags").table, "accumulator")
        for key in accumulators:
            self.assertAllClose(loaded_accumulators[key], accumulators[key])
        model.fit(tags_data(seed=1), epochs=1, verbose=0)
        loaded.fit(tags_data(seed=1), epochs=1, verbose=0)
        probe = tf.ragged.constant([["tag-1", "tag-2"], ["new"]])
        self.assertAllClose(loaded.predict(probe, verbose=0), model.predict(probe, verbose=0), atol=1e-6)

    def test_collection_with_dynamic_and_static_tables_trains_and_saves(self):
        inputs = {"ids": keras.Input((3,), dtype="int64", name="ids"), "item": keras.Input((1,), dtype="int64")}
        collection = tfs.layers.EmbeddingCollection(
            tables={
                "emb": {"vocabulary": "dynamic", "output_dim": 4, "seed": 5, "partitions": 2},
                "items": {"input_dim": 10, "output_dim": 4, "seed": 1},
            },
            features={"ids": {"table": "emb", "combiner": "mean"}, "item": "items"},
            name="features",
        )
        vectors = collection(inputs)
        out = keras.layers.Dense(1, kernel_initializer="ones", name="dense")(vectors["ids"])
        model = keras.Model(inputs, [out, vectors["item"]])
        model.compile(optimizer=tfs.optimizers.SGD(0.3, momentum=0.5), loss=["mse", None])
        table = collection.tables["emb"]
        self.assertIsInstance(table, tfs.DynamicTable)
        self.assertEqual(table.name, "features/emb")
        x = {"ids": RAW_KEYS[IDS], "item": np.zeros((len(IDS), 1), np.int64)}
        model.predict(x, verbose=0)
        self.assertEqual(int(table.size()), 0)
        steps = 3
        model.fit(x, LABELS, batch_size=len(IDS), epochs=steps, shuffle=False, verbose=0)
        assert_matches_dynamic_reference(self, model, steps, table=table)
        path = os.path.join(self.get_temp_dir(), "collection.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertAllClose(loaded.predict(x, verbose=0)[0], model.predict(x, verbose=0)[0], atol=1e-6)
        with self.assertRaisesRegex(ValueError, r"`tables\['u'\]\['vocabulary'\]` must be 'static'.*'dynamic'"):
            tfs.layers.EmbeddingCollection({"u": {"vocabulary": "open", "output_dim": 2}}, {"u": "u"})
        with self.assertRaisesRegex(ValueError, r"`tables\['u'\]\['output_dim'\]` must be a positive"):
            tfs.layers.EmbeddingCollection({"u": {"vocabulary": "dynamic", "output_dim": 0}}, {"u": "u"})

    def test_config_round_trip_and_mixed_precision(self):
        layer = tfs.layers.DynamicEmbedding(3, key_dtype="string", combiner="mean", seed=4, max_rows=10, name="d")
        clone = tfs.layers.DynamicEmbedding.from_config(layer.get_config())
        self.assertEqual(clone.get_config(), layer.get_config())
        keys = tf.ragged.constant([["a", "b"], ["c"]])
        self.assertAllClose(clone(keys, training=False), layer(keys, training=False))
        mixed = tfs.layers.DynamicEmbedding(3, seed=4, dtype="mixed_float16")
        out = mixed(tf.constant([[5]], tf.int64))
        self.assertEqual(out.dtype, tf.float16)
        self.assertEqual(mixed.table.dtype, tf.float32)

    def test_bad_input_names_layer_and_argument(self):
        layer = tfs.layers.DynamicEmbedding(3, name="users_raw")
        with self.assertRaisesRegex(TypeError, "`inputs` of dynamic table 'users_raw'.*int32 or int64.*float32"):
            layer(tf.constant([[1.0]]))
        strings = tfs.layers.DynamicEmbedding(3, key_dtype="string", name="words_raw")
        with self.assertRaisesRegex(TypeError, "`inputs` of dynamic table 'words_raw'.*string.*int64"):
            strings(tf.constant([[1]], tf.int64))
        with self.assertRaisesRegex(TypeError, "combiner=None"):
            layer(tf.ragged.constant([[1, 2]], dtype=tf.int64))
        with self.assertRaisesRegex(TypeError, "`key_dtype` must be tf.int64 or tf.string.*float32"):
            tfs.layers.DynamicEmbedding(3, key_dtype="float32")
        with self.assertRaisesRegex(ValueError, "output_dim"):
            tfs.layers.DynamicEmbedding(0)

    def test_stock_keras_optimizer_refused_by_tfs_fit(self):
        model = make_dynamic_model()
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        data = tf.data.Dataset.from_tensors((RAW_KEYS[IDS], LABELS))
        with self.assertRaisesRegex(ValueError, "Dynamic table 'emb' needs a tfs.optimizers optimizer.*Adam"):
            tfs.fit(model, data, verbose=0)
        self.assertEqual(int(model.get_layer("emb").table.size()), 0)


if __name__ == "__main__":
    tf.test.main()
