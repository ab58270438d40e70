"""MultiWorkerMirroredStrategy: 2 worker processes on localhost, one TF_CONFIG each (custom loop and tfs.fit)."""

import pytest
import tensorflow as tf

from tests.harness.strategies import run_multi_worker

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # clusters of worker processes

WORKER = """
import json, os, sys
import numpy as np, tensorflow as tf, keras
import tf_sharded as tfs
from tests.harness.steps import squared_norm_step

strategy = tf.distribute.MultiWorkerMirroredStrategy()
assert strategy.num_replicas_in_sync == 2
rows, dim = 30, 4
values = np.random.RandomState(0).uniform(-1, 1, (rows, dim)).astype(np.float32)
# Global batches: replica r takes row r. Duplicates, and an all-duplicate replica.
batches = [np.array([[1, 1, 1, 1], [2, 3, 29, 3]]), np.array([[0, 0, 7, 7], [7, 7, 7, 7]]),
           np.array([[5, 6, 7, 8], [9, 10, 11, 12]])]
for mode, placement in (("allgather", "device"), ("dense", "device"), ("auto", "host")):
    with strategy.scope():
        table = strategy.create_sharded_variable(f"t_{mode}", [rows, dim], initializer=values, partitions=2,
                                                 scheme="mod", exchange=mode, placement=placement)
        optimizer = keras.optimizers.SGD(0.25)
    reference, ref_optimizer = tf.Variable(values), keras.optimizers.SGD(0.25)
    step = squared_norm_step(strategy, table, optimizer)

    for batch in batches:
        ids = strategy.experimental_distribute_values_from_function(
            lambda ctx, b=batch: tf.constant(b[ctx.replica_id_in_sync_group][None, :]))
        step(ids)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(reference, batch) ** 2)
        ref_optimizer.apply_gradients([(tape.gradient(loss, reference), reference)])
    err = float(np.abs(table.numpy() - reference.numpy()).max())
    assert err < 1e-5, (mode, err)
    print(f"worker {os.environ['TASK']} {mode}/{placement} max error {err:.2e}", flush=True)

# Keras 3's model.fit fails under MultiWorkerMirroredStrategy (keras-team/keras#20585); tfs.fit runs the
# model's train_step in its own loop. Same global batches on one device, in this process, as the reference.
rng = np.random.RandomState(1)
x, y = rng.randint(0, rows, (32, 3)), rng.rand(32, 1).astype(np.float32)
x[:6] = 4  # duplicates inside and across the workers' halves


def fit_model(table0=None):
    inp = keras.Input((3,), dtype="int64")
    init = keras.initializers.Constant(table0) if table0 is not None else "uniform"
    emb = tfs.layers.Embedding(rows, dim, combiner="mean", partitions=2, seed=7, embeddings_initializer=init)
    model = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(emb(inp)))
    model.compile(optimizer=tfs.optimizers.Adagrad(0.2), loss="mse")
    return model, emb


with strategy.scope():
    model, emb = fit_model()
table0 = emb.embeddings.numpy()
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
history = tfs.fit(model, data, epochs=2, verbose=0, validation_data=data)
assert len(history.history["val_loss"]) == 2, history.history
single, single_emb = fit_model(table0)
single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
err = float(np.abs(emb.embeddings.numpy() - single_emb.embeddings.numpy()).max())
assert err < 1e-5, ("fit", err)
slot = model.optimizer.table_slot(emb.embeddings, "accumulator").numpy()
assert np.allclose(slot, single.optimizer.table_slot(single_emb.embeddings, "accumulator").numpy(), atol=1e-5)
# tfs.evaluate / predict (Keras's fail here too) against Keras's own on one device, and the last val_loss.
want = single.evaluate(x, y, batch_size=8, verbose=0)
assert abs(tfs.evaluate(model, data) - want) < 1e-5 and abs(history.history["val_loss"][-1] - want) < 1e-5
assert np.allclose(tfs.predict(model, data), single.predict(x, batch_size=8, verbose=0), atol=1e-5)
print(f"worker {os.environ['TASK']} tfs.fit max error {err:.2e}", flush=True)
print("MWMS OK", flush=True)
"""


class MultiWorkerMirroredTest(tf.test.TestCase):
    def test_two_workers_match_single_device_reference(self):
        outputs = run_multi_worker(WORKER, num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-3000:])
            self.assertIn("MWMS OK", out)
            self.assertIn("auto/host", out)
            self.assertIn("tfs.fit max error", out)


if __name__ == "__main__":
    tf.test.main()
