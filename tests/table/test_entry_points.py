"""TensorFlow's embedding entry points on a `tfs.ShardedVariable`, against TF's own ops on a plain variable.

Each case runs the same TF call on the sharded table (3 uneven `div`
shards) and on a `tf.Variable` holding the same values, and compares the
results and the gradients (per shard, concatenated into the logical table).
"""

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import uid

ROWS, DIM = 10, 3


def sparse(indices, values, shape, dtype=tf.int64):
    return tf.SparseTensor(indices, tf.constant(values, dtype), shape)


IDS = sparse([[0, 0], [0, 1], [1, 0], [1, 2], [2, 0], [3, 1]], [1, 9, -1, 4, 4, 0], [4, 3])
WEIGHTS = sparse([[0, 0], [0, 1], [1, 0], [1, 2], [2, 0], [3, 1]], [1.0, 2.0, 3.0, 0.0, 0.5, -1.0], [4, 3], tf.float32)
VALID = sparse([[0, 0], [0, 1], [1, 0], [1, 2], [2, 0], [3, 1]], [1, 9, 2, 4, 4, 0], [4, 3])
RANK3 = sparse([[0, 0, 0], [0, 1, 0], [0, 1, 1], [1, 0, 1]], [1, 3, 3, 8], [2, 2, 2])
RANK3_WEIGHTS = sparse([[0, 0, 0], [0, 1, 0], [0, 1, 1], [1, 0, 1]], [1.0, 2.0, 0.5, 4.0], [2, 2, 2], tf.float32)


class TensorFlowEntryPointsTest(tf.test.TestCase):
    def setUp(self):
        super().setUp()
        self.values = np.random.RandomState(0).rand(ROWS, DIM).astype(np.float32)
        self.table = tfs.create_sharded_variable(uid("entry"), [ROWS, DIM], initializer=self.values, partitions=3)
        self.plain = tf.Variable(self.values)

    def same(self, call, **kw):
        """`call(params)` on the sharded table and on the plain variable: equal results and gradients."""
        with tf.GradientTape(persistent=True) as tape:
            ours, theirs = call(self.table), call(self.plain)
            if isinstance(ours, tf.RaggedTensor):
                self.assertIsInstance(theirs, tf.RaggedTensor)
                ours, theirs = ours.flat_values, theirs.flat_values
            scale = tf.reshape(tf.range(1, tf.size(theirs) + 1, dtype=tf.float32), tf.shape(theirs))
            loss_ours, loss_theirs = tf.reduce_sum(ours * scale), tf.reduce_sum(theirs * scale)
        self.assertAllClose(ours, theirs, **kw)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss_ours, list(self.table.variables))]
        self.assertAllClose(tf.concat(grads, 0), tf.convert_to_tensor(tape.gradient(loss_theirs, self.plain)), **kw)

    def test_safe_embedding_lookup_sparse_every_combiner_weights_default_id_and_rank_3(self):
        for combiner in ("sum", "mean", "sqrtn"):
            for default_id in (None, 7):
                for weights in (None, WEIGHTS):
                    with self.subTest(combiner=combiner, default_id=default_id, weights=weights is not None):
                        self.same(lambda p: tf.nn.safe_embedding_lookup_sparse(
                            p, IDS, weights, combiner=combiner, default_id=default_id))  # fmt: skip
                        self.same(lambda p: tf.compat.v1.nn.safe_embedding_lookup_sparse(
                            [p], IDS, weights, combiner=combiner, default_id=default_id))  # fmt: skip
            self.same(lambda p: tf.nn.safe_embedding_lookup_sparse(p, RANK3, RANK3_WEIGHTS, combiner=combiner))
            ragged_ids = tf.ragged.constant([[1, 9], [-1, 4], [4], [0], []], dtype=tf.int64)
            ragged_weights = tf.ragged.constant([[1.0, 2.0], [3.0, 0.0], [0.5], [-1.0], []])
            self.same(lambda p: tf.nn.safe_embedding_lookup_sparse(p, ragged_ids, ragged_weights, combiner=combiner))
        self.same(lambda p: tf.nn.safe_embedding_lookup_sparse(p, IDS, max_norm=0.5))
        self.same(lambda p: tf.function(tf.nn.safe_embedding_lookup_sparse)(p, IDS, WEIGHTS, "sqrtn", 2))

    def test_lookup_and_lookup_sparse_forms(self):
        ids = tf.constant([[1, 9], [4, 4]], tf.int64)
        self.same(lambda p: tf.compat.v1.nn.embedding_lookup(p, ids, partition_strategy="div"))
        self.same(lambda p: tf.nn.embedding_lookup([p], ids, max_norm=0.8))
        self.same(lambda p: tf.nn.embedding_lookup(p, tf.ragged.constant([[1, 2, 9], [], [4]], dtype=tf.int64)))
        # RaggedTensor ids through the compat.v1 forms, where TF has its own ragged targets.
        ragged_ids = tf.ragged.constant([[1, 9], [], [2, 4], [4], [0]], dtype=tf.int64)
        ragged_weights = tf.ragged.constant([[1.0, 2.0], [], [3.0, 0.5], [0.5], [-1.0]])
        self.same(lambda p: tf.compat.v1.nn.embedding_lookup(p, ragged_ids))
        self.same(lambda p: tf.compat.v1.nn.embedding_lookup_sparse(p, ragged_ids, ragged_weights, combiner="sqrtn"))
        self.same(lambda p: tf.compat.v1.nn.safe_embedding_lookup_sparse(p, ragged_ids, ragged_weights, default_id=3))
        self.same(lambda p: tf.compat.v1.nn.safe_embedding_lookup_sparse(p, ragged_ids[:2], None))
        for combiner in ("sum", "mean", "sqrtn"):
            self.same(lambda p: tf.compat.v1.nn.embedding_lookup_sparse(p, VALID, WEIGHTS, combiner=combiner))
            self.same(lambda p: tf.nn.embedding_lookup_sparse([p], VALID, None, combiner=combiner))
            # Rank 3: combined per first index, as TensorFlow does.
            self.same(lambda p: tf.nn.embedding_lookup_sparse(p, RANK3, RANK3_WEIGHTS, combiner=combiner))

    def test_max_norm_clips_the_scalar_rows_of_a_rank_1_table(self):
        values = np.arange(-5.0, 5.0, dtype=np.float32)
        table = tfs.create_sharded_variable(uid("scalars"), [10], initializer=values, partitions=2)
        ids = tf.constant([0, 3, 9, 8], tf.int64)
        self.assertAllClose(
            tf.nn.embedding_lookup(table, ids, max_norm=2.0),
            tf.nn.embedding_lookup(tf.constant(values), ids, max_norm=2.0),
        )
        self.assertAllClose(tfs.embedding_lookup(table, ids, max_norm=2.0), [-2.0, -2.0, 2.0, 2.0])

    def test_bad_arguments_are_refused_when_tracing(self):
        short = sparse([[0, 0], [0, 1]], [1.0, 2.0], [4, 3], tf.float32)
        lookup = tf.function(lambda p: tf.nn.embedding_lookup_sparse(p, VALID, short))
        with self.assertRaisesRegex(
            ValueError, r"must have one weight per id: its values have shape \[2\], the ids' \[6\]"
        ):
            lookup(self.table)
        with self.assertRaises(ValueError):  # TensorFlow refuses the same call on a plain variable
            lookup(self.plain)
        with self.assertRaisesRegex(ValueError, "a list holding one .* Received: a list of 2 tables"):
            tf.nn.embedding_lookup([self.table, self.table], [1])
        with self.assertRaisesRegex(TypeError, "Argument `sparse_ids` must be a tf.SparseTensor or tf.RaggedTensor"):
            tf.nn.safe_embedding_lookup_sparse(self.table, tf.constant([[1]], dtype=tf.int64))
        with self.assertRaisesRegex(TypeError, "Argument `sparse_weights` must be None or of the type of"):
            tf.nn.safe_embedding_lookup_sparse(self.table, IDS, tf.ragged.constant([[1.0]]))


if __name__ == "__main__":
    tf.test.main()
