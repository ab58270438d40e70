"""Dynamic tables under MultiWorkerMirroredStrategy: 2 worker processes, one copy each, against references.

Each worker checks its copy against a plain reference computed in the same
process and prints a digest of the copy; the test checks the digests agree
and restores worker 0's checkpoint into a 3-shard table here.
"""

import os
import re
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import run_multi_worker, uid

# Clusters of worker processes.
pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=200), pytest.mark.timeout(1000)]

WORKER = """
import functools, os
import numpy as np, tensorflow as tf
import tf_sharded as tfs
from tests.harness.models import fit_dynamic_like_keras
from tests.harness.references import check_string_admission, table_digest as digest
from tests.harness.strategies import per_replica
from tests.table.dynamic.test_dynamic import adagrad_rows_match_reference, train_step

task = int(os.environ["TASK"])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
assert strategy.num_replicas_in_sync == 2
check = tf.test.TestCase()
per_replica = functools.partial(per_replica, strategy)

# 1. The conformance matrix's combinations under this strategy: every kind with each placement it takes here (a
#    copy per worker, sharded over the workers, ...), trained against one dense variable, checkpointed into other
#    layouts under the default strategy and back. A dynamic table's copy on the host gathers its keys.
from tests.conformance.test_conformance import MultiWorkerSpec, run_matrix

with strategy.scope():
    table = strategy.create_dynamic_table("users", dim=4, partitions=2, seed=3)
assert (table.placement, table.exchange.mode) == ("host", "allgather")
ran = run_matrix(MultiWorkerSpec(strategy))
assert set(ran) == MultiWorkerSpec.expected, ran
print(f"worker {task} conformance ran {len(ran)} combinations", flush=True)

# 2. String keys with admission by count: a key met once on each worker has met its count of 2.
words = check_string_admission(check, strategy, per_replica, train_step)
print(f"worker {task} strings digest {digest(words)}", flush=True)

# 3. tfs.fit with tfs.layers.DynamicEmbedding against plain Keras on one device (the same global batches).
model = fit_dynamic_like_keras(check, strategy, partitions=2)
print(f"worker {task} fit digest {digest(model.get_layer('emb').table)}", flush=True)

# 4. A collection's int64 tables share one pool in each worker's copy ("c", of strings, has its own), and each
#    worker inserts both workers' keys: the copies agree and every table matches its reference.
from tests.table.dynamic.test_dynamic_pooled import (NAMES, assert_like_reference, assert_rows_accounted,
                                                     assert_same_tables, key_batches, pooled_collection, train_replicas)

layer, adagrad = pooled_collection(strategy)
pooled = layer.tables
assert pooled["a"].variables[0] is pooled["b"].variables[0] is not pooled["c"].variables[0]
batches = [key_batches(np.random.default_rng(3 + s), 2, n=16) for s in range(4)]  # per step, one per worker
batches[2][1] = {n: v[:0] for n, v in batches[2][1].items()}  # worker 1 meets no keys in step 3
reference = train_replicas(strategy, layer, adagrad, batches)
assert_like_reference(check, pooled, reference, accumulator_rtol=1e-5)
print(f"worker {task} pooled digest {'-'.join(digest(pooled[n]) for n in NAMES)}", flush=True)

# 5. Policies in a shared pool ("a" evicts keys unseen for a step, "b" admits a key at its second occurrence):
#    the pooled collection holds what one with a pool per table holds, keys, rows and columns.
policies = {"a": {"eviction": tfs.policies.StepsSinceSeenEviction(1, every=1)},
            "b": {"admission": tfs.policies.MinCountAdmission(2)}}
(shared, shared_opt), (alone, alone_opt) = [pooled_collection(strategy, b, **policies) for b in (True, False)]
assert shared.tables["a"].variables[0] is shared.tables["b"].variables[0]
assert alone.tables["a"].variables[0] is not alone.tables["b"].variables[0]
batches = [key_batches(np.random.default_rng(9 + s), 2, n=16) for s in range(4)]
for layer_, optimizer_ in ((shared, shared_opt), (alone, alone_opt)):
    train_replicas(strategy, layer_, optimizer_, batches)
assert_same_tables(check, shared, alone, columns=("accumulator", "seen", "hits"), atol=1e-5)
assert_rows_accounted(check, shared)
assert int(shared.tables["b"].size()) < len({k for s in batches for b in s for k in b["b"].tolist()})
print(f"worker {task} policies digest {'-'.join(digest(shared.tables[n]) for n in NAMES)}", flush=True)
print("MWMS DYNAMIC OK", flush=True)
"""

TRANSPORTS_SECTION = """
# Both transports of tables sharded over workers, forced in turn: the keys, counts, rows and gradients of dynamic
# tables travel over the all-to-all (the cost model's choice) or the gather form, as fixed-row tables' do, and give
# the same tables. String keys with admission: a key reaches its count with every replica's occurrences summed.
import collections
from tests.harness.graphs import op_types
from tf_sharded.exchange import workers

replicas = strategy.num_replicas_in_sync
ints_in = [[[5, -7, 5, 2**50, 11], [-7, 3, 11, 8], [3, 9, 2**50], [1, 2]], [[3, 9], [], [9, 9], [4]],
           [[1, 2, 3, 4, 5, 6, 7, 8], [8, 5, -7], [], [6, 6, 1]]]
words_in = [[[b"a", b"bb", b""], [b"bb", b"ccc"], [b"ccc"], [b"ffffff"]], [[b"a"], [], [b"ffffff"], []],
            [[b"ccc", b"dddd", b"a"], [b"dddd", b"eeeee"], [], [b""]]]
int_batches = [[np.array(b, np.int64) for b in step[:replicas]] for step in ints_in]
word_batches = [[np.array(b, "S6") for b in step[:replicas]] for step in words_in]
met = collections.Counter(w for step in word_batches for b in step for w in b.tolist())
collectives = {"alltoall": "CollectiveAllToAllV2", "gather": "CollectiveGatherV2"}
results = {}
for transport in ("alltoall", "gather"):
    with workers.transport_scope(transport):
        with strategy.scope():
            ints = strategy.create_dynamic_table(f"ints_{transport}", dim=3, seed=7, placement="sharded")
            words = strategy.create_dynamic_table(f"words_{transport}", dim=3, key_dtype=tf.string, seed=7,
                                                  placement="sharded", admission=tfs.policies.MinCountAdmission(2))
            adagrad = tfs.optimizers.Adagrad(0.1)

        @tf.function
        def step(int_keys, word_keys):
            def fn(int_keys, word_keys):
                with tf.GradientTape() as tape:
                    rows = [tfs.embedding_lookup(ints, int_keys), tfs.embedding_lookup(words, word_keys)]
                    loss = tf.add_n([tf.reduce_sum(tf.square(r - 1.0)) for r in rows])
                variables = ints.trainable_variables + words.trainable_variables
                adagrad.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return loss

            return strategy.run(fn, args=(int_keys, word_keys))

        for ints_k, words_k in zip(int_batches, word_batches):
            step(per_replica(ints_k), per_replica(words_k))
        ops = op_types(step.get_concrete_function(per_replica(int_batches[0]), per_replica(word_batches[0])))
    used = {t for t, op in collectives.items() if op in ops}
    assert used == {transport}, (transport, used)
    assert (int(ints.step), int(words.step)) == (3, 3)
    assert set(words.export()[0].numpy().tolist()) == {w for w, n in met.items() if n >= 2}, words.export()[0]
    assert int(ints.size()) == len({k for step in int_batches for b in step for k in b.tolist()})
    results[transport] = [dict(zip(*[t.numpy().tolist() for t in table.export()])) for table in (ints, words)]
for over_all_to_all, over_gather in zip(results["alltoall"], results["gather"]):
    assert set(over_all_to_all) == set(over_gather)
    for key, row in over_all_to_all.items():
        check.assertAllClose(row, over_gather[key], atol=1e-6)
print(f"worker {task} transports agree", flush=True)
"""

SHARDED_WORKER = (
    """
import functools, os, sys
import numpy as np, tensorflow as tf
import tf_sharded as tfs
from tests.harness.references import check_string_admission
from tests.harness.strategies import per_replica
from tests.table.dynamic.test_dynamic import adagrad_rows_match_reference, train_step

task = int(os.environ["TASK"])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
check = tf.test.TestCase()
per_replica = functools.partial(per_replica, strategy)


def by_key(keys, values):
    return dict(zip(keys.numpy().tolist(), values.numpy()))


# 1. int64 keys, Adagrad: worker r holds shard r only; the table matches one dense variable trained on both
#    workers' keys, each row updated on its owner.
with strategy.scope():
    table = strategy.create_dynamic_table("users", dim=4, seed=3, placement="sharded")
assert (table.placement, table.sharded_over_workers, table.num_shards) == ("sharded", True, 2), table
(held,) = table.held_variables
assert table.variables[task] is held and table.trainable_variables == (held,)
rows = adagrad_rows_match_reference(check, strategy, table, per_replica)
mine = table.shards[task].export()[0].numpy()
assert len(mine) and np.all(table.shard_of(mine).numpy() == task), "a worker holds only its shard's keys"
keys, values = table.export()
assert len(mine) < len(rows)
# Reads outside the replicas: every worker asks for the same keys and gets every owner's rows.
asked = np.array(sorted(rows)[:7] + [12345], np.int64)
got = tfs.embedding_lookup(table, asked, training=False).numpy()
check.assertAllClose(got[:-1], np.stack([rows[k] for k in asked[:-1]]), atol=0)
check.assertAllClose(got[-1], table.initial_rows([12345])[0], atol=0)
assert int(table.size()) == len(rows), "a read inserts nothing"
# The checkpoint holds the whole table; it restores into another sharded table and into one plain table.
path = tf.train.Checkpoint(table=table).write(os.path.join(sys.argv[1], f"worker{task}", "ckpt"))
with strategy.scope():
    again = strategy.create_dynamic_table("users2", dim=4, seed=9, placement="sharded")
tf.train.Checkpoint(table=again).read(path).assert_consumed()
restored = by_key(*again.export())
assert set(restored) == set(rows)
for key, value in rows.items():
    check.assertAllClose(restored[key], value, atol=0)
np.savez(os.path.join(sys.argv[1], f"worker{task}", "rows.npz"), keys=keys.numpy(), values=values.numpy())
print(f"worker {task} holds {len(mine)} of {len(rows)} keys", flush=True)

# 2. String keys with admission by count: a key met once on each worker has met its count of 2 (its owner
#    counts both workers' occurrences).
check_string_admission(check, strategy, per_replica, train_step, placement="sharded")

# 3. tfs.fit with tfs.layers.DynamicEmbedding(placement="sharded") against plain Keras on one device (the same
#    global batches); each worker's model trains its own pool, and the export serves the whole table.
from tests.harness.models import IDS, RAW_KEYS, fit_dynamic_like_keras

model = fit_dynamic_like_keras(check, strategy, placement="sharded")
emb = model.get_layer("emb").table
assert emb.sharded_over_workers and len(model.get_layer("emb").trainable_weights) == 1  # this worker's pool only
served = tf.saved_model.load(tfs.export(model, os.path.join(sys.argv[1], f"export{task}")))
keys = RAW_KEYS[IDS][:4]
want = tfs.predict(model, tf.data.Dataset.from_tensor_slices(keys).batch(4))
check.assertAllClose(list(served.signatures["serving_default"](tf.constant(keys)).values())[0], want, atol=1e-5)

# 4. A collection of sharded tables, int64 ("a", "b") and string ("c") keys, looked up together: each table
#    matches its own dense variable, accumulators included, and each worker holds only its shards' keys.
from tests.table.dynamic.test_dynamic_pooled import (NAMES, assert_like_reference, key_batches, pooled_collection,
                                                     train_replicas)

layer, adagrad = pooled_collection(strategy, **{n: {"placement": "sharded"} for n in NAMES})
assert all(layer.tables[n].sharded_over_workers for n in NAMES)
batches = [key_batches(np.random.default_rng(3 + s), 2, n=16) for s in range(3)]  # per step, one per worker
batches[1][1] = {n: v[:0] for n, v in batches[1][1].items()}  # worker 1 meets no keys in step 2
reference = train_replicas(strategy, layer, adagrad, batches)
assert_like_reference(check, layer.tables, reference, accumulator_rtol=1e-5)
for n in NAMES:
    held = layer.tables[n].shards[task].export()[0]
    assert np.all(layer.tables[n].shard_of(held).numpy() == task), n
"""
    + TRANSPORTS_SECTION
    + """
print("MWMS SHARDED DYNAMIC OK", flush=True)
"""
)


# Two replicas on each worker (logical CPUs standing in for a worker's GPUs) share the worker's copy.
LOCAL_REPLICAS_WORKER = (
    """
CHECKPOINTS = %r
import functools, os
import numpy as np, tensorflow as tf
from tests.harness.strategies import multi_worker_with_local_replicas, per_replica

strategy = multi_worker_with_local_replicas(2)
import tf_sharded as tfs
from tests.harness.models import fit_dynamic_like_keras
from tests.harness.references import table_digest as digest
from tests.table.dynamic.test_dynamic import adagrad_rows_match_reference, train_step

task = int(os.environ["TASK"])
assert strategy.num_replicas_in_sync == 4
check = tf.test.TestCase()
per_replica = functools.partial(per_replica, strategy)

# 1. Custom loop, int64 keys over 2 shards, Adagrad: each worker's copy, shared by its two replicas, matches one
#    dense variable trained on all four replicas' keys.
with strategy.scope():
    table = strategy.create_dynamic_table("users", dim=4, partitions=2, seed=3)
assert table.placement == "host" and len(table.held_variables) == 2
rows = adagrad_rows_match_reference(check, strategy, table, per_replica, replicas=4)
print(f"worker {task} custom digest {digest(table)} keys {len(rows)}", flush=True)

# 2. Admission counts each occurrence once: "b" met on both replicas of worker 0 and "d" on the second replica of
#    each worker reach their count of 2; "c", met once per step, waits for its second step.
with strategy.scope():
    words = strategy.create_dynamic_table("words", dim=2, key_dtype=tf.string, seed=1,
                                          admission=tfs.policies.MinCountAdmission(2))
    sgd = tfs.optimizers.SGD(0.1)
step = train_step(words, sgd)
initial = dict(zip([b"a", b"b", b"c", b"d"], words.initial_rows(tf.constant([b"a", b"b", b"c", b"d"])).numpy()))
step(per_replica([np.array([b"a", b"b"]), np.array([b"b"]), np.array([b"a"]), np.array([b"c"])]))
check.assertEqual(sorted(words.export()[0].numpy().tolist()), [b"a", b"b"])
step(per_replica([np.array([b"c"]), np.array([b"d"]), np.array([], dtype="S1"), np.array([b"d"])]))
got = dict(zip(*[t.numpy().tolist() for t in words.export()]))
check.assertEqual(sorted(got), [b"a", b"b", b"c", b"d"])
# Each occurrence of an admitted key adds 2 * (row - 1) to its gradient; SGD(0.1) moves the row by 0.1 times that.
for key, occurrences in ((b"a", 2), (b"b", 2), (b"c", 1), (b"d", 2)):
    check.assertAllClose(got[key], initial[key] - 0.1 * 2 * occurrences * (initial[key] - 1), atol=1e-6)
print(f"worker {task} strings digest {digest(words)}", flush=True)
# A random admission draws once per key and step, on the worker's first replica: the others admit nothing more,
# and the step admits what one lookup of all four replicas' keys admits on one device.
admission = tfs.policies.ProbabilityAdmission(0.5)
with strategy.scope():
    coin = strategy.create_dynamic_table("coin", dim=2, partitions=2, seed=4, admission=admission)
    coin_sgd = tfs.optimizers.SGD(0.1)
batches = [np.arange(100 * r, 100 * r + 100, dtype=np.int64) for r in range(4)]
train_step(coin, coin_sgd)(per_replica(batches))
local = tfs.create_dynamic_table("coin_local", dim=2, partitions=2, seed=4, admission=admission)
tfs.embedding_lookup(local, np.concatenate(batches))
admitted = sorted(coin.export()[0].numpy().tolist())
assert admitted == sorted(local.export()[0].numpy().tolist()) and 100 < len(admitted) < 300, len(admitted)

# 3. tfs.fit with tfs.layers.DynamicEmbedding against plain Keras on one device (the same global batches).
model = fit_dynamic_like_keras(check, strategy, partitions=2)
print(f"worker {task} fit digest {digest(model.get_layer('emb').table)}", flush=True)

# 4. A collection's int64 tables share one pool in each worker's copy: every table matches its reference.
from tests.table.dynamic.test_dynamic_pooled import (NAMES, assert_like_reference, key_batches, pooled_collection,
                                                     train_replicas)

layer, adagrad = pooled_collection(strategy)
pooled = layer.tables
assert pooled["a"].variables[0] is pooled["b"].variables[0] is not pooled["c"].variables[0]
batches = [key_batches(np.random.default_rng(3 + s), 4, n=16) for s in range(3)]  # per step, one per replica
batches[1][3] = {n: v[:0] for n, v in batches[1][3].items()}  # replica 3 meets no keys in step 2
reference = train_replicas(strategy, layer, adagrad, batches)
assert_like_reference(check, pooled, reference, accumulator_rtol=1e-5)
print(f"worker {task} pooled digest {'-'.join(digest(pooled[n]) for n in NAMES)}", flush=True)

# 5. placement="sharded": worker r holds shard r, shared by its two replicas; the table matches one dense variable
#    trained on every replica's keys, and a key met on both replicas of a worker is admitted once, at its count.
with strategy.scope():
    over_workers = strategy.create_dynamic_table("over_workers", dim=4, seed=3, placement="sharded")
assert (over_workers.placement, over_workers.sharded_over_workers, over_workers.num_shards) == ("sharded", True, 2)
(held,) = over_workers.held_variables
assert over_workers.variables[task] is held
rows = adagrad_rows_match_reference(check, strategy, over_workers, per_replica, replicas=4)
mine = over_workers.shards[task].export()[0].numpy()
assert len(mine) and np.all(over_workers.shard_of(mine).numpy() == task), "a worker holds only its shard's keys"
path = tf.train.Checkpoint(table=over_workers).write(os.path.join(CHECKPOINTS, f"worker{task}", "ckpt"))
with strategy.scope():
    again = strategy.create_dynamic_table("over_workers2", dim=4, seed=9, placement="sharded")
tf.train.Checkpoint(table=again).read(path).assert_consumed()
restored = dict(zip(*[t.numpy().tolist() for t in again.export()]))
assert set(restored) == set(rows)
for key, value in rows.items():
    check.assertAllClose(restored[key], value, atol=0)
print(f"worker {task} holds {len(mine)} of {len(rows)} keys", flush=True)
"""
    + TRANSPORTS_SECTION
    + """
print("MWMS LOCAL REPLICAS DYNAMIC OK", flush=True)
"""
)


class DynamicMultiWorkerTest(tf.test.TestCase):
    def test_tables_sharded_over_two_workers_match_references(self):
        workdir = tempfile.mkdtemp()
        outputs = run_multi_worker(SHARDED_WORKER.replace("sys.argv[1]", repr(workdir)), num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-4000:])
            self.assertIn("MWMS SHARDED DYNAMIC OK", out)
            self.assertIn("transports agree", out)
        held = [int(re.search(r"holds (\d+) of (\d+) keys", out).group(1)) for _, out, _ in outputs]
        total = {int(re.search(r"holds (\d+) of (\d+) keys", out).group(2)) for _, out, _ in outputs}
        self.assertEqual({sum(held)}, total)  # each key on one worker only
        # Worker 0's checkpoint (the whole table) restores into 3 local shards under the default strategy.
        saved = np.load(os.path.join(workdir, "worker0", "rows.npz"))
        table = tfs.create_dynamic_table(uid("users"), dim=4, partitions=3, seed=3)
        tf.train.Checkpoint(table=table).read(os.path.join(workdir, "worker0", "ckpt")).expect_partial()
        self.assertEqual(int(table.size()), len(saved["keys"]))
        self.assertAllClose(table.lookup(tf.constant(saved["keys"]), training=False), saved["values"], atol=0)

    def test_two_replicas_on_each_of_two_workers_share_its_copy_and_match_references(self):
        outputs = run_multi_worker(LOCAL_REPLICAS_WORKER % tempfile.mkdtemp(), num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-4000:])
            self.assertIn("MWMS LOCAL REPLICAS DYNAMIC OK", out)
            self.assertIn("transports agree", out)
        for part in ("custom", "strings", "fit", "pooled"):
            digests = {re.search(rf"{part} digest ([\w-]+)", out).group(1) for _, out, _ in outputs}
            self.assertEqual(len(digests), 1, msg=f"{part}: the workers' copies differ: {digests}")
        held = [int(re.search(r"holds (\d+) of (\d+) keys", out).group(1)) for _, out, _ in outputs]
        total = {int(re.search(r"holds (\d+) of (\d+) keys", out).group(2)) for _, out, _ in outputs}
        self.assertEqual({sum(held)}, total)  # each key on one worker only

    def test_two_workers_agree_and_match_references(self):
        outputs = run_multi_worker(WORKER, num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-4000:])
            self.assertIn("MWMS DYNAMIC OK", out)
            self.assertIn("conformance ran 8 combinations", out)
        for part in ("strings", "fit", "pooled", "policies"):
            digests = {re.search(rf"{part} digest (\w+)", out).group(1) for _, out, _ in outputs}
            self.assertEqual(len(digests), 1, msg=f"{part}: the workers' copies differ: {digests}")


if __name__ == "__main__":
    tf.test.main()
