"""`make demo` runs end to end: trains, reshards a checkpoint, exits 0."""

import os
import subprocess
import sys

import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DemoTest(tf.test.TestCase):
    def test_demo_runs(self):
        proc = subprocess.run(
            [sys.executable, "-m", "tf_sharded", "demo"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        self.assertEqual(proc.returncode, 0, msg=proc.stdout + proc.stderr[-3000:])
        self.assertIn("rows match = True", proc.stdout)
        self.assertIn("checkpoint resharded 4 -> 3 (OK)", proc.stdout)

    def test_cli_usage(self):
        proc = subprocess.run([sys.executable, "-m", "tf_sharded", "nope"], capture_output=True, text=True, cwd=ROOT)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("unknown command 'nope'", proc.stderr)


if __name__ == "__main__":
    tf.test.main()
