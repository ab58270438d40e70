"""Table-batched storage: under parameter servers an EmbeddingCollection keeps consecutive tables of one dtype and
row shape in one variable per ps; each table's lookups, training, checkpoints, weight files and export stay its own.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.graphs import ROW_OPS, handle_uses, nodes
from tests.harness.serving import serve_elsewhere
from tests.harness.strategies import ps_strategy

pytestmark = pytest.mark.ps_cluster

# Two runs of one row shape (a-c, then w1-w2), then a table alone: two storages and a table of its own.
TABLES = {
    "a": {"input_dim": 10, "output_dim": 4, "partitions": 2, "seed": 1},
    "b": {"input_dim": 7, "output_dim": 4, "partitions": 3, "scheme": "mod", "seed": 2},
    "c": {"input_dim": 5, "output_dim": 4, "seed": 3},
    "w1": {"input_dim": 6, "output_dim": 8, "partitions": 2, "seed": 4},
    "w2": {"input_dim": 9, "output_dim": 8, "partitions": 2, "scheme": "balanced", "seed": 5},
    "d": {"input_dim": 9, "output_dim": 4, "partitions": 2, "seed": 6},
}
LR, EPSILON, INITIAL_ACCUMULATOR = 0.1, 1e-7, 0.1


def batches(steps: int):
    rng = np.random.default_rng(0)
    return [{k: rng.integers(0, v["input_dim"], 12) for k, v in TABLES.items()} for _ in range(steps)]


def adagrad_reference(initial: dict, steps) -> tuple:
    """Tables and accumulators after sparse Adagrad on `sum(rows ** 2)` per batch, in NumPy."""
    tables = {k: v.astype(np.float64) for k, v in initial.items()}
    accumulators = {k: np.full_like(v, INITIAL_ACCUMULATOR) for k, v in tables.items()}
    for batch in steps:
        for k, ids in batch.items():
            rows, counts = np.unique(ids, return_counts=True)
            grad = 2.0 * counts[:, None] * tables[k][rows]
            accumulators[k][rows] += grad**2
            tables[k][rows] -= LR * grad / np.sqrt(accumulators[k][rows] + EPSILON)
    return tables, accumulators


def build(strategy, batch_tables=True, partitions=None):
    tables = TABLES if partitions is None else {k: {**v, "partitions": partitions} for k, v in TABLES.items()}
    with strategy.scope():
        layer = tfs.layers.EmbeddingCollection(tables, {k: k for k in TABLES}, name="coll", batch_tables=batch_tables)
        layer.build()
        optimizer = tfs.optimizers.Adagrad(LR, epsilon=EPSILON, initial_accumulator_value=INITIAL_ACCUMULATOR)
        optimizer.build(layer.trainable_variables)
    return layer, optimizer


def step_fn(strategy, layer, optimizer):
    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                out = layer(ids)
                loss = tf.add_n([tf.reduce_sum(tf.square(out[k])) for k in TABLES])
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))
            return loss

        return strategy.run(fn, args=(ids,))

    return step


def ops_on_ps(concrete, op_type: str) -> int:
    return sum(n.op == op_type and "/job:ps" in n.device for n in nodes(concrete))


class BatchedStorageTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()
        cls.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(cls.strategy)

    def test_one_variable_per_ps_trains_every_table_like_a_local_reference(self):
        layer, optimizer = build(self.strategy)
        plain, plain_optimizer = build(self.strategy, batch_tables=False)
        self.assertEqual(
            sorted(v.name for v in layer.weights),
            ["batched_a_part_0", "batched_a_part_1", "batched_w1_part_0", "batched_w1_part_1", "d_part_0", "d_part_1"],
        )
        self.assertLen({v.value.device for v in layer.weights if v.name.startswith("batched_a")}, 2)
        self.assertLen(plain.weights, 13)  # a shard each: 2 + 3 + 2 (one per ps) + 2 + 2 + 2
        initial = {k: layer.tables[k].numpy() for k in TABLES}
        for k in TABLES:  # each table starts as it does with variables of its own
            self.assertAllEqual(initial[k], plain.tables[k].numpy(), msg=k)
            self.assertEqual(layer.tables[k].partition, plain.tables[k].partition, k)

        step, plain_step = step_fn(self.strategy, layer, optimizer), step_fn(self.strategy, plain, plain_optimizer)
        spec = {k: tf.TensorSpec([None], tf.int64) for k in TABLES}
        # A gather and an update (accumulator and rows) per variable: 6 instead of 13.
        for fn, variables in ((step, 6), (plain_step, 13)):
            concrete = fn.get_concrete_function(spec)
            self.assertEqual(ops_on_ps(concrete, "ResourceGather"), 2 * variables)  # rows, then the accumulator's
            self.assertEqual(ops_on_ps(concrete, "ResourceScatterSub"), variables)
            self.assertEqual(ops_on_ps(concrete, "ResourceScatterUpdate"), variables)

        # Nothing on the training path reads a storage variable (or its slot's) but by rows.
        storage = [v.value for v in layer.trainable_variables]
        slot_storage = {
            id(segment.storage): segment.storage
            for k in TABLES
            for segment in optimizer.table_slot(layer.tables[k], "accumulator").variables
            if hasattr(segment, "storage")
        }
        watched = storage + list(slot_storage.values())
        captured, uses = handle_uses(step.get_concrete_function(spec).graph, watched)
        self.assertEqual(captured, len({id(v.handle) for v in watched}))
        self.assertLen(slot_storage, 4)  # two storages on two ps each
        self.assertIn("ResourceScatterSub", {m.split()[0] for m in uses})
        self.assertEqual([m for m in uses if m.split()[0] not in ROW_OPS], [])

        steps = batches(3)
        for batch in steps:
            for fn in (step, plain_step):
                self.coordinator.schedule(fn, args=({k: tf.constant(v) for k, v in batch.items()},))
            self.coordinator.join()
        expected, accumulators = adagrad_reference(initial, steps)
        for k in TABLES:
            self.assertAllClose(layer.tables[k].numpy(), expected[k], rtol=1e-5, atol=1e-6, msg=k)
            self.assertAllClose(plain.tables[k].numpy(), expected[k], rtol=1e-5, atol=1e-6, msg=k)
            slot = optimizer.table_slot(layer.tables[k], "accumulator")
            self.assertAllClose(slot.numpy(), accumulators[k], rtol=1e-5, msg=k)
            self.assertEqual(slot.shape, layer.tables[k].shape)
        self.assertFalse(np.allclose(expected["b"], initial["b"]))

    def test_checkpoints_are_per_table_and_restore_across_batched_and_plain_layouts(self):
        layer, optimizer = build(self.strategy)
        for k in TABLES:  # distinct values in every table and slot
            layer.tables[k].assign(layer.tables[k].numpy() + 1.0)
            optimizer.table_slot(layer.tables[k], "accumulator").assign(np.full(layer.tables[k].shape, 0.5 + len(k)))
        path = tf.train.Checkpoint(layer=layer, optimizer=optimizer).save(os.path.join(self.get_temp_dir(), "b"))
        keys = {name: shape for name, shape in tf.train.list_variables(path) if "tables_" in name or "slots" in name}
        plain, plain_optimizer = build(tf.distribute.get_strategy(), partitions=3)  # one device, 3 shards each
        plain_path = tf.train.Checkpoint(layer=plain, optimizer=plain_optimizer).save(
            os.path.join(self.get_temp_dir(), "p")
        )
        self.assertEqual(keys, {name: shape for name, shape in tf.train.list_variables(plain_path) if name in keys})
        self.assertLen(keys, 12)  # a key per table and one per table's slot, each of the table's full shape
        self.assertEqual(keys["layer/tables_w2/.ATTRIBUTES/VARIABLE_VALUE"], [9, 8])
        self.assertEqual(keys["optimizer/table_slots_4_accumulator/.ATTRIBUTES/VARIABLE_VALUE"], [9, 8])

        tf.train.Checkpoint(layer=plain, optimizer=plain_optimizer).restore(path).assert_existing_objects_matched()
        for k in TABLES:
            self.assertAllEqual(plain.tables[k].numpy(), layer.tables[k].numpy(), msg=k)
            self.assertAllEqual(
                plain_optimizer.table_slot(plain.tables[k], "accumulator").numpy(),
                np.full(TABLES_SHAPE[k], 0.5 + len(k)),
            )
        # And back: a plain checkpoint into batched storage (other values, so nothing passes by chance).
        for k in TABLES:
            plain.tables[k].assign(plain.tables[k].numpy() * -2.0)
        plain_path = tf.train.Checkpoint(layer=plain, optimizer=plain_optimizer).save(
            os.path.join(self.get_temp_dir(), "p2")
        )
        fresh, fresh_optimizer = build(self.strategy)
        tf.train.Checkpoint(layer=fresh, optimizer=fresh_optimizer).restore(
            plain_path
        ).assert_existing_objects_matched()
        for k in TABLES:
            self.assertAllEqual(fresh.tables[k].numpy(), plain.tables[k].numpy(), msg=k)
            self.assertAllEqual(
                fresh_optimizer.table_slot(fresh.tables[k], "accumulator").numpy(),
                np.full(TABLES_SHAPE[k], 0.5 + len(k)),
            )

    @pytest.mark.slow  # over 4 s
    def test_keras_files_and_export_see_each_table(self):
        with self.strategy.scope():
            inputs = {k: keras.Input((), dtype="int64", name=k) for k in TABLES}
            layer = tfs.layers.EmbeddingCollection(TABLES, {k: k for k in TABLES}, name="coll")
            out = layer(inputs)
            model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()([out[k] for k in TABLES])))
        self.assertLen(layer.weights, 6)
        path = os.path.join(self.get_temp_dir(), "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path)  # no strategy: each table with variables of its own
        ids = {k: np.arange(3) % v["input_dim"] for k, v in TABLES.items()}
        for k in TABLES:
            self.assertAllEqual(loaded.get_layer("coll").tables[k].numpy(), layer.tables[k].numpy(), msg=k)
        expected = model({k: tf.constant(v) for k, v in ids.items()}).numpy()
        self.assertAllClose(loaded({k: tf.constant(v) for k, v in ids.items()}), expected)
        export = os.path.join(self.get_temp_dir(), "export")
        tfs.export(model, export)
        self.assertAllClose(serve_elsewhere(self, export, ids), expected, rtol=1e-6)

    def test_batch_tables_is_a_bool(self):
        with self.assertRaisesRegex(TypeError, "`batch_tables` must be a bool. Received: batch_tables='yes'"):
            tfs.layers.EmbeddingCollection(TABLES, {k: k for k in TABLES}, batch_tables="yes")
        self.assertFalse(
            tfs.layers.EmbeddingCollection.from_config(
                tfs.layers.EmbeddingCollection(TABLES, {k: k for k in TABLES}, batch_tables=False).get_config()
            ).batch_tables
        )


TABLES_SHAPE = {k: (v["input_dim"], v["output_dim"]) for k, v in TABLES.items()}


if __name__ == "__main__":
    tf.test.main()
