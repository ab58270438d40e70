"""The training application's input: which data trains and which is held out, per worker, from where it
resumes, and the checks that run before training.

Under parameter servers each worker runs the training dataset function in
its own process: it opens its share of the files there (a file each when
there are at least as many files as workers, else every file with the
records dealt out in turn), so nothing built on the chief is captured.
TensorFlow traces that function once and runs the same graph on every
worker, with the same `InputContext` (one pipeline, id 0): a worker cannot
be told its index. So each worker's pipeline claims its share when it
starts, from a counter on a parameter server (`Shares`).

The input position is part of the training state. A run that resumes from a
checkpoint of `N` steps skips the batches those steps consumed: `N` batches
of the single stream under the synchronous strategies; `N / workers` of each
worker's stream under parameter servers (exact with one worker; with more,
the coordinator spreads steps over workers as they become free, so a worker
may have consumed a few batches more or fewer than its share).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from typing import Callable, Optional, Tuple

import tensorflow as tf

from tf_sharded.app import data, parquet, readers, scan
from tf_sharded.app import schema as schemas
from tf_sharded.app.readers import InputError

SCHEMA_FILE = "tf_sharded_schema.json"


@dataclasses.dataclass
class InputPlan:
    """The data of one run: the schema (with statistics), the train function, the held-out batches."""

    schema: schemas.Schema
    train_fn: Callable[[Optional[tf.distribute.InputContext]], tf.data.Dataset]
    held_out: tf.data.Dataset
    scanned: Optional[scan.ScanResult]
    description: str


class Shares:
    """Which share of the input each pipeline reads.

    One pipeline (every strategy but parameter servers): all of it. Under
    parameter servers with `workers` workers: a pipeline claims a number from
    a counter on a parameter server when its iterator starts, and reads
    share `claim % workers`. The workers start their pipelines together, so
    their claims are consecutive and their shares distinct (an extra claim,
    e.g. `tfs.fit` reading the first batch here, only rotates them).
    """

    def __init__(self, strategy=None, workers: int = 1):
        self.workers = workers
        self.counter = None
        if workers > 1:
            with strategy.scope():
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfs_input_share")

    def dataset(self, build: Callable[[Optional[tuple]], tf.data.Dataset]) -> tf.data.Dataset:
        """`build(share)`, `share` None (everything) or `(workers, index)` with `index` a scalar tensor."""
        if self.counter is None:
            return build(None)
        n = self.workers
        claim = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).map(lambda _: self.counter.assign_add(1) % n)
        return claim.flat_map(lambda index: build((n, index)))


def steps_in_checkpoint(checkpoint_dir: Optional[str]) -> int:
    """Steps done by the run whose checkpoints are in `checkpoint_dir` (0 without one): `tfs.fit` numbers
    each checkpoint by its step."""
    latest = tf.train.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    return int(latest.rsplit("-", 1)[1]) if latest else 0


def requested_schema(args) -> Tuple[schemas.Schema, str]:
    """The schema the flags ask for (`--schema`, else Criteo's layout for `--max_vocab`, with `--vocabulary`)
    and the flags that ask for it, for messages."""
    if args.schema and args.data != "synthetic":
        schema, given = schemas.load(args.schema), f"--schema {args.schema}"
    else:
        where = "--data synthetic" if args.data == "synthetic" else "without --schema"
        schema, given = schemas.criteo(data.vocab_sizes(args.max_vocab)), f"Criteo's layout ({where}, --max_vocab)"
    if getattr(args, "vocabulary", "hashed") == "dynamic":
        schema, given = schema.with_vocabulary("dynamic"), f"{given} with --vocabulary dynamic"
    bounds = {k: getattr(args, k, None) for k in schemas.POLICY_KEYS}
    named = [f"--{k}" for k, v in bounds.items() if v is not None]
    if named and not any(f.vocabulary == "dynamic" for f in schema.embedded):
        raise schemas.SchemaError(
            f"{', '.join(named)} bound(s) dynamic tables, and {given} has none: add --vocabulary dynamic, or "
            '"vocabulary": "dynamic" to a column of the schema'
        )
    if named:
        schema, given = schema.with_policies(**bounds), f"{given} with {', '.join(named)}"
    schema.table_policies()  # features sharing a table agree on its bounds
    return schema, given


def check_resumes(schema: schemas.Schema, given: str, checkpoint_dir: Optional[str]) -> None:
    """Refuses, before any data is read, to train on from checkpoints written with another schema (kept beside
    them, `SCHEMA_FILE`): its model would be another model."""
    saved = saved_schema(checkpoint_dir) if steps_in_checkpoint(checkpoint_dir) else None
    found = schemas.differences(saved, schema) if saved is not None else []
    if found:
        raise schemas.SchemaError(
            f"{given}: the checkpoints in --checkpoint_dir {checkpoint_dir} were written with another schema "
            f"({os.path.join(checkpoint_dir, SCHEMA_FILE)}): {'; '.join(found)}. Train with that schema, or "
            "write to another --checkpoint_dir."
        )


def plan(args, workers: int, strategy=None) -> InputPlan:
    """The data for the flags in `args`; `workers` input pipelines read it (1 but under parameter servers,
    whose `strategy` holds the counter of `Shares`)."""
    schema, given = requested_schema(args)
    check_resumes(schema, given, args.checkpoint_dir)
    done = steps_in_checkpoint(args.checkpoint_dir)
    skip = done // workers if workers > 1 else done
    shares = Shares(strategy, workers)
    dynamic = getattr(args, "vocabulary", "hashed") == "dynamic"
    if args.data == "synthetic":
        criteo = schema

        def as_keys(dataset):
            # Dynamic tables take the ids' decimal text as keys, as they would from a file.
            convert = lambda x, y: ({k: v if k == "dense" else tf.strings.as_string(v) for k, v in x.items()}, y)  # noqa: E731
            return dataset.map(convert) if dynamic else dataset

        def stretch(share, position: Optional[int] = None):
            # Each worker reads its own stretch of the (deterministic) stream, from where it stopped.
            start = (0 if share is None else share[1] * 10_000_000) + (skip if position is None else position)
            return as_keys(data.synthetic_dataset(args.batch_size, args.max_vocab, args.seed, start=start))

        def synthetic(context: Optional[tf.distribute.InputContext] = None, skip: Optional[int] = None):
            # `skip`: as for files, below.
            return shares.dataset(lambda share: stretch(share, skip))

        held_out = data.synthetic_dataset(args.batch_size, args.max_vocab, args.seed + 1, num_batches=args.eval_steps)
        return InputPlan(criteo, synthetic, as_keys(held_out), None, "synthetic")
    return _files_plan(args, schema, shares, skip)


def saved_schema(checkpoint_dir: Optional[str]) -> Optional[schemas.Schema]:
    """The schema kept beside the checkpoints in `checkpoint_dir` (`save_schema`), or None."""
    path = os.path.join(checkpoint_dir, SCHEMA_FILE) if checkpoint_dir else None
    return schemas.load(path) if path and os.path.exists(path) else None


def _files_plan(args, schema: schemas.Schema, shares: Shares, skip: int) -> InputPlan:
    saved = saved_schema(args.checkpoint_dir)
    if saved is not None and saved.columns == schema.columns:
        # A resumed run standardizes with the statistics it started with.
        schema = schema.with_statistics({f.name: (f.mean, f.std) for f in saved.numeric if f.mean is not None})
    try:
        source = readers.open_source(
            args.data, schema, None if args.format == "auto" else args.format, cache_dir=args.cache_dir
        )
    except readers.MissingColumns as e:
        if args.schema:
            raise readers.MissingColumns(f"{e}: --schema {args.schema} names them") from None
        raise readers.MissingColumns(f"{e} (without --schema the columns are Criteo's; see `schema infer`)") from None
    if source.cache:
        where = os.path.dirname(source.cache[0])
        print(f"Parquet: reading a copy in {where} (--cache_dir), as {parquet.why_cached()}", flush=True)
    files = list(source.files)
    held_records = 0
    if len(files) > 1:
        train_files, held_files = files[:-1], files[-1:]
    else:
        train_files, held_files = files, files
        held_records = args.eval_steps * args.batch_size
    # One pass before training: malformed records counted (and fatal under --strict), too little data
    # found, statistics computed; the workers then drop the same records with the same parsing.
    scanned = scan.scan(source, schema, train_files, held_out=held_records)
    if len(files) > 1:
        held = scan.scan(source, schema, held_files)
        scanned.malformed += held.malformed
        scanned.first_error = scanned.first_error or held.first_error
        held_available, train_records = held.records, scanned.records
    else:
        held_available, train_records = min(held_records, scanned.records), scanned.records - held_records
    if scanned.first_error and args.strict:
        raise InputError(f"malformed input (--strict): {scanned.first_error}")
    if held_available == 0 or train_records < args.batch_size:
        where = f"{held_files[0]} (held out) and {len(train_files)} training file(s)" if len(files) > 1 else files[0]
        raise InputError(
            f"--data {args.data}: too little data in {where}: {held_available} held-out and "
            f"{max(train_records, 0)} training records; training needs at least one batch of --batch_size "
            f"{args.batch_size}" + ("" if len(files) > 1 else f" after the {held_records} held out (--eval_steps)")
        )
    if schema.needs_statistics():
        schema = schema.with_statistics(scanned.statistics)

    def share_of(read, share):
        # `read(files, share)`: raw or parsed records.
        if held_records:
            # One file: the held-out records come first; the rest is dealt out.
            rest = read(train_files, None).skip(held_records)
            return rest if share is None else rest.shard(*share)
        return read(train_files, share)

    raw = lambda files, share: readers.raw_records(source, files, share)  # noqa: E731
    parsed = lambda files, share: readers.records(source, schema, files, share)  # noqa: E731
    resumed_at = skip
    # Without malformed records a raw record is a parsed one, so a resumed pipeline skips raw records
    # (parsing them is most of the cost of skipping); otherwise it skips parsed records.
    raw_is_parsed = scanned.malformed == 0

    def train_fn(context: Optional[tf.distribute.InputContext] = None, skip: Optional[int] = None):
        # `skip`: batches to pass over, where `tfs.fit` resumes this pipeline (after a parameter-server
        # recovery), else where the checkpoint this run started from left it.
        passed = (resumed_at if skip is None else skip) * args.batch_size

        def share_of_records(share):
            if raw_is_parsed:
                return readers.parsed(share_of(raw, share).repeat().skip(passed), source, schema)
            return share_of(parsed, share).repeat().skip(passed)

        records = shares.dataset(share_of_records)
        return readers.batched(records, args.batch_size, drop_remainder=True)

    held_out = readers.batched(readers.records(source, schema, held_files), args.batch_size)
    held_out = held_out.take(args.eval_steps)
    description = f"{args.data} ({source.format}{', gzip' if source.gzip else ''}, {len(files)} file(s))"
    return InputPlan(schema, train_fn, held_out, scanned, description)


def save_schema(schema: schemas.Schema, checkpoint_dir: Optional[str]) -> None:
    """Keeps the schema (with its statistics) beside the checkpoints, for resuming and for serving; a resumed
    run's schema is the one kept (`check_resumes`), which stays as it is."""
    if not checkpoint_dir:
        return
    saved = saved_schema(checkpoint_dir)
    if saved is not None and saved.to_json() == schema.to_json():
        return
    os.makedirs(checkpoint_dir, exist_ok=True)
    schemas.save(schema, os.path.join(checkpoint_dir, SCHEMA_FILE))


def check_writable(directory: Optional[str], flag: str = "--checkpoint_dir") -> None:
    """Fails before training when `directory` (given as `flag`) cannot be written."""
    if not directory:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        # Named for this process: every worker of a job checks the same directory at once.
        probe = os.path.join(directory, f".tf_sharded_write_test_{os.getpid()}_{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            json.dump({}, f)
        os.remove(probe)
    except OSError as e:
        raise InputError(f"{flag} {directory}: cannot write there ({e.strerror})") from None


def log_dir(args) -> Optional[str]:
    """Where `train` writes its TensorBoard summaries: `--logdir`, else `<--checkpoint_dir>/logs`, else none."""
    if args.logdir:
        return args.logdir
    return os.path.join(args.checkpoint_dir, "logs") if args.checkpoint_dir else None
