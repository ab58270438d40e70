"""`tf_sharded.local_workers.LocalWorkers`: how the loss of a worker is reported."""

import sys
import threading

import pytest

from tf_sharded.local_workers import LocalWorkers

pytestmark = pytest.mark.timeout(60)


def _failure_of(command):
    """The failure phrase the cluster reports when worker 1 (`command`) ends by itself."""
    reported, done = [], threading.Event()

    def on_failure(cluster, reason):
        reported.append(reason)
        cluster.stop()  # the job's own handling: here, nothing restarts
        done.set()

    cluster = LocalWorkers(2, command, isolation="none", on_failure=on_failure).start()
    try:
        assert done.wait(30), "no failure reported"
    finally:
        cluster.stop()
    return reported[0]


def test_a_worker_that_fails_by_itself_is_reported_with_its_last_line():
    said = "ValueError: Argument `steps` must be a positive integer. Received: 0"
    reason = _failure_of([sys.executable, "-c", f"import sys; print('starting'); sys.exit({said!r})"])
    assert reason == f"the local multi-worker cluster's worker 1 ended (exit code 1: {said})"


def test_a_worker_killed_by_a_signal_is_reported_by_its_signal():
    reason = _failure_of([sys.executable, "-c", "import os, signal; print('starting'); os.kill(os.getpid(), 9)"])
    assert reason == "the local multi-worker cluster's worker 1 ended (exit code -9)"
