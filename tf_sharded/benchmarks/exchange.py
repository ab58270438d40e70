"""B2: mirrored gradient exchange, swept over the fraction of rows touched per step.

One process, 4 replicas (virtual CPUs unless the machine has more devices), a
`rows x dim` table. For each density and id distribution the same steps run
with tf_sharded's `allgather`, `dense` and `auto` exchanges and with TF's
default path (Keras 3 `keras.layers.Embedding` + Keras SGD, whose
`IndexedSlices` are all-gathered with every duplicate kept). All run in the
same process run; step times are medians, reported with their ratio to TF's
default. Under `MirroredStrategy` tf_sharded gathers on one device and merges
once; `allgather_collective` is the same
table's all-gather over TF's collective with a merge on every replica, the
transport `MultiWorkerMirroredStrategy` uses (`tfs.strategy.mirrored.exchange_transport_scope`).

Bytes are those one replica would receive per step over a collective, from
the measured distinct ids: allgather `R * max_distinct * (row_bytes + 8)` (padded to the largest
replica, as TF's collective gather does), dense
`2 (R - 1) / R * rows * row_bytes`, TF default `R * ids * (row_bytes + 8)`.
`auto_chose` is what the in-process cost model picks for the measured number
of rows gathered ("auto" decides every step from that count, so this is what
it ran: "allgather" a hash merge, "dense" the densified merge).
`floor` is the same step with the lookup only (no gradient, exchange or
update): no exchange can make a training step cheaper than that, so
`tf_default / floor` bounds any speed-up over TF's default on this machine.
`allgather_again` is the allgather step of a second, identical table, timed
the same way: `noise = allgather_again / allgather` shows how far two
identical graphs differ here (where `auto` compiles to all-gather, its graph
is that one too).

    python -m tf_sharded bench exchange [--quick] [--out bench_results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

REPLICAS = 4


def _configure_devices() -> list:
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    except RuntimeError:
        pass  # already initialised (e.g. under the test runner, which configures the same)
    return [f"/cpu:{i}" for i in range(REPLICAS)]


def _ids(rng, distribution: str, rows: int, count: int):
    import numpy as np

    if distribution == "uniform":
        return rng.integers(0, rows, size=count, dtype=np.int64)
    # Power law (alpha ~ 1.05, like click logs), scattered over the table.
    raw = np.minimum(rng.zipf(1.05, size=count) - 1, rows - 1)
    return (raw * 2654435761) % rows


def _collective(strategy, step):
    """`step` traced (on its first call) with the collective transport instead of the in-process merge."""
    from tf_sharded.strategy import mirrored

    def call(batch):
        with mirrored.exchange_transport_scope(strategy, "collective"):
            return step(batch)

    return call


def interleaved_medians(strategy, named_steps: dict, batches, warmup: int) -> dict:
    """Median step time per name after `warmup` batches; the steps run interleaved so drift hits all alike.

    The order is shuffled every step (seeded): a step that follows the slow, allocation-heavy dense
    step may run slower, and a fixed order (or a rotation, which keeps the neighbours) would charge
    that to one mode.
    """
    import numpy as np

    for step in named_steps.values():
        for b in batches[:warmup]:
            step(b)
    times = {name: [] for name in named_steps}
    order = np.random.default_rng(1)
    for b in batches[warmup:]:
        for name in order.permutation(list(named_steps)):
            step = named_steps[name]
            t0 = time.perf_counter()
            out = step(b)
            strategy.experimental_local_results(out)[0].numpy()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run(quick: bool = False, out_dir: str = "bench_results", strategy=None) -> dict:
    """Runs the sweep; returns (and writes) the results."""
    devices = _configure_devices()
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_sharded as tfs

    rows, dim = (100_000, 16) if quick else (1_000_000, 32)
    densities = [1e-4, 1e-2] if quick else [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 0.5]
    distributions = ["power_law"] if quick else ["power_law", "uniform"]
    steps, warmup = (2, 1) if quick else (27, 2)
    strategy = strategy or tf.distribute.MirroredStrategy(devices)
    replicas = strategy.num_replicas_in_sync
    row_bytes = dim * 4
    rng = np.random.default_rng(0)
    results = []

    def make_step(model_vars, lookup, optimizer, train=True):
        @tf.function
        def step(ids):
            def fn(ids):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(lookup(ids) ** 2) * 1e-3
                if train:
                    optimizer.apply_gradients(zip(tape.gradient(loss, model_vars()), model_vars()))
                return loss

            return strategy.run(fn, args=(ids,))

        return step

    with strategy.scope():
        # Table name -> its exchange: the three modes, a second identical all-gather table (the noise) and
        # one for the collective transport.
        exchanges = {"allgather": "allgather", "dense": "dense", "auto": "auto"}
        exchanges.update(allgather_again="allgather", allgather_collective="allgather")
        tables = {
            name: strategy.create_sharded_variable(
                f"bench_{name}", [rows, dim], initializer="uniform", exchange=mode, placement="device", seed=1
            )
            for name, mode in exchanges.items()
        }
        optimizers = {mode: keras.optimizers.SGD(0.1) for mode in tables}
        embedding = keras.layers.Embedding(rows, dim)
        embedding.build((None,))
        keras_optimizer = keras.optimizers.SGD(0.1)

    for distribution in distributions:
        for density in densities:
            per_replica = max(1, int(round(density * rows / replicas)))
            batches = []
            distinct = []
            gathered = []
            for _ in range(warmup + steps):
                arrays = [_ids(rng, distribution, rows, per_replica) for _ in range(replicas)]
                distinct.append(max(len(np.unique(a)) for a in arrays))
                gathered.append(sum(len(np.unique(a)) for a in arrays))
                batches.append(
                    strategy.experimental_distribute_values_from_function(
                        lambda ctx, a=arrays: tf.constant(a[ctx.replica_id_in_sync_group])
                    )
                )
            # Whole rows: the padded gather's count rounded up, the merged rows down, so a step's bound (merged
            # rows <= replicas x the largest distinct count) holds for the reported means too.
            max_distinct = int(np.ceil(np.mean(distinct)))
            mean_gathered = int(np.mean(gathered))
            row = {
                "distribution": distribution,
                "density": density,
                "ids_per_replica": per_replica,
                "max_distinct_per_replica": max_distinct,
                "rows_gathered": mean_gathered,
            }
            named = {
                f"{mode}_s": make_step(
                    lambda t=table: list(t.variables), lambda i, t=table: tfs.embedding_lookup(t, i), optimizers[mode]
                )
                for mode, table in tables.items()
            }
            named["allgather_collective_s"] = _collective(strategy, named["allgather_collective_s"])
            named["tf_default_s"] = make_step(lambda: embedding.trainable_variables, embedding, keras_optimizer)
            # The floor: the same step with the lookup only (no gradient, no exchange, no update).
            named["floor_s"] = make_step(
                lambda: [], lambda i, t=tables["allgather"]: tfs.embedding_lookup(t, i), None, train=False
            )
            row.update(interleaved_medians(strategy, named, batches, warmup))
            per_replica_gathered = mean_gathered / replicas
            row["auto_chose"] = tfs.exchange.choose(rows, row_bytes, replicas, per_replica_gathered, in_process=True)
            row["bytes_allgather"] = replicas * max_distinct * (row_bytes + 8)
            row["bytes_dense"] = int(2 * (replicas - 1) / replicas * rows * row_bytes)
            row["bytes_tf_default"] = replicas * per_replica * (row_bytes + 8)
            best = min(row["allgather_s"], row["dense_s"])
            row["auto_vs_best"] = row["auto_s"] / best
            row["tf_default_vs_auto"] = row["tf_default_s"] / row["auto_s"]
            row["tf_default_vs_floor"] = row["tf_default_s"] / row["floor_s"]
            row["noise"] = row["allgather_again_s"] / row["allgather_s"]
            row["collective_vs_allgather"] = row["allgather_collective_s"] / row["allgather_s"]
            results.append(row)
            print(_format_row(row), flush=True)

    report = {
        "benchmark": "exchange",
        "rows": rows,
        "dim": dim,
        "replicas": replicas,
        "quick": quick,
        "steps": steps,
        "results": results,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "exchange.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return report


HEADER = (
    f"{'ids':>10} {'density':>8} {'ids/rep':>8} {'distinct':>8} | {'allgather':>9} {'dense':>9} {'auto':>9} "
    f"{'tf':>9} {'floor':>9} {'ag coll':>9} | {'auto/best':>9} {'tf/auto':>8} {'tf/floor':>8} {'noise':>6} "
    f"{'coll/ag':>7} {'chose':>9} | "
    f"{'MB gather':>9} {'MB dense':>9} {'MB tf':>9}"
)


def _format_row(r: dict) -> str:
    mb = 1 / (1 << 20)
    return (
        f"{r['distribution']:>10} {r['density']:>8.0e} {r['ids_per_replica']:>8} {r['max_distinct_per_replica']:>8} | "
        f"{r['allgather_s'] * 1e3:>7.1f}ms {r['dense_s'] * 1e3:>7.1f}ms {r['auto_s'] * 1e3:>7.1f}ms "
        f"{r['tf_default_s'] * 1e3:>7.1f}ms {r['floor_s'] * 1e3:>7.1f}ms {r['allgather_collective_s'] * 1e3:>7.1f}ms | "
        f"{r['auto_vs_best']:>9.2f} {r['tf_default_vs_auto']:>8.2f} {r['tf_default_vs_floor']:>8.2f} "
        f"{r['noise']:>6.2f} {r['collective_vs_allgather']:>7.2f} "
        f"{r['auto_chose']:>9} | {r['bytes_allgather'] * mb:>9.2f} {r['bytes_dense'] * mb:>9.2f} "
        f"{r['bytes_tf_default'] * mb:>9.2f}"
    )


def format_rows(report: dict) -> list:
    return [HEADER] + [_format_row(r) for r in report["results"]]


def merge_sweep(quick: bool = False, out_dir: str = "bench_results", repeats: int = 9) -> dict:
    """The in-process merges on one device: hash vs densified (position map) vs densifying into the table.

    What `tfs.exchange.LOCAL_MERGE_FACTOR` is fitted to. Rows gathered are
    4 replicas' distinct uniform ids, 5-50% of the table; the three are timed
    interleaved in one process (medians), with the in-process model's choice.
    """
    import numpy as np
    import tensorflow as tf

    from tf_sharded.exchange import cost, transports

    tables = [(20_000, 8)] if quick else [(1_000_000, 32), (1_000_000, 8), (100_000, 16)]
    fractions = [0.05, 0.5] if quick else [0.05, 0.1, 0.2, 0.3, 0.4, 0.5]
    rng = np.random.default_rng(0)
    results = []
    for rows, dim in tables:
        merges = {
            "hash": tf.function(transports.hash_merge),
            "densified": tf.function(lambda i, v, rows=rows: transports.map_merge(i, v, rows)),
            "densify": tf.function(lambda i, v, rows=rows: tf.math.unsorted_segment_sum(v, tf.cast(i, tf.int32), rows)),
        }
        for fraction in fractions:
            per_replica = int(fraction * rows) // REPLICAS
            ids = np.concatenate([np.unique(rng.integers(0, rows, per_replica)) for _ in range(REPLICAS)])
            indices, values = tf.constant(ids), tf.random.normal([len(ids), dim])
            times = {name: [] for name in merges}
            for repeat in range(repeats + 1):
                for name, merge in merges.items():
                    t0 = time.perf_counter()
                    [t.numpy() for t in tf.nest.flatten(merge(indices, values))]
                    if repeat:  # the first round traces
                        times[name].append(time.perf_counter() - t0)
            row = {"rows": rows, "dim": dim, "fraction": fraction, "rows_gathered": len(ids)}
            row.update({f"{name}_s": statistics.median(t) for name, t in times.items()})
            distinct = len(ids) / REPLICAS
            row["model_chose"] = cost.choose(rows, dim * 4, REPLICAS, distinct, in_process=True)
            row["faster"] = "allgather" if row["hash_s"] <= row["densified_s"] else "dense"
            results.append(row)
            print(
                f"{rows:>9} x {dim:<3} {fraction:>5.0%} {len(ids):>8} gathered | hash {row['hash_s'] * 1e3:6.1f} ms  "
                f"densified {row['densified_s'] * 1e3:6.1f} ms  densify {row['densify_s'] * 1e3:6.1f} ms | "
                f"faster {row['faster']:>9}  model {row['model_chose']:>9}",
                flush=True,
            )
    report = {"benchmark": "exchange_merges", "quick": quick, "replicas": REPLICAS, "results": results}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "exchange_merges.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tf_sharded.benchmarks.exchange",
        description="The in-process merge sweep behind LOCAL_MERGE_FACTOR (the B2 sweep: python -m tf_sharded "
        "bench exchange)",
    )
    parser.add_argument("--quick", action="store_true", help="one small table, two fractions (for tests)")
    parser.add_argument("--out", default="bench_results", help="directory for exchange_merges.json")
    args = parser.parse_args(argv)
    merge_sweep(quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
