"""The one place where tf_sharded touches TensorFlow internals.

Everything imported from `tensorflow.python...` lives here, and
`tests/compat_test.py` fails loudly when a TensorFlow upgrade moves any of it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from tensorflow.python.checkpoint import restore as _restore
from tensorflow.python.trackable import base as _trackable_base
from tensorflow.python.training.saving import saveable_object as _saveable_object

Trackable = _trackable_base.Trackable
VARIABLE_VALUE_KEY = _trackable_base.VARIABLE_VALUE_KEY
CheckpointPosition = _restore.CheckpointPosition


SaveableObject = _saveable_object.SaveableObject


def save_spec(tensor_fn: Callable[[], Any], slice_spec: str, name: str, dtype, device: str):
    """A lazily evaluated slice of a checkpoint entry."""
    return _saveable_object.SaveSpec(tensor_fn, slice_spec, name, dtype=dtype, device=device)


def pending_restore(trackable: Any) -> Optional[tuple]:
    """If a saveable factory is being called to plan a restore, says what.

    TensorFlow asks a trackable for its saveables both to save and to restore;
    only the restoring caller knows the checkpoint. We look one level up the
    stack for the `CheckpointPosition` that is restoring `trackable` and
    return `(checkpoint_key, saved_shape, saved_dtype)` of its
    `VARIABLE_VALUE` attribute, or None when this is not a restore.
    """
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return None
        position = frame.f_locals.get("self")
        if isinstance(position, CheckpointPosition):
            try:
                if position.trackable is not trackable:
                    return None
            except (AttributeError, KeyError):
                return None
            for attribute in position.object_proto.attributes:
                if attribute.name == VARIABLE_VALUE_KEY:
                    key = attribute.checkpoint_key
                    coordinator = position.checkpoint
                    return (key, coordinator.shape_map.get(key), coordinator.dtype_map.get(key))
            return None
    return None


def default_strategy_type() -> type:
    """The class of TensorFlow's default (no-scope) strategy."""
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib._DefaultDistributionStrategy


def ps_variable_partitioner(strategy) -> Any:
    """The `variable_partitioner` a ParameterServerStrategy was built with."""
    return strategy.extended._variable_partitioner


def ps_num_ps(strategy) -> int:
    """Number of parameter-server tasks of a ParameterServerStrategy."""
    return int(strategy.extended._num_ps)


def register_dispatchable_type(cls: type) -> type:
    """Lets `tf.experimental.dispatch_for_api` dispatch on a plain Python class.

    Only `CompositeTensor` subclasses are dispatchable out of the box; the
    public decorator accepts other classes but the C++ dispatcher skips them
    unless they are registered here.
    """
    from tensorflow.python.util import dispatch

    return dispatch.register_dispatchable_type(cls)
