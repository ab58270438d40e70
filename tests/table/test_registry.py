"""Table kinds and placements are registered objects: every table names its own, lookups route by them, and a
new kind plugs in with a registration and a lookup route, TF's embedding ops included."""

import types

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.conformance import minimal_kind
from tests.harness.strategies import mirrored, uid
from tf_sharded.table import registry


class RegistryTest(tf.test.TestCase):
    def test_every_table_names_its_kind_and_placement(self):
        fixed = tfs.create_sharded_variable(uid("fixed"), [6, 2], partitions=2)
        dynamic = tfs.create_dynamic_table(name=uid("dyn"), dim=2)
        self.assertEqual((fixed.kind.name, fixed.placement_type.name), ("fixed", "local"))
        self.assertEqual((dynamic.kind.name, dynamic.placement_type.name), ("dynamic", "local"))
        self.assertTrue(fixed.kind.static_rows)
        self.assertFalse(dynamic.kind.static_rows)
        strategy = mirrored()
        with strategy.scope():
            made = {
                placement: strategy.create_sharded_variable(uid(placement), [8, 2], placement=placement)
                for placement in ("device", "host", "sharded")
            }
        self.assertEqual(
            {p: t.placement_type.name for p, t in made.items()},
            {"device": "device", "host": "host", "sharded": "replicas"},
        )
        self.assertEqual([t.placement_type.single_copy for t in made.values()], [False, True, True])
        self.assertTrue(all(registry.is_any_table(t) for t in [fixed, dynamic, *made.values()]))
        self.assertFalse(registry.is_any_table(tf.Variable([1.0])))

    def test_a_name_registered_twice_and_a_pair_without_a_route_are_refused(self):
        with self.assertRaisesRegex(ValueError, "A table kind named 'fixed' is registered already"):
            registry.register_kind(registry.Kind("fixed", static_rows=False))
        with self.assertRaisesRegex(ValueError, "Unknown placement 'nowhere'; registered: \\['device', 'host'"):
            registry.placement("nowhere")
        lonely = registry.register_kind(registry.Kind(uid("lonely"), static_rows=True))
        with self.assertRaisesRegex(NotImplementedError, f"No lookup is registered for {lonely.name} tables placed "):
            registry.lookup_route(registry.HOST, lonely)

    def test_a_new_kind_is_a_class_a_registration_and_a_route(self):
        """A minimal kind (rows computed from the id, nothing stored) reaches tfs.embedding_lookup and TF's own
        embedding ops through the registry alone, clipped and combined as every kind is."""
        self.assertIs(registry.kind("constant_rows_for_test"), minimal_kind.CONSTANT)
        self.assertIs(registry.lookup_route(registry.LOCAL, minimal_kind.CONSTANT), minimal_kind.route)
        table = minimal_kind.ConstantRows()
        ids = np.array([[3, 4], [0, 3]])
        want = np.stack([ids, -ids], -1).astype(np.float32)
        self.assertAllClose(tfs.embedding_lookup(table, ids), want)
        self.assertAllClose(tf.nn.embedding_lookup(table, ids), want)
        clipped = tfs.embedding_lookup(table, [3], max_norm=1.0)
        self.assertAllClose(clipped, [[2**-0.5, -(2**-0.5)]])
        ragged = tf.ragged.constant([[3, 4], [1]], dtype=tf.int64)
        self.assertAllClose(tfs.embedding_lookup_sparse(table, ragged, combiner="sum"), [[7.0, -7.0], [1.0, -1.0]])

    def test_a_kind_knows_its_configs_its_weights_its_checkpoint_entries_and_its_export(self):
        fixed = tfs.create_sharded_variable(uid("fixed"), [4, 2], partitions=2, seed=0)
        dynamic = tfs.create_dynamic_table(name=uid("dyn"), dim=2, seed=0)
        tfs.embedding_lookup(dynamic, [5, 9])
        self.assertIs(registry.kind_of_config(tfs.TableConfig("t", [4, 2])), fixed.kind)
        self.assertIs(registry.kind_of_config(tfs.DynamicTableConfig("d", 2)), dynamic.kind)
        unknown = types.SimpleNamespace(name="odd", vocabulary="odd")
        with self.assertRaisesRegex(ValueError, "No table kind is registered for 'odd' tables \\(config 'odd'\\)"):
            registry.kind_of_config(unknown)
        self.assertEqual((fixed.kind.noun, dynamic.kind.noun), ("table", "dynamic table"))
        self.assertEqual((fixed.kind.deltas, dynamic.kind.deltas), (False, True))
        # Weight files: one full-shape array, or the live keys and rows.
        store = {}
        for table in (fixed, dynamic):
            table.kind.save_weights(table, store, table.name)
        self.assertEqual(sorted(store), sorted([fixed.name, f"{dynamic.name}__keys", f"{dynamic.name}__values"]))
        want = fixed.numpy()
        fixed.assign(np.zeros([4, 2], np.float32))
        fixed.kind.load_weights(fixed, store, fixed.name, "layer")
        self.assertAllClose(fixed.numpy(), want)
        with self.assertRaisesRegex(ValueError, "Layer 'layer': the saved file has no 'other' entry"):
            fixed.kind.load_weights(fixed, store, "other", "layer")
        with self.assertRaisesRegex(ValueError, "saved 'wide' has shape \\[4, 3\\], the layer's table has shape"):
            fixed.kind.load_weights(fixed, {"wide": np.zeros([4, 3])}, "wide", "layer")
        rows = dict(zip(*[t.numpy().tolist() for t in dynamic.export()]))
        dynamic.assign_keys(tf.constant([1], tf.int64), np.zeros([1, 2], np.float32))
        dynamic.kind.load_weights(dynamic, store, dynamic.name, "layer")
        self.assertEqual(dict(zip(*[t.numpy().tolist() for t in dynamic.export()])), rows)
        # Checkpoint entries: a fixed table is one value; a dynamic one its keys and rows under its prefix.
        key = "t/.ATTRIBUTES/VARIABLE_VALUE"
        self.assertIsNone(fixed.kind.checkpoint_difference(fixed, key, {}, {}))
        prefix = "t/.ATTRIBUTES/"
        shapes, dtypes = {prefix + "keys": [3], prefix + "values": [3, 2]}, {prefix + "keys": tf.int64}
        self.assertEqual(dynamic.kind.checkpoint_difference(dynamic, key, shapes, dtypes), (prefix, ""))
        shapes[prefix + "values"] = [3, 5]
        self.assertEqual(
            dynamic.kind.checkpoint_difference(dynamic, key, shapes, dtypes),
            (prefix, "rows of 5 in the checkpoint, 2 in the model"),
        )
        dtypes[prefix + "keys"] = tf.string
        self.assertEqual(
            dynamic.kind.checkpoint_difference(dynamic, key, shapes, dtypes),
            (prefix, "string keys in the checkpoint, int64 in the model"),
        )
        self.assertEqual(
            dynamic.kind.checkpoint_difference(dynamic, key, {}, {}), (prefix, "in the model, not in the checkpoint")
        )
        self.assertIsNone(fixed.kind.exported(fixed))
        self.assertIsInstance(dynamic.kind.exported(dynamic), tf.Module)
        self.assertEqual(fixed.kind.reset_lost(fixed), 0)

    def test_a_placement_knows_what_each_replica_and_worker_holds(self):
        self.assertEqual(
            [(p.option, p.per_replica, p.exchanged) for p in (registry.DEVICE, registry.HOST, registry.REPLICAS)],
            [("device", "copy", True), ("host", None, True), ("sharded", "shard", False)],
        )
        # A table of 400 bytes over 4 replicas, 2 of them on this worker.
        self.assertEqual(
            [(p.replica_bytes(400, 4), p.copies_per_worker(2, 4)) for p in (registry.DEVICE, registry.HOST,
                                                                             registry.REPLICAS, registry.WORKERS)],
            [(400, 2), (0.0, 1), (100.0, 0.5), (100.0, 0.5)],
        )  # fmt: skip
        self.assertEqual(
            [registry.chosen_placement(o) for o in (None, "auto", tfs.Placement.HOST, "sharded")],
            [None, None, registry.HOST, registry.REPLICAS],
        )
        self.assertIs(registry.placement_of_option(tfs.Placement.DEVICE, over_workers=False), registry.DEVICE)
        with self.assertRaisesRegex(ValueError, "Argument `per_replica` must be None, 'copy' or 'shard'"):
            registry.PlacementType("odd", "odd", per_replica="half")

    def test_a_new_kind_keeping_state_beside_variables_is_reset_by_recovery_through_its_kind(self):
        """`tfs.training`'s recovery after a lost ps asks each table's kind, not its class, what to reset."""
        from tf_sharded.keras.training.recovery import reset_dynamic

        class Counting(registry.Kind):
            def reset_lost(self, table):
                table.resets += 1
                return 3

        counting = registry.register_kind(Counting("counting_for_test", static_rows=False, noun="counting table"))

        class Counted(registry.TableClass, tf.Module):
            kind, placement_type, resets = counting, registry.LOCAL, 0

        root = tf.Module()
        root.table, root.fixed = Counted(), tfs.create_sharded_variable(uid("fixed"), [4, 2])
        self.assertEqual(reset_dynamic(root), 3)
        self.assertEqual(root.table.resets, 1)


if __name__ == "__main__":
    pytest.main([__file__])
