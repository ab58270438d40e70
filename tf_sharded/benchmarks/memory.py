"""B3: resident memory of every task while training tables of known size on parameter servers.

A cluster of 2 ps + 1 worker, one OS process per task. The 26 Criteo-Kaggle
tables (capped at `max_vocab` rows, dim 16) in a `tfs.layers.EmbeddingCollection`
(2 shards per table) with `tfs.optimizers.Adagrad` (one slot per table) are
created and trained for a few steps scheduled on the worker. Each process's
resident set size (RSS, psutil) is read before the tables exist and after
training; the growth is compared with what the process should hold:

* each ps: the bytes of its shards x (1 + slots), target within 15%;
* the worker: target at most 5% of the table bytes (it holds no table).

    python -m tf_sharded bench memory [--quick]
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np

DIM = 16
BATCH = 512


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def run(quick: bool = False) -> Dict:
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded import data
    from tf_sharded.benchmarks.ps_lookup import _ids

    max_vocab = 50_000 if quick else 1_000_000
    vocab = data.vocab_sizes(max_vocab)
    keys = data.CATEGORICAL_KEYS
    cluster = tfs.cluster.LocalCluster(num_workers=1, num_ps=2, mode="process").start()
    try:
        strategy = cluster.strategy()
        coordinator = cluster.coordinator(strategy)
        pids = cluster.task_pids()

        # Warm the runtime up (a scheduled step with a small variable) before the baseline.
        with strategy.scope():
            warm = tf.Variable(tf.zeros([4, DIM]))
        coordinator.schedule(tf.function(lambda: strategy.run(lambda: tf.reduce_sum(warm))))
        coordinator.join()
        before = {task: _rss(pid) for task, pid in pids.items()}

        tables = {
            k: {"input_dim": v, "output_dim": DIM, "partitions": 2, "seed": i}
            for i, (k, v) in enumerate(zip(keys, vocab))
        }
        with strategy.scope():
            layer = tfs.layers.EmbeddingCollection(tables, {k: k for k in keys})
            layer.build()
            optimizer = tfs.optimizers.Adagrad(0.05)
            optimizer.build(layer.trainable_variables)

        @tf.function
        def step(ids):
            def fn(ids):
                with tf.GradientTape() as tape:
                    out = layer(ids)
                    loss = tf.add_n([tf.reduce_sum(tf.square(out[k])) for k in keys])
                grads = tape.gradient(loss, layer.trainable_variables)
                optimizer.apply_gradients(zip(grads, layer.trainable_variables))
                return loss

            return strategy.run(fn, args=(ids,))

        rng = np.random.default_rng(0)
        for _ in range(3 if quick else 10):
            ids = {k: tf.constant(_ids(rng, "power_law", v, BATCH)) for k, v in zip(keys, vocab)}
            coordinator.schedule(step, args=(ids,))
        coordinator.join()
        after = {task: _rss(pid) for task, pid in pids.items()}

        table_bytes = sum(v * DIM * 4 for v in vocab)
        slots = 1
        held = {task: 0 for task in pids}
        for table in layer.tables.values():
            for v in table.variables:
                spec = tf.DeviceSpec.from_string(v.device)
                held[(spec.job, spec.task)] += int(np.prod(v.shape)) * 4 * (1 + slots)
        rows = []
        for task in sorted(pids):
            growth = after[task] - before[task]
            row = {
                "job": task[0],
                "task": task[1],
                "rss_before_mb": before[task] / 2**20,
                "rss_after_mb": after[task] / 2**20,
                "growth_mb": growth / 2**20,
                "expected_mb": held[task] / 2**20,
            }
            if task[0] == "ps":
                row["growth_vs_expected"] = growth / held[task]
            else:
                row["growth_vs_table_bytes"] = growth / table_bytes
            rows.append(row)
        return {
            "benchmark": "memory",
            "mode": "process",
            "quick": quick,
            "table_mb": table_bytes / 2**20,
            "slots_per_table": slots,
            "results": rows,
        }
    finally:
        cluster.stop()


def format_rows(report: Dict) -> List[str]:
    lines = [
        f"B3 memory (tables {report['table_mb']:.0f} MB + {report['slots_per_table']} slot): {'task':>8} | "
        f"{'before':>9} {'after':>9} {'growth':>9} {'expected':>9} | ratio"
    ]
    for r in report["results"]:
        ratio = r.get("growth_vs_expected", r.get("growth_vs_table_bytes"))
        what = "growth/expected" if "growth_vs_expected" in r else "growth/table"
        lines.append(
            f"{'':>42}{r['job'] + ':' + str(r['task']):>8} | {r['rss_before_mb']:>7.0f}MB {r['rss_after_mb']:>7.0f}MB "
            f"{r['growth_mb']:>7.0f}MB {r['expected_mb']:>7.0f}MB | {ratio:.3f} ({what})"
        )
    return lines
