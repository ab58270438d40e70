"""MirroredStrategy on 4 virtual CPUs: mirrored tables and gradient exchange."""

from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.strategy_bodies import squared_norm_step, table_values, uid
from tests.subprocs import run_python

pytestmark = pytest.mark.mirrored

DEVICES = [f"/cpu:{i}" for i in range(4)]

# Restores a mirrored checkpoint on a PS cluster, checks it, saves 3x the values back.
PS_ROUND_TRIP = """
import sys, numpy as np, tensorflow as tf, tf_sharded as tfs
strategy = tfs.cluster.local_cluster(num_workers=1, num_ps=2).strategy()
with strategy.scope():
    t = strategy.create_sharded_variable("t", [17, 3], initializer="zeros", partitions=3, scheme="mod")
tf.train.Checkpoint(t=t).restore(sys.argv[1]).assert_existing_objects_matched()
want = np.random.RandomState(0).uniform(-1, 1, size=(17, 3)).astype(np.float32)
assert np.array_equal(t.numpy(), want), t.numpy()
t.assign(want * 3)
tf.train.CheckpointManager(tf.train.Checkpoint(t=t), sys.argv[2], 1).save()
print("PS restored OK")
"""
MODES = ("allgather", "dense", "auto")
PLACEMENTS = ("device", "host")
# In process: gather on one device and merge once (MirroredStrategy's default); else the collective transport
# MultiWorkerMirroredStrategy uses (markers, per-replica merge), exercised here on the same 4 devices.
TRANSPORTS = {"in_process": True, "collective": False}


def transport(name):
    return mock.patch.object(tfs.exchange, "MERGE_IN_PROCESS", TRANSPORTS[name])


_STRATEGY = []


def mirrored():
    # One instance per process: two MirroredStrategy objects on the same devices
    # reuse collective instance keys and abort each other's collectives.
    if not _STRATEGY:
        _STRATEGY.append(tf.distribute.MirroredStrategy(DEVICES))
    return _STRATEGY[0]


def per_replica(strategy, arrays):
    """One array per replica (arrays may differ in length; empty ones allowed)."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(arrays[ctx.replica_id_in_sync_group])
    )


def graph_op_types(concrete_fn):
    graph_def = concrete_fn.graph.as_graph_def()
    types = {n.op for n in graph_def.node}
    for fn in graph_def.library.function:
        types |= {n.op for n in fn.node_def}
    return types


class MirroredTrainingTest(tf.test.TestCase):
    rows, dim = 40, 3
    # Per replica: duplicates everywhere, one replica with no ids at all.
    batches = [
        [
            np.array([[1, 1, 1], [1, 1, 1]]),
            np.array([[2, 3, 4], [39, 39, 0]]),
            np.zeros([0, 3], np.int64),
            np.array([[7, 7, 8], [1, 2, 3]]),
        ],
        [
            np.array([[5, 5, 5], [5, 5, 5]]),
            np.zeros([0, 3], np.int64),
            np.array([[5, 6, 7], [8, 9, 5]]),
            np.array([[0, 0, 0], [39, 1, 1]]),
        ],
        [np.array([[11, 12, 13], [14, 15, 16]])] * 4,
    ]

    def test_keras_optimizer_steps_match_single_device_reference(self):
        strategy = mirrored()
        values = table_values(self.rows, self.dim)
        head0 = np.random.RandomState(1).randn(self.dim, 1).astype(np.float32)
        labels = np.array([[1.0], [0.0]], np.float32)
        combos = [(m, p, "in_process") for m in MODES for p in PLACEMENTS]
        combos += [(m, "device", "collective") for m in MODES]
        for mode, placement, name in combos:
            with transport(name):
                with strategy.scope():
                    table = strategy.create_sharded_variable(
                        uid("m"),
                        [self.rows, self.dim],
                        initializer=values,
                        partitions=3,
                        scheme="mod",
                        exchange=mode,
                        placement=placement,
                    )
                    head = tf.Variable(head0)
                    optimizer = keras.optimizers.SGD(0.5)
                ref_table, ref_head = tf.Variable(values), tf.Variable(head0)
                ref_optimizer = keras.optimizers.SGD(0.5)

                def loss_fn(emb, w, n_examples):
                    logits = tf.matmul(tf.reduce_mean(emb, axis=1), w)
                    per_example = tf.nn.sigmoid_cross_entropy_with_logits(
                        tf.constant(labels)[: tf.shape(logits)[0]], logits
                    )
                    # Global-batch mean: the sum over replicas equals the reference loss.
                    return tf.reduce_sum(per_example) / n_examples

                @tf.function
                def step(ids, n_examples):
                    def replica_fn(ids):
                        with tf.GradientTape() as tape:
                            loss = loss_fn(tfs.embedding_lookup(table, ids), head, n_examples)
                        variables = list(table.variables) + [head]
                        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
                        return loss

                    return strategy.run(replica_fn, args=(ids,))

                for arrays in self.batches:
                    n = float(sum(len(a) for a in arrays))
                    step(per_replica(strategy, arrays), tf.constant(n))
                    with tf.GradientTape() as tape:
                        loss = tf.add_n([loss_fn(tf.nn.embedding_lookup(ref_table, a), ref_head, n) for a in arrays])
                    grads = tape.gradient(loss, [ref_table, ref_head])
                    ref_optimizer.apply_gradients(zip(grads, [ref_table, ref_head]))
                msg = f"{mode} {placement} {name}"
                self.assertAllClose(table.numpy(), ref_table.numpy(), atol=1e-6, msg=msg)
                self.assertAllClose(head.numpy(), ref_head.numpy(), atol=1e-6, msg=msg)
                self.assertEqual(table.placement, placement)
                if placement == "host":
                    self.assertTrue(all(not hasattr(v, "values") for v in table.variables))
                    self.assertTrue(all(d.endswith("CPU:0") for d in table.devices))
                else:
                    self.assertTrue(all(len(v.values) == 4 for v in table.variables))


class MirroredGraphTest(tf.test.TestCase):
    def test_step_reads_rows_not_whole_tables(self):
        # A mirrored variable has no sparse_read (tf.gather on it reads it whole), and any attribute it does
        # not have is forwarded to a full read in cross-replica context: neither may happen in a step.
        strategy = mirrored()
        rows = 1009
        for placement in ("device", "host"):
            tables = {
                "a": {"input_dim": rows, "output_dim": 4, "placement": placement, "exchange": "allgather"},
                "b": {"input_dim": rows + 2, "output_dim": 4, "placement": placement, "exchange": "dense"},
            }
            with strategy.scope():
                layer = tfs.layers.EmbeddingCollection(tables, {"fa": "a", "fb": "b"}, name=uid("graph"))
                layer.build()
                optimizer = tfs.optimizers.Adagrad(0.1)
                optimizer.build(layer.trainable_variables)

            @tf.function
            def step(ids):
                def fn(ids):
                    with tf.GradientTape() as tape:
                        loss = tf.add_n([tf.reduce_sum(v**2) for v in layer(ids).values()])
                    grads = tape.gradient(loss, layer.trainable_variables)
                    optimizer.apply_gradients(zip(grads, layer.trainable_variables))
                    return loss

                return strategy.run(fn, args=(ids,))

            ids = {"fa": tf.constant([1, 2, 2], tf.int64), "fb": tf.constant([0, 5, 9], tf.int64)}
            step(ids)
            graph = step.get_concrete_function(ids).graph
            full = [
                f"{op.type} {op.name}"
                for op in graph.get_operations()
                if op.type == "ReadVariableOp" and op.outputs[0].shape.rank == 2 and op.outputs[0].shape[0] >= rows
            ]
            self.assertEqual(full, [], msg=placement)
            self.assertNotEmpty([op for op in graph.get_operations() if op.type == "ResourceGather"])


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
                        merged, gathered = tfs.exchange.allgather_exchange(grad, tf.distribute.get_replica_context())
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
                        gathered, _ = tfs.exchange.allgather_exchange(grad, ctx)
                        adaptive, _ = tfs.exchange.adaptive_exchange(grad, ctx, 10)
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
        graph_def = step.get_concrete_function(ids).graph.as_graph_def()
        nodes = list(graph_def.node) + [n for fn in graph_def.library.function for n in fn.node_def]
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
                merged, gathered = tfs.exchange.adaptive_exchange(grad, tf.distribute.get_replica_context(), 2000)
                return gathered, tf.size(merged.indices), tf.reduce_sum(merged.values)

            return strategy.run(fn, args=(indices,))

        for name in TRANSPORTS:
            even = tfs.exchange.break_even_ids(2000, 16, 4, in_process=TRANSPORTS[name])
            over = int(4 * even if TRANSPORTS[name] else even) + 50
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
            variables = [v for t in tables.values() for v in t.variables]

            @tf.function
            def step(ids):
                def fn(ids):
                    with tf.GradientTape() as tape:
                        loss = tf.add_n([tf.reduce_sum(tfs.embedding_lookup(t, ids) ** 2) for t in tables.values()])
                    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
                    return loss

                return strategy.run(fn, args=(ids,))

            ids = per_replica(strategy, arrays)
            with transport(name):
                step(ids)
            for k in widths:
                self.assertAllClose(tables[k].numpy(), references[k].numpy(), atol=1e-6, msg=f"{name} {k}")
            graph_def = step.get_concrete_function(ids).graph.as_graph_def()
            nodes = list(graph_def.node) + [n for fn in graph_def.library.function for n in fn.node_def]
            if name == "collective":
                # Per row shape and replica, TF's variable-length gather: one of the lengths, one of the data.
                self.assertEqual(sum(n.op == "CollectiveGatherV2" for n in nodes), 2 * 2 * 4)
            else:
                # One merge per row shape, on one device (not one per shard, not one per replica).
                self.assertEqual(sum(n.op == "Unique" and "tfs_hash_merge" in n.name for n in nodes), 2)

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


class MirroredCheckpointAndArgumentTest(tf.test.TestCase):
    def test_checkpoints_cross_strategies(self):
        strategy = mirrored()
        values = table_values(17, 3)
        for placement in PLACEMENTS:
            with strategy.scope():
                table = strategy.create_sharded_variable(
                    uid("ck"), [17, 3], initializer=values, partitions=2, scheme="balanced", placement=placement
                )
            path = tf.train.Checkpoint(t=table).save(self.get_temp_dir() + f"/{uid('m')}")
            local = tfs.create_sharded_variable(uid("l"), [17, 3], initializer="zeros", partitions=3, scheme="mod")
            tf.train.Checkpoint(t=local).restore(path)
            self.assertAllEqual(local.numpy(), values)
            # The parameter-server side runs in its own process (see conftest.py).
            back_path = self.get_temp_dir() + f"/{uid('ps')}"
            proc = run_python(["-c", PS_ROUND_TRIP, path, back_path], timeout=240)
            self.assertEqual(proc.returncode, 0, msg=proc.stderr[-3000:])
            self.assertIn("PS restored OK", proc.stdout)
            with strategy.scope():
                back = strategy.create_sharded_variable(
                    uid("b"), [17, 3], initializer="zeros", partitions=1, placement=placement
                )
            tf.train.Checkpoint(t=back).restore(tf.train.latest_checkpoint(back_path))
            self.assertAllEqual(back.numpy(), values * 3)
            if placement == "device":
                for component in back.variables[0].values:
                    self.assertAllEqual(component.numpy(), values * 3)

    def test_same_seed_same_table_as_default_strategy(self):
        strategy = mirrored()
        with strategy.scope():
            a = strategy.create_sharded_variable(uid("s"), [30, 4], partitions=3, scheme="mod", seed=7)
        b = tfs.create_sharded_variable(uid("s"), [30, 4], seed=7)
        self.assertAllEqual(a.numpy(), b.numpy())

    def test_chunked_init_writes_each_copy(self):
        # A mirrored variable's own scatter in cross-replica context reads it back whole, so each chunk's write
        # copied the shard (B3: ~2 shard copies left pooled per table). Initialisation writes each copy instead.
        from tensorflow.python.distribute import values as tf_values

        strategy = mirrored()
        refuse = mock.patch.object(tf_values.MirroredVariable, "scatter_update", side_effect=AssertionError("whole"))
        for scheme in ("div", "mod"):
            with mock.patch.object(tfs.creation, "CHUNK_ELEMENTS", 64), refuse, strategy.scope():
                table = strategy.create_sharded_variable(
                    uid("ch"), [100, 4], partitions=2, scheme=scheme, seed=3, placement="device"
                )
            plain = tfs.create_sharded_variable(uid("ch"), [100, 4], partitions=2, scheme=scheme, seed=3)
            for shard, want in zip(table.variables, plain.variables):
                self.assertLen(shard.values, 4)
                for copy in shard.values:
                    self.assertAllEqual(copy.numpy(), want.numpy(), msg=scheme)

    def test_bad_arguments(self):
        strategy = mirrored()
        with strategy.scope():
            with self.assertRaisesRegex(ValueError, "Argument `exchange` must be one of"):
                strategy.create_sharded_variable(uid("x"), [4, 2], exchange="ring")
            with self.assertRaisesRegex(ValueError, "Argument `placement` must be one of"):
                strategy.create_sharded_variable(uid("x"), [4, 2], placement="tpu")
            with self.assertRaisesRegex(ValueError, "Argument `ids_per_step` must be a positive int"):
                strategy.create_sharded_variable(uid("x"), [4, 2], ids_per_step=0)
        with self.assertRaisesRegex(ValueError, "Argument `exchange` must be one of"):
            tfs.strategy.mirrored.set_default_exchange(strategy, "fast")
        tfs.strategy.mirrored.set_default_exchange(strategy, "dense")
        try:
            with strategy.scope():
                self.assertEqual(strategy.create_sharded_variable(uid("x"), [4, 2]).exchange.mode, "dense")
        finally:
            tfs.strategy.mirrored.set_default_exchange(strategy, "auto")

    def test_auto_placement_by_size(self):
        from tf_sharded.strategy import mirrored as hook

        self.assertEqual(hook.resolve_placement("auto", hook.HOST_PLACEMENT_BYTES + 1), "host")
        self.assertEqual(hook.resolve_placement(None, 1024), "device")


if __name__ == "__main__":
    tf.test.main()
