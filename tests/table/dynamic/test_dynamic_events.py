"""What a dynamic table's training lookups did, as its shards count it (`shard_events`: ids looked up, ids whose
key was present, keys admitted, rejected and evicted), step by step against a model of the table's policies
computed here from the same key stream."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import ps_strategy, uid
from tests.table.dynamic.test_dynamic import train_step
from tf_sharded.table import tally

pytestmark = pytest.mark.timeout(300)

LOOKUPS, HITS, ADMITTED, REJECTED, EVICTED = range(5)


def key_stream(steps: int, seed: int, vocabulary: int = 60, batch: int = 12) -> list:
    """Power-law keys (repeats within and across batches), large and negative ones among them."""
    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.3, batch) % vocabulary) * 1_000_003 - 5 for _ in range(steps)]


class Model:
    """A dynamic table's keys under a minimum-count admission and an age eviction, kept in dicts: the events a
    training lookup of `keys` causes at table step `step`, per shard."""

    def __init__(self, table, min_count: int = 1, max_steps=None, every: int = 1):
        self.table, self.min_count, self.max_steps, self.every = table, min_count, max_steps, every
        self.last_seen, self.sketch = {}, collections.Counter()

    def step(self, keys, step: int) -> np.ndarray:
        events = np.zeros([self.table.num_shards, 5], np.int64)
        counts = collections.Counter(keys.tolist())
        shard_of = dict(zip(counts, self.table.shard_of(tf.constant(list(counts), tf.int64)).numpy()))
        for key, count in counts.items():
            row = events[shard_of[key]]
            row[LOOKUPS] += count
            if key in self.last_seen:
                row[HITS] += count
            else:
                self.sketch[key] += count  # the admission sketch counts a key's occurrences while it is absent
                if self.sketch[key] < self.min_count:
                    row[REJECTED] += 1
                    continue
                row[ADMITTED] += 1
            self.last_seen[key] = step
        if self.max_steps is not None and step % self.every == 0:
            for key in [k for k, seen in self.last_seen.items() if seen <= step - self.max_steps]:
                events[shard_of[key] if key in shard_of else self._shard(key), EVICTED] += 1
                del self.last_seen[key]
        return events

    def _shard(self, key) -> int:
        return int(self.table.shard_of(tf.constant([key], tf.int64))[0])


class DynamicEventsTest(tf.test.TestCase):
    def check_stream(self, table, model, stream):
        step = train_step(table, tfs.optimizers.Adagrad(0.1))
        total = np.zeros([table.num_shards, 5], np.int64)
        for s, keys in enumerate(stream, 1):
            step(tf.constant(keys, tf.int64))
            total += model.step(keys, s)
            self.assertAllEqual(table.shard_events(), total, msg=f"step {s}")
            self.assertEqual(int(table.size()), len(model.last_seen))
        return total

    def test_admission_and_age_eviction_are_counted_per_shard_as_the_keys_arrive(self):
        admission, age = tfs.policies.MinCountAdmission(3), tfs.policies.StepsSinceSeenEviction(4, every=2)
        table = tfs.create_dynamic_table(uid("events"), 3, partitions=3, seed=1, admission=admission, eviction=age)
        total = self.check_stream(table, Model(table, min_count=3, max_steps=4, every=2), key_stream(16, 0))
        self.assertTrue((total[:, [ADMITTED, REJECTED, EVICTED]].sum(0) > 0).all(), total)  # each event occurred

    def test_the_pooled_path_counts_new_keys_and_age_evictions(self):
        # No admission: every absent key gets a row in the insert that handles all parts as one tensor.
        table = tfs.create_dynamic_table(uid("events_plain"), 2, partitions=2, seed=2,
                                         eviction=tfs.policies.StepsSinceSeenEviction(3, every=1))  # fmt: skip
        total = self.check_stream(table, Model(table, max_steps=3), key_stream(12, 1))
        self.assertEqual(total[:, REJECTED].sum(), 0)
        self.assertGreater(total[:, EVICTED].sum(), 0)

    def test_a_capacity_bound_evicts_or_turns_away_what_does_not_fit(self):
        # One shard of at most 5 keys: evictions make room for a batch's new keys, but never evict the batch's
        # own keys, so a batch of 8 distinct new keys leaves 3 of them out.
        table = tfs.create_dynamic_table(uid("events_capacity"), 2, seed=3,
                                         eviction=tfs.policies.CapacityEviction(5))  # fmt: skip
        step = train_step(table, tfs.optimizers.SGD(0.1))
        before = np.zeros(5, np.int64)
        for s, keys in enumerate(key_stream(10, 2, vocabulary=30) + [np.arange(100, 108)], 1):
            live = set(table.export()[0].numpy().tolist())
            counts = collections.Counter(keys.tolist())
            step(tf.constant(keys, tf.int64))
            now = table.shard_events().numpy()[0]
            got = now - before
            before = now
            absent = [k for k in counts if k not in live]
            self.assertEqual(got[LOOKUPS], len(keys), msg=f"step {s}")
            self.assertEqual(got[HITS], sum(c for k, c in counts.items() if k in live), msg=f"step {s}")
            self.assertEqual(got[ADMITTED] + got[REJECTED], len(absent), msg=f"step {s}")
            after = set(table.export()[0].numpy().tolist())
            self.assertEqual(got[ADMITTED], len(after - live), msg=f"step {s}")
            self.assertEqual(got[EVICTED], len(live - after), msg=f"step {s}")
        self.assertEqual(got[REJECTED], 3)
        self.assertEqual(int(table.size()), 5)

    @pytest.mark.ps_cluster
    def test_eager_lookups_count_too_here_and_on_parameter_servers(self):
        # Outside a function (a notebook's cell), under the default strategy and on parameter servers, whose
        # counter variables have unknown shapes.
        for strategy in (tf.distribute.get_strategy(), ps_strategy()):
            with strategy.scope():
                table = strategy.create_dynamic_table(uid("events_eager"), 4, partitions=2, seed=4,
                                                      admission=tfs.policies.MinCountAdmission(2))  # fmt: skip
                fixed = strategy.create_sharded_variable(uid("events_eager_fixed"), [20, 4], partitions=2)
            model, total = Model(table, min_count=2), np.zeros([2, 5], np.int64)
            for s, keys in enumerate(key_stream(3, 3), 1):
                tfs.embedding_lookup(table, tf.constant(keys, tf.int64))
                total += model.step(keys, s)
                self.assertAllEqual(table.shard_events(), total, msg=f"{strategy} step {s}")
            tfs.embedding_lookup(fixed, tf.constant([1, 2, 2, 13], tf.int64))
            owners = fixed.layout.route(tf.constant([1, 2, 13], tf.int64))[0].numpy()
            self.assertAllEqual(tally.shard_counts(fixed), np.bincount(owners, minlength=2))
