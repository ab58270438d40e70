"""`tfs.fit`: Keras 3 training in one call, including where Keras 3's `model.fit` fails.

Keras 3's `model.fit` refuses `ParameterServerStrategy`, and under
`MultiWorkerMirroredStrategy` (TF 2.16 / Keras 3) it fails before the first
step (its symbolic build all-reduces the first input batch eagerly;
keras-team/keras#20585). Under those two strategies `tfs.fit` runs the
model's own `train_step` in its own loop: through a `ClusterCoordinator` on
per-worker datasets for parameter servers, with `strategy.run` on a
distributed dataset for multi-worker mirrored. Both show a progress bar
(loss, metrics, samples/s), call Keras callbacks and write periodic
checkpoints that a rerun resumes from. Under every other strategy it calls
`model.fit` (adding the same checkpoints and resume).
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, List, Optional, Union

import keras
import tensorflow as tf

from tf_sharded.errors import positive_int
from tf_sharded.keras import evaluation
from tf_sharded.keras.checkpoints import Checkpoints, PeriodicCheckpoint
from tf_sharded.keras.optimizers import check_trains_tables
from tf_sharded.strategy import FitLoop, family_of

DatasetSource = Union[Callable[[tf.distribute.InputContext], tf.data.Dataset], tf.data.Dataset]


def _first_batch(source: DatasetSource):
    return next(iter(evaluation.as_dataset(source)))


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
    validation_data: Optional[DatasetSource] = None,
    validation_steps: Optional[int] = None,
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
        `ParameterServerStrategy` (worker datasets should repeat), and under
        `MultiWorkerMirroredStrategy` unless `dataset` is a finite Dataset.
      callbacks: Keras callbacks.
      checkpoint_dir: if set, the model and optimizer are checkpointed there
        at every epoch end (and every `checkpoint_every` steps), and a rerun
        restores the latest checkpoint and continues from its epoch.
      checkpoint_every: optional step interval between checkpoints.
      verbose: 0 (silent) or 1 (progress bar).
      log_every: under `ParameterServerStrategy` and
        `MultiWorkerMirroredStrategy`, steps between progress updates (each
        update waits for the steps launched so far).
      validation_data: evaluated at every epoch end like Keras's
        `validation_data` (a finite `tf.data.Dataset`, or a dataset function
        with `validation_steps`; see `tfs.evaluate`): `val_` entries in the
        progress line, the history and the callbacks' epoch logs.
      validation_steps: batches of `validation_data` per evaluation (default:
        all; required for a dataset function under parameter servers).

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
    check_trains_tables(model.optimizer, model.trainable_variables)
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
    strategy = evaluation.strategy_of(model)
    validation = evaluation.validation(model, strategy, validation_data, validation_steps)
    loop = family_of(strategy).fit_loop(strategy, getattr(model, "steps_per_execution", 1) or 1)
    data = evaluation.as_dataset(dataset) if loop == FitLoop.KERAS else None
    if loop == FitLoop.KERAS and family_of(strategy).mirrors_tables and evaluation.has_ragged(data):
        # Keras 3's model.fit fails on ragged inputs under MirroredStrategy ("'RaggedTensor' object has no
        # attribute 'device'"): the replica loop runs them.
        loop = FitLoop.REPLICAS
    if loop != FitLoop.KERAS:
        if steps_per_epoch is None and isinstance(dataset, tf.data.Dataset) and loop == FitLoop.REPLICAS:
            steps_per_epoch = int(dataset.cardinality()) if int(dataset.cardinality()) > 0 else None
        if steps_per_epoch is None:
            raise ValueError(
                f"Argument `steps_per_epoch` is required under {type(strategy).__name__} unless the dataset is a "
                "tf.data.Dataset of known, finite length (parameter-server workers read their own, usually "
                "repeated, datasets). Received: steps_per_epoch=None"
            )
        return _fit_loop(
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
            validation,
        )
    checkpoints = Checkpoints(model, checkpoint_dir) if checkpoint_dir else None
    callbacks = list(callbacks or [])
    initial_epoch = 0
    if checkpoints is not None:
        callbacks.append(PeriodicCheckpoint(checkpoints, checkpoint_every))
        if steps_per_epoch:
            initial_epoch = int(model.optimizer.iterations.numpy()) // steps_per_epoch
    if validation_data is not None:
        validation_data = evaluation.as_dataset(validation_data)
    return model.fit(
        data,
        epochs=epochs,
        initial_epoch=min(initial_epoch, epochs),
        steps_per_epoch=steps_per_epoch,
        callbacks=callbacks,
        verbose=verbose,
        validation_data=validation_data,
        validation_steps=validation_steps,
    )


# Per model, where workers apply steps asynchronously (parameter servers): a step counter on a ps. Keras
# increments `optimizer.iterations` with a read-then-assign, which loses counts when two workers race;
# `assign_add` on a resource variable does not.
_STEP_COUNTERS = weakref.WeakKeyDictionary()


def _step_counter(model, strategy) -> Optional[tf.Variable]:
    if not family_of(strategy).asynchronous_steps:
        return None
    if model not in _STEP_COUNTERS:
        with strategy.scope():
            _STEP_COUNTERS[model] = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfs_fit_step")
    return _STEP_COUNTERS[model]


def _steps_done(model, counter) -> int:
    return int((counter if counter is not None else model.optimizer.iterations).numpy())


def train_function(model: keras.Model, strategy) -> tf.types.experimental.GenericFunction:
    """The step `tfs.fit` runs in its own loop: the model's `train_step` on one batch, in every replica.

    Returns the logs (metric results) plus `_samples`, the batch size.
    """
    counter = _step_counter(model, strategy)

    @tf.function
    def step_fn(data):
        def step(data):
            logs = dict(model.train_step(data))
            logs["_samples"] = _batch_size(keras.utils.unpack_x_y_sample_weight(data)[0])
            if counter is not None:
                counter.assign_add(1)
            return logs

        return strategy.run(step, args=(data,))

    return step_fn


class _Runner:
    """How one step is launched and its results collected, per strategy."""

    def __init__(self, strategy, dataset, step_fn):
        self.strategy = strategy
        self.ps = family_of(strategy).fit_loop(strategy, 1) == FitLoop.COORDINATOR
        if self.ps:
            self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
            source = evaluation.per_worker(dataset) if callable(dataset) else (lambda: dataset)
            self.per_epoch = False
            self.distributed = self.coordinator.create_per_worker_dataset(source)
        else:
            self.coordinator = None
            # A finite Dataset is read once per epoch, like model.fit; a dataset function should repeat.
            self.per_epoch = isinstance(dataset, tf.data.Dataset)
            if callable(dataset) and not isinstance(dataset, tf.data.Dataset):
                self.distributed = strategy.distribute_datasets_from_function(dataset)
            else:
                self.distributed = strategy.experimental_distribute_dataset(dataset)

        # Unrolled copies must each trace their own collectives: the undecorated step, not one function
        # called several times (its collectives would share their instance keys).
        inline_step = getattr(step_fn, "python_function", step_fn)

        def one_step(iterator, inline=False):
            # The first replica's logs (its batch size stands for every replica's): plain tensors.
            logs = (inline_step if inline else step_fn)(next(iterator))
            return logs if self.ps else self._first_replica(logs)

        @tf.function
        def scheduled(iterator, count):
            # `count` consecutive steps in one function (Keras's `steps_per_execution`): one dispatch
            # for all of them. The logs are the last step's, the batch sizes summed. On parameter
            # servers a loop; with collectives unrolled, so that every step's collectives have their
            # own instance (in a loop, replicas one iteration apart would meet in one instance).
            logs = one_step(iterator, inline=not self.ps)
            if count == 1:
                return logs
            samples = logs["_samples"]
            for _ in tf.range(count - 1) if self.ps else range(count - 1):
                logs = one_step(iterator, inline=not self.ps)
                samples += logs["_samples"]
            logs["_samples"] = samples
            return logs

        self._scheduled = scheduled
        self.iterator = iter(self.distributed)

    def new_epoch(self):
        if self.per_epoch:
            self.iterator = iter(self.distributed)

    def launch(self, count: int = 1):
        """Starts `count` steps (one scheduled function, traced once per distinct count)."""
        if self.ps:
            return self.coordinator.schedule(self._scheduled, args=(self.iterator, count))
        return self._scheduled(self.iterator, count)

    def results(self, launched: list) -> list:
        """Per launch: its last step's logs as floats and its samples over all replicas."""
        if self.ps:
            self.coordinator.join()
            values = [r.fetch() for r in launched]
        else:
            values = [tf.nest.map_structure(lambda v: v.numpy(), r) for r in launched]
        replicas = 1 if self.ps else self.strategy.num_replicas_in_sync
        return [({k: float(v) for k, v in r.items() if k != "_samples"}, int(r["_samples"]) * replicas) for r in values]

    def _first_replica(self, out):
        return tf.nest.map_structure(lambda v: self.strategy.experimental_local_results(v)[0], out)


def _fit_loop(
    model,
    strategy,
    dataset,
    epochs,
    steps_per_epoch,
    callbacks,
    checkpoint_dir,
    checkpoint_every,
    verbose,
    log_every,
    validation,
):
    # Variables (model, optimizer, metrics) are created before the first step,
    # in scope: a worker function cannot create them.
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(_first_batch(dataset))
    with strategy.scope():
        y_pred = model(x, training=False)
        model.compute_metrics(x, y, y_pred, sample_weight)
        model.optimizer.build(model.trainable_variables)
    model.reset_metrics()
    counter = _step_counter(model, strategy)
    checkpoints = Checkpoints(model, checkpoint_dir, step=counter, several_tasks=counter is not None)
    global_step = _steps_done(model, counter)
    initial_epoch = min(epochs, global_step // steps_per_epoch)
    runner = _Runner(strategy, dataset, train_function(model, strategy))
    per_execution = positive_int("steps_per_execution", getattr(model, "steps_per_execution", 1) or 1)

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
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        runner.new_epoch()
        callback_list.on_epoch_begin(epoch)
        bar = keras.utils.Progbar(steps_per_epoch, verbose=verbose) if verbose else None
        launched, samples, start = [], 0, time.perf_counter()
        step = 0
        while step < steps_per_epoch:
            count = min(per_execution, steps_per_epoch - step)
            callback_list.on_train_batch_begin(step)
            launched.append(runner.launch(count))
            before, global_step, step = global_step, global_step + count, step + count
            last = step == steps_per_epoch
            due = bool(checkpoint_every) and global_step // checkpoint_every > before // checkpoint_every
            if step // log_every > (step - count) // log_every or last or due:
                results = runner.results(launched)
                launched = []
                samples += sum(n for _, n in results)
                logs = results[-1][0]
                rate = samples / max(time.perf_counter() - start, 1e-9)
                callback_list.on_train_batch_end(step - 1, logs)
                if bar is not None and not last:
                    bar.update(step, [*logs.items(), ("samples/s", rate)], finalize=False)
                if due:
                    _save(checkpoints, model, counter, global_step)
        logs = {name: float(value) for name, value in model.get_metrics_result().items()}
        logs["samples_per_second"] = samples / max(time.perf_counter() - start, 1e-9)
        if validation is not None:
            logs.update({f"val_{name}": value for name, value in validation().items()})
        if bar is not None:
            shown = [(k, v) for k, v in logs.items() if k != "samples_per_second"]
            bar.update(steps_per_epoch, shown + [("samples/s", logs["samples_per_second"])], finalize=True)
        _save(checkpoints, model, counter, global_step)
        callback_list.on_epoch_end(epoch, logs)
        if getattr(model, "stop_training", False):
            break
    callback_list.on_train_end(logs)
    return history


def _save(checkpoints, model, counter, global_step: int) -> None:
    """A checkpoint at `global_step` (every launched step has finished). Where workers race on the
    optimizer's own step count, it is set to the exact count first, so that a run resumed under another
    strategy (which reads `optimizer.iterations`) continues from the right step."""
    if counter is not None:
        model.optimizer.iterations.assign(global_step)
    checkpoints.save(global_step)


def steps_done(model: keras.Model) -> int:
    """Training steps `tfs.fit` has applied to `model` (counted exactly, also under asynchronous workers)."""
    counter = _STEP_COUNTERS.get(model)
    return _steps_done(model, counter)


__all__ = ["fit", "steps_done", "train_function"]
