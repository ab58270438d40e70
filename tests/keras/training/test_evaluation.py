"""`tfs.evaluate`, `tfs.predict` and `tfs.fit(validation_data=...)` under each strategy, against Keras's own
`model.evaluate` / `model.predict` on one device with the same weights."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import mirrored, ps_strategy

ROWS = 50
rng = np.random.RandomState(0)
IDS = rng.randint(0, ROWS, (100, 3))
LENGTHS = rng.randint(1, 4, 100)
LABELS = rng.randint(0, 2, (100, 1)).astype(np.float32)
WEIGHTS = rng.rand(100).astype(np.float32)


def build(ragged=False, partitions=2):
    """The same weights under every strategy: seeded tables, constant dense kernel."""
    inp = keras.Input((None,) if ragged else (3,), dtype="int64", ragged=ragged, name="ids")
    x = tfs.layers.Embedding(ROWS, 4, combiner="mean", seed=0, partitions=partitions)(inp)
    out = keras.layers.Dense(1, kernel_initializer="ones")(x)
    model = keras.Model(inp, out)
    model.compile(
        optimizer=tfs.optimizers.SGD(0.1),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.AUC(from_logits=True, name="auc"), "mae"],
    )
    return model


def dataset(ragged=False, weighted=True):
    ids = tf.RaggedTensor.from_row_lengths(
        np.concatenate([row[:n] for row, n in zip(IDS, LENGTHS)]), LENGTHS
    ) if ragged else IDS  # fmt: skip
    parts = (ids, LABELS, WEIGHTS) if weighted else (ids, LABELS)
    return tf.data.Dataset.from_tensor_slices(parts).batch(16)  # 7 batches, the last of 4


def reference(ragged=False):
    """Keras's own evaluate and predict, on one device (the default strategy), and the model."""
    model = build(ragged, partitions=1)
    return model.evaluate(dataset(ragged), return_dict=True, verbose=0), model.predict(dataset(ragged), verbose=0)


@pytest.mark.ps_cluster
class ParameterServerEvaluationTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()

    @pytest.mark.slow  # over 4 s
    def test_evaluate_and_predict_equal_keras_on_one_device(self):
        want, predicted = reference()
        with self.strategy.scope():
            model = build()
        got = tfs.evaluate(model, dataset(), return_dict=True)
        self.assertEqual(sorted(got), sorted(want))
        for name in want:
            self.assertAllClose(got[name], want[name], rtol=1e-5, msg=name)
        self.assertAllClose(tfs.predict(model, dataset()), predicted, atol=1e-6)  # in input order
        # The list form is in Keras's order.
        as_list = build(partitions=1).evaluate(dataset(), verbose=0)
        self.assertAllClose(tfs.evaluate(model, dataset()), as_list, rtol=1e-5)

        # A dataset function: each worker reads its own batches; `steps` batches in all.
        def per_worker(context):
            return dataset(weighted=False).repeat()

        self.assertEqual(tfs.predict(model, per_worker, steps=5).shape, (80, 1))
        with self.assertRaisesRegex(ValueError, "Argument `steps` is required when `data` is a dataset function"):
            tfs.evaluate(model, per_worker)
        # Every worker reads the first batch again and again: 4 of them are that batch's figures.
        again = tfs.evaluate(model, lambda context: dataset(weighted=False).take(1).repeat(), steps=4, return_dict=True)
        once = build(partitions=1).evaluate(dataset(weighted=False).take(1), return_dict=True, verbose=0)
        for name in once:
            self.assertAllClose(again[name], once[name], rtol=1e-5, msg=name)

    def test_fit_validation_data_per_epoch(self):
        with self.strategy.scope():
            model = build()
        history = tfs.fit(
            model,
            lambda context: dataset().repeat(),
            epochs=2,
            steps_per_epoch=3,
            validation_data=dataset(),
            verbose=0,
        )
        self.assertEqual(
            sorted(history.history),
            ["auc", "loss", "mae", "samples_per_second", "val_auc", "val_loss", "val_mae"],
        )
        self.assertLen(history.history["val_loss"], 2)
        after = tfs.evaluate(model, dataset(), return_dict=True)
        for name in ("loss", "auc", "mae"):
            self.assertAllClose(history.history[f"val_{name}"][-1], after[name], rtol=1e-5)
        with self.assertRaisesRegex(ValueError, "Argument `validation_steps` is required when `validation_data`"):
            tfs.fit(model, lambda c: dataset().repeat(), steps_per_epoch=1, validation_data=lambda c: dataset())


@pytest.mark.mirrored
class MirroredEvaluationTest(tf.test.TestCase):
    def test_ragged_inputs_where_keras_fails(self):
        # Keras's evaluate fails on ragged inputs under MirroredStrategy ('RaggedTensor' object has no
        # attribute 'device'); tfs.evaluate and tfs.predict run the model themselves there.
        want, predicted = reference(ragged=True)
        with mirrored().scope():
            model = build(ragged=True)
        got = tfs.evaluate(model, dataset(ragged=True), return_dict=True)
        for name in want:
            self.assertAllClose(got[name], want[name], rtol=1e-5, msg=name)
        self.assertAllClose(tfs.predict(model, dataset(ragged=True)), predicted, atol=1e-6)

    @pytest.mark.slow  # over 4 s here
    def test_fit_with_ragged_inputs_where_keras_fit_fails(self):
        # Keras's model.fit fails on ragged inputs under MirroredStrategy; tfs.fit takes its replica loop.
        with mirrored().scope():
            model = build(ragged=True)
        history = tfs.fit(model, dataset(ragged=True), epochs=2, validation_data=dataset(ragged=True), verbose=0)
        twin = build(ragged=True, partitions=1)
        want = twin.fit(dataset(ragged=True), epochs=2, validation_data=dataset(ragged=True), verbose=0, shuffle=False)
        for name in ("loss", "val_loss", "val_auc"):
            self.assertAllClose(history.history[name], want.history[name], rtol=1e-4, msg=name)
        self.assertAllClose(model.layers[1].embeddings.numpy(), twin.layers[1].embeddings.numpy(), atol=1e-5)

    @pytest.mark.slow  # over 4 s here
    def test_fit_validation_data_is_keras_validation(self):
        with mirrored().scope():
            model = build()
        history = tfs.fit(model, dataset(), epochs=2, validation_data=dataset(), verbose=0)
        twin = build(partitions=1)
        want = twin.fit(dataset(), epochs=2, validation_data=dataset(), verbose=0, shuffle=False)
        self.assertEqual(sorted(history.history), sorted(want.history))
        for name, values in want.history.items():
            self.assertAllClose(history.history[name], values, rtol=1e-4, msg=name)

    def test_bad_arguments_are_named(self):
        model = build(partitions=1)
        with self.assertRaisesRegex(ValueError, "Argument `data` must be a tf.data.Dataset or a function"):
            tfs.evaluate(model, [1, 2])
        with self.assertRaisesRegex(ValueError, "Argument `steps` must be a positive int"):
            tfs.predict(model, dataset(), steps=0)
        with self.assertRaisesRegex(ValueError, "Argument `model` must be a compiled keras.Model"):
            tfs.evaluate(keras.Sequential([keras.layers.Dense(1)]), dataset())
        with self.assertRaisesRegex(ValueError, "Argument `validation_steps` needs `validation_data`"):
            tfs.fit(model, dataset(), validation_steps=2)
