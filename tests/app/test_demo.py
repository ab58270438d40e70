"""The walkthrough (`tf_sharded demo`) and the main job's default (`make demo`) run end to end."""

import re

import pytest
import tensorflow as tf

from tests.harness.subprocs import run_python

pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=30)]  # the demo and the main job, end to end


class DemoTest(tf.test.TestCase):
    def test_demo_runs(self):
        proc = run_python(["-m", "tf_sharded", "demo"])
        self.assertEqual(proc.returncode, 0, msg=proc.stdout + proc.stderr[-3000:])
        self.assertIn("rows match = True", proc.stdout)
        self.assertIn("checkpoint resharded 4 -> 3 (OK)", proc.stdout)

    def test_main_job_default_learns(self):
        # What `make demo` runs: DLRM, synthetic data, a local 2 ps + 2 worker cluster, 200 steps of 512.
        proc = run_python(["-m", "tf_sharded", "train", "--verbose", "0"], timeout=600)
        self.assertEqual(proc.returncode, 0, msg=proc.stdout + proc.stderr[-3000:])
        auc = float(re.search(r"held-out AUC (\d\.\d+)", proc.stdout).group(1))
        self.assertGreaterEqual(auc, 0.70, proc.stdout)
        self.assertIn("dlrm | parameter_server (local cluster: 2 ps, 2 workers) | 200 steps", proc.stdout)

    def test_cli_usage(self):
        proc = run_python(["-m", "tf_sharded", "nope"], timeout=120)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("unknown command 'nope'", proc.stderr)


if __name__ == "__main__":
    tf.test.main()
