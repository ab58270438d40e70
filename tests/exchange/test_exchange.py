"""`tf_sharded.exchange`: the cost model, both transports of each mode, grouping, and the reduction, on 4 devices."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness import graphs
from tests.harness.references import table_values
from tests.harness.steps import squared_norm_step, squared_norm_tables_step
from tests.harness.strategies import TRANSPORTS, mirrored, per_replica, transport, uid
from tf_sharded.exchange import transports

pytestmark = pytest.mark.mirrored

MODES = ("allgather", "dense", "auto")


class ExchangeTest(tf.test.TestCase):
    def test_allgather_exchanges_deduplicated_rows(self):
        strategy = mirrored()
        # 4 replicas, 12 + 3 + 0 + 5 = 20 raw rows, 3 + 3 + 0 + 2 = 8 distinct per replica.
        per_indices = [
            np.array([4, 4, 4, 4, 1, 1, 1, 1, 9, 9, 9, 9]),
            np.array([1, 2, 3]),
            np.zeros([0], np.int64),
            np.array([9, 9, 9, 9, 0]),
        ]
        for name in TRANSPORTS:
            with transport(name):

                @tf.function
                def run(indices):
                    def fn(indices):
                        grad = tf.IndexedSlices(tf.ones([tf.size(indices), 2]), indices, tf.constant([10, 2], tf.int64))
                        merged, gathered = transports.allgather_exchange(grad, tf.distribute.get_replica_context())
                        return merged.indices, merged.values, gathered

                    return strategy.run(fn, args=(indices,))

                indices, values, gathered = run(per_replica(strategy, per_indices))
            for r in range(4):
                self.assertEqual(int(strategy.experimental_local_results(gathered)[r]), 8, msg=name)
                got = dict(
                    zip(
                        strategy.experimental_local_results(indices)[r].numpy().tolist(),
                        strategy.experimental_local_results(values)[r].numpy()[:, 0].tolist(),
                    )
                )
                self.assertEqual(got, {4: 4.0, 1: 5.0, 9: 8.0, 2: 1.0, 3: 1.0, 0: 1.0}, msg=name)

    def test_shard_no_replica_touched_does_not_hang(self):
        # A collective whose every participant sends nothing never completes.
        strategy = mirrored()
        for name in TRANSPORTS:
            with transport(name):

                @tf.function
                def run(indices):
                    def fn(indices):
                        ctx = tf.distribute.get_replica_context()
                        grad = tf.IndexedSlices(tf.ones([tf.size(indices), 2]), indices, tf.constant([10, 2], tf.int64))
                        gathered, _ = transports.allgather_exchange(grad, ctx)
                        adaptive, _ = transports.adaptive_exchange(grad, ctx, 10)
                        return tf.size(gathered.indices), tf.reduce_sum(adaptive.values)

                    return strategy.run(fn, args=(indices,))

                sizes, totals = run(per_replica(strategy, [np.zeros([0], np.int64)] * 4))
            self.assertEqual([int(x) for x in strategy.experimental_local_results(sizes)], [0, 0, 0, 0])
            self.assertEqual([float(x) for x in strategy.experimental_local_results(totals)], [0.0] * 4)

    def step_ops(self, rows, ids_per_replica, exchange, ids_per_step=None, name="in_process"):
        """Op types of a training step's graph, and the op names (to find the exchange's name scopes)."""
        strategy = mirrored()
        with strategy.scope():
            table = strategy.create_sharded_variable(
                uid("g"), [rows, 4], exchange=exchange, ids_per_step=ids_per_step, partitions=1
            )
            optimizer = keras.optimizers.SGD(0.1)

        @tf.function
        def step(ids):
            def fn(ids):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tfs.embedding_lookup(table, ids))
                optimizer.apply_gradients(zip(tape.gradient(loss, list(table.variables)), table.variables))
                return loss

            return strategy.run(fn, args=(ids,))

        ids = per_replica(strategy, [np.arange(ids_per_replica) % rows] * 4)
        with transport(name):
            step(ids)
        nodes = graphs.nodes(step.get_concrete_function(ids))
        return {n.op for n in nodes}, " ".join(n.name for n in nodes)

    def test_each_mode_uses_only_its_exchange(self):
        gather_ops, _ = self.step_ops(1000, 8, "allgather", name="collective")
        self.assertIn("CollectiveGatherV2", gather_ops)
        self.assertNotIn("CollectiveReduceV2", gather_ops)
        dense_ops, _ = self.step_ops(1000, 8, "dense", name="collective")
        self.assertIn("CollectiveReduceV2", dense_ops)
        self.assertNotIn("CollectiveGatherV2", dense_ops)
        # In process the all-gather is a concatenation on one device and one merge: no collective at all.
        gather_ops, gather_names = self.step_ops(1000, 8, "allgather")
        self.assertNotIn("CollectiveGatherV2", gather_ops)
        self.assertNotIn("CollectiveReduceV2", gather_ops)
        self.assertIn("tfs_hash_merge", gather_names)
        dense_ops, dense_names = self.step_ops(1000, 8, "dense")
        self.assertIn("CollectiveReduceV2", dense_ops)
        self.assertNotIn("tfs_hash_merge", dense_names)

    @pytest.mark.slow  # over 4 s here
    def test_auto_picks_each_side_where_it_should(self):
        # Few ids on a large table: gather.  Many ids on a small table: dense.
        for in_process in (False, True):
            kw = {"in_process": in_process}
            self.assertEqual(tfs.exchange.choose(1_000_000, 128, 4, distinct_ids=512, **kw), "allgather")
            self.assertEqual(tfs.exchange.choose(1_000, 128, 4, distinct_ids=5_000, **kw), "dense")
            self.assertEqual(tfs.exchange.choose(1_000, 128, 4, distinct_ids=None, **kw), "allgather")
            even = tfs.exchange.break_even_ids(rows=2000, row_bytes=16, replicas=4, **kw)
            self.assertEqual(tfs.exchange.choose(2000, 16, 4, int(even), **kw), "allgather")
            self.assertEqual(tfs.exchange.choose(2000, 16, 4, int(even) + 1, **kw), "dense")
        # A merge without hashing only pays on a table-sized map: never for few ids on a large table.
        self.assertEqual(tfs.exchange.break_even_ids(10, 16, 4, merge_factor=0.5, in_process=True), float("inf"))
        # Per step, from the observed distinct counts: the collective decides on the largest replica's, in process on
        # the exact number gathered (4 x its per-replica break-even).
        strategy = mirrored()

        @tf.function
        def decide(indices):
            def fn(indices):
                grad = tf.IndexedSlices(tf.ones([tf.size(indices), 4]), indices, tf.constant([2000, 4], tf.int64))
                merged, gathered = transports.adaptive_exchange(grad, tf.distribute.get_replica_context(), 2000)
                return gathered, tf.size(merged.indices), tf.reduce_sum(merged.values)

            return strategy.run(fn, args=(indices,))

        for name in TRANSPORTS:
            even = tfs.exchange.break_even_ids(2000, 16, 4, in_process=name == "in_process")
            over = int(4 * even if name == "in_process" else even) + 50
            few = [np.arange(10), np.arange(5, 15), np.zeros([0], np.int64), np.array([1999])]
            many = [np.arange(over), np.arange(3), np.arange(7), np.zeros([0], np.int64)]
            for arrays, want_gather in ((few, True), (many, False)):
                # Either way only the rows some replica touched come out (a lazy optimizer must not see others).
                want_rows = len(np.unique(np.concatenate(arrays)))
                with transport(name):
                    decide_now = tf.function(decide.python_function)
                    gathered, rows, total = decide_now(per_replica(strategy, arrays))
                for r in range(4):
                    msg = f"{name} gather={want_gather}"
                    self.assertEqual(bool(strategy.experimental_local_results(gathered)[r]), want_gather, msg=msg)
                    self.assertEqual(int(strategy.experimental_local_results(rows)[r]), want_rows, msg=msg)
                    self.assertEqual(
                        float(strategy.experimental_local_results(total)[r]), 4.0 * sum(map(len, arrays)), msg=msg
                    )
        # Collective. A static batch already below the break-even: decided when traced, no runtime decision.
        small, _ = self.step_ops(100_000, 16, "auto", name="collective")
        self.assertIn("CollectiveGatherV2", small)
        self.assertNotIn("CollectiveReduceV2", small)
        # A batch that could cross it: both collectives, the step decides.
        large, _ = self.step_ops(64, 512, "auto", name="collective")
        self.assertIn("CollectiveGatherV2", large)
        self.assertIn("CollectiveReduceV2", large)
        declared, _ = self.step_ops(64, 4, "auto", ids_per_step=5_000, name="collective")
        self.assertIn("CollectiveReduceV2", declared)
        self.assertNotIn("CollectiveGatherV2", declared)
        # In process: a hash merge only, a per-step choice of merge, a densified merge only; never a collective.
        cond_ops = {"If", "StatelessIf"}
        small, _ = self.step_ops(100_000, 16, "auto")
        self.assertFalse(cond_ops & small)
        self.assertNotIn("Cumsum", small)
        large, _ = self.step_ops(64, 512, "auto")
        self.assertTrue(cond_ops & large)
        declared, _ = self.step_ops(64, 4, "auto", ids_per_step=5_000)
        self.assertFalse(cond_ops & declared)
        self.assertIn("Cumsum", declared)
        for ops in (small, large, declared):
            self.assertFalse({"CollectiveGatherV2", "CollectiveReduceV2"} & ops)

    @pytest.mark.slow  # over 4 s here
    def test_auto_switching_between_steps_stays_exact(self):
        strategy = mirrored()
        values = table_values(2000, 4)
        # Below and above the break-even: ~105 distinct ids per replica collective, ~1540 gathered in process.
        for name in TRANSPORTS:
            with strategy.scope():
                table = strategy.create_sharded_variable(uid("sw"), [2000, 4], initializer=values, exchange="auto")
                optimizer = keras.optimizers.SGD(0.1)
            reference, ref_optimizer = tf.Variable(values), keras.optimizers.SGD(0.1)
            step = squared_norm_step(strategy, table, optimizer)
            rng = np.random.RandomState(0)
            for size in (8, 600, 8, 1500):
                arrays = [rng.randint(0, 2000, size=size) for _ in range(4)]
                with transport(name):
                    step(per_replica(strategy, arrays))
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(tf.nn.embedding_lookup(reference, a) ** 2) for a in arrays])
                ref_optimizer.apply_gradients([(tape.gradient(loss, reference), reference)])
                self.assertAllClose(table.numpy(), reference.numpy(), atol=1e-5, msg=f"{name} {size}")

    @pytest.mark.slow  # over 4 s here
    def test_same_width_shards_share_one_exchange(self):
        # Three width-4 tables (2 shards each) and one width-8 table: one all-gather per row shape, and the
        # tables trained as on one device (ids collide across tables and shards only if the offsets are wrong).
        strategy = mirrored()
        widths = {"a": 4, "b": 4, "c": 4, "d": 8}
        values = {k: table_values(30, w, seed=i) for i, (k, w) in enumerate(widths.items())}
        arrays = [np.array([0, 1, 1, 29]), np.array([15, 14, 0]), np.zeros([0], np.int64), np.array([29, 28, 2, 3])]
        references = {k: tf.Variable(v) for k, v in values.items()}
        with tf.GradientTape() as tape:
            loss = tf.add_n(
                [tf.reduce_sum(tf.nn.embedding_lookup(references[k], a) ** 2) for k in widths for a in arrays]
            )
        keras.optimizers.SGD(0.1).apply_gradients(
            zip(tape.gradient(loss, list(references.values())), references.values())
        )
        for name in TRANSPORTS:
            with strategy.scope():
                tables = {
                    k: strategy.create_sharded_variable(
                        uid(k), [30, w], initializer=values[k], exchange="allgather", partitions=2, scheme="mod"
                    )
                    for k, w in widths.items()
                }
                optimizer = keras.optimizers.SGD(0.1)
            step = squared_norm_tables_step(strategy, tables, optimizer)
            ids = per_replica(strategy, arrays)
            with transport(name):
                step(ids)
            for k in widths:
                self.assertAllClose(tables[k].numpy(), references[k].numpy(), atol=1e-6, msg=f"{name} {k}")
            nodes = graphs.nodes(step.get_concrete_function(ids))
            if name == "collective":
                # Per row shape and replica, TF's variable-length gather: one of the lengths, one of the data.
                self.assertEqual(sum(n.op == "CollectiveGatherV2" for n in nodes), 2 * 2 * 4)
            else:
                # One merge per row shape, on one device (not one per shard, not one per replica).
                self.assertEqual(sum(n.op == "Unique" and "tfs_hash_merge" in n.name for n in nodes), 2)

    @pytest.mark.slow  # over 4 s here
    def test_auto_shards_share_three_rendezvous_and_each_decides_alone(self):
        # Collective transport, the per-step "auto" exchange (batch shapes unknown when traced): three tables of
        # one row shape (one of two shards) share one gather of counts, one gather of rows and one all-reduce,
        # while each shard decides for itself. Gather iff the largest replica's distinct count u <= rows / 19
        # (4 replicas, 16-byte rows): at 30 ids the 40-row table goes dense and the others gather; at one id
        # all gather; at 500 ids all go dense. Every step is checked against one device.
        strategy = mirrored()
        sizes = {"small": 40, "mid": 400, "large": 4000}
        values = {k: table_values(n, 4, seed=i) for i, (k, n) in enumerate(sizes.items())}
        references = {k: tf.Variable(v) for k, v in values.items()}
        ref_optimizer = keras.optimizers.SGD(0.1)
        with strategy.scope():
            tables = {
                k: strategy.create_sharded_variable(
                    uid(k), [n, 4], initializer=values[k], exchange="auto", partitions=2 if k == "mid" else 1,
                    scheme="mod",
                )
                for k, n in sizes.items()
            }  # fmt: skip
            optimizer = keras.optimizers.SGD(0.1)
        step = squared_norm_tables_step(strategy, tables, optimizer, ids_for=lambda k, ids: ids % sizes[k])
        rng = np.random.RandomState(3)
        for size in (30, 1, 500, 30):
            arrays = [rng.randint(0, 4000, size=size) for _ in range(4)]
            arrays[2] = arrays[2][: size // 2]  # replicas differ in what they look up
            with transport("collective"):
                step(per_replica(strategy, arrays))
            with tf.GradientTape() as tape:
                loss = tf.add_n(
                    [tf.reduce_sum(tf.nn.embedding_lookup(r, a % sizes[k]) ** 2) for k, r in references.items()
                     for a in arrays]
                )  # fmt: skip
            ref_optimizer.apply_gradients(zip(tape.gradient(loss, list(references.values())), references.values()))
            for k in sizes:
                self.assertAllClose(tables[k].numpy(), references[k].numpy(), atol=1e-5, msg=f"{size} {k}")
        with transport("collective"):
            nodes = graphs.nodes(step.get_concrete_function(per_replica(strategy, arrays)))
        # Per replica: TF's variable-length gather (lengths, then data) of the counts and of the rows, and one
        # all-reduce; per shard these were 4 gathers and 1 all-reduce (16 and 4 here).
        self.assertEqual(sum(n.op == "CollectiveGatherV2" for n in nodes), 4 * 4)
        self.assertEqual(sum(n.op == "CollectiveReduceV2" for n in nodes), 1 * 4)

    def test_eager_strategy_run_matches_reference(self):
        # Outside tf.function nothing is traced: "auto" decides per step (here the densified merge in process).
        strategy = mirrored()
        values = table_values(50, 3)
        arrays = [np.array([1, 1, 2]), np.array([2, 3]), np.zeros([0], np.int64), np.arange(40)]
        reference, ref_optimizer = tf.Variable(values), keras.optimizers.SGD(0.1)
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.nn.embedding_lookup(reference, a) ** 2) for a in arrays])
        ref_optimizer.apply_gradients([(tape.gradient(loss, reference), reference)])
        for mode in MODES:
            for name in TRANSPORTS:
                with strategy.scope():
                    table = strategy.create_sharded_variable(uid("e"), [50, 3], initializer=values, exchange=mode)
                    optimizer = keras.optimizers.SGD(0.1)

                def fn(ids, table=table, optimizer=optimizer):
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_sum(tfs.embedding_lookup(table, ids) ** 2)
                    optimizer.apply_gradients(zip(tape.gradient(loss, list(table.variables)), table.variables))
                    return loss

                with transport(name):
                    strategy.run(fn, args=(per_replica(strategy, arrays),))
                self.assertAllClose(table.numpy(), reference.numpy(), atol=1e-6, msg=f"{mode} {name}")

    def test_custom_loop_reduction_without_keras(self):
        strategy = mirrored()
        with strategy.scope():
            table = strategy.create_sharded_variable(uid("c"), [10, 2], initializer="zeros", exchange="allgather")
            bias = tf.Variable([0.0])

        @tf.function
        def run(ids):
            def fn(ids):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tfs.embedding_lookup(table, ids) + 1.0) + tf.reduce_sum(bias)
                pairs = list(zip(tape.gradient(loss, list(table.variables) + [bias]), list(table.variables) + [bias]))
                reduced = tfs.exchange.all_reduce_gradients(pairs)
                return reduced[0][0].indices, reduced[0][0].values, reduced[1][0]

            return strategy.run(fn, args=(ids,))

        indices, values, bias_grad = run(
            per_replica(strategy, [np.array([1, 1]), np.array([1]), np.array([3]), np.zeros([0], np.int64)])
        )
        got = dict(
            zip(
                strategy.experimental_local_results(indices)[2].numpy().tolist(),
                strategy.experimental_local_results(values)[2].numpy()[:, 0].tolist(),
            )
        )
        self.assertEqual(got, {1: 3.0, 3: 1.0})
        self.assertAllEqual(strategy.experimental_local_results(bias_grad)[0], [4.0])
