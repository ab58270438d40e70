"""The training application: every strategy on tiny settings, files, resume, inspect, bad input, TF_CONFIG."""

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import portpicker
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from tests.harness.subprocs import ROOT, network, run_cli_here, run_python, run_python_together
from tf_sharded.app import parquet

# The application's commands on process clusters, killed and rerun.
pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=560)]

TINY = [
    "--steps",
    "4",
    "--steps_per_epoch",
    "2",
    "--batch_size",
    "64",
    "--max_vocab",
    "500",
    "--eval_steps",
    "2",
    "--verbose",
    "0",
]


def train_args(*args):
    return ["-m", "tf_sharded", "train", *TINY, *args]


def train(*args, timeout=300):
    return run_python(train_args(*args), timeout=timeout)


def synthesize_args(fmt, rows, out):
    return ["-m", "tf_sharded", "data", "synthesize", "--format", fmt, "--rows", str(rows), "--out", out,
            "--max_vocab", "500"]  # fmt: skip


def summary(proc):
    lines = [line for line in proc.stdout.splitlines() if line.startswith("summary:")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    return lines[-1]


class ApplicationTest(tf.test.TestCase):
    def test_each_strategy_trains_and_reports(self):
        cases = (
            ("default", "deepfm", "1"),
            ("mirrored", "dlrm", "1"),  # tables sharded over 2 CPU replicas
            ("multi_worker", "deepfm", "1"),
            ("parameter_server", "dlrm", "3"),  # 2 steps per epoch at 3 per execution: one execution of 2
            ("hybrid", "dlrm", "1"),  # a table server and 2 workers, a process each
        )
        ckpts = {strategy: os.path.join(self.get_temp_dir(), strategy) for strategy, _, _ in cases}
        # Tables sharded over the replicas: 2 CPU replicas; the one worker of a multi-worker run without TF_CONFIG.
        sharded = {
            "mirrored": ["--cpu_replicas", "2", "--placement", "sharded"],
            "multi_worker": ["--placement", "sharded", "--notable_metrics"],  # and no TensorBoard summaries
            "hybrid": ["--num_ps", "1"],  # and 2 workers, the second started by the first
        }
        commands = [
            train_args("--strategy", strategy, "--model", model, "--steps_per_execution", per_execution,
                       "--checkpoint_dir", ckpts[strategy], *sharded.get(strategy, []))
            for strategy, model, per_execution in cases
        ]  # fmt: skip
        # Two runs at a time (independent processes): most of a tiny run is start-up and tracing.
        # The hybrid run beside the two lightest (its second worker and its server mostly wait on each other).
        procs = run_python_together(commands[:2] + commands[4:], 300) + run_python_together(commands[2:4], 300)
        procs = procs[:2] + procs[3:] + procs[2:3]  # back in the order of `cases`
        for (strategy, model, _), proc in zip(cases, procs):
            ckpt = ckpts[strategy]
            self.assertEqual(proc.returncode, 0, msg=f"{strategy}: {proc.stderr[-3000:]}")
            line = summary(proc)
            self.assertIn(f"{model} | {strategy}", line)
            if strategy == "mirrored":
                self.assertIn("mirrored (2 replicas on CPU devices)", line)
            self.assertIn("4 steps", line)
            self.metrics_are_those_of_the_saved_model(proc, model, ckpt)
            # The table metrics' summaries go to <checkpoint_dir>/logs, unless --notable_metrics.
            self.assertEqual(os.path.isdir(os.path.join(ckpt, "logs")), strategy != "multi_worker", strategy)

    def metrics_are_those_of_the_saved_model(self, proc, model_name, ckpt):
        """The printed AUC and log-loss, recomputed here from the checkpoint on the same held-out batches."""
        from tf_sharded.app import data, models

        reported = re.search(r"held-out AUC (\d\.\d{4}), log-loss (\d+\.\d{4}) on 128 examples", proc.stdout)
        self.assertIsNotNone(reported, proc.stdout)

        model = models.build(model_name, data.vocab_sizes(500), embedding_dim=16)
        held_out = data.synthetic_dataset(64, 500, 1, num_batches=2)  # --seed 0 + 1, --eval_steps 2
        model(next(iter(held_out))[0])
        tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(ckpt)).expect_partial()
        p, y = [], []
        for features, labels in held_out:
            p.append(tf.sigmoid(model(features, training=False)).numpy().ravel())
            y.append(labels.numpy().ravel())
        p, y = np.concatenate(p).astype(np.float64), np.concatenate(y)
        logloss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
        # The app reports Keras's AUC (2000 thresholds, which can differ from the exact one by a few 1e-3):
        # the same metric on the predictions recomputed here.
        auc = keras.metrics.AUC(num_thresholds=2000)
        auc.update_state(y, p)
        self.assertAllClose(float(reported.group(2)), logloss, atol=1e-4)
        self.assertAllClose(float(reported.group(1)), float(auc.result()), atol=1e-4)

    def test_files_resume_and_inspect(self):
        out = self.get_temp_dir()
        tsv, pq = os.path.join(out, "tsv"), os.path.join(out, "pq")
        # Commands that end before training run in this process; training runs in processes of its own.
        made = [run_cli_here(synthesize_args("tsv", 1500, tsv)), run_cli_here(synthesize_args("parquet", 800, pq))]
        for proc in made:
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        # A malformed line where training reads (the first 2 batches of 64 are held out).
        name = os.path.join(tsv, "part-00000.tsv")
        with open(name) as f:
            lines = f.readlines()
        with open(name, "w") as f:
            f.writelines(lines[:149] + ["not\ta\tcriteo\tline\n"] + lines[149:])
        ckpt = os.path.join(out, "ckpt")
        # The default strategy (parameter servers, a local cluster): each worker opens the file itself.
        first = train("--data", tsv, "--checkpoint_dir", ckpt, "--steps", "5", "--metrics_every", "2")
        strict = run_cli_here(train_args("--strategy", "default", "--data", tsv, "--strict"))
        self.assertEqual(first.returncode, 0, first.stderr[-3000:])
        self.assertIn("under parameter_server", first.stdout)
        # --steps is the total: 5 is 2 epochs of 2 steps and one step of a third.
        self.assertIn("5 steps (5 this run)", summary(first))
        self.assertIn(f"skipped 1 malformed record(s); first: {name}:150: Expect 40 fields but have 4", first.stdout)
        self.assertIn(f"checkpoint: {ckpt}/ckpt-5", first.stdout)
        self.assertEqual(strict.returncode, 1)
        self.assertEqual(
            strict.stderr.strip().splitlines()[-1],
            f"error: malformed input (--strict): {name}:150: Expect 40 fields but have 4 in record 0",
        )
        self.assertNotIn("training dlrm", strict.stdout)  # refused before training

        # Parquet under parameter servers with a process per task: each worker process reads its own share.
        again, from_parquet = run_python_together(
            [train_args("--strategy", "mirrored", "--data", tsv, "--checkpoint_dir", ckpt, "--steps", "7",
                        "--metrics_every", "2"),
             train_args("--local_cluster", "process", "--data", pq)]
        )  # fmt: skip
        self.assertEqual(again.returncode, 0, again.stderr[-3000:])
        # Resumed inside an epoch, under another strategy (Keras's model.fit): steps 6 and 7.
        self.assertIn("7 steps (2 this run)", summary(again))
        self.assertIn(f"checkpoint: {ckpt}/ckpt-7", again.stdout)
        self.assertEqual(from_parquet.returncode, 0, from_parquet.stderr[-3000:])
        # Its functions are released while the tasks still run: nothing on stderr about unreachable tasks at exit.
        self.assertNotIn("Failed to remove function remotely", from_parquet.stderr)
        where = "(local cluster, a process per task: 2 ps, 2 workers)"
        self.assertIn(f"{where} | 4 steps (4 this run)", summary(from_parquet))
        # Read through tensorflow-io where its ops load, else through the cache, which one line names.
        cached = [line for line in from_parquet.stdout.splitlines() if line.startswith("Parquet: reading a copy in ")]
        self.assertEqual(len(cached), 0 if parquet.tensorflow_io_loads() else 1, from_parquet.stdout[:2000])
        self.assertTrue(all(parquet.why_cached() in line for line in cached), cached)

        shown = run_cli_here(["-m", "tf_sharded", "inspect", ckpt])
        self.assertEqual(shown.returncode, 0, shown.stderr[-2000:])
        self.assertRegex(
            shown.stdout,
            r"tables_C3\s+\[500, 16\]\s+float32\s+0\.03 MiB\s+table 'embeddings/C3' saved as "
            r"PartitionSpec\(num_shards=1, scheme='div'\) on 1 device\(s\) under MirroredStrategy",
        )
        # TensorBoard's curves in <checkpoint_dir>/logs (the default --logdir), one file per run (the chief's, or
        # the coordinator's), continued by the resumed run: the tables' every 2 steps and the loss beside them.
        logs = os.path.join(ckpt, "logs")
        self.assertLen([f for f in os.listdir(logs) if "tfevents" in f], 2)
        found = event_accumulator.EventAccumulator(logs, size_guidance={event_accumulator.TENSORS: 0})
        found.Reload()  # TF 2's summaries are tensors
        series = {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in found.Tensors(tag)]
                  for tag in found.Tags()["tensors"] if not tag.endswith(("shard_rows", "shard_lookups"))}  # fmt: skip
        for name, want in (("rows", 500), ("bytes", 500 * 16 * 4 * 3), ("shard_load", 1.0)):  # Adam: 2 slots a row
            self.assertEqual(series[f"tables/embeddings/C3/{name}"], [(2, want), (4, want), (6, want)], name)
        self.assertEqual([step for step, _ in series["train/loss"]], [2, 4, 6])
        self.assertIn(5, [step for step, _ in series["epoch/samples_per_second"]])  # the first run's last epoch

    def test_plan_auto_prints_the_plan_it_trains_with(self):
        """`--plan auto` under the default strategy (parameter servers): the printed plan is the layout saved."""
        ckpt = os.path.join(self.get_temp_dir(), "planned")
        proc = train("--plan", "auto", "--checkpoint_dir", ckpt)
        self.assertEqual(proc.returncode, 0, msg=proc.stderr[-3000:])
        self.assertIn("embeddings: plan for parameter_server (2 ps)", proc.stdout)
        self.assertIn("4 steps", summary(proc))
        rows = re.findall(r"^(C\d+) +\S+ x 16 +\d+ +\d+ +(1 shard|2 shards, div|2 shards, mod) ", proc.stdout, re.M)
        self.assertEqual(len(rows), 26, proc.stdout)
        planned = {table: "1 div" if layout == "1 shard" else f"2 {layout[-3:]}" for table, layout in rows}
        shown = run_cli_here(["-m", "tf_sharded", "inspect", ckpt])
        self.assertEqual(shown.returncode, 0, shown.stderr[-2000:])
        pattern = r"table 'embeddings/(C\d+)' saved as PartitionSpec\(num_shards=(\d), scheme='(\w+)'\)"
        saved = {table: f"{n} {scheme}" for table, n, scheme in re.findall(pattern, shown.stdout)}
        self.assertEqual(saved, planned)

    def test_bad_flags_and_unreadable_input(self):
        small = os.path.join(self.get_temp_dir(), "small")
        ratings = os.path.join(self.get_temp_dir(), "ratings")
        # A bad flag through a process of its own (its exit code and its stderr's one line), the rest called here.
        bad = run_python(train_args("--model", "xgboost"), timeout=120)
        self.assertNotIn("Traceback", bad.stderr)
        (*shown, missing, made_small, made_ratings, unwritable, no_logs, unknown, stray) = map(run_cli_here, [
            ["-m", "tf_sharded", "train", "--help"],
            ["-m", "tf_sharded", "train", "--helpfull"],
            train_args("--strategy", "default", "--data", "/nonexistent/day_0.tsv"),
            synthesize_args("tsv", 100, small),
            ["-m", "tf_sharded", "data", "synthesize", "--dataset", "ratings", "--format", "parquet", "--rows", "300",
             "--out", ratings],
            train_args("--strategy", "default", "--checkpoint_dir", "/proc/no_such_dir/ckpt"),
            train_args("--strategy", "default", "--logdir", "/proc/no_such_dir/logs"),
            ["-m", "tf_sharded", "inspect", "/nonexistent"],
            train_args("--strategy", "mirrored", "--local_cluster", "process", "--num_ps", "3"),
        ])  # fmt: skip
        # The local cluster's flags where no local cluster starts: refused, not ignored.
        self.assertEqual(stray.returncode, 2)
        self.assertEqual(
            stray.stderr.strip().splitlines()[-1],
            "error: --num_ps, --local_cluster: the local cluster's flags apply to --strategy "
            "parameter_server|hybrid|multi_worker without TF_CONFIG; received --strategy mirrored (python -m "
            "tf_sharded train --help lists the flags)",
        )
        self.assertNotIn("training dlrm", stray.stdout)
        self.assertEqual(bad.returncode, 2)
        self.assertEqual(
            bad.stderr.strip().splitlines()[-1],
            "error: flag --model=xgboost: value should be one of <dlrm|deepfm|mlp> (python -m tf_sharded train "
            "--help lists the flags)",
        )
        for proc in shown:
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            self.assertIn("--schema: Feature schema", proc.stdout)
            self.assertIn("--format: <auto|tsv|csv|tfrecord|parquet>", proc.stdout)
        self.assertEqual(missing.returncode, 1)
        self.assertEqual(
            missing.stderr.strip().splitlines()[-1],
            "error: --data: cannot read input: No such file or directory: '/nonexistent/day_0.tsv'",
        )
        self.assertEqual((made_small.returncode, made_ratings.returncode), (0, 0))
        self.assertEqual(unwritable.returncode, 1)
        self.assertIn("error: --checkpoint_dir /proc/no_such_dir/ckpt: cannot write there", unwritable.stderr)
        self.assertEqual(no_logs.returncode, 1)
        self.assertRegex(no_logs.stderr.strip().splitlines()[-1], r"^error: --logdir /proc/no_such_dir/logs: cannot "
                         r"write there \(.+\)$")  # fmt: skip
        self.assertNotIn("training dlrm", no_logs.stdout)
        self.assertEqual(unknown.returncode, 1)
        self.assertNotIn("Traceback", unknown.stderr)
        self.assertEqual(
            unknown.stderr.strip().splitlines()[-1],
            "error: inspect: no checkpoint at '/nonexistent': expected a checkpoint directory or a checkpoint's "
            "prefix, such as ckpt/ckpt-200",
        )
        too_small, lacking = map(run_cli_here, [train_args("--strategy", "default", "--data", path)
                                                for path in (small, ratings)])  # fmt: skip
        self.assertEqual(too_small.returncode, 1)
        self.assertIn(f"error: --data {small}: too little data in {small}/part-00000.tsv", too_small.stderr)
        self.assertNotIn("training dlrm", too_small.stdout)
        self.assertEqual(lacking.returncode, 1)
        criteo = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
        self.assertEqual(lacking.stderr.strip().splitlines()[-1],
                         f"error: --data {ratings}/ratings.parquet lacks columns {criteo}; it has ['rating', "
                         "'user_id', 'movie_id', 'age', 'genres'] (without --schema the columns are Criteo's; see "
                         "`schema infer`)")  # fmt: skip

    def test_one_process_per_task_with_tf_config(self):
        """Each task of a TF_CONFIG cluster runs the same command: parameter servers (the chief trains, ps and
        workers serve) and hybrid (ps tasks serve tables, chief and worker train together); both at once."""
        jobs = {"parameter_server": (("chief", 1), ("worker", 2), ("ps", 2)), "hybrid": (("chief", 1), ("worker", 1),
                                                                                          ("ps", 1))}  # fmt: skip
        procs = {}
        try:
            for strategy, counts in jobs.items():
                cluster = {job: [f"localhost:{portpicker.pick_unused_port()}" for _ in range(n)] for job, n in counts}
                for job, n in counts:
                    for i in range(n):
                        config = json.dumps({"cluster": cluster, "task": {"type": job, "index": i}})
                        procs[(strategy, job, i)] = subprocess.Popen(
                            [sys.executable, "-m", "tf_sharded", "train", "--strategy", strategy, *TINY],
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": config},
                            cwd=ROOT,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=network(),  # the tasks reach one another in the run's own network
                        )
            described = {"parameter_server": "parameter_server (2 ps, 2 workers, TF_CONFIG)",
                         "hybrid": "hybrid (2 workers, 1 table server, TF_CONFIG)"}  # fmt: skip
            for strategy, where in described.items():
                trainers = [k for k in procs if k[0] == strategy and k[1] != "ps"]
                for key in trainers if strategy == "hybrid" else [(strategy, "chief", 0)]:
                    out, err = procs[key].communicate(timeout=300)
                    self.assertEqual(procs[key].returncode, 0, f"{key}: {err[-3000:]}")
                    self.assertIn(where, out, key)
                    self.assertIn("4 steps", summary(subprocess.CompletedProcess([], 0, out, err)))
            time.sleep(0.5)
            for key, p in procs.items():
                if key[1] == "ps" or key[0] == "parameter_server" and key[1] != "chief":
                    self.assertIsNone(p.poll(), msg=f"{key} exited early")  # servers serve until stopped
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()


def write_ratings(path, rows=4000, seed=0):
    """Movie-rating-like records: string user ids, integer movie ids, multi-hot genres, a numeric age and a
    real-valued rating from hidden per-id effects."""
    rng = np.random.default_rng(seed)
    users, movies, genres = rng.normal(0, 0.8, 150), rng.normal(0, 0.8, 80), rng.normal(0, 0.5, 8)
    movie_genres = [rng.choice(8, size=rng.integers(1, 4), replace=False) for _ in range(80)]
    ages = rng.integers(18, 70, 150)
    lines = ["rating,user,movie,genres,age"]
    for _ in range(rows):
        u, m = rng.integers(150), rng.integers(80)
        rating = 3.0 + users[u] + movies[m] + genres[movie_genres[m]].mean() + 0.02 * (ages[u] - 40)
        rating += rng.normal(0, 0.3)
        names = "|".join(f"g{g}" for g in movie_genres[m])
        lines.append(f"{rating:.3f},user{u},{m},{names},{ages[u]}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


RATINGS_SCHEMA = {
    "label": {"name": "rating", "type": "regression"},
    "features": [
        {"name": "user", "type": "categorical", "buckets": 20000},
        {"name": "movie", "type": "categorical", "buckets": 10000},
        {"name": "genres", "type": "multi_hot", "buckets": 64, "combiner": "mean"},
        {"name": "age", "type": "numeric", "transform": "standardize"},
    ],
}


class OwnDataTest(tf.test.TestCase):
    def test_a_regression_schema_trains_as_well_as_plain_keras(self):
        out = self.get_temp_dir()
        path, schema_path = os.path.join(out, "ratings.csv"), os.path.join(out, "schema.json")
        write_ratings(path)
        with open(schema_path, "w") as f:
            json.dump(RATINGS_SCHEMA, f)
        # The app reads the same records as TFRecord, genres a list (the reference below reads the CSV).
        records = os.path.join(out, "ratings.tfrecord")
        with open(path) as f, tf.io.TFRecordWriter(records) as writer:
            for row in list(csv.DictReader(f)):
                feature = {
                    "rating": tf.train.Feature(float_list=tf.train.FloatList(value=[float(row["rating"])])),
                    "user": tf.train.Feature(bytes_list=tf.train.BytesList(value=[row["user"].encode()])),
                    "movie": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(row["movie"])])),
                    "genres": tf.train.Feature(
                        bytes_list=tf.train.BytesList(value=[g.encode() for g in row["genres"].split("|")])
                    ),
                    "age": tf.train.Feature(float_list=tf.train.FloatList(value=[float(row["age"])])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        steps, batch, held = 400, 64, 5
        args = ["--data", records, "--schema", schema_path, "--model", "mlp", "--strategy", "default"]
        args += ["--steps", str(steps), "--steps_per_epoch", "100", "--batch_size", str(batch)]
        args += ["--eval_steps", str(held), "--embedding_dim", "8", "--verbose", "0", "--max_vocab", "500"]
        proc = run_python(["-m", "tf_sharded", "train", *args], timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        reported = re.search(r"held-out MSE (\d+\.\d{4}), RMSE (\d+\.\d{4}) on 320 examples", proc.stdout)
        self.assertIsNotNone(reported, proc.stdout)
        app_mse = float(reported.group(1))

        # The reference: one device, plain Keras (lookup layers + keras.layers.Embedding), the same MLP,
        # optimizer, steps and batches, the same held-out rows (the file's first 320).
        with open(path) as f:
            rows = list(csv.DictReader(f))
        columns = {k: [r[k] for r in rows] for k in rows[0]}
        y = np.array(columns["rating"], np.float32)[:, None]
        age = np.array(columns["age"], np.float32)
        train_age = age[held * batch :]
        x = {
            "user": np.array(columns["user"]),
            "movie": np.array(columns["movie"]),
            # Genre ids 1..8, padded with 0 (masked).
            "genres": np.array(
                [[int(g[1:]) + 1 for g in gs.split("|")] + [0] * (3 - len(gs.split("|"))) for gs in columns["genres"]]
            ),
            "age": ((age - train_age.mean()) / train_age.std())[:, None],
        }
        keras.utils.set_random_seed(0)
        user = keras.layers.StringLookup(vocabulary=sorted(set(columns["user"])))
        movie = keras.layers.StringLookup(vocabulary=sorted(set(columns["movie"])))
        inputs = {
            "user": keras.Input((), dtype="string"),
            "movie": keras.Input((), dtype="string"),
            "age": keras.Input((1,)),
        }
        genres_in = keras.Input((3,), dtype="int64")
        e_user = keras.layers.Embedding(user.vocabulary_size(), 8)(user(inputs["user"]))
        e_movie = keras.layers.Embedding(movie.vocabulary_size(), 8)(movie(inputs["movie"]))
        e_genre = keras.layers.Embedding(9, 8, mask_zero=True)(genres_in)
        e_genre = keras.layers.GlobalAveragePooling1D()(e_genre)
        h = keras.layers.Concatenate()([e_user, e_movie, e_genre, inputs["age"]])
        h = keras.layers.Dense(256, activation="relu")(h)
        h = keras.layers.Dense(128, activation="relu")(h)
        reference = keras.Model({**inputs, "genres": genres_in}, keras.layers.Dense(1)(h))
        reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        start = held * batch
        train = tf.data.Dataset.from_tensor_slices(({k: v[start:] for k, v in x.items()}, y[start:]))
        train = train.repeat().batch(batch, drop_remainder=True).take(steps)
        reference.fit(train, epochs=1, verbose=0)
        test = tf.data.Dataset.from_tensor_slices(({k: v[:start] for k, v in x.items()}, y[:start])).batch(batch)
        keras_mse = float(reference.evaluate(test, verbose=0))
        variance = float(np.var(y[:start]))
        # Both learn (well below the label's variance), and the app is as good as plain Keras.
        self.assertLess(keras_mse, 0.5 * variance)
        self.assertLess(app_mse, max(1.15 * keras_mse, keras_mse + 0.02), msg=f"app {app_mse}, keras {keras_mse}")


class KillAndResumeTest(tf.test.TestCase):
    """A run killed with SIGKILL and rerun ends where an uninterrupted run ends: the restore is exact and the
    input resumes at the batch after the checkpoint (the same batches in the same order)."""

    COMMON = ["--steps_per_epoch", "15", "--batch_size", "256", "--max_vocab", "1000", "--eval_steps", "8",
              "--verbose", "0"]  # fmt: skip

    def test_killed_run_resumes_to_the_uninterrupted_result(self):
        self._kill_and_resume(["--strategy", "parameter_server", "--num_workers", "1", "--steps", "60"], 60, 30)

    def test_two_worker_job_whose_second_worker_is_killed_restarts_itself_to_the_uninterrupted_result(self):
        # tfs.fit's own replica loop over the two worker processes of the local cluster `--num_workers 2` starts,
        # sharing one --checkpoint_dir, with the tables sharded over them. Worker 1 is killed: a synchronous
        # job cannot go on without it, so the job stops its cluster and runs its command again.
        flags = ["--strategy", "multi_worker", "--num_workers", "2", "--placement", "sharded", "--steps", "45"]
        self._kill_and_resume(flags, 45, 15, kill=lambda procs: os.kill(self._started_by(procs[0], "tf_sharded train"),
                                                                         signal.SIGKILL), restarts=True)  # fmt: skip
        restarted = (r"(?m)^restarting: the local multi-worker cluster's worker 1 ended \(exit code -9\); "
                     r"the job restarts from --checkpoint_dir \(restart 1 of 3\)$")  # fmt: skip
        self.assertRegex(self._stderr, restarted)

    def test_hybrid_job_whose_table_server_is_killed_restarts_itself_to_the_uninterrupted_result(self):
        # The table server killed mid-run: the job stops its cluster and runs its command again, which starts a
        # new server and restores the tables and their slots into it. Dynamic tables: their keys, counters and
        # optimizer columns too. One worker: every run is deterministic.
        flags = ["--strategy", "hybrid", "--num_workers", "1", "--num_ps", "1", "--steps", "30",
                 "--vocabulary", "dynamic"]  # fmt: skip
        self._kill_and_resume(flags, 30, 15, kill=lambda procs: os.kill(self._started_by(procs[0], "tf_sharded.hybrid"),
                                                                         signal.SIGKILL), restarts=True)  # fmt: skip
        restarted = (r"(?m)^restarting: the local hybrid cluster's table server localhost:\d+ ended \(exit code -9\); "
                     r"the job restarts from --checkpoint_dir \(restart 1 of 3\)$")  # fmt: skip
        self.assertRegex(self._stderr, restarted)

    def test_hybrid_job_whose_second_worker_is_killed_restarts_itself(self):
        """Two workers: the lost one cannot rejoin a synchronous step, so the job restarts as a whole and ends
        every step (the table updates of two workers interleave, so runs differ: no reference run)."""
        directory = os.path.join(self.get_temp_dir(), "two")
        flags = ["--strategy", "hybrid", "--num_workers", "2", "--num_ps", "1", "--steps", "30"]
        procs = self._start(flags, directory)
        try:
            self._wait_for(procs, os.path.join(directory, "ckpt-15.index"))
            os.kill(self._started_by(procs[0], "tf_sharded train"), signal.SIGKILL)
            out = self._finish(procs)
        finally:
            self._kill(procs)
        self.assertRegex(self._stderr, r"(?m)^restarting: the local hybrid cluster's worker 1 ended \(exit code "
                                       r"-9\); the job restarts from --checkpoint_dir \(restart 1 of 3\)$")  # fmt: skip
        this_run = int(
            re.search(r"30 steps \((\d+) this run\)", summary(subprocess.CompletedProcess([], 0, out, ""))).group(1)
        )
        self.assertBetween(30 - this_run, 15, 29)  # resumed from a checkpoint at or after the one waited for
        self.assertGreater(float(re.search(r"held-out AUC (\d\.\d{4})", out).group(1)), 0.6)

    @staticmethod
    def _started_by(proc, command: str) -> int:
        """The one process `proc` started whose command line has `command`."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline") as f:
                    line = f.read().replace("\0", " ")
            except OSError:
                continue
            if parent == proc.pid and command in line:
                found.append(int(pid))
        assert len(found) == 1, (command, found)
        return found[0]

    def _start(self, flags, directory):
        """The run's process (its local cluster's other processes are its own)."""
        return [
            subprocess.Popen([sys.executable, "-m", "tf_sharded", "train", *flags, *self.COMMON,
                              "--checkpoint_dir", directory], cwd=ROOT,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=network())
        ]  # fmt: skip

    def _finish(self, procs) -> str:
        """The chief's output once every process ended well (its stderr: `self._stderr`)."""
        outputs = []
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=300)
                self.assertEqual(proc.returncode, 0, err[-3000:])
                outputs.append((out, err))
        finally:
            self._kill(procs)
        self._stderr = outputs[0][1]
        return outputs[0][0]

    def _wait_for(self, procs, path):
        deadline = time.time() + 240
        while not os.path.exists(path) and time.time() < deadline:
            self.assertTrue(all(p.poll() is None for p in procs), "the run ended before it could be killed")
            time.sleep(0.05)

    @staticmethod
    def _kill(procs):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    def _kill_and_resume(self, flags, steps, kill_after, kill=None, restarts=False):
        """`kill` (default: SIGKILL to every process) once checkpoint `kill_after` is written, then the run
        rerun, or (`restarts`) the same command left to restart itself; either ends as an uninterrupted run."""
        whole, killed = (os.path.join(self.get_temp_dir(), name) for name in ("whole", "killed"))
        uninterrupted = self._finish(self._start(flags, whole))

        procs = self._start(flags, killed)
        try:
            self._wait_for(procs, os.path.join(killed, f"ckpt-{kill_after}.index"))
            if kill is not None:
                kill(procs)
            resumed = self._finish(procs) if restarts else None
        finally:
            self._kill(procs)
        if resumed is None:
            done = int(tf.train.latest_checkpoint(killed).rsplit("-", 1)[1])
            resumed = self._finish(self._start(flags, killed))
        else:  # the step the restarted command resumed from
            done = steps - int(re.search(rf"{steps} steps \((\d+) this run\)", resumed).group(1))
        self.assertBetween(done, kill_after - 15, kill_after + 15)  # killed mid-run (the last one may be unrecorded)
        self.assertLess(done, steps)
        self.assertIn(f"{steps} steps ({steps - done} this run)", resumed)
        a, b = (tf.train.load_checkpoint(tf.train.latest_checkpoint(d)) for d in (whole, killed))
        entries = [k for k in a.get_variable_to_shape_map() if k.startswith("model/") and "tables_" in k]
        tables = sorted({k.split("/.ATTRIBUTES/")[0] for k in entries})
        self.assertLen(tables, 26)
        for table in tables:
            attribute = f"{table}/.ATTRIBUTES/"
            if attribute + "keys" not in entries:
                value = attribute + "VARIABLE_VALUE"
                self.assertAllClose(b.get_tensor(value), a.get_tensor(value), atol=1e-5, msg=table)
                continue
            # A dynamic table: its live keys (in any order) with their rows and counters.
            order = [np.argsort(r.get_tensor(attribute + "keys")) for r in (a, b)]
            keys = [r.get_tensor(attribute + "keys")[o].tolist() for r, o in zip((a, b), order)]
            self.assertEqual(keys[1], keys[0], msg=table)
            for name in ("values", "seen", "hits"):
                want, got = (r.get_tensor(attribute + name)[o] for r, o in zip((a, b), order))
                self.assertAllClose(got, want, atol=1e-5, msg=f"{table} {name}")
            self.assertEqual(b.get_tensor(attribute + "step"), a.get_tensor(attribute + "step"))
        # Only the chief's checkpoints are left in the directory.
        self.assertEqual([f for f in os.listdir(killed) if f.startswith("workertemp")], [])
        auc = [float(re.search(r"held-out AUC (\d\.\d{4})", out).group(1)) for out in (uninterrupted, resumed)]
        self.assertAllClose(auc[1], auc[0], atol=2e-4)
        self.assertGreater(auc[0], 0.6)


class ReadmeWorkedExampleTest(tf.test.TestCase):
    """The README's worked example, its lines run as written in a fresh directory."""

    def test_readme_worked_example(self):
        with open(os.path.join(ROOT, "README.md")) as f:
            readme = f.read()
        block = readme.split("<!-- worked-example")[1].split("<!-- /worked-example -->")[0]
        lines = [line for line in block.splitlines() if line.startswith("python -m tf_sharded")]
        self.assertLen(lines, 5)
        cwd = self.get_temp_dir()
        outputs = []
        for line in lines:
            proc = subprocess.run(
                [sys.executable, *shlex.split(line)[1:]],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=400,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
            )
            self.assertEqual(proc.returncode, 0, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            outputs.append(proc.stdout)
        with open(os.path.join(cwd, "ratings.schema.json")) as f:
            inferred = {f["name"]: f["type"] for f in json.load(f)["features"]}
        self.assertEqual(inferred, {"user_id": "categorical", "movie_id": "categorical", "genres": "multi_hot",
                                    "age": "categorical"})  # fmt: skip
        self.assertIn("200 steps (200 this run)", summary(subprocess.CompletedProcess([], 0, outputs[2], "")))
        self.assertIn("300 steps (100 this run)", summary(subprocess.CompletedProcess([], 0, outputs[3], "")))
        # Learned: well below the label's variance (the README quotes the range on this machine).
        mse = float(re.search(r"held-out MSE (\d+\.\d{4})", outputs[2]).group(1))
        with open(os.path.join(cwd, "ratings", "ratings.csv")) as f:
            ratings = np.array([float(line.split(",")[0]) for line in f.readlines()[1:]])
        self.assertLess(mse, 0.4 * np.var(ratings[: 20 * 512]))
        self.assertIn("tables_genres", outputs[4])
