"""Creation: strategy hooks, initialisation, argument validation."""

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tests.strategy_bodies import uid


class InitialisationTest(tf.test.TestCase):
    def test_same_seed_same_table_for_every_layout(self):
        for init in ("uniform", "normal", "truncated_normal", "glorot_uniform", "he_normal", "ones"):
            tables = [
                tfs.create_sharded_variable(uid("i"), [97, 5], initializer=init, partitions=n, scheme=s, seed=11)
                for n, s in ((1, "div"), (2, "div"), (7, "div"), (3, "mod"), (4, "balanced"))
            ]
            first = tables[0].numpy()
            for t in tables[1:]:
                self.assertAllEqual(t.numpy(), first, msg=f"{init} {t.partition}")

    def test_distributions_have_keras_parameters(self):
        t = tfs.create_sharded_variable(uid("u"), [4000, 50], initializer="uniform", seed=1).numpy()
        self.assertBetween(t.min(), -0.05, -0.0499)
        self.assertBetween(t.max(), 0.0499, 0.05)
        n = tfs.create_sharded_variable(uid("n"), [4000, 50], initializer="normal", seed=1).numpy()
        self.assertAllClose([n.mean(), n.std()], [0.0, 0.05], atol=2e-3)
        tn = tfs.create_sharded_variable(uid("tn"), [4000, 50], initializer="truncated_normal", seed=1).numpy()
        self.assertLessEqual(np.abs(tn).max(), 0.1)
        g = tfs.create_sharded_variable(uid("g"), [4000, 50], initializer="glorot_uniform", seed=1).numpy()
        self.assertAllClose(np.abs(g).max(), np.sqrt(6.0 / 4050), rtol=1e-3)
        self.assertNotAllEqual(
            tfs.create_sharded_variable(uid("s"), [10, 2], seed=1).numpy(),
            tfs.create_sharded_variable(uid("s"), [10, 2], seed=2).numpy(),
        )

    def test_keras_initializer_objects(self):
        import keras

        a = tfs.create_sharded_variable(
            uid("k"), [50, 3], initializer=keras.initializers.RandomUniform(-1, 1, seed=4), partitions=3, scheme="mod"
        )
        b = tfs.create_sharded_variable(uid("k"), [50, 3], initializer=keras.initializers.RandomUniform(-1, 1, seed=4))
        self.assertAllEqual(a.numpy(), b.numpy())
        self.assertGreater(a.numpy().max(), 0.8)
        c = tfs.create_sharded_variable(uid("k"), [5, 3], initializer=keras.initializers.Constant(2.5), partitions=2)
        self.assertAllEqual(c.numpy(), np.full([5, 3], 2.5))
        pretrained = np.arange(15, dtype=np.float32).reshape(5, 3)  # a Constant holding a whole table
        d = tfs.create_sharded_variable(
            uid("k"), [5, 3], initializer=keras.initializers.Constant(pretrained), partitions=2, scheme="balanced"
        )
        self.assertAllEqual(d.numpy(), pretrained)
        with self.assertRaisesRegex(ValueError, "keras Constant whose value has shape \\[2, 3\\]"):
            tfs.create_sharded_variable(uid("k"), [5, 3], initializer=keras.initializers.Constant(pretrained[:2]))

    def test_callable_with_partition_offset_is_layout_independent(self):
        def init(shape, dtype, partition_offset):
            rows = np.arange(partition_offset[0], partition_offset[0] + shape[0], dtype=np.float32)
            return tf.constant(np.repeat(rows[:, None], shape[1], axis=1), dtype)

        want = np.repeat(np.arange(31, dtype=np.float32)[:, None], 2, axis=1)
        for n, scheme in ((1, "div"), (3, "div"), (4, "mod"), (3, "balanced")):
            t = tfs.create_sharded_variable(uid("c"), [31, 2], initializer=init, partitions=n, scheme=scheme)
            self.assertAllEqual(t.numpy(), want)

    def test_large_shards_are_initialised_in_chunks(self):
        from tf_sharded import creation

        old = creation.CHUNK_ELEMENTS
        creation.CHUNK_ELEMENTS = 64
        try:
            chunked = tfs.create_sharded_variable(uid("ch"), [101, 8], partitions=2, scheme="mod", seed=5)
        finally:
            creation.CHUNK_ELEMENTS = old
        whole = tfs.create_sharded_variable(uid("wh"), [101, 8], seed=5)
        self.assertAllEqual(chunked.numpy(), whole.numpy())

    def test_one_device_strategy_places_shards(self):
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            t = tfs.create_sharded_variable(uid("od"), [10, 2], partitions=2)
        self.assertEqual(t.num_shards, 2)
        self.assertTrue(all("CPU:0" in d for d in t.devices))
        self.assertIs(t.strategy, strategy)


class BadArgumentTest(tf.test.TestCase):
    def test_initializer_returning_the_wrong_shape(self):
        with self.assertRaisesRegex(
            ValueError,
            r"Argument `initializer` must return a tensor of the requested shape \[5, 2\]. "
            r"Received: a tensor of shape \[3, 2\]",
        ):
            tfs.create_sharded_variable(
                uid("b"), [10, 2], initializer=lambda shape, dtype: tf.zeros([3, 2]), partitions=2
            )
        with self.assertRaisesRegex(
            ValueError, r"must have the table's shape \[10, 2\]. Received: a value of shape \[9, 2\]"
        ):
            tfs.create_sharded_variable(uid("b"), [10, 2], initializer=np.zeros([9, 2]))
        with self.assertRaisesRegex(ValueError, "Argument `initializer` must be a known initializer name"):
            tfs.create_sharded_variable(uid("b"), [10, 2], initializer="orthogonal-ish")

    def test_bad_layout_arguments(self):
        with self.assertRaisesRegex(ValueError, "Argument `scheme` must be one of"):
            tfs.create_sharded_variable(uid("b"), [10, 2], partitions=2, scheme="hash")
        with self.assertRaisesRegex(ValueError, "Argument `num_shards` must not exceed the number of rows \\(10\\)"):
            tfs.create_sharded_variable(uid("b"), [10, 2], partitions=11)
        with self.assertRaisesRegex(ValueError, "Argument `scheme` conflicts with `partitions`"):
            tfs.create_sharded_variable(uid("b"), [10, 2], partitions=tfs.PartitionSpec(2, "mod"), scheme="div")
        with self.assertRaisesRegex(TypeError, "Argument `partitions` must be None, an int"):
            tfs.create_sharded_variable(uid("b"), [10, 2], partitions="two")

    def test_bad_shape_dtype_name(self):
        with self.assertRaisesRegex(ValueError, "Argument `shape` must have rank >= 1 and positive dimensions"):
            tfs.create_sharded_variable(uid("b"), [0, 2])
        with self.assertRaisesRegex(ValueError, "Argument `shape` must be a fully defined shape"):
            tfs.create_sharded_variable(uid("b"), [None, 2])
        with self.assertRaisesRegex(TypeError, "Argument `dtype` must be a TensorFlow dtype"):
            tfs.create_sharded_variable(uid("b"), [3, 2], dtype="floaty")
        with self.assertRaisesRegex(ValueError, "Argument `name` must be a non-empty string"):
            tfs.create_sharded_variable("", [3, 2])
        with self.assertRaisesRegex(TypeError, "needs a floating-point `dtype`"):
            tfs.create_sharded_variable(uid("b"), [3, 2], dtype=tf.int32, initializer="uniform")

    def test_exchange_outside_mirrored(self):
        with self.assertRaisesRegex(ValueError, "Argument `exchange` must be one of"):
            tfs.create_sharded_variable(uid("b"), [3, 2], exchange="ring")
        with self.assertRaisesRegex(ValueError, "Argument `exchange` only applies under MirroredStrategy"):
            tfs.create_sharded_variable(uid("b"), [3, 2], exchange="dense")
        with self.assertRaisesRegex(ValueError, "Argument `placement` only applies under MirroredStrategy"):
            tfs.create_sharded_variable(uid("b"), [3, 2], placement="host")
        with self.assertRaisesRegex(ValueError, "Argument `placement` must be one of"):
            tfs.create_sharded_variable(uid("b"), [3, 2], placement="gpu")
        self.assertEqual(tfs.create_sharded_variable(uid("b"), [3, 2], exchange="auto").num_shards, 1)

    def test_unsupported_strategy(self):
        class TPUishStrategy(tf.distribute.Strategy):
            def __init__(self):
                pass

        with self.assertRaisesRegex(
            tfs.UnsupportedStrategyError,
            "must be one of the strategies tf_sharded supports: .*ParameterServerStrategy.* "
            "Received: strategy=TPUishStrategy",
        ):
            TPUishStrategy().create_sharded_variable(uid("u"), [3, 2])

    def test_strategy_method_signature_errors(self):
        with self.assertRaisesRegex(TypeError, "create_sharded_variable\\(\\): missing a required argument: 'shape'"):
            tf.distribute.get_strategy().create_sharded_variable("x")

    def test_conversion_to_tensor_is_refused(self):
        t = tfs.create_sharded_variable(uid("c"), [3, 2])
        with self.assertRaisesRegex(TypeError, "would concatenate the whole table"):
            tf.convert_to_tensor(t)
        with self.assertRaisesRegex(TypeError, "sparse_delta"):
            t.scatter_add(tf.ones([3, 2]))
        with self.assertRaisesRegex(ValueError, r"must have the table's full shape \[3, 2\]"):
            t.assign(tf.ones([4, 2]))


if __name__ == "__main__":
    tf.test.main()
