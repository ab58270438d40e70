"""A killed job leaves nothing running: the tasks its local cluster started end with it (`tf_sharded.lifetime`).

The job is the application as a user starts it, `python -m tf_sharded train
--local_cluster process`, killed with SIGKILL once it is training (what an
out-of-memory killer or a scheduler does), and its hybrid and multi-worker counterparts.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import tensorflow as tf

from tests.harness.subprocs import ROOT, _env, network
from tf_sharded import lifetime

pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=40), pytest.mark.timeout(600)]


class KilledJobTest(tf.test.TestCase):
    def kill_while_training(self, args, tasks: int):
        """Starts `python -m tf_sharded train ARGS`, waits until it trains with `tasks` processes under it,
        kills it with SIGKILL, and checks every one of them ends."""
        proc = subprocess.Popen([sys.executable, "-m", "tf_sharded", "train", *args], cwd=ROOT, env=_env(None),
                                preexec_fn=network(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        output = bytearray()

        def read():
            for chunk in iter(lambda: proc.stdout.read1(), b""):
                output.extend(chunk)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        children = []
        try:
            deadline = time.monotonic() + 300
            while b"samples/s" not in output:  # the progress bar: steps are running
                self.assertIsNone(proc.poll(), msg=output.decode(errors="replace")[-3000:])
                self.assertLess(time.monotonic(), deadline, msg=output.decode(errors="replace")[-3000:])
                time.sleep(0.5)
            children = psutil.Process(proc.pid).children(recursive=True)
            self.assertGreaterEqual(len(children), tasks)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            gone, alive = psutil.wait_procs(children, timeout=30)
            self.assertEmpty(alive, msg=f"left running after kill -9: {[p.cmdline() for p in alive]}")
        finally:
            if proc.poll() is None:
                proc.kill()
            for child in children:  # whatever the check found running, so that no later test meets it
                if child.is_running():
                    child.kill()

    def test_a_killed_parameter_server_job_leaves_no_task_running(self):
        self.kill_while_training(["--local_cluster", "process", "--steps", "3000"], tasks=4)

    def test_a_killed_hybrid_job_leaves_no_table_server_or_worker_running(self):
        self.kill_while_training(["--strategy", "hybrid", "--steps", "3000"], tasks=3)

    def test_a_killed_multi_worker_job_leaves_no_worker_running(self):
        self.kill_while_training(["--strategy", "multi_worker", "--num_workers", "2", "--steps", "3000"], tasks=1)

    def test_a_process_not_started_by_a_cluster_does_not_watch_its_parent(self):
        script = "import threading; from tf_sharded import lifetime; lifetime.exit_with_parent(); "
        script += "print(threading.active_count())"
        proc = subprocess.run([sys.executable, "-c", script], env={k: v for k, v in _env(None).items()
                                                                 if k != lifetime.PARENT_ENV},
                              capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
        self.assertEqual(proc.stdout.strip(), "1")
