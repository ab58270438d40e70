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
from tests.table.dynamic.test_dynamic import DIM
from tests.table.dynamic.test_dynamic_pooled import (
    assert_like_reference,
    key_batches,
    pooled_collection,
    train_replicas,
)
from tf_sharded.table import owner_of

pytestmark = pytest.mark.mirrored


class DynamicMirroredTest(tf.test.TestCase):
    def test_replicas_share_one_host_copy_whose_gradients_are_all_gathered(self):
        # Its training against a dense reference, over 4 replicas, is the conformance matrix's (tests/conformance).
        strategy = mirrored()
        with strategy.scope():
            table = strategy.create_dynamic_table(uid("mdyn"), DIM, partitions=2, seed=3)
        self.assertEqual({tf.DeviceSpec.from_string(d).device_type for d in table.devices}, {"CPU"})
        self.assertEqual({tf.DeviceSpec.from_string(d).device_index for d in table.devices}, {0})
        self.assertEqual((table.placement, table.exchange.mode), ("host", "allgather"))

    @pytest.mark.slow  # over 4 s here
    def test_keras_fit_matches_plain_keras(self):
        strategy = mirrored()
        with strategy.scope():
            model = make_dynamic_model(partitions=2)
        steps = 3
        model.fit(RAW_KEYS[IDS], LABELS, batch_size=len(IDS), epochs=steps, shuffle=False, verbose=0)
        assert_matches_dynamic_reference(self, model, steps)

    @pytest.mark.slow  # over 4 s
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
