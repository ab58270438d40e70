"""Key churn under the in-process strategies: the default strategy, a parameter-server cluster and
MirroredStrategy (4 virtual CPUs) each take 50 times a table's capacity in new keys (`tests/harness/churn.py`).
The multi-worker and hybrid runs are in test_churn_processes.py."""

import pytest
import tensorflow as tf
from absl.testing import parameterized

import tf_sharded as tfs
from tests.harness.churn import DIM, LEARNING_RATE, STEPS, VARIANTS, churn, evictions, variant_name
from tests.harness.strategies import mirrored, per_replica, ps_strategy, uid
from tests.table.dynamic.test_dynamic import train_step
from tf_sharded.table.dynamic import index as dynamic_index

NAMED_VARIANTS = [(variant_name(k, a), k, a) for k, a in VARIANTS]


def make(strategy, key_dtype, ages, **kwargs):
    with strategy.scope():
        table = strategy.create_dynamic_table(uid(variant_name(key_dtype, ages)), DIM, key_dtype=key_dtype, seed=5,
                                              eviction=evictions(ages), **kwargs)  # fmt: skip
        optimizer = tfs.optimizers.Adagrad(LEARNING_RATE)
    return table, optimizer


class IndexCompactionTest(tf.test.TestCase):
    def test_erased_keys_do_not_exhaust_the_index_and_its_buckets_follow_the_live_keys(self):
        index = dynamic_index.KeyIndex(tf.int64, uid("compact"))
        live = []
        for s in range(100):
            keys = tf.constant([s * 1000 + i for i in range(100)], tf.int64)
            index.insert(keys, tf.range(100, dtype=tf.int64) + s)
            live.append(keys)
            if len(live) > 3:
                index.remove(live.pop(0))
            # Absent keys: a lookup that found no empty bucket would fail here.
            self.assertAllEqual(index.find(tf.constant([-5, 10**12], tf.int64)), [-1, -1])
        self.assertEqual(int(index.size()), 300)
        self.assertLessEqual(int(index.buckets()), 4 * 400)
        for s, keys in zip(range(97, 100), live):
            self.assertAllEqual(index.find(keys), tf.range(100, dtype=tf.int64) + s)
        index.remove(tf.concat(live, 0))  # every key gone: the buckets shrink to the smallest table
        self.assertEqual(int(index.size()), 0)
        self.assertEqual(int(index.buckets()), dynamic_index.MIN_BUCKETS)
        self.assertAllEqual(index.find(live[0]), [-1] * 100)


@pytest.mark.slow  # 2-14 s each here
class DefaultStrategyChurnTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(*NAMED_VARIANTS)
    def test_fifty_times_the_capacity_in_new_keys(self, key_dtype, ages):
        strategy = tf.distribute.get_strategy()
        table, optimizer = make(strategy, key_dtype, ages, partitions=2)
        step = train_step(table, optimizer)
        churn(self, table, lambda batch: step(tf.constant(batch, key_dtype)), key_dtype=key_dtype, ages=ages)


@pytest.mark.slow
@pytest.mark.ps_cluster
class ParameterServerChurnTest(tf.test.TestCase, parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()
        cls.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(cls.strategy)

    @parameterized.named_parameters(*NAMED_VARIANTS)
    def test_fifty_times_the_capacity_in_new_keys_from_two_workers(self, key_dtype, ages):
        table, optimizer = make(self.strategy, key_dtype, ages)
        self.assertEqual(len(table.devices), 2)
        step = train_step(table, optimizer)

        def run(batch):
            # One step at a time, on whichever worker is free: a step that overlaps another can hand its update
            # to a new key that took the row of an evicted key still in flight (RFC, dynamic tables' limits), so
            # rows are exact only between steps that do not overlap. Concurrent steps' inserts are checked by
            # test_dynamic_ps.py.
            self.coordinator.schedule(step, args=(tf.constant(batch, key_dtype),))
            self.coordinator.join()

        churn(self, table, run, self.coordinator.join, key_dtype=key_dtype, ages=ages)


@pytest.mark.slow
@pytest.mark.mirrored
class MirroredChurnTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(*NAMED_VARIANTS)
    def test_fifty_times_the_capacity_in_new_keys_over_four_replicas(self, key_dtype, ages):
        strategy = mirrored()
        table, optimizer = make(strategy, key_dtype, ages, partitions=2)
        step = train_step(table, optimizer)
        replicas = strategy.num_replicas_in_sync

        def run(batch):
            step(per_replica(strategy, [tf.constant(part, key_dtype) for part in _split(batch, replicas)]))

        churn(self, table, run, key_dtype=key_dtype, ages=ages)
        self.assertEqual(int(table.step.numpy()), STEPS)  # the 4 replicas sharing the table count a step once


def _split(batch, parts: int) -> list:
    size = len(batch) // parts
    return [batch[i * size : (i + 1) * size] for i in range(parts)]


if __name__ == "__main__":
    tf.test.main()
