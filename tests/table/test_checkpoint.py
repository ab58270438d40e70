"""Layout-independent checkpoints: mismatches, delayed restore, TF interop."""

import tensorflow as tf

import tf_sharded as tfs
from tests.harness.references import table_values
from tests.harness.strategies import uid


def make(values, partitions=2, scheme="div"):
    return tfs.create_sharded_variable(
        uid("c"), list(values.shape), initializer=values, partitions=partitions, scheme=scheme
    )


class CheckpointTest(tf.test.TestCase):
    def test_single_full_shape_key(self):
        values = table_values(11, 3)
        path = tf.train.Checkpoint(t=make(values, 3, "mod")).save(self.get_temp_dir() + "/k")
        entries = dict(tf.train.list_variables(path))
        self.assertEqual(entries["t/.ATTRIBUTES/VARIABLE_VALUE"], [11, 3])
        self.assertAllEqual(tf.train.load_variable(path, "t/.ATTRIBUTES/VARIABLE_VALUE"), values)

    def test_shape_mismatch_is_a_dedicated_error_and_assigns_nothing(self):
        values = table_values(11, 3)
        path = tf.train.Checkpoint(t=make(values)).save(self.get_temp_dir() + "/m")
        for shape, dtype in (([12, 3], tf.float32), ([11, 4], tf.float32), ([11, 3], tf.float64)):
            target = tfs.create_sharded_variable(
                uid("t"), shape, dtype=dtype, initializer="ones", partitions=3, scheme="mod"
            )
            before = target.numpy()
            with self.assertRaises(tfs.LayoutMismatchError) as ctx:
                tf.train.Checkpoint(t=target).restore(path)
            err = ctx.exception
            self.assertEqual(err.saved_shape, [11, 3])
            self.assertEqual(err.expected_shape, list(shape))
            self.assertIn("Nothing was assigned", str(err))
            self.assertIn("checkpoint holds shape [11, 3] dtype float32", str(err))
            self.assertAllEqual(target.numpy(), before)

    def test_mismatch_in_delayed_restore(self):
        path = tf.train.Checkpoint(t=make(table_values(11, 3))).save(self.get_temp_dir() + "/dm")
        root = tf.train.Checkpoint()
        root.restore(path)
        with self.assertRaises(tfs.LayoutMismatchError):
            root.t = tfs.create_sharded_variable(uid("t"), [10, 3], partitions=2)

    def test_delayed_restore_into_another_layout(self):
        values = table_values(19, 2)
        path = tf.train.Checkpoint(model=tf.train.Checkpoint(emb=make(values, 4, "balanced"))).save(
            self.get_temp_dir() + "/d"
        )
        root = tf.train.Checkpoint(model=tf.train.Checkpoint())
        status = root.restore(path)
        root.model.emb = tfs.create_sharded_variable(
            uid("late"), [19, 2], initializer="zeros", partitions=3, scheme="mod"
        )
        self.assertAllEqual(root.model.emb.numpy(), values)
        status.assert_existing_objects_matched()

    def test_tf_native_sharded_variable_checkpoint_restores_into_ours(self):
        values = table_values(12, 2)
        parts = [tf.Variable(values[:5]), tf.Variable(values[5:])]
        native = tf.__internal__.distribute.ShardedVariable(parts)
        path = tf.train.Checkpoint(t=native).save(self.get_temp_dir() + "/native")
        ours = tfs.create_sharded_variable(uid("o"), [12, 2], initializer="zeros", partitions=3, scheme="mod")
        tf.train.Checkpoint(t=ours).restore(path).assert_existing_objects_matched()
        self.assertAllEqual(ours.numpy(), values)

    def test_checkpoint_manager_and_tf_function_save(self):
        values = table_values(9, 2)
        t = make(values, 3, "mod")
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(t=t), self.get_temp_dir() + "/mgr", max_to_keep=2)
        manager.save()
        t.scatter_add(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([4])))
        path = manager.save()
        restored = tfs.create_sharded_variable(uid("r"), [9, 2], initializer="zeros", partitions=2)
        tf.train.Checkpoint(t=restored).restore(path)
        want = values.copy()
        want[4] += 1
        self.assertAllEqual(restored.numpy(), want)


if __name__ == "__main__":
    tf.test.main()
