"""The training path never reads or concatenates a whole table."""

import tensorflow as tf

import tf_sharded as tfs
from tests.harness.graphs import whole_table_reads
from tests.harness.strategies import uid


class GraphTest(tf.test.TestCase):
    rows = 1009

    def step_fn(self, table, lookup):
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(lookup(table, ids) ** 2)
            grads = tape.gradient(loss, list(table.variables))
            for v, g in zip(table.variables, grads):
                v.scatter_sub(tf.IndexedSlices(0.1 * g.values, g.indices, g.dense_shape))
            return loss

        return tf.function(step).get_concrete_function(tf.TensorSpec([None, 3], tf.int64))

    def test_lookup_and_update_step_touches_rows_only(self):
        for scheme in ("div", "mod", "balanced"):
            table = tfs.create_sharded_variable(uid("g"), [self.rows, 8], partitions=3, scheme=scheme)
            fn = self.step_fn(table, tfs.embedding_lookup)
            self.assertEqual(whole_table_reads(fn, min(table.layout.shard_sizes)), [], msg=scheme)
            sparse = tf.function(
                lambda ids: tfs.embedding_lookup_sparse(table, ids, combiner="sqrtn")
            ).get_concrete_function(tf.RaggedTensorSpec([None, None], tf.int64, 1))
            self.assertEqual(whole_table_reads(sparse, min(table.layout.shard_sizes)), [])

    def test_checker_catches_a_full_read(self):
        # The same step through read_value() must be flagged, so the test above can fail.
        table = tfs.create_sharded_variable(uid("g"), [self.rows, 8], partitions=3)
        fn = self.step_fn(table, lambda t, ids: tf.nn.embedding_lookup(t.read_value(), ids))
        self.assertNotEqual(whole_table_reads(fn, min(table.layout.shard_sizes)), [])


if __name__ == "__main__":
    tf.test.main()
