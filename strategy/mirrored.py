"""MirroredStrategy and MultiWorkerMirroredStrategy: mirrored tables, exchanged gradients.

Placement:

* `"device"`: every shard is an ordinary `MirroredVariable`, one copy per
  replica device;
* `"host"`: one copy per worker, in host memory, read by that worker's
  replicas (a plain variable on the host CPU, created through the strategy's
  own single-device colocation; the exchanged gradient, identical on every
  replica, is applied to it once);
* `"sharded"`: the table is split along its rows over the replicas, replica
  `r` holding shard `r` (and its optimizer slots) as a plain variable on its
  device (a table with fewer rows than replicas: one row on each of the
  first replicas). A replica's lookup sends its distinct ids to the shards that own
  them and gets their rows back; each shard's gradient rows from every
  replica are summed on its owner (`tfs.exchange.owners`), and the optimizer
  updates each row once, there. A table can then use every replica's memory;
* `"auto"`: in one process, `"sharded"` for a table whose copy (with a slot)
  does not fit a replica's memory but whose shard does (`replica_memory`);
  otherwise `"host"` for tables above `HOST_PLACEMENT_BYTES`, else `"device"`.

Sparse gradients of every mirrored shard are summed by the table's `ExchangePolicy`
(`tfs.exchange`): in one process (MirroredStrategy) the replicas' slices are
merged once on one device; across workers (MultiWorkerMirroredStrategy) they
travel over TensorFlow's collectives. `set_transport` forces the collective
transport under MirroredStrategy too (tests and the exchange benchmark
compare the two on the same devices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
import zlib
from typing import Optional

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.config import Exchange, ExchangePolicy
from tf_sharded.layout import resolve_spec
from tf_sharded.strategy import FitLoop, StrategyFamily, Transport, register
from tf_sharded.table import registry
from tf_sharded.table.batched import build_batched
from tf_sharded.table.builder import ShardPlacement, build_sharded_variable, colocate_scope

HOST_PLACEMENT_BYTES = 256 << 20
# Optimizer slots counted beside a table when "auto" asks whether it fits a replica (Adagrad's one; as tfs.plan).
AUTO_SLOTS = 1

# Per strategy: the exchange of tables created without `exchange=`, and a forced transport.
_DEFAULT_EXCHANGE = weakref.WeakKeyDictionary()
_TRANSPORT = weakref.WeakKeyDictionary()


def host_device(strategy) -> str:
    """This worker's host CPU."""
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return spec.replace(device_type="CPU", device_index=0).to_string()


def resolve_placement(placement, table_bytes: int) -> str:
    """Resolves a validated `placement` argument; None and "auto" choose by table size."""
    if registry.chosen_placement(placement) is None:
        return "host" if table_bytes > HOST_PLACEMENT_BYTES else "device"
    return placement


def _sharded_devices(strategy, config, num_shards: int) -> list:
    """The replica device of each shard of a `placement="sharded"` table; refuses what cannot be sharded so."""
    if not _compat.uses_merge_call(strategy) and not _compat.in_multi_worker_mode(strategy):
        raise ValueError(
            f"Argument `placement` of table '{config.name}': placement='sharded' needs MirroredStrategy or "
            f"MultiWorkerMirroredStrategy with its replicas meeting in merge_call or collectives. Received: "
            f"placement='sharded' under {type(strategy).__name__} with {list(strategy.extended.worker_devices)}"
        )
    if config.exchange is not None:
        raise ValueError(
            f"Argument `exchange` of table '{config.name}' does not apply to placement='sharded': each shard's "
            f"gradient rows are summed on the replica that owns it. Received: exchange={config.exchange.value!r}"
        )
    devices = _replica_devices(strategy)
    wanted = min(len(devices), config.shape[0])
    if num_shards != wanted:
        raise ValueError(
            f"Argument `partitions` of table '{config.name}' must give one shard per replica with "
            f"placement='sharded': {wanted} shards for {len(devices)} replicas and {config.shape[0]} rows (or "
            f"None). Received: partitions={config.partitions!r} ({num_shards} shards)"
        )
    return devices[:num_shards]


def _replica_devices(strategy) -> list:
    """The device of every replica in sync, in replica order (across workers: each worker's local devices)."""
    if not _compat.in_multi_worker_mode(strategy):
        return list(strategy.extended.worker_devices)
    return _compat.cluster_replicas(strategy)[1]


def _remote(strategy, devices):
    """`remote(i)` for the shards on `devices`: the device of shard `i` if another worker holds it (not one of
    this worker's replicas), else None (None altogether within one process)."""
    if not _compat.in_multi_worker_mode(strategy):
        return None
    first, local = _compat.cluster_replicas(strategy)[0], len(strategy.extended.worker_devices)
    return lambda i: None if first <= i < first + local else devices[i]


def replica_memory(strategy) -> Optional[int]:
    """Bytes one replica's device can hold, where this process can tell (None where it cannot).

    GPU replicas: the smallest `memory_limit` configured for their logical
    devices (TensorFlow reports no total otherwise). CPU replicas (logical
    devices of one host): the host's physical memory, shared by the replicas.
    """
    devices = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    if all(d.device_type == "GPU" for d in devices):
        limits = []
        for gpu in tf.config.list_physical_devices("GPU"):
            configured = tf.config.get_logical_device_configuration(gpu) or []
            limits += [c.memory_limit for c in configured]
        if not limits or None in limits:
            return None
        return int(min(limits)) << 20
    if all(d.device_type == "CPU" for d in devices):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // len(devices)
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _budget_source(strategy) -> str:
    """Where `replica_memory` took its figure from, for messages."""
    if all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in strategy.extended.worker_devices):
        return "the smallest GPU memory_limit configured"
    return f"the host's physical memory over {len(strategy.extended.worker_devices)} replica(s)"


def _placement_of(strategy, config) -> registry.PlacementType:
    """A table's placement; "auto" (or none given) in one process shards a table whose copy with a slot does not
    fit a replica's memory but whose shard does, else keeps the size rule (`resolve_placement`). In one process,
    an explicit copy per replica ("device") that alone exceeds a replica's memory is refused before anything is
    created."""
    table_bytes = config.dtype.size * int(tf.TensorShape(config.shape).num_elements())
    # Across workers each would measure its own memory and might decide otherwise: tfs.plan decides for all.
    one_process = _compat.uses_merge_call(strategy) and not _compat.in_multi_worker_mode(strategy)
    chosen = registry.chosen_placement(config.placement)
    if chosen is not None and chosen.per_replica == "copy" and one_process:
        budget = replica_memory(strategy)
        if budget is not None and table_bytes > budget:
            replicas = min(strategy.num_replicas_in_sync, config.shape[0])
            instead = f"placement='sharded' ({_mib(table_bytes / replicas)} per replica), " if replicas > 1 else ""
            raise ValueError(
                f"Argument `placement` of table '{config.name}': placement='{chosen.option}' puts a copy of "
                f"{_mib(table_bytes)} (the table alone, before optimizer slots) on every replica, and a replica "
                f"holds {_mib(budget)} ({_budget_source(strategy)}). Use {instead}'host' or 'auto'."
            )
    if chosen is None and one_process:
        replicas = min(strategy.num_replicas_in_sync, config.shape[0])
        budget = replica_memory(strategy) if replicas > 1 else None
        need = table_bytes * (1 + AUTO_SLOTS)
        if budget is not None and need > budget:
            return registry.REPLICAS if need / replicas <= budget else registry.HOST
    return chosen or registry.chosen_placement(resolve_placement(None, table_bytes))


def _sharded_layout(strategy, config):
    """`(partition spec, device of each shard)` of a table sharded over the replicas: a shard per replica (the
    first `rows` replicas of a table with fewer rows)."""
    shards = min(strategy.num_replicas_in_sync, config.shape[0])
    spec = resolve_spec(config.partitions, config.shape, config.dtype, config.scheme, default_shards=shards)
    return spec, _sharded_devices(strategy, config, spec.num_shards)


def create_group(strategy, configs, name, variable_factory=None):
    """Tables sharded over the replicas, of one dtype and row shape, in one storage variable per replica
    (table-batched storage: one gather per replica and owner, one update per owner and step); None (each
    table its own variables) unless every table is sharded."""
    if any(_placement_of(strategy, config).per_replica != "shard" for config in configs):
        return None
    specs, shard_devices = [], []
    for config in configs:
        spec, devices = _sharded_layout(strategy, config)
        specs.append(spec)
        shard_devices.append(list(range(len(devices))))
    devices = _replica_devices(strategy)
    with strategy.scope():
        return build_batched(
            name, _seeded(strategy, configs), specs, shard_devices, devices, strategy,
            lambda d: colocate_scope(_compat.single_device(devices[d])), variable_factory=variable_factory,
            mirrored_placement="sharded", remote_device=_remote(strategy, devices),
        )  # fmt: skip


def _seeded(strategy, configs):
    """Across workers every worker initialises its own shards or copy: the seed must not be drawn per worker."""
    if not _compat.in_multi_worker_mode(strategy):
        return list(configs)
    return [c if c.seed is not None else dataclasses.replace(c, seed=zlib.crc32(c.name.encode())) for c in configs]


def _split_over_replicas(strategy, config):
    """Shard `r` on replica `r`'s device, a plain variable there (held by another worker: a stand-in here)."""
    spec, devices = _sharded_layout(strategy, config)
    on_replica = lambda i: colocate_scope(_compat.single_device(devices[i]))  # noqa: E731
    return spec, ShardPlacement([None] * spec.num_shards, scope=on_replica, remote=_remote(strategy, devices))


def _on_host(strategy, config):
    """Every shard a plain variable on this worker's host CPU, read by its replicas."""
    spec = resolve_spec(config.partitions, config.shape, config.dtype, config.scheme, default_shards=1)
    host = _compat.single_device(host_device(strategy))
    return spec, ShardPlacement([None] * spec.num_shards, scope=lambda i: colocate_scope(host))


def _copy_per_replica(strategy, config):
    """Every shard a `MirroredVariable`, as the strategy makes one."""
    spec = resolve_spec(config.partitions, config.shape, config.dtype, config.scheme, default_shards=1)
    return spec, ShardPlacement([None] * spec.num_shards)


# How each placement a mirrored table can have lays out its shards: `(partition spec, shard placement)`. The
# exchange of the replicas' gradients, where the placement has one, is the table's `ExchangePolicy`.
_LAYOUTS = {
    registry.DEVICE.name: _copy_per_replica,
    registry.HOST.name: _on_host,
    registry.REPLICAS.name: _split_over_replicas,
}


def create(strategy, config, variable_factory=None):
    placement = _placement_of(strategy, config)
    (config,) = _seeded(strategy, [config])
    spec, shards = _LAYOUTS[placement.name](strategy, config)
    policy = None
    if placement.exchanged:
        policy = ExchangePolicy(config.exchange or _DEFAULT_EXCHANGE.get(strategy, "auto"), config.ids_per_step)
    with strategy.scope():
        return build_sharded_variable(
            config,
            spec,
            strategy,
            shards,
            variable_factory=variable_factory,
            exchange=policy,
            mirrored_placement=placement.option,
        )


def set_default_exchange(strategy, mode: str) -> None:
    """Sets the exchange used by tables created later under `strategy` without `exchange=`."""
    _DEFAULT_EXCHANGE[strategy] = Exchange.parse(mode, "exchange")


def set_transport(strategy, transport) -> None:
    """Forces how `strategy`'s replicas exchange gradients in steps traced from now on.

    `transport`: "collective", "in_process" (MirroredStrategy in one process
    only), or None for the strategy's own.
    """
    if transport is None:
        _TRANSPORT.pop(strategy, None)
        return
    chosen = Transport(transport) if transport in ("in_process", "collective") else None
    if chosen is None or (chosen == Transport.IN_PROCESS and _default_transport(strategy) != chosen):
        raise ValueError(
            "Argument `transport` must be 'collective', 'in_process' (MirroredStrategy in one process) or None. "
            f"Received: transport={transport!r} under {type(strategy).__name__}"
        )
    _TRANSPORT[strategy] = chosen


@contextlib.contextmanager
def exchange_transport_scope(strategy, transport):
    """`set_transport` for the steps traced inside the block; the previous transport afterwards."""
    saved = _TRANSPORT.get(strategy)
    set_transport(strategy, transport)
    try:
        yield
    finally:
        set_transport(strategy, saved)


def _default_transport(strategy) -> Transport:
    if isinstance(strategy, tf.distribute.MirroredStrategy) and _compat.uses_merge_call(strategy):
        return Transport.IN_PROCESS
    return Transport.COLLECTIVE


def transport(strategy) -> Transport:
    return _TRANSPORT.get(strategy) or _default_transport(strategy)


def _mirrored_fit_loop(strategy, steps_per_execution: int) -> FitLoop:
    # Keras 3's own steps_per_execution > 1 fails under MirroredStrategy (keras-team/keras#19246).
    return FitLoop.REPLICAS if steps_per_execution > 1 else FitLoop.KERAS


def dynamic_devices(strategy, num_shards):
    """Dynamic tables: one copy on this worker's host, shared by its replicas (their inserts meet in one index).

    Across workers the copies agree because each worker applies the same
    inserts in the same order (`tf_sharded.table.dynamic.agree`); of a
    worker's replicas, the first inserts the keys with their counts, the
    others with none.
    """
    return [host_device(strategy)] * (num_shards or 1)


MIRRORED = register(
    StrategyFamily(
        name="mirrored",
        create=create,
        mirrors_tables=True,
        transport=transport,
        fit_loop=_mirrored_fit_loop,
        dynamic_devices=dynamic_devices,
        create_group=create_group,
    ),
    tf.distribute.MirroredStrategy,
)


def sharded_dynamic(strategy, name: str) -> tuple:
    """A dynamic table sharded over the workers: shard `r` on worker `r`'s host (in the order of workers), shared
    by that worker's replicas (one index per host, as a copy is); the others' shards stand-ins here (one
    worker: one shard, held here)."""
    me, firsts = _compat.cluster_workers(strategy)
    hosts = [tf.DeviceSpec.from_string(d).replace(device_type="CPU", device_index=0).to_string() for d in firsts]
    return hosts, [r != me for r in range(len(hosts))]


# Keras 3's model.fit fails before the first step under MultiWorkerMirroredStrategy (keras-team/keras#20585).
MULTI_WORKER = register(
    StrategyFamily(
        name="multi_worker_mirrored",
        create=create,
        mirrors_tables=True,
        transport=transport,
        fit_loop=lambda strategy, steps_per_execution: FitLoop.REPLICAS,
        dynamic_devices=dynamic_devices,
        create_group=create_group,
        sharded_dynamic=sharded_dynamic,
    ),
    tf.distribute.MultiWorkerMirroredStrategy,
)
