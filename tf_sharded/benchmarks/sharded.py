"""B12: tables sharded over the replicas (`placement="sharded"`) against mirrored copies.

At N = 2 and 4 replicas (logical CPUs of one process), each in its own
process, and over 2 workers of MultiWorkerMirroredStrategy (a process each,
one replica per worker); `--quick`: N = 4 only, without the application (the
tests run the multi-worker case and the application on their own):

* **bytes per replica**: the bytes of the variables placed on each
  replica's device (tables and `tfs.optimizers.Adagrad`'s slot), for an
  `EmbeddingCollection` of 8 tables sharded (across workers also 2 and 26
  at 100K rows), against (tables + slots) / N,
  the goal (within 15%); and what a mirrored copy per replica holds;
* **step time**, sharded / mirrored (`placement="device"`), on tables both
  fit, at several table sizes: 8 tables of `rows` x 16, 512 uniform ids per
  table and replica, a lookup, a dense head and an Adagrad update per step
  (median of interleaved timed rounds after a traced warm-up); across workers the
  sharded step also over the gather transport, against the one the cost
  model chooses (`tfs.exchange.workers`: the all-to-all);
* **the cost model**: the same run fits `APPLY_FACTOR`
  (`tfs.exchange.cost`, from the replicas of one process) and
  `SHARDED_RENDEZVOUS_MS` (`tfs.plan`, from the workers, whose points
  also vary the number of tables that share it), and at every
  point `tfs.plan` is asked, with that point's ids, to place the tables: it
  should pick the faster placement, or one within `NOISE` of it;
* **the plan** (from 3 replicas on, where a shard fits a third): with
  `memory_per_replica` at a third of one table's bytes (table and slot),
  `tfs.plan` places it sharded, and the layer built from the plan trains.

Then the application, as a user runs it: `python -m tf_sharded train
--strategy mirrored --cpu_replicas N`, and `--strategy multi_worker` on 2
worker processes, with `--placement sharded` and with
`--placement device` at equal steps: samples/s and held-out AUC.

    python -m tf_sharded bench sharded [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

from tf_sharded.benchmarks import children

TABLES, DIM, IDS = 8, 16, 512
WORKERS = 2  # MultiWorkerMirroredStrategy's case: one replica per worker process
SLOTS = 1  # Adagrad's accumulator
STEPS_SAMPLED = 4  # the distinct batches a timed round cycles through
NOISE = 0.10  # two identical steps differ by up to this here (B11's)


def _sizes(quick: bool) -> Dict:
    if quick:
        return {"replicas": [4], "rows": [2_000], "memory_rows": 4_000, "steps": 3, "rounds": 2,
                "app_steps": 20, "app_vocab": 1_000, "worker_counts": []}  # fmt: skip
    return {"replicas": [2, 4], "rows": [10_000, 100_000, 1_000_000], "memory_rows": 1_000_000, "steps": 20,
            "rounds": 5, "app_steps": 600, "app_vocab": 100_000, "worker_counts": [2, 26]}  # fmt: skip


def _collection(strategy, rows: int, placement, memory_per_replica=None, count: int = TABLES):
    import tensorflow as tf

    import tf_sharded as tfs

    tables = {f"t{i}": {"input_dim": rows, "output_dim": DIM, "seed": i} for i in range(count)}
    plan = None
    if memory_per_replica is not None:
        plan = tfs.plan(tables, strategy, memory_per_replica=memory_per_replica)
    else:
        tables = {name: dict(t, placement=placement) for name, t in tables.items()}
    with strategy.scope():
        layer = tfs.layers.EmbeddingCollection(tables, {name: name for name in tables}, plan=plan)
        layer.build()
        head = tf.Variable(tf.ones([count * DIM, 1]) / 100)
        optimizer = tfs.optimizers.Adagrad(0.05)
        optimizer.build(layer.trainable_variables + [head])
    return layer, head, optimizer, plan


def _bytes_by_device(variables) -> Dict[str, int]:
    """Bytes of `variables` per device (a mirrored variable's copies each on their own device)."""
    import keras
    import tensorflow as tf

    held: Dict[str, int] = {}
    for v in variables:
        v = v.value if isinstance(v, keras.Variable) else v  # a Keras variable's TensorFlow variable
        copies = v.values if isinstance(v, tf.distribute.DistributedValues) else (v,)
        for copy in copies:
            held[copy.device] = held.get(copy.device, 0) + copy.shape.num_elements() * copy.dtype.size
    return held


def _step(strategy, layer, head, optimizer):
    import tensorflow as tf

    @tf.function
    def step(features):
        def fn(features):
            with tf.GradientTape() as tape:
                out = layer(features)
                x = tf.concat([out[name] for name in sorted(out)], axis=1)
                loss = tf.reduce_mean(tf.square(tf.matmul(x, head) - 1.0))
            variables = layer.trainable_variables + [head]
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.run(fn, args=(features,))

    return step


def replica_ids(rows: int, seed: int, replica: int, count: int = TABLES) -> Dict:
    """`{table: ids}` one replica looks up in the batch `seed`: IDS uniform ids per table."""
    import numpy as np

    rng = np.random.default_rng(seed * 100 + replica)
    return {f"t{i}": rng.integers(0, rows, IDS) for i in range(count)}


def plan_for(rows: int, replicas: int, workers: int, count: int = TABLES):
    """`tfs.plan` of the point's tables from the batches the point times (each step's replicas' ids, joined)."""
    import numpy as np

    import tf_sharded as tfs

    per_step = [[replica_ids(rows, s, r, count) for r in range(replicas)] for s in range(STEPS_SAMPLED)]
    ids = {f"t{i}": [np.concatenate([step[r][f"t{i}"] for r in range(replicas)]) for step in per_step]
           for i in range(count)}  # fmt: skip
    kind = {"kind": "multi_worker_mirrored", "workers": workers} if workers else {"kind": "mirrored"}
    tables = {f"t{i}": {"input_dim": rows, "output_dim": DIM} for i in range(count)}
    return tfs.plan(tables, dict(kind, replicas=replicas), ids=ids, slots=SLOTS)


def _features(strategy, rows: int, seed: int, count: int = TABLES):
    import tensorflow as tf

    def value(ctx):
        ids = replica_ids(rows, seed, ctx.replica_id_in_sync_group, count)
        return {name: tf.constant(v, tf.int64) for name, v in ids.items()}

    return strategy.experimental_distribute_values_from_function(value)


def _time(strategy, rows: int, variants, sizes: Dict, count: int = TABLES) -> List[Dict]:
    """The step of each `(placement, transport)` of `variants`, in interleaved rounds on the same batches
    (drift on a shared machine then touches each alike); `transport` forces the sharded lookup's across
    workers (None: the cost model's)."""
    import contextlib

    from tf_sharded.exchange import workers
    from tf_sharded.table.batched import storage_of

    batches = [_features(strategy, rows, s, count) for s in range(STEPS_SAMPLED)]
    built = []
    for placement, transport in variants:
        layer, head, optimizer, _ = _collection(strategy, rows, placement, count=count)
        step = _step(strategy, layer, head, optimizer)
        with workers.transport_scope(transport) if transport else contextlib.nullcontext():
            step(batches[0])  # traced: the transport is chosen here
        graph = step.get_concrete_function(batches[0]).graph.as_graph_def()
        ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
        built.append((layer, optimizer, step, ops))
    rounds = [[] for _ in built]
    for _ in range(sizes["rounds"]):
        for times, (_, _, step, _) in zip(rounds, built):
            start = time.perf_counter()
            for s in range(sizes["steps"]):
                loss = step(batches[s % len(batches)])
            strategy.experimental_local_results(loss)[0].numpy()
            times.append((time.perf_counter() - start) / sizes["steps"])
    out = []
    for times, (layer, optimizer, _, ops) in zip(rounds, built):
        stored = {id(storage_of(t) or t): storage_of(t) or t for t in layer.tables.values()}.values()
        slots = [v for table in stored for v in optimizer.table_slot(table, "accumulator").held_variables]
        held = _bytes_by_device(layer.trainable_variables + slots)
        used = workers.ALLTOALL if "CollectiveAllToAllV2" in ops else workers.GATHER  # what the traced step holds
        out.append({"step_s": statistics.median(times), "bytes_per_replica": max(held.values()),
                    "devices": len(held), "transport": used})  # fmt: skip
    return out


def _child(replicas: int, quick: bool, out: Optional[str]) -> int:
    """One replica count: N logical CPUs of this process, or (`replicas` 0) this worker of a
    MultiWorkerMirroredStrategy cluster named by `TF_CONFIG`, one replica per worker; `out`: where the report
    goes (None: another worker writes it)."""
    import tensorflow as tf

    if replicas:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
        strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = 0 if replicas else strategy.num_replicas_in_sync
    replicas = strategy.num_replicas_in_sync
    sizes = _sizes(quick)
    rows_out = []
    # Across workers also other numbers of tables (at the middle size): the sharded group's rendezvous is shared
    # by its tables.
    points = [(rows, TABLES) for rows in sizes["rows"]]
    points += [(sizes["rows"][len(sizes["rows"]) // 2], n) for n in (sizes["worker_counts"] if workers else [])]
    for rows, count in points:
        # Across workers the sharded lookup also over the gather form, beside the cost model's choice.
        variants = [("sharded", None), ("device", None)] + ([("sharded", "gather")] if workers else [])
        sharded, device, *other = _time(strategy, rows, variants, sizes, count)
        whole = count * rows * DIM * 4 * 2  # tables and one Adagrad slot, float32
        transports = {}
        if other:
            assert other[0]["transport"] == "gather", other
            transports = {"transport": sharded["transport"], "sharded_gather_step_s": other[0]["step_s"],
                          "chosen_vs_gather_step": sharded["step_s"] / other[0]["step_s"]}  # fmt: skip
        rows_out.append(
            {
                **transports,
                "rows": rows,
                "tables": count,
                "table_and_slot_bytes": whole,
                "sharded_bytes_per_replica": sharded["bytes_per_replica"],
                "sharded_vs_even_share": sharded["bytes_per_replica"] / (whole / replicas),
                "device_bytes_per_replica": device["bytes_per_replica"],
                "sharded_step_s": sharded["step_s"],
                "device_step_s": device["step_s"],
                "sharded_vs_device_step": sharded["step_s"] / device["step_s"],
            }
        )
    # The plan: a replica's budget of a third of a table and its slot shards it (a shard per replica fits from
    # 3 replicas on), and the layer built from the plan trains.
    one_table, planned = sizes["memory_rows"] * DIM * 4 * 2, None
    if replicas >= 3:
        rows = sizes["memory_rows"]
        layer, head, optimizer, plan = _collection(strategy, rows, None, one_table // 3, count=1)
        step = _step(strategy, layer, head, optimizer)
        losses = [float(strategy.reduce("SUM", step(_features(strategy, rows, s, count=1)), None)) for s in range(3)]
        planned = {
            "memory_per_replica": one_table // 3,
            "table_and_slot_bytes": one_table,
            "placements": sorted({t.placement for t in plan.tables.values()}),
            "reason": plan.tables["t0"].reason,
            "built": sorted({t.placement for t in layer.tables.values()}),
            "losses": losses,
        }
    if out is not None:
        with open(out, "w") as f:
            json.dump({"replicas": replicas, "workers": workers, "results": rows_out, "plan": planned}, f)
    return 0


def _app(replicas: int, placement: str, sizes: Dict, workers: int = 0) -> Dict:
    """The application's training job, as a user runs it, with one placement: `--strategy mirrored
    --cpu_replicas N`, or with `workers` `--strategy multi_worker` in a process each (each its `TF_CONFIG`)."""
    flags = ["--placement", placement, "--steps", str(sizes["app_steps"]), "--steps_per_epoch",
             str(sizes["app_steps"]), "--max_vocab", str(sizes["app_vocab"]), "--eval_steps", "8",
             "--verbose", "0"]  # fmt: skip
    if workers:
        return children.train_summary(flags + ["--strategy", "multi_worker"], workers)
    return children.train_summary(flags + ["--strategy", "mirrored", "--cpu_replicas", str(replicas)])


def run(quick: bool = False, timeout: float = 3600.0) -> Dict:
    """Runs B12 (one process per replica count, then the application); returns the report."""
    sizes = _sizes(quick)
    per_replicas = []
    for replicas in sizes["replicas"]:
        out = tempfile.mktemp(suffix=f"_sharded_{replicas}.json")
        command = [sys.executable, "-m", "tf_sharded.benchmarks.sharded", "--replicas", str(replicas), "--out", out]
        ended = children.run_together([(command + (["--quick"] if quick else []), children.child_env())], timeout)
        if ended[0][0] != 0 or not os.path.exists(out):
            raise RuntimeError(f"B12 with {replicas} replicas failed:\n{ended[0][1][-3000:]}")
        with open(out) as f:
            per_replicas.append(json.load(f))
        os.remove(out)
    if quick:  # the tests run the multi-worker case (tests/strategy/test_multi_worker.py) and the application
        return _report(quick, sizes, per_replicas, [])
    # Across processes: WORKERS workers of MultiWorkerMirroredStrategy, one replica each (worker 0 reports).
    out = tempfile.mktemp(suffix="_sharded_workers.json")
    command = [sys.executable, "-m", "tf_sharded.benchmarks.sharded", "--replicas", "0"]
    workers = children.worker_commands(command, children.child_env(), WORKERS, ["--out", out])
    ended = children.run_together(workers, timeout)
    if any(code != 0 for code, _ in ended) or not os.path.exists(out):
        raise RuntimeError(f"B12 with {WORKERS} workers failed:\n{[err[-3000:] for _, err in ended]}")
    with open(out) as f:
        per_replicas.append(json.load(f))
    os.remove(out)
    app = []
    for replicas, workers in [(n, 0) for n in sizes["replicas"]] + [(WORKERS, WORKERS)]:
        sharded, device = (_app(replicas, p, sizes, workers) for p in ("sharded", "device"))
        app.append({
            "replicas": replicas,
            "workers": workers,
            "sharded_samples_per_s": sharded["samples_per_s"],
            "device_samples_per_s": device["samples_per_s"],
            "sharded_vs_device": sharded["samples_per_s"] / device["samples_per_s"],
            "sharded_auc": sharded["auc"],
            "device_auc": device["auc"],
            "auc_difference": sharded["auc"] - device["auc"],
        })  # fmt: skip
    return _report(quick, sizes, per_replicas, app)


def _placements(per_replicas: List[Dict]) -> Dict:
    """The cost model's constants fitted from the points, and what `tfs.plan` picks at each against what was
    faster.

    `APPLY_FACTOR`: at each point of one process, the value that makes the model's copied-minus-sharded
    difference the measured one (per table), then the median. `SHARDED_RENDEZVOUS_MS`: at each point across
    workers, the measured sharded-minus-copied step less the model's bytes for its tables, then the median.
    """
    import statistics as stats

    import numpy as np

    from tf_sharded.exchange import cost
    from tf_sharded.planning import planner

    applies, waits, points = [], [], []
    for per in per_replicas:
        replicas, workers = per["replicas"], per["workers"]
        for r in per["results"]:
            count = r.get("tables", TABLES)
            u = max(len(np.unique(ids)) for s in range(STEPS_SAMPLED) for k in range(replicas)
                    for ids in replica_ids(r["rows"], s, k, count).values())  # fmt: skip
            args = (r["rows"], DIM * 4, replicas, u, SLOTS, not workers)
            measured = (r["device_step_s"] - r["sharded_step_s"]) * 1e3 / count  # ms per table
            if workers:
                c = cost.placement_costs(*args)
                bytes_ms = (c["device"] - c["sharded"]) * count / planner.EXCHANGE_BYTES_PER_MS
                waits.append(-measured * count + bytes_ms)
            else:
                at = [cost.placement_costs(*args, apply_factor=a) for a in (0.0, 1.0)]
                d0, d1 = (c["device"] - c["sharded"] for c in at)
                applies.append((measured * planner.EXCHANGE_BYTES_PER_MS - d0) / (d1 - d0))
            chose = {t.placement for t in plan_for(r["rows"], replicas, workers, count).tables.values()}
            times = {"sharded": r["sharded_step_s"], "device": r["device_step_s"]}
            fastest = min(times, key=times.get)
            pick = chose.pop() if len(chose) == 1 else "mixed"
            ratio = times[pick] / times[fastest] if pick in times else float("inf")
            points.append({"replicas": replicas, "workers": workers, "rows": r["rows"], "tables": count,
                           "distinct_per_replica": u, "plan_chose": pick, "fastest": fastest,
                           "chosen_vs_fastest": ratio, "agrees": ratio <= 1 + NOISE})  # fmt: skip
    fitted = {
        "APPLY_FACTOR": stats.median(applies) if applies else None,
        "SHARDED_RENDEZVOUS_MS": stats.median(waits) if waits else None,
    }
    constants = {"APPLY_FACTOR": cost.APPLY_FACTOR, "SHARDED_RENDEZVOUS_MS": planner.SHARDED_RENDEZVOUS_MS}
    return {"noise": NOISE, "fitted": fitted, "constants": constants, "points": points}


def _report(quick: bool, sizes: Dict, per_replicas: List[Dict], app: List[Dict]) -> Dict:
    return {
        "benchmark": "sharded",
        "quick": quick,
        "tables": TABLES,
        "dim": DIM,
        "ids_per_replica_and_table": IDS,
        "steps": sizes["steps"],
        "rounds": sizes["rounds"],
        "app_steps": sizes["app_steps"],
        "app_max_vocab": sizes["app_vocab"],
        "results": per_replicas,
        "placement": _placements(per_replicas),
        "app": app,
    }


def replicas_label(row: Dict) -> str:
    """`4` (replicas of one process) or `2 workers` (MultiWorkerMirroredStrategy, one replica each)."""
    return f"{row['workers']} workers" if row.get("workers") else str(row["replicas"])


def app_label(row: Dict) -> str:
    """The application's strategy flags of one B12 run."""
    if row.get("workers"):
        return f"--strategy multi_worker ({row['workers']} workers)"
    return f"--strategy mirrored --cpu_replicas {row['replicas']}"


def format_rows(report: Dict) -> List[str]:
    lines = [
        f"B12 ({report['tables']} tables x {report['dim']}, {report['ids_per_replica_and_table']} ids per table and "
        "replica, Adagrad; bytes of tables and slot per replica; step times):",
        f"{'replicas':>8} {'tables':>6} {'rows':>10} | {'sharded MB':>10} {'/ even':>7} {'device MB':>10} | "
        f"{'sharded':>9} {'device':>9} {'sh/dev':>7}",
    ]
    for per in report["results"]:
        for r in per["results"]:
            lines.append(
                f"{replicas_label(per):>8} {r.get('tables', TABLES):>6} {r['rows']:>10,} | "
                f"{r['sharded_bytes_per_replica'] / 2**20:>10.1f} "
                f"{r['sharded_vs_even_share']:>7.3f} {r['device_bytes_per_replica'] / 2**20:>10.1f} | "
                f"{r['sharded_step_s'] * 1e3:>7.1f}ms {r['device_step_s'] * 1e3:>7.1f}ms "
                f"{r['sharded_vs_device_step']:>7.2f}"
            )
        plan = per["plan"]
        if plan is None:
            continue
        lines.append(
            f"{'':>8} plan with memory_per_replica {plan['memory_per_replica'] / 2**20:.1f} MB (a third of a table "
            f"and its slot): {plan['placements']}, built {plan['built']}; {plan['reason']}"
        )
    for per in report["results"]:
        for r in per["results"]:
            if "sharded_gather_step_s" in r:
                lines.append(
                    f"{replicas_label(per)}, {r['tables']} tables of {r['rows']:,} rows: sharded over {r['transport']} "
                    f"{r['sharded_step_s'] * 1e3:.1f}ms, over gather {r['sharded_gather_step_s'] * 1e3:.1f}ms: "
                    f"{r['chosen_vs_gather_step']:.2f}"
                )
    placement = report["placement"]
    for p in placement["points"]:
        where = replicas_label(p) if p["workers"] else f"{p['replicas']} replicas"
        lines.append(
            f"plan at {where}, {p['tables']} tables of {p['rows']:,} rows ({p['distinct_per_replica']} distinct "
            f"ids per replica): {p['plan_chose']}; fastest {p['fastest']}; {p['chosen_vs_fastest']:.2f}x: "
            f"{'agrees' if p['agrees'] else 'DISAGREES'}"
        )
    shown = [f"{k} {v if v is None else round(v, 3)} / {placement['constants'][k]}"
             for k, v in placement["fitted"].items()]  # fmt: skip
    lines.append("constants (fitted in this run / the model's): " + ", ".join(shown))
    for a in report["app"]:
        lines.append(
            f"train {app_label(a)}, {report['app_steps']} steps: sharded "
            f"{a['sharded_samples_per_s']:,.0f} samples/s (AUC {a['sharded_auc']:.4f}), device "
            f"{a['device_samples_per_s']:,.0f} (AUC {a['device_auc']:.4f}): {a['sharded_vs_device']:.2f}x"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="B12 child: one replica count")
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    return _child(args.replicas, args.quick, args.out)


if __name__ == "__main__":
    sys.exit(main())
