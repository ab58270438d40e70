"""Fault injection: tasks killed with SIGKILL on process-per-task clusters, checked against uninterrupted runs.

Each run is `tf_sharded/benchmarks/fault_job.py` in its own process (a client connects
to one cluster per process), the runs of a test at once. The application killed mid-run
and rerun is `tests/app/test_app.py::KillAndResumeTest`.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.harness.subprocs import ROOT, _env, run_python, run_python_together

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.processes(cost=225)]

TOTAL = 300  # fault_job: 2 epochs of 150 steps


def _launch(test, *variants):
    """Runs `fault_job` once per flag list, all at once: `(process, result or None)` per run."""
    outs = [os.path.join(test.get_temp_dir(), f"run{i}.json") for i in range(len(variants))]
    job = ["-m", "tf_sharded.benchmarks.fault_job"]
    procs = run_python_together([[*job, out, *v] for out, v in zip(outs, variants)], 420)
    return [(proc, _read(out) if os.path.exists(out) else None) for proc, out in zip(procs, outs)]


def _traceback(stderr: str) -> str:
    """The last traceback in a run's stderr (TensorFlow's connection warnings follow it)."""
    start = stderr.rfind("Traceback (most recent call last)")
    return stderr[start : start + 6000] if start >= 0 else stderr[-4000:]


def _read(path):
    with open(path) as f:
        return json.load(f)


def _runs(test, *variants):
    """`_launch` for runs that must succeed: `(result, stdout)` per run."""
    out = []
    for proc, result in _launch(test, *variants):
        test.assertEqual(proc.returncode, 0, _traceback(proc.stderr))
        out.append((result, proc.stdout))
    return out


class ParameterServerFailureTest(tf.test.TestCase):
    def test_the_recovery_benchmark_restores_a_killed_ps_to_where_an_uninterrupted_run_ends(self):
        # B8 (`bench recovery --quick`): an uninterrupted run, then one with ps:1 killed, one after the other.
        out = self.get_temp_dir()
        proc = run_python(["-m", "tf_sharded", "bench", "recovery", "--quick", "--out", out], 480)
        self.assertEqual(proc.returncode, 0, proc.stdout + _traceback(proc.stderr))
        self.assertIn("B8 recovery", proc.stdout)
        self.assertGreater(os.path.getsize(os.path.join(out, "recovery.png")), 1000)
        (row,) = _read(os.path.join(out, "recovery.json"))["results"]
        self.assertEqual(row["steps"], [TOTAL, TOTAL])  # every step counted once
        self.assertEqual(row["iterations"], [TOTAL, TOTAL])
        self.assertIn(["ps", 1], row["restarts"][0])
        (event,) = row["events"]
        self.assertEqual(event["tasks"], [1])
        self.assertLessEqual(event["restored"], event["failed_at"])
        self.assertEqual(event["restored"] % 50, 0)  # a checkpoint_every=50 checkpoint
        self.assertEqual(
            row["printed"], [f"ps:1 failed at step {event['failed_at']}; restored ckpt-{event['restored']}; resuming"]
        )
        self.assertEqual(row["steps_redone"], event["failed_at"] - event["restored"])
        self.assertGreater(row["recovery_s"], 0)
        self.assertGreater(row["restart_s"], 0)
        self.assertGreater(row["wait_s"], 0)
        self.assertAllClose(row["wait_s"] + row["resume_s"], row["recovery_s"])
        self.assertAllClose(row["restart_vs_resume"], row["restart_s"] / row["resume_s"])
        # Restored from the checkpoint and the input resumed at the batch after it (one worker): the same steps
        # on the same batches, so the same weights.
        self.assertLessEqual(row["max_weight_difference"], 1e-6)

    def test_a_killed_ps_holding_the_step_count_and_dynamic_table_shards_is_restored_exactly(self):
        # ps:0 holds the step count, the tables' steps and a shard of each of the two dynamic tables (their
        # indexes, and the row pool they share: rows, Adagrad column, last-seen steps): all renewed, emptied
        # and restored table by table into the one pool, the other shards restored beside them.
        # Beside them, ps:1 killed where the first error names no task (a retried step's input iterator ends
        # with OutOfRangeError): the failed ps is found by asking each ps for its state.
        (whole, _), (killed, printed), (unnamed, unnamed_printed) = _runs(
            self,
            ["--dynamic"],
            ["--dynamic", "--kill", "ps:0", "--after", "0.5"],
            ["--dynamic", "--kill", "ps:1", "--unnamed_errors"],
        )
        self.assertEqual([len(whole["weights"][f"keys_{n}"]) for n in ("a", "b")], [60, 60])
        for run, output, task in ((killed, printed, 0), (unnamed, unnamed_printed, 1)):
            self.assertEqual((run["steps"], run["iterations"]), (TOTAL, TOTAL))
            self.assertEqual([e["tasks"] for e in run["recoveries"]], [[task]])
            self.assertRegex(output, rf"ps:{task} failed at step \d+; restored ckpt-\d+; resuming")
            for name, value in whole["weights"].items():
                self.assertAllClose(run["weights"][name], value, atol=1e-6, msg=(task, name))


class WorkerFailureTest(tf.test.TestCase):
    def test_a_killed_worker_rejoins_and_steps_count_once(self):
        # One worker: the run can only finish if the restarted worker rejoins. Two workers: it continues on
        # the other. Either way a step whose worker died is run again, and counted once.
        (alone, _), (whole, _) = _runs(self, ["--kill", "worker:0"], [])
        # Beside the two-worker run: a ps failure that tfs.fit is told not to recover from, or cannot.
        (two, pair), (off, _), (unsaved, _) = _launch(
            self, ["--kill", "worker:1", "--workers", "2"], ["--kill", "ps:1", "--max_restarts", "0"],
            ["--kill", "ps:1", "--no_checkpoints", "--unnamed_errors"],
        )  # fmt: skip
        self.assertEqual(two.returncode, 0, _traceback(two.stderr))
        for result in (alone, pair):
            self.assertEqual(result["steps"], TOTAL)
            self.assertEqual(result["iterations"], TOTAL)
            self.assertEqual(result["recoveries"], [])  # no restore: the coordinator reschedules
        self.assertIn(["worker", 0], alone["restarts"])
        self.assertIn(["worker", 1], pair["restarts"])
        # The rescheduled step ran again after its first run may have applied part of its update (TensorFlow
        # runs a closure at least once): close to, not equal to, the uninterrupted run.
        for name, value in whole["weights"].items():
            self.assertAllClose(alone["weights"][name], value, atol=0.05, msg=name)
        for proc, reason in (
            (off, r"max_restarts=0 restarts already used: rerun with the same checkpoint_dir"),
            (
                unsaved,
                r"tfs.fit was given no checkpoint_dir, so there is nothing to restore: rerun with checkpoint_dir",
            ),
        ):
            self.assertNotEqual(proc.returncode, 0)
            # Without a recovery nothing asks which task lost its state: the tasks the error names (ps:1 among them).
            named = r"(ps:\d, )*ps:1(, ps:\d)*"
            self.assertRegex(_traceback(proc.stderr), r"RuntimeError: " + named + r" failed at step \d+; " + reason)


SAVER = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras, tensorflow as tf, tf_sharded as tfs
from tf_sharded.keras.training.checkpoints import Checkpoints
inp = keras.Input((2,), dtype="int64")
model = keras.Model(inp, keras.layers.Dense(1)(tfs.layers.Embedding(2000, 64, partitions=3, combiner="sum")(inp)))
model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
model.optimizer.build(model.trainable_variables)
checkpoints = Checkpoints(model, sys.argv[1])
step = int(model.optimizer.iterations.numpy())
slot = model.optimizer.table_slot(model.layers[1].embeddings, "accumulator")
print("ready", flush=True)
while True:
    step += 1
    for v in model.variables + model.optimizer.variables + list(slot.variables):
        v.assign(tf.fill(v.shape, tf.cast(step, v.dtype)))
    checkpoints.save(step)
"""


class KillDuringSaveTest(tf.test.TestCase):
    def test_a_kill_at_any_moment_of_a_save_leaves_a_restorable_consistent_checkpoint(self):
        directory = os.path.join(self.get_temp_dir(), "ckpt")
        rng = random.Random(0)
        last = 0
        for _ in range(4):
            proc = subprocess.Popen(
                [sys.executable, "-c", SAVER, directory], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env(None)
            )
            self.assertEqual(proc.stdout.readline().strip(), "ready")
            time.sleep(rng.uniform(0.5, 2.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            latest = tf.train.latest_checkpoint(directory)
            self.assertIsNotNone(latest)
            step = int(latest.rsplit("-", 1)[1])
            self.assertGreaterEqual(step, last)  # each restart continued from the checkpoint it found
            last = step
            reader = tf.train.load_checkpoint(latest)
            names = [k for k in reader.get_variable_to_shape_map() if k.endswith("VARIABLE_VALUE")]
            names = [k for k in names if not k.startswith("save_counter")]  # saves by this process, not steps
            self.assertGreater(len(names), 5)
            # Every variable, tables and their slots included, holds the value of the one save it belongs to.
            for name in names:
                self.assertTrue(np.all(reader.get_tensor(name) == step), (name, step))
            with open(os.path.join(directory, "tf_sharded_layout.json")) as f:
                self.assertIn("tables", json.load(f))
        self.assertGreater(last, 0)
