"""tf_sharded.app.footprint: the variables a training process holds, against a count of the model's own arrays."""

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import mirrored, uid
from tf_sharded.app import footprint

ROWS, DIM = 50, 4


def trained(strategy, placement=None):
    import keras

    with strategy.scope():
        inp = keras.Input((3,), dtype="int64")
        emb = tfs.layers.Embedding(ROWS, DIM, combiner="mean", placement=placement, name=uid("footprint"))
        model = keras.Model(inp, keras.layers.Dense(1)(emb(inp)))
        model.compile(optimizer=tfs.optimizers.Adam(0.1), loss="mse")
    x = np.random.RandomState(0).randint(0, ROWS, (8, 3))
    tfs.fit(model, tf.data.Dataset.from_tensor_slices((x, np.ones((8, 1), np.float32))).batch(8), verbose=0)
    return model, emb


def dense_bytes(model) -> int:
    """The Keras arrays that are not the table: the dense layer, Adam's moments for it, its step and rate."""
    kernel_and_bias = (DIM + 1) * 4
    return 3 * kernel_and_bias + tf.as_dtype(model.optimizer.iterations.dtype).size + 4


class FootprintTest(tf.test.TestCase):
    def test_one_device_holds_dense_table_and_slots(self):
        model, _ = trained(tf.distribute.get_strategy())
        found = footprint.footprint(model)
        table_and_slots = ROWS * DIM * 4 * 3  # Adam: momentum and velocity per row
        self.assertEqual(found["tables_mib"] * footprint.MIB, table_and_slots)
        self.assertEqual(found["held_mib"] * footprint.MIB, table_and_slots + dense_bytes(model))
        self.assertGreater(found["peak_resident_mib"], 100)  # TensorFlow's runtime alone is hundreds of MiB
        line = footprint.describe(found)
        self.assertRegex(line, r"^memory: peak resident [\d,]+ MiB; variables held here 0\.0 MiB; tables and their "
                               r"optimizer slots 0\.0 MiB$")  # fmt: skip
        read = footprint.parse(f"held-out AUC 0.5\n{line}\ncheckpoint: x\n")
        self.assertEqual(read["held_mib"], 0.0)
        self.assertAlmostEqual(read["peak_resident_mib"], found["peak_resident_mib"], delta=0.5)
        self.assertIsNone(footprint.parse("summary: no memory line"))

    def test_each_replica_copy_counts_once_per_copy(self):
        strategy = mirrored()  # the process's one MirroredStrategy, on 4 virtual CPUs
        model, _ = trained(strategy, placement="device")
        found = footprint.footprint(model)
        table_and_slots = ROWS * DIM * 4 * 3
        self.assertEqual(found["tables_mib"] * footprint.MIB, table_and_slots)  # the table's size, not its copies'
        # Every variable is mirrored on each replica.
        replicas = strategy.num_replicas_in_sync
        self.assertEqual(replicas, 4)
        self.assertEqual(found["held_mib"] * footprint.MIB, replicas * (table_and_slots + dense_bytes(model)))
