"""`tfs.fit`'s own training loop (parameter servers, and multi-worker mirrored): launching steps, counting
them, checkpointing, resuming the input position, and recovering from a parameter-server failure.

Steps are counted on this process from the steps that completed, never in
the step itself: TensorFlow's coordinator runs a step whose worker failed
again on another worker (at least once), and an in-graph counter would
count both runs. A launch counts when its result arrives; when a launch
fails, the launches that completed before it still count and nothing else
does.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Callable, Optional

import keras
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.errors import positive_int
from tf_sharded.keras.training import evaluation, recovery
from tf_sharded.strategy import FitLoop, family_of


@dataclasses.dataclass
class FitSettings:
    """What one `tfs.fit` call asks of its loop, checked (`checked`): `tfs.fit`'s arguments of the same names,
    with `validation` the epoch-end evaluation (or None) and `per_execution` the model's
    `steps_per_execution`."""

    epochs: int = 1
    steps_per_epoch: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None
    checkpoint_secs: Optional[float] = None
    verbose: int = 1
    log_every: int = 10
    max_restarts: int = 2
    max_steps: Optional[int] = None
    restart_timeout: float = 300.0
    validation: Optional[Callable[[], dict]] = None
    per_execution: int = 1

    @classmethod
    def checked(cls, **arguments) -> FitSettings:
        """The settings of `arguments`, each checked; errors name the argument."""
        settings = cls(**arguments)
        settings.epochs = positive_int("epochs", settings.epochs)
        for name in ("steps_per_epoch", "checkpoint_every", "max_steps"):
            if getattr(settings, name) is not None:
                setattr(settings, name, positive_int(name, getattr(settings, name)))
        secs = settings.checkpoint_secs
        if secs is not None and not (isinstance(secs, (int, float)) and not isinstance(secs, bool) and secs > 0):
            raise ValueError(f"Argument `checkpoint_secs` must be a positive number. Received: {secs!r}")
        restarts = settings.max_restarts
        if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
            raise ValueError(f"Argument `max_restarts` must be an int >= 0. Received: {restarts!r}")
        settings.log_every = positive_int("log_every", settings.log_every)
        settings.per_execution = positive_int("steps_per_execution", settings.per_execution)
        return settings


def _with_skip(fn: Callable, skip: int) -> Callable:
    """The dataset function reading from `skip` batches on: called with `skip=` when it takes that argument
    (so it can seek), else its dataset's first `skip` batches are dropped."""
    if skip <= 0:
        return fn
    if "skip" in inspect.signature(fn).parameters:
        return lambda context: fn(context, skip=skip)
    return lambda context: fn(context).skip(skip)


def epoch_plan(epochs: int, per_epoch: int, size: int) -> list:
    """`(first batch, steps)` of each epoch, read as Keras's `model.fit` reads a Dataset of `size` batches with
    `per_epoch` steps an epoch: an epoch reads on where the last one stopped, ends early when the Dataset runs
    out, and the next one starts it over. `size` 0 (an endless Dataset, or a stream its caller positions):
    every epoch runs `per_epoch` steps, and its first batch is not used."""
    plan, offset = [], 0
    for _ in range(epochs):
        if size and offset >= size:
            offset = 0
        steps = min(per_epoch, size - offset) if size else per_epoch
        plan.append((offset, steps))
        offset += steps
    return plan


class Runner:
    """How steps are launched and their results collected: `CoordinatorRunner` (parameter servers: steps
    scheduled on the workers) or `ReplicaRunner` (every replica runs each step here); `runner_for` picks.

    `position`: steps of this run already done, whose input a dataset
    function skips (per worker under parameter servers: `position /
    workers`, exact with one). A Dataset is positioned at each epoch's start
    instead (`new_epoch`).
    """

    # Whether a failed step can be a lost parameter server, recovered from inside the loop.
    recovers_tasks = False
    # Whether a finite Dataset is read once per epoch (as model.fit reads it) and positioned by `new_epoch`.
    per_epoch = False
    # Replicas whose batches one step's logs stand for (the first replica's batch size counts for each).
    replicas = 1

    def __init__(self, strategy, step_fn, unrolled: bool):
        self.strategy = strategy
        # Unrolled copies must each trace their own collectives: the undecorated step, not one function
        # called several times (its collectives would share their instance keys). Only the mirrored
        # families have replicas that meet in a step; elsewhere the steps run in a loop, traced once.
        inline_step = getattr(step_fn, "python_function", step_fn)

        def one_step(iterator, inline=False):
            return self._logs((inline_step if inline else step_fn)(next(iterator)))

        @tf.function
        def scheduled(iterator, count):
            # `count` consecutive steps in one function (Keras's `steps_per_execution`): one dispatch
            # for all of them. The logs are the last step's, the batch sizes summed. A loop, unrolled
            # where replicas meet in the step, so that every step's collectives have their own instance
            # (in a loop, replicas one iteration apart would meet in one instance).
            logs = one_step(iterator, inline=unrolled)
            if count == 1:
                return logs
            samples = logs["_samples"]
            for _ in range(count - 1) if unrolled else tf.range(count - 1):
                logs = one_step(iterator, inline=unrolled)
                samples += logs["_samples"]
            logs["_samples"] = samples
            return logs

        self._scheduled = scheduled

    def _logs(self, logs):
        """A step's logs as the launch returns them."""
        return logs

    # Batches of a finite Dataset read once per epoch (`per_epoch`), else 0.
    size = 0

    def new_epoch(self, batch: int):
        """Positions a finite Dataset read per epoch at `batch` (an epoch's first batch plus the steps of it
        already done, not 0 in a resumed run)."""

    def launch(self, count: int = 1):
        """Starts `count` steps (one scheduled function, traced once per distinct count)."""
        raise NotImplementedError

    def _values(self, launched: list) -> list:
        raise NotImplementedError

    def results(self, launched: list) -> list:
        """Per launch `(result, count)`: its last step's logs as floats and its samples over all replicas."""
        return [({k: float(v) for k, v in r.items() if k != "_samples"}, int(r["_samples"]) * self.replicas)
                for r in self._values(launched)]  # fmt: skip

    def completed(self, launched: list) -> int:
        """After a failure: the steps of `launched` that completed (a retried launch once)."""
        return sum(count for _, count in launched)


class CoordinatorRunner(Runner):
    """Parameter servers: each launch is scheduled on a worker by TensorFlow's coordinator, each worker
    reading its own dataset."""

    recovers_tasks = True

    def __init__(self, strategy, dataset, step_fn, position: int = 0):
        super().__init__(strategy, step_fn, unrolled=False)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        workers = _compat.ps_num_workers(strategy)
        fn = dataset if callable(dataset) else (lambda context: dataset)
        self.distributed = self.coordinator.create_per_worker_dataset(
            evaluation.per_worker(_with_skip(fn, position // workers))
        )
        self.iterator = iter(self.distributed)

    def launch(self, count: int = 1):
        return self.coordinator.schedule(self._scheduled, args=(self.iterator, count))

    def _values(self, launched: list) -> list:
        self.coordinator.join()
        return [r.fetch() for r, _ in launched]

    def completed(self, launched: list) -> int:
        done = 0
        for result, count in launched:
            try:
                result.fetch()
            except Exception:  # noqa: BLE001 - failed or cancelled: it did not complete
                continue
            done += count
        return done


class ReplicaRunner(Runner):
    """Every replica of this process runs each step (default, mirrored, multi-worker mirrored, hybrid)."""

    def __init__(self, strategy, dataset, step_fn, position: int = 0):
        super().__init__(strategy, step_fn, unrolled=family_of(strategy).mirrors_tables)
        self.replicas = strategy.num_replicas_in_sync
        self._dataset, self._consumed = dataset, 0
        # A finite Dataset is read once per epoch, like model.fit; a dataset function should repeat.
        self.per_epoch = isinstance(dataset, tf.data.Dataset)
        if self.per_epoch:
            self.distributed = strategy.experimental_distribute_dataset(dataset)
            # A finite Dataset resumes where its epoch stopped (`new_epoch`); an endless one (or one of
            # unknown length) is a stream its caller positions.
            self.size = max(int(dataset.cardinality()), 0)
        else:
            self.distributed = strategy.distribute_datasets_from_function(_with_skip(dataset, position))
        self.iterator = iter(self.distributed)

    def _logs(self, logs):
        # The first replica's logs (its batch size stands for every replica's): plain tensors.
        return tf.nest.map_structure(lambda v: self.strategy.experimental_local_results(v)[0], logs)

    def new_epoch(self, batch: int):
        if not self.per_epoch or not self.size:
            return
        if batch != self._consumed:
            skipped = self._dataset.skip(batch) if batch else self._dataset
            self.iterator = iter(self.strategy.experimental_distribute_dataset(skipped))
            self._consumed = batch

    def launch(self, count: int = 1):
        self._consumed += count
        return self._scheduled(self.iterator, count)

    def _values(self, launched: list) -> list:
        return [tf.nest.map_structure(lambda v: v.numpy(), r) for r, _ in launched]


def runner_for(strategy, dataset, step_fn, position: int = 0) -> Runner:
    """The runner of `strategy`'s fit loop."""
    coordinated = family_of(strategy).fit_loop(strategy, 1) == FitLoop.COORDINATOR
    return (CoordinatorRunner if coordinated else ReplicaRunner)(strategy, dataset, step_fn, position)


def _names(tasks) -> str:
    return ", ".join(f"ps:{t}" for t in sorted(tasks))


class Loop:
    """The epochs of one `tfs.fit` call under `FitLoop.COORDINATOR` or `FitLoop.REPLICAS`."""

    def __init__(self, model, strategy, dataset, settings: FitSettings, checkpoints, counter, make_step: Callable):
        self.model, self.strategy, self.dataset, self.s = model, strategy, dataset, settings
        self.checkpoints, self.counter, self.make_step = checkpoints, counter, make_step
        self.global_step = int((counter if counter is not None else model.optimizer.iterations).numpy())
        # Without a checkpoint directory every call trains its epochs (as model.fit does); with one, a
        # rerun continues the run the checkpoints belong to.
        self.first_step = 0 if checkpoints.manager is not None else self.global_step
        self.restarts, self.recoveries = 0, []
        self.runner = runner_for(strategy, dataset, make_step(), self.global_step - self.first_step)
        self.plan = epoch_plan(settings.epochs, settings.steps_per_epoch, self.runner.size)
        # The step each epoch starts at (and, last, the run's total).
        self.epoch_starts = [sum(steps for _, steps in self.plan[:e]) for e in range(len(self.plan) + 1)]
        self.last_save = time.monotonic()
        self._awaiting_first = None
        if checkpoints.manager is not None and checkpoints.started_from is None:
            self.save()  # what a parameter-server failure before the first periodic save restores

    def position(self) -> int:
        return self.global_step - self.first_step

    def _more(self) -> bool:
        """Whether steps remain: the epochs not all done, and `max_steps` (the model's own count) not reached."""
        max_steps = self.s.max_steps
        done = self.position() >= self.epoch_starts[-1]
        return not done and (max_steps is None or self.global_step < max_steps)

    def run(self, callbacks, history) -> None:
        epochs, total = self.s.epochs, self.epoch_starts[-1]
        self.model.stop_training = False  # as in model.fit: a flag an earlier run's callback left is not this run's
        callbacks.on_train_begin()
        logs = {}
        if not self._more() and self.s.verbose:
            epochs_done = self.position() >= total
            covered = f"{epochs} epoch(s), {total} steps" if epochs_done else f"max_steps={self.s.max_steps}"
            print(f"checkpoint at step {self.global_step} already covers {covered}")
        while self._more():
            epoch = max(e for e in range(epochs) if self.epoch_starts[e] <= self.position())
            try:
                logs = self._epoch(epoch, callbacks)
            except Exception as error:  # noqa: BLE001 - a ps failure, in a step or a save, is recovered from
                self._fail(error)  # returns once recovered; raises any other error
                continue
            if getattr(self.model, "stop_training", False):
                break
        callbacks.on_train_end(logs)
        history.recoveries = self.recoveries

    def _epoch(self, epoch, callbacks) -> dict:
        verbose = self.s.verbose
        self.model.reset_metrics()
        first_batch, steps = self.plan[epoch]
        step = self.position() - self.epoch_starts[epoch]
        # The epoch's last step: its end, or earlier where `max_steps` comes first.
        max_steps = self.s.max_steps
        end = steps if max_steps is None else min(steps, step + max_steps - self.global_step)
        self.runner.new_epoch(first_batch + step)
        callbacks.on_epoch_begin(epoch)
        bar = keras.utils.Progbar(end, verbose=verbose) if verbose else None
        launched, samples, start = [], 0, time.perf_counter()
        # Callbacks that report every N steps of the model's count (`steps_between_reports`, as TableMetrics)
        # get their batch callback at those steps, whatever `log_every` is.
        reports = [r for r in (getattr(c, "steps_between_reports", None) for c in callbacks.callbacks) if r]
        while step < end:
            count = min(self.s.per_execution, end - step)
            callbacks.on_train_batch_begin(step)
            step += count
            last = step == end
            try:
                launched.append((self.runner.launch(count), count))
                launched_to = self.global_step + sum(n for _, n in launched)
                due = self._checkpoint_due(launched_to, count)
                every = self.s.log_every
                collect = step // every > (step - count) // every or last or due or self._awaiting_first is not None
                collect = collect or any(launched_to // r > (launched_to - count) // r for r in reports)
                results = self.runner.results(launched) if collect else None
            except Exception:
                self.global_step += self.runner.completed(launched)  # the launches that completed count
                raise
            if results is None:
                continue
            self.global_step += sum(n for _, n in launched)
            launched = []
            self._first_step_done()
            samples += sum(n for _, n in results)
            logs = results[-1][0]
            rate = samples / max(time.perf_counter() - start, 1e-9)
            self.sync_step()  # the callbacks read the exact step count (`steps_done`)
            callbacks.on_train_batch_end(step - 1, logs)
            if bar is not None and not last:
                bar.update(step, [*logs.items(), ("samples/s", rate)], finalize=False)
            if due:
                self.save()
            if getattr(self.model, "stop_training", False):
                break  # a callback stopped training: this epoch ends here, as in model.fit
        logs = {name: float(value) for name, value in self.model.get_metrics_result().items()}
        logs["samples_per_second"] = samples / max(time.perf_counter() - start, 1e-9)
        if self.s.validation is not None:
            logs.update({f"val_{name}": value for name, value in self.s.validation().items()})
        if bar is not None:
            shown = [(k, v) for k, v in logs.items() if k != "samples_per_second"]
            bar.update(end, shown + [("samples/s", logs["samples_per_second"])], finalize=True)
        self.save()
        callbacks.on_epoch_end(epoch, logs)
        return logs

    def _checkpoint_due(self, launched_to: int, count: int) -> bool:
        every, secs = self.s.checkpoint_every, self.s.checkpoint_secs
        if every and launched_to // every > (launched_to - count) // every:
            return True
        return secs is not None and time.monotonic() - self.last_save >= secs

    def sync_step(self) -> None:
        """Where workers race on Keras's own step count (parameter servers), it is set to the exact count,
        so that a run resumed under another strategy (which reads `optimizer.iterations`) continues right."""
        if self.counter is not None:
            self.counter.assign(self.global_step)
            self.model.optimizer.iterations.assign(self.global_step)

    def save(self) -> None:
        """A checkpoint at `global_step`: every launched step has finished and no other is running."""
        self.sync_step()
        self.checkpoints.save(self.global_step)
        self.last_save = time.monotonic()

    def _fail(self, error: BaseException) -> None:
        """After a failure (the completed steps counted): recovers from a ps failure and returns, the loop
        continuing from the restored `global_step`; raises any other error."""
        tasks = set()
        if self.runner.recovers_tasks:
            tasks = recovery.failed_ps(error) or recovery.lost_ps()
        if not tasks:
            self.sync_step()  # the exact count, where the failed step's own increments raced
            raise error
        # Until a step completes after a recovery, a failure is the same one: a worker's channel to the
        # restarted task can take a moment to reconnect. It is retried within the restart timeout.
        announced = retrying = self._awaiting_first is not None
        if retrying:
            failed_at, tasks = self._awaiting_first["failed_at"], set(self._awaiting_first["tasks"])
        else:
            failed_at = self.global_step
            self._check_restart_allowed(tasks, error)
            self.restarts += 1
            self._recovery_began, self._renewed, self._lost = time.monotonic(), [], set()
        while True:
            remaining = self.s.restart_timeout - (time.monotonic() - self._recovery_began)
            if remaining <= 0:
                raise RuntimeError(
                    f"{_names(tasks)} failed at step {failed_at} and did not serve steps again within "
                    f"{self.s.restart_timeout:.0f}s: rerun with the same checkpoint_dir to resume"
                ) from error
            if retrying:
                time.sleep(min(1.0, remaining))
            try:
                path = self._restore(tasks, remaining)
                break
            except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError) as again:
                error, retrying = again, True  # the restarted task's channels are still reconnecting
        tasks = self._lost or tasks
        if not announced:
            print(
                f"{_names(tasks)} failed at step {failed_at}; restored {path.rsplit('/', 1)[-1]}; resuming", flush=True
            )
        self._awaiting_first = {
            "tasks": sorted(tasks),
            "failed_at": failed_at,
            "restored": self.global_step,
            "back_time": self._back_time,  # when the task answered again
        }

    def _restore(self, tasks, remaining: float) -> str:
        """One attempt: waits for `tasks`, renews what they lost and restores the latest checkpoint everywhere
        (every renewed variable it does not hold set to zero); returns the checkpoint's path."""
        recovery.wait_for(tasks, remaining)
        self._back_time = time.time()
        lost, renewed = recovery.reconnect(tasks)
        self._lost |= lost
        self._renewed += renewed
        recovery.reset_dynamic(self.checkpoints.checkpoint)
        path, self.global_step = self.checkpoints.restore_latest()
        recovery.zero_unrestored(self._renewed)
        self.sync_step()
        self.model.reset_metrics()
        self.runner = runner_for(self.strategy, self.dataset, self.make_step(), self.position())
        return path

    def _check_restart_allowed(self, tasks, error) -> None:
        where = f"{_names(tasks)} failed at step {self.global_step}"
        if self.checkpoints.manager is None:
            raise RuntimeError(
                f"{where}; tfs.fit was given no checkpoint_dir, so there is nothing to restore: rerun with "
                "checkpoint_dir=... to resume from checkpoints after a parameter-server failure"
            ) from error
        if self.restarts >= self.s.max_restarts:
            raise RuntimeError(
                f"{where}; max_restarts={self.s.max_restarts} restarts already used: rerun with the same "
                "checkpoint_dir to resume from the latest checkpoint"
            ) from error

    def _first_step_done(self) -> None:
        if self._awaiting_first is not None:
            self._awaiting_first["first_step_time"] = time.time()
            self.recoveries.append(self._awaiting_first)
            self._awaiting_first = None


__all__ = ["CoordinatorRunner", "FitSettings", "Loop", "ReplicaRunner", "Runner", "runner_for"]
