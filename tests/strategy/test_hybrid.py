"""HybridStrategy: tables on table servers (processes), dense variables all-reduced over worker processes.

Every figure is checked against the same optimizer on one device in the
same worker process, or against the closed form of the applied updates.
"""

import json
import os

import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import TableServers, run_multi_worker
from tests.harness.subprocs import ROOT

# Table servers and worker processes.
pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=70), pytest.mark.timeout(1000)]


@pytest.fixture(scope="module")
def servers():
    started = TableServers(2)
    yield started.addresses
    started.stop()


ONE_WORKER = """
import json, os, tempfile
import numpy as np, tensorflow as tf, keras
import tf_sharded as tfs

strategy = tfs.hybrid.HybridStrategy(json.loads(os.environ["SERVERS"]))
assert strategy.num_replicas_in_sync == 1
rows = 30
rng = np.random.RandomState(0)
va, w0 = rng.uniform(-1, 1, (rows, 4)).astype(np.float32), rng.uniform(-1, 1, (7, 1)).astype(np.float32)
with strategy.scope():
    # Widths 4 and 3: two arenas per server. "one_a" in 3 shards over 2 servers (mod), "one_b" one per server.
    a = strategy.create_sharded_variable("one_a", [rows, 4], initializer=va, partitions=3, scheme="mod")
    b = strategy.create_sharded_variable("one_b", [rows, 3], initializer="uniform", seed=5)
    w = tf.Variable(w0)
    opt = tfs.optimizers.Adam(0.05)  # built by the first traced step
ref_a = tfs.create_sharded_variable("ref_a", [rows, 4], initializer=va)
ref_b = tfs.create_sharded_variable("ref_b", [rows, 3], initializer="uniform", seed=5, partitions=2)
assert np.array_equal(a.numpy(), va) and np.array_equal(b.numpy(), ref_b.numpy())  # drawn per row on the servers
ref_w, ref_opt = tf.Variable(w0), tfs.optimizers.Adam(0.05)


def loss_of(ta, tb, w, ids):
    x = tf.concat([tf.reduce_sum(tfs.embedding_lookup(ta, ids[:, :2]), 1), tfs.embedding_lookup(tb, ids[:, 2])], 1)
    return tf.reduce_mean((tf.matmul(x, w) - 1.0) ** 2)


@tf.function
def step(ids):
    def fn(ids):
        with tf.GradientTape() as tape:
            loss = loss_of(a, b, w, ids)
        variables = [*a.variables, *b.variables, w]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return strategy.run(fn, args=(ids,))


for s in range(4):
    ids = np.random.RandomState(s).randint(0, rows, (8, 3))
    ids[:, 1] = ids[:, 0] if s == 1 else ids[:, 1]  # the same row twice in an example
    step(tf.constant(ids))
    with tf.GradientTape() as tape:
        loss = loss_of(ref_a, ref_b, ref_w, ids)
    variables = [*ref_a.variables, *ref_b.variables, ref_w]
    ref_opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    for name, got, want in (("a", a, ref_a), ("b", b, ref_b)):
        err = float(np.abs(got.numpy() - want.numpy()).max())
        assert err < 1e-5, (s, name, err)
    assert np.abs(w.numpy() - ref_w.numpy()).max() < 1e-5, s
for slot in ("momentum", "velocity"):  # the slots live on the servers
    err = float(np.abs(opt.table_slot(a, slot).numpy() - ref_opt.table_slot(ref_a, slot).numpy()).max())
    assert err < 1e-6, (slot, err)
assert int(opt.iterations.numpy()) == 4
print("custom loop: tables, slots and dense equal the one-device reference", flush=True)
# What the servers counted of each shard's training lookups: each step's distinct ids, by the layout.
for table, columns in ((a, [0, 1]), (b, [2])):
    want = np.zeros(table.num_shards, np.int64)
    for s in range(4):
        ids = np.random.RandomState(s).randint(0, rows, (8, 3))
        ids[:, 1] = ids[:, 0] if s == 1 else ids[:, 1]
        owners = table.layout.route(tf.constant(np.unique(ids[:, columns]), tf.int64))[0].numpy()
        want += np.bincount(owners, minlength=table.num_shards)
    got = table.kind.shard_lookups(table)
    assert (got == want).all(), (table.name, got, want)

# What a server refuses, from any client: each call fails with its reason and changes nothing.
from tf_sharded.hybrid import calls

before, slot_before = a.numpy(), opt.table_slot(a, "momentum").numpy()
where, shard = a.server_of[0], tf.constant(a.ids[0], tf.int64)


def refused(method, args, spec, reason):
    try:
        strategy.servers.call(where, method, args, spec)
    except tf.errors.OpError as e:
        assert reason in e.message, (method, e.message)
    else:
        raise AssertionError(f"{method} was accepted")


other_shape = {"name": "one_a", "rows": 31, "dim": 4, "shard": 0, "num_shards": 3, "scheme": "mod", "initializer": None}
refused("create", [tf.constant(json.dumps(other_shape))], calls.INTS, "exists on")
refused("configure", [shard, tf.constant(json.dumps({"class_name": "RMSprop", "config": {}}))], calls.SCALAR_INT,
        "RMSprop")
sgd = {"class_name": "SGD", "config": {"learning_rate": 0.0}}
refused("configure", [shard, tf.constant(json.dumps(sgd))], calls.SCALAR_INT, "are trained by Adam")
refused("gather", [shard, tf.constant(""), tf.constant([10**6], tf.int64)], calls.FLAT, "outside the shard")
refused("scatter", [shard, tf.constant(""), tf.constant([0, 1], tf.int64), tf.zeros([4])], calls.SCALAR_INT,
        "2 rows to write with 1 values")
refused("gather", [shard, tf.constant("no_such_slot"), tf.constant([0], tf.int64)], calls.FLAT, "no optimizer slot")
assert np.array_equal(a.numpy(), before) and np.array_equal(opt.table_slot(a, "momentum").numpy(), slot_before)
print("refusals: each call refused with its reason, nothing changed", flush=True)

# Checkpoints are layout-free: the served tables and their slots restore into tables of this process in
# other layouts, and the reference's state restores into the served ones.
directory = tempfile.mkdtemp()
path = tf.train.Checkpoint(a=a, b=b, w=w, opt=opt).save(os.path.join(directory, "served"))
pa = tfs.create_sharded_variable("plain_a", [rows, 4], initializer="zeros", partitions=2, scheme="balanced")
pb = tfs.create_sharded_variable("plain_b", [rows, 3], initializer="zeros")
pw, popt = tf.Variable(tf.zeros([7, 1])), tfs.optimizers.Adam(0.05)
popt.build([*pa.variables, *pb.variables, pw])
tf.train.Checkpoint(a=pa, b=pb, w=pw, opt=popt).restore(path).assert_consumed()
for got, want in ((pa, a), (pb, b), (popt.table_slot(pa, "velocity"), opt.table_slot(a, "velocity"))):
    assert np.array_equal(got.numpy(), want.numpy()), got
rng2 = np.random.RandomState(9)
for table in (ref_a, ref_b, ref_opt.table_slot(ref_a, "momentum")):  # make the reference's state differ
    table.assign(rng2.uniform(-1, 1, table.shape).astype(np.float32))
ref_path = tf.train.Checkpoint(a=ref_a, b=ref_b, w=ref_w, opt=ref_opt).save(os.path.join(directory, "ref"))
with strategy.scope():  # new served tables, in another layout, with an optimizer built before the restore
    a2 = strategy.create_sharded_variable("one_a2", [rows, 4], initializer="zeros", partitions=2)
    b2 = strategy.create_sharded_variable("one_b2", [rows, 3], initializer="zeros", partitions=1)
    w2, opt2 = tf.Variable(tf.zeros([7, 1])), tfs.optimizers.Adam(0.05)
    opt2.build([*a2.variables, *b2.variables, w2])
tf.train.Checkpoint(a=a2, b=b2, w=w2, opt=opt2).restore(ref_path).assert_consumed()
for got, want in ((a2, ref_a), (b2, ref_b), (opt2.table_slot(a2, "momentum"), ref_opt.table_slot(ref_a, "momentum"))):
    assert np.array_equal(got.numpy(), want.numpy()), got
print("checkpoints: served <-> one device, slots included", flush=True)

# tfs.fit / evaluate / predict with a Keras model, against Keras's own fit of the same model on one device.
x = rng.randint(0, rows, (32, 3))
x[:6] = 4
y = rng.rand(32, 1).astype(np.float32)


def fit_model(name, table0=None):
    inp = keras.Input((3,), dtype="int64")
    init = keras.initializers.Constant(table0) if table0 is not None else "uniform"
    emb = tfs.layers.Embedding(rows, 4, combiner="mean", seed=7, embeddings_initializer=init, name=name)
    model = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(emb(inp)))
    model.compile(optimizer=tfs.optimizers.Adagrad(0.2), loss="mse")
    return model, emb


with strategy.scope():
    model, emb = fit_model("served")
assert isinstance(emb.embeddings, tfs.hybrid.ServedTable), emb.embeddings
table0 = emb.embeddings.numpy()
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
history = tfs.fit(model, data, epochs=2, verbose=0, validation_data=data)
single, single_emb = fit_model("single", table0)
single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
err = float(np.abs(emb.embeddings.numpy() - single_emb.embeddings.numpy()).max())
assert err < 1e-5, ("fit", err)
acc = single.optimizer.table_slot(single_emb.embeddings, "accumulator").numpy()
assert np.abs(model.optimizer.table_slot(emb.embeddings, "accumulator").numpy() - acc).max() < 1e-5
want = single.evaluate(x, y, batch_size=8, verbose=0)
assert abs(tfs.evaluate(model, data) - want) < 1e-5 and abs(history.history["val_loss"][-1] - want) < 1e-5
assert np.allclose(tfs.predict(model, data), single.predict(x, batch_size=8, verbose=0), atol=1e-5)
# tfs.export reads the table from its servers into one plain variable: the SavedModel serves alone.
served = tf.saved_model.load(tfs.export(model, os.path.join(directory, "export")))
out = list(served.signatures["serving_default"](tf.constant(x[:8], tf.int64)).values())[0]
assert np.allclose(out, single.predict(x[:8], verbose=0), atol=1e-5)
print("tfs.fit: table, slot, evaluate, predict and export equal Keras on one device", flush=True)

# The conformance matrix's combinations under this strategy: every kind with each placement it takes here.
from tests.conformance.test_conformance import HybridSpec, run_matrix

ran = run_matrix(HybridSpec(strategy))
assert set(ran) == HybridSpec.expected, ran
print(f"conformance ran {len(ran)} combinations", flush=True)
print("ONE WORKER OK", flush=True)
"""


def test_one_worker_equals_training_on_one_device(servers):
    from tests.harness.subprocs import run_python

    proc = run_python(["-c", ONE_WORKER], timeout=900, env={"SERVERS": json.dumps(servers)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ONE WORKER OK" in proc.stdout and "conformance ran 4 combinations" in proc.stdout, proc.stdout


ONE_WORKER_DYNAMIC = """
import json, os, tempfile
import keras, numpy as np, tensorflow as tf
import tf_sharded as tfs

strategy = tfs.hybrid.HybridStrategy(json.loads(os.environ["SERVERS"]))
admit, evict = tfs.policies.MinCountAdmission(2), tfs.policies.CapacityEviction(6)
with strategy.scope():
    # int64 keys under an admission policy in 3 shards over 2 servers; string keys; a capacity bound.
    a = strategy.create_dynamic_table("dyn_a", dim=4, seed=3, partitions=3, admission=admit)
    b = strategy.create_dynamic_table("dyn_b", dim=4, key_dtype=tf.string, seed=4)
    c = strategy.create_dynamic_table("dyn_c", dim=2, seed=5, eviction=evict)
    w = tf.Variable(np.linspace(-1, 1, 10, dtype=np.float32)[:, None])
    opt = tfs.optimizers.Adam(0.05)  # built by the first traced step
assert isinstance(a, tfs.hybrid.ServedDynamicTable) and a.variables == (a.anchor,), a.variables
# One device; the capacity bound is per shard, so the reference has c's shard count.
ref_a = tfs.create_dynamic_table("ref_a", dim=4, seed=3, admission=admit)
ref_b = tfs.create_dynamic_table("ref_b", dim=4, key_dtype=tf.string, seed=4)
ref_c = tfs.create_dynamic_table("ref_c", dim=2, seed=5, eviction=evict, partitions=2)
ref_w, ref_opt = tf.Variable(w.numpy()), tfs.optimizers.Adam(0.05)


def loss_of(ta, tb, tc, w, ka, kb, kc):
    x = tf.concat([tfs.embedding_lookup(ta, ka), tfs.embedding_lookup(tb, kb), tfs.embedding_lookup(tc, kc)], 1)
    return tf.reduce_mean((tf.matmul(x, w) - 1.0) ** 2)


@tf.function
def step(ka, kb, kc):
    def fn(ka, kb, kc):
        with tf.GradientTape() as tape:
            loss = loss_of(a, b, c, w, ka, kb, kc)
        variables = [*a.variables, *b.variables, *c.variables, w]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return strategy.run(fn, args=(ka, kb, kc))


def by_key(table, columns=()):
    keys, values, extra = table.export_columns(list(columns))
    keys = keys.numpy()
    order = np.argsort(keys)
    return keys[order], values.numpy()[order], {k: v.numpy()[order] for k, v in extra.items()}


def same(got, want, columns=(), what=""):
    gk, gv, gx = by_key(got, columns)
    wk, wv, wx = by_key(want, columns)
    assert np.array_equal(gk, wk), (what, got.name, gk, wk)
    assert np.abs(gv - wv).max(initial=0) < 1e-5, (what, got.name, np.abs(gv - wv).max())
    for column in columns:
        assert np.abs(gx[column] - wx[column]).max(initial=0) < 1e-5, (what, got.name, column)


for s in range(6):
    rng = np.random.RandomState(s)
    ka = rng.randint(-5, 6, 8).astype(np.int64) * 2**40  # beyond 2**53 apart, negative too
    kb = np.array([f"w{i}" for i in rng.randint(0, 6, 8)])
    kc = rng.randint(0, 12, 8).astype(np.int64)
    step(tf.constant(ka), tf.constant(kb), tf.constant(kc))
    with tf.GradientTape() as tape:
        loss = loss_of(ref_a, ref_b, ref_c, ref_w, ka, kb, kc)
    variables = [*ref_a.variables, *ref_b.variables, *ref_c.variables, ref_w]
    ref_opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    for got, want in ((a, ref_a), (b, ref_b), (c, ref_c)):
        same(got, want, ("momentum", "velocity", "seen", "hits"), f"step {s}")
        assert int(got.step) == int(want.step.numpy()) == s + 1
    assert np.abs(w.numpy() - ref_w.numpy()).max() < 1e-5, s
assert int(a.size()) == int(ref_a.size()) < 11 and int(c.size()) <= 6  # admission and the bound turned keys away
# Evaluation reads: absent keys read their initial row, and nothing is inserted or counted.
before = by_key(a, ("hits",))
fresh = tf.constant([2**62, -7, int(before[0][0])], tf.int64)
got = tfs.embedding_lookup(a, fresh, training=False)
assert np.abs(got.numpy() - tfs.embedding_lookup(ref_a, fresh, training=False).numpy()).max() < 1e-5
after = by_key(a, ("hits",))
assert np.array_equal(before[0], after[0]) and np.array_equal(before[2]["hits"], after[2]["hits"])
assert int(a.step) == 6
with strategy.scope():  # a table that is not trained: lookups insert nothing, here as on one device
    frozen = strategy.create_dynamic_table("dyn_frozen", dim=2, seed=1, trainable=False)
assert not frozen.trainable_variables
tfs.embedding_lookup(frozen, [1, 2])
assert int(frozen.size()) == 0 and int(frozen.step) == 0
for got, want in ((a, ref_a), (b, ref_b)):  # the rows trained since a step (a serving delta)
    assert sorted(got.export(since_step=4)[0].numpy().tolist()) == sorted(want.export(since_step=4)[0].numpy().tolist())
print("custom loop: keys, rows, optimizer columns, counters equal the one-device reference", flush=True)

# Checkpoints are a DynamicTable's: the served tables restore into tables of this process, and back.
directory = tempfile.mkdtemp()
path = tf.train.Checkpoint(a=a, b=b, w=w, opt=opt).save(os.path.join(directory, "served"))
pa = tfs.create_dynamic_table("plain_a", dim=4, seed=0, partitions=2, admission=admit)
pb = tfs.create_dynamic_table("plain_b", dim=4, key_dtype=tf.string, seed=0)
pw, popt = tf.Variable(tf.zeros([10, 1])), tfs.optimizers.Adam(0.05)
popt.build([*pa.variables, *pb.variables, pw])
tf.train.Checkpoint(a=pa, b=pb, w=pw, opt=popt).restore(path).assert_consumed()
for got, want in ((pa, a), (pb, b)):
    same(got, want, ("momentum", "velocity", "seen", "hits"), "served -> plain")
    assert int(got.step.numpy()) == int(want.step)
rng2 = np.random.RandomState(9)
for table in (ref_a, ref_b):  # make the reference's state differ from the served tables'
    keys, values = table.export()
    table.assign_keys(keys, rng2.uniform(-1, 1, values.shape).astype(np.float32))
ref_path = tf.train.Checkpoint(a=ref_a, b=ref_b, w=ref_w, opt=ref_opt).save(os.path.join(directory, "ref"))
with strategy.scope():  # new served tables, another shard count, an optimizer built before the restore
    a2 = strategy.create_dynamic_table("dyn_a2", dim=4, seed=0, partitions=1, admission=admit)
    b2 = strategy.create_dynamic_table("dyn_b2", dim=4, key_dtype=tf.string, seed=0, partitions=3)
    w2, opt2 = tf.Variable(tf.zeros([10, 1])), tfs.optimizers.Adam(0.05)
    opt2.build([*a2.variables, *b2.variables, w2])
tf.train.Checkpoint(a=a2, b=b2, w=w2, opt=opt2).restore(ref_path).assert_consumed()
for got, want in ((a2, ref_a), (b2, ref_b)):
    same(got, want, ("momentum", "velocity", "seen", "hits"), "plain -> served")
    assert int(got.step) == int(want.step.numpy())
print("checkpoints: served <-> one device, optimizer columns and counters included", flush=True)

# tfs.fit / evaluate / predict / export with a Keras model, against Keras's own fit on one device.
rng = np.random.RandomState(1)
x = rng.randint(-20, 20, (32, 3)).astype(np.int64) * 1_000_003
x[:6] = 7
y = rng.rand(32, 1).astype(np.float32)


def fit_model(name):
    inp = keras.Input((3,), dtype="int64")
    emb = tfs.layers.DynamicEmbedding(4, combiner="mean", seed=7, name=name)
    model = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(emb(inp)))
    model.compile(optimizer=tfs.optimizers.Adagrad(0.2), loss="mse")
    return model, emb


with strategy.scope():
    model, emb = fit_model("served")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
metrics = tfs.callbacks.TableMetrics(every=4)
history = tfs.fit(model, data, epochs=2, verbose=0, validation_data=data, callbacks=[metrics])
assert isinstance(emb.table, tfs.hybrid.ServedDynamicTable), emb.table
single, single_emb = fit_model("single")
single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
same(emb.table, single_emb.table, ("accumulator", "hits"), "fit")
# The table metrics, read from the servers: the live keys of the one-device table, per shard by the keys' shard.
from tf_sharded.table.dynamic.keys import shard_of_keys

live = single_emb.table.export()[0]
per_shard = np.bincount(shard_of_keys(live, emb.table.num_shards).numpy(), minlength=emb.table.num_shards)
reported = {k.split("/")[-1]: v[-1] for k, v in history.history.items() if k.startswith(f"tables/{emb.table.name}/")}
# The last report counts the second epoch's lookups (steps 5 to 8): the same ids again, every key present.
looked = np.bincount(shard_of_keys(x.ravel(), emb.table.num_shards).numpy(), minlength=emb.table.num_shards)
assert reported == {"rows": len(live), "bytes": len(live) * 4 * 4 * 2,
                    "shard_load": per_shard.max() / per_shard.mean(), "admitted": 0, "rejected": 0,
                    "evicted": 0, "hit_rate": 1.0, "lookup_load": looked.max() / looked.mean()}, reported
first = {k.split("/")[-1]: v[0] for k, v in history.history.items() if k.startswith(f"tables/{emb.table.name}/")}
assert first["admitted"] == len(live) and first["rejected"] == first["evicted"] == 0, first
want = single.evaluate(x, y, batch_size=8, verbose=0)
assert abs(tfs.evaluate(model, data) - want) < 1e-5 and abs(history.history["val_loss"][-1] - want) < 1e-5
assert np.allclose(tfs.predict(model, data), single.predict(x, batch_size=8, verbose=0), atol=1e-5)
same(emb.table, single_emb.table, ("hits",), "evaluate and predict insert nothing")
served = tf.saved_model.load(tfs.export(model, os.path.join(directory, "export")))
unseen = x[:8] + 1  # keys never trained read their initial rows, as on one device
for batch in (x[:8], unseen):
    out = list(served.signatures["serving_default"](tf.constant(batch)).values())[0]
    assert np.allclose(out, single.predict(batch, verbose=0), atol=1e-5)
print("tfs.fit: table, optimizer column, evaluate, predict and export equal Keras on one device", flush=True)

# What the strategy refuses, before anything is made.
for kwargs, reason in (({"placement": "sharded"}, "does not apply under HybridStrategy"),
                       ({"dtype": tf.float16}, "float32")):
    try:
        with strategy.scope():
            tfs.create_dynamic_table("refused", dim=2, **kwargs)
    except ValueError as e:
        assert reason in str(e), e
    else:
        raise AssertionError(kwargs)
print("ONE WORKER DYNAMIC OK", flush=True)
"""


def test_dynamic_tables_on_one_worker_equal_training_on_one_device(servers):
    from tests.harness.subprocs import run_python

    proc = run_python(["-c", ONE_WORKER_DYNAMIC], timeout=900, env={"SERVERS": json.dumps(servers)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ONE WORKER DYNAMIC OK" in proc.stdout, proc.stdout


TWO_WORKERS = """
import json, os
import keras, numpy as np, tensorflow as tf
import tf_sharded as tfs

strategy = tfs.hybrid.HybridStrategy.from_tf_config()
task = int(os.environ["TASK"])
workers = strategy.num_replicas_in_sync
assert workers == 2
rows, dim, lr = 40, 4, 0.1
values = np.random.RandomState(0).uniform(-1, 1, (rows, dim)).astype(np.float32)
with strategy.scope():
    table = strategy.create_sharded_variable("two_t", [rows, dim], initializer=values, partitions=3, scheme="mod")
    dyn = strategy.create_dynamic_table("two_d", dim=dim, seed=1, partitions=3)  # keys: ids * 2**40 - 3
    unseeded = strategy.create_dynamic_table("two_u", dim=2)  # each worker draws a seed: the first one's wins
    w = tf.Variable(np.linspace(-1, 1, dim, dtype=np.float32)[:, None])
    opt = keras.optimizers.SGD(lr)  # Keras's own: the servers train with tf_sharded's of the same name
initial = unseeded.initial_rows(tf.constant([5, -5], tf.int64)).numpy()
assert np.array_equal(initial, tfs.embedding_lookup(unseeded, [5, -5], training=False).numpy())  # the servers' rows
print("seeds", unseeded.seed, json.dumps(initial.tolist()), flush=True)


def batch(worker, step):
    return np.random.RandomState(100 * step + worker).randint(0, rows, (6, 3))


@tf.function
def train(ids):
    def fn(ids):
        # Linear in the rows: a row's gradient is the dense `w` of the step (all-reduced, the same on both
        # workers), whatever the other worker has applied by then.
        with tf.GradientTape() as tape:
            x = tfs.embedding_lookup(table, ids) + tfs.embedding_lookup(dyn, ids * 2**40 - 3)
            loss = tf.reduce_sum(tf.matmul(tf.reduce_sum(x, 1), w))
        variables = [*table.variables, *dyn.variables, w]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return strategy.run(fn, args=(ids,))


used = []
for s in range(4):
    used.append(w.numpy()[:, 0].copy())
    train(tf.constant(batch(task, s)))
    print("dense", s, json.dumps([float(v) for v in w.numpy()[:, 0]]), flush=True)
strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)  # both workers' steps are done
# The servers counted both workers' lookups of each shard: each step's distinct ids, by the layout.
looked = np.zeros(table.num_shards, np.int64)
for s in range(4):
    for k in range(workers):
        owners = table.layout.route(tf.constant(np.unique(batch(k, s)), tf.int64))[0].numpy()
        looked += np.bincount(owners, minlength=table.num_shards)
assert (table.shard_lookups() == looked).all(), (table.shard_lookups(), looked)
expected = values.copy()
for s in range(4):
    for k in range(workers):
        for i in batch(k, s).reshape(-1):
            expected[i] -= lr * used[s]
err = float(np.abs(table.numpy() - expected).max())
assert err < 1e-5, err
# The dynamic table: every key either worker met, at its initial row minus every update applied to it.
met = sorted({int(i) for s in range(4) for k in range(workers) for i in batch(k, s).reshape(-1)})
keys, got = dyn.export()
order = np.argsort(keys.numpy())
assert keys.numpy()[order].tolist() == [i * 2**40 - 3 for i in met], keys
want = dyn.initial_rows(tf.constant([i * 2**40 - 3 for i in met], tf.int64)).numpy() + expected[met] - values[met]
err = max(err, float(np.abs(got.numpy()[order] - want).max()))
assert err < 1e-5, err
print("table error", err, flush=True)

# No table gradient enters a collective: the step's only all-reduce carries the dense `w`.
graph = train.get_concrete_function(tf.TensorSpec([6, 3], tf.int64)).graph
reduced = [op for op in graph.get_operations() if op.type.startswith("CollectiveReduce")]
sizes = [op.inputs[0].shape.num_elements() for op in reduced]  # TensorFlow packs the gradients it all-reduces
assert reduced and sum(sizes) == dim, sizes
assert not [op for op in graph.get_operations() if op.type.startswith("CollectiveGather")]
assert len([op for op in graph.get_operations() if op.type == "RpcCall"]) >= 2  # the lookup's and the apply's
print("TWO WORKERS OK", flush=True)
"""


def test_two_workers_keep_dense_equal_and_apply_every_sparse_update(servers):
    outputs = run_multi_worker(TWO_WORKERS, num_workers=2, ps=servers)
    dense = []
    for code, out, err in outputs:
        assert code == 0, out[-3000:] + err[-5000:]
        assert "TWO WORKERS OK" in out, out
        dense.append([line for line in out.splitlines() if line.startswith(("dense", "seeds"))])
    assert len(dense[0]) == 5 and dense[0] == dense[1], dense  # identical on both workers after every step


def test_readme_example_runs_as_written(servers):
    """The README's hybrid block, run as written on one worker of a TF_CONFIG cluster with the two servers."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("### Hybrid training") :]
    block = section[
        section.index("```python") + len("```python") : section.index("```\n", section.index("```python") + 9)
    ]
    script = block + "\nprint('README OK', model.count_params(), flush=True)\n"
    outputs = run_multi_worker(script, num_workers=1, ps=servers)
    code, out, err = outputs[0]
    assert code == 0, out[-3000:] + err[-5000:]
    assert "README OK" in out, out


def test_strategy_and_cluster_arguments_are_checked():
    with pytest.raises(ValueError, match="`servers` must be a list"):
        tfs.hybrid.HybridStrategy("localhost:1")
    with pytest.raises(ValueError, match="'ps' job"):
        tfs.hybrid.HybridStrategy.from_tf_config(json.dumps({"cluster": {"worker": ["a:1"]}, "task": {}}))
    config = {"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, "task": {"type": "ps", "index": 0}}
    with pytest.raises(ValueError, match="chief or worker"):
        tfs.hybrid.HybridStrategy.from_tf_config(json.dumps(config))


def test_servers_train_tables_with_tf_shardeds_optimizers_only():
    from tf_sharded.hybrid.table import optimizer_spec

    spec = optimizer_spec(tfs.optimizers.Adam(0.5, beta_1=0.8))
    assert spec["class_name"] == "Adam" and spec["config"]["beta_1"] == 0.8
    assert spec["config"]["learning_rate"] == 0.0  # sent with every step instead
    with pytest.raises(ValueError, match="RMSprop"):
        optimizer_spec(tf.keras.optimizers.RMSprop())
