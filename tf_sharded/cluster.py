"""Local clusters: the embedded default for the demo, the tests and notebooks.

Two modes:

* `"inprocess"`: one `tf.distribute.Server` per task inside this process
  (fast; servers cannot be shut down, so there is at most one such cluster
  per process and asking again for the same shape returns it);
* `"process"`: one OS process per task, each with its own `TF_CONFIG`,
  stopped when the cluster is closed, when this process exits, or when it
  fails to start; each task also ends by itself once this process is gone,
  however it ended (`kill -9` included: `tf_sharded.lifetime`).

Worker servers get `inter_op_parallelism_threads >= num_workers + 1`:
with fewer, coordinator steps can dead-lock on small machines.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from tf_sharded import isolation as _isolation
from tf_sharded import lifetime as _lifetime
from tf_sharded.errors import positive_int

MODES = ("inprocess", "process")
# What `LocalCluster(imports=...)` accepts: "package.module" or "package.module:function".
_IMPORT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?")

# Environment of parameter-server processes (a value already set wins). A ps only gathers and scatters
# rows, so oneDNN's kernels give it nothing, while TensorFlow's oneDNN CPU allocator keeps freed memory
# pooled, and glibc's adaptive mmap threshold keeps freed blocks of up to 32 MB in the heap: together
# they keep a ps's initialisation temporaries resident after the shards are written. `bench memory`
# measures the ps footprint against shards x (1 + slots) with these settings (docs/benchmarks.md, B3), and
# `bench dynamic` a dynamic table's bytes per live key (B7): its pools grow through blocks of every size,
# and a threshold of 4 MB left those between 1 and 4 MB in the heap (1.14x B7's memory bound at
# 500K keys, 0.97x with 1 MB).
PS_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
_INPROCESS: Optional[LocalCluster] = None
# Attempts at connecting this process to a cluster, each on a newly picked coordinator port.
CONNECT_ATTEMPTS = 3


def _pick_ports(count: int) -> List[int]:
    import portpicker

    return [portpicker.pick_unused_port() for _ in range(count)]


def _worker_config(num_workers: int) -> tf.compat.v1.ConfigProto:
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = max(num_workers + 1, os.cpu_count() or 1)
    return config


def _wait_for_ports(addresses: List[str], timeout: float, procs=None) -> None:
    deadline = time.monotonic() + timeout
    pending = list(addresses)
    while pending:
        if procs:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"A cluster task exited with code {p.returncode} before it was ready")
        host, port = pending[0].rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                pending.pop(0)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Cluster tasks {pending} did not start within {timeout:.0f}s") from None
            time.sleep(0.2)


class LocalCluster:
    """A parameter-server cluster on localhost.

    Args:
      num_workers: worker tasks (>= 1).
      num_ps: parameter-server tasks (>= 1).
      mode: "inprocess" or "process".
      start_timeout: seconds to wait for "process" tasks to listen.
      isolation: "auto" (default, or the TF_SHARDED_ISOLATION variable): if
        other machines could reach the cluster's ports (this process is not
        in a network namespace of its own, as `python -m tf_sharded` runs
        are: `tf_sharded.isolation`), start anyway and print one warning
        line naming them; "required": refuse to start instead
        (RuntimeError); "none": start without a word.
      imports: what each "process" task loads before serving, as "module"
        (imported) or "module:function" (imported, then the function
        called): the custom ops a worker's functions run (a dataset read
        with tensorflow-io, say), which TensorFlow looks up in the process
        that executes them. Code the calling program chooses, as its own
        imports are: pass names from the program, never from a file, a flag
        or the environment (the training application passes its readers'
        `tf_sharded.app.readers:load_ops`). Anything but a dotted name is
        refused.

    Example (one OS process per task; `cluster.strategy()` would then give a
    `ParameterServerStrategy` connected to it):

    >>> import tf_sharded as tfs
    >>> with tfs.cluster.LocalCluster(num_workers=1, num_ps=2, mode="process") as cluster:
    ...     print(len(cluster.pids), sorted(cluster.cluster_dict))
    3 ['ps', 'worker']
    >>> cluster.pids
    []
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 2,
        mode: str = "inprocess",
        start_timeout: float = 60.0,
        imports: Sequence[str] = (),
        restart: bool = True,
        isolation: Optional[str] = None,
    ):
        positive_int("num_workers", num_workers)
        isolation = os.environ.get(_isolation.ENV, "auto") if isolation is None else isolation
        if isolation not in _isolation.MODES:
            raise ValueError(
                f"Argument `isolation` must be one of {_isolation.MODES}. Received: isolation={isolation!r}"
            )
        positive_int("num_ps", num_ps)
        if mode not in MODES:
            raise ValueError(f"Argument `mode` must be one of {MODES}. Received: mode={mode!r}")
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.mode = mode
        self.start_timeout = start_timeout
        self.imports = tuple(_checked_imports(imports))
        self.restart = restart
        self.isolation = isolation
        self.restarts: List[tuple] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: Optional[threading.Thread] = None
        self._procs: List[subprocess.Popen] = []
        self._servers = []
        self._started = False
        self._strategies: Dict[object, tf.distribute.experimental.ParameterServerStrategy] = {}
        self.cluster_dict: Dict[str, List[str]] = {}
        self.chief_port: Optional[int] = None

    # ------------------------------------------------------------------ life --

    def start(self) -> LocalCluster:
        """Starts the tasks (idempotent)."""
        if self._started:
            return self
        ports = _pick_ports(self.num_workers + self.num_ps)
        warning = _isolation.check(self.isolation, ports)  # raises before any task starts if required
        if warning:
            print(warning, file=sys.stderr, flush=True)
        self.cluster_dict = {
            "worker": [f"localhost:{p}" for p in ports[: self.num_workers]],
            "ps": [f"localhost:{p}" for p in ports[self.num_workers :]],
        }
        if self.mode == "inprocess":
            self._start_inprocess()
        else:
            self._start_processes()
        self._started = True
        return self

    def _start_inprocess(self) -> None:
        spec = tf.train.ClusterSpec(self.cluster_dict)
        config = _worker_config(self.num_workers)
        for i in range(self.num_workers):
            self._servers.append(
                tf.distribute.Server(spec, job_name="worker", task_index=i, config=config, protocol="grpc", start=True)
            )
        for i in range(self.num_ps):
            self._servers.append(tf.distribute.Server(spec, job_name="ps", task_index=i, protocol="grpc", start=True))

    def _launch(self, job: str, index: int) -> subprocess.Popen:
        env = _lifetime.child_environment(os.environ)  # ends with this process, however it ends
        env["TF_CONFIG"] = json.dumps({"cluster": self.cluster_dict, "task": {"type": job, "index": index}})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if job == "ps":
            env = {**PS_ENV, **env}
        return subprocess.Popen(
            [sys.executable, "-m", "tf_sharded.cluster", "--serve", str(self.num_workers), *self.imports],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _start_processes(self) -> None:
        atexit.register(self.stop)
        try:
            for job, index in self._tasks():
                self._procs.append(self._launch(job, index))
            _wait_for_ports(self.cluster_dict["worker"] + self.cluster_dict["ps"], self.start_timeout, self._procs)
        except BaseException:
            self.stop()
            raise
        if self.restart:
            self._stopping.clear()
            self._supervisor = threading.Thread(target=self._supervise, name="LocalClusterSupervisor", daemon=True)
            self._supervisor.start()

    def _tasks(self) -> List[tuple]:
        return [(job, i) for job in ("worker", "ps") for i in range(len(self.cluster_dict[job]))]

    def _supervise(self) -> None:
        # A task that exits while the cluster runs is started again on its address, as a Kubernetes pod
        # of a StatefulSet is: TensorFlow's coordinator lets a restarted worker rejoin, and `tfs.fit`
        # restores a restarted parameter server from its checkpoint.
        while not self._stopping.wait(0.2):
            with self._lock:
                for n, (task, proc) in enumerate(zip(self._tasks(), self._procs)):
                    if proc.poll() is not None and not self._stopping.is_set():
                        self._procs[n] = self._launch(*task)
                        self.restarts.append(task)

    def kill(self, job: str, index: int) -> None:
        """Kills one task of a "process" cluster with SIGKILL, as a machine failure would (fault injection)."""
        if self.mode != "process":
            raise ValueError(f"Only a mode='process' cluster has tasks to kill. Received a {self.mode!r} cluster")
        position = self._tasks().index((job, index))
        with self._lock:
            proc = self._procs[position]
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def task_pids(self) -> dict:
        """`{(job, index): pid}` of a "process" cluster's tasks (empty in-process)."""
        if self.mode != "process":
            return {}
        return {task: p.pid for task, p in zip(self._tasks(), self._procs)}

    def stop(self) -> None:
        """Stops "process" tasks; in-process servers live as long as the process."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
            self._supervisor = None
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs = []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pids(self) -> List[int]:
        """OS process ids of the tasks ("process" mode)."""
        return [p.pid for p in self._procs]

    # --------------------------------------------------------------- clients --

    @property
    def resolver(self) -> tf.distribute.cluster_resolver.SimpleClusterResolver:
        """A cluster resolver for the coordinator (this process), which serves as task "chief"."""
        self.start()
        if self.chief_port is None:
            (self.chief_port,) = _pick_ports(1)
        spec = {**self.cluster_dict, "chief": [f"localhost:{self.chief_port}"]}
        return tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc")

    def strategy(self, variable_partitioner=None) -> tf.distribute.experimental.ParameterServerStrategy:
        """A `ParameterServerStrategy` on this cluster (cached per partitioner)."""
        key = variable_partitioner
        if key not in self._strategies:
            self._strategies[key] = self._connect(variable_partitioner)
        return self._strategies[key]

    def _connect(self, variable_partitioner) -> tf.distribute.experimental.ParameterServerStrategy:
        # The coordinator's gRPC server binds a port picked moments before, which another process on the
        # machine can take in between ("Could not start gRPC server"): connecting again on a newly picked
        # port is safe, as this process's context is only initialised by a connection that succeeds.
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                return tf.distribute.experimental.ParameterServerStrategy(
                    self.resolver, variable_partitioner=variable_partitioner
                )
            except tf.errors.UnknownError as error:
                if "Could not start gRPC server" not in str(error) or attempt == CONNECT_ATTEMPTS - 1:
                    raise
                self.chief_port = None

    def coordinator(self, strategy=None) -> tf.distribute.experimental.coordinator.ClusterCoordinator:
        """The `ClusterCoordinator` of `strategy` (default: `self.strategy()`)."""
        return tf.distribute.experimental.coordinator.ClusterCoordinator(strategy or self.strategy())

    def __repr__(self):
        return f"LocalCluster(num_workers={self.num_workers}, num_ps={self.num_ps}, mode={self.mode!r})"


def local_cluster(
    num_workers: int = 2,
    num_ps: int = 2,
    mode: str = "inprocess",
    imports: Sequence[str] = (),
    isolation: Optional[str] = None,
) -> LocalCluster:
    """Starts (or returns the running) local cluster.

    In-process servers can never be shut down, so this process keeps one
    in-process cluster: asking again for the same shape returns it, asking for
    another shape is an error. "process" clusters are new each call.
    """
    global _INPROCESS
    if mode == "inprocess":
        if _INPROCESS is not None:
            if (_INPROCESS.num_workers, _INPROCESS.num_ps) != (num_workers, num_ps):
                raise ValueError(
                    f"This process already runs an in-process cluster with num_workers="
                    f"{_INPROCESS.num_workers}, num_ps={_INPROCESS.num_ps}; in-process servers cannot "
                    f"be stopped. Received: num_workers={num_workers}, num_ps={num_ps}. Use "
                    "mode='process' for a second cluster."
                )
            return _INPROCESS
        _INPROCESS = LocalCluster(num_workers, num_ps, "inprocess", isolation=isolation).start()
        return _INPROCESS
    return LocalCluster(num_workers, num_ps, mode, imports=imports, isolation=isolation).start()


def _checked_imports(imports: Sequence[str]) -> Sequence[str]:
    """`imports` if each is "module" or "module:function" (dotted Python names), else a ValueError."""
    if isinstance(imports, str):
        imports = [imports]
    wrong = [name for name in imports if not isinstance(name, str) or not _IMPORT.fullmatch(name)]
    if wrong:
        raise ValueError(
            f'Argument `imports` must hold module names ("package.module") or "package.module:function". '
            f"Received: imports={list(imports)!r}"
        )
    return imports


def _serve(num_workers: int, imports: Sequence[str] = ()) -> None:
    """Entry point of a "process" task: serve the task named by TF_CONFIG. `imports` are the names its
    `LocalCluster` was given by the program that started it (the command line of this process)."""
    _lifetime.exit_with_parent()
    for name in _checked_imports(imports):
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    job, index = resolver.task_type, resolver.task_id
    config = _worker_config(num_workers) if job == "worker" else None
    server = tf.distribute.Server(
        resolver.cluster_spec(), job_name=job, task_index=index, config=config, protocol="grpc", start=True
    )
    server.join()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--serve":
        _serve(int(sys.argv[2]), sys.argv[3:])
    else:
        print("usage: python -m tf_sharded.cluster --serve NUM_WORKERS [MODULE ...]", file=sys.stderr)
        sys.exit(2)
