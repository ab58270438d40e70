"""B6: one `EmbeddingCollection` (fused requests, tables stored in one variable per ps) against one
`tfs.layers.Embedding` per table.

On a parameter-server cluster (2 ps + 1 worker), `n` tables of 10,000 x 16
(2 shards each), a batch of 512 power-law ids per table, lookup + lazy SGD
update scheduled on the worker. For n = 8, 16, 32, 64 both variants run in
the same process run on the same batches, in interleaved rounds; reported:
median step time and `per_table / collection`.

    python -m tf_sharded bench fused [--quick]
"""

from __future__ import annotations

import statistics
from typing import Dict, List

import numpy as np

ROWS, DIM, BATCH = 10_000, 16, 512


def run(quick: bool = False, mode: str = "inprocess") -> Dict:
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.benchmarks.ps_lookup import _ids, scheduled_seconds

    counts = [8, 16] if quick else [8, 16, 32, 64]
    steps, rounds = (3, 1) if quick else (10, 3)
    cluster = tfs.cluster.LocalCluster(num_workers=1, num_ps=2, mode=mode).start()
    try:
        strategy = cluster.strategy()
        coordinator = cluster.coordinator(strategy)
        rng = np.random.default_rng(0)
        results = []
        for n in counts:
            keys = [f"t{i}" for i in range(n)]
            with strategy.scope():
                collection = tfs.layers.EmbeddingCollection(
                    {k: {"input_dim": ROWS, "output_dim": DIM, "partitions": 2, "seed": i} for i, k in enumerate(keys)},
                    {k: k for k in keys},
                )
                collection.build()
                singles = {k: tfs.layers.Embedding(ROWS, DIM, partitions=2, seed=i) for i, k in enumerate(keys)}
                for layer in singles.values():
                    layer.build()
                optimizers = {"collection": tfs.optimizers.SGD(0.01), "per_table": tfs.optimizers.SGD(0.01)}
                optimizers["collection"].build(collection.trainable_variables)
                per_table_vars = [v for layer in singles.values() for v in layer.trainable_variables]
                optimizers["per_table"].build(per_table_vars)

            steps_by_name = {
                "collection": train_step(strategy, collection, optimizers["collection"], collection.trainable_variables,
                                         keys),
                "per_table": train_step(strategy, lambda ids: {k: singles[k](ids[k]) for k in keys},
                                        optimizers["per_table"], per_table_vars, keys),
            }  # fmt: skip
            batches = [{k: tf.constant(_ids(rng, "power_law", ROWS, BATCH)) for k in keys} for _ in range(steps)]
            times: Dict[str, List[float]] = {name: [] for name in steps_by_name}
            for fn in steps_by_name.values():
                coordinator.schedule(fn, args=(batches[0],))
                coordinator.join()
            for _ in range(rounds):
                for name, fn in steps_by_name.items():
                    times[name].append(scheduled_seconds(coordinator, fn, batches))
            row = {"tables": n, **{f"{name}_s": statistics.median(t) for name, t in times.items()}}
            row["per_table_vs_collection"] = row["per_table_s"] / row["collection_s"]
            results.append(row)
        return {
            "benchmark": "fused",
            "mode": mode,
            "quick": quick,
            "rows": ROWS,
            "dim": DIM,
            "batch": BATCH,
            "results": results,
        }
    finally:
        cluster.stop()


def train_step(strategy, lookup, optimizer, variables, keys):
    """A step to schedule: `lookup(ids)` (a dict of embeddings per key), a squared loss, `optimizer` on
    `variables`."""
    import tensorflow as tf

    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                out = lookup(ids)
                loss = 1e-3 * tf.add_n([tf.reduce_sum(tf.square(out[k])) for k in keys])
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.run(fn, args=(ids,))

    return step


def format_rows(report: Dict) -> List[str]:
    lines = [f"B6 fused ({report['mode']}): {'tables':>6} | {'collection':>10} {'per table':>10} | {'per/coll':>8}"]
    for r in report["results"]:
        lines.append(
            f"{'':>18}{r['tables']:>6} | {r['collection_s'] * 1e3:>8.1f}ms {r['per_table_s'] * 1e3:>8.1f}ms | "
            f"{r['per_table_vs_collection']:>8.2f}"
        )
    return lines
