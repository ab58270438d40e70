"""Local clusters answer on their own loopback only: `python -m tf_sharded` runs move into a network namespace.

This process stays on the machine's network, so it sees what another machine
would: no port of a run's cluster listens here, and connecting to one from this
machine's own addresses is refused.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.subprocs import ROOT
from tf_sharded import isolation


def _namespaces_work() -> str:
    """ "" where this machine lets a process enter a user and network namespace, else why not."""
    try:
        subprocess.run(["true"], preexec_fn=_enter_or_fail, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    return ""


def _enter_or_fail():
    reason = isolation.enter()
    if reason:
        raise OSError(reason)


def _listening(net_dir: str) -> set:
    """The TCP ports in LISTEN state in the network namespace that `net_dir` (a /proc/.../net) shows."""
    ports = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(net_dir, name)) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


class CommandTest(tf.test.TestCase):
    @pytest.mark.slow  # a training run of the command
    @pytest.mark.timeout(300)
    def test_a_training_runs_cluster_cannot_be_reached_from_this_machines_network(self):
        why = _namespaces_work()
        if why:
            self.skipTest(f"no user and network namespaces here: {why}")
        flags = ["--steps", "100000", "--steps_per_epoch", "50", "--batch_size", "64", "--max_vocab", "1000",
                 "--eval_steps", "1", "--verbose", "0"]  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "tf_sharded", "train", *flags],  # the default strategy: a local cluster
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            theirs = f"/proc/{proc.pid}/net"
            deadline = time.monotonic() + 180
            ports = set()
            while len(ports) < 5 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.5)
                ports = _listening(theirs)  # 2 ps, 2 workers and the coordinator
            self.assertGreaterEqual(len(ports), 5, f"the run's cluster did not start: {proc.poll()}")
            self.assertNotEqual(os.readlink(f"/proc/{proc.pid}/ns/net"), os.readlink("/proc/self/ns/net"))
            self.assertFalse(ports & _listening("/proc/self/net"), "a task listens on this machine's network")
            addresses = [a.split()[1] for a in isolation.exposed_addresses() if a.split()[1] != "?"]
            print(f"the cluster's ports {sorted(ports)}; tried from 127.0.0.1 and {addresses or 'no other address'}")
            for port in ports:
                for host in ["127.0.0.1", *addresses]:
                    self.assertTrue(_refused(host, port), f"{host}:{port} accepted a connection")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
        self.assertNotIn("warning: the local cluster", err)

    @pytest.mark.slow  # starts a Python process with TensorFlow
    def test_required_isolation_is_refused_in_one_line_where_the_run_needs_the_network(self):
        url = "gs://a-bucket/clicks"
        done = subprocess.run(
            [sys.executable, "-m", "tf_sharded", "train", "--data", url, "--local_cluster_isolation", "required"],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"},  # as a user runs it
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(done.returncode, 2, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        if not isolation.exposed_addresses():
            self.skipTest("this machine has no network beyond its loopback: nothing to refuse")
        self.assertLen(lines, 1, done.stderr)
        self.assertTrue(lines[0].startswith("error: --local_cluster_isolation required: "), lines[0])
        self.assertIn(f"{url} needs the network", lines[0])


# Runs `tf_sharded/isolation.py` loaded by path in a process with one thread (no TensorFlow), as the
# package runs it before TensorFlow loads: argv[1] "works" moves for real, "fails" with an `enter` that fails.
TRIAL = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("isolation", sys.argv[2])
isolation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(isolation)
if sys.argv[1] == "fails":
    isolation.enter = lambda: "no capabilities in the new user namespace"
before = os.readlink("/proc/self/ns/net")
isolation.enter_for_command(["train"])
print(before != os.readlink("/proc/self/ns/net"), isolation._not_isolated_because, isolation.exposed_addresses())
"""


class DecisionTest(tf.test.TestCase):
    def test_a_run_moves_only_after_a_copy_of_it_did(self):
        path = isolation.__file__
        works = subprocess.run([sys.executable, "-c", TRIAL, "works", path], capture_output=True, text=True, timeout=60)
        self.assertEqual(works.returncode, 0, works.stderr)
        why = _namespaces_work()
        if why:
            self.assertEqual(works.stdout.split()[0], "False")  # it stayed, and says why
        else:
            self.assertEqual(works.stdout.strip(), "True None []")  # moved: nothing but its loopback
        fails = subprocess.run([sys.executable, "-c", TRIAL, "fails", path], capture_output=True, text=True, timeout=60)
        self.assertEqual(fails.stdout.strip().split(" ", 1)[0], "False", fails.stderr)
        self.assertIn("no capabilities in the new user namespace", fails.stdout)

    def test_which_runs_move_into_a_namespace_of_their_own(self):
        for argv in (["train"], ["train", "--steps", "5"], ["demo"], ["bench", "ps", "--quick"]):
            self.assertEqual(isolation.decide(argv, {}), "enter", argv)
        for argv, environ in (
            (["inspect", "ckpt"], {}),  # starts no cluster
            (["bench", "report"], {}),
            (["data", "synthesize", "--format", "tsv"], {}),
            (["train"], {"TF_CONFIG": "{}"}),  # the cluster is on the machines TF_CONFIG names
        ):
            self.assertEqual(isolation.decide(argv, environ), "", argv)
        self.assertEqual(isolation.decide(["train", "--local_cluster_isolation", "none"], {}), f"{isolation.FLAG} none")
        self.assertEqual(isolation.decide(["train"], {isolation.ENV: "none"}), f"{isolation.FLAG} none")
        self.assertEqual(isolation.decide(["train", "--local_cluster_isolation=required"], {isolation.ENV: "none"}),
                         "enter")  # fmt: skip
        self.assertIn("gs://b/d needs the network", isolation.decide(["train", "--data", "gs://b/d"], {}))

    def test_a_cluster_started_on_this_machines_network_warns_or_is_refused(self):
        # This process runs TensorFlow on the machine's network: it cannot move, so a cluster here is exposed.
        exposed = isolation.exposed_addresses()
        if not exposed:
            self.skipTest("this machine has no network beyond its loopback")
        warning = isolation.check("auto", [1234, 5678])
        self.assertLen(warning.splitlines(), 1)
        self.assertStartsWith(warning, "warning: the local cluster's ports 1234, 5678 accept connections from")
        self.assertIn(exposed[0], warning)
        self.assertIn("isolation='required' refuses to start it", warning)
        self.assertIsNone(isolation.check("none", [1234]))
        cluster = tfs.cluster.LocalCluster(1, 1, mode="process", isolation="required")
        with self.assertRaisesRegex(RuntimeError, r"^isolation='required': this process's network reaches other"):
            cluster.start()
        self.assertEqual(cluster.pids, [])  # nothing started
        with self.assertRaisesRegex(ValueError, r"Argument `isolation` must be one of \('auto', 'required', 'none'\)"):
            tfs.cluster.LocalCluster(1, 1, isolation="loopback")
