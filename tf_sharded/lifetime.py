"""The processes a local cluster starts end when the process that started them ends, however it ends.

A local cluster (`tfs.cluster.LocalCluster` in "process" mode, the hybrid
`LocalHybridCluster`) starts its tasks in sessions of their own, so that it
can stop each task's process group, and they outlive a parent that is killed
(by `kill -9`, an out-of-memory killer, a scheduler) unless they watch for
it: a task serving for a job that is gone holds its memory and ports for
good. Each such process gets `PARENT_ENV` in its environment
(`child_environment`) and calls `exit_with_parent` first thing: a thread
that ends the process once its parent is gone (it is then re-parented, so
`os.getppid()` changes).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Mapping

PARENT_ENV = "TF_SHARDED_EXIT_WITH_PARENT"
POLL_SECONDS = 0.5


def child_environment(env: Mapping[str, str]) -> dict:
    """`env` for a process that must end with this one (`exit_with_parent`)."""
    return {**env, PARENT_ENV: "1"}


def exit_with_parent() -> None:
    """If this process was started by a local cluster (`PARENT_ENV`), ends it once its parent is gone."""
    if not os.environ.get(PARENT_ENV):
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="ExitWithParent", daemon=True).start()
