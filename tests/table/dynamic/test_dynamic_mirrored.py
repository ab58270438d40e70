"""Dynamic tables under MirroredStrategy (4 virtual CPUs): one host copy shared by the replicas, against references."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.models import (
    IDS,
    LABELS,
    RAW_KEYS,
    assert_matches_dynamic_reference,
    make_dynamic_model,
)
from tests.harness.strategies import mirrored, uid
from tests.table.dynamic.test_dynamic import DIM, Reference, by_key, power_law_keys
from tests.table.dynamic.test_dynamic_pooled import (
    assert_like_reference,
    key_batches,
    pooled_collection,
    train_replicas,
)
from tf_sharded.table import owner_of

pytestmark = pytest.mark.mirrored


class DynamicMirroredTest(tf.test.TestCase):
    @pytest.mark.slow  # over 5 s here
    def test_replicas_share_one_host_copy_and_match_a_dense_reference(self):
        strategy = mirrored()
        with strategy.scope():
            table = strategy.create_dynamic_table(uid("mdyn"), DIM, partitions=2, seed=3)
            optimizer = tfs.optimizers.Adagrad(0.3)
        self.assertEqual({tf.DeviceSpec.from_string(d).device_type for d in table.devices}, {"CPU"})
        self.assertEqual({tf.DeviceSpec.from_string(d).device_index for d in table.devices}, {0})
        self.assertEqual((table.placement, table.exchange.mode), ("host", "allgather"))
        rng = np.random.default_rng(2)
        steps = [[power_law_keys(rng, 24) for _ in range(4)] for _ in range(4)]
        steps[1][3] = steps[1][3][:0]  # a replica with no keys
        ref = Reference(table, [np.concatenate(s) for s in steps], tfs.optimizers.Adagrad(0.3))

        @tf.function
        def step(keys):
            def fn(keys):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(tfs.embedding_lookup(table, keys) - 1.0))
                grads = tape.gradient(loss, table.trainable_variables)
                optimizer.apply_gradients(zip(grads, table.trainable_variables))
                return loss

            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(fn, args=(keys,)), axis=None)

        for keys in steps:
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda ctx, keys=keys: tf.constant(keys[ctx.replica_id_in_sync_group], tf.int64)
            )
            self.assertAllClose(float(step(per_replica)), ref.step(np.concatenate(keys)), rtol=1e-5)
        rows = by_key(table)
        self.assertEqual(set(rows), set(ref.row))
        for key, value in rows.items():
            self.assertAllClose(value, ref.var.numpy()[ref.row[key]], atol=1e-5)

    @pytest.mark.slow  # over 4 s here
    def test_keras_fit_matches_plain_keras(self):
        strategy = mirrored()
        with strategy.scope():
            model = make_dynamic_model(partitions=2)
        steps = 3
        model.fit(RAW_KEYS[IDS], LABELS, batch_size=len(IDS), epochs=steps, shuffle=False, verbose=0)
        assert_matches_dynamic_reference(self, model, steps)

    def test_a_collections_tables_share_one_host_pool_and_match_their_references(self):
        # The replicas share one host copy of each table, so a collection pools its int64 tables there (one
        # insert section a step for both); the pools' gradient is all-gathered once, as each table's was.
        strategy = mirrored()
        replicas = strategy.num_replicas_in_sync
        layer, optimizer = pooled_collection(strategy)
        pooled = layer.tables
        self.assertIs(pooled["a"].variables[0], pooled["b"].variables[0])
        self.assertIsNot(pooled["a"].variables[0], pooled["c"].variables[0])
        self.assertLen(layer.trainable_variables, 2)
        self.assertEqual(owner_of(pooled["a"].variables[0])[0].exchange.mode, "allgather")
        rng = np.random.default_rng(3)
        steps = [key_batches(rng, replicas, n=16) for _ in range(4)]  # per step, a batch per replica
        reference = train_replicas(strategy, layer, optimizer, steps)
        # The accumulators sum squared gradients up to ~80: float32 sums in another order differ by ~4e-5.
        assert_like_reference(self, pooled, reference, accumulator_rtol=1e-5)

    def test_multi_worker_mirrored_strategy_takes_dynamic_tables(self):
        # Its clusters run in tests/table/dynamic/test_dynamic_multi_worker.py, with one and two replicas per worker.
        self.assertIn("CollectiveAllReduceStrategy", tfs.creation.dynamic_strategies())


if __name__ == "__main__":
    tf.test.main()
