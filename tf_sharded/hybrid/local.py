"""A hybrid cluster on one machine: table servers and worker processes started by the library.

`LocalHybridCluster(num_workers, num_ps)` starts `num_ps` table servers, a
process each (`python -m tf_sharded.hybrid localhost:PORT`, listening on
loopback only), then the job's other workers as `tf_sharded.local_workers`
does for any synchronous job: this process is worker 0, and each other
worker runs `worker_command`. A lost table server takes its rows with it,
so it fails the job as a lost worker does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

from tf_sharded.errors import positive_int
from tf_sharded.lifetime import child_environment
from tf_sharded.local_workers import LocalWorkers


class LocalHybridCluster(LocalWorkers):
    """Table servers (a process each) and the other workers of a hybrid job, on localhost.

    Args:
      num_workers: workers, this process included (>= 1).
      num_ps: table servers (>= 1).
      worker_command: the command of workers 1.. (required with more than one worker), e.g.
        `[sys.executable, "train.py"]`; each gets `TF_CONFIG` naming the cluster and its task.
      isolation: "auto", "required" or "none", as `tfs.cluster.LocalCluster`'s (for the workers' ports).
      start_timeout: seconds for the servers to start serving.
      on_failure: called as `on_failure(cluster, reason)` (from a thread of its own) when a server or another
        worker fails while the job runs, before the cluster's own handling; e.g. to stop the cluster and
        restart the job from its checkpoint, as the application does.

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

    kind = "hybrid"

    def __init__(
        self,
        num_workers: int = 1,
        num_ps: int = 2,
        worker_command: Optional[Sequence[str]] = None,
        isolation: Optional[str] = None,
        start_timeout: float = 120.0,
        on_failure: Optional[Callable[[LocalHybridCluster, str], None]] = None,
    ):
        super().__init__(num_workers, worker_command, isolation, on_failure)
        self.num_ps, self.start_timeout = positive_int("num_ps", num_ps), start_timeout
        self._servers: List[subprocess.Popen] = []

    @property
    def servers(self) -> List[str]:
        return list(self.cluster_dict.get("ps", []))

    def _other_ports(self) -> int:
        return self.num_ps

    def _other_jobs(self, ports: List[int]) -> dict:
        return {"ps": [f"localhost:{p}" for p in ports]}

    def _other_processes(self) -> list:
        return [(f"table server {a}", p) for a, p in zip(self.cluster_dict.get("ps", []), self._servers)]

    def _start_others(self) -> None:
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

    def _forget_processes(self) -> None:
        super()._forget_processes()
        self._servers = []

    def strategy(self):
        """The `HybridStrategy` of this process, worker 0 (blocks until the other workers join)."""
        from tf_sharded.hybrid.strategy import HybridStrategy

        return HybridStrategy(self.servers, cluster_resolver=self.resolver())
