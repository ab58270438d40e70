"""Reading a user's files with a schema: format detection, pure-TensorFlow readers, sharding, a scan pass.

Formats: Criteo-style TSV (no header; columns in schema order, or a header
line naming them), CSV with a header, TFRecord of `tf.train.Example`, and
Parquet. Text formats and TFRecord may be gzip-compressed.
The format is found from the file's content (Parquet's magic bytes, gzip's,
a text first line, else TFRecord), so `x.parquet.snappy` or `day_0` need no
particular suffix; `format=` overrides it. Parquet is read by tensorflow-io
where its ops load into this TensorFlow, else from a cache that pyarrow
writes once (`tf_sharded.app.parquet`).

Every reader is made of TensorFlow ops only, so a parameter-server worker
builds and runs it in its own process inside its dataset function. A record
that cannot be parsed (wrong field count, a label that is not 0/1, a number
that is not a number) is dropped by the reader; `scan` is the pass over the
same files with the same parsing that counts them, finds the first one (for
`--strict`, before training starts) and computes the statistics of
standardized columns. Ids are hashed from the value's text (`schema.py`).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_sharded.app import parquet
from tf_sharded.app.schema import Feature, FeatureType, LabelType, Schema, SchemaError, Transform

FORMATS = ("tsv", "csv", "tfrecord", "parquet")


def load_ops() -> None:
    """Registers the custom ops the readers use (Parquet: tensorflow-io's) in this process, where they load.
    A parameter-server worker runs the dataset function in its own process and looks the ops up there, so a
    worker task calls this before it serves."""
    parquet.tensorflow_io_loads()


LOAD_OPS = "tf_sharded.app.readers:load_ops"


class InputError(ValueError):
    """A problem with the input files (named in the message): missing columns, malformed records, no data."""


class MissingColumns(InputError):
    """The files lack columns the schema reads."""


# ------------------------------------------------------------------------------------------- files --


def list_files(path: str) -> List[str]:
    """`path` itself, or the regular files in directory `path` (sorted; hidden files and `_SUCCESS` skipped)."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if not f.startswith((".", "_")) and os.path.isfile(os.path.join(path, f))
        )
        if not files:
            raise FileNotFoundError(f"No data files in directory {path!r}")
        return files
    matches = sorted(glob.glob(path)) if any(c in path for c in "*?[") else []
    if matches:
        return matches
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such file or directory: {path!r}")
    return [path]


def _head(name: str, size: int = 4096) -> Tuple[bytes, bool]:
    """The first bytes of `name` (decompressed if gzip) and whether it is gzip."""
    with open(name, "rb") as f:
        raw = f.read(size)
    if raw[:2] == b"\x1f\x8b":
        with gzip.open(name, "rb") as f:
            return f.read(size), True
    return raw, False


def detect_format(name: str) -> Tuple[str, bool]:
    """`(format, gzip)` of file `name`, from its content."""
    head, gz = _head(name)
    if head[:4] == b"PAR1":
        if gz:
            raise InputError(f"{name}: a gzip-compressed Parquet file; Parquet compresses inside the file")
        return "parquet", False
    if not head:
        raise InputError(f"{name}: the file is empty")
    line = head.split(b"\n", 1)[0]
    try:
        text = line.decode("utf-8")
        printable = all(c.isprintable() or c in "\t\r" for c in text)
    except UnicodeDecodeError:
        printable = False
    if printable and ("\t" in text or "," in text):
        return ("tsv" if text.count("\t") >= text.count(",") else "csv"), gz
    if len(head) >= 12:
        return "tfrecord", gz
    raise InputError(f"{name}: not a TSV, CSV, TFRecord or Parquet file (first bytes {head[:16]!r})")


@dataclasses.dataclass(frozen=True)
class Source:
    """The files to read and how: one format for all of them."""

    files: Tuple[str, ...]
    format: str
    gzip: bool
    header: Tuple[str, ...]  # text formats: the file's column names, in file order
    has_header_line: bool
    kinds: Dict[str, str]  # tfrecord / parquet: column -> TensorFlow dtype name
    # Parquet read from the cache (`tf_sharded.app.parquet`): its directories, one per file of `files`.
    cache: Tuple[str, ...] = ()


def open_source(
    path: str, schema: Schema, fmt: Optional[str] = None, flag: str = "--data", cache_dir: Optional[str] = None
) -> Source:
    """Lists and checks the files at `path`: one format, and every column of `schema` present.

    Parquet that tensorflow-io cannot read here (its ops do not load, or a column read has nulls) is
    converted once into `cache_dir` (default `tf_sharded.app.parquet.default_cache_dir()`); the returned
    source's `cache` names the result.
    """
    files = list_files(path)
    found = {}
    for name in files:
        detected, gz = detect_format(name)
        if fmt is not None and fmt != detected and not (fmt in ("tsv", "csv") and detected in ("tsv", "csv")):
            raise InputError(f"{flag}: {name} looks like {detected}, not --format={fmt}")
        found[name] = (fmt or detected, gz)
    kinds_found = {v for v in found.values()}
    if len(kinds_found) > 1:
        raise InputError(f"{flag}: files of different formats in {path}: {sorted(set(found.values()))}")
    fmt, gz = kinds_found.pop()
    first = files[0]
    if fmt in ("tsv", "csv"):
        header, has_header = _text_header(first, gz, fmt, schema, flag)
        kinds = {}
    else:
        kinds = _tfrecord_kinds(first, gz) if fmt == "tfrecord" else _parquet_kinds(first)
        header, has_header = tuple(kinds), False
    missing = [c for c in schema.columns if c not in header]
    lists = [c for c in missing if f"{c}.list.element" in header or f"{c}.list.item" in header]
    if lists:
        raise InputError(
            f"{flag} {first}: Parquet list column(s) {lists}, which the Parquet readers cannot read; write a "
            "multi-hot column as '|'-separated text in Parquet, or use TFRecord (lists) or CSV"
        )
    if missing:
        raise MissingColumns(f"{flag} {first} lacks columns {missing}; it has {list(header)}")
    unsupported = {c: kinds[c].split(":", 1)[1] for c in schema.columns if kinds.get(c, "").startswith("unsupported:")}
    if unsupported:
        raise InputError(f"{flag} {first}: Parquet column(s) of types the readers do not read: {unsupported}")
    source = Source(tuple(files), fmt, gz, tuple(header), has_header, kinds)
    return _parquet_cache(source, schema, cache_dir) if fmt == "parquet" else source


def _parquet_cache(source: Source, schema: Schema, cache_dir: Optional[str]) -> Source:
    """`source` as tensorflow-io reads it, or with the schema's columns in the cache where it cannot."""
    nulls = parquet.null_counts(source.files, schema.columns)
    if parquet.tensorflow_io_loads() and not any(nulls.values()):
        return source
    kinds = parquet.with_nulls({c: source.kinds[c] for c in schema.columns}, nulls)
    parts = parquet.cached(source.files, kinds, cache_dir)
    return dataclasses.replace(source, kinds=kinds, cache=tuple(parts))


def _text_header(name: str, gz: bool, fmt: str, schema: Schema, flag: str) -> Tuple[Tuple[str, ...], bool]:
    head, _ = _head(name)
    first = head.split(b"\n", 1)[0].decode("utf-8", errors="replace").rstrip("\r")
    fields = [f.strip().strip('"') for f in first.split("\t" if fmt == "tsv" else ",")]
    if set(schema.columns) <= set(fields):
        return tuple(fields), True
    if fmt == "csv":
        missing = [c for c in schema.columns if c not in fields]
        raise MissingColumns(f"{flag} {name} lacks columns {missing}; it has {fields}")
    # TSV without a header line (Criteo's layout): the columns are the schema's, label first.
    if len(fields) != len(schema.columns):
        raise InputError(
            f"{name}: a TSV without a header line must have the schema's {len(schema.columns)} columns "
            f"(label, then the features in order); its first line has {len(fields)}"
        )
    return tuple(schema.columns), False


def _tfrecord_kinds(name: str, gz: bool) -> Dict[str, str]:
    records = tf.data.TFRecordDataset(name, compression_type="GZIP" if gz else "")
    try:
        first = next(iter(records.take(1)), None)
    except tf.errors.OpError as e:
        raise InputError(f"{name}: not a readable TFRecord file ({e.message.splitlines()[0]})") from None
    if first is None:
        raise InputError(f"{name}: the file has no records")
    example = tf.train.Example.FromString(first.numpy())
    kinds = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        kinds[key] = {"int64_list": "int64", "float_list": "float32"}.get(kind, "string")
    return kinds


def _parquet_kinds(name: str) -> Dict[str, str]:
    import pyarrow as pa

    try:
        return parquet.column_kinds(name)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{name}: not a readable Parquet file ({str(e).splitlines()[0]})") from None


# ------------------------------------------------------------------------------------------ parsing --


def _text_of(value: tf.Tensor) -> tf.Tensor:
    """A value as the text its id is hashed from: strings as they are, integers in decimal."""
    if value.dtype == tf.string:
        return tf.strings.strip(value)
    if value.dtype.is_floating:
        # 3.0 from a float column hashes like "3" from a text one; NaN (a null) is missing.
        whole = tf.equal(value, tf.round(value))
        text = tf.where(whole, tf.strings.as_string(tf.cast(value, tf.int64)), tf.strings.as_string(value))
        return tf.where(tf.math.is_nan(value), "", text)
    return tf.strings.as_string(value)


def _ids(text: tf.Tensor, buckets: int) -> tf.Tensor:
    """Row ids of text values: 0 for empty (missing), else 1 + hash mod (buckets - 1)."""
    hashed = tf.strings.to_hash_bucket_fast(text, buckets - 1) + 1
    return tf.where(tf.equal(tf.strings.length(text), 0), tf.zeros_like(hashed), hashed)


def _keys(text: tf.Tensor, feature: Feature) -> tf.Tensor:
    """A categorical or multi-hot column's model input: hashed row ids, or its text as dynamic-table keys."""
    return text if feature.vocabulary == "dynamic" else _ids(text, feature.buckets)


_NUMBER = r"[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][+-]?[0-9]+)?"


def _number(text: tf.Tensor, what: str) -> tf.Tensor:
    """float32 of a text field (empty -> NaN, meaning missing); raises for text that is not a number."""
    text = tf.strings.strip(text)
    empty = tf.equal(tf.strings.length(text), 0)
    number = tf.strings.regex_full_match(text, _NUMBER)
    tf.debugging.assert_equal(number | empty, True, message=f"{what} is not a number")
    value = tf.strings.to_number(tf.where(number, text, "0"), tf.float32)
    return tf.where(empty, float("nan"), value)


def _transform(feature: Feature, x: tf.Tensor, raw: bool = False) -> tf.Tensor:
    """A numeric column's model input: the transform, missing (NaN) -> 0; `raw`: as read, missing NaN."""
    if raw:
        return x
    if feature.transform == Transform.LOG1P:
        x = tf.math.log1p(tf.maximum(x, 0.0))
    elif feature.transform == Transform.STANDARDIZE:
        if feature.mean is None:
            raise SchemaError(f"numeric column '{feature.name}' is standardized but has no statistics yet")
        x = (x - feature.mean) / feature.std
    return tf.where(tf.math.is_nan(x), 0.0, x)


def _label(schema: Schema, y: tf.Tensor) -> tf.Tensor:
    y = tf.cast(y, tf.float32)
    tf.debugging.assert_equal(tf.math.is_finite(y), True, message=f"label '{schema.label.name}' is missing")
    if schema.label.type == LabelType.BINARY:
        tf.debugging.assert_equal(
            tf.logical_or(tf.equal(y, 0.0), tf.equal(y, 1.0)), True, message=f"label '{schema.label.name}' is not 0/1"
        )
    return y


def raw_columns(source: Source, schema: Schema, record) -> Dict[str, tf.Tensor]:
    """One record's columns as read: for text formats strings, otherwise typed values (lists ragged)."""
    if source.format in ("tsv", "csv"):
        delimiter = "\t" if source.format == "tsv" else ","
        fields = tf.io.decode_csv(
            record, record_defaults=[""] * len(source.header), field_delim=delimiter, use_quote_delim=delimiter == ","
        )
        return dict(zip(source.header, fields))
    if source.format == "tfrecord":
        spec = {c: tf.io.VarLenFeature(tf.as_dtype(source.kinds[c])) for c in schema.columns}
        parsed = tf.io.parse_single_example(record, spec)
        return {c: v.values for c, v in parsed.items()}
    return {c: record[c] for c in schema.columns}


def _first(values: tf.Tensor, missing) -> tf.Tensor:
    """A typed column's single value: a scalar (Parquet), or the first of a list of 0 or 1 (TFRecord)."""
    if values.shape.rank == 0:
        return values
    return tf.cond(tf.size(values) > 0, lambda: values[0], lambda: tf.constant(missing, values.dtype))


def _typed_number(values: tf.Tensor, what: str) -> tf.Tensor:
    if values.dtype == tf.string:  # a Parquet integer column with nulls, kept as text in the cache
        return _number(_first(values, ""), what)
    return _first(tf.cast(values, tf.float32), float("nan"))


def _typed_text(values: tf.Tensor) -> tf.Tensor:
    return _first(_text_of(values), "")


def parse_record(
    source: Source, schema: Schema, record, raw_numeric: bool = False
) -> Tuple[Dict[str, tf.Tensor], tf.Tensor]:
    """One record -> (`{"dense": [n numeric], feature: id or ids}`, label [1]). Raises if it is malformed.

    `raw_numeric`: numeric columns as read (missing as NaN), for the statistics pass.
    """
    columns = raw_columns(source, schema, record)
    text = source.format in ("tsv", "csv")
    label = columns[schema.label.name]
    what = f"label '{schema.label.name}'"
    y = _number(label, what) if text else _typed_number(label, what)
    features: Dict[str, tf.Tensor] = {}
    dense = []
    for f in schema.features:
        value = columns[f.name]
        if f.type == FeatureType.NUMERIC:
            what = f"column '{f.name}'"
            x = _number(value, what) if text else _typed_number(value, what)
            dense.append(_transform(f, x, raw_numeric))
        elif f.type == FeatureType.CATEGORICAL:
            features[f.name] = _keys(_text_of(value) if text else _typed_text(value), f)
        else:
            if text or (value.dtype == tf.string and value.shape.rank == 0):
                items = tf.strings.split(tf.strings.strip(value), f.delimiter)
            else:
                items = _text_of(value)
            items = tf.boolean_mask(items, tf.strings.length(tf.strings.strip(items)) > 0)
            features[f.name] = _keys(_text_of(items), f)
    if dense:
        features["dense"] = tf.stack(dense)
    return features, tf.reshape(_label(schema, y), [1])


def raw_records(source: Source, files: Sequence[str], share: Optional[Tuple[int, object]] = None) -> tf.data.Dataset:
    """The raw records of `files` in order: text lines (header lines skipped, blank lines dropped) or
    serialized examples or Parquet rows.

    `share`: `(count, index)`, `index` possibly a tensor: only this input pipeline's share, a file in
    `count` when there are at least `count` files (text and TFRecord), else a record in `count`.
    """
    compression = "GZIP" if source.gzip else ""
    by_file = share is not None and share[0] > 1 and len(files) >= share[0] and source.format != "parquet"
    if source.format == "parquet" and source.cache:
        # The cache directories of `files` (which may be a subset of the source's, e.g. the held-out file).
        rows = parquet.load([source.cache[source.files.index(f)] for f in files], source.kinds)
        return rows.shard(*share) if share is not None and share[0] > 1 else rows
    names = tf.data.Dataset.from_tensor_slices(list(files))
    if by_file:
        names = names.shard(*share)
    if source.format in ("tsv", "csv"):
        skip = 1 if source.has_header_line else 0
        lines = names.interleave(
            lambda f: tf.data.TextLineDataset(f, compression_type=compression).skip(skip), cycle_length=1
        )
        rows = lines.filter(lambda line: tf.strings.length(tf.strings.strip(line)) > 0)
    elif source.format == "tfrecord":
        rows = names.interleave(lambda f: tf.data.TFRecordDataset(f, compression_type=compression), cycle_length=1)
    else:
        import tensorflow_io as tfio

        # Column types given up front: a worker's dataset function is traced, where tensorflow-io cannot look.
        columns = {
            c: tf.TensorSpec([], tf.as_dtype(k)) for c, k in source.kinds.items() if ":" not in k and k != "list"
        }
        parts = [tfio.IODataset.from_parquet(f, columns=columns) for f in files]
        rows = parts[0]
        for part in parts[1:]:
            rows = rows.concatenate(part)
        rows = rows.map(lambda row: {(k.decode() if isinstance(k, bytes) else k): v for k, v in row.items()})
    if share is not None and share[0] > 1 and not by_file:
        rows = rows.shard(*share)
    return rows


def records(
    source: Source, schema: Schema, files: Sequence[str], share: Optional[Tuple[int, object]] = None
) -> tf.data.Dataset:
    """Parsed records of `files` (this pipeline's `share`, see `raw_records`), malformed ones dropped
    (`scan` counts them)."""
    return parsed(raw_records(source, files, share), source, schema)


def parsed(raw: tf.data.Dataset, source: Source, schema: Schema) -> tf.data.Dataset:
    """The records of the raw records `raw` (from `raw_records`), malformed ones dropped."""
    return raw.map(lambda r: parse_record(source, schema, r), num_parallel_calls=tf.data.AUTOTUNE).ignore_errors()


def batched(dataset: tf.data.Dataset, batch_size: int, drop_remainder: bool = False) -> tf.data.Dataset:
    """Batches of records; multi-hot features become `tf.RaggedTensor`s."""
    return dataset.ragged_batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)


def error_text(e: Exception) -> str:
    text = getattr(e, "message", str(e)).strip()
    # TensorFlow wraps the message in its own bookkeeping: function names before, op names and the
    # assertion's operands after.
    text = re.sub(r"^(\{\{[^}]*\}\}\s*)+", "", text)
    for marker in (" Condition x == y did not hold", " [Op:", "\n"):
        text = text.split(marker)[0]
    return text.rstrip(". ")
