"""The locks of dynamic shards: one `tf.CriticalSection` per device, and running many shards' work in one.

Every dynamic shard on a device shares that device's lock (`device_lock`).
Each critical section is a round trip to its device, and a traced function
runs its sections on one device one after another (`locked_on`: TensorFlow
2.16 hangs when a function holds two independent `MutexLock`s on one
device; sections on different devices run side by side), so a step's cost
would grow with its tables if each shard took the lock on its own:
`locked_together` runs the work of many shards in one section per device,
and inside `grouped_updates` (Keras's update step) the optimizer's writes
to dynamic shards wait and then run that way too.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

# Per traced graph and device: the output of the last critical section it executes there, which the next one
# on that device waits for.
_LAST_RELEASE = weakref.WeakKeyDictionary()
# Device -> the critical section of every dynamic shard there.
_DEVICE_LOCKS: Dict[str, tf.CriticalSection] = {}
# Per thread: inside `grouped_updates`, the (shard, writes) waiting to run.
_DEFERRED = threading.local()


def device_lock(device: str) -> tf.CriticalSection:
    """The lock of every dynamic shard on `device` (created on first use, on that device)."""
    lock = _DEVICE_LOCKS.get(device)
    if lock is None:
        with tf.init_scope(), tf.device(device):
            lock = _DEVICE_LOCKS[device] = tf.CriticalSection(name="dynamic_lock")
    return lock


def settled(ops) -> tf.Tensor:
    """A scalar that is ready only after every op in `ops` ran (what a critical section waits for)."""
    with tf.control_dependencies([op for op in ops if op is not None]):
        return tf.constant(0, tf.int64)


def locked_on(lock: tf.CriticalSection, device: str, body: Callable[[], object]):
    """`body()` under `lock` on `device`, after every critical section the traced function ran there before."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    previous = _LAST_RELEASE.get(graph, {}).get(device) if graph is not None else None

    def after_previous():
        with tf.control_dependencies([previous] if previous is not None else []):
            return body()

    with tf.device(device):
        released = lock.execute(after_previous, exclusive_resource_access=False)
        if graph is not None:
            single = isinstance(released, tf.Tensor)
            _LAST_RELEASE.setdefault(graph, {})[device] = released if single else settled(tf.nest.flatten(released))
    return released


def locked_together(requests: Sequence[Tuple[Any, Callable[[], tf.Tensor]]]) -> List[tf.Tensor]:
    """Outputs of `body()` for each `(shard, body)`, in one critical section per device.

    Bodies of different shards run side by side inside the section; bodies
    of the same shard run in the order given, each allocating from what the
    previous one left (a traced function orders ops on one resource as they
    were created).
    """
    by_lock: Dict[int, list] = {}
    for i, (shard, _) in enumerate(requests):
        by_lock.setdefault(id(shard.lock), []).append(i)
    outputs: List[Optional[tf.Tensor]] = [None] * len(requests)
    for members in by_lock.values():
        first = requests[members[0]][0]

        def section(members=members):
            return [requests[i][1]() for i in members]

        for i, out in zip(members, locked_on(first.lock, first.device, section)):
            outputs[i] = out
    return outputs


@contextlib.contextmanager
def grouped_updates():
    """Inside the block, `DynamicShard.update_exclusively` writes wait; they run as the block ends, in one
    critical section per device (a step's optimizer writes to all of a device's dynamic shards at once)."""
    if getattr(_DEFERRED, "pending", None) is not None:  # nested: the outer block runs them
        yield
        return
    _DEFERRED.pending = []
    try:
        yield
        pending = _DEFERRED.pending
    finally:
        _DEFERRED.pending = None
    if pending:
        locked_together(pending)


def defer(shard, body: Callable[[], tf.Tensor]) -> bool:
    """Inside `grouped_updates`: keeps `body` (writes to `shard`, run under its lock) for the block's end and
    returns True."""
    pending = getattr(_DEFERRED, "pending", None)
    if pending is None:
        return False
    pending.append((shard, body))
    return True
