"""The table protocol: what lookups, optimizers, the exchange, checkpoints and export need from a table.

A table is one logical `[rows, ...]` array stored as shard variables. Code
outside `tf_sharded.table` never asks which class a table is: it calls
`is_table(obj)` and `owner_of(variable)`, and uses the members of `Table`.
`ShardedVariable` implements it; a table type registers itself with
`@implements_table`, which also checks that it has every member.

Shards are found from variables through a registry kept here (a weak map
from each shard variable to its table and index): optimizers and the
exchange receive `(gradient, variable)` pairs from Keras or the user and must
find the table a variable belongs to, whatever wrapped it (a Keras variable,
one replica's component of a mirrored variable).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple

import tensorflow as tf

from tf_sharded import _compat

MAX_IDS_RANK = 3


class Table(Protocol):
    """The operations every table type provides.

    Metadata: `name`, `shape` (full logical shape), `dtype`, `variables` (the
    shards, in shard order), `num_shards`, `devices`, `trainable`, `strategy`
    (whose hook made it), `layout` (a `tfs.Layout`: how logical rows map to
    shards and local rows), `partition` (the `tfs.PartitionSpec` it was
    created with, which the checkpoint layout manifest records), and, under
    mirrored strategies, `exchange` (a `tfs.exchange.ExchangePolicy`) and
    `placement` ("device" / "host" / "sharded"; both None elsewhere).

    Example:

    >>> import tf_sharded as tfs
    >>> from tf_sharded.table import is_table, owner_of
    >>> table = tfs.create_sharded_variable("protocol_doc", [6, 2], partitions=2)
    >>> is_table(table), owner_of(table.variables[1]) == (table, 1)
    (True, True)
    """

    name: str
    shape: tf.TensorShape
    dtype: tf.DType
    variables: Tuple[Any, ...]
    num_shards: int
    devices: Tuple[str, ...]
    trainable: bool
    strategy: Any
    layout: Any
    partition: Any
    exchange: Any
    placement: Optional[str]

    def check_ids(self, ids, arg: str = "ids", max_rank: Optional[int] = MAX_IDS_RANK) -> Tuple[tf.Tensor, tf.Tensor]:
        """Validated ids as `(int64 ids, flat int64 ids)`; errors name `arg` (lookups)."""

    def shard_rows(self, shard: int) -> int:
        """Rows held by shard `shard` (the exchange's dense size, the optimizer's slot rows)."""

    def make_slot(self, name: str, fill: float) -> Table:
        """A non-trainable table of `fill` with this layout, shard `i` beside shard `i` (optimizer slots)."""

    def read_value(self) -> tf.Tensor:
        """The whole table in logical row order (export, `numpy()`): an explicit full read."""

    def assign(self, value, use_locking: bool = False, name: Optional[str] = None, read_value: bool = False):
        """Writes a full-shape value (weight files, model conversion)."""

    def numpy(self):
        """The whole table as a NumPy array (eager only)."""

    def _gather_saveables_for_checkpoint(self) -> Dict[str, Callable]:
        """TensorFlow's checkpoint hook: one full-shape entry, whatever the layout."""


_TABLE_TYPES: list = []
_MEMBERS = [m for m in Table.__annotations__] + [
    m for m in vars(Table) if not m.startswith("__") and callable(vars(Table)[m])
]


def implements_table(cls: type) -> type:
    """Registers `cls` as a table type, after checking that it has every member of `Table`."""
    missing = [m for m in _MEMBERS if not hasattr(cls, m)]
    if missing:
        raise TypeError(f"{cls.__name__} does not implement the table protocol: missing {missing}")
    _TABLE_TYPES.append(cls)
    return cls


def is_table(obj: Any) -> bool:
    """Whether `obj` is a table (an instance of a registered table type)."""
    return isinstance(obj, tuple(_TABLE_TYPES))


# id(shard variable) -> (weakref to it, weakref to its table, shard index).
_SHARDS: Dict[int, Tuple[weakref.ref, weakref.ref, int]] = {}
_LOCK = threading.Lock()


# Integrations that change how another library behaves for every caller (Keras's optimizer routing) wait
# for the process's first table: a process that never creates one runs that library untouched.
_ON_FIRST_TABLE: list = []
_HAS_TABLE = []


def on_first_table(install: Callable[[], None]) -> None:
    """Runs `install()` once this process has a table: now if it has one, else when the first registers."""
    with _LOCK:
        if not _HAS_TABLE:
            _ON_FIRST_TABLE.append(install)
            return
    install()


def register_shards(table: Any, variables: Sequence[Any]) -> None:
    """Records that `variables[i]` is shard `i` of `table` (read back by `owner_of`)."""
    with _LOCK:
        for index, variable in enumerate(variables):
            key = id(variable)
            _SHARDS[key] = (weakref.ref(variable), weakref.ref(table), index)
            weakref.finalize(variable, _forget, key, _SHARDS[key][0])
        first = []
        if not _HAS_TABLE:
            _HAS_TABLE.append(True)
            first, _ON_FIRST_TABLE[:] = list(_ON_FIRST_TABLE), []
    for install in first:
        install()


def _forget(key: int, ref: weakref.ref) -> None:
    with _LOCK:
        if key in _SHARDS and _SHARDS[key][0] is ref:
            del _SHARDS[key]


def _lookup(variable: Any) -> Optional[Tuple[Any, int]]:
    entry = _SHARDS.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return None
    table = entry[1]()
    return None if table is None else (table, entry[2])


def owner_of(variable: Any) -> Optional[Tuple[Any, int]]:
    """`(table, shard index)` if `variable` is a shard of a table, else None.

    Accepts the shard itself, a Keras variable wrapping it, or one replica's
    component of a mirrored shard. Never reads the variable.
    """
    if variable is None:
        return None
    for candidate in (variable, _compat.keras_variable_value(variable)):
        if candidate is None:
            continue
        found = _lookup(candidate)
        if found is None:
            container = _compat.distributed_container(candidate)
            found = _lookup(container) if container is not None else None
        if found is not None:
            return found
    return None


def update_exclusively(table: Any, shard: int, fn: Callable[[], Any]) -> Any:
    """Runs `fn`, an optimizer's writes to shard `shard` of `table` and its slots, as the table requires.

    A dynamic table runs them under the shard's lock (its pools may be growing
    concurrently); a `ShardedVariable`'s shards never move, so `fn` just runs.
    """
    run = getattr(table, "update_exclusively", None)
    return fn() if run is None else run(shard, fn)
