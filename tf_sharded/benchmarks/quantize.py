"""B9: the demo model served with int8 and int4 tables (`tfs.export(..., quantize=...)`) against its float tables.

Trains the main job's default model, what `make demo` runs (`python -m
tf_sharded train`: DLRM, 26 tables capped at 100,000 rows x 16, 200 steps of
512 synthetic Criteo-shaped examples under parameter servers), then exports
it three times from its checkpoint, as trained, with `quantize="int8"` and
with `quantize="int4"`, loads the SavedModels and scores the main job's
held-out batches (20 batches of 512, the data seed + 1) with each. Reported
per export:

* held-out AUC and log-loss, and for a quantized export their changes
  (quantized - float);
* `max_abs_logit_change`: the largest change of one example's output;
* the bytes of the tables in the SavedModel and the float/quantized ratio
  (int8 rows plus one float32 scale per row: 4 * 16 / (16 + 4) = 3.2x at dim
  16; int4 values two a byte plus a float32 scale and an int8 zero point per
  row of up to 128 columns: 4 * 16 / (8 + 5) = 4.9x).

`--quick` trains 20 steps on one worker with tables capped at 1,000 rows:
with one worker the run is deterministic, where with two the model after
20 steps depends on how their steps interleave (held-out AUC 0.58-0.72 on
this machine, 0.7547 every time on one).

    python -m tf_sharded bench quantize [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Dict, List

BATCH, EVAL_STEPS, SEED = 512, 20, 0
MODES = ("int8", "int4")


def _sizes(quick: bool) -> Dict:
    if quick:
        return {"steps": 20, "max_vocab": 1_000, "num_workers": 1}
    return {"steps": 200, "max_vocab": 100_000, "num_workers": 2}


def _train(sizes: Dict, checkpoint_dir: str) -> None:
    flags = ["--steps", str(sizes["steps"]), "--max_vocab", str(sizes["max_vocab"]), "--verbose", "0"]
    flags += ["--num_workers", str(sizes["num_workers"])]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    proc = subprocess.run(
        [sys.executable, "-m", "tf_sharded", "train", *flags, "--checkpoint_dir", checkpoint_dir],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"B9: training the demo model failed:\n{proc.stderr[-3000:]}")


def _table_bytes(path: str) -> int:
    """Bytes of the tables a SavedModel from `tfs.export` holds (the module's `tables`)."""
    import numpy as np
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    return int(sum(np.prod(shapes[k]) * dtypes[k].size for k in shapes if k.startswith("tables/")))


def _score(path: str, held_out) -> Dict:
    import keras
    import numpy as np
    import tensorflow as tf

    served = tf.saved_model.load(path)
    logits, labels = [], []
    for features, y in held_out:
        logits.append(served.serve(**features)["output_0"].numpy().ravel())
        labels.append(y.numpy().ravel())
    logits, labels = np.concatenate(logits).astype(np.float64), np.concatenate(labels)
    p = np.clip(1.0 / (1.0 + np.exp(-logits)), 1e-7, 1 - 1e-7)
    auc = keras.metrics.AUC(num_thresholds=2000)
    auc.update_state(labels, p)
    logloss = float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
    return {"auc": float(auc.result()), "logloss": logloss, "logits": logits, "table_bytes": _table_bytes(path)}


def run(quick: bool = False) -> Dict:
    """Trains the demo model, exports it as trained, as int8 and as int4, and scores each on the held-out batches."""
    import numpy as np
    import tensorflow as tf

    import tf_sharded as tfs
    from tf_sharded.app import data, models

    sizes = _sizes(quick)
    work = tempfile.mkdtemp(prefix="tfs_b9_")
    checkpoint_dir = os.path.join(work, "ckpt")
    _train(sizes, checkpoint_dir)
    model = models.build("dlrm", data.vocab_sizes(sizes["max_vocab"]), embedding_dim=16)
    held_out = data.synthetic_dataset(BATCH, sizes["max_vocab"], SEED + 1, num_batches=EVAL_STEPS)
    model(next(iter(held_out))[0])
    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(checkpoint_dir)).expect_partial()
    scores = {
        mode or "float": _score(tfs.export(model, os.path.join(work, mode or "float"), quantize=mode), held_out)
        for mode in (None, *MODES)
    }
    as_float = scores["float"]
    results = []
    for name, s in scores.items():
        row = {"export": name, **{k: v for k, v in s.items() if k != "logits"}}
        if name != "float":
            row.update(
                auc_change=s["auc"] - as_float["auc"],
                logloss_change=s["logloss"] - as_float["logloss"],
                max_abs_logit_change=float(np.max(np.abs(s["logits"] - as_float["logits"]))),
                table_bytes_ratio=as_float["table_bytes"] / s["table_bytes"],
            )
        results.append(row)
    return {
        "benchmark": "quantize",
        "quick": quick,
        "model": "dlrm",
        "steps": sizes["steps"],
        "max_vocab": sizes["max_vocab"],
        "embedding_dim": 16,
        "held_out_examples": BATCH * EVAL_STEPS,
        "results": results,
    }


def format_rows(report: Dict) -> List[str]:
    lines = [
        f"B9 (DLRM, {report['steps']} steps, tables capped at {report['max_vocab']:,} rows x "
        f"{report['embedding_dim']}; held-out {report['held_out_examples']:,} examples):",
        f"{'export':>8} | {'AUC':>7} {'log-loss':>9} {'tables MB':>10}",
    ]
    for r in report["results"]:
        lines.append(f"{r['export']:>8} | {r['auc']:>7.4f} {r['logloss']:>9.4f} {r['table_bytes'] / 2**20:>10.2f}")
    for r in report["results"][1:]:
        lines.append(
            f"{r['export']} - float: AUC {r['auc_change']:+.4f}, log-loss {r['logloss_change']:+.4f}, "
            f"largest logit change {r['max_abs_logit_change']:.4f}; tables {r['table_bytes_ratio']:.2f}x smaller"
        )
    return lines
