"""`tf_sharded.table.lookup` and `tf_sharded.trace`: fused feature lookups, export substitution, the trace record."""

import threading

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.graphs import op_types
from tests.harness.references import table_values
from tests.harness.strategies import uid
from tf_sharded import trace
from tf_sharded.table import lookup


def make(rows, dim, partitions=3, scheme="mod", seed=0, dtype=tf.float32):
    values = table_values(rows, dim, seed).astype(dtype.as_numpy_dtype)
    table = tfs.create_sharded_variable(
        uid("lk"), [rows, dim], dtype=dtype, initializer=values, partitions=partitions, scheme=scheme
    )
    return table, tf.Variable(values)


class LookupFeaturesTest(tf.test.TestCase):
    def test_outputs_and_gradients_match_separate_plain_lookups(self):
        users, ref_users = make(30, 4)
        items, ref_items = make(20, 4, partitions=2, scheme="div", seed=1)
        tags, ref_tags = make(9, 2, partitions=1, seed=2)
        dense = tf.constant([[3, 3], [29, 0]], tf.int64)
        ragged = tf.ragged.constant([[1, 19, 19], [], [4]], dtype=tf.int64)
        weights = tf.ragged.constant([[1.0, 0.5, 2.0], [], [3.0]])
        sparse = tf.ragged.constant([[0, 8], [8]], dtype=tf.int64).to_sparse()

        def ours():
            return lookup.lookup_features(
                [
                    lookup.FeatureLookup(users, dense),
                    lookup.FeatureLookup(items, ragged, "mean", weights),
                    lookup.FeatureLookup(items, tf.constant([5, 5], tf.int64)),  # same table again
                    lookup.FeatureLookup(tags, sparse, "sqrtn"),
                ]
            )

        def theirs():
            return [
                tf.nn.embedding_lookup(ref_users, dense),
                tf.nn.embedding_lookup_sparse(ref_items, ragged.to_sparse(), weights.to_sparse(), combiner="mean"),
                tf.nn.embedding_lookup(ref_items, [5, 5]),
                tf.nn.embedding_lookup_sparse(ref_tags, sparse, None, combiner="sqrtn"),
            ]

        scale = [tf.constant(np.random.RandomState(i).randn(*s).astype(np.float32)) for i, s in
                 enumerate([(2, 2, 4), (3, 4), (2, 4), (2, 2)])]  # fmt: skip

        with tf.GradientTape() as tape:
            got = ours()
            loss = sum(tf.reduce_sum(g * s) for g, s in zip(got, scale))
        grads = tape.gradient(loss, list(users.variables) + list(items.variables) + list(tags.variables))
        with tf.GradientTape() as tape:
            want = theirs()
            ref_loss = sum(tf.reduce_sum(w * s) for w, s in zip(want, scale))
        ref_grads = tape.gradient(ref_loss, [ref_users, ref_items, ref_tags])
        for g, w in zip(got, want):
            self.assertAllClose(g, w, atol=1e-6)
        # Shard gradients, put back in logical order, are the plain tables' gradients.
        k = 0
        for table, ref_grad in zip((users, items, tags), ref_grads):
            logical = np.zeros(table.shape, np.float32)
            for shard in range(table.num_shards):
                g = grads[k + shard]
                self.assertIsInstance(g, tf.IndexedSlices)
                rows = table.layout.logical_rows(shard)[g.indices.numpy()]
                np.add.at(logical, rows, g.values.numpy())
            k += table.num_shards
            self.assertAllClose(logical, tf.convert_to_tensor(ref_grad), atol=1e-6)

    def test_tables_of_one_row_shape_share_one_routing(self):
        a, _ = make(30, 4)
        b, _ = make(20, 4, seed=1)
        fn = tf.function(
            lambda x, y: lookup.lookup_features([lookup.FeatureLookup(a, x), lookup.FeatureLookup(b, y)])
        ).get_concrete_function(tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64))
        uniques = [op for op in fn.graph.get_operations() if op.type == "UniqueV2" or op.type == "Unique"]
        self.assertLen(uniques, 1)  # one de-duplication over both tables' ids
        self.assertIn("ResourceGather", op_types(fn))

    def test_bad_requests(self):
        table, _ = make(10, 2)
        with self.assertRaisesRegex(ValueError, "Argument `combiner` must be one of"):
            lookup.lookup_features([lookup.FeatureLookup(table, tf.ragged.constant([[1]], tf.int64), "max")])
        with self.assertRaisesRegex(TypeError, "Argument `history` must be a tf.SparseTensor or tf.RaggedTensor"):
            lookup.lookup_features([lookup.FeatureLookup(table, tf.constant([[1]]), "sum", arg="history")])
        with self.assertRaisesRegex(TypeError, r"Argument `weights` must have the same structure as `ids` \(ragged\)"):
            ids = tf.ragged.constant([[1, 2]], tf.int64)
            lookup.lookup_features([lookup.FeatureLookup(table, ids, "sum", ids.to_sparse())])

    def test_substituted_reads_the_plain_variable(self):
        table, _ = make(10, 2)
        plain = tf.Variable(tf.fill([10, 2], 7.0))
        with lookup.substituted({id(table): plain}):
            inside = tfs.embedding_lookup(table, [1, 9])
        self.assertAllEqual(inside, [[7.0, 7.0], [7.0, 7.0]])
        self.assertAllEqual(tfs.embedding_lookup(table, [1]), table.numpy()[[1]])


class TraceTest(tf.test.TestCase):
    def test_lookups_are_recorded_per_trace(self):
        table, _ = make(10, 2)
        seen = {}

        @tf.function
        def twice(ids):
            tfs.embedding_lookup(table, ids)
            seen["after_one"] = (trace.single_lookup(table), trace.traced_ids(table))
            tfs.embedding_lookup(table, tf.constant([1, 2, 3]))
            seen["after_two"] = (trace.single_lookup(table), trace.traced_ids(table))
            return tf.constant(0)

        twice.get_concrete_function(tf.TensorSpec([4], tf.int64))
        self.assertEqual(seen, {"after_one": (True, 4), "after_two": (False, 7)})
        twice.get_concrete_function(tf.TensorSpec([None], tf.int64))  # a new trace starts a new record
        self.assertEqual(seen["after_one"], (True, None))
        self.assertEqual(seen["after_two"], (False, None))

    def test_nothing_is_recorded_eagerly_or_for_other_threads(self):
        table, _ = make(10, 2)
        tfs.embedding_lookup(table, [1])
        self.assertFalse(trace.single_lookup(table))
        self.assertIsNone(trace.traced_ids(table))
        other = {}

        @tf.function
        def step():
            tfs.embedding_lookup(table, tf.constant([1, 2]))
            thread = threading.Thread(target=lambda: other.update(single=trace.single_lookup(table)))
            thread.start()
            thread.join()
            other["here"] = trace.single_lookup(table)
            return tf.constant(0)

        step()
        self.assertEqual(other, {"single": False, "here": True})

    def test_each_thread_in_one_trace_starts_its_own_record(self):
        # As steps unrolled in one function, each a `strategy.run` whose replicas trace in threads of their own:
        # a thread that looks up after an earlier one ended (whose id the system often hands on) starts afresh.
        table, _ = make(10, 2)
        seen, idents = [], []

        def replica(graph, ids):
            with graph.as_default():  # a thread's default graph is its own: given, as replicas get theirs
                tfs.embedding_lookup(table, ids)
                seen.append((trace.single_lookup(table), trace.traced_ids(table)))
            idents.append(threading.get_ident())

        @tf.function
        def unrolled(ids):
            for _ in range(3):
                thread = threading.Thread(target=replica, args=(tf.compat.v1.get_default_graph(), ids))
                thread.start()
                thread.join()
            return tf.constant(0)

        unrolled.get_concrete_function(tf.TensorSpec([4], tf.int64))
        self.assertEqual(seen, [(True, 4)] * 3, f"thread ids {idents}")

    def test_unrolled_mirrored_steps_each_see_their_own_lookups(self):
        # Two `strategy.run` calls in one function, as `tfs.fit` unrolls `steps_per_execution` where replicas
        # meet: the exchange of each step sees the lookup of that step only.
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            table, _ = make(10, 2)
        seen = []

        def step(ids):
            tfs.embedding_lookup(table, ids)
            seen.append((trace.single_lookup(table), trace.traced_ids(table)))
            return tf.constant(0)

        @tf.function
        def two_steps(ids):
            strategy.run(step, (ids,))
            return strategy.run(step, (ids,))

        two_steps.get_concrete_function(tf.TensorSpec([4], tf.int64))
        self.assertEqual(seen, [(True, 4), (True, 4)])
