"""Checkpoints of Keras training: the model, its optimizer and the step, plus the layout each table was saved from.

`Checkpoints` restores the latest checkpoint on creation (a rerun resumes) and
writes `tf_sharded_layout.json` beside each save, which `python -m
tf_sharded inspect` reads; TensorFlow's checkpoint itself is layout-free.

A restore is all or nothing: TensorFlow assigns each matched variable as it
walks the object graph, so a checkpoint of another model would be restored
up to its first mismatch. `differences` compares the checkpoint's entries
with the model's first (`tfs.training.CheckpointMismatchError`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import List, Optional, Tuple

import keras
import tensorflow as tf
from google.protobuf import text_format

from tf_sharded import _compat
from tf_sharded.errors import CheckpointMismatchError
from tf_sharded.table import registry

STEP_KEY = "step/.ATTRIBUTES/VARIABLE_VALUE"


class Checkpoints:
    """A CheckpointManager over the model and its optimizer, restoring the latest on start.

    `several_tasks`: the variables live on several tasks (parameter servers).
    There TensorFlow writes an eager checkpoint by tracing a new function on
    every save (and warns about the retracing after five); here the write is
    one function traced once per set of saved objects, and the manager's
    bookkeeping (the `checkpoint` state file, keeping `max_to_keep`) is done
    after it.
    """

    def __init__(self, model, directory: Optional[str], max_to_keep: int = 3, step=None, several_tasks=False):
        self.manager = self.started_from = None
        if directory is None:
            return
        # Every checkpoint holds the step count as `step`, whatever the strategy, so that a run resumes under
        # another one: `step` (the exact count tfs.fit keeps under parameter servers), or else a copy of
        # Keras's `optimizer.iterations` written at each save.
        self._copy = step is None
        if self._copy:
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfs_fit_step_copy")
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step)
        self.directory = directory
        # Every worker of a multi-worker mirrored job takes part in a save (its reads are collectives), but
        # only the chief's lands in `directory`: another worker writes to a directory of its own, removed
        # after each save, as TensorFlow's multi-worker checkpointing does. Every worker restores the chief's.
        strategy = model.distribute_strategy
        self._scratch = None
        if not strategy.extended.should_checkpoint:
            self._scratch = os.path.join(directory, f"workertemp_{_compat.cluster_workers(strategy)[0]}")
        self.manager = tf.train.CheckpointManager(self.checkpoint, self._scratch or directory, max_to_keep=max_to_keep)
        self._max_to_keep = max_to_keep
        self._writers = {} if several_tasks else None
        self._model, self._step = model, step
        # Read once, so that every worker decides alike whether to save before the first step.
        self.started_from = tf.train.latest_checkpoint(directory)
        _check_workers_agree(strategy, directory, self.started_from)
        if self.started_from:
            if model.built and not model.optimizer.built:
                # As Keras builds it (`model.fit`, `compile_from_config`): its variables exist before the
                # restore, so they are compared with the checkpoint's too, not restored later on their own.
                with model.distribute_strategy.scope():
                    model.optimizer.build(model.trainable_variables)
            self._restore(self.started_from)

    def _restore(self, path: str) -> None:
        found = differences(self.checkpoint, path, self._model)
        if found:
            raise CheckpointMismatchError(path, found)
        if tf.train.load_checkpoint(path).has_tensor(STEP_KEY):
            self.checkpoint.restore(path).assert_existing_objects_matched()
            return
        # Written without the step entry (by an earlier version, under a strategy without tfs.fit's counter):
        # the count is Keras's.
        tf.train.Checkpoint(model=self._model, optimizer=self._model.optimizer).restore(
            path
        ).assert_existing_objects_matched()
        self._step.assign(self._model.optimizer.iterations)

    def restore_latest(self) -> Tuple[str, int]:
        """Restores the latest checkpoint again (after a parameter server came back empty): its path and step."""
        if self._writers is not None:
            self._writers.clear()  # traced writers hold the resources that were renewed
        path = tf.train.latest_checkpoint(self.directory)
        self._restore(path)
        step = self._model.optimizer.iterations if self._copy else self._step
        return path, int(step.numpy())

    def save(self, step: int) -> Optional[str]:
        if self.manager is None:
            return None
        if self._copy:
            self._step.assign(step)
        if self._writers is None:
            path = self.manager.save(checkpoint_number=step)
        else:
            path = self._traced_save(step)
        if self._scratch is not None:
            tf.io.gfile.rmtree(self._scratch)
            return os.path.join(self.directory, os.path.basename(path))
        write_layouts(self.checkpoint, self.directory)
        return path

    def _traced_save(self, step: int) -> str:
        self.checkpoint.save_counter.assign_add(1)  # as `Checkpoint.save` counts, so that a restore matches it
        # The object graph is fixed when the function is traced: a new object (a slot created later) needs
        # its own trace, so the functions are keyed by the number of saved objects.
        objects = len(tf.train.TrackableView(self.checkpoint).descendants())
        if objects not in self._writers:
            # A partial, not a lambda: TensorFlow counts retracing per code object, which would lump the
            # writers of every Checkpoints in the process together (and warn after five tfs.fit calls).
            self._writers[objects] = tf.function(functools.partial(_write, self.checkpoint))
        prefix = os.path.join(self.directory, f"ckpt-{step}")
        tf.io.gfile.makedirs(self.directory)
        self._writers[objects](tf.constant(prefix))
        state = tf.train.get_checkpoint_state(self.directory)
        kept = [p for p in (state.all_model_checkpoint_paths if state else []) if p != prefix] + [prefix]
        for old in kept[: -self._max_to_keep]:
            for f in tf.io.gfile.glob(old + ".*"):
                tf.io.gfile.remove(f)
        kept = kept[-self._max_to_keep :]
        _record_state(self.directory, prefix, kept)
        return prefix


def _check_workers_agree(strategy, directory: str, latest: Optional[str]) -> None:
    """Refuses, on every worker at once, a multi-worker mirrored job whose workers found different latest
    checkpoints (directories that are not one shared directory): a worker that restored and one that did
    not would wait for each other in different collectives."""
    if not _compat.in_multi_worker_mode(strategy):
        return
    step = float(latest.rsplit("-", 1)[1]) if latest else -1.0
    # Equal steps on every replica exactly when count * sum of squares == square of the sum.
    count, total, squares = strategy.reduce(
        tf.distribute.ReduceOp.SUM, tf.constant([1.0, step, step * step], tf.float64), axis=None
    ).numpy()
    if count * squares != total * total:
        found = f"its latest checkpoint {latest}" if latest else "no checkpoint"
        raise ValueError(
            f"Argument `checkpoint_dir` must be one directory that every worker reads (the chief writes it); "
            f"this worker found {found} in {directory}, and another worker found another. Received: "
            f"checkpoint_dir={directory!r}"
        )


def _write(checkpoint, prefix):
    return checkpoint.write(prefix)


def _record_state(directory: str, latest: str, kept: list) -> None:
    """Writes `directory`'s checkpoint state file (what `tf.train.latest_checkpoint` reads) naming `latest` and
    the `kept` checkpoints, replacing the file at once so a reader never sees half of it. The same file
    `tf.compat.v1.train.update_checkpoint_state` writes, without its deprecation warning on every run."""
    state = tf.compat.v1.train.generate_checkpoint_state_proto(directory, latest, all_model_checkpoint_paths=kept)
    path = os.path.join(directory, "checkpoint")
    temporary = f"{path}.tmp{os.getpid()}"
    with tf.io.gfile.GFile(temporary, "w") as f:
        f.write(text_format.MessageToString(state))
    tf.io.gfile.rename(temporary, path, overwrite=True)


def _saved_objects(root) -> List[Tuple[List[str], object, bool]]:
    """`(path, object, is a value)` of every object reachable from checkpoint `root`, at the path TensorFlow
    names its entries by (breadth-first; an object reached twice is saved once). Values (variables, tables,
    dynamic tables) are not walked into."""
    view = tf.train.TrackableView(root)
    seen, found, queue = {id(root)}, [], [(root, [])]
    while queue:
        obj, path = queue.pop(0)
        for name, child in view.children(obj).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            value = registry.is_any_table(child) or isinstance(child, (tf.Variable, keras.Variable))
            found.append((path + [name], child, value))
            if not value:
                queue.append((child, path + [name]))
    return found


def _described(key: str, obj) -> str:
    name = key.split("/" + _compat.VARIABLE_VALUE_KEY)[0].replace("/.ATTRIBUTES", "")
    if registry.is_any_table(obj):
        return f"{name} ({obj.kind.noun} '{obj.name}')"
    return f"{name} (variable '{getattr(obj, 'path', None) or obj.name}')"


def differences(root, path: str, model: keras.Model) -> List[str]:
    """What keeps checkpoint `path` from restoring into `root` (which holds `model`) whole, one line per entry:
    a variable or table whose shape or dtype differs, one of `root` the checkpoint lacks, and one the
    checkpoint holds under `root`'s objects (the model, the optimizer) that `root` lacks. Empty when they
    agree. Values of the root itself (`step`, `save_counter`) are left to `Checkpoints`; entries a model not
    built yet lacks may be created later, and are not counted.
    """
    reader = tf.train.load_checkpoint(path)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    found, claimed, prefixes, walked = [], set(), [], set()
    for object_path, obj, value in _saved_objects(root):
        key = _compat.checkpoint_key(object_path)
        if not value:  # compared through what it holds
            walked.add(key.split("/.ATTRIBUTES/")[0])
            continue
        if len(object_path) == 1:
            continue
        where = _described(key, obj)
        # A table its kind saves as several entries (a dynamic table's keys and rows) is compared by its kind.
        entries = obj.kind.checkpoint_difference(obj, key, shapes, dtypes) if registry.is_any_table(obj) else None
        if entries is not None:
            prefix, problem = entries
            prefixes.append(prefix)
            if problem:
                found.append(f"{where}: {problem}")
            continue
        claimed.add(key)
        if key not in shapes:
            found.append(f"{where}: in the model, not in the checkpoint")
            continue
        shape, dtype = list(shapes[key]), dtypes[key]
        expected_shape, expected_dtype = list(obj.shape), tf.as_dtype(obj.dtype)
        if dtype != expected_dtype:
            found.append(
                f"{where}: {dtype.name} {shape} in the checkpoint, {expected_dtype.name} {expected_shape} in the model"
            )
        elif shape != expected_shape:
            found.append(f"{where}: shape {shape} in the checkpoint, {expected_shape} in the model")
    if model.built:
        extra = set()
        for key in shapes:
            name = key.split("/.ATTRIBUTES/")[0]
            if key in claimed or name in walked or key.startswith(tuple(prefixes)):
                continue
            if "/" in name and name.split("/")[0] in walked:
                extra.add(name)
        found += [f"{name}: in the checkpoint, not in the model" for name in sorted(extra)]
    return sorted(found, key=lambda line: not line.startswith("model/"))  # the model's own entries first


LAYOUT_FILE = "tf_sharded_layout.json"


def table_keys(root) -> dict:
    """`{checkpoint key: table}` for every table reachable from checkpoint `root`.

    Walks the object graph breadth-first as TensorFlow does when it names
    checkpoint entries, so the keys are those `tf.train.list_variables` shows.
    """
    view = tf.train.TrackableView(root)
    seen, keys, queue = {id(root)}, {}, [(root, [])]
    while queue:
        obj, path = queue.pop(0)
        for name, child in view.children(obj).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_path = path + [name]
            # Tables of rows [0, n): the layout of their rows is what a reader of the checkpoint needs.
            if registry.is_any_table(child) and child.kind.static_rows:
                keys[_compat.checkpoint_key(child_path)] = child
            queue.append((child, child_path))
    return keys


def write_layouts(root, directory: str) -> str:
    """Writes, beside a checkpoint, the layout each table was saved from (read by `tf_sharded inspect`)."""
    tables = {
        key: {
            "table": t.name,
            "partition": repr(t.partition),
            "devices": list(t.devices),
            "strategy": type(t.strategy).__name__ if t.strategy is not None else None,
        }
        for key, t in table_keys(root).items()
    }
    path = os.path.join(directory, LAYOUT_FILE)
    # Written whole beside the file, then renamed over it: a crash mid-write leaves the previous file.
    partial = f"{path}.tmp-{os.getpid()}"
    try:
        with open(partial, "w") as f:
            json.dump({"tables": tables}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


class PeriodicCheckpoint(keras.callbacks.Callback):
    """Checkpoints under Keras's `model.fit`: every `every` steps, every `secs` seconds and at epoch ends."""

    def __init__(self, checkpoints: Checkpoints, every: Optional[int], secs: Optional[float] = None):
        super().__init__()
        self._checkpoints, self._every, self._secs = checkpoints, every, secs
        self._last = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        timed = self._secs is not None and time.monotonic() - self._last >= self._secs
        if not (self._every or timed):
            return  # reading the step count syncs with the device: only when it can matter
        step = int(self.model.optimizer.iterations.numpy())
        if timed or step % self._every == 0:
            self._save(step)

    def _save(self, step: int) -> None:
        self._checkpoints.save(step)
        self._last = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        self._save(int(self.model.optimizer.iterations.numpy()))
