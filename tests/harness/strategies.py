"""The strategies the tests run under, and helpers to feed them.

MirroredStrategy runs on the 4 virtual CPUs `tests/conftest.py` configures.
One instance per process: two MirroredStrategy objects on the same devices
reuse collective instance keys and abort each other's collectives.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

import tf_sharded as tfs

DEVICES = [f"/cpu:{i}" for i in range(4)]
PLACEMENTS = ("device", "host")
# In process: gather on one device and merge once (MirroredStrategy's default); the collective transport is
# what MultiWorkerMirroredStrategy uses (markers, per-replica merge), exercised here on the same 4 devices.
TRANSPORTS = ("in_process", "collective")

_MIRRORED = []
_COUNTER = itertools.count()


def uid(prefix: str) -> str:
    """A table name not used before in this process."""
    return f"{prefix}_{next(_COUNTER)}"


def bound(fn, **kwargs):
    """`fn` with keyword arguments fixed (scheduled functions take no defaults)."""

    def wrapper(*args):
        return fn(*args, **kwargs)

    return wrapper


def mirrored() -> tf.distribute.MirroredStrategy:
    """The process's MirroredStrategy on the 4 virtual CPUs (created once)."""
    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy(DEVICES))
    return _MIRRORED[0]


def transport(name: str):
    """Context: the 4-device mirrored strategy exchanges gradients with transport `name`."""
    return tfs.strategy.mirrored.exchange_transport_scope(mirrored(), name)


def per_replica(strategy, arrays):
    """One array (or ragged tensor) per replica (they may differ in length; empty ones allowed)."""

    def value(ctx):
        array = arrays[ctx.replica_id_in_sync_group]
        return array if isinstance(array, tf.RaggedTensor) else tf.constant(array)

    return strategy.experimental_distribute_values_from_function(value)


def ps_strategy(num_workers: int = 2, num_ps: int = 2, **kwargs):
    """A ParameterServerStrategy on an in-process cluster (connects this process: mark the test `ps_cluster`)."""
    return tfs.cluster.local_cluster(num_workers=num_workers, num_ps=num_ps).strategy(**kwargs)


def run_multi_worker(script: str, num_workers: int = 2, timeout: int = 900, ps=()) -> list:
    """Runs `script` (Python source) in `num_workers` processes forming a MultiWorkerMirroredStrategy cluster.

    Each process gets its own `TF_CONFIG` (and `TASK`, its index), whose
    cluster also names `ps` (addresses) as its `ps` job if given. Returns
    `(returncode, stdout, stderr)` per worker; every worker is killed if one
    outlives `timeout`. The default is about eight times what the slowest
    cluster test takes alone here: process tests run beside each other and
    beside the main suite, on machines that may be several times slower.
    """
    import json
    import os
    import subprocess
    import sys

    import portpicker

    from tests.harness.subprocs import ROOT, network

    cluster = {"worker": [f"localhost:{portpicker.pick_unused_port()}" for _ in range(num_workers)]}
    if ps:
        cluster["ps"] = list(ps)
    procs = []
    for i in range(num_workers):
        env = {
            **os.environ,
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TASK": str(i),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                env=env,
                cwd=ROOT,
                preexec_fn=network(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outputs


class TableServers:
    """`count` table servers (`python -m tf_sharded.hybrid ADDRESS`), each its own process, until `stop()`."""

    def __init__(self, count: int, timeout: float = 120):
        import subprocess
        import sys
        import time

        import portpicker

        from tests.harness.subprocs import ROOT, _env, network

        self.addresses = [f"localhost:{portpicker.pick_unused_port()}" for _ in range(count)]
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "tf_sharded.hybrid", a], cwd=ROOT, env=_env(None),
                             preexec_fn=network(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for a in self.addresses
        ]  # fmt: skip
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            for line in proc.stdout:
                if line.startswith("serving tables at"):
                    break
                if time.monotonic() > deadline:
                    break
            else:
                self.stop()
                raise RuntimeError(f"a table server ended before serving (exit {proc.wait()})")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def multi_worker_with_local_replicas(local: int) -> tf.distribute.MultiWorkerMirroredStrategy:
    """This worker's MultiWorkerMirroredStrategy (its `TF_CONFIG`) with `local` replicas, on logical CPUs.

    MultiWorkerMirroredStrategy gives a worker one replica per GPU, and one
    replica on a machine without a GPU. To run several replicas per worker
    here, the worker's CPU is split into `local` logical devices and the
    strategy is given them where it would list its GPUs (its
    `_initialize_local_devices`). The collectives, replica numbering and
    variable placement are then those of a worker with `local` GPUs; NCCL and
    GPU memory are what this does not exercise. Call before TensorFlow
    initialises its devices.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as collective

    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * local)

    def local_cpus(self, cluster_resolver, worker_device):
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(local)), "CPU"

    collective.CollectiveAllReduceExtended._initialize_local_devices = local_cpus
    return tf.distribute.MultiWorkerMirroredStrategy()
