"""MirroredStrategy and MultiWorkerMirroredStrategy: mirrored tables, exchanged gradients.

Placement:

* `"device"`: every shard is an ordinary `MirroredVariable`, one copy per
  replica device;
* `"host"`: one copy per worker, in host memory, read by that worker's
  replicas (a plain variable on the host CPU, created through the strategy's
  own single-device colocation; the exchanged gradient, identical on every
  replica, is applied to it once);
* `"auto"`: `"host"` for tables above `HOST_PLACEMENT_BYTES`, else `"device"`.

Sparse gradients of every shard are summed by the table's `ExchangePolicy`
(`tfs.exchange`): in one process (MirroredStrategy) the replicas' slices are
merged once on one device; across workers (MultiWorkerMirroredStrategy) they
travel over TensorFlow's collectives. `set_transport` forces the collective
transport under MirroredStrategy too (tests and the exchange benchmark
compare the two on the same devices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
import zlib

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.config import Exchange
from tf_sharded.exchange.policy import ExchangePolicy
from tf_sharded.layout import resolve_spec
from tf_sharded.strategy import FitLoop, StrategyFamily, Transport, register
from tf_sharded.table.builder import ShardPlacement, build_sharded_variable, colocate_scope

HOST_PLACEMENT_BYTES = 256 << 20

# Per strategy: the exchange of tables created without `exchange=`, and a forced transport.
_DEFAULT_EXCHANGE = weakref.WeakKeyDictionary()
_TRANSPORT = weakref.WeakKeyDictionary()


def host_device(strategy) -> str:
    """This worker's host CPU."""
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return spec.replace(device_type="CPU", device_index=0).to_string()


def resolve_placement(placement, table_bytes: int) -> str:
    """Resolves a validated `placement` argument; None and "auto" choose by table size."""
    if placement in (None, "auto"):
        return "host" if table_bytes > HOST_PLACEMENT_BYTES else "device"
    return placement


def create(strategy, config, variable_factory=None):
    spec = resolve_spec(config.partitions, config.shape, config.dtype, config.scheme, default_shards=1)
    table_bytes = config.dtype.size * int(tf.TensorShape(config.shape).num_elements())
    placement = resolve_placement(config.placement, table_bytes)
    policy = ExchangePolicy(config.exchange or _DEFAULT_EXCHANGE.get(strategy, "auto"), config.ids_per_step)
    if config.seed is None and _compat.in_multi_worker_mode(strategy):
        # Every worker initialises its own copy: the seed must not be drawn per worker.
        config = dataclasses.replace(config, seed=zlib.crc32(config.name.encode()))
    if placement == "host":
        host = _compat.single_device(host_device(strategy))
        shards = ShardPlacement([None] * spec.num_shards, scope=lambda i: colocate_scope(host))
    else:
        shards = ShardPlacement([None] * spec.num_shards)
    with strategy.scope():
        return build_sharded_variable(
            config,
            spec,
            strategy,
            shards,
            variable_factory=variable_factory,
            exchange=policy,
            mirrored_placement=placement,
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
def transport_scope(strategy, transport):
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
    """Dynamic tables: one copy on this worker's host, shared by its replicas (their inserts meet in one index)."""
    return [host_device(strategy)] * (num_shards or 1)


MIRRORED = register(
    StrategyFamily(
        name="mirrored",
        create=create,
        mirrors_tables=True,
        transport=transport,
        fit_loop=_mirrored_fit_loop,
        dynamic_devices=dynamic_devices,
    ),
    tf.distribute.MirroredStrategy,
)


def multi_worker_dynamic_devices(strategy, num_shards):
    """Dynamic tables: one copy per worker, kept equal by inserting every replica's keys on every worker.

    The copies agree because each worker applies the same inserts in the same
    order (`tf_sharded.table.dynamic.agree`); several replicas of one worker
    would insert the gathered keys once each, so one replica per worker only.
    """
    local = len(strategy.extended.worker_devices)
    if local != 1:
        raise ValueError(
            f"Dynamic tables under MultiWorkerMirroredStrategy need one replica per worker (each worker's copy "
            f"inserts every replica's keys once). Received: {local} local devices per worker "
            f"({list(strategy.extended.worker_devices)}); use one device per worker process."
        )
    return dynamic_devices(strategy, num_shards)


# Keras 3's model.fit fails before the first step under MultiWorkerMirroredStrategy (keras-team/keras#20585).
MULTI_WORKER = register(
    StrategyFamily(
        name="multi_worker_mirrored",
        create=create,
        mirrors_tables=True,
        transport=transport,
        fit_loop=lambda strategy, steps_per_execution: FitLoop.REPLICAS,
        dynamic_devices=multi_worker_dynamic_devices,
    ),
    tf.distribute.MultiWorkerMirroredStrategy,
)
