"""tfs.layers.Embedding: Keras 3 models, model.fit under default and Mirrored strategies."""

import os
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import mirrored
from tf_sharded.exchange import reduce
from tf_sharded.keras import quantized

pytestmark = pytest.mark.mirrored

ROWS, DIM = 50, 4


def data(n=64):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, ROWS, (n, 3))
    ids[:8] = 7  # duplicates inside and across replicas' batches
    return ids, rng.rand(n, 1).astype(np.float32)


def build(embedding, optimizer=None):
    inp = keras.Input((3,), dtype="int64")
    x = keras.layers.GlobalAveragePooling1D()(embedding(inp))
    model = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(x))
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.5), loss="mse")
    return model


def reference_after_fit(table0, epochs=2):
    """The same model with keras.layers.Embedding on one device."""
    embedding = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.Constant(table0))
    model = build(embedding)
    ids, y = data()
    model.fit(ids, y, epochs=epochs, batch_size=16, shuffle=False, verbose=0)
    return embedding.embeddings.numpy(), model.layers[-1].kernel.numpy()


class MirroredFitTest(tf.test.TestCase):
    @pytest.mark.slow  # over 5 s here
    def test_fit_matches_single_device_reference_for_each_exchange(self):
        strategy = mirrored()
        calls = []
        # Every shard's exchange starts with its trace-time choice (grouped all-gathers included).
        original = reduce.trace_time_choice

        def spy(grad, table, shard, *args, **kwargs):
            calls.append((table.name, shard))
            return original(grad, table, shard, *args, **kwargs)

        with mock.patch.object(reduce, "trace_time_choice", spy):
            for mode in ("allgather", "dense", "auto"):
                calls.clear()
                with strategy.scope():
                    layer = tfs.layers.Embedding(ROWS, DIM, partitions=2, scheme="mod", seed=3, exchange=mode)
                    model = build(layer)
                table0 = layer.embeddings.numpy()
                ids, y = data()
                model.fit(ids, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
                want_table, want_kernel = reference_after_fit(table0)
                self.assertAllClose(layer.embeddings.numpy(), want_table, atol=1e-5, msg=mode)
                self.assertAllClose(model.layers[-1].kernel.numpy(), want_kernel, atol=1e-5, msg=mode)
                # Keras's gradient aggregation went through the table's exchange, per replica and shard.
                self.assertEqual({s for _, s in calls}, {0, 1}, msg=mode)

    @pytest.mark.slow  # over 4 s here
    def test_fit_with_steps_per_execution_under_mirrored(self):
        # Keras 3's own steps_per_execution > 1 fails under MirroredStrategy (keras-team/keras#19246);
        # tfs.fit runs its own loop there. 4 batches per epoch at 3 steps per execution: 3 + 1.
        strategy = mirrored()
        with strategy.scope():
            layer = tfs.layers.Embedding(ROWS, DIM, partitions=2, seed=3, exchange="allgather")
            model = build(layer)
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse", steps_per_execution=3)
        table0 = layer.embeddings.numpy()
        ids, y = data()
        history = tfs.fit(model, tf.data.Dataset.from_tensor_slices((ids, y)).batch(16), epochs=2, verbose=0)
        self.assertLen(history.history["loss"], 2)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 8)
        want_table, want_kernel = reference_after_fit(table0)
        self.assertAllClose(layer.embeddings.numpy(), want_table, atol=1e-5)
        self.assertAllClose(model.layers[-1].kernel.numpy(), want_kernel, atol=1e-5)

    @pytest.mark.slow  # over 5 s here
    def test_sparse_optimizers_under_mirrored_match_one_device(self):
        strategy = mirrored()
        ids, y = data()
        cases = [
            (tfs.optimizers.Adam, dict(learning_rate=0.05), "allgather", "device"),
            (tfs.optimizers.Adagrad, dict(learning_rate=0.3), "dense", "device"),
            (tfs.optimizers.Ftrl, dict(learning_rate=0.3), "auto", "device"),
            (tfs.optimizers.Adam, dict(learning_rate=0.05), "auto", "host"),
            (tfs.optimizers.SGD, dict(learning_rate=0.3, momentum=0.9), "allgather", "host"),
        ]
        for cls, cfg, mode, placement in cases:
            with strategy.scope():
                layer = tfs.layers.Embedding(
                    ROWS, DIM, partitions=2, scheme="mod", seed=3, exchange=mode, placement=placement
                )
                model = build(layer, cls(**cfg))
            table0 = layer.embeddings.numpy()
            model.fit(ids, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
            single = tfs.layers.Embedding(ROWS, DIM, partitions=3, embeddings_initializer=table0)
            reference = build(single, cls(**cfg))
            reference.fit(ids, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
            msg = f"{cls.__name__} {mode}/{placement}"
            self.assertAllClose(layer.embeddings.numpy(), single.embeddings.numpy(), atol=2e-5, msg=msg)
            self.assertAllClose(model.layers[-1].kernel.numpy(), reference.layers[-1].kernel.numpy(), atol=2e-5)
            slot_name = {"Adam": "velocity", "Adagrad": "accumulator", "Ftrl": "linear", "SGD": "momentum"}[
                cls.__name__
            ]
            got_slot = model.optimizer.table_slot(layer.embeddings, slot_name)
            self.assertEqual(got_slot.devices, layer.embeddings.devices, msg=msg)
            want_slot = reference.optimizer.table_slot(single.embeddings, slot_name).numpy()
            self.assertAllClose(got_slot.numpy(), want_slot, atol=2e-5, msg=msg)

    @pytest.mark.slow  # over 4 s here
    def test_lora_under_mirrored_matches_keras_lora_on_one_device(self):
        from tests.harness.models import IDS, LABELS, assert_matches_lora_reference, make_lora_model

        with mirrored().scope():
            model, table0, a0, b0 = make_lora_model(partitions=2)
        model.fit(IDS, LABELS, batch_size=len(IDS), epochs=3, shuffle=False, verbose=0)
        assert_matches_lora_reference(self, model, table0, a0, b0, 3)


class DefaultStrategyLayerTest(tf.test.TestCase):
    def test_fit_matches_keras_embedding(self):
        layer = tfs.layers.Embedding(ROWS, DIM, partitions=3, scheme="balanced", seed=5)
        model = build(layer)
        table0 = layer.embeddings.numpy()
        ids, y = data()
        model.fit(ids, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
        want_table, want_kernel = reference_after_fit(table0)
        self.assertAllClose(layer.embeddings.numpy(), want_table, atol=1e-5)
        self.assertAllClose(model.layers[-1].kernel.numpy(), want_kernel, atol=1e-5)
        self.assertLen(model.trainable_weights, 3 + 2)

    def test_sequential_subclassed_and_config_round_trip(self):
        layer = tfs.layers.Embedding(
            ROWS, DIM, partitions=tfs.PartitionSpec(2, "mod"), combiner="sqrtn", embeddings_initializer="normal"
        )
        clone = tfs.layers.Embedding.from_config(layer.get_config())
        self.assertEqual(clone.get_config(), layer.get_config())
        self.assertEqual(clone.partitions, tfs.PartitionSpec(2, "mod"))
        seq = keras.Sequential([keras.Input((4,), dtype="int64"), tfs.layers.Embedding(ROWS, DIM, combiner="sum")])
        self.assertEqual(tuple(seq(np.zeros((2, 4), np.int64)).shape), (2, DIM))

        class Tower(keras.Model):
            def __init__(self):
                super().__init__()
                self.emb = tfs.layers.Embedding(ROWS, DIM, combiner="mean", partitions=2)
                self.out = keras.layers.Dense(1)

            def call(self, ids):
                return self.out(self.emb(ids))

        tower = Tower()
        self.assertEqual(tuple(tower(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)).shape), (2, 1))
        self.assertLen(tower.trainable_weights, 4)
        # Built inside Keras's StatelessScope (subclassed models build that way): still real variables.
        self.assertTrue(all(isinstance(v, tf.Variable) for v in tower.emb.embeddings.variables))
        before = tower.emb.embeddings.numpy()
        tower.compile(optimizer=tfs.optimizers.SGD(0.5), loss="mse")
        tower.fit(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64), np.ones((2, 1)), epochs=1, verbose=0)
        changed = np.abs(tower.emb.embeddings.numpy() - before).sum(axis=1) > 0
        self.assertEqual(np.nonzero(changed)[0].tolist(), [1, 2, 3])

    def test_multi_hot_inputs_agree(self):
        layer = tfs.layers.Embedding(ROWS, DIM, combiner="mean", mask_zero=True, partitions=2, seed=1)
        ragged = tf.ragged.constant([[3, 4, 4], [9], [1, 2]], dtype=tf.int64)
        padded = np.array([[3, 4, 4], [9, 0, 0], [1, 2, -1]])
        self.assertAllClose(layer(ragged), layer(padded))
        self.assertAllClose(layer(ragged.to_sparse()), layer(padded))
        table = layer.embeddings.numpy()
        self.assertAllClose(layer(ragged)[0], table[[3, 4, 4]].mean(axis=0), atol=1e-6)

    def test_float_ids_weights_argument_and_mixed_precision_as_keras(self):
        table = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) / 100
        ours = tfs.layers.Embedding(ROWS, DIM, partitions=3, weights=[table])
        theirs = keras.layers.Embedding(ROWS, DIM, weights=[table])
        self.assertAllEqual(ours.embeddings.numpy(), table)
        self.assertAllEqual(tfs.layers.Embedding(ROWS, DIM, partitions=2, weights=table).embeddings.numpy(), table)
        with self.assertRaisesRegex(ValueError, r"Argument `weights` must be one array of shape \(50, 4\).*\(49, 4\)"):
            tfs.layers.Embedding(ROWS, DIM, weights=[table[:-1]])
        # keras.Input's default dtype is float32: the ordinary functional model works, ids cast as Keras casts.
        inp = keras.Input((2,))
        model = keras.Model(inp, ours(inp))
        ids = np.array([[1.0, 7.0], [49.0, 0.0]], np.float32)
        self.assertAllEqual(model(ids), keras.Model(inp, theirs(inp))(ids))
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("mixed_float16")
        try:
            half, reference = (
                tfs.layers.Embedding(ROWS, DIM, partitions=2, weights=[table]),
                keras.layers.Embedding(ROWS, DIM, weights=[table]),
            )
            ids = tf.constant([[1, 2]])
            # float32 tables, float16 rows out: what the next layer computes in.
            self.assertEqual((half(ids).dtype, half.embeddings.dtype), (reference(ids).dtype, tf.float32))
            self.assertEqual(reference(ids).dtype, tf.float16)
            self.assertAllEqual(half(ids), reference(ids))
        finally:
            keras.config.set_dtype_policy(previous)

    def test_ragged_and_sparse_ids_without_a_combiner_as_keras(self):
        table = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
        ours = tfs.layers.Embedding(ROWS, DIM, partitions=3, weights=[table])
        theirs = keras.layers.Embedding(ROWS, DIM, weights=[table])
        ragged = tf.ragged.constant([[1, 2, 49], [7]], dtype=tf.int64)
        rows = ours(ragged)
        self.assertIsInstance(rows, tf.RaggedTensor)
        self.assertAllEqual(rows.to_tensor(), theirs(ragged).to_tensor())
        self.assertAllEqual(rows.row_lengths(), [3, 1])
        sparse = tf.SparseTensor([[0, 0], [1, 2]], tf.constant([3, 5], tf.int64), [2, 3])
        self.assertAllEqual(ours(sparse), theirs(sparse))  # [2, 3, DIM]: absent entries read row 0
        self.assertAllEqual(ours(sparse)[0, 1], table[0])

    @pytest.mark.slow  # over 5 s here
    def test_quantization_matches_keras_quantized_layer(self):
        ids = np.random.RandomState(2).randint(0, ROWS, (16, 3))
        if quantized.keras_groups_int4():
            int4 = keras.quantizers.Int4QuantizationConfig
            forms = [("int8", None, "int8_from_float32"), ("int4", None, "int4/128_from_float32"),  # Keras's defaults
                     ("int4", int4(block_size=None), "int4/-1_from_float32"),
                     ("int4", int4(block_size=3), "int4/3_from_float32")]  # fmt: skip
        else:  # Keras before 3.14: int4 per row only
            forms = [("int8", None, "int8_from_float32"), ("int4", None, "int4_from_float32")]
        for mode, config, policy in forms:
            for partitions, combiner in ((1, None), (3, None), (3, "mean")):
                ours = tfs.layers.Embedding(ROWS, DIM, partitions=partitions, scheme="mod", combiner=combiner, seed=4)
                ours.build()
                theirs = keras.layers.Embedding(
                    ROWS, DIM, embeddings_initializer=keras.initializers.Constant(ours.embeddings.numpy())
                )
                theirs.build()
                ours.quantize(mode, config=config)
                theirs.quantize(mode, config=config)
                where = (mode, policy, partitions, combiner)
                self.assertEqual((ours.dtype_policy.name, theirs.dtype_policy.name), (policy, policy), where)
                # Keras's weights, each sharded with the table (int4 packed two a byte, as Keras stores it).
                for name in ("embeddings", "embeddings_scale", "embeddings_zero"):
                    self.assertEqual(hasattr(ours, name), hasattr(theirs, name), where)
                    if hasattr(theirs, name) and name != "embeddings":
                        table = getattr(ours, name)
                        self.assertLen(table.variables, partitions)
                        self.assertAllEqual(table.numpy(), getattr(theirs, name).numpy(), msg=where)
                self.assertEqual([v.dtype for v in ours._table.variables], [tf.int8] * partitions)
                self.assertAllEqual(ours._table.numpy(), theirs._embeddings.numpy(), msg=where)
                self.assertEqual(hasattr(ours, "g_idx"), hasattr(theirs, "g_idx"), where)
                want = theirs(ids).numpy()
                want = want.mean(axis=1) if combiner else want
                self.assertAllClose(ours(ids), want, atol=1e-6, msg=where)

    @pytest.mark.skipif(not hasattr(keras.quantizers, "abs_max_quantize_grouped_with_zero_point"),
                        reason=f"Keras {keras.__version__} has no grouped int4 quantizer")  # fmt: skip
    def test_grouped_int4_is_keras_grouped_quantizer_on_the_columns(self):
        values = np.random.RandomState(5).normal(size=(9, 10)).astype(np.float32)
        values[0] = np.abs(values[0])  # a row of one sign: the zero padding widens its last group's range
        for block_size in (1, 3, 4, 10, 128):
            want = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
                values.T, block_size=block_size, value_range=(-8, 7), dtype="int8", to_numpy=True
            )
            got = quantized.grouped_int4(values, block_size)
            for name, mine, theirs in zip(("values", "scale", "zero"), got, want):
                self.assertAllEqual(mine, np.asarray(theirs).T, msg=(name, block_size))

    def test_checkpoint_keys_are_the_keras_names_with_lora_and_quantization(self):
        layer = tfs.layers.Embedding(ROWS, DIM, partitions=2)
        layer.build()
        keys = lambda layer: {k for k, _ in tf.train.list_variables(  # noqa: E731
            tf.train.Checkpoint(layer=layer).save(os.path.join(self.get_temp_dir(), "c")))}  # fmt: skip
        self.assertIn("layer/embeddings/.ATTRIBUTES/VARIABLE_VALUE", keys(layer))
        layer.enable_lora(2)
        layer.quantize("int8")
        names = {k.split("/")[1] for k in keys(layer) if k.startswith("layer/")}
        self.assertEqual(names, {"embeddings", "embeddings_scale", "lora_embeddings_a", "lora_embeddings_b"})
        grouped = tfs.layers.Embedding(ROWS, DIM, partitions=2)
        grouped.build()
        grouped.quantize("int4")  # Keras's default: groups of 128 columns with zero points (per row before 3.14)
        names = {k.split("/")[1] for k in keys(grouped) if k.startswith("layer/")}
        extra = {"embeddings_zero", "g_idx"} if quantized.keras_groups_int4() else set()
        self.assertEqual(names, {"embeddings", "embeddings_scale"} | extra)

    def test_mask_zero_single_hot(self):
        layer = tfs.layers.Embedding(ROWS, DIM, mask_zero=True)
        self.assertAllEqual(layer.compute_mask(tf.constant([[0, 3]])), [[False, True]])

    def test_bad_input(self):
        layer = tfs.layers.Embedding(ROWS, DIM)
        with self.assertRaisesRegex(TypeError, "Argument `inputs` must be an int32 or int64 tensor"):
            layer(tf.constant([["1"]]))
        bag = tfs.layers.Embedding(ROWS, DIM, combiner="sum")
        with self.assertRaisesRegex(ValueError, "needs multi-hot ids of shape \\[batch, ids\\]"):
            bag(tf.constant([1, 2]))
        with self.assertRaisesRegex(ValueError, "Argument `combiner` must be None or one of"):
            tfs.layers.Embedding(ROWS, DIM, combiner="max")
        with self.assertRaisesRegex(ValueError, "Argument `input_dim` must be a positive int"):
            tfs.layers.Embedding(0, DIM)
        built = tfs.layers.Embedding(ROWS, DIM)
        built.build()
        with self.assertRaisesRegex(
            NotImplementedError, "quantizes to \\('int8', 'int4'\\) only. Received: mode='float8'"
        ):
            built.quantize("float8")
        self.assertIsNone(built.quantization_mode)  # nothing applied
        self.assertEqual([v.dtype for v in built.weights], ["float32"])
        with self.assertRaisesRegex(
            ValueError, "Argument `lora_rank` must be a positive integer. Received: lora_rank=-2"
        ):
            tfs.layers.Embedding(ROWS, DIM, lora_rank=-2)
        self.assertFalse(tfs.layers.Embedding(ROWS, DIM, lora_rank=0).lora_rank)  # as Keras: no LoRA
        with self.assertRaisesRegex(ValueError, "lora is already enabled"):
            layer.enable_lora(2)
            layer.enable_lora(2)
        with self.assertRaisesRegex(ValueError, "Cannot enable lora on a layer that isn't yet built"):
            tfs.layers.Embedding(ROWS, DIM).enable_lora(2)
        with self.assertRaisesRegex(ValueError, "Argument `embeddings_constraint` is not supported"):
            tfs.layers.Embedding(ROWS, DIM, embeddings_constraint="non_neg")
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "must hold row ids in \\[0, 50\\)"):
            layer(tf.constant([[50]]))


if __name__ == "__main__":
    tf.test.main()
