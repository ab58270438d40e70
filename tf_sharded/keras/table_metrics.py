"""`TableMetrics`: what each table of a model holds, in Keras logs and TensorBoard, as training runs.

Every `every` training steps, for each tf_sharded table of the model (each
member of a batched storage or of shared row pools on its own), the callback
adds to the logs:

* `tables/<name>/rows`: rows held (a fixed table's row count, a dynamic
  table's live keys);
* `tables/<name>/bytes`: the bytes of those rows and of the optimizer's
  slots beside them (a tf_sharded optimizer's per-row slots);
* `tables/<name>/shard_load`: the largest shard's rows over the mean
  shard's (1.0: even).

Each table also reports, since the last report (the first: since training
began), `tables/<name>/lookup_load`: what the busiest shard's training
lookups asked of it over the mean shard's (a dynamic table's ids; a fixed
table's distinct ids per step, the rows it read and updates). A dynamic
table adds:

* `tables/<name>/admitted`, `.../rejected`, `.../evicted`: keys given a
  row, absent keys turned away (an admission policy, a capacity bound), and
  keys evicted;
* `tables/<name>/hit_rate`: the looked-up ids whose key was present / the
  ids looked up.

A table whose gradient the replicas exchange (mirrored, or sharded over the
replicas of one process; not yet a dynamic table whose rows share pools with
others) adds `tables/<name>/exchange_bytes`: the bytes the
replicas put into its exchange per step since the last report, summed over
them (the gradient rows and their ids each sends to be gathered or summed
on the owner, or the densified shard it all-reduces; the one-row markers
and shared counts left out).

`lookup_load` and `hit_rate` are left out of a report with no lookups since
the one before.

They are read from where the tables live: a dynamic table's shards count
their keys and these events on their devices, parameter servers or table
servers, with one counter update per row pool and step; a fixed table's
training lookups add each shard's distinct ids to a counter on the lookup
group's first device, one op per group and step (`tf_sharded.table.tally`),
summed over the workers of a MultiWorkerMirroredStrategy at the report; a
table server counts the rows its applies update, every worker's. A
report reads a few scalars per table and computes the figures from them,
never on the step's path. The epoch's logs carry the last report too, so
`History` holds them.

With `log_dir`, each report is also written with `tf.summary` at the
optimizer's step (a resumed run continues its curves where it stopped), with
each table's rows and lookups per shard as histograms; with `write_logs`,
the Keras logs' numbers too (`train/<name>` at each report: the loss and metrics;
`epoch/<name>` at each epoch's end: samples per second among them). Only
the process that saves summaries for its strategy writes them
(`should_save_summary`: the chief; under parameter servers, the
coordinator).
"""

from __future__ import annotations

import os
import time
from typing import Dict, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_sharded._compat import cluster_workers, write_summary_event
from tf_sharded.errors import positive_int
from tf_sharded.keras.training.trainer import steps_done
from tf_sharded.table import tally
from tf_sharded.table.batched import logical_tables
from tf_sharded.table.dynamic.pool import EVENTS
from tf_sharded.table.protocol import owner_of
from tf_sharded.table.registry import placement_of
from tf_sharded.table.remote import sum_over_workers

PREFIX = "tables"


def model_tables(model) -> list:
    """The tf_sharded tables of `model` a user sees (a storage's or a pool group's members), in model order."""
    found = {}
    for variable in model.variables:
        tag = owner_of(variable)
        if tag is not None:
            for table in logical_tables(tag[0]):
                found.setdefault(id(table), table)
    return list(found.values())


def _slot_bytes_per_row(optimizer, table) -> int:
    """Bytes of the optimizer's per-row slots of one row of `table` (0 where the optimizer keeps none)."""
    total = 0
    for name in optimizer.slot_names() if hasattr(optimizer, "slot_names") else ():
        try:
            slot = optimizer.table_slot(table, name)
        except ValueError:  # a table the optimizer does not train, or not built yet
            continue
        # A slot is row-shaped: the table's width (a dynamic table's slot is a column of its row pools).
        shape = getattr(slot, "shape", None)
        width = tf.TensorShape(shape)[1:].num_elements() if shape is not None else None
        total += int(width or table.shape[-1]) * tf.as_dtype(getattr(slot, "dtype", table.dtype)).size
    return total


def _balance(per_shard) -> float:
    """The largest of `per_shard` over their mean (1.0: even, or all zero)."""
    mean = float(np.mean(per_shard))
    return float(np.max(per_shard)) / mean if mean else 1.0


def table_report(table, optimizer=None) -> Dict[str, object]:
    """`{"rows", "bytes", "shard_load", "shard_rows", "events"}` of `table` now, read from where its shards live
    (`events`: the kind's per-shard counters of its training lookups, `Kind.shard_events`, or None)."""
    shard_rows = table.kind.shard_rows(table)
    rows = int(sum(shard_rows))
    row_bytes = int(table.shape[-1]) * tf.as_dtype(table.dtype).size
    slot_bytes = _slot_bytes_per_row(optimizer, table) if optimizer is not None else 0
    return {
        "rows": rows,
        "bytes": rows * (row_bytes + slot_bytes),
        "shard_load": _balance(shard_rows),
        "shard_rows": shard_rows,
        "events": table.kind.shard_events(table),
        "lookups": table.kind.shard_lookups(table),
        "exchanged": tally.exchanged_bytes(table),
        # Counted where the table lives, for every worker (table servers), not by each worker for its own.
        "all_workers": bool(getattr(placement_of(table), "trained_remotely", False)),
    }


def _over_workers(strategy, counts):
    """`counts` summed over the workers of a MultiWorkerMirroredStrategy (each counted its own replicas'
    lookups; every worker reads its tables in the same order), else as they are."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or len(cluster_workers(strategy)[1]) < 2:
        return counts
    return np.asarray(sum_over_workers(strategy, tf.constant(counts, tf.int64)))


def _sum_own_counts(strategy, reports) -> None:
    """Replaces, in `reports`, the counters each worker counted for its own replicas (fixed tables' lookups, the
    exchange's bytes) by their sums over the workers, all in one all-reduce (`_over_workers`); a table server's
    counts are every worker's already."""
    own = [(name, key) for name, report in reports.items() for key in ("lookups", "exchanged")
           if report[key] is not None and not (key == "lookups" and report["all_workers"])]  # fmt: skip
    parts = [np.atleast_1d(np.asarray(reports[name][key], np.int64)) for name, key in own]
    if not parts:
        return
    summed = np.asarray(_over_workers(strategy, np.concatenate(parts)))
    for (name, key), part in zip(own, np.split(summed, np.cumsum([len(p) for p in parts])[:-1])):
        reports[name][key] = part


def since(now, before):
    """Per-shard counters `now` less those of the last report (`before`, None at the first): a counter below
    its last value started again (its shard's task restarted) and counts from zero."""
    if before is None or np.shape(before) != np.shape(now):
        return now
    return np.where(now >= before, now - before, now)


def event_metrics(per_shard) -> Dict[str, float]:
    """The logged figures of a dynamic table's counters since the last report (`[shards, EVENTS]`)."""
    lookups, hits, admitted, rejected, evicted = (per_shard[:, i] for i in range(len(EVENTS)))
    out = {"admitted": float(admitted.sum()), "rejected": float(rejected.sum()), "evicted": float(evicted.sum())}
    if lookups.sum() > 0:
        out["hit_rate"] = float(hits.sum()) / float(lookups.sum())
    return out


def shard_lookups(report) -> Optional[np.ndarray]:
    """Per shard, what its training lookups since the last report asked of it (a dynamic table's ids, a fixed
    table's distinct ids per step), or None where nothing was counted."""
    if report.get("since") is not None:
        looked = report["since"][:, EVENTS.index("lookups")]
    elif report.get("lookups_since") is not None:
        looked = report["lookups_since"]
    else:
        return None
    return looked if looked.sum() > 0 else None


def _writable(log_dir) -> str:
    """`log_dir` as a path, refused in one line where it cannot be written: a file, or under one, or a directory
    this process may not write to. Nothing is written here (the writer makes the directory when training
    begins), so a run refused before training leaves it as it was. Remote paths (`gs://`, ...) are not checked."""
    if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
        raise ValueError(f"Argument `log_dir` must be a directory path. Received: log_dir={log_dir!r}")
    path = os.fspath(log_dir)
    if "://" in path:
        return path
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "a file" if not os.path.isdir(existing) else "not writable"
        raise ValueError(
            f"Argument `log_dir` must be a directory that can be written. Received: {path!r} ({existing} is {what})"
        )
    return path


class TableMetrics(keras.callbacks.Callback):
    """Reports each tf_sharded table's rows, bytes and shard balance every `every` steps (see the module doc).

    Works with `tfs.fit` and Keras's `model.fit` under every strategy that
    trains tf_sharded tables.

    Args:
      every: report every this many training steps (a positive integer).
      log_dir: None, or a directory to write the reports to as TensorBoard
        summaries (made if missing; it must be writable).
      write_logs: with `log_dir`, also write the numbers of the Keras logs
        (the loss and metrics at each report, the epoch's at its end).

    Example:

    >>> import keras, tensorflow as tf, tf_sharded as tfs
    >>> ids = keras.Input((2,), dtype="int64")
    >>> emb = tfs.layers.Embedding(100, 4, combiner="mean", partitions=2, name="emb")
    >>> model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    >>> model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
    >>> data = tf.data.Dataset.from_tensors(([[1, 2]], [[1.0]])).repeat(4)
    >>> history = tfs.fit(model, data, steps_per_epoch=4, verbose=0, callbacks=[tfs.callbacks.TableMetrics(2)])
    >>> history.history["tables/emb/rows"], history.history["tables/emb/bytes"]  # rows and Adagrad's slot
    ([100.0], [3200.0])
    """

    def __init__(self, every: int = 100, log_dir: Optional[str] = None, write_logs: bool = False):
        super().__init__()
        self.every = positive_int("every", every)
        self.log_dir = None if log_dir is None else _writable(log_dir)
        self.write_logs = bool(write_logs)
        self._writer = None
        self._step = self._reported = self._read_step = 0
        self._latest: Dict[str, float] = {}
        self._events: Dict[str, np.ndarray] = {}  # each table's counters at the last report

    # ---------------------------------------------------------------- reading --

    def read(self) -> Dict[str, Dict[str, object]]:
        """`{table name: table_report(...)}` for every table of the model, read now; a table with counters gets
        `"since"`, its counters less those of the last `read` (which this one becomes)."""
        optimizer = getattr(self.model, "optimizer", None)
        strategy = self.model.distribute_strategy
        with tally.reading():
            reports = {table.name: table_report(table, optimizer) for table in model_tables(self.model)}
        _sum_own_counts(strategy, reports)
        step, self._read_step = self._read_step, steps_done(self.model)
        steps = self._read_step - step
        for name, report in reports.items():
            if report["exchanged"] is not None:
                moved = since(report["exchanged"], self._events.get((name, "exchanged")))
                self._events[(name, "exchanged")] = report["exchanged"]
                if steps > 0:
                    report["exchange_bytes"] = float(moved[0]) / steps
            if report["events"] is not None:
                report["since"] = since(report["events"], self._events.get(name))
                self._events[name] = report["events"]
            if report["lookups"] is not None:
                report["lookups_since"] = since(report["lookups"], self._events.get(name))
                self._events[name] = report["lookups"]
        return reports

    @staticmethod
    def scalars(reports: Dict[str, Dict[str, object]]) -> Dict[str, float]:
        """The reports as log entries: `tables/<name>/<metric>` -> float."""
        out = {}
        for name, report in reports.items():
            figures = {
                metric: float(report[metric])
                for metric in ("rows", "bytes", "shard_load", "exchange_bytes")
                if metric in report
            }
            if report.get("since") is not None:
                figures.update(event_metrics(report["since"]))
            looked = shard_lookups(report)
            if looked is not None:
                figures["lookup_load"] = _balance(looked)
            out.update((f"{PREFIX}/{name}/{metric}", value) for metric, value in figures.items())
        return out

    @property
    def steps_between_reports(self) -> int:
        """`tfs.fit`'s own loop calls the batch callbacks at least at these steps (elsewhere every
        `log_every` steps): so each report comes at its step."""
        return self.every

    # -------------------------------------------------------------- callbacks --

    def on_train_begin(self, logs=None):
        self._step = steps_done(self.model)
        self._reported = self._step // self.every
        # The first report counts the events since training began (a restored table's counters start at zero).
        self._events, self._latest = {}, {}
        self._read_step = self._step
        self.read()
        if self.log_dir is not None and self.model.distribute_strategy.extended.should_save_summary:
            self._writer = tf.summary.create_file_writer(self.log_dir)
            self._mark_start()

    def _mark_start(self) -> None:
        """Marks where this run's curves start (a `SessionLog.START` event after the step it starts from): at a
        run's second start and later, TensorBoard drops what an earlier run wrote from there on, such as the
        reports of a run killed after its last checkpoint, so the curves go on with no step twice."""
        from tensorboard.compat.proto import event_pb2

        # TensorBoard drops the steps from the marked one on: the first this run can write (the resumed step's
        # report is the earlier run's, kept).
        event = event_pb2.Event(step=self._step + 1, wall_time=time.time())
        event.session_log.status = event_pb2.SessionLog.START
        with self._writer.as_default():
            write_summary_event(event.SerializeToString())
        self._writer.flush()

    def on_train_batch_end(self, batch, logs=None):
        # The model's step count, exact under every loop: an epoch resumed part way, steps run several at a
        # time, or steps rolled back to a checkpoint after a lost parameter server.
        self._step = steps_done(self.model)
        if self._step // self.every > self._reported:
            self._reported = self._step // self.every
            self._report(logs)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        self._step = steps_done(self.model)
        if self._writer is not None and self.write_logs:
            self._write_logs("epoch", logs)
        logs.update(self._latest)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _report(self, logs) -> None:
        reports = self.read()
        self._latest = self.scalars(reports)
        if logs is not None:
            logs.update(self._latest)
        if self._writer is None:
            return
        self._write_summaries(reports)
        if self.write_logs and logs:
            self._write_logs("train", logs)
        self._writer.flush()

    def _write_summaries(self, reports) -> None:
        """The report's scalars and shard histograms as one serialized `Summary`, written by one op: eager
        summary ops took one dispatch each (a histogram several milliseconds), and a traced function is
        instantiated across the cluster under parameter servers. The protos are TensorBoard's own, built by
        its summary functions (`tf.summary` needs the `tensorboard` package too)."""
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.histogram.summary_v2 import histogram_pb
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb

        summary = summary_pb2.Summary()
        for name, value in self._latest.items():
            summary.value.extend(scalar_pb(name, np.float32(value)).value)
        for name, report in reports.items():
            rows = np.asarray(report["shard_rows"], np.float64)
            summary.value.extend(histogram_pb(f"{PREFIX}/{name}/shard_rows", rows).value)
            looked = shard_lookups(report)
            if looked is not None:
                summary.value.extend(histogram_pb(f"{PREFIX}/{name}/shard_lookups", looked.astype(np.float64)).value)
        with self._writer.as_default(step=self._step):
            tf.summary.experimental.write_raw_pb(summary.SerializeToString())

    def _write_logs(self, group: str, logs) -> None:
        """The numbers of Keras `logs` (not the tables' own entries) as `group/<name>` at the current step."""
        with self._writer.as_default(step=self._step):
            for name, value in logs.items():
                number = np.asarray(value)
                if not name.startswith(PREFIX + "/") and number.ndim == 0 and np.issubdtype(number.dtype, np.number):
                    tf.summary.scalar(f"{group}/{name}", float(number))
        self._writer.flush()
