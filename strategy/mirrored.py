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
(`tf_sharded.exchange`); Keras 3 optimizers are routed there (see
`_compat.route_keras_gradient_reduction`).
"""

from __future__ import annotations

import zlib

import tensorflow as tf

from tf_sharded import _compat, creation, exchange
from tf_sharded.strategy import register

HOST_PLACEMENT_BYTES = 256 << 20


def host_device(strategy) -> str:
    """This worker's host CPU."""
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return spec.replace(device_type="CPU", device_index=0).to_string()


def resolve_placement(placement, table_bytes: int) -> str:
    """Resolves a validated `placement` argument; None and "auto" choose by table size."""
    if placement in (None, "auto"):
        return "host" if table_bytes > HOST_PLACEMENT_BYTES else "device"
    return placement


@register(tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
def create(strategy, request: creation.VariableRequest):
    spec = request.resolve_spec(default_shards=1)
    table_bytes = request.dtype.size * int(tf.TensorShape(request.shape).num_elements())
    placement = resolve_placement(request.placement, table_bytes)
    policy = exchange.ExchangePolicy(
        request.exchange or getattr(strategy, "_tfs_default_exchange", "auto"), request.ids_per_step
    )
    if request.seed is None and _compat.in_multi_worker_mode(strategy):
        # Every worker initialises its own copy: the seed must not be drawn per worker.
        request.seed = zlib.crc32(request.name.encode())
    host = _compat.single_device(host_device(strategy)) if placement == "host" else None
    placement_scope = (lambda i: creation.colocate_scope(host)) if host is not None else None

    with strategy.scope():
        table = creation.build_sharded_variable(
            request, spec, [None] * spec.num_shards, strategy, placement=placement_scope
        )
    table._exchange = policy
    table._placement = placement
    _compat.route_keras_gradient_reduction(exchange.all_reduce_gradients, exchange.apply_updates)
    return table


def set_default_exchange(strategy, mode: str) -> None:
    """Sets the exchange used by tables created later under `strategy` without `exchange=`."""
    exchange.ExchangePolicy(mode)  # validates
    strategy._tfs_default_exchange = mode
