"""`make demo` runs end to end: trains, reshards a checkpoint, exits 0."""

import tensorflow as tf

from tests.subprocs import run_python


class DemoTest(tf.test.TestCase):
    def test_demo_runs(self):
        proc = run_python(["-m", "tf_sharded", "demo"])
        self.assertEqual(proc.returncode, 0, msg=proc.stdout + proc.stderr[-3000:])
        self.assertIn("rows match = True", proc.stdout)
        self.assertIn("checkpoint resharded 4 -> 3 (OK)", proc.stdout)

    def test_cli_usage(self):
        proc = run_python(["-m", "tf_sharded", "nope"], timeout=120)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("unknown command 'nope'", proc.stderr)


if __name__ == "__main__":
    tf.test.main()
