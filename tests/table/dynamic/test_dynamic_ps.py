"""Dynamic tables on a local parameter-server cluster (2 ps, 2 workers): steps scheduled on the workers."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.graphs import sends_per_call
from tests.harness.models import (
    IDS,
    LABELS,
    RAW_KEYS,
    assert_matches_dynamic_reference,
    make_dynamic_model,
)
from tests.harness.steps import squared_norm_collection_step
from tests.harness.strategies import ps_strategy, uid
from tests.table.dynamic.test_dynamic import DIM, by_key, train_step

pytestmark = pytest.mark.ps_cluster


class DynamicParameterServerTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()
        cls.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(cls.strategy)

    def make(self, **kwargs):
        with self.strategy.scope():
            return self.strategy.create_dynamic_table(uid("ps_dyn"), DIM, **kwargs)

    def test_one_shard_per_ps_by_default(self):
        table = self.make()
        tasks = sorted(tf.DeviceSpec.from_string(d).task for d in table.devices)
        self.assertEqual([tf.DeviceSpec.from_string(d).job for d in table.devices], ["ps", "ps"])
        self.assertEqual(tasks, [0, 1])
        self.assertEqual(self.make(partitions=3).num_shards, 3)

    def sends_per_step(self, tables: int) -> float:
        """Tensors sent between tasks per scheduled training step of a collection of `tables` dynamic tables."""
        names = [f"f{i}" for i in range(tables)]
        with self.strategy.scope():
            tables = {n: {"output_dim": 4, "vocabulary": "dynamic"} for n in names}
            layer = tfs.layers.EmbeddingCollection(tables, {n: n for n in names})
            layer.build()
            optimizer = tfs.optimizers.Adagrad(0.1)
            optimizer.build(layer.trainable_variables)
        step = squared_norm_collection_step(self.strategy, layer, optimizer)
        rng = np.random.default_rng(0)
        batch = {n: tf.constant(rng.integers(-(2**62), 2**62, size=64, dtype=np.int64)) for n in names}

        def run(times=1):
            for _ in range(times):
                self.coordinator.schedule(step, args=(batch,))
            self.coordinator.join()

        # Traces and inserts the keys; a step's first runs on each worker also send what its functions set up.
        run(times=6)
        return sends_per_call(run, 3)

    @pytest.mark.slow  # over 4 s
    def test_a_steps_transfers_between_tasks_do_not_grow_with_its_tables(self):
        # Per ps: one tensor of keys, counts and table steps in, one of rows out, one of gradients in; the
        # optimizer reads its learning rate once per ps and nothing passes through the worker on its way back.
        two, six = self.sends_per_step(2), self.sends_per_step(6)
        self.assertEqual(two, six)
        self.assertLess(two, 40)

    @pytest.mark.slow  # over 4 s
    def test_concurrent_inserts_from_two_workers_lose_and_duplicate_nothing(self):
        # Growing by 2% makes nearly every step copy the pools while the other worker's step writes rows.
        table = self.make(seed=4, key_dtype=tf.int64, growth=1.02)
        # d(sum of rows)/d(row) = 1 per occurrence: with SGD(1.0) each row ends at initial - count.
        step = train_step(table, tfs.optimizers.SGD(1.0), loss_of=tf.reduce_sum)

        rng = np.random.default_rng(3)
        batches = []
        for _ in range(40):
            keys = rng.integers(-(2**62), 2**62, size=2000, dtype=np.int64)
            keys[:150] = rng.integers(0, 200, size=150)  # keys every worker inserts at once
            batches.append(keys)
        for keys in batches:
            self.coordinator.schedule(step, args=(tf.constant(keys),))
        self.coordinator.join()
        counts = collections.Counter(np.concatenate(batches).tolist())
        self.assertEqual(int(table.size()), len(counts))
        rows = by_key(table)
        self.assertEqual(set(rows), set(counts))
        initial = table.initial_rows(tf.constant(list(counts), tf.int64)).numpy()
        expected = {k: initial[i] - counts[k] for i, k in enumerate(counts)}
        for key, value in rows.items():
            self.assertAllClose(value, expected[key], atol=1e-4)
        for shard in table.shards:
            _, used = shard.index.export()
            self.assertEqual(len(set(used.numpy().tolist())), int(shard.size()))

    def test_checkpoint_from_ps_restores_locally_with_slots_and_back(self):
        table = self.make(seed=6, key_dtype=tf.string)
        step = train_step(table, tfs.optimizers.Adagrad(0.5), loss_of=lambda rows: tf.reduce_sum(tf.square(rows)))

        words = np.array([f"w{i}" for i in range(60)])
        for _ in range(3):
            self.coordinator.schedule(step, args=(tf.constant(np.random.default_rng(0).choice(words, 50)),))
        self.coordinator.join()
        path = tf.train.Checkpoint(t=table).write(self.get_temp_dir() + "/ps_dyn")
        with tf.device("/job:chief/replica:0/task:0/device:CPU:0"):
            local = tfs.DynamicTable(uid("local"), DIM, tf.string, seed=6, devices=[None] * 3)
        local.make_slot("accumulator", 0.1)
        tf.train.Checkpoint(t=local).read(path).assert_consumed()
        self.assertEqual(by_key(local).keys(), by_key(table).keys())
        for column in (None, "accumulator"):
            expected, got = by_key(table, column), by_key(local, column)
            for key in expected:
                self.assertAllClose(got[key], expected[key])
        back = self.make(seed=6, key_dtype=tf.string, partitions=3)
        tf.train.Checkpoint(t=back).read(tf.train.Checkpoint(t=local).write(self.get_temp_dir() + "/back"))
        self.assertEqual(by_key(back).keys(), by_key(table).keys())

    def test_policies_run_on_the_ps_under_concurrent_steps(self):
        table = self.make(
            seed=1, admission=tfs.policies.MinCountAdmission(2), eviction=tfs.policies.CapacityEviction(300),
            growth=1.05,
        )  # fmt: skip
        self.assertEqual({v.device for v in [s.admission_state for s in table.shards]}, set(table.devices))
        step = train_step(table, tfs.optimizers.Adagrad(0.1))
        rng = np.random.default_rng(8)
        batches = [rng.integers(0, 1000, size=400, dtype=np.int64) for _ in range(24)]
        for keys in batches:
            self.coordinator.schedule(step, args=(tf.constant(keys),))
        self.coordinator.join()
        self.assertEqual(int(table.step.numpy()), len(batches))
        for shard in table.shards:
            keys, rows = shard.index.export()
            rows = rows.numpy().tolist()
            self.assertEqual(len(set(rows)), len(rows))  # no row shared by two keys
            self.assertLessEqual(len(rows), 150)
            self.assertLessEqual(int(shard.capacity.numpy()), 150)
        # Every live key was admitted: it occurred at least twice in the batches run before it got its row.
        counts = collections.Counter(np.concatenate(batches).tolist())
        self.assertTrue(all(counts[k] >= 2 for k in by_key(table)))
        self.assertGreater(int(table.size()), 250)

    def test_keras_fit_on_raw_keys_matches_plain_keras_and_restores_locally(self):
        with self.strategy.scope():
            model = make_dynamic_model()
        layer = model.get_layer("emb")
        self.assertEqual(layer.table.num_shards, 2)
        steps = 4
        ckpt_dir = self.get_temp_dir() + "/dyn_fit"
        dataset_fn = lambda context=None: tf.data.Dataset.from_tensors((RAW_KEYS[IDS], LABELS)).repeat()  # noqa: E731
        tfs.fit(model, dataset_fn, epochs=1, steps_per_epoch=steps, checkpoint_dir=ckpt_dir, verbose=0, log_every=1)
        assert_matches_dynamic_reference(self, model, steps)
        rows = by_key(layer.table)

        with tf.device("/job:chief/replica:0/task:0/device:CPU:0"), tf.distribute.get_strategy().scope():
            local = make_dynamic_model(partitions=3)
            local.optimizer.build(local.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=local, optimizer=local.optimizer)
        checkpoint.restore(tf.train.latest_checkpoint(ckpt_dir)).assert_existing_objects_matched()
        local_table = local.get_layer("emb").table
        self.assertEqual(by_key(local_table).keys(), rows.keys())
        momentum = by_key(layer.table, "momentum")
        for key, value in by_key(local_table, "momentum").items():
            self.assertAllClose(value, momentum[key])


if __name__ == "__main__":
    tf.test.main()
