"""Fails loudly when a TensorFlow upgrade moves an internal tf_sharded relies on."""

import tensorflow as tf

import tf_sharded as tfs
from tf_sharded import _compat


class CompatTest(tf.test.TestCase):
    def test_keras_stateless_scope_is_left_for_table_creation(self):
        import keras

        with keras.StatelessScope():
            with _compat.outside_keras_stateless_scope():
                inside = keras.Variable(1.0)
            from keras.src.backend.common.stateless_scope import in_stateless_scope

            self.assertTrue(in_stateless_scope())
        self.assertIsInstance(inside.value, tf.Variable)  # created for real, not deferred

    def test_tensorflow_and_keras_versions_are_the_pinned_ones(self):
        import keras

        self.assertEqual(tf.__version__, "2.16.2")
        # _compat routes TFOptimizer._all_reduce_sum_gradients / _distributed_tf_update_step.
        self.assertEqual(keras.__version__, "3.15.1")
        from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer

        for name in ("_all_reduce_sum_gradients", "_distributed_tf_update_step", "update_step"):
            self.assertTrue(hasattr(keras_tf_optimizer.TFOptimizer, name), name)

    def test_trackable_and_saveable_classes(self):
        self.assertIs(_compat.Trackable, tf.__internal__.tracking.Trackable)
        self.assertEqual(_compat.VARIABLE_VALUE_KEY, "VARIABLE_VALUE")
        spec = _compat.save_spec(lambda: tf.zeros([2]), "4 0,2", "k", tf.float32, "/cpu:0")
        self.assertEqual((spec.slice_spec, spec.name, spec.dtype), ("4 0,2", "k", tf.float32))
        self.assertAllEqual(spec.tensor, [0.0, 0.0])
        for attr in ("object_proto", "checkpoint", "trackable"):
            self.assertTrue(hasattr(_compat.CheckpointPosition, attr), attr)

    def test_pending_restore_sees_the_checkpoint(self):
        seen = []
        original = _compat.pending_restore

        def spy(trackable):
            seen.append(original(trackable))
            return seen[-1]

        table = tfs.create_sharded_variable("compat_t", [6, 2], partitions=2)
        path = tf.train.Checkpoint(t=table).save(self.get_temp_dir() + "/c")
        _compat.pending_restore = spy
        try:
            tf.train.Checkpoint(t=table).restore(path)
        finally:
            _compat.pending_restore = original
        self.assertIn(("t/.ATTRIBUTES/VARIABLE_VALUE", [6, 2], tf.float32), seen)

    def test_strategy_internals(self):
        self.assertIs(type(tf.distribute.get_strategy()), _compat.default_strategy_type())

        class FakeExtended:
            _variable_partitioner = "p"
            _num_ps = 3

        class FakeStrategy:
            extended = FakeExtended()

        self.assertEqual(_compat.ps_variable_partitioner(FakeStrategy()), "p")
        self.assertEqual(_compat.ps_num_ps(FakeStrategy()), 3)
        import inspect

        from tensorflow.python.distribute import parameter_server_strategy_v2 as ps

        init_src = inspect.getsource(ps.ParameterServerStrategyV2Extended.__init__)
        self.assertIn("self._variable_partitioner", init_src)
        self.assertIn("self._num_ps", init_src)
        # Shards rely on the PS creator honouring `colocate_with` (and not partitioning).
        self.assertIn(
            '"colocate_with" in kwargs', inspect.getsource(ps.ParameterServerStrategyV2Extended._create_variable)
        )

    def test_dispatch_registration(self):
        table = tfs.create_sharded_variable("compat_d", [6, 2], initializer="ones", partitions=3)
        self.assertAllEqual(tf.nn.embedding_lookup(table, [5]), [[1.0, 1.0]])


if __name__ == "__main__":
    tf.test.main()
