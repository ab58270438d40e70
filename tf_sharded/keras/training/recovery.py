"""`tfs.fit`'s recovery from a parameter-server failure.

TensorFlow's `ClusterCoordinator` reschedules the steps of a worker that
fails and lets a restarted worker rejoin, but a parameter server's failure
is final for it: the variables on that task are gone and every later step
raises `UnavailableError`. TF's guidance is to restart the whole program
from a checkpoint. `tfs.fit` does that restart inside the running program:

1. tell a ps failure from any other error: the message names the ps task,
   as TF's own classification reads it; an error that names no ps (a
   worker's input iterator that a cancelled retry left finished raises
   `OutOfRangeError`) asks every ps whether it still holds its state;
2. wait, bounded, until the task answers again (a process-per-task
   `LocalCluster` restarts it; on Kubernetes its StatefulSet pod restarts);
3. refresh the client's view of the cluster and give every variable, lookup
   table and critical section that lived on the task a new, empty resource;
4. restore model, optimizer and step from the latest checkpoint (the
   surviving ps are restored too: the cluster returns to one consistent
   state), reset what the checkpoint does not hold (metrics, counters) to
   zero, and retrace the step functions, which captured the old handles.
   A dynamic table's shards on the task are first set to an empty table's
   state: its restore exports every shard before it replaces their keys.
"""

from __future__ import annotations

import re
import time
from typing import Set, Tuple

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table import registry, tally

_PS_TASK = re.compile(r"/job:ps/replica:0/task:(\d+)")


def failed_ps(error: BaseException) -> Set[int]:
    """The ps tasks an error from a step reports as gone (empty for any other error)."""
    original = getattr(error, "original_exception", None)  # the coordinator's ClosureInputError / AbortedError
    if original is not None and original is not error:
        return failed_ps(original)
    message = str(error)
    tasks = {int(t) for t in _PS_TASK.findall(message)}
    if not tasks:
        return set()
    if isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError)):
        return tasks
    restarted = ("unknown device", "Unable to find the relevant tensor remote_handle", "contains an invalid device")
    if isinstance(error, tf.errors.InvalidArgumentError) and any(s in message for s in restarted):
        return tasks
    return set()


def lost_ps() -> Set[int]:
    """The ps tasks that hold this process's state and no longer answer, or answer without it (restarted).

    For an error whose message names no ps: a failure TensorFlow's coordinator
    retried as a transient one can surface as another error (a retry cancelled
    inside `IteratorGetNext` leaves the worker's iterator at its end), so the
    cluster is asked instead of the message. One variable read per ps.
    """
    probes = {}  # task -> up to 3 of its variables: a restarted task holds none, a live one may hold one unset
    for obj, on in _compat.remote_state():
        match = _PS_TASK.match(on)
        if match and hasattr(obj, "is_initialized"):
            variables = probes.setdefault(int(match.group(1)), [])
            if len(variables) < 3:
                variables.append(obj)
    lost = set()
    for task, variables in sorted(probes.items()):
        if not _compat.task_alive(f"/job:ps/replica:0/task:{task}"):
            lost.add(task)
            continue
        try:
            if not any(bool(v.is_initialized()) for v in variables):
                lost.add(task)
        except (tf.errors.OpError, RuntimeError):  # the old incarnation's context is unknown to a restarted task
            lost.add(task)
    return lost


def wait_for(tasks: Set[int], timeout: float) -> None:
    """Returns once every ps in `tasks` answers; raises TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    for task in sorted(tasks):
        while not _compat.task_alive(f"/job:ps/replica:0/task:{task}"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ps:{task} did not come back within {timeout:.0f}s")
            time.sleep(0.5)


def reconnect(tasks: Set[int]) -> Tuple[Set[int], list]:
    """Refreshes the cluster and renews every resource on those of `tasks` that lost their state.

    An error from a step names every task its cancelled parts touched, so
    after the refresh each named task is asked to read one of its variables:
    a restarted task no longer knows it. Returns those tasks, and the
    renewed variables (uninitialised until restored or assigned).
    """
    _compat.refresh_cluster()
    state = _compat.remote_state()
    names = {f"/job:ps/replica:0/task:{t}": t for t in tasks}
    lost = set()
    for name, task in names.items():
        held = [obj for obj, on in state if on == name and hasattr(obj, "is_initialized")]
        try:
            if held:
                held[0].is_initialized()
        except (tf.errors.OpError, RuntimeError):
            lost.add(task)
    renewed = []
    for obj, on in state:
        if names.get(on) in lost and _compat.renew_remote_state(obj):
            renewed.append(obj)
    return lost, renewed


def reset_dynamic(root) -> int:
    """Tables under `root` whose shards lost their task and that keep state besides variables (a dynamic table's
    keys): an empty table's state, which a restore can read and refill (it exports every shard before it
    assigns), as each table's kind sets it; and the lookup tallies there, zeros (`table.tally`). Returns how
    many variables were set."""
    found = tf.train.TrackableView(root).descendants()
    return sum(t.kind.reset_lost(t) for t in found if registry.is_any_table(t)) + tally.reset_lost()


def zero_unrestored(variables: list) -> None:
    """Renewed variables the checkpoint did not hold (metric totals, input claims) start again from zero."""
    for v in variables:
        if not bool(v.is_initialized()):
            v.assign(tf.zeros(v.shape, v.dtype))


__all__ = ["failed_ps", "lost_ps", "reconnect", "reset_dynamic", "wait_for", "zero_unrestored"]
