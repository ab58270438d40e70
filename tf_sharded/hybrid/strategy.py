"""HybridStrategy: dense variables synchronous over the workers, tables on table servers (Persia's hybrid).

A `MultiWorkerMirroredStrategy` over the cluster's `chief`/`worker` tasks
only, which also knows the table servers (`tfs.hybrid.TableServer`, one per
`ps` task). Under it `create_sharded_variable` and the layers make
`ServedTable`s, and `create_dynamic_table` `ServedDynamicTable`s: the
tables live on the servers and each worker reads and updates them alone
(`tf_sharded.hybrid.table`, `tf_sharded.hybrid.dynamic`), while every
other variable is mirrored and all-reduced each step as under MultiWorkerMirroredStrategy.

Why the strategy must not see the `ps` job: MultiWorkerMirroredStrategy
makes the first `ps` task its coordination-service leader whenever the
cluster has one, and a table server never starts that service, so the
workers would wait for it (up to TensorFlow's one-hour registration
timeout).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import tensorflow as tf

from tf_sharded.hybrid.table import Servers

WORKER_JOBS = ("chief", "worker")


class HybridStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous dense training over the workers, with tables on table servers updated by each worker.

    Args:
      servers: the table servers' addresses ("host:port"), one per `ps` task.
      cluster_resolver: the workers' cluster (its `chief`/`worker` jobs only).
        None: this process alone, as a one-worker cluster.
      communication_options: as MultiWorkerMirroredStrategy's.

    Create it before anything else runs TensorFlow ops in the process
    (collectives are configured at start-up), as MultiWorkerMirroredStrategy.
    `HybridStrategy.from_tf_config()` reads a `TF_CONFIG` with `ps` tasks.

    Use (one worker, two table servers already serving):

        strategy = tfs.hybrid.HybridStrategy(["localhost:5000", "localhost:5001"])
        with strategy.scope():
            model = build_model()          # tables go to the servers

    Example (the servers are a list of addresses):

    >>> import tf_sharded as tfs
    >>> tfs.hybrid.HybridStrategy("localhost:5000")
    Traceback (most recent call last):
    ...
    ValueError: Argument `servers` must be a list of 'host:port' addresses. Received: 'localhost:5000'
    """

    def __init__(
        self,
        servers: Sequence[str],
        cluster_resolver: Optional[tf.distribute.cluster_resolver.ClusterResolver] = None,
        communication_options: Optional[tf.distribute.experimental.CommunicationOptions] = None,
    ):
        if isinstance(servers, str) or not servers or not all(isinstance(s, str) and s for s in servers):
            raise ValueError(f"Argument `servers` must be a list of 'host:port' addresses. Received: {servers!r}")
        super().__init__(cluster_resolver=cluster_resolver, communication_options=communication_options)
        self.servers = Servers(servers)

    @classmethod
    def from_tf_config(cls, tf_config: Optional[str] = None) -> HybridStrategy:
        """The strategy of this `chief`/`worker` task of `TF_CONFIG` (or `tf_config`), whose `ps` tasks serve tables."""
        config = json.loads(tf_config if tf_config is not None else os.environ.get("TF_CONFIG", "{}"))
        cluster, task = config.get("cluster", {}), config.get("task", {})
        if not cluster.get("ps"):
            raise ValueError(f"TF_CONFIG must name the table servers as a 'ps' job. Received jobs: {sorted(cluster)}")
        if task.get("type") not in WORKER_JOBS:
            raise ValueError(f"TF_CONFIG's task must be a chief or worker task here. Received: task={task!r}")
        workers = {job: list(cluster[job]) for job in WORKER_JOBS if cluster.get(job)}
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(workers), task_type=task["type"], task_id=int(task.get("index", 0)), rpc_layer="grpc"
        )
        return cls(list(cluster["ps"]), cluster_resolver=resolver)
