"""B11: the placement planner's choices against the measured options, and the constants it uses.

At each point `tfs.plan` is given the tables and a sample of the point's ids;
every option it chooses between is then built and timed in the same process
run (medians of interleaved rounds), and the report says whether the plan's
option was the fastest or within `NOISE` of it.

Parameter servers (a cluster of 2 ps + 1 worker, `--mode`): `TABLES` tables
of `ROWS x 16` (but for `scheme`), a batch of 512 ids per table, lookup +
SGD scheduled on the worker:
* `storage`: one storage variable per ps for all tables (batched) or one
  variable per shard;
* `shards`: row-wise (a shard per ps) or each table whole on one ps;
* `scheme`: "div" or "mod" for 2 tables (each too large to stay whole on
  one ps) with a vocabulary sorted by frequency (hot ids low).

Mirrored (4 virtual CPUs, in a child process: a `MirroredStrategy` cannot
share a process with a cluster): one table per point, lookup + SGD, the
all-gather exchange against the densified merge.

The same run fits the planner's constants: `PS_VARIABLE_MS` (unbatched minus
batched step, per variable), `PS_DISPATCH_MS` (a step that reads one row of
each storage variable), `PS_ID_US` (the rest of the batched step, per id)
and `EXCHANGE_BYTES_PER_MS` (the exchange's cost model over each mirrored
option's time above a lookup-only step).

    python -m tf_sharded bench plan [--quick] [--mode inprocess|process|both]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Dict, List

import numpy as np

ROWS, DIM, BATCH, TABLES, LR = 100_000, 16, 512, 26, 0.01
NOISE = 0.10  # two identical steps differ by up to this here (B2's `noise`, B1's reruns)
# (rows, ids per replica, distribution) of the mirrored points: both sides of the exchange's break-even.
MIRRORED_POINTS = [
    (1_000_000, 256, "power_law"),
    (200_000, 4096, "uniform"),
    (20_000, 4096, "uniform"),
    (5_000, 16_384, "uniform"),
]


def sample_ids(point: str, rows: int, batch: int, tables: int, steps: int, seed: int = 0) -> List[Dict]:
    """The batches of a parameter-server point (`scheme`: frequency-sorted ids; else scattered power law)."""
    from tf_sharded.benchmarks.ps_lookup import _ids

    rng = np.random.default_rng(seed)
    if point == "scheme":
        # Zipf (alpha 1.05) over the ranks [0, rows): id r is the r-th most frequent value.
        cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -1.05)
        draw = lambda: np.searchsorted(cdf, rng.random(batch) * cdf[-1]).astype(np.int64)  # noqa: E731
    else:
        draw = lambda: _ids(rng, "power_law", rows, batch)  # noqa: E731
    return [{f"t{i}": draw() for i in range(tables)} for _ in range(steps)]


def ps_choice(point: str, plan) -> str:
    """The option of `point` that `plan` (for the point's tables) takes."""
    first = plan.tables["t0"]
    if point == "storage":
        return "batched" if len(plan.groups) == 1 else "unbatched"
    if point == "shards":
        return "row_wise" if first.partitions > 1 else "table_wise"
    return first.scheme


def _ps_options(point: str) -> Dict[str, dict]:
    """Option -> (collection arguments, per-table arguments)."""
    if point == "storage":
        return {"batched": ({}, {"partitions": 2}), "unbatched": ({"batch_tables": False}, {"partitions": 2})}
    if point == "shards":
        return {"row_wise": ({}, {"partitions": 2}), "table_wise": ({}, {"partitions": 1})}
    return {"div": ({}, {"partitions": 2, "scheme": "div"}), "mod": ({}, {"partitions": 2, "scheme": "mod"})}


def _timed(coordinator, steps: Dict, batches, rounds: int) -> Dict[str, float]:
    from tf_sharded.benchmarks.ps_lookup import scheduled_seconds

    for fn in steps.values():
        coordinator.schedule(fn, args=(batches[0],))
        coordinator.join()
    times = {name: [] for name in steps}
    # A new order every round (seeded), so that what runs after a slower option is not always the same one.
    order = np.random.default_rng(1)
    for _ in range(rounds):
        for name in order.permutation(list(steps)):
            times[name].append(scheduled_seconds(coordinator, steps[name], batches))
    return {name: statistics.median(t) for name, t in times.items()}


def _ps_points(quick: bool, mode: str) -> Dict:
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.benchmarks.fused import train_step

    rows, tables = (10_000, 8) if quick else (ROWS, TABLES)
    steps, rounds = (3, 1) if quick else (10, 7)
    cluster = tfs.cluster.LocalCluster(num_workers=1, num_ps=2, mode=mode).start()
    try:
        strategy = cluster.strategy()
        coordinator = cluster.coordinator(strategy)
        points, extra = [], {}
        # The scheme matters to tables split over the ps: two tables, each too large to stay whole on one.
        for point, n in (("storage", tables), ("shards", tables), ("scheme", 2)):
            keys = [f"t{i}" for i in range(n)]
            table_configs = {k: {"input_dim": rows, "output_dim": DIM, "seed": i} for i, k in enumerate(keys)}
            batches = sample_ids(point, rows, BATCH, n, steps)
            plan = tfs.plan(table_configs, strategy, ids={k: [b[k] for b in batches] for k in keys})
            named, collections = {}, {}
            for option, (layer_args, table_args) in _ps_options(point).items():
                configs = {k: {**c, **table_args} for k, c in table_configs.items()}
                with strategy.scope():
                    layer = tfs.layers.EmbeddingCollection(configs, {k: k for k in keys}, name=f"{point}_{option}",
                                                           **layer_args)  # fmt: skip
                    layer.build()
                    optimizer = tfs.optimizers.SGD(LR)
                    optimizer.build(layer.trainable_variables)
                named[option] = train_step(strategy, layer, optimizer, layer.trainable_variables, keys)
                collections[option] = layer
            if point == "storage":
                storages = collections["batched"].trainable_variables
                named["dispatch"] = _dispatch_step(tf, strategy, storages)
                extra["variables"] = {o: len(c.trainable_variables) for o, c in collections.items()}
            tensors = [{k: tf.constant(v) for k, v in b.items()} for b in batches]
            times = _timed(coordinator, named, tensors, rounds)
            if point == "storage":
                extra["dispatch_s"] = times.pop("dispatch")
                extra["batched_s"] = times["batched"]
                extra["unbatched_s"] = times["unbatched"]
            row = {"family": "parameter_server", "point": point, "rows": rows, "tables": n, "batch": BATCH}
            points.append(_agreement({**row, "steps": steps}, times, ps_choice(point, plan)))
        variables = extra["variables"]
        per_variable = (extra["unbatched_s"] - extra["batched_s"]) / (variables["unbatched"] - variables["batched"])
        rest = extra["batched_s"] - extra["dispatch_s"] - variables["batched"] * per_variable
        fitted = {
            "PS_DISPATCH_MS": extra["dispatch_s"] * 1e3,
            "PS_VARIABLE_MS": per_variable * 1e3,
            "PS_ID_US": rest / (tables * BATCH) * 1e6,
        }
        return {"points": points, "fitted": fitted}
    finally:
        cluster.stop()


def _dispatch_step(tf, strategy, variables):
    @tf.function
    def step(ids):
        del ids
        # A gather of one row on each ps (`v[0]` would read the whole variable to the worker).
        return strategy.run(
            lambda: tf.add_n([tf.reduce_sum(tf.gather(getattr(v, "value", v), [0])) for v in variables])
        )

    return step


def _agreement(row: Dict, times: Dict[str, float], chose: str) -> Dict:
    fastest = min(times, key=times.get)
    ratio = times[chose] / times[fastest]
    return {**row, "times_s": times, "plan_chose": chose, "fastest": fastest, "chosen_vs_fastest": ratio,
            "agrees": ratio <= 1 + NOISE}  # fmt: skip


def mirrored_sample(rows: int, per_replica: int, distribution: str, replicas: int, steps: int, seed: int = 0):
    """The per-replica id arrays of each step of a mirrored point."""
    from tf_sharded.benchmarks.exchange import _ids

    rng = np.random.default_rng(seed)
    return [[_ids(rng, distribution, rows, per_replica) for _ in range(replicas)] for _ in range(steps)]


def mirrored_points(quick: bool = False) -> Dict:
    """The mirrored points (run in a process of their own)."""
    from tf_sharded.benchmarks.exchange import _configure_devices, interleaved_medians

    devices = _configure_devices()
    import keras
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.exchange.cost import cost_bytes

    strategy = tf.distribute.MirroredStrategy(devices)
    replicas = strategy.num_replicas_in_sync
    points_in = [(20_000, 256, "power_law"), (2_000, 1024, "uniform")] if quick else MIRRORED_POINTS
    steps, warmup = (3, 1) if quick else (15, 2)
    points, speeds = [], []
    for rows, per_replica, distribution in points_in:
        sample = mirrored_sample(rows, per_replica, distribution, replicas, warmup + steps)
        # The plan sees one global batch per step: the replicas' ids, concatenated.
        # The copies' exchange (the placement is B12's question).
        plan = tfs.plan({"t": {"input_dim": rows, "output_dim": DIM, "placement": "device"}}, strategy,
                        ids={"t": [np.concatenate(s) for s in sample]})  # fmt: skip
        chose = plan.tables["t"].exchange
        with strategy.scope():
            tables = {
                "allgather": strategy.create_sharded_variable("ag", [rows, DIM], exchange="allgather", seed=1,
                                                              placement="device"),
                # Declaring every row touched fixes the densified merge at trace time.
                "dense": strategy.create_sharded_variable("dn", [rows, DIM], exchange="auto", ids_per_step=rows,
                                                          seed=1, placement="device"),
            }  # fmt: skip
            optimizers = {name: keras.optimizers.SGD(LR) for name in tables}
        per_replica_ids = lambda ctx, a: tf.constant(a[ctx.replica_id_in_sync_group])  # noqa: E731
        batches = [
            strategy.experimental_distribute_values_from_function(lambda ctx, a=s: per_replica_ids(ctx, a))
            for s in sample
        ]
        named = {name: _mirrored_step(tf, tfs, strategy, table, optimizers[name]) for name, table in tables.items()}
        named["floor"] = _mirrored_step(tf, tfs, strategy, tables["allgather"], None)
        times = interleaved_medians(strategy, named, batches, warmup)
        floor = times.pop("floor")
        distinct = plan.tables["t"].exchange_ids
        for mode, t in times.items():
            if t > floor:
                speeds.append(cost_bytes(mode if mode == "allgather" else "dense", rows, DIM * 4, replicas,
                                         min(distinct, rows), in_process=True) / ((t - floor) * 1e3))  # fmt: skip
        row = {
            "family": "mirrored",
            "rows": rows,
            "ids_per_replica": per_replica,
            "distribution": distribution,
            "replicas": replicas,
            "steps": warmup + steps,
            "distinct_per_replica": distinct,
            "floor_s": floor,
        }
        points.append(_agreement(row, times, chose))
    return {"points": points, "fitted": {"EXCHANGE_BYTES_PER_MS": statistics.median(speeds) if speeds else None}}


def _mirrored_step(tf, tfs, strategy, table, optimizer):
    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                loss = 1e-3 * tf.reduce_sum(tf.square(tfs.embedding_lookup(table, ids)))
            if optimizer is not None:
                variables = list(table.variables)
                optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.run(fn, args=(ids,))

    return step


def run(quick: bool = False, mode: str = "inprocess") -> Dict:
    from tf_sharded.benchmarks.children import child_env
    from tf_sharded.planning import planner

    ps = _ps_points(quick, mode)
    command = [sys.executable, "-m", "tf_sharded.benchmarks.plan", "--mirrored"] + (["--quick"] if quick else [])
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    mirrored = json.loads(done.stdout.strip().splitlines()[-1])
    fitted = {**ps["fitted"], **mirrored["fitted"]}
    return {
        "benchmark": "plan",
        "mode": mode,
        "quick": quick,
        "noise": NOISE,
        "results": ps["points"] + mirrored["points"],
        "fitted": fitted,
        "constants": {name: getattr(planner, name) for name in fitted},
    }


def format_rows(report: Dict) -> List[str]:
    lines = [f"B11 plan ({report['mode']}): point | options (ms) | plan chose | fastest | chosen/fastest | agrees"]
    for r in report["results"]:
        where = r.get("point") or f"{r['rows']:,} rows, {r['ids_per_replica']} ids/replica {r['distribution']}"
        times = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r["times_s"].items())
        lines.append(
            f"  {r['family']:>16} {where:<40} | {times:<34} | {r['plan_chose']:>10} | {r['fastest']:>10} | "
            f"{r['chosen_vs_fastest']:>5.2f} | {'yes' if r['agrees'] else 'NO'}"
        )
    fitted = report["fitted"].items()
    shown = [f"{k} {v if v is None else round(v, 3)} / {report['constants'][k]}" for k, v in fitted]
    lines.append("  constants (fitted in this run / the planner's): " + ", ".join(shown))
    return lines


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--mirrored" in args:
        print(json.dumps(mirrored_points(quick="--quick" in args)))
        return 0
    print("\n".join(format_rows(run(quick="--quick" in args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
