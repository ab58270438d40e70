"""Tables sharded over MirroredStrategy's replicas (`placement="sharded"`), against single-device references."""

from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.graphs import ROW_OPS, whole_table_reads
from tests.harness.models import mixed_width_layer, one_device_embedding, optimizer_cases, pooled_model
from tests.harness.references import squared_norm_adagrad_collection, table_values
from tests.harness.steps import squared_norm_collection_step, squared_norm_step
from tests.harness.strategies import mirrored, per_replica, uid
from tf_sharded.table.batched import storage_of

pytestmark = pytest.mark.mirrored

ROWS, DIM = 50, 4
WRITES = ("ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate", "AssignVariableOp",
          "AssignSubVariableOp", "AssignAddVariableOp")  # fmt: skip


def data(n=64):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, ROWS, (n, 3))
    ids[:8] = 7  # duplicates inside and across replicas' batches
    return ids, rng.rand(n, 1).astype(np.float32)


class ShardedPlacementTest(tf.test.TestCase):
    def test_each_replica_holds_one_shard_and_its_slots(self):
        strategy = mirrored()
        devices = list(strategy.extended.worker_devices)
        values = table_values(ROWS, DIM)
        for scheme in ("div", "mod", "balanced"):
            with strategy.scope():
                table = strategy.create_sharded_variable(
                    uid("sh"), [ROWS, DIM], initializer=values, scheme=scheme, placement="sharded"
                )
                optimizer = tfs.optimizers.Adagrad(0.1)
                optimizer.build(table.variables)
            self.assertEqual((table.placement, table.num_shards), ("sharded", 4))
            self.assertEqual(list(table.devices), devices, msg=scheme)
            for shard in table.variables:  # one plain variable per shard: no copy on another replica
                self.assertFalse(isinstance(shard, tf.distribute.DistributedValues), msg=scheme)
            self.assertEqual(sum(v.shape[0] for v in table.variables), ROWS)
            self.assertAllEqual(table.numpy(), values)
            slot = optimizer.table_slot(table, "accumulator")
            self.assertEqual(list(slot.devices), devices, msg=scheme)

    @pytest.mark.slow  # over 4 s here
    def test_keras_and_lazy_optimizers_match_one_device(self):
        strategy = mirrored()
        ids, y = data()
        for cls, cfg, scheme, slot_name in optimizer_cases():
            msg = f"{cls.__module__}.{cls.__name__} {scheme}"
            with strategy.scope():
                layer = tfs.layers.Embedding(ROWS, DIM, scheme=scheme, seed=3, placement="sharded")
                model = pooled_model(layer, cls(**cfg))
            table0 = layer.embeddings.numpy()
            model.fit(ids, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
            self.assertEqual(layer.embeddings.placement, "sharded")
            single = one_device_embedding(cls, table0)
            reference = pooled_model(single, cls(**cfg))
            reference.fit(ids, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
            self.assertAllClose(layer.embeddings.numpy(), single.embeddings.numpy(), atol=2e-5, msg=msg)
            self.assertAllClose(model.layers[-1].kernel.numpy(), reference.layers[-1].kernel.numpy(), atol=2e-5)
            self.assertEqual(int(model.optimizer.iterations.numpy()), int(reference.optimizer.iterations.numpy()))
            if slot_name is not None:
                got = model.optimizer.table_slot(layer.embeddings, slot_name)
                self.assertEqual(got.devices, layer.embeddings.devices, msg=msg)
                want_slot = reference.optimizer.table_slot(single.embeddings, slot_name).numpy()
                self.assertAllClose(got.numpy(), want_slot, atol=2e-5, msg=msg)

    def test_each_row_is_updated_on_its_owner_once_and_no_step_reads_a_whole_table(self):
        strategy = mirrored()
        rows = 1009
        layer, optimizer, reference = mixed_width_layer(strategy, rows, uid("owners"))
        step = squared_norm_collection_step(strategy, layer, optimizer)
        arrays = {
            "fa": [np.array([1, 2, 2]), np.array([1, 700]), np.array([1000]), np.array([3, 3])],
            "fb": [np.array([0, 5]), np.array([9]), np.array([1010, 5]), np.array([5])],
            "fc": [tf.ragged.constant([[1, 1], [1000]]), tf.ragged.constant([[2], []]),
                   tf.ragged.constant([[3, 4, 5], [1]]), tf.ragged.constant([[1013], [0]])],
        }  # fmt: skip
        features = {k: per_replica(strategy, v) for k, v in arrays.items()}
        step(features)
        # The same step on one device, summed over the replicas' batches.
        want = squared_norm_adagrad_collection(reference, [arrays])
        for name in reference:
            self.assertAllClose(layer.tables[name].numpy(), want[name], atol=1e-5, msg=name)

        graph = step.get_concrete_function(features).graph
        # Consecutive tables of one width are stored together (a and b): one variable per replica, a slot beside it.
        storages = {id(storage_of(t) or t): storage_of(t) or t for t in layer.tables.values()}.values()
        self.assertIs(storage_of(layer.tables["a"]), storage_of(layer.tables["b"]))
        self.assertLen(storages, 2)
        handles = {}
        for storage in storages:
            slot = optimizer.table_slot(storage, "accumulator")
            self.assertEqual(list(storage.devices), list(strategy.extended.worker_devices))
            self.assertEqual(list(slot.devices), list(strategy.extended.worker_devices))
            for v in list(storage.variables) + list(slot.variables):
                handles[id(v.handle)] = v.device
        captured = {internal.name: handles[id(external)] for external, internal in graph.captures if id(external)
                    in handles}  # fmt: skip
        # No op reads a shard or slot shard other than by rows, and none produces a table's worth of rows.
        reads = [f"{op.type} {op.name}" for op in graph.get_operations() for t in op.inputs
                 if t.name in captured and op.type not in ROW_OPS]  # fmt: skip
        self.assertEqual(reads, [])
        self.assertEqual([p for p in whole_table_reads(step.get_concrete_function(features), rows)
                          if "produces" in p], [])  # fmt: skip
        writes = {}
        for op in graph.get_operations():
            if op.type in WRITES and op.inputs[0].name in captured:
                writes.setdefault(op.inputs[0].name, []).append(op)
                self.assertEqual(
                    tf.DeviceSpec.from_string(op.device or captured[op.inputs[0].name]).to_string(),
                    tf.DeviceSpec.from_string(captured[op.inputs[0].name]).to_string(),
                    msg=op.name,
                )
        self.assertLen(writes, 2 * 4 * 2)  # every storage variable (2 widths x 4 owners) and its slot is written ...
        self.assertEqual({len(ops) for ops in writes.values()}, {1})  # ... once per step, not once per replica
        # One payload per owner and row shape carries the three tables: 4 owners x 2 widths, not 4 x 3.
        merges = [op for op in graph.get_operations() if op.type == "Unique" and "tfs_to_owners" in op.name]
        self.assertLen(merges, 4 * 2)

    def test_keras_optimizers_with_slots_are_refused_by_tfs_fit(self):
        strategy = mirrored()
        ids, y = data(16)
        for placement in ("sharded", "host"):
            with strategy.scope():
                layer = tfs.layers.Embedding(ROWS, DIM, seed=3, placement=placement)
                model = pooled_model(layer, keras.optimizers.Adam(0.05))
            before = layer.embeddings.numpy()
            with self.assertRaisesRegex(
                ValueError,
                rf"\(placement='{placement}'\) needs a tfs.optimizers optimizer.* "
                r"Received: optimizer=keras.src.optimizers.adam.Adam. Use tfs.optimizers.Adam",
            ):
                tfs.fit(model, tf.data.Dataset.from_tensor_slices((ids, y)).batch(8), epochs=1, verbose=0)
            self.assertAllEqual(layer.embeddings.numpy(), before)  # refused before anything ran
            self.assertEqual(int(model.optimizer.iterations.numpy()), 0)

    def test_bad_arguments(self):
        strategy = mirrored()
        with strategy.scope():
            with self.assertRaisesRegex(ValueError, r"`partitions` of table 'x' must give one shard per replica"):
                strategy.create_sharded_variable("x", [40, 2], partitions=3, placement="sharded")
            with self.assertRaisesRegex(ValueError, r"`exchange` of table 'y' does not apply to placement='sharded'"):
                strategy.create_sharded_variable("y", [40, 2], exchange="dense", placement="sharded")
        with self.assertRaisesRegex(ValueError, "Argument `placement`"):
            tfs.create_sharded_variable("z", [40, 2], placement="sharded")  # the default strategy: no replicas

    def test_auto_shards_a_table_whose_copy_does_not_fit_a_replica(self):
        strategy = mirrored()
        family = tfs.strategy.mirrored
        need = ROWS * DIM * 4 * 2  # the table and one slot
        # The replica's memory is measured: a real host holds this small table's copy (the size rule: device).
        self.assertGreater(family.replica_memory(strategy), need)
        cases = [(need // 2, "sharded"), (need // 8, "host"), (None, "device")]  # a quarter fits / does not
        for budget, want in cases:
            with mock.patch.object(family, "replica_memory", return_value=budget), strategy.scope():
                table = strategy.create_sharded_variable(uid("auto"), [ROWS, DIM], placement="auto")
                layer = tfs.layers.Embedding(ROWS, DIM)  # no placement given: the same rule
                layer.build()
            self.assertEqual((table.placement, layer.embeddings.placement), (want, want), msg=budget)
        self.assertEqual(list(table.devices)[0], strategy.extended.worker_devices[0])

    def test_explicit_device_placement_whose_copy_cannot_fit_is_refused_before_creation(self):
        strategy = mirrored()
        family = tfs.strategy.mirrored
        table_bytes = ROWS * DIM * 4
        name = uid("big")
        # A replica holding half the table: its copy cannot fit, whatever the optimizer.
        created = []

        def record(next_creator, **kwargs):
            created.append(kwargs.get("name"))
            return next_creator(**kwargs)

        with mock.patch.object(family, "replica_memory", return_value=table_bytes // 2), strategy.scope():
            layer = tfs.layers.Embedding(ROWS, DIM, placement="device")
            with tf.variable_creator_scope(record):
                with self.assertRaises(ValueError) as raised:
                    strategy.create_sharded_variable(name, [ROWS, DIM], placement="device")
                with self.assertRaisesRegex(ValueError, "placement='device' puts a copy of"):
                    layer.build()
            self.assertEqual(created, [])  # refused before any variable was created
            # A table that fits is created (through the same recording scope).
            with tf.variable_creator_scope(record):
                fits = strategy.create_sharded_variable(uid("fits"), [ROWS // 4, DIM], placement="device")
            self.assertNotEqual(created, [])
        message = str(raised.exception)
        mib = f"{table_bytes / 2**20:,.1f} MiB"
        self.assertIn(f"Argument `placement` of table '{name}'", message)
        self.assertIn(f"a copy of {mib} (the table alone", message)
        self.assertIn(f"a replica holds {table_bytes / 2 / 2**20:,.1f} MiB", message)
        self.assertIn("placement='sharded'", message)
        self.assertEqual(len(message.splitlines()), 1)
        self.assertEqual(layer.weights, [])
        self.assertEqual(fits.placement, "device")


class ShardedTrainingFunctionsTest(tf.test.TestCase):
    @pytest.mark.slow  # over 4 s here
    def test_fit_evaluate_predict_and_export_match_one_device(self):
        strategy = mirrored()
        ids, y = data()
        dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(16)
        with strategy.scope():
            layer = tfs.layers.Embedding(ROWS, DIM, seed=4, combiner="sum", placement="sharded")
            inp = keras.Input((3,), dtype="int64")
            model = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(layer(inp)))
            # tfs.fit's own loop: Keras's steps_per_execution > 1 fails under MirroredStrategy.
            model.compile(optimizer=tfs.optimizers.Adagrad(0.2), loss="mse", steps_per_execution=3)
        table0 = layer.embeddings.numpy()
        single = tfs.layers.Embedding(ROWS, DIM, partitions=1, combiner="sum", embeddings_initializer=table0)
        inp = keras.Input((3,), dtype="int64")
        reference = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(single(inp)))
        reference.compile(optimizer=tfs.optimizers.Adagrad(0.2), loss="mse")
        history = tfs.fit(model, dataset, epochs=2, verbose=0)
        want_history = reference.fit(dataset, epochs=2, verbose=0)
        self.assertAllClose(history.history["loss"], want_history.history["loss"], atol=1e-5)
        self.assertAllClose(layer.embeddings.numpy(), single.embeddings.numpy(), atol=1e-5)
        self.assertAllClose(tfs.evaluate(model, dataset), reference.evaluate(dataset, verbose=0), atol=1e-5)
        want = reference.predict(ids, verbose=0)
        self.assertAllClose(tfs.predict(model, tf.data.Dataset.from_tensor_slices(ids).batch(16)), want, atol=1e-5)
        # The export holds one plain table: no shard, no replica device.
        loaded = tf.saved_model.load(tfs.export(model, self.get_temp_dir() + f"/{uid('export')}"))
        served = loaded.signatures["serving_default"]
        self.assertAllClose(list(served(tf.constant(ids[:8], tf.int64)).values())[0], want[:8], atol=1e-5)


class ShardedCheckpointTest(tf.test.TestCase):
    def test_checkpoints_cross_placements_with_slots(self):
        strategy = mirrored()
        values = table_values(ROWS, DIM)
        ids = tf.constant([[1, 2, 2], [40, 7, 7]], tf.int64)
        with strategy.scope():
            table = strategy.create_sharded_variable(
                uid("ck"), [ROWS, DIM], initializer=values, scheme="mod", placement="sharded"
            )
            optimizer = tfs.optimizers.Adam(0.1)
            optimizer.build(table.variables)
        squared_norm_step(strategy, table, optimizer)(per_replica(strategy, [ids] * 4))
        trained, velocity = table.numpy(), optimizer.table_slot(table, "velocity").numpy()
        path = tf.train.Checkpoint(t=table, o=optimizer).save(self.get_temp_dir() + f"/{uid('s')}")
        # Into one device, 3 shards: table and slot.
        local = tfs.create_sharded_variable(uid("l"), [ROWS, DIM], initializer="zeros", partitions=3)
        local_opt = tfs.optimizers.Adam(0.1)
        tf.train.Checkpoint(t=local, o=local_opt).restore(path)
        local_opt.build(local.variables)  # delayed: the slots are created after restore() was called
        self.assertAllEqual(local.numpy(), trained)
        self.assertAllEqual(local_opt.table_slot(local, "velocity").numpy(), velocity)
        # Into a plain variable, and into copies on every device.
        plain = tf.Variable(tf.zeros([ROWS, DIM]))
        tf.train.Checkpoint(t=plain).restore(path).expect_partial()
        self.assertAllEqual(plain.numpy(), trained)
        with strategy.scope():
            mirrored_table = strategy.create_sharded_variable(
                uid("m"), [ROWS, DIM], initializer="zeros", partitions=2, placement="device"
            )
        tf.train.Checkpoint(t=mirrored_table).restore(path).expect_partial()
        self.assertAllEqual(mirrored_table.numpy(), trained)
        # And back: a mirrored checkpoint into a sharded table with its slots.
        back_path = tf.train.Checkpoint(t=mirrored_table).save(self.get_temp_dir() + f"/{uid('b')}")
        with strategy.scope():
            back = strategy.create_sharded_variable(
                uid("b"), [ROWS, DIM], initializer="zeros", scheme="balanced", placement="sharded"
            )
        tf.train.Checkpoint(t=back).restore(back_path)
        self.assertAllEqual(back.numpy(), trained)
        for shard, device in zip(back.variables, strategy.extended.worker_devices):
            self.assertEqual(shard.device, device)


if __name__ == "__main__":
    tf.test.main()
