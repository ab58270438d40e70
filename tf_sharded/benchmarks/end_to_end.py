"""B4 end to end: samples/s of the main job's DLRM per strategy, against the same model on `keras.layers.Embedding`.

The model, data, optimizer, loss and metric are the main job's defaults
(`python -m tf_sharded train`): DLRM with 26 tables capped at 100,000 rows
(840,543 rows x 16), synthetic Criteo-shaped batches of 512 generated on the
fly, Adam (learning rate 0.01), binary cross-entropy and AUC, trained with
`tfs.fit` (`--quick`: the first 4 tables, capped at 1,000 rows). Three
variants per strategy, run one after the other in the same process:

* `ours`: the DLRM of `tf_sharded.models` (one `EmbeddingCollection`) with
  `tfs.optimizers.Adam` (lazy on the tables);
* `keras`: the same model with one `keras.layers.Embedding` per feature and
  `keras.optimizers.Adam` (TensorFlow's own path), wherever it runs;
* `ours_multi`: `ours` compiled with `steps_per_execution=8` (2 with
  `--quick`; Keras's argument, which `tfs.fit` honours in its own loop too):
  one dispatch per 8 steps.

Strategies: `default` (one device); `mirrored` (2 replicas on 2 logical
CPUs); `parameter_server` (the main job's local cluster: 2 ps + 2 workers,
in-process); `multi_worker` (`MultiWorkerMirroredStrategy`, 2 worker
processes on localhost). Keras 3's `model.fit` refuses parameter servers and
fails under multi-worker mirrored (keras-team/keras#20585); there `tfs.fit`
runs the Keras model's own `train_step` in its loop for both variants.

Each strategy runs in its own process(es) (`--quick`: `default` in the runner's). Per variant: one warm-up epoch
(tracing) then `epochs` timed epochs of `steps` steps; samples/s is the
median over the timed epochs. `input` is the data pipeline alone (batches
generated and dropped) in the `default` process: no training step can beat it.

    python -m tf_sharded bench e2e [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

from tf_sharded.benchmarks import children

STRATEGIES = ("default", "mirrored", "parameter_server", "multi_worker")
BATCH = 512
MAX_VOCAB = 100_000
LEARNING_RATE = 0.01
STEPS_PER_EXECUTION = 8  # the `ours_multi` variant: Keras's steps_per_execution


def _sizes(quick: bool) -> Dict:
    # --quick keeps 4 of the 26 tables: tracing 26 tables per variant and strategy is most of its time.
    if quick:
        # `batches`: the stream's first batches, made once and repeated (see `_dataset`).
        return {"max_vocab": 1_000, "tables": 4, "steps": 2, "epochs": 1, "per_execution": 2, "batches": 6}
    return {"max_vocab": MAX_VOCAB, "tables": 26, "steps": 40, "epochs": 3, "per_execution": STEPS_PER_EXECUTION}


def _strategy(name: str):
    import tensorflow as tf

    import tf_sharded as tfs

    if name == "default":
        return tf.distribute.get_strategy(), None
    if name == "mirrored":
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(2)]), None
    if name == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy(), None
    cluster = tfs.cluster.local_cluster(num_workers=2, num_ps=2)
    return cluster.strategy(), cluster


def _epoch_timer():
    """A Keras callback recording the wall time of every epoch (in `.seconds`)."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: List[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def _cause(error: Exception) -> str:
    """What stopped a variant, in one line: the message, or for TensorFlow's "Graph execution error" (whose first
    line says nothing) the op's own message, which ends it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Graph execution error"):
        return " ".join(lines[-2:])[:600]
    return (lines[0] if lines else "")[:300]


def _measure_variant(strategy, embeddings: str, sizes: Dict, steps_per_execution: int = 1) -> Dict:
    """Builds and trains one variant under `strategy`; samples/s per timed epoch, or the error that stopped it."""
    import keras

    import tf_sharded as tfs
    from tf_sharded.app import data, models

    vocab = data.vocab_sizes(sizes["max_vocab"])[: sizes["tables"]]
    ps = tfs.strategy.family_of(strategy).dataset_function

    def dataset_fn(input_context=None):
        worker = input_context.input_pipeline_id if input_context is not None else 0
        return _dataset(sizes, start=worker * 10_000_000)

    try:
        with strategy.scope():
            model = models.dlrm(vocab, embeddings=embeddings)
            optimizer = (tfs.optimizers.Adam if embeddings == "tfs" else keras.optimizers.Adam)(LEARNING_RATE)
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.BinaryCrossentropy(from_logits=True),
                metrics=[keras.metrics.AUC(from_logits=True, name="auc")],
                steps_per_execution=steps_per_execution,
            )
        timer = _epoch_timer()
        history = tfs.fit(
            model,
            dataset_fn if ps else dataset_fn(None),
            epochs=1 + sizes["epochs"],
            steps_per_epoch=sizes["steps"],
            callbacks=[timer],
            verbose=0,
        )
    except Exception as e:  # noqa: BLE001  (the baseline may not run under every strategy: reported, not fatal)
        return {"samples_per_s": None, "error": f"{type(e).__name__}: {_cause(e)}"}
    rates = [sizes["steps"] * BATCH / s for s in timer.seconds[1:]]
    return {
        "samples_per_s": statistics.median(rates),
        "epoch_samples_per_s": rates,
        "final_loss": float(history.history["loss"][-1]),
        "error": None,
    }


def _dataset(sizes: Dict, start: int = 0):
    """The synthetic batches from `start`, with the dense features and the first `sizes["tables"]` categoricals.

    With `sizes["batches"]` (`--quick`), the first that many, made once a process and repeated: a pipeline over
    values in memory, whose every iterator starts cheaply (the generator's graph, all 26 features of it, is
    optimized again for every iterator made of it, twice per training run, which was a quarter of a quick run).
    """
    import tensorflow as tf

    if sizes.get("batches"):
        with tf.init_scope():  # eager even where `tfs.fit` traces the dataset function
            features, labels = _first_batches(sizes["max_vocab"], sizes["tables"], sizes["batches"], start)
        return tf.data.Dataset.from_tensor_slices((features, labels)).repeat()
    return _stream(sizes["max_vocab"], sizes["tables"], start)


def _stream(max_vocab: int, tables: int, start: int):
    from tf_sharded.app import data

    kept = ["dense"] + data.CATEGORICAL_KEYS[:tables]
    dataset = data.synthetic_dataset(BATCH, max_vocab, seed=0, start=start)
    return dataset.map(lambda features, labels: ({k: features[k] for k in kept}, labels))


@functools.cache
def _first_batches(max_vocab: int, tables: int, count: int, start: int):
    """`_stream`'s first `count` batches from `start`, stacked (numpy)."""
    batches = list(_stream(max_vocab, tables, start).take(count).as_numpy_iterator())
    features = {k: np.stack([f[k] for f, _ in batches]) for k in batches[0][0]}
    return features, np.stack([labels for _, labels in batches])


def _input_rate(sizes: Dict) -> float:
    """Samples/s of the synthetic input pipeline alone (same batches as training)."""
    count = sizes["steps"] * sizes["epochs"]
    dataset = _dataset(sizes).take(count + 5)
    iterator = iter(dataset)
    for _ in range(5):
        next(iterator)
    start = time.perf_counter()
    for _ in range(count):
        next(iterator)
    return count * BATCH / (time.perf_counter() - start)


def _child(strategy_name: str, quick: bool, out: str) -> int:
    """One strategy, both variants, in this process (one of two processes for multi_worker)."""
    row = _measure_strategy(strategy_name, quick)
    if out:
        with open(out, "w") as f:
            json.dump(row, f)
    return 0


def _measure_strategy(strategy_name: str, quick: bool) -> Dict:
    """One strategy's row: every variant, in this process."""
    import tensorflow as tf

    if strategy_name == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    sizes = _sizes(quick)
    strategy, cluster = _strategy(strategy_name)
    try:
        row = {"strategy": strategy_name, "replicas": int(strategy.num_replicas_in_sync)}
        for name, embeddings, per_execution in (
            ("ours", "tfs", 1),
            ("keras", "keras", 1),
            ("ours_multi", "tfs", sizes["per_execution"]),
        ):
            row[name] = _measure_variant(strategy, embeddings, sizes, per_execution)
        if strategy_name == "default":
            row["input_samples_per_s"] = _input_rate(sizes)
    finally:
        if cluster is not None:
            cluster.stop()
    return row


def _run_strategy(name: str, quick: bool, timeout: float) -> Dict:
    """Runs one strategy's child process(es); returns the row written by the (first) child."""
    out = tempfile.mktemp(suffix=f"_{name}.json")
    base = [sys.executable, "-m", "tf_sharded.benchmarks.end_to_end", "--strategy", name] + (
        ["--quick"] if quick else []
    )
    env = children.child_env()
    if name == "multi_worker":
        commands = children.worker_commands(base, env, 2, first_only=["--out", out])
    else:
        commands = [(base + ["--out", out], env)]
    ended = children.run_together(commands, timeout)
    failed = [(code, err) for code, err in ended if code != 0]
    if failed or not os.path.exists(out):
        detail = failed[0][1][-3000:] if failed else "no report written"
        raise RuntimeError(f"B4 {name} failed (exit {failed[0][0] if failed else 0}):\n{detail}")
    with open(out) as f:
        row = json.load(f)
    os.remove(out)
    return row


def run(quick: bool = False, timeout: float = 1800.0) -> Dict:
    """Runs B4 for every strategy (one set of processes each); returns the report."""
    sizes = _sizes(quick)
    # --quick checks the report, not speed: two strategies' processes at once there (one at a time for figures),
    # and `default` in this process (TensorFlow as it starts, no cluster): one process fewer.
    with concurrent.futures.ThreadPoolExecutor(2 if quick else 1) as pool:
        started = [
            pool.submit(_run_strategy, name, quick, timeout) for name in STRATEGIES if not quick or name != "default"
        ]
        rows = [_measure_strategy("default", quick)] if quick else []
        rows += [future.result() for future in started]
    input_rate = rows[0].get("input_samples_per_s")
    results = []
    for row in rows:
        ours, keras_, multi = row["ours"], row["keras"], row["ours_multi"]
        for variant in (ours, multi):
            if variant["samples_per_s"] is None:
                raise RuntimeError(f"B4: tf_sharded's DLRM failed under {row['strategy']}: {variant['error']}")
        results.append(
            {
                "strategy": row["strategy"],
                "replicas": row["replicas"],
                "ours_samples_per_s": ours["samples_per_s"],
                "keras_samples_per_s": keras_["samples_per_s"],
                "keras_error": keras_["error"],
                "ours_vs_keras": (ours["samples_per_s"] / keras_["samples_per_s"] if keras_["samples_per_s"] else None),
                "ours_vs_input": ours["samples_per_s"] / input_rate,
                "ours_multi_samples_per_s": multi["samples_per_s"],
                "ours_multi_vs_ours": multi["samples_per_s"] / ours["samples_per_s"],
                "ours_final_loss": ours["final_loss"],
                "keras_final_loss": keras_.get("final_loss"),
            }
        )
    return {
        "benchmark": "e2e",
        "quick": quick,
        "model": "dlrm",
        "batch": BATCH,
        "max_vocab": sizes["max_vocab"],
        "tables": sizes["tables"],
        "steps_per_epoch": sizes["steps"],
        "timed_epochs": sizes["epochs"],
        "steps_per_execution_multi": sizes["per_execution"],
        "input_samples_per_s": input_rate,
        "results": results,
    }


def format_rows(report: Dict) -> List[str]:
    multi = f"ours x{report['steps_per_execution_multi']}/step"
    lines = [
        f"B4 (DLRM, batch {report['batch']}, {report['tables']} tables capped at {report['max_vocab']:,} rows; "
        f"input pipeline alone "
        f"{report['input_samples_per_s']:,.0f} samples/s; samples/s):",
        f"{'strategy':>18} | {'ours':>8} {'keras':>8} {multi:>16} | {'ours/keras':>10} {'ours/input':>10} "
        f"{'multi/ours':>10}",
    ]
    for r in report["results"]:
        keras_rate = f"{r['keras_samples_per_s']:>8,.0f}" if r["keras_samples_per_s"] else f"{'n/a':>8}"
        ratio = f"{r['ours_vs_keras']:>10.2f}" if r["ours_vs_keras"] else f"{'n/a':>10}"
        lines.append(
            f"{r['strategy']:>18} | {r['ours_samples_per_s']:>8,.0f} {keras_rate} "
            f"{r['ours_multi_samples_per_s']:>16,.0f} | {ratio} {r['ours_vs_input']:>10.2f} "
            f"{r['ours_multi_vs_ours']:>10.2f}"
        )
        if r["keras_error"]:
            lines.append(f"{'':>18}   keras: {r['keras_error']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="B4 child: one strategy, both variants")
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    return _child(args.strategy, args.quick, args.out)


if __name__ == "__main__":
    sys.exit(main())
