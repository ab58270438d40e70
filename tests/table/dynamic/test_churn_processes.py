"""Key churn across processes (`tests/harness/churn.py`): a table sharded over two MultiWorkerMirroredStrategy
workers (`placement="sharded"`), and tables on two hybrid table servers. Each process runs every variant
(int64 and string keys, capacity eviction alone and with age eviction) and checks it as the in-process
strategies are checked in test_churn.py."""

import json

import pytest
import tensorflow as tf

from tests.harness.strategies import TableServers, run_multi_worker
from tests.harness.subprocs import run_python

# Worker processes and table servers.
pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=55), pytest.mark.timeout(1000)]

CHURN = """
import functools, os
import numpy as np, tensorflow as tf
import tf_sharded as tfs
from tests.harness.churn import DIM, LEARNING_RATE, VARIANTS, churn, evictions, variant_name
from tests.harness.strategies import per_replica
from tests.table.dynamic.test_dynamic import train_step

%(strategy)s
check = tf.test.TestCase()
replicas = strategy.num_replicas_in_sync
for key_dtype, ages in VARIANTS:
    with strategy.scope():
        table = strategy.create_dynamic_table(variant_name(key_dtype, ages), DIM, key_dtype=key_dtype, seed=5,
                                              eviction=evictions(ages), %(options)s)
        optimizer = tfs.optimizers.Adagrad(LEARNING_RATE)
    step = train_step(table, optimizer)

    def run(batch):
        size = len(batch) // replicas
        step(per_replica(strategy, [tf.constant(batch[r * size : (r + 1) * size], key_dtype) for r in range(replicas)]))

    churn(check, table, run, key_dtype=key_dtype, ages=ages)
    print("churned", variant_name(key_dtype, ages), int(table.size()), flush=True)
print("CHURN OK", flush=True)
"""

SHARDED = CHURN % {
    "strategy": "strategy = tf.distribute.MultiWorkerMirroredStrategy()\nassert strategy.num_replicas_in_sync == 2",
    "options": 'placement="sharded"',
}
HYBRID = CHURN % {
    "strategy": 'strategy = tfs.hybrid.HybridStrategy(__import__("json").loads(os.environ["SERVERS"]))',
    "options": "partitions=2",
}


class ChurnAcrossProcessesTest(tf.test.TestCase):
    def test_a_table_sharded_over_two_workers_takes_fifty_times_its_capacity(self):
        outputs = run_multi_worker(SHARDED, num_workers=2)
        for rc, out, err in outputs:
            self.assertEqual(rc, 0, msg=out + err[-4000:])
            self.assertIn("CHURN OK", out)
            self.assertEqual(out.count("churned "), 4)

    def test_tables_on_two_table_servers_take_fifty_times_their_capacity(self):
        servers = TableServers(2)
        try:
            proc = run_python(["-c", HYBRID], timeout=900, env={"SERVERS": json.dumps(servers.addresses)})
        finally:
            servers.stop()
        self.assertEqual(proc.returncode, 0, msg=proc.stdout[-3000:] + proc.stderr[-5000:])
        self.assertIn("CHURN OK", proc.stdout)
        self.assertEqual(proc.stdout.count("churned "), 4)


if __name__ == "__main__":
    tf.test.main()
