"""Admission, eviction, delta export and serving of dynamic tables: exact semantics on small, known sequences."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.serving import serve_elsewhere
from tests.harness.strategies import uid
from tests.table.dynamic.test_dynamic import by_key, train_step

SUM = tf.reduce_sum  # d(loss)/d(row) = 1 per occurrence: with SGD(1.0) a stored row moves by -count per step


def initial(table, keys):
    return dict(zip(keys, table.initial_rows(tf.constant(keys, table.key_dtype)).numpy()))


def rows_used(table):
    """Each shard's rows in use: one per live key, none shared."""
    for shard in table.shards:
        _, rows = shard.index.export()
        rows = rows.numpy().tolist()
        assert len(set(rows)) == len(rows) == int(shard.size()), rows
    return sum(int(s.size()) for s in table.shards)


class AdmissionTest(tf.test.TestCase):
    @pytest.mark.slow  # 4-6 s here
    def test_min_count_admits_on_the_nth_occurrence_and_only_then_trains(self):
        table = tfs.create_dynamic_table(
            uid("minc"), 2, admission=tfs.policies.MinCountAdmission(3), partitions=2, seed=1
        )
        step = train_step(table, tfs.optimizers.SGD(1.0), loss_of=SUM)
        start = initial(table, [10, 20])
        step(tf.constant([10], tf.int64))
        step(tf.constant([10, 20], tf.int64))
        self.assertEqual(int(table.size()), 0)  # 10 seen twice, 20 once: read their initial rows, not stored
        self.assertAllEqual(tfs.embedding_lookup(table, [10, 20], training=False), [start[10], start[20]])
        step(tf.constant([10, 20, 20], tf.int64))  # 10: 3rd occurrence; 20: 3rd and 2nd ... both reach 3
        rows = by_key(table)
        self.assertEqual(set(rows), {10, 20})
        self.assertAllClose(rows[10], start[10] - 1)
        self.assertAllClose(rows[20], start[20] - 2)

    def test_probability_is_deterministic_and_turned_away_keys_get_no_update(self):
        keys = tf.range(2000, dtype=tf.int64)
        sizes = []
        for _ in range(2):
            table = tfs.create_dynamic_table(uid("prob"), 2, admission=tfs.policies.ProbabilityAdmission(0.25), seed=5)
            step = train_step(table, tfs.optimizers.SGD(1.0), loss_of=SUM)
            step(keys)
            sizes.append(sorted(by_key(table)))
        self.assertEqual(sizes[0], sizes[1])
        self.assertBetween(len(sizes[0]), 400, 600)
        rows, start = by_key(table), initial(table, list(range(2000)))
        for key, row in rows.items():
            self.assertAllClose(row, start[key] - 1)
        step(keys)  # a second draw for the keys turned away
        self.assertGreater(int(table.size()), len(rows))


class EvictionTest(tf.test.TestCase):
    def test_steps_since_seen_frees_rows_for_reuse_and_resets_slots(self):
        eviction = tfs.policies.StepsSinceSeenEviction(max_steps=2, every=1)
        table = tfs.create_dynamic_table(uid("ttl"), 2, eviction=eviction, seed=2)
        optimizer = tfs.optimizers.Adagrad(0.5, initial_accumulator_value=0.1)
        step = train_step(table, optimizer, loss_of=SUM)
        for keys in ([1, 2], [2], [2]):  # at step 3, key 1 (last seen at 1 <= 3 - 2) is evicted
            step(tf.constant(keys, tf.int64))
        self.assertEqual(set(by_key(table)), {2})
        self.assertEqual(int(table.shards[0].free_count.numpy()), 1)
        step(tf.constant([3], tf.int64))  # takes key 1's freed row
        self.assertEqual(int(table.shards[0].count.numpy()), 2)
        self.assertEqual(set(by_key(table)), {2, 3})
        accumulator = by_key(table, "accumulator")
        self.assertAllClose(accumulator[3], [1.1, 1.1])  # 0.1 + 1**2, not key 1's
        self.assertAllClose(accumulator[2], [0.1 + 3, 0.1 + 3])  # step 4: key 2 unseen, not yet 2 steps
        again = tfs.embedding_lookup(table, [1], training=False)
        self.assertAllEqual(again[0], initial(table, [1])[1])

    def test_lru_capacity_evicts_the_least_recently_seen_never_the_batch(self):
        table = tfs.create_dynamic_table(uid("lru"), 2, eviction=tfs.policies.CapacityEviction(3), seed=3)
        step = train_step(table, tfs.optimizers.SGD(1.0), loss_of=SUM)
        for keys in ([1, 2, 3], [1], [2], [4]):  # key 3 last seen at step 1
            step(tf.constant(keys, tf.int64))
        self.assertEqual(set(by_key(table)), {1, 2, 4})
        step(tf.constant([5, 6, 4], tf.int64))  # 1 (step 2) and 2 (step 3) go; 4 is in the batch
        self.assertEqual(set(by_key(table)), {4, 5, 6})
        self.assertEqual(rows_used(table), 3)
        self.assertLessEqual(int(table.shards[0].capacity.numpy()), 3)
        start = initial(table, [7, 8, 9, 10])
        loss = step(tf.constant([7, 8, 9, 10], tf.int64))  # four new keys, three fit: the last reads its initial row
        rows = by_key(table)
        self.assertEqual(set(rows), {7, 8, 9})
        self.assertAllClose(float(loss), sum(float(np.sum(v)) for v in start.values()), rtol=1e-5)
        for key in (7, 8, 9):
            self.assertAllClose(rows[key], start[key] - 1)

    def test_lfu_capacity_evicts_the_least_frequent(self):
        table = tfs.create_dynamic_table(uid("lfu"), 2, eviction=tfs.policies.CapacityEviction(3, policy="lfu"), seed=3)
        step = train_step(table, tfs.optimizers.SGD(1.0), loss_of=SUM)
        for keys in ([1, 1, 1, 2, 3], [2, 3, 3], [1], [4]):  # occurrences 1: 4, 2: 2, 3: 3
            step(tf.constant(keys, tf.int64))
        self.assertEqual(set(by_key(table)), {1, 3, 4})
        self.assertAllEqual(by_key(table, "hits")[3], 3)
        step(tf.constant([5], tf.int64))  # 4 (1 occurrence, the newest) goes; LRU would take 3 (seen at step 2)
        self.assertEqual(set(by_key(table)), {1, 3, 5})

    def test_capacity_is_split_across_shards(self):
        table = tfs.create_dynamic_table(
            uid("split"), 2, partitions=4, eviction=tfs.policies.CapacityEviction(40), seed=0
        )
        step = train_step(table, tfs.optimizers.SGD(0.1))
        for start in range(0, 400, 50):
            step(tf.range(start, start + 50, dtype=tf.int64))
        self.assertLessEqual(rows_used(table), 40)
        for shard in table.shards:
            self.assertLessEqual(int(shard.size()), 10)
            self.assertLessEqual(int(shard.capacity.numpy()), 10)
        self.assertGreater(int(table.size()), 30)


class DeltaAndServingTest(tf.test.TestCase):
    def test_export_since_step_gives_the_rows_trained_after_it(self):
        table = tfs.create_dynamic_table(uid("delta"), 2, key_dtype="string", partitions=3, seed=0)
        step = train_step(table, tfs.optimizers.SGD(0.1))
        step(tf.constant(["a", "b", "c"]))
        since = int(table.step.numpy())
        self.assertEqual(since, 1)
        step(tf.constant(["b", "d"]))
        keys, values = table.export(since_step=since)
        self.assertEqual(sorted(k.decode() for k in keys.numpy()), ["b", "d"])
        rows = by_key(table)
        for key, value in zip(keys.numpy(), values.numpy()):
            self.assertAllEqual(value, rows[key.decode()])
        self.assertEqual(int(tf.size(table.export(since_step=2)[0])), 0)
        self.assertEqual(int(tf.size(table.export()[0])), 4)

    @pytest.mark.slow  # over 5 s here
    def test_export_served_without_the_library_then_updated_by_a_delta(self):
        inp = keras.Input((None,), dtype="string", ragged=True, name="tags")
        out = tfs.layers.DynamicEmbedding(3, key_dtype="string", combiner="sum", partitions=2, seed=1, name="t")(inp)
        model = keras.Model(inp, out)
        model.compile(optimizer=tfs.optimizers.Adagrad(0.3), loss="mse")
        x = tf.ragged.constant([["a", "b"], ["c"], ["a", "d", "e"]])
        y = np.ones((3, 3), np.float32)
        model.fit(x, y, epochs=2, verbose=0)
        path = tfs.export(model, os.path.join(self.get_temp_dir(), "served"))
        since = int(model.get_layer("t").table.step.numpy())
        model.fit(tf.ragged.constant([["a", "new"], ["b"]]), y[:2], epochs=1, verbose=0)
        delta = os.path.join(self.get_temp_dir(), "delta")
        self.assertEqual(tfs.export_delta(model, delta, since_step=since), {"t": 3})

        probe = tf.ragged.constant([["a", "b"], ["new", "never"], ["c", "d"]])
        feed = {"tags_values": probe.values.numpy().astype("S"), "tags_row_lengths": probe.row_lengths().numpy()}
        before = serve_elsewhere(self, path, feed)
        after = serve_elsewhere(self, path, feed, delta=delta)
        self.assertAllClose(after, model.predict(probe, verbose=0), atol=1e-6)
        self.assertNotAllClose(before, after)
        # "never" was never trained: the served row is its initial row, as in the model.
        never = model.get_layer("t").table.initial_rows(tf.constant(["never"])).numpy()[0]
        self.assertAllClose(after[1] - by_key(model.get_layer("t").table)["new"], never, atol=1e-6)

    def test_export_delta_argument_errors(self):
        with self.assertRaisesRegex(ValueError, "`since_step` must be an integer >= 0. Received: since_step=-1"):
            tfs.export_delta(tfs.create_dynamic_table(uid("e"), 2), self.get_temp_dir(), since_step=-1)
        with self.assertRaisesRegex(TypeError, "without dynamic tables"):
            tfs.export_delta(keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]), "/tmp/x", since_step=0)


class PolicyCheckpointTest(tf.test.TestCase):
    @pytest.mark.slow  # over 4 s here
    def test_admission_counts_step_and_last_seen_restore_into_another_layout(self):
        make = lambda n: tfs.create_dynamic_table(  # noqa: E731
            uid("pck"), 2, partitions=n, seed=4, admission=tfs.policies.MinCountAdmission(2),
            eviction=tfs.policies.StepsSinceSeenEviction(3, every=1),
        )  # fmt: skip
        table = make(2)
        step = train_step(table, tfs.optimizers.SGD(1.0), loss_of=SUM)
        step(tf.constant([1, 1, 2, 3], tf.int64))  # 1 admitted; 2 and 3 counted once
        step(tf.constant([1, 4], tf.int64))
        path = tf.train.Checkpoint(t=table).write(self.get_temp_dir() + "/policies")
        other = make(3)
        tf.train.Checkpoint(t=other).read(path).assert_consumed()
        self.assertEqual(int(other.step.numpy()), 2)
        self.assertEqual(set(by_key(other)), {1})
        self.assertAllEqual(by_key(other, "seen")[1], 2)
        again = train_step(other, tfs.optimizers.SGD(1.0), loss_of=SUM)
        again(tf.constant([2], tf.int64))  # its second occurrence, counted before the save
        self.assertEqual(set(by_key(other)), {1, 2})
        again(tf.constant([2], tf.int64))
        again(tf.constant([2], tf.int64))  # step 5: key 1 last seen at 2 <= 5 - 3
        self.assertEqual(set(by_key(other)), {2})


if __name__ == "__main__":
    tf.test.main()
