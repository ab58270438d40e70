"""Local clusters: one OS process per task, cleaned up on exit and on error."""

import os
import textwrap

import psutil
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.subprocs import run_python

pytestmark = [pytest.mark.ps_cluster, pytest.mark.slow]


SCRIPT = textwrap.dedent(
    """
    import socket, sys, numpy as np, tensorflow as tf, tf_sharded as tfs
    RETRIES = tuple(int(v) for v in tf.__version__.split(".")[:2]) >= (2, 17)
    cluster = tfs.cluster.LocalCluster(num_workers=1, num_ps=2, mode="process").start()
    print("PIDS", *cluster.pids, flush=True)
    import psutil
    for (job, index), pid in sorted(cluster.task_pids().items()):
        environ = psutil.Process(pid).environ()
        print("ENV", job, index, environ.get("TF_ENABLE_ONEDNN_OPTS", "-"), environ.get("MALLOC_MMAP_THRESHOLD_", "-"),
              flush=True)
    # A port another process took: the coordinator's gRPC server cannot start there, so it connects again on
    # a newly picked one (TensorFlow 2.16 ends the process with SIGSEGV there instead, so not on 2.16).
    if RETRIES:
        taken = socket.socket()
        taken.bind(("", 0))
        taken.listen()
        cluster.chief_port = taken.getsockname()[1]
    strategy = cluster.strategy()
    if RETRIES:
        print("CHIEF", cluster.chief_port != taken.getsockname()[1], flush=True)
    coordinator = cluster.coordinator(strategy)
    values = np.arange(20, dtype=np.float32).reshape(10, 2)
    with strategy.scope():
        table = strategy.create_sharded_variable("t", [10, 2], initializer=values, scheme="mod")

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tfs.embedding_lookup(table, ids))
        for v, g in zip(table.variables, tape.gradient(loss, list(table.variables))):
            v.scatter_sub(g)
        return loss

    coordinator.schedule(step, args=(tf.constant([1, 1, 8]),))
    coordinator.join()
    want = values.copy(); want[1] -= 2; want[8] -= 1
    assert np.array_equal(table.numpy(), want), table.numpy()
    print("DEVICES", *sorted(set(table.devices)), flush=True)
    if sys.argv[1] == "fail":
        raise RuntimeError("boom")
    cluster.stop()
    print("DONE", flush=True)
    """
)


def run_script(mode):
    return run_python(["-c", SCRIPT, mode], timeout=240)


class ProcessClusterTest(tf.test.TestCase):
    def check(self, mode):
        proc = run_script(mode)
        pids = [int(p) for line in proc.stdout.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
        self.assertLen(pids, 3, msg=proc.stdout + proc.stderr[-3000:])
        self.assertIn(
            "DEVICES /job:ps/replica:0/task:0/device:CPU:0 /job:ps/replica:0/task:1/device:CPU:0", proc.stdout
        )
        for pid in pids:
            alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            self.assertFalse(alive, msg=f"task {pid} outlived the cluster ({mode})")
        return proc

    def test_trains_and_stops(self):
        proc = self.check("ok")
        self.assertEqual(proc.returncode, 0, msg=proc.stderr[-3000:])
        self.assertIn("DONE", proc.stdout)
        if tuple(int(v) for v in tf.__version__.split(".")[:2]) >= (2, 17):  # see SCRIPT
            self.assertIn("CHIEF True", proc.stdout)
        # Parameter servers run with tfs.cluster.PS_ENV (no oneDNN, a 1 MB mmap threshold); the worker keeps the
        # caller's setting.
        lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("ENV")]
        env = {tuple(words[1:3]): words[3:] for words in lines}
        settings = [tfs.cluster.PS_ENV["TF_ENABLE_ONEDNN_OPTS"], tfs.cluster.PS_ENV["MALLOC_MMAP_THRESHOLD_"]]
        self.assertEqual(settings, ["0", "1048576"])
        self.assertEqual(env[("ps", "0")], settings)
        self.assertEqual(env[("ps", "1")], settings)
        self.assertEqual(env[("worker", "0")][0], os.environ.get("TF_ENABLE_ONEDNN_OPTS", "-"))

    def test_tasks_are_cleaned_up_when_the_coordinator_fails(self):
        proc = self.check("fail")
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("boom", proc.stderr)


class ClusterArgumentTest(tf.test.TestCase):
    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "Argument `mode` must be one of"):
            tfs.cluster.LocalCluster(mode="threads")
        with self.assertRaisesRegex(ValueError, "Argument `num_ps` must be a positive integer. Received: num_ps=0"):
            tfs.cluster.LocalCluster(num_ps=0)

    def test_one_inprocess_cluster_per_process(self):
        cluster = tfs.cluster.local_cluster(num_workers=2, num_ps=2)
        self.assertIs(tfs.cluster.local_cluster(num_workers=2, num_ps=2), cluster)
        with self.assertRaisesRegex(ValueError, "already runs an in-process cluster"):
            tfs.cluster.local_cluster(num_workers=1, num_ps=3)


if __name__ == "__main__":
    tf.test.main()
