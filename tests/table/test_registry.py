"""Table kinds and placements are registered objects: every table names its own, lookups route by them, and a
new kind plugs in with a registration and a lookup route, TF's embedding ops included."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import mirrored, uid
from tf_sharded.table import registry
from tf_sharded.table.norms import clip_rows


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
        constant = registry.register_kind(registry.Kind("constant_rows_for_test", static_rows=True))

        class ConstantRows(registry.TableClass):
            kind, placement_type = constant, registry.LOCAL
            name, dtype, shape = "constant", tf.float32, tf.TensorShape([100, 2])

            def check_ids(self, ids, arg="ids", max_rank=3):
                ids = tf.cast(ids, tf.int64)
                return ids, tf.reshape(ids, [-1])

        def route(pairs, max_norm, training):
            return [clip_rows(tf.stack([tf.cast(ids, tf.float32), -tf.cast(ids, tf.float32)], 1), max_norm)
                    for _, ids in pairs]  # fmt: skip

        registry.register_lookup(registry.LOCAL, constant, route)
        table = ConstantRows()
        ids = np.array([[3, 4], [0, 3]])
        want = np.stack([ids, -ids], -1).astype(np.float32)
        self.assertAllClose(tfs.embedding_lookup(table, ids), want)
        self.assertAllClose(tf.nn.embedding_lookup(table, ids), want)
        clipped = tfs.embedding_lookup(table, [3], max_norm=1.0)
        self.assertAllClose(clipped, [[2**-0.5, -(2**-0.5)]])
        ragged = tf.ragged.constant([[3, 4], [1]], dtype=tf.int64)
        self.assertAllClose(tfs.embedding_lookup_sparse(table, ragged, combiner="sum"), [[7.0, -7.0], [1.0, -1.0]])


if __name__ == "__main__":
    pytest.main([__file__])
