"""Tallies: int64 counters a training step adds to beside the lookups it runs, read by reports between steps.

A fixed-row table's training lookup counts, per shard, the distinct ids it
reads (the rows that shard serves, and whose gradient the exchange then
moves). The counts of a whole lookup group are added by one op into one
`Tally` variable on the group's first device (a parameter server, the
replica's device, the local device): one slot per `(table, shard)`,
registered when a step is traced. Dynamic tables keep their own counters
beside their row pools (`dynamic.pool.EVENTS`).

The gradient exchange of mirrored and sharded tables counts, per table, the
bytes each replica puts into it (`add_exchanged`, one op per replica and
step on the replica's device): the gradient rows and their ids it sends to
be gathered or summed, or the densified shard it all-reduces.

Counters only grow; a reader takes differences between two reads (a task
that restarted starts its tally from zero again, `reset_lost`). They are
not checkpointed.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_sharded import _compat

_LOCK = threading.Lock()
_TALLIES: Dict[str, Tally] = {}
_NUMBERS = itertools.count()
_NUMBERED: Dict[int, tuple] = {}  # id(table) -> (weak reference to it, its number)


class Tally:
    """Counters on one device, one per registered key, in one variable that grows as keys register."""

    def __init__(self, device: str):
        self.device = device
        self.slots: Dict[tuple, int] = {}
        self._growing = threading.Lock()
        with tf.init_scope(), tf.device(device or None):
            self.variable = _compat.plain_variable(
                tf.zeros([0], tf.int64), "tfs_tally", False, shape=tf.TensorShape(None)
            )

    def slots_of(self, keys: Sequence[tuple]) -> List[int]:
        """The slots of `keys`, registering new ones (the variable grows to one counter per slot, keeping its
        counts; under one lock with the registration, so two threads tracing at once cannot leave it short)."""
        with self._growing:
            new = [k for k in dict.fromkeys(keys) if k not in self.slots]
            if new:
                with tf.init_scope(), tf.device(self.variable.device):
                    grown = tf.concat([self.variable.read_value(), tf.zeros([len(new)], tf.int64)], 0)
                    self.variable.assign(grown, read_value=False)
                with _LOCK:
                    for key in new:
                        self.slots[key] = len(self.slots)
            return [self.slots[k] for k in keys]

    def add(self, keys: Sequence[tuple], counts) -> tf.Tensor:
        """Adds `counts` (int64, one per key) to the counters of `keys`: one op on the tally's device."""
        slots = tf.constant(self.slots_of(keys), tf.int64)
        with tf.device(self.variable.device):  # scatter_add: an eager scatter_nd_add takes the unknown shape for []
            return self.variable.scatter_add(tf.IndexedSlices(tf.cast(counts, tf.int64), slots))

    def read(self) -> np.ndarray:
        return np.asarray(self.variable.read_value())

    def reset_lost(self) -> int:
        """After the tally's task restarted (its variable renewed, uninitialised): zeros. Returns 1 if set."""
        if bool(self.variable.is_initialized()):
            return 0
        with tf.device(self.variable.device):
            self.variable.assign(tf.zeros([len(self.slots)], tf.int64), read_value=False)
        return 1


def tally_on(device: str) -> Tally:
    """The tally of `device` (made on first use)."""
    with _LOCK:
        tally = _TALLIES.get(device)
    if tally is None:
        made = Tally(device)
        with _LOCK:
            tally = _TALLIES.setdefault(device, made)
    return tally


def key_of(table, shard: int) -> tuple:
    """A table shard's key in the tallies: a number the table is given once (names repeat across models,
    and Python ids across objects' lifetimes: an id whose table is gone is given a new number)."""
    with _LOCK:
        entry = _NUMBERED.get(id(table))
        if entry is None or entry[0]() is not table:
            entry = (weakref.ref(table), next(_NUMBERS))
            _NUMBERED[id(table)] = entry
    return (entry[1], shard)


_READING = threading.local()


@contextlib.contextmanager
def reading():
    """Inside the block (this thread), each tally is read once, at its first use: a report over many tables
    reads each counter variable once, not once per table."""
    saved = getattr(_READING, "values", None)
    _READING.values = {} if saved is None else saved
    try:
        yield
    finally:
        _READING.values = saved


def _values(tally: Tally) -> np.ndarray:
    cache = getattr(_READING, "values", None)
    if cache is None:
        return tally.read()
    if tally.device not in cache:
        cache[tally.device] = tally.read()
    return cache[tally.device]


def shard_counts(table) -> np.ndarray:
    """The distinct ids each shard of `table` served in training lookups so far, summed over the tallies that
    count them (several devices' under mirrored copies), int64 `[num_shards]`."""
    out = np.zeros([table.num_shards], np.int64)
    with _LOCK:
        tallies = list(_TALLIES.values())
    for tally in tallies:
        wanted = [(i, tally.slots.get(key_of(table, i))) for i in range(table.num_shards)]
        wanted = [(i, s) for i, s in wanted if s is not None]
        if wanted:
            values = _values(tally)
            for i, s in wanted:
                out[i] += values[s] if s < len(values) else 0
    return out


EXCHANGED = "exchanged"  # a table's key in the tallies for its exchange's bytes, beside its shards' numbers


def add_exchanged(device: str, sent: Sequence[tuple]) -> tf.Tensor:
    """Adds the bytes `sent` (`(table, int64 scalar)` pairs, a table listed once per shard) to each table's
    exchange counter on `device` (the replica's): one op for all of them."""
    totals: Dict[tuple, list] = {}
    for table, nbytes in sent:
        totals.setdefault(key_of(table, EXCHANGED), []).append(tf.cast(nbytes, tf.int64))
    return tally_on(device).add(list(totals), tf.stack([tf.add_n(parts) for parts in totals.values()]))


def exchanged_bytes(table) -> Optional[int]:
    """The bytes the replicas of this process put into `table`'s gradient exchange so far, or None where its
    exchange counts none (one replica, a placement without an exchange)."""
    found, total = False, 0
    with _LOCK:
        tallies = list(_TALLIES.values())
    for tally in tallies:
        slot = tally.slots.get(key_of(table, EXCHANGED))
        if slot is not None:
            values = _values(tally)
            found, total = True, total + (int(values[slot]) if slot < len(values) else 0)
    return total if found else None


def counter_variables() -> list:
    """Every tally's variable (graph checks tell them from tables)."""
    with _LOCK:
        return [t.variable for t in _TALLIES.values()]


def reset_lost() -> int:
    """`Tally.reset_lost` of every tally; returns how many were set."""
    with _LOCK:
        tallies = list(_TALLIES.values())
    return sum(t.reset_lost() for t in tallies)
