"""Dynamic tables under the default strategy, against a plain reference: distinct keys mapped to a dense variable."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness import graphs
from tests.harness.strategies import uid
from tf_sharded.table.dynamic import index as dynamic_index
from tf_sharded.table.dynamic import table as dynamic

DIM = 4


def power_law_keys(rng, n, distinct=300):
    """Raw int64 keys: negatives and keys beyond 2**53 included, a few very frequent."""
    pool = rng.integers(-(2**62), 2**62, size=distinct, dtype=np.int64)
    pool[:3] = [-1, 0, 2**53 + 1]
    return pool[np.minimum(rng.zipf(1.3, size=n) - 1, distinct - 1)]


def by_key(table, column=None):
    """`{key: row}` of a table's live keys (or of an optimizer column)."""
    keys, values, extra = table.export_columns([column] if column else [])
    values = extra[column] if column else values
    keys = [k.decode() if isinstance(k, bytes) else int(k) for k in keys.numpy()]
    return dict(zip(keys, values.numpy()))


class Reference:
    """Distinct keys in first-seen order, mapped to rows of one dense variable trained by a Keras optimizer."""

    def __init__(self, table, key_batches, optimizer):
        order = list(dict.fromkeys(k for batch in key_batches for k in batch.tolist()))
        self.row = {k: i for i, k in enumerate(order)}
        self.var = tf.Variable(table.initial_rows(tf.constant(order, table.key_dtype)))
        self.optimizer = optimizer

    def step(self, keys):
        ids = tf.constant([self.row[k] for k in keys.tolist()], tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.gather(self.var, ids) - 1.0))
        # Dense: Keras squares an IndexedSlices gradient per duplicate index; rows without gradient do not move.
        self.optimizer.apply_gradients([(tf.convert_to_tensor(tape.gradient(loss, self.var)), self.var)])
        return float(loss)


def train_step(table, optimizer, loss_of=lambda rows: tf.reduce_sum(tf.square(rows - 1.0))):
    """A `tf.function` step training `table` on `loss_of(rows)`, run by the current strategy (per replica)."""
    strategy = tf.distribute.get_strategy() if not tf.distribute.has_strategy() else None

    @tf.function
    def step(keys):
        def fn(keys):
            with tf.GradientTape() as tape:
                loss = loss_of(tfs.embedding_lookup(table, keys))
            grads = tape.gradient(loss, table.trainable_variables)
            optimizer.apply_gradients(zip(grads, table.trainable_variables))
            return loss

        return (table.strategy or strategy).run(fn, args=(keys,))

    return step


def two_replica_steps_match_reference(
    check, strategy, table, optimizer, reference_optimizer, per_replica, replicas: int = 2
):
    """Four steps of power-law keys over two (or `replicas`) replicas (replica r feeds `steps[s][r]`; replica 1
    meets none in step 2), each step's summed loss checked against one dense variable trained by
    `reference_optimizer` on every replica's keys. Returns that `Reference`."""
    rng = np.random.default_rng(2)  # the same keys in every process
    steps = [[power_law_keys(rng, 24) for _ in range(replicas)] for _ in range(4)]
    steps[1][1] = steps[1][1][:0]
    ref = Reference(table, [np.concatenate(s) for s in steps], reference_optimizer)
    step = train_step(table, optimizer)
    for keys in steps:
        loss = strategy.reduce(tf.distribute.ReduceOp.SUM, step(per_replica(keys)), axis=None)
        check.assertAllClose(float(loss), ref.step(np.concatenate(keys)), rtol=1e-5)
    return ref


def adagrad_rows_match_reference(check, strategy, table, per_replica, replicas: int = 2) -> dict:
    """`two_replica_steps_match_reference` with Adagrad(0.3), then every live key's row checked against the
    reference's (the same keys, none more). Returns `{key: row}`."""
    with strategy.scope():
        optimizer = tfs.optimizers.Adagrad(0.3)
    ref = two_replica_steps_match_reference(
        check, strategy, table, optimizer, tfs.optimizers.Adagrad(0.3), per_replica, replicas
    )
    keys, values = table.export()
    rows = dict(zip(keys.numpy().tolist(), values.numpy()))
    check.assertEqual(set(rows), set(ref.row))
    check.assertEqual(int(table.size()), len(ref.row))
    for key, value in rows.items():
        check.assertAllClose(value, ref.var.numpy()[ref.row[key]], atol=1e-5)
    return rows


class DynamicTableTest(tf.test.TestCase):
    def test_initial_rows_depend_on_seed_and_key_only(self):
        keys = tf.constant([5, -(2**63), 2**63 - 1, 5, 12], tf.int64)
        values = []
        for partitions in (1, 2, 7):
            table = tfs.create_dynamic_table(uid("lay"), dim=DIM, partitions=partitions, seed=3)
            values.append(tfs.embedding_lookup(table, keys).numpy())
            self.assertEqual(int(table.size()), 4)
        self.assertAllEqual(values[0], values[1])
        self.assertAllEqual(values[0], values[2])
        self.assertAllEqual(values[0][0], values[0][3])
        other = tfs.create_dynamic_table(uid("seed"), dim=DIM, seed=4)
        self.assertNotAllClose(tfs.embedding_lookup(other, keys).numpy(), values[0])

    @pytest.mark.slow  # over 4 s here
    def test_the_dense_index_reserved_keys_train_evict_and_restore_like_any_other(self):
        # The index's dense table reserves the two smallest int64 keys as markers; they are held beside it.
        low = [-(2**63), -(2**63) + 1]
        batches = [np.array(low + [0, 7]), np.array([7, 9, low[0]]), np.array([low[1], 9, 11, 7])]
        eviction = tfs.policies.StepsSinceSeenEviction(max_steps=2, every=1)
        table = tfs.create_dynamic_table(uid("low"), dim=DIM, partitions=2, seed=5, eviction=eviction)
        step = train_step(table, tfs.optimizers.Adagrad(0.3))
        ref = Reference(table, batches, tfs.optimizers.Adagrad(0.3))
        for keys in batches[:2]:
            self.assertAllClose(float(step(tf.constant(keys))), ref.step(keys), rtol=1e-5)
        path = tf.train.Checkpoint(t=table).write(self.get_temp_dir() + "/low")
        self.assertAllClose(float(step(tf.constant(batches[2]))), ref.step(batches[2]), rtol=1e-5)
        # Step 3 evicts what was last seen at step 1: key 0 only (low[0] was seen at 2, low[1] again at 3).
        rows = by_key(table)
        self.assertEqual(set(rows), {low[0], low[1], 7, 9, 11})
        for key, value in rows.items():
            self.assertAllClose(value, ref.var.numpy()[ref.row[key]], atol=1e-6)
        self.assertEqual(int(table.size()), 5)
        step(tf.constant([11], tf.int64))  # step 4 evicts low[0] (seen at 2) and reuses rows
        step(tf.constant([11], tf.int64))  # step 5 evicts low[1], 7 and 9 (seen at 3)
        self.assertEqual(set(by_key(table)), {11})
        self.assertAllEqual(tfs.embedding_lookup(table, low, training=False), table.initial_rows(low))
        other = tfs.create_dynamic_table(uid("low1"), dim=DIM, partitions=1, seed=5)
        tf.train.Checkpoint(t=other).read(path).assert_consumed()
        self.assertEqual(set(by_key(other)), {low[0], low[1], 0, 7, 9})
        self.assertEqual(int(other.size()), 5)

    def test_index_parts_keep_their_reserved_keys_apart(self):
        # The shards of one pool share the table of reserved keys; one call serves several shards' keys.
        shared = dynamic_index.reserved_table(uid("low"))
        indexes = [dynamic_index.KeyIndex(tf.int64, uid(f"part{i}"), shared, slot=i) for i in range(3)]
        low = [-(2**63), -(2**63) + 1]
        keys = tf.constant([5, low[0]] + [low[0], low[1], 5, 6] + [low[1]], tf.int64)
        sizes = tf.constant([2, 4, 1])
        rows = tf.range(10, 17, dtype=tf.int64)
        self.assertAllEqual(dynamic_index.find_many(indexes, keys, sizes), [-1] * 7)
        dynamic_index.insert_many(indexes, keys, rows, sizes)
        self.assertAllEqual(dynamic_index.find_many(indexes, keys, sizes), rows)
        others = tf.constant([6, low[1], 6, low[1], low[0], 5], tf.int64)
        self.assertAllEqual(dynamic_index.find_many(indexes, others, tf.constant([2, 2, 2])), [-1, -1, 15, 13, -1, -1])
        exported = [dict(zip(*[t.numpy().tolist() for t in x.export()])) for x in indexes]
        self.assertEqual(exported, [{5: 10, low[0]: 11}, {low[0]: 12, low[1]: 13, 5: 14, 6: 15}, {low[1]: 16}])
        indexes[1].remove(tf.constant([low[0], 5, 7], tf.int64))
        self.assertEqual([int(x.size()) for x in indexes], [2, 2, 1])
        self.assertAllEqual(indexes[1].find(tf.constant([low[0], low[1], 5, 6], tf.int64)), [-1, 13, -1, 15])
        self.assertAllEqual(indexes[0].find(tf.constant([low[0], 5], tf.int64)), [11, 10])

    def test_inference_lookup_stores_nothing(self):
        table = tfs.create_dynamic_table(uid("inf"), dim=DIM, seed=1)
        fresh = tfs.embedding_lookup(table, [3, 4], training=False)
        self.assertEqual(int(table.size()), 0)
        stored = tfs.embedding_lookup(table, [3, 4])
        self.assertAllEqual(fresh, stored)
        self.assertEqual(int(table.size()), 2)

    def test_string_keys_with_a_combiner_match_reference(self):
        table = tfs.create_dynamic_table(uid("str"), dim=DIM, key_dtype=tf.string, partitions=2, seed=2)
        ids = tf.ragged.constant([["a", "b", "a"], [], ["c"]])
        out = tfs.embedding_lookup_sparse(table, ids, combiner="mean")
        rows = table.initial_rows(tf.constant(["a", "b", "c"])).numpy()
        expected = [(2 * rows[0] + rows[1]) / 3, np.zeros(DIM), rows[2]]
        self.assertAllClose(out, expected)
        self.assertEqual(sorted(by_key(table)), ["a", "b", "c"])
        self.assertAllClose(tf.nn.embedding_lookup(table, ["c"]), rows[2:])

    def test_rows_grow_past_the_first_capacity(self):
        table = tfs.create_dynamic_table(uid("grow"), dim=2, partitions=2, seed=0)
        step = train_step(table, tfs.optimizers.SGD(0.5))
        for start in range(0, 3000, 500):
            step(tf.range(start, start + 700, dtype=tf.int64))
        self.assertEqual(int(table.size()), 3200)
        rows = by_key(table)
        first = table.initial_rows(tf.constant([0, 3199], tf.int64)).numpy()
        # key 0 was looked up once, key 3199 once: one SGD step each towards 1.
        self.assertAllClose(rows[0], first[0] - 0.5 * 2 * (first[0] - 1))
        self.assertAllClose(rows[3199], first[1] - 0.5 * 2 * (first[1] - 1))
        capacity = sum(int(s.capacity.numpy()) for s in table.shards)
        self.assertLessEqual(capacity, 1.3 * 3200 + 2 * 64)

    def test_checkpoint_restores_into_other_layouts_with_optimizer_columns(self):
        rng = np.random.default_rng(1)
        batches = [power_law_keys(rng, 40) for _ in range(3)]
        table = tfs.create_dynamic_table(uid("ck"), dim=DIM, partitions=2, seed=9)
        optimizer = tfs.optimizers.Adagrad(0.2)
        step = train_step(table, optimizer)
        for keys in batches:
            step(tf.constant(keys))
        path = tf.train.Checkpoint(t=table).write(self.get_temp_dir() + "/dyn")
        saved = by_key(table)
        for partitions in (1, 3):
            # Restored before the optimizer exists: the accumulator column waits for it.
            other = tfs.create_dynamic_table(uid("ck2"), dim=DIM, partitions=partitions, seed=9)
            tf.train.Checkpoint(t=other).read(path).assert_consumed()
            other_optimizer = tfs.optimizers.Adagrad(0.2)
            other_step = train_step(other, other_optimizer)
            self.assertEqual(by_key(other).keys(), by_key(table).keys())
            extra = power_law_keys(rng, 40)
            a, b = float(step(tf.constant(extra))), float(other_step(tf.constant(extra)))
            self.assertAllClose(a, b, rtol=1e-6)
            expected, got = by_key(table), by_key(other)
            for key in expected:
                self.assertAllClose(got[key], expected[key], atol=1e-6)
            acc, other_acc = by_key(table, "accumulator"), by_key(other, "accumulator")
            for key in acc:
                self.assertAllClose(other_acc[key], acc[key], atol=1e-6)
            # Back to the saved state for the next layout: keys added since are gone.
            tf.train.Checkpoint(t=table).read(path)
            self.assertEqual(set(by_key(table)), set(saved))

    def test_checkpoint_holds_live_keys_not_capacity(self):
        table = tfs.create_dynamic_table(uid("size"), dim=8, seed=0)
        tfs.embedding_lookup(table, tf.range(10, dtype=tf.int64))
        path = tf.train.Checkpoint(t=table).write(self.get_temp_dir() + "/small")
        reader = tf.train.load_checkpoint(path)
        shapes = {k: v for k, v in reader.get_variable_to_shape_map().items() if k.startswith("t/")}
        # keys, values, and per key its last-seen step and occurrences; the table's step
        self.assertEqual(sorted(shapes.values()), [[], [10], [10], [10], [10, 8]])
        self.assertGreater(int(table.shards[0].capacity.numpy()), 10)

    def test_bad_keys_are_refused_naming_the_table(self):
        ints = tfs.create_dynamic_table(uid("ints"), dim=DIM)
        strings = tfs.create_dynamic_table(uid("strs"), dim=DIM, key_dtype="string")
        with self.assertRaisesRegex(TypeError, f"ids` of dynamic table '{ints.name}'.*int32 or int64.*float32"):
            tfs.embedding_lookup(ints, tf.constant([1.5]))
        with self.assertRaisesRegex(TypeError, f"dynamic table '{ints.name}'.*string"):
            tfs.embedding_lookup(ints, ["a"])
        with self.assertRaisesRegex(TypeError, f"dynamic table '{strings.name}'.*int64"):
            tfs.embedding_lookup(strings, [1])
        with self.assertRaisesRegex(TypeError, "argument `key_dtype` must be tf.int64 or tf.string.*float32"):
            tfs.create_dynamic_table(uid("bad"), dim=DIM, key_dtype=tf.float32)
        with self.assertRaisesRegex(ValueError, "scales by the vocabulary size"):
            tfs.create_dynamic_table(uid("bad"), dim=DIM, initializer="glorot_uniform")
        self.assertEqual(int(ints.size()) + int(strings.size()), 0)

    def test_restore_with_another_dim_or_key_dtype_is_refused_and_applies_nothing(self):
        table = tfs.create_dynamic_table(uid("src"), dim=DIM, seed=0)
        tfs.embedding_lookup(table, [1, 2, 3])
        path = tf.train.Checkpoint(t=table).write(self.get_temp_dir() + "/src")
        wide = tfs.create_dynamic_table(uid("wide"), dim=DIM + 1, seed=0)
        tfs.embedding_lookup(wide, [7])
        with self.assertRaisesRegex(ValueError, f"Dynamic table '{wide.name}' has dim=5"):
            tf.train.Checkpoint(t=wide).read(path)
        self.assertEqual(list(by_key(wide)), [7])
        strings = tfs.create_dynamic_table(uid("s"), dim=DIM, key_dtype=tf.string)
        with self.assertRaises((TypeError, tf.errors.InvalidArgumentError)):
            tf.train.Checkpoint(t=strings).read(path)
        self.assertEqual(int(strings.size()), 0)

    def test_full_table_without_eviction_fails_and_inserts_nothing(self):
        table = tfs.create_dynamic_table(uid("full"), dim=2, max_rows=5, seed=0)
        tfs.embedding_lookup(table, [1, 2, 3])
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, f"Dynamic table '{table.name}'.*is full"):
            tfs.embedding_lookup(table, [4, 5, 6])
        self.assertEqual(sorted(by_key(table)), [1, 2, 3])
        tfs.embedding_lookup(table, [4, 5])
        self.assertEqual(int(table.size()), 5)

    def test_a_step_over_several_tables_takes_the_device_lock_once_to_insert_and_once_to_update(self):
        # Three tables of two shards on this device, looked up by one EmbeddingCollection and trained by one
        # optimizer: each table matches its own dense reference, and the step runs two critical sections
        # (one per table and shard, twice, would be twelve).
        rng = np.random.default_rng(3)
        names = ["a", "b", "c"]
        batches = [{n: power_law_keys(rng, 48) for n in names} for _ in range(4)]
        collection = tfs.layers.EmbeddingCollection(
            {n: {"vocabulary": "dynamic", "output_dim": DIM, "partitions": 2, "seed": i} for i, n in enumerate(names)},
            {n: n for n in names},
            name=uid("together"),
        )
        collection.build()
        optimizer = tfs.optimizers.Adagrad(0.3)
        variables = collection.trainable_variables
        optimizer.build(variables)

        @tf.function
        def step(keys):
            with tf.GradientTape() as tape:
                out = collection(keys)
                loss = tf.add_n([tf.reduce_sum(tf.square(out[n] - 1.0)) for n in names])
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        refs = {n: Reference(collection.tables[n], [b[n] for b in batches], tfs.optimizers.Adagrad(0.3)) for n in names}
        for batch in batches:
            loss = step({n: tf.constant(k) for n, k in batch.items()})
            self.assertAllClose(float(loss), sum(refs[n].step(batch[n]) for n in names), rtol=1e-5)
        for n in names:
            rows, ref = by_key(collection.tables[n]), refs[n]
            self.assertEqual(set(rows), set(ref.row))
            for key, value in rows.items():
                self.assertAllClose(value, ref.var.numpy()[ref.row[key]], atol=1e-6)
        traced = step.get_concrete_function({n: tf.TensorSpec([None], tf.int64) for n in names})
        self.assertEqual(sum(node.op == "MutexLock" for node in graphs.nodes(traced)), 2)

    def test_one_table_requested_twice_in_a_section_gives_every_new_key_its_own_row(self):
        # Requests for one shard in one critical section run in order: the second allocates after the first.
        table = tfs.create_dynamic_table(uid("twice"), dim=DIM, seed=2)
        first, second = tf.constant([1, 2, 3], tf.int64), tf.constant([4, 5, 3], tf.int64)
        rows = tf.function(lambda a, b: dynamic.lookup_many([(table, a), (table, b)]))(first, second)
        keys = tf.constant([1, 2, 3, 4, 5], tf.int64)
        self.assertEqual(int(table.size()), 5)
        self.assertAllClose(tfs.embedding_lookup(table, keys, training=False), table.initial_rows(keys))
        self.assertAllClose(tf.concat(rows, 0), table.initial_rows(tf.concat([first, second], 0)))

    def test_strategy_method_and_unsupported_strategies(self):
        strategy = tf.distribute.get_strategy()
        table = strategy.create_dynamic_table(uid("m"), 3, key_dtype=tf.string)
        self.assertIsInstance(table, tfs.DynamicTable)
        with self.assertRaisesRegex(
            TypeError, "Dynamic table 'adm.*': argument `admission` must be None, tfs.policies.Min"
        ):
            tfs.create_dynamic_table(uid("adm"), dim=2, admission=object())
        with self.assertRaisesRegex(TypeError, "argument `eviction` must be .* at most one of each"):
            tfs.create_dynamic_table(
                uid("ev"), dim=2, eviction=[tfs.policies.CapacityEviction(3), tfs.policies.CapacityEviction(4)]
            )
        # A shard per worker needs MultiWorkerMirroredStrategy; the strategy places a dynamic table otherwise.
        name = uid("sh")
        needs = f"Argument `placement` of dynamic table '{name}': placement='sharded' needs MultiWorkerMirroredStrategy"
        with self.assertRaisesRegex(ValueError, needs):
            tfs.create_dynamic_table(name, dim=2, placement="sharded")
        with self.assertRaisesRegex(ValueError, "must be None or 'sharded'.*Received: placement='device'"):
            tfs.create_dynamic_table(uid("dev"), dim=2, placement="device")


if __name__ == "__main__":
    tf.test.main()
