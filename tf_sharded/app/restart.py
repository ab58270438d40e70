"""The application's restart of a synchronous job from its checkpoint when a process of its local cluster fails.

A hybrid or multi-worker job is synchronous across its workers: a lost
worker cannot rejoin a running step, and a lost table server takes its rows
with it. So the job restarts as a whole: `train --strategy hybrid` (or
`--strategy multi_worker --num_workers N`) on the local cluster it starts
(no `TF_CONFIG`) stops every process of that cluster and runs the same
command again, which starts a new cluster and resumes from
`--checkpoint_dir` (tables, slots, dense variables, step and input
position), at most `MAX_RESTARTS` times per job. Without
`--checkpoint_dir`, or once they are spent, the job ends with one line on
stderr. A cluster described by `TF_CONFIG` is restarted by whatever started
its tasks (Kubernetes, a job scheduler).
"""

from __future__ import annotations

import os
import sys
import threading

RESTARTS_ENV = "TF_SHARDED_RESTARTS"
MAX_RESTARTS = 3
_LOCK = threading.Lock()


class JobFailure(RuntimeError):
    """A step failed because a process of the job's local cluster did (the message says which)."""


def restarts_done() -> int:
    """How many times this job has restarted so far."""
    return int(os.environ.get(RESTARTS_ENV, "0"))


def restart(reason: str, checkpoint_dir, cluster=None) -> None:
    """Runs this command again in place of this process (after stopping `cluster`), if it can resume from
    `checkpoint_dir` and restarts are left; returns otherwise. One caller at a time: the first one wins."""
    with _LOCK:
        done = restarts_done()
        if not checkpoint_dir or done >= MAX_RESTARTS or os.environ.get("TF_CONFIG"):
            return
        print(f"restarting: {reason}; the job restarts from --checkpoint_dir (restart {done + 1} of "
              f"{MAX_RESTARTS})", file=sys.stderr, flush=True)  # fmt: skip
        sys.stdout.flush()
        if cluster is not None:
            cluster.stop()
        command = [sys.executable, "-m", "tf_sharded", *sys.argv[1:]]
        os.execve(sys.executable, command, {**os.environ, RESTARTS_ENV: str(done + 1)})


def ending(checkpoint_dir) -> str:
    """What the last line says when the job ends instead."""
    if not checkpoint_dir:
        return "the job ends (without --checkpoint_dir it cannot resume)"
    if restarts_done() >= MAX_RESTARTS:
        return f"the job ends after {MAX_RESTARTS} restarts; rerun it to resume from --checkpoint_dir"
    return "the job ends; rerun it to resume from --checkpoint_dir"
