"""MirroredStrategy on 4 virtual CPUs (`strategy/mirrored.py`): placement, training against references, checkpoints."""

from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.bodies import StrategyBodies
from tests.harness.references import table_values
from tests.harness.steps import squared_norm_collection_step
from tests.harness.strategies import PLACEMENTS, mirrored, per_replica, transport, uid
from tf_sharded.table import builder

pytestmark = pytest.mark.mirrored

MODES = ("allgather", "dense", "auto")


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

    @pytest.mark.slow  # over 5 s here
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

            step = squared_norm_collection_step(strategy, layer, optimizer)
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


class MirroredCheckpointAndArgumentTest(tf.test.TestCase):
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
            with mock.patch.object(builder, "CHUNK_ELEMENTS", 64), refuse, strategy.scope():
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


class MirroredReplicaBodiesTest(StrategyBodies, tf.test.TestCase):
    """The shared bodies in replica context (`strategy.run`), tables mirrored on every device."""

    table_kwargs = {"placement": "device"}
    schemes = ("balanced",)

    @property
    def strategy(self):
        return mirrored()

    def execute(self, fn, *args):
        results = self.strategy.experimental_local_results(self.strategy.run(fn, args=args))
        for other in results[1:]:
            self.assertAllClose(tf.nest.map_structure(np.asarray, other), tf.nest.map_structure(np.asarray, results[0]))
        return results[0]


class MirroredHostReplicaBodiesTest(MirroredReplicaBodiesTest):
    """The same with one copy of each table in host memory."""

    table_kwargs = {"placement": "host"}
    # A host shard is one plain variable: a raw scatter from replica context runs once per replica, as it does
    # on any unmirrored variable. Optimizers apply host updates once (MirroredTrainingTest checks that).
    SCATTERS_IN_REPLICA_CONTEXT = (
        "test_max_norm_values_and_gradients_match_tf",
        "test_scatter_ops_match_reference",
        "test_sgd_steps_match_single_device_reference",
    )

    def setUp(self):
        super().setUp()
        if self._testMethodName in self.SCATTERS_IN_REPLICA_CONTEXT:
            self.skipTest("raw scatters on a host shard run once per replica; MirroredHostCrossReplica runs them")


class MirroredCrossReplicaBodiesTest(StrategyBodies, tf.test.TestCase):
    """The shared bodies in cross-replica context (a `tf.function` called under `strategy.scope()`)."""

    table_kwargs = {"placement": "device"}
    schemes = ("mod",)
    # TensorFlow refuses a mirrored variable's handle outside replica context, so a tape cannot watch it there.
    NEEDS_REPLICA_CONTEXT = (
        "test_gradient_reaches_each_shard_deduplicated",
        "test_max_norm_values_and_gradients_match_tf",
        "test_sgd_steps_match_single_device_reference",
    )

    @property
    def strategy(self):
        return mirrored()

    def setUp(self):
        super().setUp()
        if self._testMethodName in self.NEEDS_REPLICA_CONTEXT:
            self.skipTest("gradients of mirrored variables need replica context (TensorFlow's rule)")

    def execute(self, fn, *args):
        with self.strategy.scope():
            return fn(*args)


class MirroredHostCrossReplicaBodiesTest(StrategyBodies, tf.test.TestCase):
    """Host-placed tables in cross-replica context: shards are plain variables, so a tape can watch them."""

    table_kwargs = {"placement": "host"}
    schemes = ("div",)

    def setUp(self):
        super().setUp()
        if self._testMethodName == "test_sgd_steps_match_single_device_reference":
            # Its dense layer is a mirrored variable, which needs replica context (TensorFlow's rule).
            self.skipTest("gradients of mirrored variables need replica context (TensorFlow's rule)")

    @property
    def strategy(self):
        return mirrored()

    def execute(self, fn, *args):
        with self.strategy.scope():
            return fn(*args)
