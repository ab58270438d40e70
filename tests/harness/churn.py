"""Key churn: a stream of all-new keys through a capacity-bounded dynamic table, as new users and items arrive.

`churn` feeds `STEPS` batches of `BATCH` keys never seen before (50 times
`CAPACITY` in inserts, the reserved int64 extremes among the first) to a
table with `CapacityEviction(CAPACITY)`, alone or with
`StepsSinceSeenEviction(AGE)`, trained by Adagrad on the sum of
`(row - 1)**2`. After every `CHECK_EVERY` steps it checks that the table
holds at most `CAPACITY + BATCH` keys and at most `MAX_BUCKETS_PER_KEY`
index buckets per key of that bound. The last batch runs alone once every
other step is done (two parameter-server workers run steps in any order),
and then it checks that every live key was fed, the last batch is live, no
live key was last seen `AGE` or more table steps before the last, and every
live row is exactly one Adagrad step from the key's initial row, computed
here on a plain dense variable: each key is met once, so that is its whole
history, whichever row it was given (freed rows are reused) and wherever it
lives.

The same function runs under every strategy: the caller passes how to run a
step on a batch (`run_step`) and how to wait for the steps run so far
(`settle`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

import tf_sharded as tfs

CAPACITY = 256
BATCH = 64
STEPS = 50 * CAPACITY // BATCH  # 200 steps: 50 times the capacity in inserts
AGE = 3
DIM = 4
LEARNING_RATE = 0.1
CHECK_EVERY = 10
# The index's buckets are a power of two below twice what fits at its 0.8 load, or below four times the keys
# a compaction keeps: at most 4 per key of the bound (and TF's smallest table per shard).
MAX_BUCKETS_PER_KEY = 4
VARIANTS = [(tf.int64, False), (tf.int64, True), (tf.string, False), (tf.string, True)]


def evictions(ages: bool) -> list:
    capacity = [tfs.policies.CapacityEviction(CAPACITY)]
    return capacity + [tfs.policies.StepsSinceSeenEviction(AGE, every=1)] if ages else capacity


def variant_name(key_dtype, ages: bool) -> str:
    return f"churn_{key_dtype.name}{'_aged' if ages else ''}"


def new_keys(key_dtype, seed: int = 0) -> list:
    """`STEPS` batches of `BATCH` distinct keys, no key in two batches (the int64 extremes in the first)."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-(2**63) + 2, 2**63 - 1, size=2 * STEPS * BATCH, dtype=np.int64))
    keys = rng.permutation(keys)[: STEPS * BATCH]
    keys[:3] = [-(2**63), -(2**63) + 1, 2**63 - 1]  # the dense index's reserved markers, and the largest
    batches = keys.reshape(STEPS, BATCH)
    if key_dtype == tf.string:
        return [np.array([f"k{k}" for k in batch], dtype=object) for batch in batches]
    return list(batches)


def adagrad_step_rows(table, keys) -> np.ndarray:
    """The rows of `keys` after one Adagrad step on `(row - 1)**2` from their initial rows, on a plain variable."""
    variable = tf.Variable(table.initial_rows(tf.constant(keys, table.key_dtype)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(variable - 1.0))
    tfs.optimizers.Adagrad(LEARNING_RATE).apply_gradients([(tape.gradient(loss, variable), variable)])
    return variable.numpy()


def churn(check, table, run_step: Callable, settle: Callable[[], None] = lambda: None, key_dtype=tf.int64,
          ages: bool = False) -> None:  # fmt: skip
    """Feeds `new_keys` to `table` with `run_step(batch)` and checks it as the module doc says."""
    batches = new_keys(key_dtype)
    for s, batch in enumerate(batches[:-1]):
        run_step(batch)
        if (s + 1) % CHECK_EVERY == 0:
            settle()
            _check_bounds(check, table, key_dtype, ages, s + 1)
    settle()
    run_step(batches[-1])  # alone: the last step's policies are the last to run
    settle()
    _check_bounds(check, table, key_dtype, ages, len(batches))
    keys, rows, extra = table.export_columns(["seen"])
    keys = [k.decode() if isinstance(k, bytes) else k for k in keys.numpy().tolist()]
    fed = {k for batch in batches for k in batch.tolist()}
    check.assertEqual(len(set(keys)), len(keys))
    check.assertTrue(all(k in fed for k in keys), "a live key that was never fed")
    check.assertContainsSubset(batches[-1].tolist(), keys)
    if ages:  # every key last seen `AGE` or more steps before the last is gone
        check.assertGreater(int(extra["seen"].numpy().min()), int(table.step.numpy()) - AGE)
    check.assertEqual(int(table.size()), len(keys))
    expected = adagrad_step_rows(table, np.array(keys, dtype=object if key_dtype == tf.string else np.int64))
    check.assertAllClose(rows.numpy(), expected, rtol=1e-6, atol=1e-6)


def _check_bounds(check, table, key_dtype, ages: bool, steps: int) -> None:
    """The live keys and the index's buckets after `steps` steps, against their bounds."""
    size = int(table.size())
    check.assertLessEqual(size, CAPACITY + BATCH, f"size after step {steps}")
    check.assertGreaterEqual(size, BATCH if ages else min(steps * BATCH, CAPACITY) // 2)
    buckets = int(table.index_buckets())
    if key_dtype == tf.int64:
        bound = MAX_BUCKETS_PER_KEY * (CAPACITY + BATCH) + 64 * getattr(table, "num_shards", 1)
        check.assertBetween(buckets, CAPACITY // 2, bound, f"index buckets after step {steps}")
    else:
        check.assertEqual(buckets, 0)
