"""The pass over the input files before training, and the sample `schema infer` reads.

`scan` reads the training files with the same parsing as the workers' readers
(`readers.parse_record`): it counts the records that parse and those that do
not, names the first malformed one (`FILE:LINE: what`, fatal under
`--strict`), and computes the mean and standard deviation of standardized
columns and the mean of the label over the training records (where the
model's output starts). Workers drop the same records, so the count is the number of
records training skips, whichever worker would have read them.
"""

from __future__ import annotations

import dataclasses
import gzip
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_sharded.app.readers import InputError, Source, detect_format, error_text, list_files, parse_record, raw_records
from tf_sharded.app.schema import Schema, Transform

# Records reduced at a time (the parsing drops malformed ones one by one before).
_BATCH = 4096
_NO_GAP = tf.int64.max


@dataclasses.dataclass
class ScanResult:
    """What one pass over the training files found."""

    records: int = 0
    malformed: int = 0
    first_error: Optional[str] = None
    statistics: Dict[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)
    label_mean: Optional[float] = None  # over the good records after the first `held_out` (None: none)


def scan(
    source: Source, schema: Schema, files: Sequence[str], line_numbers: bool = True, held_out: int = 0
) -> ScanResult:
    """Counts good and malformed records per file, finds the first malformed one, and computes the mean and
    standard deviation of standardized columns over the good ones, and the label's mean over the good ones
    after the first `held_out` (the records a single file holds out for evaluation)."""
    result = ScanResult()
    label_sum, label_count = 0.0, 0
    columns = [i for i, f in enumerate(schema.numeric) if f.transform == Transform.STANDARDIZE]
    standardized = [schema.numeric[i] for i in columns]
    width = len(columns)
    totals = np.zeros([3, max(width, 1)], np.float64)  # count, sum, sum of squares per column
    for name in files:
        lines = raw_records(source, [name]).enumerate()
        good = lines.map(
            lambda k, r: _numbers(k, parse_record(source, schema, r, raw_numeric=True)),
            num_parallel_calls=tf.data.AUTOTUNE,
        ).ignore_errors()
        # Good records of this file before which the label is not counted (the held-out prefix).
        skip_labels = max(held_out - result.records, 0)

        def add(state, batch):
            count, first_gap, s, labels = state
            k, dense, y = batch
            # Each good record's position among the good ones; where its position in the file is further on,
            # records before it were dropped, the first of them at that position.
            at = count + tf.range(tf.size(k, out_type=tf.int64), dtype=tf.int64)
            counted = tf.cast(at >= skip_labels, tf.float64)
            labels = labels + tf.stack([tf.reduce_sum(counted), tf.reduce_sum(counted * tf.cast(y, tf.float64))])
            after_gap = tf.reduce_min(tf.where(k != at, at, _NO_GAP))
            gap = tf.where(tf.logical_and(first_gap < 0, after_gap < _NO_GAP), after_gap, first_gap)
            if width:
                x = tf.cast(tf.gather(dense, columns, axis=1), tf.float64)
                seen = tf.logical_not(tf.math.is_nan(x))
                x0 = tf.where(seen, x, 0.0)
                s = s + tf.stack([tf.reduce_sum(tf.cast(seen, tf.float64), 0), tf.reduce_sum(x0, 0),
                                  tf.reduce_sum(x0 * x0, 0)])  # fmt: skip
            return count + tf.size(k, out_type=tf.int64), gap, s, labels

        initial = (
            tf.constant(0, tf.int64), tf.constant(-1, tf.int64), tf.zeros([3, max(width, 1)], tf.float64),
            tf.zeros([2], tf.float64),
        )  # fmt: skip
        try:
            count, first_gap, sums, labels = good.batch(_BATCH).reduce(initial, add)
            total = lines.batch(_BATCH).reduce(tf.constant(0, tf.int64), lambda n, b: n + tf.size(b[0], tf.int64))
        except tf.errors.OpError as e:
            raise InputError(f"{name}: cannot be read: {error_text(e)}") from None
        count, total = int(count), int(total)
        totals += sums.numpy()
        label_count, label_sum = label_count + int(labels[0]), label_sum + float(labels[1])
        result.records += count
        result.malformed += total - count
        if total > count and result.first_error is None:
            position = int(first_gap) if int(first_gap) >= 0 else count
            result.first_error = _describe_error(source, schema, name, position, line_numbers)
    for j, f in zip(range(width), standardized):
        n, s, ss = totals[:, j]
        if n == 0:
            raise InputError(f"column '{f.name}' has no values to standardize with in {list(files)}")
        mean = s / n
        std = float(np.sqrt(max(ss / n - mean * mean, 0.0)))
        result.statistics[f.name] = (float(mean), std if std > 0 else 1.0)
    result.label_mean = label_sum / label_count if label_count else None
    return result


def _numbers(k, parsed):
    """`(position, raw numeric columns, label)` of one parsed record."""
    features, label = parsed
    return k, features.get("dense", tf.zeros([0])), tf.reshape(label, [])


def _describe_error(source: Source, schema: Schema, name: str, position: int, line_numbers: bool) -> str:
    """`FILE:LINE: what is wrong` for the `position`-th record of `name` (line numbers for text files)."""
    record = next(iter(raw_records(source, [name]).skip(position).take(1)))
    try:
        parse_record(source, schema, record, raw_numeric=True)
        what = "malformed record"
    except (tf.errors.OpError, ValueError) as e:
        what = error_text(e)
    if source.format in ("tsv", "csv") and line_numbers:
        return f"{name}:{_line_number(source, name, position)}: {what}"
    return f"{name}: record {position + 1}: {what}"


def _line_number(source: Source, name: str, position: int) -> int:
    """The 1-based line of the `position`-th non-blank record line of text file `name`."""
    opener = gzip.open if source.gzip else open
    seen = -1
    with opener(name, "rt", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if number == 1 and source.has_header_line:
                continue
            if line.strip():
                seen += 1
                if seen == position:
                    return number
    return number


def sample_columns(path: str, rows: int = 2000, fmt: Optional[str] = None) -> Tuple[Dict[str, list], List[str]]:
    """Up to `rows` values per column of the first file at `path` (text values for TSV/CSV, typed ones
    otherwise), and the columns that hold lists: what `schema infer` looks at."""
    import csv
    import itertools

    name = list_files(path)[0]
    detected, gz = detect_format(name)
    fmt = fmt or detected
    if fmt in ("tsv", "csv"):
        opener = gzip.open if gz else open
        with opener(name, "rt", encoding="utf-8", errors="replace", newline="") as f:
            reader = csv.reader(f, delimiter="\t" if fmt == "tsv" else ",")
            header = next(reader, None)
            if header is None:
                raise InputError(f"{name}: the file is empty")
            if fmt == "tsv" and not any(c and not c.replace(".", "").replace("-", "").isdigit() for c in header):
                raise InputError(f"{name}: a TSV without a header line; write the schema by hand (columns in order)")
            lines = [line for line in itertools.islice(reader, rows) if line]
        return {c: [line[i] if i < len(line) else "" for line in lines] for i, c in enumerate(header)}, []
    if fmt == "tfrecord":
        columns: Dict[str, list] = {}
        lists = set()
        dataset = tf.data.TFRecordDataset(name, compression_type="GZIP" if gz else "").take(rows)
        for record in dataset:
            example = tf.train.Example.FromString(record.numpy())
            for key, feature in example.features.feature.items():
                values = list(getattr(feature, feature.WhichOneof("kind")).value) if feature.WhichOneof("kind") else []
                values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
                if len(values) > 1:
                    lists.add(key)
                columns.setdefault(key, []).append(values)
        return {k: [v if k in lists else (v[0] if v else "") for v in vs] for k, vs in columns.items()}, sorted(lists)
    import pyarrow.parquet as pq

    table = pq.ParquetFile(name).read_row_group(0).slice(0, rows).to_pydict()
    return {k: ["" if v is None else v for v in vs] for k, vs in table.items()}, []
