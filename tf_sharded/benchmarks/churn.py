"""B7 churn: a dynamic table bounded by `CapacityEviction` under a stream of keys that are all new, for long.

What a recommender's tables meet every day (new users and items), run far
past the table's capacity: on a parameter-server cluster (2 ps + 1 worker),
one table of 16-wide rows trained by Adagrad, a batch of 512 keys never seen
before per step, 50 times the capacity in inserts (after one warm-up step that traces). The baseline runs in the
same process on the same batches, interleaved block by block: the same table
without eviction, which keeps every key. Reported:

* the step time over the run: the median step of each tenth of it, and the
  last tenth's over the first (1: no slow-down as keys come and go);
* the churned table's step over the baseline's, per tenth;
* at the end, the live keys, the index's buckets and the bytes per live key
  held by each table's pools (rows, the Adagrad column, `seen` and `hits`)
  and index (12 bytes a bucket): bounded by the capacity for the churned
  table, by every key ever seen for the baseline.

    python -m tf_sharded bench dynamic_churn [--quick] [--mode inprocess|process|both]
"""

from __future__ import annotations

import statistics
from typing import Dict, List

import numpy as np

DIM, BATCH = 16, 512
BLOCK = 10  # steps scheduled together, then joined: the unit of timing
TENTHS = 10
BUCKET_BYTES = 12  # an int64 key and an int32 row
META_BYTES = 16  # a row's last-seen step and hit count


def _held_bytes(table) -> Dict:
    """Live keys, index buckets and the bytes the table's pools and index hold, per live key."""
    live = int(table.size())
    capacity = sum(int(s.capacity.numpy()) for s in table.shards)
    buckets = int(table.index_buckets())
    held = capacity * (DIM * 4 * 2 + META_BYTES) + buckets * BUCKET_BYTES
    return {"live_keys": live, "pool_rows": capacity, "index_buckets": buckets, "bytes_per_live_key": held / live}


def run(quick: bool = False, mode: str = "inprocess") -> Dict:
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.benchmarks.dynamic import _train_step
    from tf_sharded.benchmarks.ps_lookup import scheduled_seconds

    capacity = 1_024 if quick else 32_768  # --quick: 100 steps, the fewest whole blocks in each tenth
    steps = 50 * capacity // BATCH // (BLOCK * TENTHS) * BLOCK * TENTHS  # whole blocks in each tenth
    cluster = tfs.cluster.LocalCluster(num_workers=1, num_ps=2, mode=mode).start()
    try:
        strategy = cluster.strategy()
        coordinator = cluster.coordinator(strategy)
        with strategy.scope():
            tables = {
                "churn": tfs.create_dynamic_table(
                    "b7_churn", DIM, seed=0, eviction=tfs.policies.CapacityEviction(capacity)
                ),  # fmt: skip
                "baseline": tfs.create_dynamic_table("b7_churn_baseline", DIM, seed=0),
            }
            optimizers = {name: tfs.optimizers.Adagrad(0.05) for name in tables}
            for name, table in tables.items():
                optimizers[name].build(list(table.variables))
        # B7's step: a lookup of the table, the sum of (row - 0.5)**2, one Adagrad update.
        fns = {name: _train_step(tfs, tf, strategy, [tables[name]], optimizers[name]) for name in tables}
        rng = np.random.default_rng(0)
        keys = np.unique(rng.integers(-(2**62), 2**62, size=2 * (steps + 1) * BATCH, dtype=np.int64))
        keys = rng.permutation(keys)[: (steps + 1) * BATCH].reshape(steps + 1, BATCH)
        warm_up, batches = [tf.constant(keys[0])], [[tf.constant(k)] for k in keys[1:]]
        for fn in fns.values():  # traces each step outside the timing (its keys count among the inserted)
            scheduled_seconds(coordinator, fn, [warm_up])
        times: Dict[str, List[float]] = {name: [] for name in tables}
        for start in range(0, steps, BLOCK):
            block = batches[start : start + BLOCK]
            for name, fn in fns.items():
                times[name].append(scheduled_seconds(coordinator, fn, block))
        per_tenth = len(times["churn"]) // TENTHS
        tenths = {
            name: [statistics.median(t[i * per_tenth : (i + 1) * per_tenth]) for i in range(TENTHS)]
            for name, t in times.items()
        }
        result = {
            "churn_tenths_s": tenths["churn"],
            "baseline_tenths_s": tenths["baseline"],
            "churn_last_vs_first": tenths["churn"][-1] / tenths["churn"][0],
            "baseline_last_vs_first": tenths["baseline"][-1] / tenths["baseline"][0],
            "churn_vs_baseline_tenths": [c / b for c, b in zip(tenths["churn"], tenths["baseline"])],
            "churn_vs_baseline_last": tenths["churn"][-1] / tenths["baseline"][-1],
            "churn": _held_bytes(tables["churn"]),
            "baseline": _held_bytes(tables["baseline"]),
        }
        result["churn_vs_baseline_bytes"] = (result["churn"]["bytes_per_live_key"] * result["churn"]["live_keys"]) / (
            result["baseline"]["bytes_per_live_key"] * result["baseline"]["live_keys"]
        )
        return {
            "benchmark": "dynamic_churn",
            "mode": mode,
            "quick": quick,
            "capacity": capacity,
            "steps": steps,
            "batch": BATCH,
            "dim": DIM,
            "inserted_keys": (steps + 1) * BATCH,  # the timed steps' and the warm-up step's
            "results": [result],
        }
    finally:
        cluster.stop()


def format_rows(report: Dict) -> List[str]:
    r = report["results"][0]
    c, b = r["churn"], r["baseline"]
    return [
        f"B7 churn ({report['mode']}): {report['inserted_keys']:,} new keys ({report['steps']} + 1 steps of "
        f"{report['batch']}) into CapacityEviction({report['capacity']:,}), dim {report['dim']}, 2 ps",
        f"  step over the run (ms, per tenth): {' '.join(f'{t * 1e3:.1f}' for t in r['churn_tenths_s'])}; "
        f"last / first {r['churn_last_vs_first']:.2f}",
        f"  without eviction (ms, per tenth): {' '.join(f'{t * 1e3:.1f}' for t in r['baseline_tenths_s'])}; "
        f"last / first {r['baseline_last_vs_first']:.2f}; churned / baseline at the end "
        f"{r['churn_vs_baseline_last']:.2f}",
        f"  at the end: {c['live_keys']:,} live keys, {c['index_buckets']:,} index buckets, "
        f"{c['bytes_per_live_key']:.0f} B per live key; without eviction {b['live_keys']:,} keys, "
        f"{b['bytes_per_live_key']:.0f} B per key; held bytes churned / baseline {r['churn_vs_baseline_bytes']:.3f}",
    ]
