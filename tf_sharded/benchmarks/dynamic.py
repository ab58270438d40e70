"""B7: dynamic tables (raw 64-bit keys) against static tables on the same ids, insert rate, memory per key.

On a parameter-server cluster (2 ps + 1 worker): 26 Criteo-shaped features,
each with its own table of 16-wide rows, a batch of 512 power-law ids per
feature; the static tables (`rows` rows) look up the ids, the dynamic tables
look up raw 64-bit keys that stand one-to-one for the same ids. A step is
lookup + sparse Adagrad update, scheduled on the worker, in two layouts: one
`tfs.embedding_lookup` per table (`tfs.create_sharded_variable` /
`tfs.create_dynamic_table`), and one `tfs.layers.EmbeddingCollection` over
all the tables (static tables fused into one id space; dynamic tables'
inserts and writes in one critical section per ps). Every variant runs on
the same batches in interleaved rounds after a warm-up pass (which inserts
the keys). Also reported: the insert rate (new keys per second, every key of
every step new) and resident memory per live key against the bound of issue
14, 1.3 x (dim x 4 x (1 + slots) + key and metadata bytes), with the default
strategy in this process and in a process with the parameter-server
settings of the README (`PS_ENV`).

TFRA's `dynamic_embedding` is the peer baseline when it can be imported
(`pip install -e ".[peers]"`); otherwise the report says why it was skipped.

    python -m tf_sharded bench dynamic [--quick] [--mode inprocess|process|both]
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np

from tf_sharded.benchmarks import dynamic_peer
from tf_sharded.cluster import PS_ENV  # the ps settings (README): memory per key is measured with them too

DIM, BATCH = 16, 512
KEY_BYTES, META_BYTES = 8, 16  # an int64 key; its last-seen step and occurrences


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _loss(tf, rows):
    return tf.add_n([tf.reduce_sum(tf.square(r - 0.5)) for r in rows])


def _scheduled(tf, strategy, fn):
    """`fn(batch)` as a function the coordinator schedules on a worker."""

    @tf.function
    def step(batch):
        return strategy.run(fn, args=(batch,))

    return step


def _train_step(tfs, tf, strategy, tables, optimizer):
    variables = [v for t in tables for v in t.variables]
    return _step_of(tf, strategy, lambda batch: [tfs.embedding_lookup(t, ids) for t, ids in zip(tables, batch)],
                    variables, optimizer)  # fmt: skip


def _step_of(tf, strategy, lookup, variables, optimizer):
    """The scheduled step: `lookup(batch)` (one tensor of rows per feature), the loss, one optimizer update."""

    def fn(batch):
        with tf.GradientTape() as tape:
            loss = _loss(tf, lookup(batch))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    return _scheduled(tf, strategy, fn)


def _collection(tfs, strategy, tables: Dict, optimizer):
    """An `EmbeddingCollection` of `tables` (feature i reads table i), built in scope with its optimizer."""
    with strategy.scope():
        layer = tfs.layers.EmbeddingCollection(tables, {k: k for k in tables})
        layer.build()
        optimizer.build(layer.trainable_variables)
    return layer


def _collection_step(tf, strategy, layer, optimizer):
    names = list(layer.feature_configs)

    def lookup(batch):
        out = layer(dict(zip(names, batch)))
        return [out[n] for n in names]

    return _step_of(tf, strategy, lookup, layer.trainable_variables, optimizer)


def memory_per_key(keys: int) -> Dict:
    """Resident bytes per live key of a dynamic table trained by Adagrad (one slot), default strategy.

    Every step inserts a chunk of the same shape (the first, traced before the
    measurement starts): a step of another shape would trace the function
    again inside the measurement. The figure is read at every quarter from
    half the keys on, because the spare rows and index buckets depend on
    where the growths fell; the largest is reported.
    """
    import tensorflow as tf

    import tf_sharded as tfs

    table = tfs.create_dynamic_table("b7_memory", DIM, seed=0)
    step = _train_step(tfs, tf, tf.distribute.get_strategy(), [table], tfs.optimizers.Adagrad(0.1))
    chunk = max(1000, keys // 20)
    raw = np.random.default_rng(1).integers(-(2**62), 2**62, size=keys // chunk * chunk, dtype=np.int64)
    step([tf.constant(raw[:chunk])])
    gc.collect()
    before = _rss()
    read_at = {len(raw) * q // 4 // chunk * chunk for q in (2, 3, 4)}
    points = []
    for start in range(chunk, len(raw), chunk):
        step([tf.constant(raw[start : start + chunk])])
        if start + chunk in read_at:
            gc.collect()
            live = int(table.size())
            capacity = sum(int(s.capacity.numpy()) for s in table.shards)
            points.append({"keys": live, "bytes_per_key": (_rss() - before) / (live - chunk),
                           "pool_bytes_per_key": capacity * (DIM * 4 * 2 + META_BYTES) / live})  # fmt: skip
    worst = max(points, key=lambda p: p["bytes_per_key"])
    bound = 1.3 * (DIM * 4 * 2 + KEY_BYTES + META_BYTES)
    return {**points[-1], "max_bytes_per_key": worst["bytes_per_key"], "bound_bytes": bound,
            "per_key_vs_bound": worst["bytes_per_key"] / bound, "points": points}  # fmt: skip


def memory_in_child(keys: int, env: Dict[str, str]) -> Dict:
    """`memory_per_key(keys)` in a new process with `env` (read by TensorFlow and glibc at start-up)."""
    command = [sys.executable, "-m", "tf_sharded.benchmarks.dynamic", "--memory", str(keys)]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "env": env}


def run(quick: bool = False, mode: str = "inprocess") -> Dict:
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.benchmarks.ps_lookup import _ids, scheduled_seconds

    features, rows = (2, 20_000) if quick else (26, 200_000)
    steps, rounds = (2, 1) if quick else (10, 9)
    memory = memory_per_key(20_000 if quick else 1_000_000)
    memory_ps_env = memory_in_child(20_000 if quick else 1_000_000, PS_ENV)
    de, skipped = dynamic_peer.load()
    # In "process" mode the parameter servers must load TFRA's kernels too.
    imports = ("tensorflow_recommenders_addons.dynamic_embedding",) if de is not None else ()
    cluster = tfs.cluster.LocalCluster(num_workers=1, num_ps=2, mode=mode, imports=imports).start()
    try:
        strategy = cluster.strategy()
        coordinator = cluster.coordinator(strategy)
        rng = np.random.default_rng(0)
        pools = [rng.integers(-(2**63), 2**63 - 1, size=rows, dtype=np.int64) for _ in range(features)]
        with strategy.scope():
            static = [tfs.create_sharded_variable(f"b7_static_{i}", [rows, DIM], seed=i) for i in range(features)]
            # Zero initial rows, as TFRA's below: after the same steps every variant holds the same rows.
            dynamic = [tfs.create_dynamic_table(f"b7_dynamic_{i}", DIM, initializer="zeros") for i in range(features)]
            fresh = [tfs.create_dynamic_table(f"b7_fresh_{i}", DIM, seed=i) for i in range(features)]
            optimizers = {name: tfs.optimizers.Adagrad(0.05) for name in ("static", "dynamic", "fresh")}
            for name, tables in (("static", static), ("dynamic", dynamic), ("fresh", fresh)):
                optimizers[name].build([v for t in tables for v in t.variables])
        names = [f"f{i}" for i in range(features)]
        dynamic_config = {"vocabulary": "dynamic", "key_dtype": "int64", "embeddings_initializer": "zeros"}
        collections = {
            "static_collection": {n: {"input_dim": rows, "seed": i} for i, n in enumerate(names)},
            "dynamic_collection": {n: dict(dynamic_config) for n in names},
        }
        for tables in collections.values():
            for config in tables.values():
                config.update(output_dim=DIM, partitions=2)  # 2 shards, as the per-table variants have
        layers = {}
        for name, tables in collections.items():
            optimizers[name] = tfs.optimizers.Adagrad(0.05)
            layers[name] = _collection(tfs, strategy, tables, optimizers[name])
        peers: Dict[str, dynamic_peer.TfraTables] = {}
        fns = {
            "static": _train_step(tfs, tf, strategy, static, optimizers["static"]),
            "dynamic": _train_step(tfs, tf, strategy, dynamic, optimizers["dynamic"]),
        }
        fns.update({name: _collection_step(tf, strategy, layers[name], optimizers[name]) for name in layers})
        ids = [[_ids(rng, "power_law", rows, BATCH) for _ in range(features)] for _ in range(steps)]
        batches = {
            "static": [[tf.constant(i) for i in step] for step in ids],
            "dynamic": [[tf.constant(pools[f][i]) for f, i in enumerate(step)] for step in ids],
        }
        batches["static_collection"], batches["dynamic_collection"] = batches["static"], batches["dynamic"]
        if de is not None:
            devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(2)]
            for name, one_table in (("tfra_per_feature", False), ("tfra_one_table", True)):
                peer = dynamic_peer.TfraTables(de, tf, strategy, features, DIM, devices, one_table, f"b7_{name}")
                peers[name] = peer
                fns[name] = _scheduled(tf, strategy, lambda b, p=peer: p.step(b, lambda r: _loss(tf, r), 0.05))
                batches[name] = batches["dynamic"]
        for name, fn in fns.items():  # warm-up: traces, and inserts the dynamic tables' keys
            scheduled_seconds(coordinator, fn, batches[name])
        times: Dict[str, List[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(scheduled_seconds(coordinator, fn, batches[name]))
        result = {f"{name}_s": statistics.median(t) for name, t in times.items()}
        result["dynamic_vs_static"] = result["dynamic_s"] / result["static_s"]
        result["collection_dynamic_vs_static"] = result["dynamic_collection_s"] / result["static_collection_s"]
        result["live_keys"] = int(sum(int(t.size()) for t in dynamic))
        if peers:
            # Throughput of our faster layout against TFRA's faster layout; and every variant holds the same rows.
            ours = min(result["dynamic_s"], result["dynamic_collection_s"])
            tfra = min(result[f"{name}_s"] for name in peers)
            result["ours_vs_tfra"] = tfra / ours
            # What ours_vs_tfra could reach if a dynamic step cost no more than the static one on the same ids,
            # which does the same lookup and update without resolving keys.
            result["tfra_vs_static_collection"] = tfra / result["static_collection_s"]
            keys = batches["dynamic"][-1][0]
            held = [tfs.embedding_lookup(t, keys, training=False).numpy()
                    for t in (dynamic[0], layers["dynamic_collection"].tables[names[0]])]  # fmt: skip
            result["tfra_max_row_difference"] = max(
                float(np.abs(peer.read(0, keys).numpy() - rows_held).max())
                for peer in peers.values()
                for rows_held in held
            )
            result["tfra_live_keys"] = {name: peer.size() for name, peer in peers.items()}

        # Insert rate: every key of every step is new.
        insert = _train_step(tfs, tf, strategy, fresh, optimizers["fresh"])
        new = [[tf.constant(rng.integers(-(2**62), 2**62, size=BATCH, dtype=np.int64)) for _ in range(features)]]
        scheduled_seconds(coordinator, insert, new)  # traces
        batches_new = [
            [tf.constant(rng.integers(-(2**62), 2**62, size=BATCH, dtype=np.int64)) for _ in range(features)]
            for _ in range(steps)
        ]
        start = time.perf_counter()
        scheduled_seconds(coordinator, insert, batches_new)
        seconds = time.perf_counter() - start
        result["insert_keys_per_s"] = features * BATCH * steps / seconds
        return {
            "benchmark": "dynamic",
            "mode": mode,
            "quick": quick,
            "features": features,
            "rows": rows,
            "dim": DIM,
            "batch": BATCH,
            "tfra": "measured (TFRA 0.8.1)" if de is not None else skipped,
            "results": [result],
            "memory": memory,
            "memory_ps_env": memory_ps_env,
        }
    finally:
        cluster.stop()


def format_rows(report: Dict) -> List[str]:
    r, m, p = report["results"][0], report["memory"], report["memory_ps_env"]
    return [
        f"B7 dynamic ({report['mode']}): {report['features']} features x {report['batch']} power-law keys, "
        f"dim {report['dim']}, 2 ps",
        f"  per-table lookups: static {r['static_s'] * 1e3:.1f} ms  dynamic {r['dynamic_s'] * 1e3:.1f} ms  "
        f"dynamic/static {r['dynamic_vs_static']:.2f} (goal <= 1.5)",
        f"  one EmbeddingCollection: static {r['static_collection_s'] * 1e3:.1f} ms  dynamic "
        f"{r['dynamic_collection_s'] * 1e3:.1f} ms  dynamic/static {r['collection_dynamic_vs_static']:.2f} "
        "(goal <= 1.5)",
        f"  inserts {r['insert_keys_per_s']:,.0f} new keys/s",
        f"  memory at most {m['max_bytes_per_key']:.0f} B per live key from {m['points'][0]['keys']:,} to "
        f"{m['keys']:,} keys ({m['bytes_per_key']:.0f} B at the end, pools {m['pool_bytes_per_key']:.0f} B); "
        f"bound {m['bound_bytes']:.0f} B: {m['per_key_vs_bound']:.2f} x bound",
        f"  memory with the parameter-server settings ({' '.join(f'{k}={v}' for k, v in p['env'].items())}): "
        f"at most {p['max_bytes_per_key']:.0f} B per live key, {p['per_key_vs_bound']:.2f} x bound",
        f"  TFRA: {report['tfra']}",
    ] + (_peer_rows(r) if "ours_vs_tfra" in r else [])


def _peer_rows(r: Dict) -> List[str]:
    per_feature, one_table = r["tfra_per_feature_s"] * 1e3, r["tfra_one_table_s"] * 1e3
    return [
        f"  TFRA per feature {per_feature:.1f} ms  one table {one_table:.1f} ms  ours/TFRA throughput "
        f"{r['ours_vs_tfra']:.2f} (our faster layout; goal >= 1.5); rows differ by at most "
        f"{r['tfra_max_row_difference']:.1e}",
        f"  TFRA (faster) / our static collection {r['tfra_vs_static_collection']:.2f} (what ours/TFRA would read if "
        "a dynamic step cost what a static one does)",
    ]


if __name__ == "__main__":
    if sys.argv[1:2] != ["--memory"] or len(sys.argv) != 3:
        sys.exit("usage: python -m tf_sharded.benchmarks.dynamic --memory KEYS")
    print(json.dumps(memory_per_key(int(sys.argv[2]))))
