"""tfs.export (served where tf_sharded cannot be imported) and .keras / weights files across layouts."""

import os
import unittest

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.serving import serve_elsewhere
from tf_sharded.keras import quantized

ROWS, DIM = 40, 4


def model_with(partitions=2, scheme="mod"):
    ids = keras.Input((3,), dtype="int64", name="ids")
    dense = keras.Input((2,), name="features")
    emb = tfs.layers.Embedding(ROWS, DIM, combiner="mean", partitions=partitions, scheme=scheme, seed=1, name="emb")
    x = keras.layers.Concatenate()([emb(ids), dense])
    out = keras.layers.Dense(1, name="out")(keras.layers.Dense(8, activation="relu")(x))
    model = keras.Model({"ids": ids, "features": dense}, out)
    model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
    return model


def data(n=32):
    rng = np.random.RandomState(0)
    return {"ids": rng.randint(0, ROWS, (n, 3)), "features": rng.rand(n, 2).astype(np.float32)}, rng.rand(n, 1)


class ExportTest(tf.test.TestCase):
    @pytest.mark.slow  # starts a Python process with TensorFlow
    def test_export_serves_in_a_process_without_tf_sharded(self):
        model = model_with()
        x, y = data()
        model.fit(x, y, epochs=2, verbose=0)
        path = tfs.export(model, os.path.join(self.get_temp_dir(), "export"))
        probe = {"ids": x["ids"][:5].astype(np.int64), "features": x["features"][:5]}
        self.assertAllClose(serve_elsewhere(self, path, probe), model.predict(probe, verbose=0), atol=1e-6)

    @pytest.mark.slow  # over 5 s here
    def test_quantized_exports_serve_quantized_rows_without_tf_sharded(self):
        wide = 64
        ids = keras.Input((3,), dtype="int64", name="ids")
        emb = tfs.layers.Embedding(ROWS, wide, combiner="sum", partitions=3, scheme="mod", seed=1, name="emb")
        model = keras.Model(ids, keras.layers.Dense(1, name="out")(emb(ids)))
        table = emb.embeddings.numpy()
        probe = {"ids": data()[0]["ids"].astype(np.int64)}
        eps = keras.config.epsilon()
        # NumPy's int8 rows: each row scaled by 127 / max|row|, rounded.
        scale = 127.0 / (np.abs(table).max(axis=1) + eps)
        int8_rows = np.clip(np.round(table * scale[:, None]), -127, 127) / scale[:, None]
        # NumPy's int4 rows, Keras's default form: one group of 128 columns per row (64 columns and 64 of zero
        # padding, so the range always holds 0), a step and a zero point mapping [lo, hi] onto [-8, 7].
        lo, hi = np.minimum(table.min(axis=1), 0)[:, None], np.maximum(table.max(axis=1), 0)[:, None]
        step = (hi - lo + eps) / 15
        zero = np.clip(np.round(-lo / step) - 8, -8, 7)
        int4_rows = (np.clip(np.round(table / step) + zero, -8, 7) - zero) * step
        kernel, bias = model.get_layer("out").get_weights()
        # The saved table: int8 rows and a float32 scale per row, (4 * 64) / (64 + 4) = 3.8x fewer bytes; int4
        # values packed two a byte with a float32 scale and an int8 zero point per row, 4 * 64 / (32 + 5) = 6.9x.
        for mode, rows, row_bytes, dtypes_of_table in (
            ("int8", int8_rows, wide + 4, ["float32", "int8"]),
            ("int4", int4_rows, wide // 2 + 5, ["float32", "int8", "int8"]),
        ):
            path = tfs.export(model, os.path.join(self.get_temp_dir(), mode), quantize=mode)
            want = rows[probe["ids"]].sum(axis=1) @ kernel + bias
            served = serve_elsewhere(self, path, probe)
            self.assertAllClose(served, want, atol=1e-5, msg=mode)
            self.assertGreater(np.abs(served - model.predict(probe, verbose=0)).max(), 0)  # quantized, not floats
            saved = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
            shapes = saved.get_variable_to_shape_map()
            dtypes = saved.get_variable_to_dtype_map()
            nbytes = {k: np.prod(shapes[k]) * dtypes[k].size for k in shapes if "_CHECKPOINTABLE" not in k}
            table_keys = [k for k in nbytes if shapes[k] and shapes[k][0] == ROWS]
            self.assertEqual(sorted(dtypes[k].name for k in table_keys), dtypes_of_table, mode)
            self.assertAllClose(sum(nbytes[k] for k in table_keys), ROWS * row_bytes, msg=mode)
        with self.assertRaisesRegex(ValueError, "Argument `quantize` must be one of \\(None, 'int8', 'int4'\\)"):
            tfs.export(model, self.get_temp_dir(), quantize="float8")

    @pytest.mark.slow  # starts a Python process with TensorFlow
    @unittest.skipUnless(quantized.keras_groups_int4(), f"Keras {keras.__version__} has no Int4QuantizationConfig")
    def test_a_layer_quantized_to_int4_exports_its_own_rows(self):
        ids = keras.Input((3,), dtype="int64", name="ids")
        emb = tfs.layers.Embedding(ROWS, 8, combiner="mean", partitions=2, seed=1, name="emb")
        model = keras.Model(ids, emb(ids))
        emb.quantize("int4", config=keras.quantizers.Int4QuantizationConfig(block_size=4))
        probe = {"ids": data()[0]["ids"].astype(np.int64)}
        path = tfs.export(model, os.path.join(self.get_temp_dir(), "own_int4"))
        self.assertAllClose(serve_elsewhere(self, path, probe), model.predict(probe, verbose=0), atol=1e-6)

    @pytest.mark.slow  # starts a Python process with TensorFlow
    def test_multi_hot_inputs_stay_ragged_and_serve_the_training_batches(self):
        from tests.app.test_data import SCHEMA, write_example_files
        from tf_sharded.app import models, readers, schema

        out = self.get_temp_dir()
        write_example_files(out)
        s = schema.load(os.path.join(out, "schema.json"))
        s = s.with_statistics({"age": (30.0, 10.0)})
        self.assertIn("genres", [f.name for f in s.features if f.type.value == "multi_hot"], SCHEMA)
        source = readers.open_source(os.path.join(out, "movies.csv"), s)
        features, _ = next(iter(readers.batched(readers.records(source, s, source.files), 4)))
        self.assertIsInstance(features["genres"], tf.RaggedTensor)  # one row has no genre at all
        model = models.build("mlp", s, embedding_dim=4)
        want = model(features).numpy()
        path = tfs.export(model, os.path.join(out, "export"))

        loaded = tf.saved_model.load(path)
        self.assertAllClose(loaded.serve(**features)["output_0"], want, atol=1e-6)  # the model's own structure
        signature = loaded.signatures["serving_default"]
        names = sorted(signature.structured_input_signature[1])
        self.assertIn("genres_values", names)
        self.assertIn("genres_row_lengths", names)
        self.assertNotIn("genres", names)
        dense = {k: v.numpy() for k, v in features.items() if k != "genres"}
        dense["genres_values"] = features["genres"].values.numpy()
        dense["genres_row_lengths"] = features["genres"].row_lengths().numpy()
        self.assertAllClose(signature(**{k: tf.constant(v) for k, v in dense.items()})["output_0"], want, atol=1e-6)
        self.assertAllClose(serve_elsewhere(self, path, dense), want, atol=1e-6)
        # One ragged input (not a dict): the same, named by the Input.
        ids = keras.Input((None,), dtype="int64", ragged=True, name="ids")
        single = keras.Model(ids, tfs.layers.Embedding(ROWS, DIM, combiner="sum", partitions=2, seed=0)(ids))
        ragged = tf.ragged.constant([[1, 2, 3], [4]], dtype=tf.int64)
        served = tf.saved_model.load(tfs.export(single, os.path.join(out, "single")))
        parts = {"ids_values": ragged.values, "ids_row_lengths": ragged.row_lengths()}
        self.assertAllClose(served.signatures["serving_default"](**parts)["output_0"], single(ragged), atol=1e-6)
        self.assertAllClose(served.serve(ragged)["output_0"], single(ragged), atol=1e-6)
        # Padding with 0 (what a dense signature made callers do) is another input: row 0 is a real row.
        padded = dict(features, genres=features["genres"].to_tensor(default_value=0))
        with self.assertRaises((TypeError, ValueError)):
            loaded.serve(**padded)

    def test_export_refuses_a_strategy_scope_and_a_model_without_inputs(self):
        model = model_with()
        with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
            with self.assertRaisesRegex(RuntimeError, "outside `strategy.scope\\(\\)`"):
                tfs.export(model, self.get_temp_dir())

        class Sub(keras.Model):
            def call(self, x):
                return x

        with self.assertRaisesRegex(ValueError, "`input_signature` is required"):
            tfs.export(Sub(), self.get_temp_dir())


class KerasFileTest(tf.test.TestCase):
    def test_keras_file_round_trip_with_optimizer_state(self):
        model = model_with()
        x, y = data()
        model.fit(x, y, epochs=2, verbose=0)
        path = os.path.join(self.get_temp_dir(), "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        emb, emb2 = model.get_layer("emb").embeddings, loaded.get_layer("emb").embeddings
        self.assertIsInstance(loaded.get_layer("emb"), tfs.layers.Embedding)
        self.assertEqual(emb2.partition, emb.partition)
        self.assertAllEqual(emb2.numpy(), emb.numpy())
        self.assertAllEqual(
            loaded.optimizer.table_slot(emb2, "accumulator").numpy(),
            model.optimizer.table_slot(emb, "accumulator").numpy(),
        )
        self.assertAllClose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))

    def test_weights_file_loads_into_another_layout(self):
        model = model_with(partitions=2, scheme="mod")
        path = os.path.join(self.get_temp_dir(), "w.weights.h5")
        model.save_weights(path)
        for partitions, scheme in ((3, "balanced"), (1, "div")):
            other = model_with(partitions=partitions, scheme=scheme)
            other.load_weights(path)
            self.assertEqual(other.get_layer("emb").embeddings.num_shards, partitions)
            self.assertAllEqual(other.get_layer("emb").embeddings.numpy(), model.get_layer("emb").embeddings.numpy())
        smaller = tfs.layers.Embedding(ROWS - 1, DIM)
        smaller.build()
        with self.assertRaisesRegex(ValueError, "saved '0' has shape \\[40, 4\\]"):
            smaller.load_own_variables({"0": np.zeros((ROWS, DIM), np.float32)})
