"""The exchange benchmark runs (`--quick`) and writes the documented JSON schema.

Speed is not checked here: figures come from the benchmark command itself.
"""

import json
import os
import tempfile

import tensorflow as tf

from tests.subprocs import run_python

ROW_KEYS = {
    "distribution",
    "density",
    "ids_per_replica",
    "max_distinct_per_replica",
    "allgather_s",
    "dense_s",
    "auto_s",
    "tf_default_s",
    "auto_chose",
    "bytes_allgather",
    "bytes_dense",
    "bytes_tf_default",
    "auto_vs_best",
    "tf_default_vs_auto",
    "floor_s",
    "tf_default_vs_floor",
}


class ExchangeBenchmarkTest(tf.test.TestCase):
    def test_quick_run_writes_json(self):
        out = tempfile.mkdtemp()
        proc = run_python(["-m", "tf_sharded", "bench", "exchange", "--quick", "--out", out])
        self.assertEqual(proc.returncode, 0, msg=proc.stderr[-3000:])
        with open(os.path.join(out, "exchange.json")) as f:
            report = json.load(f)
        self.assertEqual(report["benchmark"], "exchange")
        self.assertEqual(report["replicas"], 4)
        self.assertLen(report["results"], 2)
        for row in report["results"]:
            self.assertEqual(set(row), ROW_KEYS)
            self.assertGreater(row["tf_default_s"], 0)
            self.assertIn(row["auto_chose"], ("allgather", "dense"))
            self.assertLessEqual(row["max_distinct_per_replica"], row["ids_per_replica"])


if __name__ == "__main__":
    tf.test.main()
