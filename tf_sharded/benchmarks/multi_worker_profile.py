"""B10: what bounds B4's multi-worker mirrored step on this machine: the step taken apart.

B4 trains the main job's DLRM under `MultiWorkerMirroredStrategy` with two
worker processes on localhost at a fraction of the one-process rate. This
benchmark runs the same model (B4's `ours`: 26 tables capped at 100,000 rows
x 16, global batch 512, so 256 examples per worker, `tfs.optimizers.Adam`)
in two worker processes and measures, in the same run:

* `step_ms`: `tfs.fit`'s step (`tfs.training.train_function`), the mean
  of 30 steps timed together, after as many untimed ones;
* `collectives`: the collective ops in that traced step, by type (each is a
  rendezvous of the two processes over gRPC);
* each collective alone, in the same processes: a 4-byte all-reduce (the
  latency floor of one rendezvous), an all-reduce of the model's dense
  gradients (one tensor of their total size) and an all-gather of a batch's
  embedding gradients (the rows and int64 ids of 26 x 256 looked-up ids);
* `compute_*_ms`: the same step on one process under the default strategy
  at the per-worker batch (256), with both cores and with one thread (two
  workers share two cores), i.e. the work a worker does between rendezvous.

    python -m tf_sharded bench mwprofile [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

from tf_sharded.benchmarks import children

GLOBAL_BATCH = 512
WORKERS = 2
COLLECTIVE_OPS = (
    "CollectiveReduceV2",
    "CollectiveGatherV2",
    "CollectiveAllToAllV2",
    "CollectiveReduceScatterV2",
    "CollectiveBcastSendV2",
    "CollectiveBcastRecvV2",
)


def _sizes(quick: bool) -> Dict:
    if quick:
        return {"max_vocab": 1_000, "tables": 4, "steps": 2, "repeats": 2, "batches": 6}  # `batches`: as B4's
    return {"max_vocab": 100_000, "tables": 26, "steps": 30, "repeats": 20}


def _model(strategy, sizes: Dict):
    import keras

    import tf_sharded as tfs
    from tf_sharded.app import data, models

    vocab = data.vocab_sizes(sizes["max_vocab"])[: sizes["tables"]]
    with strategy.scope():
        model = models.dlrm(vocab, embeddings="tfs")
        model.compile(
            optimizer=tfs.optimizers.Adam(0.01),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.AUC(from_logits=True, name="auc")],
        )
    return model


def _dataset(sizes: Dict, batch: int):
    from tf_sharded.benchmarks.end_to_end import _dataset as b4_dataset

    return b4_dataset(sizes).unbatch().batch(batch, drop_remainder=True)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (tracing, first rendezvous)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def count_ops(concrete) -> Dict[str, int]:
    """Collective ops of a concrete function, its nested functions (loops, conditions) included."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    counts = {op: sum(1 for n in nodes if n.op == op) for op in COLLECTIVE_OPS}
    return {op: n for op, n in counts.items() if n}


def _step_runner(model, strategy, dataset):
    """`(run one step and wait for it, the traced step)` for `model` under `strategy`."""
    import tensorflow as tf

    import tf_sharded as tfs

    # Variables first, as tfs.fit does (one step of it), then the step it runs.
    tfs.fit(model, dataset, epochs=1, steps_per_epoch=1, verbose=0)
    step = tfs.training.train_function(model, strategy)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    concrete = step.get_concrete_function(next(iterator))

    def run():
        logs = step(next(iterator))
        tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0].numpy(), logs)

    return run, concrete


def _worker(sizes: Dict, out: str) -> int:
    """One of the two worker processes (TF_CONFIG set by `run`)."""
    import numpy as np
    import tensorflow as tf

    from tf_sharded.table.protocol import owner_of

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    model = _model(strategy, sizes)
    run_step, concrete = _step_runner(model, strategy, _dataset(sizes, GLOBAL_BATCH))
    step_ms = _median_ms(lambda: [run_step() for _ in range(sizes["steps"])], 1) / sizes["steps"]

    dense = sum(int(np.prod(v.shape)) for v in model.trainable_variables if owner_of(v) is None)
    rows = sizes["tables"] * GLOBAL_BATCH // WORKERS
    dim = 16

    def collective(kind: str, value):
        @tf.function
        def once():
            def fn():
                ctx = tf.distribute.get_replica_context()
                if kind == "reduce":
                    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)
                return [ctx.all_gather(v, axis=0) for v in value]

            return strategy.run(fn)

        return lambda: tf.nest.map_structure(lambda t: strategy.experimental_local_results(t)[0].numpy(), once())

    with strategy.scope():
        scalar = tf.constant(1.0)
        dense_grads = tf.ones([dense])
        sparse = [tf.ones([rows, dim]), tf.range(rows, dtype=tf.int64)]
    report = {
        "step_ms": step_ms,
        "collectives": count_ops(concrete),
        "scalar_all_reduce_ms": _median_ms(collective("reduce", scalar), sizes["repeats"]),
        "dense_all_reduce_ms": _median_ms(collective("reduce", dense_grads), sizes["repeats"]),
        "sparse_all_gather_ms": _median_ms(collective("gather", sparse), sizes["repeats"]),
        "dense_parameters": dense,
        "gathered_rows": rows,
    }
    if out:
        with open(out, "w") as f:
            json.dump(report, f)
    return 0


def _compute(sizes: Dict, threads: int, out: str) -> int:
    """The per-worker batch's step on one process, default strategy, with `threads` threads (0: TF's default)."""
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    strategy = tf.distribute.get_strategy()
    model = _model(strategy, sizes)
    run_step, _ = _step_runner(model, strategy, _dataset(sizes, GLOBAL_BATCH // WORKERS))
    ms = _median_ms(lambda: [run_step() for _ in range(sizes["steps"])], 1) / sizes["steps"]
    with open(out, "w") as f:
        json.dump({"ms": ms}, f)
    return 0


def _launch(commands: List, timeout: float) -> None:
    for code, err in children.run_together(commands, timeout):
        if code != 0:
            raise RuntimeError(f"B10: a child failed (exit {code}):\n{err[-3000:]}")


def run(quick: bool = False, timeout: float = 1800.0) -> Dict:
    sizes = _sizes(quick)
    work = tempfile.mkdtemp(prefix="tfs_b10_")
    base = [sys.executable, "-m", "tf_sharded.benchmarks.multi_worker_profile"] + (["--quick"] if quick else [])
    env = children.child_env()
    worker_out = os.path.join(work, "worker.json")
    _launch(children.worker_commands(base + ["--role", "worker"], env, WORKERS, ["--out", worker_out]), timeout)
    with open(worker_out) as f:
        report = json.load(f)
    for threads in (0, 1):  # one after the other: each has the machine to itself
        out = os.path.join(work, f"compute_{threads}.json")
        if quick and threads == 0:  # TensorFlow's default threads are this process's: one process fewer
            _compute(sizes, 0, out)
        else:
            _launch([(base + ["--role", "compute", "--threads", str(threads), "--out", out], env)], timeout)
        with open(out) as f:
            report["compute_all_cores_ms" if threads == 0 else "compute_one_thread_ms"] = json.load(f)["ms"]
    n = sum(report["collectives"].values())
    report.update(
        benchmark="mwprofile",
        quick=quick,
        tables=sizes["tables"],
        max_vocab=sizes["max_vocab"],
        global_batch=GLOBAL_BATCH,
        workers=WORKERS,
        samples_per_s=GLOBAL_BATCH / (report["step_ms"] / 1e3),
        collective_count=n,
        # A lower bound of the rendezvous cost: every collective at least waits one scalar rendezvous.
        rendezvous_floor_ms=n * report["scalar_all_reduce_ms"],
    )
    return report


def format_rows(report: Dict) -> List[str]:
    ops = ", ".join(f"{n} {op}" for op, n in sorted(report["collectives"].items()))
    return [
        f"B10 (DLRM, {report['tables']} tables capped at {report['max_vocab']:,}, {report['workers']} worker "
        f"processes, global batch {report['global_batch']}):",
        f"  step {report['step_ms']:.1f} ms ({report['samples_per_s']:,.0f} samples/s); collectives in the step: {ops}",
        f"  alone: scalar all-reduce {report['scalar_all_reduce_ms']:.2f} ms; dense gradients all-reduce "
        f"({report['dense_parameters']:,} floats) {report['dense_all_reduce_ms']:.2f} ms; embedding gradients "
        f"all-gather ({report['gathered_rows']:,} rows + ids) {report['sparse_all_gather_ms']:.2f} ms",
        f"  {report['collective_count']} rendezvous x the scalar latency = {report['rendezvous_floor_ms']:.1f} ms; "
        f"the per-worker batch's step on one process: {report['compute_all_cores_ms']:.1f} ms (both cores), "
        f"{report['compute_one_thread_ms']:.1f} ms (one thread)",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="B10 child")
    parser.add_argument("--role", choices=["worker", "compute"], required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    sizes = _sizes(args.quick)
    if args.role == "worker":
        return _worker(sizes, args.out)
    return _compute(sizes, args.threads, args.out)


if __name__ == "__main__":
    sys.exit(main())
