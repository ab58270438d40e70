"""`tf_sharded.initializers`: every kind gives one logical table for every layout, chunk by chunk."""

import keras
import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import uid
from tf_sharded import initializers
from tf_sharded.layout import PartitionSpec


def assemble(init, layout, shape, dtype, chunk_rows):
    """The logical table an initializer gives, written shard by shard and chunk by chunk as the builder does."""
    out = np.full(shape, np.nan, np.float32)
    for shard in range(layout.num_shards):
        local = np.full([layout.shard_sizes[shard], *shape[1:]], np.nan, np.float32)
        chunks = init.chunks(layout, shard, shape, dtype, chunk_rows)
        for chunk in chunks:
            rows, values = chunk.compute()
            local[rows.numpy()] = values.numpy()
            if chunk.whole:
                assert len(chunks) == 1 and len(rows) == len(local)
        out[layout.logical_rows(shard)] = local
    return out


class ChunkTest(tf.test.TestCase):
    shape = [37, 3]

    def kinds(self):
        values = np.arange(37 * 3, dtype=np.float32).reshape(37, 3)
        yield "named", initializers.resolve("uniform", self.shape, tf.float32, seed=3)
        yield "scaling", initializers.resolve("glorot_normal", self.shape, tf.float32, seed=3)
        yield "array", initializers.resolve(values, self.shape, tf.float32, seed=0)
        yield "keras", initializers.resolve(keras.initializers.RandomNormal(seed=2), self.shape, tf.float32, seed=0)
        yield (
            "callable",
            initializers.resolve(
                lambda shape, dtype, partition_offset=None: tf.fill(shape, 1.5), self.shape, tf.float32, seed=0
            ),
        )

    def test_chunks_cover_each_shard_once_and_agree_across_layouts(self):
        for name, init in self.kinds():
            reference = assemble(init, PartitionSpec(1).bind(37), self.shape, tf.float32, chunk_rows=1000)
            self.assertFalse(np.isnan(reference).any(), name)
            for spec in (PartitionSpec(3, "div"), PartitionSpec(4, "mod"), PartitionSpec(5, "balanced")):
                for chunk_rows in (1, 4, 1000):
                    got = assemble(init, spec.bind(37), self.shape, tf.float32, chunk_rows)
                    self.assertAllEqual(got, reference, msg=f"{name} {spec} chunk_rows={chunk_rows}")

    def test_array_kind_is_the_array(self):
        values = np.random.RandomState(0).randn(*self.shape).astype(np.float32)
        init = initializers.resolve(values, self.shape, tf.float32, seed=0)
        self.assertAllEqual(assemble(init, PartitionSpec(3, "mod").bind(37), self.shape, tf.float32, 5), values)

    def test_names(self):
        self.assertTrue(initializers.is_named("Glorot_Uniform"))
        self.assertTrue(initializers.is_named("zeros"))
        self.assertFalse(initializers.is_named("orthogonal"))

    def test_bad_initializers_are_named(self):
        with self.assertRaisesRegex(ValueError, "Argument `initializer` must be a known initializer name"):
            initializers.resolve("nope", self.shape, tf.float32, seed=0)
        with self.assertRaisesRegex(ValueError, r"must have the table's shape \[37, 3\]. Received: a value of shape"):
            initializers.resolve(np.zeros([2, 3]), self.shape, tf.float32, seed=0)
        with self.assertRaisesRegex(TypeError, "Received: initializer=3 \\(of type int\\)"):
            initializers.resolve(3, self.shape, tf.float32, seed=0)


class ThroughCreationTest(tf.test.TestCase):
    """Every initializer kind, through `tfs.create_sharded_variable`: one logical table whatever the layout."""

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
        from tf_sharded.table import builder as creation

        old = creation.CHUNK_ELEMENTS
        creation.CHUNK_ELEMENTS = 64
        try:
            chunked = tfs.create_sharded_variable(uid("ch"), [101, 8], partitions=2, scheme="mod", seed=5)
        finally:
            creation.CHUNK_ELEMENTS = old
        whole = tfs.create_sharded_variable(uid("wh"), [101, 8], seed=5)
        self.assertAllEqual(chunked.numpy(), whole.numpy())
