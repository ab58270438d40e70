"""A collection's dynamic tables sharing one row pool per parameter server (or per device under the default
strategy): each table trains, evicts, admits, saves and restores as it would alone."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.serving import serve_elsewhere
from tests.harness.steps import squared_norm_collection_step
from tests.harness.strategies import ps_strategy
from tests.table.dynamic.test_dynamic import by_key, power_law_keys
from tf_sharded.table import owner_of
from tf_sharded.table.lookup import lookup_many

pytestmark = pytest.mark.ps_cluster

DIM = 4
NAMES = ("a", "b", "c")


def key_batches(rng, steps: int, n: int = 48) -> list:
    """Per step, a batch of raw keys per table ("c" holds strings)."""
    out = []
    for _ in range(steps):
        batch = {name: power_law_keys(rng, n) for name in NAMES}
        batch["c"] = np.array([f"s{k % 97}" for k in batch["c"]])
        out.append(batch)
    return out


class PooledReference:
    """Each table's distinct keys (first-seen order) as rows of its own dense variable, trained by Keras's
    Adagrad on the same `sum(rows ** 2)`."""

    def __init__(self, tables: dict, batches: list, learning_rate: float):
        self.row, self.var = {}, {}
        for name, table in tables.items():
            order = list(dict.fromkeys(k for b in batches for k in b[name].tolist()))
            self.row[name] = {k: i for i, k in enumerate(order)}
            self.var[name] = tf.Variable(table.initial_rows(tf.constant(order, table.key_dtype)))
        self.optimizer = keras.optimizers.Adagrad(learning_rate)

    def step(self, batch) -> None:
        variables = list(self.var.values())
        with tf.GradientTape() as tape:
            rows = [tf.gather(self.var[n], [self.row[n][k] for k in batch[n].tolist()]) for n in self.var]
            loss = tf.add_n([tf.reduce_sum(r**2) for r in rows])
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        self.optimizer.apply_gradients(zip(grads, variables))

    def rows(self, name: str) -> dict:
        value = self.var[name].numpy()
        return {k: value[i] for k, i in self.row[name].items()}

    def accumulators(self, name: str) -> dict:
        value = self.optimizer._accumulators[list(self.var).index(name)].numpy()
        return {k: value[i] for k, i in self.row[name].items()}


def pooled_collection(strategy, batch_tables=True, build_optimizer=True, **policies):
    """A collection of NAMES' dynamic tables ("c" of strings; policies per table name) and its Adagrad(0.3),
    under `strategy`."""
    tables = {}
    for i, n in enumerate(NAMES):
        key_dtype = "string" if n == "c" else "int64"
        tables[n] = {"output_dim": DIM, "vocabulary": "dynamic", "seed": i + 1, "key_dtype": key_dtype}
        tables[n].update(policies.get(n, {}))
    with strategy.scope():
        layer = tfs.layers.EmbeddingCollection(tables, {n: n for n in NAMES}, batch_tables=batch_tables)
        layer.build()
        optimizer = tfs.optimizers.Adagrad(0.3)
        if build_optimizer:
            optimizer.build(layer.trainable_variables)
    return layer, optimizer


def train_replicas(strategy, layer, optimizer, steps) -> PooledReference:
    """Trains `layer` on `steps` (per step, a `key_batches` batch per replica) and a `PooledReference` on each
    step's batches joined; returns the reference."""
    whole = [{n: np.concatenate([b[n] for b in s]) for n in NAMES} for s in steps]
    reference = PooledReference(layer.tables, whole, 0.3)
    step = squared_norm_collection_step(strategy, layer, optimizer)
    for per_step, batch in zip(steps, whole):
        step(strategy.experimental_distribute_values_from_function(
            lambda ctx, s=per_step: {n: tf.constant(s[ctx.replica_id_in_sync_group][n]) for n in NAMES}
        ))  # fmt: skip
        reference.step(batch)
    return reference


def assert_same_tables(test, layer, other, columns=("accumulator",), atol=1e-6) -> None:
    """`layer`'s tables hold `other`'s keys, rows and `columns`, table by table."""
    for name in NAMES:
        for column in (None, *columns):
            expected = by_key(other.tables[name], column)
            got = by_key(layer.tables[name], column)
            test.assertEqual(set(got), set(expected), f"table {name}, column {column}")
            for key, value in got.items():
                test.assertAllClose(value, expected[key], atol=atol, msg=f"table {name} key {key} {column}")


def assert_rows_accounted(test, layer) -> None:
    """In every pool, the rows handed out and not freed are exactly its members' live keys."""
    tables = list(layer.tables.values())
    for pool in {id(s.pool): s.pool for t in tables for s in t.shards}.values():
        live = sum(int(s.size()) for s in pool.members)
        test.assertEqual(int(pool.count.numpy()) - int(pool.free_count.numpy()), live)


def assert_like_reference(test, tables, reference, accumulator_rtol: float = 1e-6) -> None:
    """Each table holds its `PooledReference`'s keys, rows and Adagrad accumulators."""
    for name in NAMES:
        test.assertEqual(int(tables[name].size()), len(reference.row[name]))
        rows, accumulators = by_key(tables[name]), by_key(tables[name], "accumulator")
        test.assertEqual(set(rows), set(reference.row[name]))
        expected_rows, expected_acc = reference.rows(name), reference.accumulators(name)
        for key, value in rows.items():
            test.assertAllClose(value, expected_rows[key], atol=1e-6)
            test.assertAllClose(accumulators[key], expected_acc[key], atol=1e-6, rtol=accumulator_rtol)


class PooledDynamicTablesTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()
        cls.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(cls.strategy)

    def collection(self, strategy=None, batch_tables=True, build_optimizer=True, **policies):
        return pooled_collection(strategy or self.strategy, batch_tables, build_optimizer, **policies)

    def model_of(self, layer) -> keras.Model:
        """A Keras model of `layer`: one input per table, the rows concatenated."""
        with self.strategy.scope():
            inputs = {n: keras.Input((), dtype="string" if n == "c" else "int64", name=n) for n in NAMES}
            outputs = layer(inputs)
            return keras.Model(inputs, keras.layers.Concatenate()([outputs[n] for n in NAMES]))

    def train(self, layer, optimizer, batches) -> None:
        step = squared_norm_collection_step(self.strategy, layer, optimizer)
        for batch in batches:
            self.coordinator.schedule(step, args=({n: tf.constant(v) for n, v in batch.items()},))
            self.coordinator.join()

    def look_up(self, table, keys) -> None:
        """One training lookup of `table` alone, scheduled on a worker (it inserts and counts the keys)."""
        step = tf.function(lambda keys: tf.reduce_sum(tfs.embedding_lookup(table, keys)))
        self.coordinator.schedule(step, args=(tf.constant(keys),))
        self.coordinator.join()

    def assert_same_tables(self, layer, other, columns=("accumulator",), atol=1e-6) -> None:
        assert_same_tables(self, layer, other, columns, atol)

    def assert_rows_accounted(self, layer) -> None:
        assert_rows_accounted(self, layer)

    @pytest.mark.slow  # over 4 s
    def test_tables_share_a_pool_per_ps_and_each_trains_like_its_own_reference(self):
        layer, optimizer = self.collection()
        tables = layer.tables
        # The int64 tables share one pool per ps; the string table (its keys travel apart) has its own.
        for i in range(2):
            self.assertIs(tables["a"].variables[i], tables["b"].variables[i])
            self.assertIsNot(tables["a"].variables[i], tables["c"].variables[i])
        self.assertLen(layer.trainable_variables, 4)
        group = owner_of(tables["a"].variables[0])[0]
        self.assertEqual([t.name for t in group.members], [tables["a"].name, tables["b"].name])

        batches = key_batches(np.random.default_rng(1), 4)
        reference = PooledReference(tables, batches, 0.3)
        self.train(layer, optimizer, batches)
        for batch in batches:
            reference.step(batch)
        assert_like_reference(self, tables, reference)
        # Every table's keys hold distinct rows of the shared pools.
        for i in range(2):
            used = np.concatenate([tables[n].shards[i].index.export()[1].numpy() for n in ("a", "b")])
            self.assertEqual(len(set(used.tolist())), len(used))

    def test_under_the_default_strategy_the_tables_share_one_pool_and_train_like_their_references(self):
        # One device, one copy of each table: the collection pools its int64 tables there too (one insert
        # section a step for both), and each table still trains exactly like its own dense reference.
        default = tf.distribute.get_strategy()
        layer, optimizer = self.collection(strategy=default)
        tables = layer.tables
        self.assertIs(tables["a"].variables[0], tables["b"].variables[0])
        self.assertIsNot(tables["a"].variables[0], tables["c"].variables[0])
        self.assertLen(layer.trainable_variables, 2)
        batches = key_batches(np.random.default_rng(4), 4)
        reference = PooledReference(tables, batches, 0.3)
        step = squared_norm_collection_step(default, layer, optimizer)
        for batch in batches:
            step({n: tf.constant(v) for n, v in batch.items()})
            reference.step(batch)
        assert_like_reference(self, tables, reference)
        self.assert_rows_accounted(layer)

    @pytest.mark.slow  # over 5 s here
    def test_checkpoint_restores_into_separate_tables_and_into_a_used_pool_with_slots(self):
        layer, optimizer = self.collection()
        batches = key_batches(np.random.default_rng(2), 3)
        self.train(layer, optimizer, batches)
        path = tf.train.Checkpoint(layer=layer, optimizer=optimizer).save(self.get_temp_dir() + "/pooled")

        # A local collection with a pool per table gets every table's keys, rows and slots.
        local, local_optimizer = self.collection(strategy=tf.distribute.get_strategy(), batch_tables=False)
        tf.train.Checkpoint(layer=local, optimizer=local_optimizer).restore(path).assert_existing_objects_matched()
        self.assert_same_tables(local, layer)

        # A pooled collection that already holds other keys, its optimizer built after the restore (the slots
        # wait for it): each table's old keys leave, its rows are the checkpoint's, and training goes on alike.
        again, again_optimizer = self.collection(build_optimizer=False)
        self.train(again, tfs.optimizers.SGD(0.1), key_batches(np.random.default_rng(9), 2))
        tf.train.Checkpoint(layer=again, optimizer=again_optimizer).restore(path)
        with self.strategy.scope():
            again_optimizer.build(again.trainable_variables)
        self.assert_same_tables(again, layer)
        more = key_batches(np.random.default_rng(3), 2)
        self.train(layer, optimizer, more)
        self.train(again, again_optimizer, more)
        self.assert_same_tables(again, layer)
        self.assert_rows_accounted(again)

    def trained_pooled_and_alone(self, seed: int, **policies) -> tuple:
        """The same collection with pooled and with separate tables (`policies` per table), "b" looked up once
        alone first (one table step ahead of "a": each row must be marked with its own table's step), then
        trained on the same batches; returns (pooled, alone, batches)."""
        pooled, pooled_optimizer = self.collection(**policies)
        alone, alone_optimizer = self.collection(batch_tables=False, **policies)
        self.assertIs(pooled.tables["a"].variables[0], pooled.tables["b"].variables[0])
        self.assertIsNot(alone.tables["a"].variables[0], alone.tables["b"].variables[0])
        batches = key_batches(np.random.default_rng(seed), 5)
        for layer, optimizer in ((pooled, pooled_optimizer), (alone, alone_optimizer)):
            self.look_up(layer.tables["b"], batches[0]["b"])
            self.train(layer, optimizer, batches)
        # `seen` and `hits` are integers, equal. Rows can differ by an ulp a step: the pooled update runs
        # Adagrad on every table's rows in one tensor, where Eigen rounds some elements on another path than
        # in one table's, and Adagrad on a key met ten times a step grows that to ~1e-6 in five steps.
        self.assert_same_tables(pooled, alone, columns=("accumulator", "seen", "hits"), atol=1e-5)
        self.assert_rows_accounted(pooled)
        return pooled, alone, batches

    @pytest.mark.slow  # over 5 s here
    def test_each_table_marks_its_rows_with_its_own_step_and_holds_to_its_own_capacity(self):
        # No table turns keys away by admission: a pool inserts its tables' keys as one tensor, making room for
        # the bounded ones' in the same step. "a" (bounded) shares its pools with "b" (not): the helper checks it.
        policies = {name: {"eviction": tfs.policies.CapacityEviction(bound)} for name, bound in (("a", 60), ("c", 12))}
        pooled, alone, batches = self.trained_pooled_and_alone(6, **policies)
        for name, bound in (("a", 60), ("c", 12)):
            fed = len({k for b in batches for k in b[name].tolist()})
            self.assertGreater(fed, bound + 10, name)  # the bound was reached and keys were evicted
            for layer in (pooled, alone):
                self.assertEqual(int(layer.tables[name].size()), bound, name)

    @pytest.mark.slow  # over 5 s here
    def test_policies_apply_per_table_in_a_shared_pool(self):
        policies = {
            "a": {"eviction": tfs.policies.StepsSinceSeenEviction(1, every=1)},
            "b": {"admission": tfs.policies.MinCountAdmission(2)},
        }
        pooled, _, batches = self.trained_pooled_and_alone(4, **policies)
        # "a" keeps only the last step's keys, and its evicted rows went back to the shared pools for reuse.
        self.assertEqual(set(by_key(pooled.tables["a"])), set(batches[-1]["a"].tolist()))
        handed_out = sum(int(s.count.numpy()) for s in pooled.tables["a"].shards)
        ever = len({k for b in batches for k in b["a"].tolist()}) + int(pooled.tables["b"].size())
        self.assertLess(handed_out, ever)

    def test_a_keras_optimizer_is_refused_naming_the_pooled_tables(self):
        layer, _ = self.collection()
        model = self.model_of(layer)
        with self.strategy.scope():
            model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
        dataset_fn = lambda context=None: tf.data.Dataset.from_tensors(  # noqa: E731
            ({"a": [1, 2], "b": [3, 4], "c": ["x", "y"]}, tf.zeros([2, 3 * DIM]))
        )
        names = f"'{layer.tables['a'].name}', '{layer.tables['b'].name}'"
        with self.assertRaisesRegex(ValueError, f"Dynamic tables {names} need a tfs.optimizers optimizer.*Adagrad"):
            tfs.fit(model, dataset_fn, steps_per_epoch=1, verbose=0)
        self.assertEqual([int(layer.tables[n].size()) for n in NAMES], [0, 0, 0])

    def test_a_table_met_twice_in_one_lookup_inserts_each_key_once(self):
        layer, _ = self.collection()
        a, b = layer.tables["a"], layer.tables["b"]
        first, second = np.arange(0, 40, dtype=np.int64), np.arange(20, 60, dtype=np.int64)

        @tf.function
        def step(x, y):
            rows = lookup_many([(a, x), (b, x), (a, y)])
            return [tf.reduce_sum(r) for r in rows]

        self.coordinator.schedule(step, args=(tf.constant(first), tf.constant(second)))
        self.coordinator.join()
        self.assertEqual(int(a.size()), 60)
        self.assertEqual(int(b.size()), 40)
        self.assert_rows_accounted(layer)
        for i in range(2):
            used = np.concatenate([t.shards[i].index.export()[1].numpy() for t in (a, b)])
            self.assertEqual(len(set(used.tolist())), len(used))

    @pytest.mark.slow  # over 5 s here
    def test_export_and_delta_serve_each_table_of_the_pools_without_the_library(self):
        layer, optimizer = self.collection()
        model = self.model_of(layer)
        batches = key_batches(np.random.default_rng(5), 3)
        self.train(layer, optimizer, batches[:2])
        path = tfs.export(model, os.path.join(self.get_temp_dir(), "served"))
        since = {n: int(layer.tables[n].step.numpy()) for n in NAMES}
        self.train(layer, optimizer, batches[2:])
        delta = os.path.join(self.get_temp_dir(), "delta")
        updated = tfs.export_delta(model, delta, since_step=since["a"])
        self.assertEqual(
            updated, {t.name: int(tf.size(t.export(since_step=since[n])[0])) for n, t in layer.tables.items()}
        )

        never = {"a": 7777777, "b": -8888888, "c": "never"}  # never trained: served as their initial rows
        probe = {n: np.concatenate([batches[2][n][:5], [never[n]]]) for n in NAMES}
        served = serve_elsewhere(self, path, {n: v.astype("S") if n == "c" else v for n, v in probe.items()}, delta)
        rows = {n: by_key(layer.tables[n]) for n in NAMES}
        for n, start in zip(NAMES, range(0, 3 * DIM, DIM)):
            for i, key in enumerate(probe[n].tolist()):
                want = rows[n].get(key)
                if want is None:
                    want = layer.tables[n].initial_rows(tf.constant([key], layer.tables[n].key_dtype)).numpy()[0]
                self.assertAllClose(served[i, start : start + DIM], want, atol=1e-6, msg=f"table {n} key {key}")

        # A .keras file holds each table's keys and rows; loaded under the default strategy, the int64 tables
        # share that device's one pool (as they shared each ps's), and each gets its own keys and rows back.
        saved = os.path.join(self.get_temp_dir(), "pooled.keras")
        model.save(saved)
        loaded = keras.models.load_model(saved).get_layer(layer.name)
        self.assertIs(loaded.tables["a"].variables[0], loaded.tables["b"].variables[0])
        self.assertLen(loaded.tables["a"].variables, 1)
        self.assert_same_tables(loaded, layer, columns=())


if __name__ == "__main__":
    tf.test.main()
