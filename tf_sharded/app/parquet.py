"""Parquet files for the readers: through tensorflow-io's ops where they load, else through a cache.

tensorflow-io's compiled ops are built against one TensorFlow release
(0.37.1: TF 2.16) and do not load in another (undefined symbols), while its
import prints warnings. So its library is probed with `tf.load_op_library`,
which only raises, and `tensorflow_io` is imported only where that worked.

Elsewhere pyarrow converts the columns a schema reads, once, into
`tf.data.Dataset.save` directories in a cache (one per Parquet file, in
file order, named by a hash of the files' paths, sizes, modification times
and the columns). Reading them back is `tf.data.Dataset.load`, a core
TensorFlow op, so a parameter-server worker in another process reads them
in its traced dataset function as it would read TFRecord files. The rows
come out with the types and the order tensorflow-io gives.

A null is a missing value: NaN in a float column, "" in a text column, and
an integer or boolean column with nulls is kept as decimal text ("" for a
null), which the readers parse as numbers or hash as ids exactly as the
integers. tensorflow-io 0.37.1 does not read nulls: it drops them and
shifts the column's later values up a row, so the readers take this path
for any file with nulls in a column they read, wherever tensorflow-io loads.

The cache must be on storage that every worker can read (a local cluster
shares this machine's). A directory appears under its final name only once
complete, so a run killed while converting leaves nothing half-written.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

CACHE_ENV = "TF_SHARDED_CACHE"
# Bumped when the layout written below changes, so an older cache is not read as a newer one.
_LAYOUT = 1


@functools.cache
def tensorflow_io_loads() -> bool:
    """Whether tensorflow-io is installed and its compiled ops load into this TensorFlow (probed once, silently)."""
    spec = importlib.util.find_spec("tensorflow_io")
    if spec is None or not spec.submodule_search_locations:
        return False
    library = os.path.join(list(spec.submodule_search_locations)[0], "python", "ops", "libtensorflow_io.so")
    if not os.path.exists(library):
        return False
    try:
        tf.load_op_library(library)
    except (tf.errors.OpError, OSError):
        return False
    return True


def why_cached() -> str:
    """Why the readers take the cache here: for the one line the command prints."""
    if tensorflow_io_loads():
        return "a column it reads has nulls, which tensorflow-io misreads"
    if importlib.util.find_spec("tensorflow_io") is None:
        return "tensorflow-io is not installed (tf_sharded[io], where its ops load: TF 2.16)"
    return f"tensorflow-io's Parquet ops do not load into TensorFlow {tf.__version__}"


def default_cache_dir() -> str:
    """`$TF_SHARDED_CACHE/parquet`, else `$XDG_CACHE_HOME/tf_sharded/parquet` (`~/.cache/...`)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tf_sharded")
    return os.path.join(root, "parquet")


# ------------------------------------------------------------------------------------------- types --

_INTS = {"int8": "int32", "int16": "int32", "int32": "int32", "int64": "int64", "uint8": "int32",
         "uint16": "int32", "uint32": "int64", "uint64": "int64"}  # fmt: skip


def column_kinds(name: str) -> Dict[str, str]:
    """`{column: TensorFlow dtype name}` of Parquet file `name`, read from its footer, named as tensorflow-io
    names them (a list column `c` appears as `c.list.element`, which the readers refuse)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = {}
    for field in pq.read_schema(name):
        kind = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            kinds[f"{field.name}.list.element"] = "list"
        elif pa.types.is_boolean(kind):
            kinds[field.name] = "bool"
        elif pa.types.is_integer(kind):
            kinds[field.name] = _INTS[str(kind)]
        elif pa.types.is_floating(kind):
            kinds[field.name] = "float64" if pa.types.is_float64(kind) else "float32"
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
            kinds[field.name] = "string"
        else:
            kinds[field.name] = f"unsupported:{kind}"
    return kinds


def null_counts(files: Sequence[str], columns: Sequence[str]) -> Dict[str, int]:
    """Nulls per column over `files`, from the row groups' statistics where every group has them, else by
    reading the column."""
    import pyarrow.parquet as pq

    counts = dict.fromkeys(columns, 0)
    for name in files:
        parquet = pq.ParquetFile(name)
        # Statistics are per leaf column: a flat column's leaf has its own name as path (a list's does not).
        leaf = {parquet.schema.column(j).path: j for j in range(parquet.metadata.num_columns)}
        unknown = set()
        for c in columns:
            stats = [parquet.metadata.row_group(g).column(leaf[c]).statistics if c in leaf else None
                     for g in range(parquet.num_row_groups)]  # fmt: skip
            if all(s is not None and s.has_null_count for s in stats):
                counts[c] += sum(s.null_count for s in stats)
            else:
                unknown.add(c)
        if unknown:
            table = parquet.read(columns=sorted(unknown))
            for c in unknown:
                counts[c] += table.column(c).null_count
    return counts


def with_nulls(kinds: Dict[str, str], nulls: Dict[str, int]) -> Dict[str, str]:
    """The cache's kinds: integer and boolean columns that have nulls become text (see the module's doc)."""
    return {c: "string" if nulls.get(c) and k in ("int32", "int64", "bool") else k for c, k in kinds.items()}


def _numpy_column(column, kind: str):
    """One Parquet column as a NumPy array of `kind`: nulls NaN (floats) or "" (text; integers as text)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if kind == "string":
        if pa.types.is_boolean(column.type):
            column = column.cast(pa.int8())
        if pa.types.is_integer(column.type):
            column = column.cast(pa.string())
        column = pc.fill_null(column.cast(pa.large_binary()), b"")
        return np.array(column.to_pylist(), dtype=object)
    if kind.startswith("float"):
        return pc.fill_null(column.cast(pa.float64()), float("nan")).to_numpy().astype(kind)
    return column.to_numpy().astype(kind)


# ------------------------------------------------------------------------------------------- cache --


def _cache_key(files: Sequence[str], kinds: Dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps([_LAYOUT, sorted(kinds.items())]).encode())
    for name in files:
        stat = os.stat(name)
        digest.update(json.dumps([os.path.abspath(name), stat.st_size, stat.st_mtime_ns]).encode())
    return digest.hexdigest()[:20]


def element_spec(kinds: Dict[str, str]) -> Dict[str, tf.TensorSpec]:
    return {c: tf.TensorSpec([], tf.as_dtype(k)) for c, k in kinds.items()}


def cached(files: Sequence[str], kinds: Dict[str, str], cache_dir: Optional[str] = None) -> List[str]:
    """The cache directories holding the `kinds` columns of Parquet `files` (one per file, in order), written
    now if absent."""
    root = os.path.abspath(cache_dir or default_cache_dir())
    final = os.path.join(root, _cache_key(files, kinds))
    parts = [os.path.join(final, f"part-{i:05d}") for i in range(len(files))]
    if os.path.exists(os.path.join(final, "manifest.json")):
        return parts
    os.makedirs(root, exist_ok=True)
    staging = f"{final}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for name, part in zip(files, parts):
            _convert(name, kinds, os.path.join(staging, os.path.basename(part)))
        with open(os.path.join(staging, "manifest.json"), "w") as f:
            json.dump({"layout": _LAYOUT, "files": [os.path.abspath(n) for n in files], "kinds": kinds}, f)
        try:
            os.rename(staging, final)
        except OSError:
            if not os.path.exists(os.path.join(final, "manifest.json")):  # another process finished it first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return parts


def _convert(name: str, kinds: Dict[str, str], out: str) -> None:
    """Writes the `kinds` columns of Parquet file `name` to `out` (`tf.data.Dataset.save`), one row group at
    a time, in row order (one shard)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(name)
    columns = list(kinds)
    spec = element_spec(kinds)

    def row_groups():
        for i in range(parquet.num_row_groups):
            group = parquet.read_row_group(i, columns=columns)
            yield {c: _numpy_column(group.column(c), kinds[c]) for c in columns}

    batches = tf.data.Dataset.from_generator(
        row_groups, output_signature={c: tf.TensorSpec([None], s.dtype) for c, s in spec.items()}
    )
    batches.unbatch().save(out, shard_func=lambda *_: tf.constant(0, tf.int64))


def load(parts: Sequence[str], kinds: Dict[str, str]) -> tf.data.Dataset:
    """The rows of cache directories `parts` in order (traceable: a worker's dataset function calls it)."""
    spec = element_spec(kinds)
    rows = tf.data.Dataset.load(parts[0], element_spec=spec)
    for part in parts[1:]:
        rows = rows.concatenate(tf.data.Dataset.load(part, element_spec=spec))
    return rows
