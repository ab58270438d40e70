"""`tfs.fit`'s recovery from a parameter-server failure.

TensorFlow's `ClusterCoordinator` reschedules the steps of a worker that
fails and lets a restarted worker rejoin, but a parameter server's failure
is final for it: the variables on that task are gone and every later step
raises `UnavailableError`. TF's guidance is to restart the whole program
from a checkpoint. `tfs.fit` does that restart inside the running program:

1. tell a ps failure from any other error (the message names the ps task,
   as TF's own classification reads it);
2. wait, bounded, until the task answers again (a process-per-task
   `LocalCluster` restarts it; on Kubernetes its StatefulSet pod restarts);
3. refresh the client's view of the cluster and give every variable, lookup
   table and critical section that lived on the task a new, empty resource;
4. restore model, optimizer and step from the latest checkpoint (the
   surviving ps are restored too: the cluster returns to one consistent
   state), reset what the checkpoint does not hold (metrics, counters) to
   zero, and retrace the step functions, which captured the old handles.
"""

from __future__ import annotations

import re
import time
from typing import Set

import tensorflow as tf

from tf_sharded import _compat

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


def lost(tasks: Set[int]) -> Set[int]:
    """Of the ps tasks an error names, those that lost their state: an error from a step names every task
    its cancelled parts touched, so each is asked to run an op in this client's current session, which a
    restarted (or still absent) task cannot."""
    gone = set()
    for task in sorted(tasks):
        try:
            with tf.device(f"/job:ps/replica:0/task:{task}/device:CPU:0"):
                tf.constant(1) + 1  # noqa: B018 - runs remotely, or raises
        except (tf.errors.OpError, RuntimeError):
            gone.add(task)
    return gone


def wait_for(tasks: Set[int], timeout: float) -> None:
    """Returns once every ps in `tasks` answers; raises TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    for task in sorted(tasks):
        while not _compat.task_alive(f"/job:ps/replica:0/task:{task}"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ps:{task} did not come back within {timeout:.0f}s")
            time.sleep(0.5)


def reconnect(tasks: Set[int]) -> list:
    """Refreshes the cluster and renews every resource that lived on `tasks`.

    Returns the renewed variables (uninitialised until restored or assigned).
    """
    _compat.refresh_cluster()
    names = {f"/job:ps/replica:0/task:{t}" for t in tasks}
    renewed = []
    for obj, task in _compat.remote_state():
        if task in names and _compat.renew_remote_state(obj):
            renewed.append(obj)
    return renewed


def zero_unrestored(variables: list) -> None:
    """Renewed variables the checkpoint did not hold (metric totals, input claims) start again from zero."""
    for v in variables:
        if not bool(v.is_initialized()):
            v.assign(tf.zeros(v.shape, v.dtype))


__all__ = ["failed_ps", "lost", "reconnect", "wait_for", "zero_unrestored"]
