"""PartitionSpec, layouts and partitioners."""

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tf_sharded.layout import PartitionSpec


class PartitionSpecTest(tf.test.TestCase):
    def test_value_object(self):
        a = PartitionSpec(4, scheme="mod")
        self.assertEqual(a, PartitionSpec(4, "mod"))
        self.assertEqual(hash(a), hash(PartitionSpec(4, "mod")))
        self.assertNotEqual(a, PartitionSpec(4, "div"))
        self.assertEqual(
            repr(PartitionSpec(2, splits=[3, 7])), "PartitionSpec(num_shards=2, scheme='div', splits=[3, 7])"
        )
        with self.assertRaises(AttributeError):
            a.num_shards = 3
        self.assertEqual(PartitionSpec.from_config(a.to_config()), a)

    def test_bad_arguments_name_the_argument(self):
        with self.assertRaisesRegex(ValueError, "Argument `scheme` must be one of .* Received: scheme='hash'"):
            PartitionSpec(2, scheme="hash")
        with self.assertRaisesRegex(ValueError, "Argument `num_shards` must be a positive int. Received: num_shards=0"):
            PartitionSpec(0)
        with self.assertRaisesRegex(TypeError, "Argument `num_shards`"):
            PartitionSpec(2.0)
        with self.assertRaisesRegex(ValueError, "Argument `splits` must hold 2 positive"):
            PartitionSpec(2, splits=[3])
        with self.assertRaisesRegex(ValueError, "only meaningful with scheme='div'"):
            PartitionSpec(2, scheme="mod", splits=[1, 1])
        with self.assertRaisesRegex(ValueError, "must not exceed the number of rows \\(3\\).* Received: num_shards=4"):
            PartitionSpec(4).bind(3)
        with self.assertRaisesRegex(ValueError, "Argument `splits` must sum to the number of rows \\(10\\)"):
            PartitionSpec(2, splits=[3, 3]).bind(10)

    def test_layouts_are_bijections_and_numpy_matches_tf(self):
        for rows in (1, 7, 100, 1031):
            for n in (1, 2, 3, 7):
                if n > rows:
                    continue
                for scheme in ("div", "mod", "balanced"):
                    layout = PartitionSpec(n, scheme, seed=3 if scheme == "balanced" else 0).bind(rows)
                    all_rows = np.arange(rows)
                    shard, local = layout.shard_of(all_rows), layout.local_of(all_rows)
                    tf_shard, tf_local = layout.route(tf.constant(all_rows, tf.int64))
                    self.assertAllEqual(shard, tf_shard)
                    self.assertAllEqual(local, tf_local)
                    seen = np.zeros(rows, bool)
                    for s in range(n):
                        owned = layout.logical_rows(s)
                        self.assertLen(owned, layout.shard_sizes[s])
                        self.assertAllEqual(owned, layout.logical_rows_tf(s))
                        self.assertAllEqual(shard[owned], np.full(len(owned), s))
                        self.assertAllEqual(local[owned], np.arange(len(owned)))
                        seen[owned] = True
                    self.assertTrue(seen.all())

    def test_uneven_div_splits(self):
        layout = PartitionSpec(3, splits=[1, 5, 4]).bind(10)
        self.assertEqual(layout.offsets, (0, 1, 6, 10))
        self.assertAllEqual(layout.route(tf.constant([0, 1, 5, 6, 9], tf.int64))[0], [0, 1, 1, 2, 2])

    def test_balanced_spreads_hot_ids(self):
        # A vocabulary sorted by frequency: ids 0..999 are the hot ones.
        rows, n = 1_000_000, 4
        hot = np.arange(1000)
        counts = {}
        for scheme in ("div", "balanced"):
            layout = PartitionSpec(n, scheme).bind(rows)
            counts[scheme] = np.bincount(layout.shard_of(hot), minlength=n)
        self.assertEqual(counts["div"].tolist(), [1000, 0, 0, 0])
        self.assertLessEqual(counts["balanced"].max() - counts["balanced"].min(), 2)  # RFC: 250 ± 1 each

    def test_balanced_large_vocabulary_uses_exact_arithmetic(self):
        layout = PartitionSpec(3, "balanced", seed=7).bind(5_000_000_017)
        probe = np.array([0, 1, 2, 5_000_000_016, 123_456_789_01 % 5_000_000_017], np.int64)
        shard, local = layout.route(tf.constant(probe))
        self.assertAllEqual(shard, layout.shard_of(probe))
        back = [layout.logical_rows(int(s), int(r), int(r) + 1)[0] for s, r in zip(shard.numpy(), local.numpy())]
        self.assertAllEqual(back, probe)


class PartitionerTest(tf.test.TestCase):
    def test_ours(self):
        shape = tf.TensorShape([1000, 16])  # 64,000 bytes of float32
        self.assertEqual(tfs.partitioners.FixedShards(3)(shape, tf.float32), [3, 1])
        self.assertEqual(tfs.partitioners.FixedShards(3)(tf.TensorShape([2, 4]), tf.float32), [2, 1])
        self.assertEqual(tfs.partitioners.MinSize(16_000, max_shards=10)(shape, tf.float32), [4, 1])
        self.assertEqual(tfs.partitioners.MinSize(16_000, max_shards=2)(shape, tf.float32), [2, 1])
        self.assertEqual(tfs.partitioners.MaxSize(20_000)(shape, tf.float32), [4, 1])
        self.assertEqual(tfs.partitioners.MaxSize(20_000, max_shards=2)(shape, tf.float32), [2, 1])
        with self.assertRaisesRegex(ValueError, "Argument `num_shards` must be a positive int"):
            tfs.partitioners.FixedShards(0)

    def test_ours_and_tfs_agree_and_both_are_accepted(self):
        shape = tf.TensorShape([1000, 16])
        ours_and_theirs = [
            (
                tfs.partitioners.MinSize(16_000, 10),
                tf.distribute.experimental.partitioners.MinSizePartitioner(16_000, 10),
            ),
            (tfs.partitioners.MaxSize(20_000), tf.distribute.experimental.partitioners.MaxSizePartitioner(20_000)),
            (tfs.partitioners.FixedShards(3), tf.distribute.experimental.partitioners.FixedShardsPartitioner(3)),
        ]
        for ours, theirs in ours_and_theirs:
            self.assertEqual(ours(shape, tf.float32), theirs(shape, tf.float32))
            for p in (ours, theirs):
                table = tfs.create_sharded_variable(f"p{id(p)}", [1000, 16], partitions=p)
                self.assertEqual(table.num_shards, ours(shape, tf.float32)[0])


if __name__ == "__main__":
    tf.test.main()
