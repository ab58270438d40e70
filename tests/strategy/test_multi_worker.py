"""MultiWorkerMirroredStrategy: 2 worker processes on localhost, one TF_CONFIG each (custom loop and tfs.fit)."""

import pytest
import tensorflow as tf

from tests.harness.strategies import run_multi_worker

# Clusters of worker processes.
pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=55), pytest.mark.timeout(1000)]

WORKER = """
import glob, json, os, sys, tempfile
import numpy as np, tensorflow as tf, keras
from tensorboard.backend.event_processing import event_accumulator
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
    # The bytes this worker's replica put into the exchange: per step and shard, its distinct ids' rows and
    # ids where the shard was gathered (the cost model's choice on the larger replica's count), else the
    # densified shard.
    want = 0
    for batch in batches:
        for shard in range(2):
            counts = [int(np.sum(table.layout.route(tf.constant(np.unique(b), tf.int64))[0].numpy() == shard))
                      for b in batch]
            rows_here = table.layout.shard_sizes[shard]
            gathered = mode == "allgather" or (mode == "auto" and tfs.exchange.choose(rows_here, 16, 2, max(counts))
                                               == "allgather")
            want += counts[int(os.environ["TASK"])] * (16 + 8) if gathered else rows_here * 16
    from tf_sharded.table.tally import exchanged_bytes
    assert exchanged_bytes(table) == want, (mode, exchanged_bytes(table), want)
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
# Each worker reports the table's metrics to its logs; only the chief writes summaries (here each worker is
# given a directory of its own, to tell who wrote).
log_dir = tempfile.mkdtemp()
history = tfs.fit(model, data, epochs=2, verbose=0, validation_data=data,
                  callbacks=[tfs.callbacks.TableMetrics(2, log_dir)])  # fmt: skip
assert len(history.history["val_loss"]) == 2, history.history
assert history.history[f"tables/{emb.embeddings.name}/rows"] == [rows, rows], history.history
# The load of the last report (steps 7 and 8, the epoch's last two batches), summed over the workers: each
# worker's replica reads its half of a global batch, one distinct-id count per shard.
read = np.zeros(emb.embeddings.num_shards)
for batch in (x[16:24], x[24:32]):
    for half in (batch[:4], batch[4:]):
        owners = emb.embeddings.layout.route(tf.constant(np.unique(half), tf.int64))[0].numpy()
        read += np.bincount(owners, minlength=emb.embeddings.num_shards)
load = history.history[f"tables/{emb.embeddings.name}/lookup_load"][-1]
assert abs(load - read.max() / read.mean()) < 1e-9, (load, read)
# Its exchange's bytes per step over those two steps, summed over the workers (as in the loop above).
sent = 0
for batch in (x[16:24], x[24:32]):
    for shard, rows_here in enumerate(emb.embeddings.layout.shard_sizes):
        counts = [int(np.sum(emb.embeddings.layout.route(tf.constant(np.unique(h), tf.int64))[0].numpy() == shard))
                  for h in (batch[:4], batch[4:])]
        gathered = tfs.exchange.choose(rows_here, 16, 2, max(counts)) == "allgather"
        sent += sum(c * (16 + 8) if gathered else rows_here * 16 for c in counts)
moved = history.history[f"tables/{emb.embeddings.name}/exchange_bytes"][-1]
assert abs(moved - sent / 2) < 1e-9, (moved, sent / 2)
# What this worker counted itself over the 8 steps: its replica's half of each global batch.
from tf_sharded.table.tally import shard_counts

mine = np.zeros(emb.embeddings.num_shards)
for start in range(0, 32, 8):
    half = x[start + 4 * int(os.environ["TASK"]) :][:4]
    owners = emb.embeddings.layout.route(tf.constant(np.unique(half), tf.int64))[0].numpy()
    mine += 2 * np.bincount(owners, minlength=emb.embeddings.num_shards)  # two epochs
assert (shard_counts(emb.embeddings) == mine).all(), (shard_counts(emb.embeddings), mine)
written = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
steps = []
if written:
    events = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    steps = [e.step for e in events.Tensors(f"tables/{emb.embeddings.name}/rows")]
print(f"worker {os.environ['TASK']} summary files {len(written)} at steps {steps}", flush=True)
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


# placement="sharded": replica r holds shard r of each table (and of its slots), so a worker holds its replicas'
# shards; ids and rows travel by collectives. With LOCAL = 2, two replicas on each worker (logical CPUs standing
# in for a worker's GPUs). Every figure against the same optimizer on one device in the same process.
SHARDED_WORKER = (
    """
CHECKPOINTS, LOCAL = %r, %d
"""
    + """import contextlib, os
import numpy as np, tensorflow as tf, keras
from tests.harness.strategies import multi_worker_with_local_replicas

strategy = multi_worker_with_local_replicas(LOCAL) if LOCAL > 1 else tf.distribute.MultiWorkerMirroredStrategy()
import tf_sharded as tfs
from tests.harness.graphs import op_types, whole_table_reads
from tests.harness.models import mixed_width_layer, one_device_embedding, optimizer_cases, pooled_model
from tests.harness.references import squared_norm_adagrad_collection
from tests.harness.steps import squared_norm_collection_step
from tests.harness.strategies import per_replica
from tf_sharded import _compat
from tf_sharded.exchange import workers
from tf_sharded.table.protocol import owner_of

task, replicas = int(os.environ["TASK"]), strategy.num_replicas_in_sync
assert replicas == 2 * LOCAL, replicas
mine = [LOCAL * task + local for local in range(LOCAL)]  # this worker's replicas: the shards it holds
# Worker w's replica l is replica w * LOCAL + l (TensorFlow's numbering), each on one of the worker's devices.
devices = [f"/job:worker/replica:0/task:{w}/device:CPU:{l}" for w in range(2) for l in range(LOCAL)]
assert _compat.cluster_replicas(strategy) == (mine[0], devices), _compat.cluster_replicas(strategy)
ROWS, DIM = 50, 4
rng = np.random.RandomState(0)
ids = rng.randint(0, ROWS, (32, 3))
ids[:6] = 7  # duplicates inside and across replicas and workers
y = rng.rand(32, 1).astype(np.float32)
data = tf.data.Dataset.from_tensor_slices((ids, y)).batch(8)


# Keras's SGD and the lazy optimizers through tfs.fit, against the same optimizer on one device in this process.
checkpoint_dir = os.path.join(CHECKPOINTS, "shared")  # one directory for both workers: the chief writes it
# With two replicas per worker, Adam (two slots) stands for the lazy optimizers: they share one update path.
cases = optimizer_cases() if LOCAL == 1 else [c for c in optimizer_cases() if c[0].__name__ == "Adam"]
for cls, cfg, scheme, slot_name in cases:
    msg = f"{cls.__module__}.{cls.__name__} {scheme}"
    checkpointed = slot_name == ("accumulator", "velocity")[LOCAL - 1]  # Adagrad with one replica, Adam with two
    with strategy.scope():
        layer = tfs.layers.Embedding(ROWS, DIM, scheme=scheme, seed=3, placement="sharded")
        model = pooled_model(layer, cls(**cfg))
    table = layer.embeddings
    table0 = table.numpy()
    # Each worker holds its replicas' shards, each on its replica's device; the others are stand-ins without memory.
    held = table.held_variables
    assert table.num_shards == replicas, msg
    assert [i for i, v in enumerate(table.variables) if any(v is h for h in held)] == mine, msg
    assert [v.device for v in held] == list(strategy.extended.worker_devices), msg
    assert [v.shape[0] for v in held] == [table.layout.shard_sizes[r] for r in mine], msg
    assert sum(int(np.prod(v.shape)) for v in model.variables if v.shape[0] == ROWS) == 0, msg
    history = tfs.fit(model, data, epochs=2, verbose=0, checkpoint_dir=checkpoint_dir if checkpointed else None)
    single = one_device_embedding(cls, table0)
    reference = pooled_model(single, cls(**cfg))
    want = reference.fit(ids, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    err = float(np.abs(table.numpy() - single.embeddings.numpy()).max())
    assert err < 2e-5, (msg, err)
    assert np.allclose(model.layers[-1].kernel.numpy(), reference.layers[-1].kernel.numpy(), atol=2e-5), msg
    assert np.allclose(history.history["loss"], want.history["loss"], atol=1e-5), msg
    if slot_name is not None:
        slot = model.optimizer.table_slot(table, slot_name)
        # The slot beside its shard only, on the same device.
        assert [(v.shape, v.device) for v in slot.held_variables] == [(v.shape, v.device) for v in held], msg
        want_slot = reference.optimizer.table_slot(single.embeddings, slot_name).numpy()
        assert np.allclose(slot.numpy(), want_slot, atol=2e-5), msg
    if checkpointed:  # tfs.evaluate / predict, and the checkpoint read back on one device, slots included
        assert abs(tfs.evaluate(model, data) - reference.evaluate(ids, y, batch_size=8, verbose=0)) < 1e-5
        got = tfs.predict(model, tf.data.Dataset.from_tensor_slices(ids).batch(8))
        assert np.allclose(got, reference.predict(ids, batch_size=8, verbose=0), atol=1e-5)
        # Every worker exports (the table is gathered over the collectives): one plain table, served alone.
        served = tf.saved_model.load(tfs.export(model, os.path.join(CHECKPOINTS, f"export{task}")))
        out = list(served.signatures["serving_default"](tf.constant(ids[:8], tf.int64)).values())[0]
        assert np.allclose(out, reference.predict(ids[:8], verbose=0), atol=1e-5)
        reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(checkpoint_dir))
        keys = reader.get_variable_to_shape_map()
        key = next(k for k in keys if k.startswith("model/") and keys[k] == [ROWS, DIM] and "OPTIMIZER" not in k)
        assert np.allclose(reader.get_tensor(key), table.numpy(), atol=0), key
        # A rerun under the same strategy restores into new shards and resumes at the checkpoint's step.
        with strategy.scope():
            layer2 = tfs.layers.Embedding(ROWS, DIM, scheme=scheme, seed=11, placement="sharded")
            model2 = pooled_model(layer2, cls(**cfg))
        tfs.fit(model2, data, epochs=2, verbose=0, checkpoint_dir=checkpoint_dir)
        assert np.array_equal(layer2.embeddings.numpy(), table.numpy()), "restored"
        restored_slot = model2.optimizer.table_slot(layer2.embeddings, slot_name).numpy()
        assert np.array_equal(restored_slot, model.optimizer.table_slot(table, slot_name).numpy())
        # Workers that find different checkpoints (directories not shared) are refused together, unrestored.
        own = checkpoint_dir if task == 0 else os.path.join(CHECKPOINTS, "unshared")
        before = layer2.embeddings.numpy()
        try:
            tfs.fit(model2, data, epochs=3, verbose=0, checkpoint_dir=own)
            raise AssertionError("workers with different checkpoints were accepted")
        except ValueError as e:
            assert "must be one directory that every worker reads" in str(e), e
        assert np.array_equal(layer2.embeddings.numpy(), before)
    print(f"worker {task} {msg} max error {err:.2e}", flush=True)

# Saves gather the shards over collectives: a time interval (each worker's own clock) is refused before any step.
try:
    tfs.fit(model, data, epochs=1, verbose=0, checkpoint_dir=checkpoint_dir + "_secs", checkpoint_secs=5)
    raise AssertionError("checkpoint_secs was accepted")
except ValueError as e:
    assert "Argument `checkpoint_secs` cannot apply to table" in str(e) and "checkpoint_every" in str(e), e
assert not os.path.exists(checkpoint_dir + "_secs")

# A collection of mixed widths, ragged ids with a combiner, tables batched in one storage per width and replica:
# two steps against NumPy on the global batch, over each transport (the cost model's, the all-to-all, first).
rows = 1009
arrays = {
    "fa": [np.array([1, 2, 2]), np.array([1, 700, 1000]), np.array([2]), np.array([999, 1])],
    "fb": [np.array([0, 5]), np.array([1010, 5]), np.array([5]), np.array([6, 0])],
    "fc": [tf.ragged.constant([[1, 1], [1000], []]), tf.ragged.constant([[3, 4, 1013], [1]]),
           tf.ragged.constant([[1]]), tf.ragged.constant([[], [2, 1000]])],
}
arrays = {k: v[:replicas] for k, v in arrays.items()}
# A second step in which feature fc has no id on any replica: its exchange still completes.
empty = tf.ragged.constant([[]], dtype=tf.int32)
steps = [arrays, {"fa": [np.array([3]), np.array([4, 4]), np.array([4]), np.array([3])][:replicas],
                  "fb": [np.array([1]), np.array([2]), np.array([1]), np.array([2])][:replicas],
                  "fc": [empty] * replicas}]
collectives = {"alltoall": "CollectiveAllToAllV2", "gather": "CollectiveGatherV2"}
for transport in (None, "gather"):
    with contextlib.nullcontext() if transport is None else workers.transport_scope(transport):
        layer, optimizer, reference = mixed_width_layer(strategy, rows, "owners")
        step = squared_norm_collection_step(strategy, layer, optimizer)
        for arrays_k in steps:
            step({k: per_replica(strategy, v) for k, v in arrays_k.items()})
        inputs = {k: per_replica(strategy, v) for k, v in arrays.items()}
        ops = op_types(step.get_concrete_function(inputs))
    want = squared_norm_adagrad_collection(reference, steps)
    for name in reference:
        err = float(np.abs(layer.tables[name].numpy() - want[name]).max())
        assert err < 1e-5, (transport, name, err)
    # The lookups' collectives are the transport's alone (the copies' exchange has no table here to gather).
    used = {t for t, op in collectives.items() if op in ops}
    assert used == {transport or "alltoall"}, (transport, used)
    # One storage variable per width and replica here (a and b together), each with one slot: its replica's rows.
    shard = {name: [layer.tables[name].layout.shard_sizes[r] for r in mine] for name in reference}
    got = sorted(int(v.shape[0]) for v in layer.trainable_variables)
    assert got == sorted([a + b for a, b in zip(shard["a"], shard["b"])] + shard["c"]), got
    for storage in {id(v): v for v in layer.trainable_variables}.values():
        storage_table = owner_of(storage)[0]
        placed = [(v.shape, v.device) for v in storage_table.held_variables]
        slots = optimizer.table_slot(storage_table, "accumulator").held_variables
        assert [(v.shape, v.device) for v in slots] == placed
    problems = [p for p in whole_table_reads(step.get_concrete_function(inputs), rows) if "produces" in p]
    assert problems == [], problems
    print(f"worker {task} collection over {transport or 'the chosen transport'} matches NumPy", flush=True)

# tfs.plan shards a table whose copy does not fit a replica over every replica of both workers.
tables = {"big": {"input_dim": 20_000, "output_dim": 4, "seed": 1}, "small": {"input_dim": 50, "output_dim": 4}}
plan = tfs.plan(tables, strategy, memory_per_replica=700_000 // replicas)  # big: 640 KB with its slot; a shard fits
assert (plan.tables["big"].placement, plan.tables["small"].placement) == ("sharded", "device"), plan
with strategy.scope():
    planned = tfs.layers.EmbeddingCollection(tables, {"b": "big", "s": "small"}, plan=plan)
    planned.build()
big = planned.tables["big"]
assert big.num_shards == replicas and [v.device for v in big.held_variables] == list(strategy.extended.worker_devices)
print("SHARDED OK", flush=True)
"""
)


class MultiWorkerMirroredTest(tf.test.TestCase):
    def test_two_workers_match_single_device_reference(self):
        outputs = run_multi_worker(WORKER, num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-3000:])
            self.assertIn("MWMS OK", out)
            self.assertIn("auto/host", out)
            self.assertIn("tfs.fit max error", out)
        chief, other = (out for _, out, _ in outputs)
        self.assertIn("worker 0 summary files 1 at steps [2, 4, 6, 8]", chief)
        self.assertIn("worker 1 summary files 0 at steps []", other)

    def test_tables_sharded_over_two_workers_match_one_device(self):
        outputs = run_multi_worker(SHARDED_WORKER % (self.get_temp_dir(), 1), num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-3000:])
            self.assertIn("SHARDED OK", out)
            self.assertEqual(out.count("max error"), 5, msg=out)

    def test_tables_sharded_over_two_replicas_on_each_of_two_workers_match_one_device(self):
        outputs = run_multi_worker(SHARDED_WORKER % (self.get_temp_dir(), 2), num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-3000:])
            self.assertIn("SHARDED OK", out)
            self.assertEqual(out.count("max error"), 1, msg=out)


if __name__ == "__main__":
    tf.test.main()
