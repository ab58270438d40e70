"""`python -m tf_sharded inspect` on a dynamic table's checkpoint: the counters its policies read (the table's step,
each live key's hits and last-seen step, the admission sketch), checked against counts made here from the keys
that trained it."""

import collections
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.subprocs import run_cli_here

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH, MIN_COUNT = 12, 8, 2


def key_batches() -> list:
    """`STEPS` batches of 2 raw keys per example: a few frequent keys and a tail met once or twice."""
    rng = np.random.default_rng(3)
    return [(rng.zipf(1.3, (BATCH, 2)) % 50) * 7919 + 11 for _ in range(STEPS)]


def expected(batches) -> dict:
    """What the table holds after training on `batches`, counted here: a key gets a row in the batch where its
    occurrences reach `MIN_COUNT`; from that batch on, each occurrence is a hit; it was last seen at the step
    of the last batch it occurred in (steps counted from 1)."""
    total, hits, last = collections.Counter(), collections.Counter(), {}
    for step, batch in enumerate(batches, start=1):
        for key, count in zip(*np.unique(batch, return_counts=True)):
            total[key] += count
            if total[key] >= MIN_COUNT:
                hits[key] += count
                last[key] = step
    return {"keys": len(hits), "hits": sum(hits.values()), "last": last}


def test_inspect_reports_the_step_hits_recency_and_admission_sketch_a_checkpoint_holds(tmp_path):
    batches = key_batches()
    keys = keras.Input((2,), dtype="int64")
    admission = tfs.policies.MinCountAdmission(MIN_COUNT, sketch_width=4096)
    table = tfs.layers.DynamicEmbedding(4, combiner="sum", seed=0, name="clicks", admission=admission)
    model = keras.Model(keys, keras.layers.Dense(1)(table(keys)))
    model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
    data = tf.data.Dataset.from_tensor_slices((np.stack(batches), np.ones([STEPS, BATCH, 1], np.float32)))
    directory = str(tmp_path / "ckpt")
    tfs.fit(model, data, steps_per_epoch=STEPS, checkpoint_dir=directory, verbose=0)

    want = expected(batches)
    assert int(table.table.size()) == want["keys"]
    shown = run_cli_here(["-m", "tf_sharded", "inspect", directory])
    assert shown.returncode == 0, shown.stderr
    line = re.search(r"^ {4}step (.*)$", shown.stdout, re.M)
    assert line, shown.stdout
    window = STEPS // 10
    recent = sum(1 for step in want["last"].values() if step > STEPS - window)
    sketch = int((np.asarray(table.table.shards[0].admission_state.numpy()) > 0).sum())
    assert line.group(0).strip() == (
        f"step {STEPS}; {want['hits']:,} hits ({want['hits'] / want['keys']:.1f} per live key); "
        f"{recent:,} keys seen in the last {window} steps, the least recent at step {min(want['last'].values())}; "
        f"admission sketch 4 x 4,096, {sketch:,} counters in use, the fullest at "
        f"{int(table.table.shards[0].admission_state.numpy().max()):,}"
    ), shown.stdout
    assert f"{want['keys']:>10,} live keys x 4" in shown.stdout
    assert os.path.exists(tf.train.latest_checkpoint(directory) + ".index")
