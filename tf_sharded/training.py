"""`tfs.fit`: Keras 3 training in one call, including under `ParameterServerStrategy`.

Keras 3's `model.fit` refuses `ParameterServerStrategy`. Under that strategy
`tfs.fit` runs the model's own `train_step` on the workers through a
`ClusterCoordinator`, with a per-worker dataset, a progress bar (loss,
metrics, samples/s), Keras callbacks and periodic checkpoints that a rerun
resumes from. Under every other strategy it calls `model.fit` (adding the
same checkpoints and resume).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, List, Optional, Union

import keras
import tensorflow as tf

from tf_sharded.errors import positive_int

DatasetSource = Union[Callable[[tf.distribute.InputContext], tf.data.Dataset], tf.data.Dataset]


def _is_ps(strategy) -> bool:
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


class _Checkpoints:
    """A CheckpointManager over the model and its optimizer, restoring the latest on start."""

    def __init__(self, model, directory: Optional[str], max_to_keep: int = 3):
        self.manager = None
        if directory is None:
            return
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        self.manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=max_to_keep)
        if self.manager.latest_checkpoint:
            checkpoint.restore(self.manager.latest_checkpoint).assert_existing_objects_matched()

    def save(self, step: int) -> Optional[str]:
        return self.manager.save(checkpoint_number=step) if self.manager is not None else None


class _PeriodicCheckpoint(keras.callbacks.Callback):
    def __init__(self, checkpoints: _Checkpoints, every: Optional[int]):
        super().__init__()
        self._checkpoints, self._every = checkpoints, every

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if self._every and step % self._every == 0:
            self._checkpoints.save(step)

    def on_epoch_end(self, epoch, logs=None):
        self._checkpoints.save(int(self.model.optimizer.iterations.numpy()))


def _first_batch(source: DatasetSource):
    dataset = source(tf.distribute.InputContext()) if callable(source) else source
    return next(iter(dataset))


def _batch_size(x) -> tf.Tensor:
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def fit(
    model: keras.Model,
    dataset: DatasetSource,
    epochs: int = 1,
    steps_per_epoch: Optional[int] = None,
    callbacks: Optional[List[keras.callbacks.Callback]] = None,
    checkpoint_dir: Optional[str] = None,
    checkpoint_every: Optional[int] = None,
    verbose: int = 1,
    log_every: int = 10,
) -> keras.callbacks.History:
    """Trains a compiled Keras 3 model under the current strategy.

    Build and compile the model inside `strategy.scope()`.

    Args:
      model: a compiled `keras.Model`.
      dataset: a function `input_context -> tf.data.Dataset` (required form
        under `ParameterServerStrategy`, where each worker calls it) or a
        `tf.data.Dataset`, yielding `(x, y)` or `(x, y, sample_weight)` batches.
      epochs: number of epochs.
      steps_per_epoch: steps per epoch; required under
        `ParameterServerStrategy` (worker datasets should repeat).
      callbacks: Keras callbacks.
      checkpoint_dir: if set, the model and optimizer are checkpointed there
        at every epoch end (and every `checkpoint_every` steps), and a rerun
        restores the latest checkpoint and continues from its epoch.
      checkpoint_every: optional step interval between checkpoints.
      verbose: 0 (silent) or 1 (progress bar).
      log_every: under `ParameterServerStrategy`, steps between progress
        updates (each update waits for the steps scheduled so far).

    Returns:
      The `keras.callbacks.History` of the run.

    Raises:
      ValueError: the model is not compiled, or a required argument is missing
        or invalid.

    Example:

    >>> import keras, tf_sharded as tfs
    >>> inp = keras.Input((2,), dtype="int64")
    >>> out = keras.layers.Dense(1)(tfs.layers.Embedding(10, 4, combiner="sum", seed=0)(inp))
    >>> model = keras.Model(inp, out)
    >>> model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
    >>> data = tf.data.Dataset.from_tensor_slices(([[1, 2], [3, 4]], [[1.0], [0.0]])).batch(2)
    >>> history = tfs.fit(model, data, epochs=2, verbose=0)
    >>> len(history.history["loss"])
    2
    """
    if not isinstance(model, keras.Model) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"Argument `model` must be a compiled keras.Model. Received: {type(model).__name__}"
            + (" (not compiled)" if isinstance(model, keras.Model) else "")
            + ". Please call model.compile(optimizer=..., loss=...) inside strategy.scope() first."
        )
    if not (callable(dataset) or isinstance(dataset, tf.data.Dataset)):
        raise ValueError(
            "Argument `dataset` must be a tf.data.Dataset or a function input_context -> tf.data.Dataset. "
            f"Received: {type(dataset).__name__}"
        )
    epochs = positive_int("epochs", epochs)
    if steps_per_epoch is not None:
        steps_per_epoch = positive_int("steps_per_epoch", steps_per_epoch)
    if checkpoint_every is not None:
        checkpoint_every = positive_int("checkpoint_every", checkpoint_every)
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else model.distribute_strategy
    if _is_ps(strategy):
        if steps_per_epoch is None:
            raise ValueError(
                "Argument `steps_per_epoch` is required under ParameterServerStrategy (each worker reads its "
                "own, usually repeated, dataset). Received: steps_per_epoch=None"
            )
        return _fit_ps(
            model,
            strategy,
            dataset,
            epochs,
            steps_per_epoch,
            callbacks,
            checkpoint_dir,
            checkpoint_every,
            verbose,
            positive_int("log_every", log_every),
        )
    checkpoints = _Checkpoints(model, checkpoint_dir) if checkpoint_dir else None
    callbacks = list(callbacks or [])
    initial_epoch = 0
    if checkpoints is not None:
        callbacks.append(_PeriodicCheckpoint(checkpoints, checkpoint_every))
        if steps_per_epoch:
            initial_epoch = int(model.optimizer.iterations.numpy()) // steps_per_epoch
    data = dataset(tf.distribute.InputContext()) if callable(dataset) else dataset
    return model.fit(
        data,
        epochs=epochs,
        initial_epoch=min(initial_epoch, epochs),
        steps_per_epoch=steps_per_epoch,
        callbacks=callbacks,
        verbose=verbose,
    )


def train_function(model: keras.Model, strategy) -> tf.types.experimental.GenericFunction:
    """The step `tfs.fit` schedules under `ParameterServerStrategy`: the model's `train_step` on one batch.

    Returns the logs (metric results) plus `_samples`, the batch size.
    """

    @tf.function
    def step_fn(data):
        def step(data):
            logs = dict(model.train_step(data))
            logs["_samples"] = _batch_size(keras.utils.unpack_x_y_sample_weight(data)[0])
            return logs

        return strategy.run(step, args=(data,))

    return step_fn


def _fit_ps(
    model, strategy, dataset, epochs, steps_per_epoch, callbacks, checkpoint_dir, checkpoint_every, verbose, log_every
):
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    # Variables (model, optimizer, metrics) are created on the coordinator, in
    # scope, before anything is scheduled: a worker function cannot create them.
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(_first_batch(dataset))
    with strategy.scope():
        y_pred = model(x, training=False)
        model.compute_metrics(x, y, y_pred, sample_weight)
        model.optimizer.build(model.trainable_variables)
    model.reset_metrics()
    checkpoints = _Checkpoints(model, checkpoint_dir)
    initial_epoch = min(epochs, int(model.optimizer.iterations.numpy()) // steps_per_epoch)

    per_worker = coordinator.create_per_worker_dataset(dataset if callable(dataset) else (lambda: dataset))
    iterator = iter(per_worker)

    step_fn = train_function(model, strategy)

    @tf.function
    def train_step(iterator):
        return step_fn(next(iterator))

    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        list(callbacks or []) + [history],
        add_history=False,
        add_progbar=False,
        model=model,
        epochs=epochs,
        steps=steps_per_epoch,
        verbose=verbose,
    )
    callback_list.on_train_begin()
    logs = {}
    global_step = int(model.optimizer.iterations.numpy())
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        bar = keras.utils.Progbar(steps_per_epoch, verbose=verbose, stateful_metrics=None) if verbose else None
        pending, samples, start = [], 0, time.perf_counter()
        for step in range(steps_per_epoch):
            callback_list.on_train_batch_begin(step)
            pending.append(coordinator.schedule(train_step, args=(iterator,)))
            global_step += 1
            last = step == steps_per_epoch - 1
            due = bool(checkpoint_every) and global_step % checkpoint_every == 0
            if (step + 1) % log_every == 0 or last or due:
                coordinator.join()
                results = [r.fetch() for r in pending]
                pending = []
                samples += sum(int(r["_samples"]) for r in results)
                logs = {k: float(v) for k, v in results[-1].items() if k != "_samples"}
                rate = samples / max(time.perf_counter() - start, 1e-9)
                callback_list.on_train_batch_end(step, logs)
                if bar is not None and not last:
                    bar.update(step + 1, [*logs.items(), ("samples/s", rate)], finalize=False)
                if due:
                    checkpoints.save(global_step)
        logs = {name: float(value) for name, value in model.get_metrics_result().items()}
        logs["samples_per_second"] = samples / max(time.perf_counter() - start, 1e-9)
        if bar is not None:
            shown = [(k, v) for k, v in logs.items() if k != "samples_per_second"]
            bar.update(steps_per_epoch, shown + [("samples/s", logs["samples_per_second"])], finalize=True)
        checkpoints.save(global_step)
        callback_list.on_epoch_end(epoch, logs)
        if getattr(model, "stop_training", False):
            break
    callback_list.on_train_end(logs)
    return history


def latest_checkpoint(directory: str) -> Optional[str]:
    """The newest checkpoint `tfs.fit` wrote to `directory`, or None."""
    return tf.train.latest_checkpoint(directory) if os.path.isdir(directory) else None


__all__: List[Any] = ["fit", "latest_checkpoint"]
