"""ParameterServerStrategy: shards round-robin over the parameter servers.

Shard variables are created through the strategy's own variable creator (so
TensorFlow sees them as created in its scope), pinned to their ps task by
colocation, which also stops the strategy's `variable_partitioner` from
splitting a shard a second time.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tf_sharded import _compat, creation
from tf_sharded.strategy import register

# Per strategy: how many shards have been placed, so that tables start on
# different ps tasks and small tables do not all pile onto ps 0.
_PLACED = weakref.WeakKeyDictionary()


class _Anchor:
    """Stands in for a variable to colocate with: only `.device` is read."""

    def __init__(self, device: str):
        self.device = device
        self.name = device


def ps_device(task: int) -> str:
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


def default_num_shards(strategy, request) -> int:
    """From the strategy's `variable_partitioner`, else one shard per ps."""
    partitioner = _compat.ps_variable_partitioner(strategy)
    num_ps = _compat.ps_num_ps(strategy)
    if partitioner is None:
        return num_ps
    result = partitioner(tf.TensorShape(request.shape), request.dtype)
    return int(list(result)[0])


@register(tf.distribute.experimental.ParameterServerStrategy)
def create(strategy, request: creation.VariableRequest):
    request.reject_exchange("ParameterServerStrategy")
    spec = request.resolve_spec(default_shards=default_num_shards(strategy, request))
    num_ps = _compat.ps_num_ps(strategy)
    start = _PLACED.get(strategy, 0)
    devices = [ps_device((start + i) % num_ps) for i in range(spec.num_shards)]
    _PLACED[strategy] = start + spec.num_shards

    with strategy.scope():
        return creation.build_sharded_variable(
            request, spec, devices, strategy, placement=lambda i: creation.colocate_scope(_Anchor(devices[i]))
        )
