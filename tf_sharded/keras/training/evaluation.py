"""`tfs.evaluate` and `tfs.predict`: Keras's `evaluate` / `predict` under every strategy.

Keras 3's `model.evaluate` and `model.predict` refuse a model built under
`ParameterServerStrategy` ("you need to pass this dataset to
ClusterCoordinator.create_per_worker_dataset"), fail before the first batch
under `MultiWorkerMirroredStrategy` (keras-team/keras#20585) and on ragged
inputs under `MirroredStrategy` (`'RaggedTensor' object has no attribute
'device'`). Where Keras works these call it. Elsewhere the forward passes
run where the strategy runs them (under parameter servers: one scheduled
function per batch on whichever worker is free) and the coordinator
aggregates: it updates the compiled loss and metrics from every batch's
labels and predictions in input order, so the figures are exactly those of
the whole data, whatever worker computed which batch.
"""

from __future__ import annotations

import collections
from typing import Callable, Dict, Iterator, List, Optional, Union

import keras
import numpy as np
import tensorflow as tf

from tf_sharded.errors import positive_int
from tf_sharded.strategy import FitLoop, family_of

Data = Union[tf.data.Dataset, Callable[[tf.distribute.InputContext], tf.data.Dataset]]


def strategy_of(model):
    """The strategy in scope, else the one the model was built under."""
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else model.distribute_strategy


def as_dataset(data: Data) -> tf.data.Dataset:
    """`data` itself, or the dataset a dataset function builds for one input pipeline (this process)."""
    return data if isinstance(data, tf.data.Dataset) else data(tf.distribute.InputContext())


def keras_fails_on(dataset: tf.data.Dataset) -> bool:
    """Whether Keras 3 fails on `dataset` under MirroredStrategy: ragged components ("'RaggedTensor' object has
    no attribute 'device'"), or string ones (Keras builds the model from the first batch averaged over the
    replicas, and strings cannot be averaged)."""
    specs = tf.nest.flatten(dataset.element_spec)
    return any(isinstance(s, tf.RaggedTensorSpec) or getattr(s, "dtype", None) == tf.string for s in specs)


def _check(model, data, steps, needs_compiled: bool, names=("data", "steps")):
    if not isinstance(model, keras.Model) or (needs_compiled and not getattr(model, "compiled", False)):
        raise ValueError(
            f"Argument `model` must be a {'compiled ' if needs_compiled else ''}keras.Model. "
            f"Received: {type(model).__name__}"
        )
    if not (callable(data) or isinstance(data, tf.data.Dataset)):
        raise ValueError(
            f"Argument `{names[0]}` must be a tf.data.Dataset or a function input_context -> tf.data.Dataset. "
            f"Received: {type(data).__name__}"
        )
    if steps is not None:
        positive_int(names[1], steps)
    strategy = strategy_of(model)
    coordinated = family_of(strategy).fit_loop(strategy, 1) == FitLoop.COORDINATOR
    if not isinstance(data, tf.data.Dataset) and steps is None and coordinated:
        raise ValueError(
            f"Argument `{names[1]}` is required when `{names[0]}` is a dataset function under "
            f"ParameterServerStrategy (each worker reads its own, usually repeated, dataset). "
            f"Received: {names[1]}=None"
        )
    return strategy, coordinated


def per_worker(fn: Callable) -> Callable[[], tf.data.Dataset]:
    """The dataset function in the form `ClusterCoordinator.create_per_worker_dataset` calls (no arguments).

    TensorFlow traces it once on the coordinator and runs that graph on every
    worker, so the `InputContext` passed is the one TensorFlow's own
    parameter-server input gets: one input pipeline, id 0, on every worker.
    """
    return lambda: fn(tf.distribute.InputContext())


def _keras_path(model, strategy, data) -> Optional[tf.data.Dataset]:
    """The dataset to hand to Keras's own evaluate / predict, or None where Keras fails."""
    family = family_of(strategy)
    if family.fit_loop(strategy, 1) != FitLoop.KERAS:
        return None
    dataset = as_dataset(data)
    if family.mirrors_tables and keras_fails_on(dataset):
        return None
    return dataset


def _outputs(model, strategy, coordinated: bool, data: Data, steps: Optional[int]) -> Iterator[tuple]:
    """`(x, y, sample_weight, y_pred)` per batch, on this process, in input order.

    Under parameter servers each batch's forward pass is one function scheduled on a free worker: batches
    of a `tf.data.Dataset` are sent from here (a few in flight per worker); a dataset function is called
    by each worker, which reads its own batches (`steps` of them in all), and `x` is not sent back.
    """

    def forward(x):
        return model(x, training=False)

    if not coordinated:
        step = tf.function(forward)
        for i, batch in enumerate(as_dataset(data)):
            if steps is not None and i >= steps:
                return
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            yield x, y, sample_weight, step(x)
        return

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

    def labelled(batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        out = {"y_pred": strategy.run(forward, args=(x,))}
        if y is not None:
            out["y"] = y
        if sample_weight is not None:
            out["sample_weight"] = sample_weight
        return out

    if isinstance(data, tf.data.Dataset):
        sent = tf.function(lambda x: strategy.run(forward, args=(x,)))
        in_flight = collections.deque()  # (x, y, sample_weight, remote y_pred), oldest first
        limit = 8  # batches in flight: enough to keep a few workers busy, few enough to hold here
        for i, batch in enumerate(data):
            if steps is not None and i >= steps:
                break
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            in_flight.append((x, y, sample_weight, coordinator.schedule(sent, args=(x,))))
            if len(in_flight) >= limit:
                x, y, sample_weight, remote = in_flight.popleft()
                yield x, y, sample_weight, remote.fetch()
        for x, y, sample_weight, remote in in_flight:
            yield x, y, sample_weight, remote.fetch()
        return

    iterator = iter(coordinator.create_per_worker_dataset(per_worker(data)))
    read = tf.function(lambda iterator: labelled(next(iterator)))
    launched = [coordinator.schedule(read, args=(iterator,)) for _ in range(steps)]
    for remote in launched:
        out = remote.fetch()
        yield None, out.get("y"), out.get("sample_weight"), out["y_pred"]


def _batch_size(x, y, y_pred) -> int:
    first = next(t for t in tf.nest.flatten((y_pred, y, x)) if t is not None)
    return int(first.shape[0])


def _in_order(model, logs: Dict[str, float]) -> List[float]:
    """Keras's list order: the model's metrics (the compiled ones one by one), then the rest by name."""
    names = []
    for metric in model.metrics:
        inner = getattr(metric, "metrics", None)  # Keras's compile-metrics container
        names += [m.name for m in inner] if isinstance(inner, list) else [metric.name]
    return [logs[n] for n in names if n in logs] + [logs[k] for k in sorted(logs) if k not in names]


def evaluate(model: keras.Model, data: Data, steps: Optional[int] = None, return_dict: bool = False,
             verbose: int = 0):  # fmt: skip
    """The compiled loss and metrics of `model` on `data`, under the current strategy.

    Same results as Keras's `model.evaluate` (which it calls where Keras
    supports the strategy and inputs), also under `ParameterServerStrategy`
    and `MultiWorkerMirroredStrategy`.

    Args:
      model: a compiled `keras.Model`.
      data: a finite `tf.data.Dataset` of `(x, y)` or `(x, y, sample_weight)`
        batches, or a function `input_context -> tf.data.Dataset` (under
        parameter servers each worker calls it and `steps` is required).
      steps: batches to evaluate (default: the whole dataset).
      return_dict: return `{name: value}` instead of a list.
      verbose: Keras's verbosity where Keras runs.

    Returns:
      The loss (a float) if the model has no metrics, else the list of loss
      and metrics in `model.metrics_names` order; a dict with
      `return_dict=True`.

    Raises:
      ValueError: an argument is missing or of the wrong kind.

    Example:

    >>> import keras, tf_sharded as tfs
    >>> inp = keras.Input((2,), dtype="int64")
    >>> out = keras.layers.Dense(1)(tfs.layers.Embedding(10, 4, combiner="sum", seed=0)(inp))
    >>> model = keras.Model(inp, out)
    >>> model.compile(optimizer=tfs.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    >>> data = tf.data.Dataset.from_tensor_slices(([[1, 2], [3, 4]], [[1.0], [0.0]])).batch(2)
    >>> sorted(tfs.evaluate(model, data, return_dict=True))
    ['loss', 'mae']
    """
    strategy, coordinated = _check(model, data, steps, needs_compiled=True)
    dataset = _keras_path(model, strategy, data)
    if dataset is not None:
        return model.evaluate(dataset, steps=steps, return_dict=return_dict, verbose=verbose)
    logs = evaluate_logs(model, strategy, coordinated, data, steps)
    if return_dict:
        return logs
    values = _in_order(model, logs)
    return values[0] if len(values) == 1 else values


def evaluate_logs(model, strategy, coordinated: bool, data: Data, steps: Optional[int]) -> Dict[str, float]:
    """Loss and metrics over `data`, aggregated on this process from every batch's labels and predictions."""
    model.reset_metrics()
    # Keras weighs each batch's loss by its batch size; so does this running mean.
    total, count = 0.0, 0
    for x, y, sample_weight, y_pred in _outputs(model, strategy, coordinated, data, steps):
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
        n = _batch_size(x, y, y_pred)
        total, count = total + float(loss) * n, count + n
        # In scope: metric variables built here are the strategy's, as those `tfs.fit` updates on workers.
        with strategy.scope():
            model.compute_metrics(x, y, y_pred, sample_weight)
    if count == 0:
        raise ValueError("Argument `data` yielded no batches to evaluate.")
    logs = {name: float(value) for name, value in model.get_metrics_result().items()}
    logs["loss"] = total / count
    return logs


def validation(model, strategy, data: Optional[Data], steps: Optional[int]) -> Optional[Callable[[], dict]]:
    """For `tfs.fit(validation_data=...)`: the arguments checked now, and a function that evaluates at an
    epoch end (None without validation data)."""
    if data is None:
        if steps is not None:
            raise ValueError(f"Argument `validation_steps` needs `validation_data`. Received: validation_steps={steps}")
        return None
    _, coordinated = _check(model, data, steps, needs_compiled=True, names=("validation_data", "validation_steps"))
    return lambda: evaluate_logs(model, strategy, coordinated, data, steps)


def predict(model: keras.Model, data: Data, steps: Optional[int] = None, verbose: int = 0):
    """The model's outputs on `data` as NumPy arrays, under the current strategy.

    Same results as Keras's `model.predict` (which it calls where Keras
    supports the strategy and inputs). Under parameter servers with a
    `tf.data.Dataset` the outputs are in input order; with a dataset function
    they are in the order the scheduled batches were launched.

    Args:
      model: a `keras.Model`.
      data: a finite `tf.data.Dataset` of inputs (or of `(x, y)` batches,
        whose labels are ignored), or a function `input_context ->
        tf.data.Dataset` (under parameter servers `steps` is required).
      steps: batches to predict (default: the whole dataset).
      verbose: Keras's verbosity where Keras runs.

    Returns:
      The concatenated outputs (a structure of arrays for several outputs).

    Example:

    >>> import keras, tf_sharded as tfs
    >>> inp = keras.Input((2,), dtype="int64")
    >>> model = keras.Model(inp, tfs.layers.Embedding(10, 4, combiner="sum", seed=0)(inp))
    >>> tfs.predict(model, tf.data.Dataset.from_tensor_slices([[1, 2], [3, 4], [5, 6]]).batch(2)).shape
    (3, 4)
    """
    strategy, coordinated = _check(model, data, steps, needs_compiled=False)
    dataset = _keras_path(model, strategy, data)
    if dataset is not None:
        return model.predict(dataset, steps=steps, verbose=verbose)
    outputs = [tf.nest.map_structure(np.asarray, out[3]) for out in _outputs(model, strategy, coordinated, data, steps)]
    if not outputs:
        raise ValueError("Argument `data` yielded no batches to predict.")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)


__all__ = ["evaluate", "predict"]
