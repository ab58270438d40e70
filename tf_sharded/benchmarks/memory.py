"""B3: resident memory of every process while training tables of known size, on parameter servers and mirrored.

Parameter servers: 2 ps + 1 worker, one OS process per task. The 26
Criteo-Kaggle tables (uncapped: 33,762,577 rows x 16, 2 GiB; capped at 50,000
rows with `--quick`) in a `tfs.layers.EmbeddingCollection` (2 shards per
table) with `tfs.optimizers.Adagrad` (one slot per table) are created and
trained for a few steps scheduled on the worker. Each process's resident set
size (RSS, psutil) is read before the tables exist and after training; the
growth is compared with what the process should hold:

* each ps: the bytes of its shards x (1 + slots), target within 15%;
* the worker: target at most 5% of the table bytes (it holds no table).

Then a checkpoint of tables and slots is written from the coordinator while
each process's RSS is polled every 10 ms: each ps's peak above its RSS
before the save, target at most 10% of the bytes it holds. The time to
create the tables and their slots (`creation_s`) is reported too.

Mirrored: one process, `MirroredStrategy` over 2 logical CPUs, the tables
capped at 1,000,000 rows (340 MiB; 50,000 with `--quick`), the same optimizer
and steps; once tables and slots exist, `placement="host"` should hold one
copy x (1 + slots) and `placement="device"` one per replica (target within
15%); the steps' own growth (the traced, replicated step) is reported apart.
Each placement runs in its own process (with `--quick`, both in one).

    python -m tf_sharded bench memory [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List

import numpy as np

DIM = 16
BATCH = 512


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def _peak_rss_during(pids: Dict, fn) -> Dict:
    """Runs `fn()` while polling the RSS of `pids` every 10 ms: `{task: peak - RSS before}` in bytes."""
    before = {task: _rss(pid) for task, pid in pids.items()}
    peak, done = dict(before), threading.Event()

    def poll():
        while not done.is_set():
            for task, pid in pids.items():
                peak[task] = max(peak[task], _rss(pid))
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        fn()
    finally:
        done.set()
        poller.join()
    for task, pid in pids.items():
        peak[task] = max(peak[task], _rss(pid))
    return {task: peak[task] - before[task] for task in pids}


def _collection_and_step(strategy, tables: Dict):
    """An `EmbeddingCollection` of `tables` (one feature per table) with Adagrad, built in scope: the layer, the
    optimizer and the training step (loss: sum of squares of the looked-up rows)."""
    import tensorflow as tf

    import tf_sharded as tfs

    with strategy.scope():
        layer = tfs.layers.EmbeddingCollection(tables, {k: k for k in tables})
        layer.build()
        optimizer = tfs.optimizers.Adagrad(0.05)
        optimizer.build(layer.trainable_variables)

    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(tf.square(v)) for v in layer(ids).values()])
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))
            return loss

        return strategy.run(fn, args=(ids,))

    return layer, optimizer, step


def run(quick: bool = False) -> Dict:
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.app import data
    from tf_sharded.benchmarks.ps_lookup import _ids

    max_vocab = 50_000 if quick else None
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
        started = time.perf_counter()
        layer, optimizer, step = _collection_and_step(strategy, tables)
        creation_s = time.perf_counter() - started
        rng = np.random.default_rng(0)
        for _ in range(3 if quick else 10):
            ids = {k: tf.constant(_ids(rng, "power_law", v, BATCH)) for k, v in zip(keys, vocab)}
            coordinator.schedule(step, args=(ids,))
        coordinator.join()
        after = {task: _rss(pid) for task, pid in pids.items()}
        checkpoint = tf.train.Checkpoint(layer=layer, optimizer=optimizer)
        save_to = os.path.join(tempfile.mkdtemp(prefix="tfs_b3_"), "ckpt")
        save_peak = _peak_rss_during(pids, lambda: checkpoint.save(save_to))

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
            row["checkpoint_peak_mb"] = save_peak[task] / 2**20
            if task[0] == "ps":
                row["growth_vs_expected"] = growth / held[task]
                row["checkpoint_peak_vs_held"] = save_peak[task] / held[task]
            else:
                row["growth_vs_table_bytes"] = growth / table_bytes
            rows.append(row)
        report = {
            "benchmark": "memory",
            "mode": "process",
            "quick": quick,
            "table_mb": table_bytes / 2**20,
            "slots_per_table": slots,
            "creation_s": creation_s,
            "results": rows,
        }
    finally:
        cluster.stop()
    # Full size: each placement in a process of its own, so that nothing one leaves behind is measured with the
    # other. --quick checks the report only: both in one process, each measured from its own baseline.
    placements = ("host", "device")
    groups = [placements] if quick else [(placement,) for placement in placements]
    report["mirrored"] = [row for group in groups for row in _run_mirrored(group, quick)]
    return report


def _run_mirrored(placements, quick: bool) -> List[Dict]:
    """The mirrored measurement of each of `placements`, in one new process."""
    out = tempfile.mktemp(suffix="_memory_mirrored.json")
    cmd = [sys.executable, "-m", "tf_sharded.benchmarks.memory", "--mirrored", *placements, "--out", out]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    proc = subprocess.run(cmd + (["--quick"] if quick else []), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"B3 mirrored ({', '.join(placements)}) failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        rows = json.load(f)
    os.remove(out)
    return rows


def _mirrored_rows(placements, quick: bool) -> List[Dict]:
    """In this process: a `MirroredStrategy` over 2 logical CPUs, and each placement's row in turn."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        warm = tf.Variable(tf.zeros([4, DIM]))
    strategy.run(tf.function(lambda: tf.reduce_sum(warm)))
    return [_mirrored_row(strategy, placement, quick) for placement in placements]


def _mirrored_row(strategy, placement: str, quick: bool) -> Dict:
    import tensorflow as tf

    from tf_sharded.app import data
    from tf_sharded.benchmarks.ps_lookup import _ids

    vocab = data.vocab_sizes(50_000 if quick else 1_000_000)
    keys = data.CATEGORICAL_KEYS
    pid = os.getpid()
    before = _rss(pid)
    tables = {
        k: {"input_dim": v, "output_dim": DIM, "placement": placement, "exchange": "allgather", "seed": i}
        for i, (k, v) in enumerate(zip(keys, vocab))
    }
    _, _, step = _collection_and_step(strategy, tables)
    created = _rss(pid)
    rng = np.random.default_rng(0)
    for _ in range(3 if quick else 10):
        batch = [{k: tf.constant(_ids(rng, "power_law", v, BATCH)) for k, v in zip(keys, vocab)} for _ in range(2)]
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx, b=batch: b[ctx.replica_id_in_sync_group]
        )
        step(per_replica)
    after = _rss(pid)
    table_bytes = sum(v * DIM * 4 for v in vocab)
    copies = 1 if placement == "host" else strategy.num_replicas_in_sync
    expected = table_bytes * copies * 2  # one Adagrad slot per table
    # The growth is read once the tables and slots exist; the training steps' own cost (tracing and
    # instantiating the replicated step, ~250 MB here whatever the table size) is reported apart.
    return {
        "placement": placement,
        "replicas": strategy.num_replicas_in_sync,
        "table_mb": table_bytes / 2**20,
        "rss_before_mb": before / 2**20,
        "rss_created_mb": created / 2**20,
        "rss_after_mb": after / 2**20,
        "growth_mb": (created - before) / 2**20,
        "steps_growth_mb": (after - created) / 2**20,
        "expected_mb": expected / 2**20,
        "growth_vs_expected": (created - before) / expected,
    }


def format_rows(report: Dict) -> List[str]:
    lines = [
        f"B3 memory (tables {report['table_mb']:.0f} MB + {report['slots_per_table']} slot): {'task':>8} | "
        f"{'before':>9} {'after':>9} {'growth':>9} {'expected':>9} | ratio"
    ]
    for r in report["results"]:
        ratio = r.get("growth_vs_expected", r.get("growth_vs_table_bytes"))
        what = "growth/expected" if "growth_vs_expected" in r else "growth/table"
        saving = f"; checkpoint write peak +{r['checkpoint_peak_mb']:.0f}MB"
        if "checkpoint_peak_vs_held" in r:
            saving += f" ({r['checkpoint_peak_vs_held']:.3f} of its shards and slots)"
        lines.append(
            f"{'':>42}{r['job'] + ':' + str(r['task']):>8} | {r['rss_before_mb']:>7.0f}MB {r['rss_after_mb']:>7.0f}MB "
            f"{r['growth_mb']:>7.0f}MB {r['expected_mb']:>7.0f}MB | {ratio:.3f} ({what}){saving}"
        )
    lines.append(f"{'':>42}tables and slots created in {report['creation_s']:.1f}s")
    for r in report.get("mirrored", []):
        lines.append(
            f"{'':>24}mirrored {r['placement']:>6} ({r['replicas']} replicas) | {r['rss_before_mb']:>7.0f}MB "
            f"{r['rss_created_mb']:>7.0f}MB {r['growth_mb']:>7.0f}MB {r['expected_mb']:>7.0f}MB | "
            f"{r['growth_vs_expected']:.3f} (growth/expected; {r['table_mb']:.0f} MB of tables; "
            f"then +{r['steps_growth_mb']:.0f} MB over the steps)"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="B3 child: the mirrored measurement of each placement given")
    parser.add_argument("--mirrored", choices=["host", "device"], nargs="+", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = _mirrored_rows(args.mirrored, args.quick)
    with open(args.out, "w") as f:
        json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
