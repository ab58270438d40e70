"""`tfs.callbacks.TableMetrics`: each table's rows, bytes and shard load in the Keras logs and in TensorBoard's
event files (read with TensorBoard's own reader), each checked against counts computed here from the same input
and the tables' layouts."""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import plugin_event_accumulator as event_accumulator

import tf_sharded as tfs
from tests.harness.strategies import mirrored, ps_strategy
from tests.harness.subprocs import network, run_python

pytestmark = pytest.mark.timeout(300)

DIM, ROWS, STEPS, BATCH = 4, 100, 8, 4
EVERY = 2  # steps between reports
EVENT_METRICS = ("admitted", "rejected", "evicted", "hit_rate", "lookup_load")  # a dynamic table's
ROW_BYTES = DIM * 4  # float32
SLOTS = 1  # Adagrad's accumulator


def batches(seed: int = 0) -> list:
    """`STEPS` batches: 3 fixed-table ids and 2 raw keys per example (keys repeat within and across batches)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, ROWS, (BATCH, 3))
        keys = (rng.zipf(1.5, (BATCH, 2)) % 40) * 1_000_003 - 7
        out.append(({"ids": ids, "keys": keys}, rng.random((BATCH, 1)).astype(np.float32)))
    return out


def dataset(data) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(
        ({k: np.stack([x[k] for x, _ in data]) for k in ("ids", "keys")}, np.stack([y for _, y in data]))
    )


def make_model(strategy, placement=None):
    """A model with a fixed table (3 shards, or `placement`'s) and a dynamic table of 2 shards."""
    extra = {} if placement is None else {"placement": placement}
    with strategy.scope():
        ids, keys = keras.Input((3,), dtype="int64", name="ids"), keras.Input((2,), dtype="int64", name="keys")
        fixed = tfs.layers.Embedding(ROWS, DIM, combiner="mean", seed=1, name="fixed", **extra)
        dynamic = tfs.layers.DynamicEmbedding(DIM, combiner="mean", partitions=2, seed=2, name="dynamic")
        out = keras.layers.Dense(1)(keras.layers.Concatenate()([fixed(ids), dynamic(keys)]))
        model = keras.Model({"ids": ids, "keys": keys}, out)
        model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
    return model, fixed.embeddings, dynamic.table


def expected(fixed, dynamic, data, steps: int, since: int = None, replicas: int = 1, first: int = 0) -> dict:
    """The metrics after `steps` steps of `data`, counted here: the fixed table's rows and layout, the distinct
    keys met so far and the shard each belongs to; and what the dynamic table's lookups did in the steps after
    step `since` (default: the report before, `EVERY` steps back), each step's batch split over `replicas`
    whose lookups reach the table one after another, replica `first` first."""
    keys = np.unique(np.concatenate([x["keys"].ravel() for x, _ in data[:steps]]))
    per_shard = np.bincount(dynamic.shard_of(keys).numpy(), minlength=dynamic.num_shards)
    sizes = np.asarray(fixed.layout.shard_sizes)
    since = max(steps - EVERY, 0) if since is None else since
    present = set(np.concatenate([x["keys"].ravel() for x, _ in data[:since]] + [np.zeros(0, np.int64)]).tolist())
    looked, hits, new = np.zeros(dynamic.num_shards), 0, 0
    read = np.zeros(fixed.num_shards)  # the fixed table's distinct ids per shard, replica and step
    sent = 0  # the bytes of the fixed table's gradient rows and ids the replicas exchange: each its distinct ids'
    for x, _ in data[since:steps]:
        parts = np.array_split(x["keys"], replicas)
        for part in parts[first:] + parts[:first]:
            ids = part.ravel()
            looked += np.bincount(dynamic.shard_of(ids).numpy(), minlength=dynamic.num_shards)
            hits += sum(k in present for k in ids.tolist())
            new += len(set(ids.tolist()) - present)
            present.update(ids.tolist())
        for part in np.array_split(x["ids"], replicas):
            owners = fixed.layout.route(tf.constant(np.unique(part), tf.int64))[0].numpy()
            read += np.bincount(owners, minlength=fixed.num_shards)
            sent += len(np.unique(part)) * (ROW_BYTES + 8)
    exchange = {f"tables/{fixed.name}/exchange_bytes": sent / (steps - since)} if replicas > 1 else {}
    return exchange | {
        f"tables/{fixed.name}/rows": ROWS,
        f"tables/{fixed.name}/bytes": ROWS * ROW_BYTES * (1 + SLOTS),
        f"tables/{fixed.name}/shard_load": sizes.max() / sizes.mean(),
        f"tables/{fixed.name}/lookup_load": read.max() / read.mean(),
        f"tables/{dynamic.name}/rows": len(keys),
        f"tables/{dynamic.name}/bytes": len(keys) * ROW_BYTES * (1 + SLOTS),
        f"tables/{dynamic.name}/shard_load": per_shard.max() / per_shard.mean(),
        f"tables/{dynamic.name}/admitted": new,
        f"tables/{dynamic.name}/rejected": 0,
        f"tables/{dynamic.name}/evicted": 0,
        f"tables/{dynamic.name}/hit_rate": hits / looked.sum(),
        f"tables/{dynamic.name}/lookup_load": looked.max() / looked.mean(),
    }


def events(log_dir) -> dict:
    """`{tag: [(step, value)]}` of the event files in `log_dir`, read with TensorBoard's own reader (TF 2's
    summaries are tensors: a scalar's is a number, a histogram's its `[left, right, count]` buckets)."""
    found = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.TENSORS: 0})
    found.Reload()
    return {
        tag: [(e.step, tf.make_ndarray(e.tensor_proto)) for e in found.Tensors(tag)] for tag in found.Tags()["tensors"]
    }


# Run in the tests' network namespace, where the TensorBoard server listens: waits for it, then prints the
# scalar series of each tag asked for, as its HTTP API returns them ([[wall time, step, value], ...]).
QUERY = """
import json, sys, time, urllib.parse, urllib.request
base, tags = sys.argv[1], sys.argv[2:]
deadline = time.monotonic() + 120
while True:
    try:
        runs = json.load(urllib.request.urlopen(base + "/data/plugin/scalars/tags", timeout=5))
        if runs:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("tensorboard did not answer in 120 s")
    time.sleep(0.5)
histograms = json.load(urllib.request.urlopen(base + "/data/plugin/histograms/tags"))
out = {"tags": runs, "series": {}, "histograms": histograms}
for tag in tags:
    query = urllib.parse.urlencode({"run": ".", "tag": tag})
    out["series"][tag] = json.load(urllib.request.urlopen(base + "/data/plugin/scalars/scalars?" + query))
print(json.dumps(out))
"""


class TableMetricsTest(tf.test.TestCase):
    @pytest.mark.slow  # over 4 s
    def test_default_strategy_reports_counts_to_logs_and_tensorboard_and_a_resumed_run_continues_its_curves(self):
        data = batches()
        strategy = tf.distribute.get_strategy()
        log_dir, checkpoints = (os.path.join(self.get_temp_dir(), d) for d in ("logs", "ckpt"))
        model, fixed, dynamic = make_model(strategy)
        history = tfs.fit(model, dataset(data[:4]), steps_per_epoch=4, verbose=0,
                          checkpoint_dir=checkpoints, callbacks=[tfs.callbacks.TableMetrics(2, log_dir)])  # fmt: skip
        # The epoch's logs (History) carry the last report: the counts after 4 steps.
        want = expected(fixed, dynamic, data, 4)
        for name, value in want.items():
            self.assertAllClose(history.history[name], [value], msg=name)
        # A run killed after its checkpoint at step 4 had written reports past it, as one killed at step 7 would.
        with tf.summary.create_file_writer(log_dir).as_default():
            for name in want:
                tf.summary.scalar(name, -1.0, step=6)
        time.sleep(1.1)  # event files are read in the order of their names, which begin with the second they began
        # Resumed from the checkpoint at step 4 by a new model, on the batches that follow: the curves go on at 6,
        # the killed run's report at 6 dropped by TensorBoard.
        model, fixed, dynamic = make_model(strategy)
        tfs.fit(model, dataset(data[4:]), epochs=2, steps_per_epoch=4, verbose=0,
                checkpoint_dir=checkpoints, callbacks=[tfs.callbacks.TableMetrics(2, log_dir)])  # fmt: skip
        found = events(log_dir)
        for name in want:
            self.assertEqual([step for step, _ in found[name]], [2, 4, 6, 8], msg=name)  # no gap, no repeat
            for step, value in found[name]:
                self.assertAllClose(value, expected(fixed, dynamic, data, step)[name], msg=name)
        shard_rows = found[f"tables/{dynamic.name}/shard_rows"]
        self.assertEqual([step for step, _ in shard_rows], [2, 4, 6, 8])
        for step, buckets in shard_rows:  # one value per shard, within the shards' smallest and largest
            keys = np.unique(np.concatenate([x["keys"].ravel() for x, _ in data[:step]]))
            per_shard = np.bincount(dynamic.shard_of(keys).numpy(), minlength=dynamic.num_shards)
            self.assertEqual(buckets[:, 2].sum(), dynamic.num_shards)
            self.assertLessEqual(buckets[0, 0], per_shard.min())
            self.assertGreaterEqual(buckets[-1, 1], per_shard.max())

    @pytest.mark.slow  # over 4 s
    def test_a_tensorboard_server_serves_each_tables_series(self):
        # A real `tensorboard --logdir` on a loopback port of the tests' network namespace, asked through its
        # HTTP API (the scalars plugin's), as the dashboard asks it.
        import portpicker

        data = batches()
        log_dir = os.path.join(self.get_temp_dir(), "served")
        model, fixed, dynamic = make_model(tf.distribute.get_strategy())
        tfs.fit(model, dataset(data), steps_per_epoch=STEPS, verbose=0,
                callbacks=[tfs.callbacks.TableMetrics(2, log_dir)])  # fmt: skip
        want = {step: expected(fixed, dynamic, data, step) for step in (2, 4, 6, 8)}
        port = portpicker.pick_unused_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", log_dir, "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=network(),
        )  # fmt: skip
        try:
            proc = run_python(["-c", QUERY, f"http://127.0.0.1:{port}", *want[2]], timeout=180)
        finally:
            server.kill()
            _, err = server.communicate(timeout=30)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:] + err.decode()[-2000:])
        served = json.loads(proc.stdout.strip().splitlines()[-1])
        self.assertEqual(sorted(served["tags"]["."]), sorted(want[2]))
        for tag in want[2]:
            self.assertEqual([step for _, step, _ in served["series"][tag]], [2, 4, 6, 8], tag)
            for _, step, value in served["series"][tag]:
                self.assertAllClose(value, want[step][tag], rtol=1e-6, msg=f"{tag} at step {step}")
        shards = [f"tables/{t.name}/shard_{what}" for t in (dynamic, fixed) for what in ("lookups", "rows")]
        self.assertEqual(sorted(served["histograms"]["."]), shards)

    @pytest.mark.slow  # over 4 s
    def test_keras_model_fit_reports_under_mirrored_with_the_fixed_table_sharded_over_the_replicas(self):
        data = batches(1)
        strategy = mirrored()
        model, fixed, dynamic = make_model(strategy, placement="sharded")
        self.assertEqual(fixed.num_shards, strategy.num_replicas_in_sync)
        callback = tfs.callbacks.TableMetrics(every=4)
        history = model.fit(dataset(data), epochs=1, verbose=0, shuffle=False, callbacks=[callback])
        replicas = strategy.num_replicas_in_sync
        want = expected(fixed, dynamic, data, STEPS, since=4, replicas=replicas)
        del want[f"tables/{dynamic.name}/hit_rate"]
        for name, value in want.items():
            self.assertAllClose(history.history[name], [value], msg=name)
        # The replicas share the worker's copy: a key new in a step that several replicas meet is a hit for
        # those whose lookups reach it after the first one's, in whichever order they come in each step (in
        # these steps no such key occurs: the bounds meet).
        hits = [[expected(fixed, dynamic, data, s, s - 1, replicas, first)[f"tables/{dynamic.name}/hit_rate"]
                 for first in range(replicas)] for s in range(5, STEPS + 1)]  # fmt: skip
        low, high = (sum(f(h) for h in hits) / len(hits) for f in (min, max))
        self.assertBetween(history.history[f"tables/{dynamic.name}/hit_rate"][0], low - 1e-9, high + 1e-9)

    @pytest.mark.slow  # over 4 s
    def test_mirrored_copies_report_the_bytes_their_exchange_moves_per_step(self):
        data = batches(2)
        strategy = mirrored()
        model, fixed, dynamic = make_model(strategy)
        history = model.fit(dataset(data), epochs=1, verbose=0, shuffle=False,
                            callbacks=[tfs.callbacks.TableMetrics(every=3)])  # fmt: skip
        replicas = strategy.num_replicas_in_sync
        # The report at step 6 covers steps 4 to 6; the epoch's logs carry it.
        name = f"tables/{fixed.name}/exchange_bytes"
        want = expected(fixed, dynamic, data, 6, since=3, replicas=replicas)[name]
        self.assertGreater(want, 0)
        self.assertAllClose(history.history[name], [want])

    def test_bad_arguments_are_refused_in_one_line_naming_them(self):
        for every in (0, -3, 2.5, "10", True):
            with self.assertRaisesRegex(ValueError, r"^Argument `every` must be a positive integer. Received: every="):
                tfs.callbacks.TableMetrics(every)
        blocker = os.path.join(self.get_temp_dir(), "a_file")
        with open(blocker, "w") as f:
            f.write("")
        for log_dir in (blocker, os.path.join(blocker, "logs")):
            with self.assertRaisesRegex(ValueError, r"^Argument `log_dir` must be a directory that can be written"):
                tfs.callbacks.TableMetrics(5, log_dir)
            self.assertEqual(os.path.getsize(blocker), 0)


@pytest.mark.ps_cluster
class ParameterServerTableMetricsTest(tf.test.TestCase):
    @pytest.mark.slow  # over 4 s
    def test_the_coordinator_reads_the_tables_on_the_parameter_servers(self):
        # Every step meets the same batch (the two workers take steps in any order): the counts after any step.
        data = batches(2)[:1] * STEPS
        strategy = ps_strategy()
        log_dir, checkpoints = (os.path.join(self.get_temp_dir(), d) for d in ("logs", "ckpt"))
        for max_steps in (5, STEPS):  # stopped inside an epoch of 2 steps, then resumed there by a new model
            model, fixed, dynamic = make_model(strategy)
            history = tfs.fit(model, lambda context=None: dataset(data).repeat(), epochs=STEPS // 2,
                              steps_per_epoch=2, max_steps=max_steps, verbose=0, checkpoint_dir=checkpoints,
                              callbacks=[tfs.callbacks.TableMetrics(2, log_dir)])  # fmt: skip
        self.assertTrue(all("/job:ps" in v.device for v in dynamic.held_variables))
        # The last report's events: steps 7 and 8, every key already present.
        want = expected(fixed, dynamic, data, 1)
        last = expected(fixed, dynamic, data, STEPS, since=STEPS - 2)
        want.update({f"tables/{dynamic.name}/{m}": last[f"tables/{dynamic.name}/{m}"] for m in EVENT_METRICS})
        want[f"tables/{fixed.name}/lookup_load"] = last[f"tables/{fixed.name}/lookup_load"]
        self.assertEqual((want[f"tables/{dynamic.name}/hit_rate"], want[f"tables/{dynamic.name}/admitted"]), (1, 0))
        for name, value in want.items():
            self.assertAllClose(history.history[name][-1], value, msg=name)
        # Each report at the step it was read at, the resumed run's included (the coordinator's exact count).
        found = events(log_dir)
        self.assertEqual([step for step, _ in found[f"tables/{dynamic.name}/rows"]], [2, 4, 6, 8])
