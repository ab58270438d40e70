"""The shared bodies on a local parameter-server cluster (2 ps, 2 workers).

`ParameterServerCoordinatorTest` runs them from the coordinator;
`ParameterServerWorkerTest` schedules every function on a worker through
`ClusterCoordinator` (so lookups and updates run worker -> ps).
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.bodies import StrategyBodies
from tests.harness.references import table_values
from tests.harness.strategies import ps_strategy, uid

pytestmark = pytest.mark.ps_cluster


class ParameterServerCoordinatorTest(StrategyBodies, tf.test.TestCase):
    eager = True

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()

    def test_shards_live_round_robin_on_the_ps_tasks(self):
        table = self.make(table_values(self.rows, self.dim), partitions=3)
        tasks = [tf.DeviceSpec.from_string(d) for d in table.devices]
        self.assertEqual({t.job for t in tasks}, {"ps"})
        self.assertLen({t.task for t in tasks}, 2)
        self.assertNotEqual(tasks[0].task, tasks[1].task)

    def test_default_shard_count_is_num_ps_or_the_partitioner(self):
        with self.strategy.scope():
            table = self.strategy.create_sharded_variable(uid("d"), [10, 2])
        self.assertEqual(table.num_shards, 2)
        cluster = tfs.cluster.local_cluster(num_workers=2, num_ps=2)
        partitioned = cluster.strategy(variable_partitioner=tfs.partitioners.FixedShards(5))
        with partitioned.scope():
            table = partitioned.create_sharded_variable(uid("p"), [10, 2])
            override = partitioned.create_sharded_variable(uid("o"), [10, 2], partitions=3)
            dense = tf.Variable(tf.zeros([10, 2]))
        self.assertEqual(table.num_shards, 5)
        self.assertEqual(override.num_shards, 3)
        # TF's own partitioner still splits plain variables; ours are not split twice.
        self.assertIsInstance(dense, tf.__internal__.distribute.ShardedVariable)
        self.assertTrue(all(v.shape[0] in (2,) for v in table.variables))

    def test_bad_creation_and_restore_arguments_on_the_cluster(self):
        with self.strategy.scope():
            with self.assertRaisesRegex(ValueError, "Argument `scheme` must be one of"):
                self.strategy.create_sharded_variable(uid("b"), [10, 2], scheme="hash")
            with self.assertRaisesRegex(ValueError, "Argument `num_shards` must not exceed the number of rows"):
                self.strategy.create_sharded_variable(uid("b"), [3, 2], partitions=4)
            with self.assertRaisesRegex(
                ValueError, "Argument `initializer` must return a tensor of the requested shape"
            ):
                self.strategy.create_sharded_variable(
                    uid("b"), [10, 2], initializer=lambda shape, dtype: tf.zeros([1, 2])
                )
            with self.assertRaisesRegex(ValueError, "Argument `exchange` only applies under MirroredStrategy"):
                self.strategy.create_sharded_variable(uid("b"), [10, 2], exchange="allgather")
        values = table_values(self.rows, self.dim)
        path = tf.train.Checkpoint(t=self.make(values)).save(self.get_temp_dir() + "/bad")
        target = self.make(np.ones((self.rows + 1, self.dim), np.float32), scheme="mod")
        with self.assertRaises(tfs.LayoutMismatchError):
            tf.train.Checkpoint(t=target).restore(path)
        self.assertAllEqual(target.numpy(), np.ones((self.rows + 1, self.dim)))


class ParameterServerWorkerTest(StrategyBodies, tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()
        cls.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(cls.strategy)

    def execute(self, fn, *args):
        result = self.coordinator.schedule(fn, args=args)
        self.coordinator.join()
        return result.fetch()


if __name__ == "__main__":
    tf.test.main()
