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

import weakref
from typing import Callable, List, Optional, Union

import keras
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.keras.optimizers import check_trains_tables
from tf_sharded.keras.training import evaluation
from tf_sharded.keras.training.checkpoints import Checkpoints, PeriodicCheckpoint
from tf_sharded.keras.training.loop import FitSettings, Loop
from tf_sharded.strategy import FitLoop, family_of
from tf_sharded.table.protocol import owner_of

# Seconds `tfs.fit` waits for a failed parameter server to come back before it gives up.
RESTART_TIMEOUT = 300.0

DatasetSource = Union[Callable[[tf.distribute.InputContext], tf.data.Dataset], tf.data.Dataset]


def _first_batch(source: DatasetSource):
    return next(iter(evaluation.as_dataset(source)))


def _build_for_training(model, strategy, dataset) -> None:
    """Creates the variables of the model, its metrics and its optimizer from the first batch, in `strategy`'s
    scope, before any step is traced: a worker function cannot create variables, and a `tf.function` whose first
    trace creates them is traced a second time without."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(_first_batch(dataset))
    with strategy.scope():
        y_pred = model(x, training=False)
        model.compute_metrics(x, y, y_pred, sample_weight)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    model.reset_metrics()


def _batch_size(x) -> tf.Tensor:
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _check_saves_together(model) -> None:
    """Refuses `checkpoint_secs` for a model with tables sharded over workers: each save gathers their rows over
    collectives, which every worker must join at the same step, and each worker's clock would choose its own."""
    for variable in model.trainable_variables:
        tag = owner_of(variable)
        if tag is not None and getattr(tag[0], "sharded_over_workers", False):
            raise ValueError(
                f"Argument `checkpoint_secs` cannot apply to table '{tag[0].name}', sharded over the workers: every "
                "worker must save at the same step, and a time interval is measured by each worker's clock. Use "
                "checkpoint_every (steps) instead."
            )


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
    checkpoint_secs: Optional[float] = None,
    max_restarts: int = 2,
    max_steps: Optional[int] = None,
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
      checkpoint_dir: if set, the model, optimizer and step are checkpointed
        there at the start, at every epoch end, every `checkpoint_every` steps
        and every `checkpoint_secs` seconds, and a rerun restores the latest
        checkpoint and continues from its step and input position (see
        below). Under `MultiWorkerMirroredStrategy`
        every worker passes the same directory and saves, but only the
        chief's checkpoint lands there (the others write to a scratch
        directory inside it, removed after each save).
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
      checkpoint_secs: optional time interval between checkpoints: it bounds
        the work a parameter-server failure loses.
      max_restarts: under `ParameterServerStrategy`, how many parameter-server
        failures this call recovers from (0: none). On a failure it waits up to
        `RESTART_TIMEOUT` seconds for the task to return, restores model,
        optimizer, step and input position from the latest checkpoint in
        `checkpoint_dir` (required), prints one line (`ps:1 failed at step
        137; restored ckpt-120; resuming`) and continues.

      max_steps: optional: stop once the model has trained this many steps
        in all, the steps of a restored checkpoint included (as
        `tf.estimator`'s `max_steps`), even inside an epoch: a run whose
        epochs do not divide it ends exactly there, and a rerun with a larger
        value continues from the checkpoint to it. With Keras's `model.fit`
        and `steps_per_execution > 1`, whose last group of steps could pass
        it, `tfs.fit` runs its own replica loop instead.

    Steps are counted exactly: a step counts once, when it completes (also
    when the coordinator runs it again after a worker failure), and a step
    that fails counts nowhere, `optimizer.iterations` included. A resumed or
    recovered run also resumes the input: a dataset function is called with
    `skip=` (the batches its pipeline already consumed: per worker under
    parameter servers, `steps / workers`) when it takes that argument, and
    otherwise its first batches are dropped; a Dataset of known length
    resumes at the batch, and in the epoch, where the uninterrupted run
    would be; an endless Dataset (or one of unknown length) is a stream its
    caller positions. Where a first run trains with Keras's `model.fit`
    (default and mirrored strategies), a rerun that finds a checkpoint runs
    `tfs.fit`'s own replica loop where it can position the input this way (a
    Dataset of known length, or a function of an endless one with
    `steps_per_epoch`; with `steps_per_execution` 1), else `model.fit` from
    the checkpoint's epoch; a Dataset of unknown length then needs
    `steps_per_epoch`.

    Returns:
      The `keras.callbacks.History` of the run. Its `initial_step` is the
      step count the run started from (a restored checkpoint's; so
      `tfs.training.steps_done(model) - history.initial_step` steps ran in
      this call). In `tfs.fit`'s own loop its `recoveries` lists each
      parameter-server recovery (`tasks`, `failed_at` and `restored` steps,
      and `first_step_time`, the wall-clock time the first step after it
      completed).

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
    _check_model_and_dataset(model, dataset)
    per_execution = getattr(model, "steps_per_execution", 1) or 1
    settings = FitSettings.checked(
        epochs=epochs, steps_per_epoch=steps_per_epoch, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, checkpoint_secs=checkpoint_secs, verbose=verbose, log_every=log_every,
        max_restarts=max_restarts, max_steps=max_steps, restart_timeout=RESTART_TIMEOUT, per_execution=per_execution,
    )  # fmt: skip
    if settings.checkpoint_secs is not None:
        _check_saves_together(model)
    strategy = evaluation.strategy_of(model)
    settings.validation = evaluation.validation(model, strategy, validation_data, validation_steps)
    loop, dataset = _fit_loop_kind(model, strategy, dataset, settings)
    if loop == FitLoop.KERAS:
        return _keras_fit(model, dataset, settings.epochs, settings.steps_per_epoch, callbacks, checkpoint_dir,
                          settings.checkpoint_every, checkpoint_secs, verbose, validation_data, validation_steps,
                          settings.max_steps)  # fmt: skip
    if settings.steps_per_epoch is None and isinstance(dataset, tf.data.Dataset) and loop == FitLoop.REPLICAS:
        settings.steps_per_epoch = int(dataset.cardinality()) if int(dataset.cardinality()) > 0 else None
    if settings.steps_per_epoch is None:
        raise ValueError(
            f"Argument `steps_per_epoch` is required under {type(strategy).__name__} unless the dataset is a "
            "tf.data.Dataset of known, finite length (parameter-server workers read their own, usually "
            "repeated, datasets). Received: steps_per_epoch=None"
        )
    return _fit_loop(model, strategy, dataset, callbacks, settings)


def _check_model_and_dataset(model, dataset) -> None:
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


def _fit_loop_kind(model, strategy, dataset, settings: FitSettings):
    """(the loop `tfs.fit` runs, its input: for Keras's `model.fit`, the Dataset it reads)."""
    family = family_of(strategy)
    loop = family.fit_loop(strategy, settings.per_execution)
    if loop != FitLoop.KERAS:
        return loop, dataset
    data = evaluation.as_dataset(dataset)
    if family.mirrors_tables and evaluation.keras_fails_on(data):
        return FitLoop.REPLICAS, dataset  # Keras 3 fails on ragged or string inputs there: the replica loop runs them
    if settings.max_steps is not None and settings.per_execution > 1:
        return FitLoop.REPLICAS, dataset  # Keras runs whole groups of steps_per_execution steps: past max_steps
    if settings.checkpoint_dir and settings.per_execution == 1 and _continues(model, settings.checkpoint_dir):
        # model.fit would read its input from the start (and a resumed epoch whole), where the replica loop
        # reads on from the batch the uninterrupted run would be at, wherever it can position the input.
        resumable = _resumable_input(dataset, data, settings.steps_per_epoch, settings.checkpoint_dir)
        if resumable is not None:
            return FitLoop.REPLICAS, resumable
    return FitLoop.KERAS, data


def _continues(model, checkpoint_dir: str) -> bool:
    """Whether a run with checkpoints in `checkpoint_dir` continues one: a checkpoint is there to restore, or
    the model has trained steps already (which the directory's first checkpoint will hold)."""
    return bool(tf.train.latest_checkpoint(checkpoint_dir)) or int(model.optimizer.iterations.numpy()) > 0


def _resumable_input(dataset, data, steps_per_epoch, checkpoint_dir):
    """The input of a rerun's replica loop, or None where model.fit resumes as well (from the epoch the
    checkpoint is in, its input from the start: an endless Dataset, a stream its caller positions, or one of
    unknown length with `steps_per_epoch`):

    * a Dataset of known length (or a function's): positioned at each epoch as model.fit reads it;
    * a function of an endless Dataset, with `steps_per_epoch`: called with the batches consumed to skip
      (model.fit reads such a stream on from epoch to epoch).

    A Dataset of unknown length without `steps_per_epoch` is refused: neither the epoch nor the batch the
    checkpoint stopped at can be found (model.fit would train every epoch again).
    """
    size = int(data.cardinality())
    if size > 0:
        return data
    if callable(dataset) and size == tf.data.INFINITE_CARDINALITY and steps_per_epoch:
        return dataset
    if size == tf.data.UNKNOWN_CARDINALITY and steps_per_epoch is None:
        raise ValueError(
            f"Argument `steps_per_epoch` is required to resume from {checkpoint_dir!r} on a dataset of unknown "
            "length: without it neither the epoch nor the batch the checkpoint stopped at can be found (or "
            "give the length: `dataset.apply(tf.data.experimental.assert_cardinality(n))`). Received: "
            "steps_per_epoch=None"
        )
    return None


class _StopAt(keras.callbacks.Callback):
    """Stops `model.fit` once the model's step count reaches `limit` (counted from `start`, the count when
    training began, with the steps each batch callback reports: no read of the step variable per batch)."""

    def __init__(self, start: int, limit: int):
        super().__init__()
        self.done, self.limit, self._last = start, limit, -1

    def on_epoch_begin(self, epoch, logs=None):
        self._last = -1

    def on_train_batch_end(self, batch, logs=None):
        self.done += batch - self._last  # `batch`: the index of the last step of the group that ran
        self._last = batch
        if self.done >= self.limit:
            self.model.stop_training = True


def _keras_fit(model, data, epochs, steps_per_epoch, callbacks, checkpoint_dir, checkpoint_every, checkpoint_secs,
               verbose, validation_data, validation_steps, max_steps) -> keras.callbacks.History:  # fmt: skip
    """`model.fit` with tfs.fit's checkpoints, resume (of an input the replica loop cannot position,
    `_resumable_input`: from the epoch the checkpoint is in) and `max_steps`."""
    checkpoints = Checkpoints(model, checkpoint_dir) if checkpoint_dir else None
    callbacks = list(callbacks or [])
    start = int(model.optimizer.iterations.numpy())
    initial_epoch, limit = 0, max_steps
    if checkpoints is not None:
        callbacks.append(PeriodicCheckpoint(checkpoints, checkpoint_every, checkpoint_secs))
        if steps_per_epoch:
            initial_epoch = min(start // steps_per_epoch, epochs)
            if start % steps_per_epoch:
                # Resumed inside an epoch, which Keras runs whole: as in tfs.fit's own loop, the run ends where
                # the uninterrupted one does.
                limit = min(limit or epochs * steps_per_epoch, epochs * steps_per_epoch)
    if limit is not None:
        if start >= limit:
            if verbose:
                print(f"checkpoint at step {start} already covers the {limit} steps asked for")
            history = keras.callbacks.History()
            history.history, history.initial_step = {}, start
            return history
        callbacks.append(_StopAt(start, limit))
    if validation_data is not None:
        validation_data = evaluation.as_dataset(validation_data)
    if not _compat.keras_builds_before_tracing(model):
        # Otherwise the first traced step creates the optimizer's slots, and tf.function traces a step that
        # creates variables twice.
        _build_for_training(model, tf.distribute.get_strategy(), data)
    history = model.fit(
        data,
        epochs=epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch,
        callbacks=callbacks,
        verbose=verbose,
        validation_data=validation_data,
        validation_steps=validation_steps,
        shuffle=False,  # `data` is a Dataset, which Keras never shuffles: its default, True, only warns
    )
    history.initial_step = start
    return history


# Per model, where workers apply steps asynchronously (parameter servers): the step count, kept on a ps so
# that checkpoints hold it. This process counts completed steps and assigns it (`fit_loop`): Keras's own
# `optimizer.iterations` is incremented with a read-then-assign that loses counts when two workers race,
# and by every run of a step the coordinator retries.
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

    @tf.function
    def step_fn(data):
        def step(data):
            logs = dict(model.train_step(data))
            logs["_samples"] = _batch_size(keras.utils.unpack_x_y_sample_weight(data)[0])
            return logs

        return strategy.run(step, args=(data,))

    return step_fn


def _fit_loop(model, strategy, dataset, callbacks, settings: FitSettings):
    _build_for_training(model, strategy, dataset)
    counter = _step_counter(model, strategy)
    checkpoints = Checkpoints(model, settings.checkpoint_dir, step=counter, several_tasks=counter is not None)
    loop = Loop(model, strategy, dataset, settings, checkpoints, counter, lambda: train_function(model, strategy))
    history = keras.callbacks.History()
    history.initial_step = loop.global_step
    callback_list = keras.callbacks.CallbackList(
        list(callbacks or []) + [history],
        add_history=False,
        add_progbar=False,
        model=model,
        epochs=settings.epochs,
        steps=settings.steps_per_epoch,
        verbose=settings.verbose,
    )
    loop.run(callback_list, history)
    return history


def steps_done(model: keras.Model) -> int:
    """Training steps `tfs.fit` has applied to `model` (counted exactly, also under asynchronous workers)."""
    counter = _STEP_COUNTERS.get(model)
    return _steps_done(model, counter)


__all__ = ["fit", "steps_done", "train_function"]
