"""Checkpoints of Keras training: the model, its optimizer and the step, plus the layout each table was saved from.

`Checkpoints` restores the latest checkpoint on creation (a rerun resumes) and
writes `tf_sharded_layout.json` beside each save, which `python -m
tf_sharded inspect` reads; TensorFlow's checkpoint itself is layout-free.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import keras
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.protocol import is_table


class Checkpoints:
    """A CheckpointManager over the model and its optimizer, restoring the latest on start."""

    def __init__(self, model, directory: Optional[str], max_to_keep: int = 3, step=None):
        self.manager = None
        if directory is None:
            return
        extra = {"step": step} if step is not None else {}
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, **extra)
        self.directory = directory
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep)
        if self.manager.latest_checkpoint:
            self.checkpoint.restore(self.manager.latest_checkpoint).assert_existing_objects_matched()

    def save(self, step: int) -> Optional[str]:
        if self.manager is None:
            return None
        path = self.manager.save(checkpoint_number=step)
        write_layouts(self.checkpoint, self.directory)
        return path


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
            if is_table(child):
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
    with open(path, "w") as f:
        json.dump({"tables": tables}, f, indent=1)
    return path


class PeriodicCheckpoint(keras.callbacks.Callback):
    def __init__(self, checkpoints: Checkpoints, every: Optional[int]):
        super().__init__()
        self._checkpoints, self._every = checkpoints, every

    def on_train_batch_end(self, batch, logs=None):
        if not self._every:
            return  # reading the step count syncs with the device: only when it can matter
        step = int(self.model.optimizer.iterations.numpy())
        if step % self._every == 0:
            self._checkpoints.save(step)

    def on_epoch_end(self, epoch, logs=None):
        self._checkpoints.save(int(self.model.optimizer.iterations.numpy()))
