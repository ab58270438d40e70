"""A hybrid cluster on one machine: table servers and worker processes started by the library.

`LocalHybridCluster(num_workers, num_ps)` starts `num_ps` table servers, a
process each (`python -m tf_sharded.hybrid localhost:PORT`, listening on
loopback only). This process is worker 0; with more workers, each other
worker runs `worker_command` (the same program, which reads its `TF_CONFIG`
and finds the cluster there), since every worker of a synchronous strategy
runs the same steps. The workers' collectives go through TensorFlow's
servers, which bind every interface: the cluster checks, as
`tfs.cluster.LocalCluster` does, that this process's network is its own
(`tf_sharded.isolation`), and warns or refuses otherwise.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Optional, Sequence

from tf_sharded import isolation as _isolation
from tf_sharded.errors import positive_int
from tf_sharded.lifetime import child_environment

# Set for the workers a local cluster starts: they run the command that started it, whose cluster flags
# describe the cluster they are part of.
WORKER_ENV = "TF_SHARDED_LOCAL_WORKER"


class LocalHybridCluster:
    """Table servers (a process each) and the other workers of a hybrid job, on localhost.

    Args:
      num_workers: workers, this process included (>= 1).
      num_ps: table servers (>= 1).
      worker_command: the command of workers 1.. (required with more than one worker), e.g.
        `[sys.executable, "train.py"]`; each gets `TF_CONFIG` naming the cluster and its task.
      isolation: "auto", "required" or "none", as `tfs.cluster.LocalCluster`'s (for the workers' ports).
      start_timeout: seconds for the servers to start serving.
      on_failure: called as `on_failure(cluster, reason)` (from a thread of its own) when a server or another
        worker fails while the job runs, before the cluster's own handling (below); e.g. to stop the cluster
        and restart the job from its checkpoint, as the application does.

    Example (this process the only worker; two table servers):

        cluster = tfs.hybrid.LocalHybridCluster(num_ps=2).start()
        strategy = cluster.strategy()
        ...
        cluster.stop()

    >>> import tf_sharded as tfs
    >>> tfs.hybrid.LocalHybridCluster(num_workers=2, num_ps=1)
    Traceback (most recent call last):
    ...
    ValueError: Argument `worker_command` must name the program workers 1.. run (2 workers). Received: None
    """

    def __init__(
        self,
        num_workers: int = 1,
        num_ps: int = 2,
        worker_command: Optional[Sequence[str]] = None,
        isolation: Optional[str] = None,
        start_timeout: float = 120.0,
        on_failure: Optional[Callable[[LocalHybridCluster, str], None]] = None,
    ):
        self.num_workers, self.num_ps = positive_int("num_workers", num_workers), positive_int("num_ps", num_ps)
        if num_workers > 1 and not worker_command:
            raise ValueError(
                f"Argument `worker_command` must name the program workers 1.. run ({num_workers} workers). "
                f"Received: {worker_command!r}"
            )
        self.worker_command = list(worker_command or [])
        self.isolation = os.environ.get(_isolation.ENV, "auto") if isolation is None else isolation
        if self.isolation not in _isolation.MODES:
            raise ValueError(f"Argument `isolation` must be one of {_isolation.MODES}. Received: {self.isolation!r}")
        self.start_timeout, self.on_failure = start_timeout, on_failure
        self.cluster_dict = {}
        self._servers: List[subprocess.Popen] = []
        self._workers: List[tuple] = []  # (process, log file)
        self._stopping = None

    @property
    def servers(self) -> List[str]:
        return list(self.cluster_dict.get("ps", []))

    def start(self) -> LocalHybridCluster:
        """Starts the servers, waits until they serve, then starts workers 1.. (idempotent)."""
        if self.cluster_dict:
            return self
        import portpicker

        ports = [portpicker.pick_unused_port() for _ in range(self.num_ps + self.num_workers)]
        workers = [f"localhost:{p}" for p in ports[self.num_ps :]]
        if self.num_workers > 1:
            warning = _isolation.check(self.isolation, ports[self.num_ps :])
            if warning:
                print(warning, file=sys.stderr, flush=True)
        self.cluster_dict = {"ps": [f"localhost:{p}" for p in ports[: self.num_ps]], "worker": workers}
        atexit.register(self.stop)
        try:
            self._start_servers()
            for index in range(1, self.num_workers):
                self._workers.append(self._launch_worker(index))
        except BaseException:
            self.stop()
            raise
        self._watch()
        return self

    def _watch(self) -> None:
        """If a server or another worker fails while the job runs, calls `on_failure`; unless that stopped the
        cluster, says so in one line on stderr and with several workers ends this process (exit code 1): it
        would otherwise wait for the lost one in its next collective, for ever. Synchronous training restarts
        as a whole, from its checkpoint (as MultiWorkerMirroredStrategy's). With one worker, its next call to a
        lost server fails by itself."""
        import threading

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
        threading.Thread(target=watch, name="LocalHybridClusterWatch", daemon=True).start()

    def failure(self, wait: float = 0.0) -> Optional[str]:
        """Which server or other worker has ended while the job runs (a worker ending well does not count), as
        a phrase, or None. Waits up to `wait` seconds for one: a peer's loss can surface in a step (a reset
        connection) just before its process has ended."""
        deadline = time.monotonic() + wait
        while True:
            for what, proc in self._watched():
                code = proc.poll()
                if code is not None and not (what.startswith("worker") and code == 0):
                    return f"the local hybrid cluster's {what} ended (exit code {code})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _watched(self) -> list:
        servers = [(f"table server {a}", p) for a, p in zip(self.cluster_dict["ps"], self._servers)]
        return servers + [(f"worker {i}", p) for i, (p, _) in enumerate(self._workers, start=1)]

    def _start_servers(self) -> None:
        env = child_environment({**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")})
        env.pop("TF_CONFIG", None)
        for address in self.cluster_dict["ps"]:
            self._servers.append(
                subprocess.Popen([sys.executable, "-m", "tf_sharded.hybrid", address], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
            )  # fmt: skip
        deadline = time.monotonic() + self.start_timeout
        for proc, address in zip(self._servers, self.cluster_dict["ps"]):
            line = proc.stdout.readline() if time.monotonic() < deadline else ""
            if not line.startswith("serving tables at"):
                raise RuntimeError(f"The table server at {address} did not start (exit code {proc.poll()})")

    def _launch_worker(self, index: int) -> tuple:
        config = {"cluster": self.cluster_dict, "task": {"type": "worker", "index": index}}
        env = child_environment({**os.environ, "TF_CONFIG": json.dumps(config), WORKER_ENV: "1"})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(self.worker_command, env=env, stdout=log, stderr=log, start_new_session=True)
        return proc, log

    def strategy(self):
        """The `HybridStrategy` of this process, worker 0 (blocks until the other workers join)."""
        import tensorflow as tf

        from tf_sharded.strategy.hybrid import HybridStrategy

        if not self.cluster_dict:
            raise RuntimeError("Start the cluster first: LocalHybridCluster(...).start()")
        if self.num_workers == 1:  # a cluster of one: no server for collectives
            return HybridStrategy(self.servers)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": self.cluster_dict["worker"]}), task_type="worker", task_id=0,
            rpc_layer="grpc",
        )  # fmt: skip
        return HybridStrategy(self.servers, cluster_resolver=resolver)

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

    def stop(self) -> None:
        """Stops every process it started (idempotent)."""
        if self._stopping is not None:
            self._stopping.set()
        for proc in self._servers + [p for p, _ in self._workers]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.wait()
        for _, log in self._workers:
            log.close()
        self._servers, self._workers = [], []

    def __enter__(self) -> LocalHybridCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
