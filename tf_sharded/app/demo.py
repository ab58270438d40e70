"""The quick-start demo: a sharded table on a local parameter-server cluster.

Starts 2 ps + 2 workers in this process, creates a 100k x 16 table sharded
over the parameter servers, trains a tiny click model for a few steps on
workers through `ClusterCoordinator` (power-law ids, sparse updates applied
on the owning ps), saves a checkpoint, and restores it into a different
layout on a single device, checking the rows match.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import tensorflow as tf

ROWS, DIM, BATCH, HOT = 100_000, 16, 256, 8


def _synthetic_batch(rng: np.random.Generator, true_weights: np.ndarray):
    # Heavy-tailed ids, as in real click logs (Zipf, alpha ~ 1.05).
    ids = np.minimum(rng.zipf(1.05, size=(BATCH, HOT)) - 1, ROWS - 1).astype(np.int64)
    logits = true_weights[ids].mean(axis=1)
    labels = (rng.random(BATCH) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)[:, None]
    return ids, labels


def main(steps: int = 200, learning_rate: float = 0.5) -> dict:
    """Runs the demo and returns what it measured."""
    import tf_sharded as tfs

    t0 = time.time()
    cluster = tfs.cluster.local_cluster(num_workers=2, num_ps=2)
    strategy = cluster.strategy()
    coordinator = cluster.coordinator(strategy)
    print(f"[1/4] local cluster up: {cluster.cluster_dict}")

    with strategy.scope():
        table = strategy.create_sharded_variable(
            "items", [ROWS, DIM], initializer="uniform", partitions=tfs.PartitionSpec(4, "balanced"), seed=0
        )
        head = tf.Variable(tf.ones([DIM, 1]) * 0.1, name="head")
    where = [tf.DeviceSpec.from_string(d) for d in table.devices]
    shard_rows = ", ".join(f"{v.shape[0]} rows on {w.job}:{w.task}" for v, w in zip(table.variables, where))
    print(f"[2/4] created {table}: {shard_rows}")

    @tf.function
    def train_step(ids, labels):
        with tf.GradientTape() as tape:
            emb = tf.reduce_mean(tfs.embedding_lookup(table, ids), axis=1)
            logits = tf.matmul(emb, head)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
        grads = tape.gradient(loss, list(table.variables) + [head])
        for shard, g in zip(table.variables, grads[:-1]):
            # IndexedSlices of the shard's own rows: applied on the ps that owns them.
            shard.scatter_sub(tf.IndexedSlices(learning_rate * g.values, g.indices, g.dense_shape))
        head.assign_sub(learning_rate * grads[-1])
        return loss

    rng = np.random.default_rng(0)
    true_weights = rng.normal(0, 3, size=ROWS).astype(np.float32)
    losses = []
    for step in range(steps):
        ids, labels = _synthetic_batch(rng, true_weights)
        losses.append(coordinator.schedule(train_step, args=(tf.constant(ids), tf.constant(labels))))
        if (step + 1) % 50 == 0:
            coordinator.join()
            print(f"      step {step + 1:3d}  loss {float(losses[-1].fetch()):.4f}")
    coordinator.join()
    first, last = float(losses[0].fetch()), float(np.mean([r.fetch() for r in losses[-10:]]))
    print(f"[3/4] trained {steps} steps on 2 workers: loss {first:.4f} -> {last:.4f}")

    path = tf.train.Checkpoint(items=table).save(os.path.join(tempfile.mkdtemp(prefix="tfs_demo_"), "ckpt"))
    restored = tfs.create_sharded_variable("items_local", [ROWS, DIM], initializer="zeros", partitions=3, scheme="mod")
    tf.train.Checkpoint(items=restored).restore(path).assert_existing_objects_matched()
    probe = tf.constant([0, 1, 2, 12_345, ROWS - 1])
    match = bool(tf.reduce_all(tfs.embedding_lookup(table, probe) == tfs.embedding_lookup(restored, probe)))
    print(
        f"[4/4] saved {path} from {table.num_shards} shards on 2 ps ({table.partition}); restored into "
        f"{restored.num_shards} local shards ({restored.partition}): rows match = {match}"
    )
    result = {"first_loss": first, "last_loss": last, "restored_match": match, "seconds": time.time() - t0}
    print(
        f"demo: loss {first:.3f} -> {last:.3f}, checkpoint resharded 4 -> 3 ({'OK' if match else 'MISMATCH'}) "
        f"in {result['seconds']:.1f}s"
    )
    if not match or not last < first:
        raise SystemExit("demo failed: the model did not learn or the restore did not match")
    return result
