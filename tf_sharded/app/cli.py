"""`python -m tf_sharded train`: the training application (DLRM / DeepFM / MLP on a user's files or synthetic data).

    python -m tf_sharded train                                  # DLRM, synthetic data, local 2 ps + 2 workers
    python -m tf_sharded train --model deepfm --strategy mirrored --steps 500
    python -m tf_sharded train --data day_0.tsv --checkpoint_dir /tmp/ctr   # Criteo TSV; a rerun resumes
    python -m tf_sharded train --data ratings/ --schema schema.json --model mlp   # any columns (schema.py)
    TF_CONFIG=... python -m tf_sharded train --strategy parameter_server     # one process per task

It prints a progress bar (step, loss, samples/s), then held-out metrics
(binary label: AUC and log-loss; regression: MSE and RMSE), the checkpoint
path and a one-line summary. Bad flags, unreadable or unsuitable files and
malformed input (under `--strict`) are reported in one line naming the flag
and file, before training, with a non-zero exit code.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from typing import List

import numpy as np
from absl import flags

STRATEGIES = ("parameter_server", "mirrored", "multi_worker", "hybrid", "default")


def define_flags(values: flags.FlagValues) -> None:
    flags.DEFINE_enum("model", "dlrm", ["dlrm", "deepfm", "mlp"], "Model to train.", flag_values=values)
    flags.DEFINE_string(
        "data",
        "synthetic",
        "'synthetic', or a file, directory or glob of TSV / CSV / TFRecord / Parquet files (gzip allowed).",
        flag_values=values,
    )
    flags.DEFINE_string(
        "schema", None, "Feature schema (JSON; see `schema infer`). Default: Criteo's layout.", flag_values=values
    )
    flags.DEFINE_enum(
        "format", "auto", ["auto", "tsv", "csv", "tfrecord", "parquet"], "Input format.", flag_values=values
    )
    flags.DEFINE_string(
        "cache_dir",
        None,
        "Where Parquet is converted once for reading where tensorflow-io cannot read it (its ops do not load "
        "into this TensorFlow, or a column has nulls); every worker must be able to read it. "
        "Default: $TF_SHARDED_CACHE/parquet, else ~/.cache/tf_sharded/parquet.",
        flag_values=values,
    )
    flags.DEFINE_enum(
        "strategy",
        "parameter_server",
        list(STRATEGIES),
        "tf.distribute strategy. Without TF_CONFIG each starts its local cluster: parameter_server --num_ps "
        "parameter servers and --num_workers workers; hybrid (tables on parameter servers, the rest all-reduced "
        "over the workers) --num_ps table servers and --num_workers workers, a process each; multi_worker "
        "--num_workers workers, a process each (this process alone unless --num_workers is given).",
        flag_values=values,
    )
    flags.DEFINE_integer(
        "num_workers",
        None,
        "Workers of the local cluster (without TF_CONFIG). Default: 2 (multi_worker: 1, this process alone).",
        lower_bound=1,
        flag_values=values,
    )
    flags.DEFINE_integer(
        "num_ps",
        2,
        "Parameter servers (hybrid: table servers) of the local cluster (without TF_CONFIG).",
        lower_bound=1,
        flag_values=values,
    )
    flags.DEFINE_enum(
        "local_cluster",
        "inprocess",
        ["inprocess", "process"],
        "The local cluster's servers: threads of this process, or one process per task.",
        flag_values=values,
    )
    flags.DEFINE_enum(
        "local_cluster_isolation",
        "auto",
        ["auto", "required", "none"],
        "The local cluster's network: auto runs it in a network namespace of its own, where its ports answer "
        "on its loopback only (Linux), else warns in one line which ports other machines can reach; required "
        "refuses to start it then; none: neither.",
        flag_values=values,
    )
    flags.DEFINE_integer(
        "steps", 200, "Training steps in all: a resumed run trains up to this count.", lower_bound=1, flag_values=values
    )
    flags.DEFINE_integer(
        "steps_per_epoch", 100, "Steps between checkpoints / progress lines.", lower_bound=1, flag_values=values
    )
    flags.DEFINE_integer("batch_size", 512, "Global batch size.", lower_bound=1, flag_values=values)
    flags.DEFINE_integer(
        "steps_per_execution",
        1,
        "Training steps per dispatched function (Keras's compile argument; amortises the per-step "
        "scheduling cost, most under parameter_server).",
        lower_bound=1,
        flag_values=values,
    )
    flags.DEFINE_enum(
        "optimizer", "adam", ["sgd", "adagrad", "adam", "ftrl"], "tfs.optimizers class.", flag_values=values
    )
    flags.DEFINE_float("learning_rate", 0.01, "Learning rate.", lower_bound=0.0, flag_values=values)
    flags.DEFINE_string(
        "checkpoint_dir", None, "Periodic checkpoints; a rerun resumes from the latest.", flag_values=values
    )
    flags.DEFINE_string(
        "logdir",
        None,
        "TensorBoard summaries: the loss, the metric, samples/s and every table's rows, bytes and shard load "
        "(default: <checkpoint_dir>/logs with --checkpoint_dir; none without).",
        flag_values=values,
    )
    flags.DEFINE_integer(
        "metrics_every", 100, "Steps between two reports of the tables' metrics.", lower_bound=1, flag_values=values
    )
    flags.DEFINE_boolean(
        "table_metrics",
        True,
        "Report the tables' metrics and write the TensorBoard summaries (tfs.callbacks.TableMetrics); "
        "--notable_metrics trains without them.",
        flag_values=values,
    )
    flags.DEFINE_integer(
        "eval_steps", 20, "Held-out batches for the reported metrics.", lower_bound=1, flag_values=values
    )
    flags.DEFINE_integer(
        "max_vocab",
        100_000,
        "Cap on each table's rows of Criteo's layout (without --schema).",
        lower_bound=2,
        flag_values=values,
    )
    flags.DEFINE_enum(
        "vocabulary",
        "hashed",
        ["hashed", "dynamic"],
        "Categorical values: hashed into each table's rows (--max_vocab or the schema's buckets), or raw "
        "values as the keys of dynamic tables (no cap, no collisions).",
        flag_values=values,
    )
    for name, meaning in (
        ("min_count", "a key gets a row once it has occurred this many times (fewer: it reads its initial row)"),
        ("evict_after_steps", "the rows of keys unseen for this many steps are freed"),
        ("max_keys", "each table holds at most this many live keys, the least recently seen going first"),
    ):
        flags.DEFINE_integer(
            name,
            None,
            f"Dynamic tables (--vocabulary dynamic, or a schema column's): {meaning}. A column's own "
            f'"{name}" in the schema wins. Default: no bound.',
            lower_bound=1,
            flag_values=values,
        )
    flags.DEFINE_integer("embedding_dim", 16, "Embedding width.", lower_bound=1, flag_values=values)
    flags.DEFINE_integer(
        "cpu_replicas",
        0,
        "--strategy mirrored on a machine without accelerators: split the CPU into this many devices, one "
        "replica each (0: one replica per device TensorFlow finds).",
        lower_bound=0,
        flag_values=values,
    )
    flags.DEFINE_enum(
        "placement",
        None,
        ["device", "host", "sharded", "auto"],
        "Where each table lives under --strategy mirrored|multi_worker: a copy per replica (device), one per "
        "worker in host memory (host), split over the replicas (sharded), or by size (auto). "
        "Default: the strategy's (auto).",
        flag_values=values,
    )
    flags.DEFINE_enum(
        "plan",
        "none",
        ["none", "auto"],
        "auto: tfs.plan lays out each table for --strategy from a sample of the data (held-out batches) and "
        "prints the plan; none: the strategy's defaults.",
        flag_values=values,
    )
    flags.DEFINE_boolean(
        "strict",
        False,
        "Fail before training on the first malformed record (default: skip and count).",
        flag_values=values,
    )
    flags.DEFINE_integer("seed", 0, "Seed of the synthetic data and of every initializer.", flag_values=values)
    flags.DEFINE_integer("verbose", 1, "0: summary only; 1: progress bar.", flag_values=values)


def _strategy(args):
    """(strategy, description, input pipelines, local cluster to stop or None) for `--strategy`."""
    import tensorflow as tf

    import tf_sharded as tfs

    name = args.strategy
    if name == "default":
        return tf.distribute.get_strategy(), "default", 1, None
    if name == "mirrored":
        if args.cpu_replicas:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * args.cpu_replicas
            )
            s = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
            return s, f"mirrored ({s.num_replicas_in_sync} replicas on CPU devices)", 1, None
        s = tf.distribute.MirroredStrategy()
        return s, f"mirrored ({s.num_replicas_in_sync} replicas)", 1, None
    if name == "multi_worker":
        return _multi_worker_strategy(args)
    if name == "hybrid":
        return _hybrid_strategy(args)
    if os.environ.get("TF_CONFIG"):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        if resolver.task_type in ("worker", "ps"):
            return None, resolver, 0, None  # a server task: serve until the chief is done
        s = tf.distribute.ParameterServerStrategy(resolver)
        spec = resolver.cluster_spec().as_dict()
        workers = len(spec.get("worker", []))
        return s, f"parameter_server ({len(spec.get('ps', []))} ps, {workers} workers, TF_CONFIG)", workers, None
    from tf_sharded.app.readers import LOAD_OPS

    num_workers = args.num_workers or 2
    cluster = tfs.cluster.local_cluster(
        num_workers=num_workers,
        num_ps=args.num_ps,
        mode=args.local_cluster,
        imports=[LOAD_OPS],
        isolation=args.local_cluster_isolation,
    )
    where = "local cluster" if args.local_cluster == "inprocess" else "local cluster, a process per task"
    description = f"parameter_server ({where}: {args.num_ps} ps, {num_workers} workers)"
    return cluster.strategy(), description, num_workers, cluster if args.local_cluster == "process" else None


def _multi_worker_strategy(args):
    """`--strategy multi_worker`: this task of TF_CONFIG, else with `--num_workers N` a local cluster of N
    workers (this process and N - 1 running this same command), else this process alone."""
    import tensorflow as tf

    from tf_sharded.app import restart
    from tf_sharded.lifetime import exit_with_parent
    from tf_sharded.local_workers import LocalWorkers

    if os.environ.get("TF_CONFIG"):
        exit_with_parent()  # a worker a local cluster started: it ends with the job
        s = tf.distribute.MultiWorkerMirroredStrategy()
        workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"].get("worker", []))
        return s, f"multi_worker ({s.num_replicas_in_sync} replicas, {workers} workers, TF_CONFIG)", 1, None
    if not args.num_workers or args.num_workers == 1:
        s = tf.distribute.MultiWorkerMirroredStrategy()
        return s, f"multi_worker ({s.num_replicas_in_sync} replicas)", 1, None
    cluster = LocalWorkers(
        args.num_workers, worker_command=[sys.executable, "-m", "tf_sharded", *sys.argv[1:]],
        isolation=args.local_cluster_isolation,
        on_failure=lambda cluster, reason: restart.restart(reason, args.checkpoint_dir, cluster),
    ).start()  # fmt: skip
    s = cluster.strategy()
    return (
        s,
        f"multi_worker ({s.num_replicas_in_sync} replicas; local: {args.num_workers} workers, a process each)",
        1,
        cluster,
    )


def _hybrid_strategy(args):
    """`--strategy hybrid`: this task of TF_CONFIG (a ps task serves tables), else a local cluster whose other
    workers run this same command."""
    import tf_sharded as tfs

    if os.environ.get("TF_CONFIG"):
        from tf_sharded.lifetime import exit_with_parent

        exit_with_parent()  # a worker a local cluster started: it ends with the job
        config = json.loads(os.environ["TF_CONFIG"])
        if config["task"]["type"] == "ps":
            return None, "tables", 0, None
        s = tfs.hybrid.HybridStrategy.from_tf_config()
        spec = config["cluster"]
        servers = f"{len(spec['ps'])} table server{'s' if len(spec['ps']) > 1 else ''}"
        return s, f"hybrid ({s.num_replicas_in_sync} workers, {servers}, TF_CONFIG)", 1, None
    from tf_sharded.app import restart

    command = [sys.executable, "-m", "tf_sharded", *sys.argv[1:]]
    num_workers = args.num_workers or 2
    cluster = tfs.hybrid.LocalHybridCluster(
        num_workers, args.num_ps, worker_command=command, isolation=args.local_cluster_isolation,
        on_failure=lambda cluster, reason: restart.restart(reason, args.checkpoint_dir, cluster),
    ).start()  # fmt: skip
    where = f"local: {args.num_ps} table server{'s' if args.num_ps > 1 else ''}, {num_workers} workers, a process each"
    return cluster.strategy(), f"hybrid ({where})", 1, cluster


def _serve(resolver) -> int:
    """A worker or ps task of a TF_CONFIG cluster: run the server until the process is stopped."""
    import tensorflow as tf

    from tf_sharded.app.readers import load_ops

    load_ops()  # the workers run the readers' custom ops (Parquet)

    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    print(f"serving as {resolver.task_type}:{resolver.task_id} at {server.target}", flush=True)
    server.join()
    return 0


def _evaluate(model, held_out, binary: bool):
    """Held-out metrics from the model's predictions (read on this process): AUC and log-loss, or MSE and
    RMSE; and the number of examples."""
    import keras

    predictions, labels = [], []
    for features, y in held_out:
        output = model(features, training=False).numpy().ravel()
        predictions.append(1.0 / (1.0 + np.exp(-output)) if binary else output)
        labels.append(y.numpy().ravel())
    p, y = np.concatenate(predictions), np.concatenate(labels)
    if not binary:
        mse = float(np.mean((p - y) ** 2))
        return {"MSE": mse, "RMSE": math.sqrt(mse)}, len(y)
    auc = keras.metrics.AUC(num_thresholds=2000)
    auc.update_state(y, p)
    eps = 1e-7
    logloss = float(-np.mean(y * np.log(np.clip(p, eps, 1)) + (1 - y) * np.log(np.clip(1 - p, eps, 1))))
    return {"AUC": float(auc.result().numpy()), "log-loss": logloss}, len(y)


def train(args) -> int:
    import tensorflow as tf

    from tf_sharded.app import inputs, restart

    inputs.check_writable(args.checkpoint_dir)
    inputs.check_writable(args.logdir, "--logdir")  # the default, in --checkpoint_dir, is checked with it
    # `workers`: input pipelines (each parameter-server worker reads its own; else one stream).
    strategy, description, workers, cluster = _strategy(args)
    if strategy is None and description == "tables":
        from tf_sharded.hybrid.server import serve_from_tf_config

        server = serve_from_tf_config()
        print(f"serving tables at {server.address}", flush=True)
        server.join()
    if strategy is None:
        return _serve(description)
    try:
        code = _train(args, strategy, description, workers)
        if hasattr(cluster, "wait_for_workers"):
            cluster.wait_for_workers()
        return code
    except Exception as e:
        # A hybrid step fails as soon as a peer is lost, often before the local cluster's watcher sees it.
        failed = (
            cluster.failure(wait=2.0 if isinstance(e, tf.errors.OpError) else 0)
            if hasattr(cluster, "failure")
            else None
        )
        if failed:
            restart.restart(failed, args.checkpoint_dir, cluster)
            raise restart.JobFailure(failed) from e
        raise
    finally:
        if cluster is not None:
            # A function's last reference going away asks every task to forget it: with the tasks already
            # stopped, TensorFlow logged ~150 lines of gRPC errors at exit. Release them while the tasks run.
            strategy = workers = None
            gc.collect()
            cluster.stop()


def _train(args, strategy, description, workers) -> int:
    import keras
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.app import footprint, inputs, models
    from tf_sharded.app.schema import LabelType

    ps = tfs.strategy.family_of(strategy).dataset_function
    plan = inputs.plan(args, workers, strategy)
    inputs.save_schema(plan.schema, args.checkpoint_dir)
    binary = plan.schema.label.type == LabelType.BINARY
    # Every initializer (not only the tables') draws from --seed: two runs with the same flags are the same
    # run, and a killed run resumed from its checkpoint ends where an uninterrupted one does.
    keras.utils.set_random_seed(args.seed)
    planner = _planner(args, strategy, plan)
    with strategy.scope():
        model = models.build(
            args.model,
            plan.schema,
            embedding_dim=args.embedding_dim,
            table_options={"placement": args.placement} if args.placement else None,
            output_bias=models.output_bias(plan.scanned, binary),
            plan=planner,
        )
        optimizer = tfs.optimizers.get(args.optimizer)
        optimizer.learning_rate = args.learning_rate
        if binary:
            loss, metrics = (
                keras.losses.BinaryCrossentropy(from_logits=True),
                [keras.metrics.AUC(from_logits=True, name="auc")],
            )
        else:
            loss, metrics = keras.losses.MeanSquaredError(), [keras.metrics.RootMeanSquaredError(name="rmse")]
        model.compile(optimizer=optimizer, loss=loss, metrics=metrics, steps_per_execution=args.steps_per_execution)
    steps_per_epoch = min(args.steps, args.steps_per_epoch)
    epochs = math.ceil(args.steps / steps_per_epoch)
    dataset = plan.train_fn if ps else plan.train_fn(None)
    print(
        f"training {args.model} on {plan.description} under {description}: {args.steps} steps of {args.batch_size}",
        flush=True,
    )
    start = time.perf_counter()
    history = tfs.fit(
        model,
        dataset,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        checkpoint_dir=args.checkpoint_dir,
        verbose=args.verbose,
        log_every=10,
        max_steps=args.steps,
        callbacks=[tfs.callbacks.TableMetrics(args.metrics_every, inputs.log_dir(args), write_logs=True)]
        if args.table_metrics
        else [],
    )
    elapsed = time.perf_counter() - start
    trained = tfs.training.steps_done(model) - history.initial_step
    rate = history.history.get("samples_per_second", [float("nan")])[-1] if ps else trained * args.batch_size / elapsed
    metrics, evaluated = _evaluate(model, plan.held_out, binary)
    checkpoint = tf.train.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if plan.scanned is not None and plan.scanned.malformed:
        print(f"skipped {plan.scanned.malformed} malformed record(s); first: {plan.scanned.first_error}")
    shown = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())
    print(f"held-out {shown} on {evaluated} examples")
    print(footprint.describe(footprint.footprint(model)))
    print(f"checkpoint: {checkpoint or '(none: pass --checkpoint_dir)'}")
    print(
        f"summary: {args.model} | {description} | {tfs.training.steps_done(model)} steps "
        f"({trained} this run) | batch {args.batch_size} | {rate:,.0f} samples/s | "
        + " | ".join(f"{name} {value:.4f}" for name, value in metrics.items()),
        flush=True,
    )
    return 0


def _planner(args, strategy, data):
    """For `--plan auto`: a function making (and printing) each collection's `tfs.plan` from a sample of the
    held-out batches; None for `--plan none`."""
    if args.plan != "auto":
        return None
    import tf_sharded as tfs
    from tf_sharded.planning.planner import ids_from_batches

    # Dynamic tables take text keys, not ids: nothing to sample for them.
    features = {f.name: f.table_name for f in data.schema.embedded if f.vocabulary != "dynamic"}
    sample = ids_from_batches(data.held_out.take(8), features)

    def make(tables, name):
        made = tfs.plan(tables, strategy, ids={t: ids for t, ids in sample.items() if t in tables})
        print(f"{name}: {made}", flush=True)
        return made

    return make


def inspect_checkpoint(path: str) -> int:
    """Prints the tables (and other variables) of a checkpoint: shape, dtype, size, saved layout."""
    import tensorflow as tf

    if os.path.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in directory {path!r}")
        directory, path = path, latest
    else:
        directory = os.path.dirname(path)
    try:
        reader = tf.train.load_checkpoint(path)
    except (tf.errors.NotFoundError, tf.errors.DataLossError, tf.errors.InvalidArgumentError):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}: expected a checkpoint directory or a checkpoint's prefix, such as "
            "ckpt/ckpt-200"
        ) from None
    except tf.errors.OpError as e:  # a damaged index, say: TensorFlow's reason, in one line
        raise ValueError(f"{path!r} is not a readable checkpoint: {e.message.splitlines()[0]}") from None
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    layouts = {"tables": _saved_layouts(directory)}
    print(f"checkpoint {path}")
    rows = []
    for key in sorted(shapes):
        if key.startswith("_CHECKPOINTABLE_OBJECT_GRAPH") or not key.endswith("VARIABLE_VALUE"):
            continue
        shape = shapes[key]
        size = int(np.prod(shape)) * dtypes[key].size if shape else dtypes[key].size
        rows.append((key.replace("/.ATTRIBUTES/VARIABLE_VALUE", ""), shape, dtypes[key].name, size))
    total = 0
    for name, shape, dtype, size in rows:
        total += size
        layout = layouts["tables"].get(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")
        saved = ""
        if layout:
            where = f"{len(set(layout['devices']))} device(s)"
            saved = f"  table '{layout['table']}' saved as {layout['partition']} on {where} under {layout['strategy']}"
        print(f"{name:70s} {str(shape):18s} {dtype:8s} {size / 2**20:10.2f} MiB{saved}")
    dynamic = _dynamic_tables(shapes, dtypes)
    bounds = _saved_bounds(directory)
    for name, (keys, dim, key_dtype, size) in sorted(dynamic.items()):
        total += size
        table = name.rsplit("/", 1)[-1].removeprefix("tables_")
        print(f"{name:70s} {keys:>10,} live keys x {dim:<4d} {key_dtype:8s} {size / 2**20:10.2f} MiB  dynamic table"
              f"; {_describe_bounds(bounds.get(table, {}))}")  # fmt: skip
        print(f"    {_describe_counters(reader, name + '/.ATTRIBUTES/', shapes)}")
    print(f"{len(rows)} variables, {len(dynamic)} dynamic tables, {total / 2**20:.1f} MiB")
    return 0


def _describe_counters(reader, prefix: str, shapes: dict) -> str:
    """What a dynamic table's checkpoint holds of the counters its policies read: the table's step, each live
    key's hits (its occurrences in training batches since it got a row) and last-seen step, and the admission
    sketch (occurrences of keys not yet admitted, per counter)."""
    step = int(reader.get_tensor(prefix + "step")) if prefix + "step" in shapes else None
    hits = reader.get_tensor(prefix + "hits") if prefix + "hits" in shapes else None
    seen = reader.get_tensor(prefix + "seen") if prefix + "seen" in shapes else None
    said = [f"step {step:,}" if step is not None else "step not saved"]
    if hits is not None and hits.size:
        said.append(f"{int(hits.sum()):,} hits ({hits.mean():.1f} per live key)")
    if seen is not None and seen.size and step is not None:
        window = max(step // 10, 1)
        recent = int((seen > step - window).sum())
        said.append(f"{recent:,} keys seen in the last {window:,} steps, the least recent at step {int(seen.min()):,}")
    if prefix + "sketch" in shapes:
        sketch = reader.get_tensor(prefix + "sketch")
        depth, width = sketch.shape
        said.append(f"admission sketch {depth} x {width:,}, {int((sketch > 0).sum()):,} counters in use, "
                    f"the fullest at {int(sketch.max()):,}")  # fmt: skip
    return "; ".join(said)


def _saved_bounds(directory: str) -> dict:
    """`{table: bounds}` of the dynamic tables, from the schema `train` keeps beside its checkpoints ({} without
    one)."""
    from tf_sharded.app import inputs

    saved = inputs.saved_schema(directory)
    return saved.table_policies() if saved is not None else {}


def _describe_bounds(bounds: dict) -> str:
    """A dynamic table's policies in words ("no bounds" without any)."""
    said = []
    if "min_count" in bounds:
        said.append(f"admits a key after {bounds['min_count']} occurrences")
    if "evict_after_steps" in bounds:
        said.append(f"evicts keys unseen for {bounds['evict_after_steps']} steps")
    if "max_keys" in bounds:
        said.append(f"holds at most {bounds['max_keys']:,} keys (least recently seen evicted)")
    return ", ".join(said) if said else "no bounds (admits every key, evicts none)"


def _saved_layouts(directory: str) -> dict:
    """The layout manifest `tfs.fit` writes beside its checkpoints, `{checkpoint key: layout}` ({} without
    one), read as JSON; one that is not what it writes is refused naming the file."""
    from tf_sharded.keras.training.checkpoints import LAYOUT_FILE

    path = os.path.join(directory, LAYOUT_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: expected the layout manifest tfs.fit writes (JSON), received: {e}") from None
    tables = manifest.get("tables") if isinstance(manifest, dict) else None
    fields = {"table": str, "partition": str, "devices": list}
    if not isinstance(tables, dict) or not all(
        isinstance(t, dict) and all(isinstance(t.get(k), kind) for k, kind in fields.items()) for t in tables.values()
    ):
        raise ValueError(
            f'{path}: expected the layout manifest tfs.fit writes, {{"tables": {{checkpoint key: {{"table", '
            f'"partition", "devices", "strategy"}}}}}}; received {json.dumps(manifest)[:120]}'
        )
    return tables


def _dynamic_tables(shapes: dict, dtypes: dict) -> dict:
    """`{name: (live keys, dim, key dtype, bytes of rows and columns)}` of the dynamic tables in a checkpoint."""
    tables = {}
    for key in shapes:
        if not key.endswith("/.ATTRIBUTES/keys"):
            continue
        prefix = key[: -len("keys")]
        values = shapes.get(prefix + "values")
        if values is None:
            continue
        parts = [k for k in shapes if k.startswith(prefix) and dtypes[k].name != "string"]
        size = sum(int(np.prod(shapes[k])) * dtypes[k].size for k in parts if shapes[k])
        tables[prefix[: -len("/.ATTRIBUTES/")]] = (shapes[key][0], values[1], dtypes[key].name, size)
    return tables


# The strategies that read TF_CONFIG (TensorFlow's TFConfigClusterResolver), and the task types each runs.
TF_CONFIG_TASKS = {
    "parameter_server": ("chief", "worker", "ps"),
    "multi_worker": ("chief", "worker"),
    "hybrid": ("chief", "worker", "ps"),
}


def tf_config_problem(strategy: str, environ=os.environ) -> str:
    """Why `TF_CONFIG` cannot name this process's task in its cluster ("" when it can, or when `strategy` does
    not read it). It is JSON, read as TensorFlow reads it, and checked here before anything starts: a
    malformed one would otherwise fail later, deep in TensorFlow, without naming TF_CONFIG."""
    text = environ.get("TF_CONFIG")
    if not text or strategy not in TF_CONFIG_TASKS:
        return ""

    def shown(value) -> str:
        text = json.dumps(value)
        return text if len(text) <= 120 else text[:117] + "..."

    try:
        config = json.loads(text)
    except ValueError as e:
        return f"TF_CONFIG: not JSON ({e})"
    if not isinstance(config, dict):
        return f"TF_CONFIG: expected a JSON object with `cluster` and `task`; received {shown(config)}"
    cluster, task = config.get("cluster"), config.get("task")

    def addresses(tasks) -> bool:
        listed = tasks.values() if isinstance(tasks, dict) else tasks if isinstance(tasks, list) else None
        return bool(listed) and all(isinstance(a, str) and a for a in listed)

    if not isinstance(cluster, dict) or not cluster or not all(addresses(t) for t in cluster.values()):
        return (
            'TF_CONFIG: `cluster` must map each job to its tasks\' addresses, such as {"worker": ["host:2222"], '
            f'"ps": ["host:2223"]}}; received {shown(cluster)}'
        )
    types = TF_CONFIG_TASKS[strategy]
    if strategy == "parameter_server" and not {"ps", "worker"} <= set(cluster):
        return f"TF_CONFIG: --strategy {strategy} needs `ps` and `worker` jobs in `cluster`; received {sorted(cluster)}"
    if strategy == "hybrid" and not ("ps" in cluster and {"chief", "worker"} & set(cluster)):
        return (
            f"TF_CONFIG: --strategy hybrid needs a `ps` job (the table servers) and a `chief` or `worker` job in "
            f"`cluster`; received {sorted(cluster)}"
        )
    kind = task.get("type") if isinstance(task, dict) else None
    if kind not in types or kind not in cluster:
        return (
            f"TF_CONFIG: `task` must name this process's task, its `type` one of the cluster's jobs "
            f"{[t for t in types if t in cluster]} under --strategy {strategy}, such as "
            f'{{"type": "worker", "index": 0}}; received {shown(task)}'
        )
    index, count = task.get("index"), len(cluster[kind])
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        return (
            f"TF_CONFIG: `task.index` must be one of the {count} {kind} task(s), 0 to {count - 1}; "
            f"received {shown(task)}"
        )
    return ""


LOCAL_CLUSTER_FLAGS = ("num_workers", "num_ps", "local_cluster", "local_cluster_isolation")


def _stray_cluster_flags(values) -> str:
    """Why the local cluster's flags given on the command line cannot apply ("" when they can): they shape the
    cluster that `--strategy parameter_server|hybrid|multi_worker` starts without TF_CONFIG, and would
    otherwise be ignored."""
    from tf_sharded.local_workers import WORKER_ENV

    given = [f"--{name}" for name in LOCAL_CLUSTER_FLAGS if values[name].present]
    if not given:
        return ""
    if values.strategy not in ("parameter_server", "hybrid", "multi_worker"):
        received = f"--strategy {values.strategy}"
    elif os.environ.get("TF_CONFIG") and not os.environ.get(WORKER_ENV):
        received = "TF_CONFIG set (its cluster spec names the tasks)"
    elif values.strategy == "multi_worker" and values["num_ps"].present:
        return (
            "--num_ps: a multi-worker cluster has workers only; --num_ps applies to --strategy parameter_server|hybrid"
        )
    elif (
        values.strategy != "parameter_server" and values["local_cluster"].present and values.local_cluster != "process"
    ):
        return (
            f"--local_cluster inprocess: a {values.strategy} cluster runs a process per task (its workers each run "
            f"collectives)"
        )
    else:
        return ""
    return (
        f"{', '.join(given)}: the local cluster's flags apply to --strategy parameter_server|hybrid|multi_worker "
        f"without TF_CONFIG; received {received}"
    )


def _placement_problem(values) -> str:
    """Why `--placement`, `--cpu_replicas` or `--vocabulary dynamic` cannot apply ("" when they can): the first two
    shape mirrored strategies."""
    if values.cpu_replicas and values.strategy != "mirrored":
        return f"--cpu_replicas applies to --strategy mirrored; received --strategy {values.strategy}"
    dynamic = getattr(values, "vocabulary", "hashed") == "dynamic"
    if values.placement == "sharded" and dynamic and values.strategy == "mirrored":
        return (
            "--placement sharded with --vocabulary dynamic needs --strategy multi_worker (a shard per worker); "
            "under --strategy mirrored a dynamic table is one copy on the host"
        )
    if values.placement is None or values.strategy == "mirrored":
        return ""
    if values.strategy != "multi_worker":
        return f"--placement applies to --strategy mirrored|multi_worker; received --strategy {values.strategy}"
    return ""


def main(argv: List[str]) -> int:
    """Entry point for `train`; returns the exit code."""
    values = flags.FlagValues()
    define_flags(values)
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv):
        # absl defines its help flags for absl.app programs only; these flags live in their own FlagValues.
        print(f"usage: python -m tf_sharded train [FLAGS]\n\n{__doc__.strip()}\n\nflags:\n{values.get_help()}")
        return 0
    try:
        values(["train"] + list(argv))
    except flags.Error as e:
        print(f"error: {e} (python -m tf_sharded train --help lists the flags)", file=sys.stderr)
        return 2
    stray = _stray_cluster_flags(values) or _placement_problem(values)
    if stray:
        print(f"error: {stray} (python -m tf_sharded train --help lists the flags)", file=sys.stderr)
        return 2
    tf_config = tf_config_problem(values.strategy)
    if tf_config:
        print(f"error: {tf_config}", file=sys.stderr)
        return 1
    if values.strategy in ("parameter_server", "hybrid", "multi_worker") and not os.environ.get("TF_CONFIG"):
        from tf_sharded import isolation

        isolation.spelling = isolation.FLAG
        try:  # before anything starts: a local cluster other machines could reach is refused if so asked
            isolation.check(values.local_cluster_isolation, [])
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from tf_sharded.app import restart
    from tf_sharded.app.readers import InputError
    from tf_sharded.app.schema import SchemaError
    from tf_sharded.errors import CheckpointMismatchError

    try:
        return train(values)
    except (InputError, SchemaError) as e:
        print(f"error: {e}", file=sys.stderr)
    except CheckpointMismatchError as e:
        print(f"error: --checkpoint_dir {values.checkpoint_dir}: {e}", file=sys.stderr)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"error: --data: cannot read input: {e}", file=sys.stderr)
    except restart.JobFailure as e:
        print(f"error: {e}: {restart.ending(values.checkpoint_dir)}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001  (reported in one line, then a non-zero exit)
        from tf_sharded.hybrid.table import lost_server

        lost = lost_server(e) if values.strategy == "hybrid" else None
        if lost:
            restart.restart(lost, values.checkpoint_dir)  # the cluster is stopped: the command runs again
            print(f"error: {lost}: {restart.ending(values.checkpoint_dir)}", file=sys.stderr)
        else:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    return 1
