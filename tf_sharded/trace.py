"""What the step being traced has looked up: per table, how many lookups and how many ids.

Lookups write here; the exchange and the optimizers read it, so neither
depends on the lookup module, and the backward path reads facts the forward
path recorded instead of calling back into it. Records are kept per graph
being traced and per thread (MirroredStrategy traces each replica of each
`strategy.run` in a thread of its own), both weakly: a finished trace's
record goes with its graph, a replica's with its thread. A thread object,
not its id: the operating system hands a finished thread's id to the next
one, so steps unrolled in one function (one `strategy.run` each) would add
up their ids whenever the ids repeat, which they do in some processes and
not others; workers tracing the same step would then choose different
exchanges, and their collectives would not match. Nothing is recorded
eagerly.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import tensorflow as tf

# graph -> thread -> {id(table): (lookups, static number of ids or None)}
_TRACED = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _record() -> dict:
    """This graph's and this thread's record (call with `_LOCK` held)."""
    threads = _TRACED.setdefault(tf.compat.v1.get_default_graph(), weakref.WeakKeyDictionary())
    return threads.setdefault(threading.current_thread(), {})


def note_lookup(table: Any, num_ids: Optional[int] = None) -> None:
    """Counts one lookup of `table` with `num_ids` ids (None: not known when traced) in the traced step."""
    if tf.executing_eagerly():
        return
    key = id(table)
    with _LOCK:
        record = _record()
        if key not in record:
            record[key] = (1, num_ids)
        else:
            lookups, ids = record[key]
            record[key] = (lookups + 1, None if ids is None or num_ids is None else ids + num_ids)


def _entry(table: Any) -> tuple:
    with _LOCK:
        return _record().get(id(table), (0, None))


def traced_ids(table: Any) -> Optional[int]:
    """Static number of ids the traced step looks up in `table` (a bound on its distinct ids), or None."""
    return _entry(table)[1]


def single_lookup(table: Any) -> bool:
    """Whether the traced step looked `table` up exactly once (False eagerly).

    A lookup de-duplicates its ids, so each shard's gradient then holds every
    row once and the merges before an exchange or an update can be skipped.
    """
    return not tf.executing_eagerly() and _entry(table)[0] == 1
