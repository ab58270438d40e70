"""A `tfs.fit` run on a process-per-task cluster with one task killed mid-run (B8 and the fault tests run it).

    python -m tf_sharded.benchmarks.fault_job OUT.json [--kill ps:1] [--workers 1] [--dynamic] [--after SECONDS]
        [--max_restarts N] [--no_checkpoints] [--unnamed_errors]

With `--kill ps:N` it also prints the recovery time (seconds from the kill to
the first step completed after the restore) and the steps redone.

Trains a sharded embedding (or two dynamic tables sharing row pools) and a dense layer for a fixed number
of steps with checkpoints, kills the named task with SIGKILL once training
has begun (the cluster restarts it), and writes the result: steps counted,
`optimizer.iterations`, the cluster's restarts, the recoveries `tfs.fit`
reports, when the first step completed and the run ended, and every weight.
"""

import argparse
import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sharded as tfs  # noqa: E402
from tf_sharded.keras.training import recovery  # noqa: E402

STEPS_PER_EPOCH, EPOCHS, BATCH = 150, 2, 64


def dataset_fn(context=None):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 60, (BATCH * 8, 3))
    labels = (ids[:, 0] % 2).astype(np.float32)[:, None]
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH).repeat()


DYNAMIC = ("a", "b")  # two dynamic tables of one width: under parameter servers they share a row pool per ps


def build(strategy, dynamic: bool):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        inp = keras.Input((3,), dtype="int64")
        if dynamic:
            tables = {n: {"vocabulary": "dynamic", "output_dim": 4, "seed": 5 + i} for i, n in enumerate(DYNAMIC)}
            features = {"a": {"table": "a", "combiner": "mean"}, "b": "b"}
            rows = tfs.layers.EmbeddingCollection(tables, features, name="emb")({"a": inp[:, :2], "b": inp[:, 2]})
            embedded = keras.layers.Concatenate()([rows["a"], rows["b"]])
        else:
            embedded = tfs.layers.Embedding(60, 4, combiner="mean", partitions=2, seed=5, name="emb")(inp)
        out = keras.layers.Dense(1, name="dense")(embedded)
        model = keras.Model(inp, out)
        model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
    return model


def weights_of(model, dynamic: bool) -> dict:
    out = {"kernel": model.get_layer("dense").kernel.numpy(), "bias": model.get_layer("dense").bias.numpy()}
    layer = model.get_layer("emb")
    if dynamic:
        for name in DYNAMIC:
            keys, values = layer.tables[name].export()
            order = np.argsort(keys.numpy())
            out[f"keys_{name}"], out[f"rows_{name}"] = keys.numpy()[order], values.numpy()[order]
    else:
        out["rows"] = layer.embeddings.numpy()
    return {k: np.asarray(v).tolist() for k, v in out.items()}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", default=None, help="job:index of the task to kill, e.g. ps:1")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--dynamic", action="store_true")
    parser.add_argument("--after", type=float, default=1.0, help="seconds after the first step to kill")
    parser.add_argument("--max_restarts", type=int, default=2)
    parser.add_argument("--no_checkpoints", action="store_true", help="tfs.fit without a checkpoint_dir")
    parser.add_argument(
        "--unnamed_errors",
        action="store_true",
        help="read no task from the first error's message, so the failed ps is found by asking the cluster "
        "(as for an input iterator's OutOfRangeError after a retried step)",
    )
    args = parser.parse_args(argv)
    if args.unnamed_errors:
        named, hidden = recovery.failed_ps, False

        def unnamed_first(error):
            nonlocal hidden
            if hidden:
                return named(error)
            hidden = True
            return set()

        recovery.failed_ps = unnamed_first
    tf.get_logger().setLevel("ERROR")
    started = threading.Event()
    times = {}

    class Started(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not started.is_set():
                times["first_step"] = time.time()
                started.set()

    times["cluster_start"] = time.time()
    with tfs.cluster.LocalCluster(args.workers, 2, mode="process") as cluster:
        strategy = cluster.strategy()
        times["cluster_ready"] = time.time()
        model = build(strategy, args.dynamic)

        def kill():
            job, index = args.kill.split(":")
            if started.wait(120):
                time.sleep(args.after)
                times["killed"] = time.time()
                cluster.kill(job, int(index))

        if args.kill:
            threading.Thread(target=kill, daemon=True).start()
        history = tfs.fit(
            model,
            dataset_fn,
            epochs=EPOCHS,
            steps_per_epoch=STEPS_PER_EPOCH,
            checkpoint_dir=None if args.no_checkpoints else tempfile.mkdtemp(),
            checkpoint_every=50,
            max_restarts=args.max_restarts,
            callbacks=[Started()],
            verbose=0,
            log_every=5,
        )
        result = {
            "steps": tfs.training.steps_done(model),
            "iterations": int(model.optimizer.iterations.numpy()),
            "restarts": [list(t) for t in cluster.restarts],
            "recoveries": history.recoveries,
            "killed_at": times.get("killed"),
            "first_step_time": times["first_step"],
            "end_time": time.time(),
            "cluster_start_s": times["cluster_ready"] - times["cluster_start"],
            "weights": weights_of(model, args.dynamic),
        }
    with open(args.out, "w") as f:
        json.dump(result, f)
    for event in history.recoveries:
        # The recovery time a user sees: from the kill to the first step that completed after the restore.
        print(
            f"recovery: {', '.join(f'ps:{t}' for t in event['tasks'])} failed at step {event['failed_at']}; "
            f"restored step {event['restored']}; "
            f"first new step {event['first_step_time'] - times['killed']:.1f}s after the kill; "
            f"{event['failed_at'] - event['restored']} steps redone"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
