"""A table larger than 2 GB is created shard by shard on the parameter servers."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tf_sharded import initializers

pytestmark = pytest.mark.ps_cluster

ROWS, DIM = 8_500_000, 64  # 2.18 GB of float32: over the 2 GB GraphDef/constant limit


class LargeTableTest(tf.test.TestCase):
    @pytest.mark.slow  # over 5 s here
    def test_table_over_2gb_initialises_per_shard_and_serves_rows(self):
        strategy = tfs.cluster.local_cluster(num_workers=2, num_ps=2).strategy()
        with strategy.scope():
            table = strategy.create_sharded_variable("big", [ROWS, DIM], partitions=3, scheme="mod", seed=1)
        self.assertGreater(ROWS * DIM * 4, 2**31)
        self.assertTrue(all(d.startswith("/job:ps/") for d in table.devices))
        ids = tf.constant([0, ROWS - 1, ROWS // 2, 1, ROWS - 1], tf.int64)
        # Reference: the logical table's definition, evaluated for these rows only.
        want = initializers.resolve("uniform", [ROWS, DIM], tf.float32, 1).rows(ids, [ROWS, DIM], tf.float32)
        self.assertAllEqual(tfs.embedding_lookup(table, ids), want)
        table.scatter_add(tf.IndexedSlices(tf.ones([1, DIM]), tf.constant([ROWS - 1])))
        self.assertAllClose(tfs.embedding_lookup(table, [ROWS - 1])[0], want[1] + 1.0)
        self.assertBetween(float(np.abs(want.numpy()).max()), 0.0, 0.05)
        del table


if __name__ == "__main__":
    tf.test.main()
