"""The workers of a synchronous multi-worker job on one machine, started by the library.

A synchronous job (MultiWorkerMirroredStrategy, or hybrid training) runs
the same steps on every worker. `LocalWorkers(num_workers, worker_command)`
makes this process worker 0 and starts workers 1.. as processes of their
own, each running `worker_command` (the same program, which reads its
`TF_CONFIG` and finds the cluster there). The workers' collectives go
through TensorFlow's servers, which bind every interface: the cluster
checks, as `tfs.cluster.LocalCluster` does, that this process's network is
its own (`tf_sharded.isolation`), and warns or refuses otherwise.

The job is synchronous, so a lost worker cannot rejoin a running step: when
one fails, `on_failure` runs (the application restarts the job from its
checkpoint), else this process ends with one line on stderr instead of
waiting for it in its next collective for ever. Every process started ends
with this one, however it ends (`tf_sharded.lifetime`).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, List, Optional, Sequence

from tf_sharded import isolation as _isolation
from tf_sharded.errors import positive_int
from tf_sharded.lifetime import child_environment

# Set for the workers a local cluster starts: they run the command that started it, whose cluster flags
# describe the cluster they are part of.
WORKER_ENV = "TF_SHARDED_LOCAL_WORKER"


class LocalWorkers:
    """Workers 1.. of a synchronous job, a process each on localhost; this process is worker 0.

    Args:
      num_workers: workers, this process included (>= 1).
      worker_command: the command of workers 1.. (required with more than one worker), e.g.
        `[sys.executable, "train.py"]`; each gets `TF_CONFIG` naming the cluster and its task.
      isolation: "auto", "required" or "none", as `tfs.cluster.LocalCluster`'s (for the workers' ports).
      on_failure: called as `on_failure(cluster, reason)` (from a thread of its own) when another process of the
        cluster fails while the job runs, before the cluster's own handling; e.g. to stop the cluster and
        restart the job from its checkpoint, as the application does.

    Example (two workers, the second running `train.py` too):

        cluster = LocalWorkers(2, [sys.executable, "train.py"]).start()
        strategy = cluster.strategy()  # MultiWorkerMirroredStrategy, as worker 0
        ...
        cluster.wait_for_workers()
        cluster.stop()

    >>> LocalWorkers(num_workers=2)
    Traceback (most recent call last):
    ...
    ValueError: Argument `worker_command` must name the program workers 1.. run (2 workers). Received: None
    """

    # How failures name the cluster ("the local multi-worker cluster's worker 1 ended ...").
    kind = "multi-worker"

    def __init__(
        self,
        num_workers: int = 1,
        worker_command: Optional[Sequence[str]] = None,
        isolation: Optional[str] = None,
        on_failure: Optional[Callable[[LocalWorkers, str], None]] = None,
    ):
        self.num_workers = positive_int("num_workers", num_workers)
        if num_workers > 1 and not worker_command:
            raise ValueError(
                f"Argument `worker_command` must name the program workers 1.. run ({num_workers} workers). "
                f"Received: {worker_command!r}"
            )
        self.worker_command = list(worker_command or [])
        self.isolation = os.environ.get(_isolation.ENV, "auto") if isolation is None else isolation
        if self.isolation not in _isolation.MODES:
            raise ValueError(f"Argument `isolation` must be one of {_isolation.MODES}. Received: {self.isolation!r}")
        self.on_failure = on_failure
        self.cluster_dict = {}
        self._workers: List[tuple] = []  # (process, log file)
        self._stopping = None

    def _other_jobs(self, ports: List[int]) -> dict:
        """Jobs beside the workers, given their ports (none here; table servers for hybrid training)."""
        return {}

    def _other_ports(self) -> int:
        return 0

    def _start_others(self) -> None:
        """Starts the processes of `_other_jobs` and waits until they serve."""

    def _other_processes(self) -> list:
        """(what, process) of the processes `_start_others` started, for the failure watch."""
        return []

    def start(self) -> LocalWorkers:
        """Starts the cluster's other processes, waits until they serve, then starts workers 1.. (idempotent)."""
        if self.cluster_dict:
            return self
        import portpicker

        others = self._other_ports()
        ports = [portpicker.pick_unused_port() for _ in range(others + self.num_workers)]
        if self.num_workers > 1:
            warning = _isolation.check(self.isolation, ports[others:])
            if warning:
                print(warning, file=sys.stderr, flush=True)
        self.cluster_dict = {**self._other_jobs(ports[:others]), "worker": [f"localhost:{p}" for p in ports[others:]]}
        atexit.register(self.stop)
        try:
            self._start_others()
            for index in range(1, self.num_workers):
                self._workers.append(self._launch_worker(index))
        except BaseException:
            self.stop()
            raise
        self._watch()
        return self

    def _watch(self) -> None:
        """If another process fails while the job runs, calls `on_failure`; unless that stopped the cluster,
        says so in one line on stderr and with several workers ends this process (exit code 1): it would
        otherwise wait for the lost one in its next collective, for ever. Synchronous training restarts as a
        whole, from its checkpoint. With one worker, its next call to a lost server fails by itself."""

        def watch():
            while not self._stopping.wait(0.5):
                failed = self.failure()
                if failed is None or self._stopping.is_set():
                    continue
                if self.on_failure is not None:
                    self.on_failure(self, failed)
                    if self._stopping.is_set():  # it stopped the cluster
                        return
                ends = "the job ends with it" if self.num_workers > 1 else "the next step will fail"
                print(f"error: {failed}; {ends} (rerun it to resume from its checkpoint)", file=sys.stderr, flush=True)
                if self.num_workers > 1:
                    os._exit(1)
                return

        self._stopping = threading.Event()
        threading.Thread(target=watch, name="LocalWorkersWatch", daemon=True).start()

    def failure(self, wait: float = 0.0) -> Optional[str]:
        """Which other process of the cluster has ended while the job runs (a worker ending well does not
        count), as a phrase, or None. Waits up to `wait` seconds for one: a peer's loss can surface in a step
        (a reset connection) just before its process has ended."""
        deadline = time.monotonic() + wait
        while True:
            for what, proc, log in self._watched():
                code = proc.poll()
                if code is not None and not (what.startswith("worker") and code == 0):
                    said = _last_line(log) if code > 0 else ""  # a process killed by a signal says nothing
                    said = f": {said}" if said else ""
                    return f"the local {self.kind} cluster's {what} ended (exit code {code}{said})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _watched(self) -> list:
        """(what, process, its log file or None) of every other process of the cluster."""
        others = [(what, proc, None) for what, proc in self._other_processes()]
        return others + [(f"worker {i}", p, log) for i, (p, log) in enumerate(self._workers, start=1)]

    def _launch_worker(self, index: int) -> tuple:
        config = {"cluster": self.cluster_dict, "task": {"type": "worker", "index": index}}
        env = child_environment({**os.environ, "TF_CONFIG": json.dumps(config), WORKER_ENV: "1"})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(self.worker_command, env=env, stdout=log, stderr=log, start_new_session=True)
        return proc, log

    def resolver(self):
        """The cluster resolver of this process, worker 0 of the workers' job (None with one worker: a cluster
        of one needs no server for collectives)."""
        import tensorflow as tf

        if not self.cluster_dict:
            raise RuntimeError(f"Start the cluster first: {type(self).__name__}(...).start()")
        if self.num_workers == 1:
            return None
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": self.cluster_dict["worker"]}), task_type="worker", task_id=0,
            rpc_layer="grpc",
        )  # fmt: skip

    def strategy(self):
        """The `tf.distribute.MultiWorkerMirroredStrategy` of this process, worker 0 (blocks until the other
        workers join)."""
        import tensorflow as tf

        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=self.resolver())

    def wait_for_workers(self, timeout: float = 600.0) -> None:
        """Waits for workers 1.. to end; raises RuntimeError with the end of a failed one's output."""
        deadline = time.monotonic() + timeout
        for index, (proc, log) in enumerate(self._workers, start=1):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"Worker {index} did not end within {timeout:.0f} s") from None
            if code != 0:
                log.seek(0)
                raise RuntimeError(f"Worker {index} failed (exit code {code}):\n{log.read()[-3000:]}")

    def _processes(self) -> list:
        return [p for _, p in self._other_processes()] + [p for p, _ in self._workers]

    def _forget_processes(self) -> None:
        self._workers = []

    def stop(self) -> None:
        """Stops every process it started (idempotent)."""
        if self._stopping is not None:
            self._stopping.set()
        for proc in self._processes():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.wait()
        for _, log in self._workers:
            log.close()
        self._forget_processes()

    def __enter__(self) -> LocalWorkers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _last_line(log) -> str:
    """The last line a process that has ended wrote to `log` (its error, when it failed by itself), or ""."""
    if log is None:
        return ""
    try:
        log.seek(0)  # the process has ended: moving the offset it shared is safe
        lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    except (OSError, ValueError):  # closed by `stop` meanwhile
        return ""
    return lines[-1][:300] if lines else ""
