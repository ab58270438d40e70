"""The one place where tf_sharded touches TensorFlow and Keras internals.

Everything imported from `tensorflow.python...` or `keras.src...`, and every
private attribute of a TensorFlow or Keras object that tf_sharded reads,
writes or overrides, is behind a named function or class here.
`tests/test_compat.py` exercises each one on both tested stacks (constraints/) and
fails loudly when an upgrade moves it; `tests/test_layout.py` fails when any
other module reaches for an internal.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, List, Optional, Tuple

import tensorflow as tf
from tensorflow.python.checkpoint import restore as _restore
from tensorflow.python.trackable import base as _trackable_base
from tensorflow.python.trackable import trackable_utils as _trackable_utils
from tensorflow.python.training.saving import saveable_object as _saveable_object

Trackable = _trackable_base.Trackable
VARIABLE_VALUE_KEY = _trackable_base.VARIABLE_VALUE_KEY
CheckpointPosition = _restore.CheckpointPosition


SaveableObject = _saveable_object.SaveableObject


def save_spec(tensor_fn: Callable[[], Any], slice_spec: str, name: str, dtype, device: str):
    """A lazily evaluated slice of a checkpoint entry."""
    return _saveable_object.SaveSpec(tensor_fn, slice_spec, name, dtype=dtype, device=device)


def _restoring_position(trackable: Any, depth: int) -> Any:
    """The `CheckpointPosition` up the stack (from `depth` frames up) that is restoring `trackable`, or None."""
    frame = sys._getframe(depth)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return None
        position = frame.f_locals.get("self")
        if isinstance(position, CheckpointPosition):
            try:
                return position if position.trackable is trackable else None
            except (AttributeError, KeyError):
                return None
    return None


def pending_restore(trackable: Any) -> Optional[tuple]:
    """If a saveable factory is being called to plan a restore, says what.

    TensorFlow asks a trackable for its saveables both to save and to restore;
    only the restoring caller knows the checkpoint. We look one level up the
    stack for the `CheckpointPosition` that is restoring `trackable` and
    return `(checkpoint_key, saved_shape, saved_dtype)` of its
    `VARIABLE_VALUE` attribute, or None when this is not a restore.
    """
    saved = restoring_attributes(trackable, depth=3)
    if saved is None or VARIABLE_VALUE_KEY not in saved:
        return None
    return saved[VARIABLE_VALUE_KEY]


def restoring_attributes(trackable: Any, depth: int = 2) -> Optional[dict]:
    """`{attribute: (checkpoint_key, saved_shape, saved_dtype)}` when TensorFlow is asking `trackable` for its
    tensors in order to restore it (a dynamic table declares the optimizer columns the checkpoint holds); else None.
    """
    position = _restoring_position(trackable, depth)
    if position is None:
        return None
    coordinator = position.checkpoint
    return {
        a.name: (
            a.checkpoint_key,
            coordinator.shape_map.get(a.checkpoint_key),
            coordinator.dtype_map.get(a.checkpoint_key),
        )
        for a in position.object_proto.attributes
    }


def leave_unconverted(package: str) -> None:
    """Tells autograph to call the functions of `package` as written, as it does Keras's and TensorFlow's own.

    The library writes its control flow with `tf.cond` and `tf.while_loop`
    where it depends on tensors, so converting its code only costs tracing
    time. Functions that the library's code calls run as written too, as
    when Keras's code calls them (Keras 3 converts no layer's `call`). A
    `tf.function`'s own body is converted whatever its module, unless it
    says `autograph=False` (as the table servers' functions do).
    """
    from tensorflow.python.autograph.core import config, config_lib

    if not any(isinstance(r, config_lib.DoNotConvert) and r._prefix == package for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config_lib.DoNotConvert(package),) + tuple(config.CONVERSION_RULES)


def converts(function) -> bool:
    """Whether autograph converts `function` when a traced function calls it."""
    from tensorflow.python.autograph.impl import conversion

    return not conversion.is_allowlisted(function)


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


def ps_num_workers(strategy) -> int:
    """Number of worker tasks of a ParameterServerStrategy."""
    return int(strategy.extended._num_workers)


def register_dispatchable_type(cls: type) -> type:
    """Lets `tf.experimental.dispatch_for_api` dispatch on a plain Python class.

    Only `CompositeTensor` subclasses are dispatchable out of the box; the
    public decorator accepts other classes but the C++ dispatcher skips them
    unless they are registered here.
    """
    from tensorflow.python.util import dispatch

    return dispatch.register_dispatchable_type(cls)


def ragged_embedding_targets() -> dict:
    """TF's own dispatch targets for RaggedTensor ids, by `tf.compat.v1.nn` embedding API.

    They match any params, so a second target matching tf_sharded tables
    would make the call ambiguous: `table.entry_points` replaces each with
    one target that routes by params.
    """
    from tensorflow.python.ops.ragged import ragged_embedding_ops as ragged

    return {
        tf.compat.v1.nn.embedding_lookup: ragged.embedding_lookup,
        tf.compat.v1.nn.embedding_lookup_sparse: ragged.embedding_lookup_sparse,
        tf.compat.v1.nn.safe_embedding_lookup_sparse: ragged.safe_embedding_lookup_sparse,
    }


# ----------------------------------------------------------------------------- distributed variables --


def _own_attribute(obj, name: str):
    """`obj.name` or None, never forwarded: a `DistributedValues` hands unknown attributes to a copy of its value,
    which for a mirrored variable in cross-replica context is a full read of it."""
    if isinstance(obj, tf.distribute.DistributedValues):
        return vars(obj).get(name)
    return getattr(obj, name, None)


def local_component(variable):
    """This replica's (or the primary) copy of a distributed variable; any other variable as it is.

    A `DistributedVariable` has no `sparse_read`, so `tf.gather` on it reads
    the whole variable; its component shares the handle the tape watches.
    """
    if isinstance(variable, tf.distribute.DistributedValues):
        return variable._get_on_device_or_primary()
    return variable


def distributed_container(component):
    """The distributed variable a per-replica component belongs to (TF keeps the link on it or its handle)."""
    for holder in (component, _own_attribute(component, "_handle")):
        container = _own_attribute(holder, "_distributed_container")
        if callable(container):
            return container()
    return None


def uses_merge_call(strategy) -> bool:
    """Whether a mirrored strategy's replicas meet in `merge_call` (every replica a device of this process)."""
    return bool(strategy.extended._use_merge_call())


def checkpoint_key(path: list) -> str:
    """The checkpoint key TensorFlow writes for the variable value of the object at `path` (names from the root)."""
    object_path = "/".join(_trackable_utils.escape_local_name(name) for name in path)
    return _trackable_utils.checkpoint_key(object_path, VARIABLE_VALUE_KEY)


# ------------------------------------------------------------------------------------------- Keras --


def keras_variable_value(variable):
    """The backend variable a Keras 3 variable wraps (None for anything else); never a read or a cast."""
    import keras

    if isinstance(variable, keras.Variable):
        return variable._value
    return None


@contextlib.contextmanager
def keras_weights_rollback(layer):
    """If the block raises, the Keras weights `layer` gained in it are untracked: creation is all or nothing.

    Keras 3 keeps a layer's own weights in `_trainable_variables` /
    `_non_trainable_variables` and removes one with `_untrack_variable`.
    """
    owned = lambda: list(layer._trainable_variables) + list(layer._non_trainable_variables)  # noqa: E731
    before = {id(v) for v in owned()}
    try:
        yield
    except BaseException:
        for variable in owned():
            if id(variable) not in before:
                layer._untrack_variable(variable)
        raise


def keras_untrack(layer, weights) -> None:
    """Removes `weights` from the Keras layer's own weights (as `keras_weights_rollback` does on failure)."""
    for weight in weights:
        layer._untrack_variable(weight)


@contextlib.contextmanager
def keras_unlocked(layer):
    """Lets a built Keras layer gain weights in the block (Keras locks a layer's `_tracker` once built;
    its own `enable_lora` unlocks it the same way)."""
    layer._tracker.unlock()
    try:
        yield
    finally:
        layer._tracker.lock()


def keras_track(owner, trackable, name: str) -> None:
    """Makes TensorFlow checkpoints follow `owner.<name>` (Keras's own containers hide what they hold)."""
    owner._track_trackable(trackable, name=name, overwrite=True)


def set_untracked(owner, name: str, value) -> None:
    """Sets an attribute that Keras's attribute tracking must not wrap or track."""
    object.__setattr__(owner, name, value)


def keras_register_trainable(optimizer, variable) -> None:
    """Lets a Keras optimizer accept gradients for `variable` without building Keras slots for it."""
    indices = optimizer._trainable_variables_indices
    indices[optimizer._var_key(variable)] = len(indices)


def keras_builds_before_tracing(model) -> bool:
    """Whether Keras's `model.fit` creates the model's, metrics' and optimizer's variables before tracing its
    step: it does so only for a model created in a distribution strategy's scope (`_maybe_symbolic_build`)."""
    return getattr(model, "_distribute_strategy", None) is not None


def keras_uses_weight_decay(optimizer, variable) -> bool:
    """Whether the optimizer's weight decay applies to `variable` (its exclusions honoured)."""
    return bool(optimizer._use_weight_decay(variable))


class KerasOptimizerHooks:
    """Mixin before a Keras 3 optimizer: whole-variable weight decay skips what `dense_decay_variables` leaves out."""

    def dense_decay_variables(self, variables):
        return variables

    def _apply_weight_decay(self, variables):
        return super()._apply_weight_decay(self.dense_decay_variables(variables))


def is_functional_or_sequential(model) -> bool:
    """Whether `model` is a Keras 3 Functional or Sequential model (which `keras.models.clone_model` can clone)."""
    import keras
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def tf_keras_layers_module():
    """`tf.keras.layers` as Keras 3 serves it under TensorFlow (None if it cannot be imported)."""
    import importlib

    try:
        return importlib.import_module("keras._tf_keras.keras.layers")
    except ImportError:
        return None


_KERAS_ROUTED = []


def route_keras_gradient_reduction(reduce_fn: Callable, update_fn: Callable) -> None:
    """Routes Keras 3 (TF backend) optimizers through tf_sharded for its shards.

    Keras sums replica gradients in `TFOptimizer._all_reduce_sum_gradients`
    (with `ReplicaContext.all_reduce`) and applies them in
    `_distributed_tf_update_step` (with `extended.update`, which only takes
    distributed variables). `reduce_fn(grads_and_vars, fallback)` takes over
    the first for tf_sharded shards; `update_fn(optimizer, distribution,
    grads_and_vars, learning_rate, fallback)` the second, for host-placed
    shards. Everything else is handed back to Keras.
    """
    if _KERAS_ROUTED:
        return
    from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer

    cls = keras_tf_optimizer.TFOptimizer
    original_reduce = cls._all_reduce_sum_gradients
    original_update = cls._distributed_tf_update_step

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return reduce_fn(list(grads_and_vars), fallback=lambda pairs: original_reduce(self, pairs))

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        return update_fn(
            self,
            distribution,
            list(grads_and_vars),
            learning_rate,
            fallback=lambda pairs: original_update(self, distribution, pairs, learning_rate),
        )

    cls._all_reduce_sum_gradients = _all_reduce_sum_gradients
    cls._distributed_tf_update_step = _distributed_tf_update_step
    _KERAS_ROUTED.append((original_reduce, original_update))


def keras_routing_installed() -> bool:
    """Whether `route_keras_gradient_reduction` has replaced Keras's two `TFOptimizer` methods in this process."""
    return bool(_KERAS_ROUTED)


def single_device(device: str) -> Any:
    """TF's marker that makes a mirrored strategy create a plain variable on `device`."""
    from tensorflow.python.distribute import numpy_dataset

    return numpy_dataset.SingleDevice(device)


def in_multi_worker_mode(strategy) -> bool:
    """Whether a mirrored strategy spans several workers."""
    return bool(strategy.extended._in_multi_worker_mode())


def cluster_workers(strategy) -> Tuple[int, List[str]]:
    """`(this worker's position, every worker's first device)` of a MultiWorkerMirroredStrategy, in its order
    of replicas: the chief first, then the workers by index (TensorFlow's `id_in_cluster`)."""
    me, replicas = cluster_replicas(strategy)
    local = len(strategy.extended.worker_devices)
    return me // local, replicas[::local]


def cluster_replicas(strategy) -> Tuple[int, List[str]]:
    """`(this worker's first replica, every replica's device)` of a MultiWorkerMirroredStrategy, in replica order.

    TensorFlow numbers replica `l` of the worker at position `w` (`id_in_cluster`:
    the chief first, then the workers by index) `w * L + l`, L the local
    replicas of a worker; like TensorFlow, this assumes every worker has as
    many local devices as this one.
    """
    extended = strategy.extended
    spec = extended._cluster_spec.as_dict() if extended._cluster_spec is not None else {}
    local = [tf.DeviceSpec.from_string(d) for d in extended.worker_devices]
    tasks = [("chief", i) for i in range(len(spec.get("chief", [])))]
    tasks += [("worker", i) for i in range(len(spec.get("worker", [])))]
    devices = [d.replace(job=job, replica=0, task=index).to_string() for job, index in tasks for d in local]
    devices = devices or list(extended.worker_devices)
    return int(extended._id_in_cluster) * len(local), devices


def collective_all_to_all(strategy, tensor: tf.Tensor) -> tf.Tensor:
    """`CollectiveAllToAllV2` of `tensor` among the replicas of a MultiWorkerMirroredStrategy, from a replica.

    `tensor[i]` (its first axis is the number of replicas, and every replica
    gives the same shape) goes to replica `i`; `result[i]` came from replica
    `i`. TensorFlow has this collective but no strategy method for it: it is
    issued on the strategy's own launcher for this replica (its group key,
    its next instance key, its ordering token and communication options), so
    it is ordered with the strategy's other collectives and no separate group
    is formed. On GPUs the options' NCCL hint selects NCCL's all-to-all.

    Several replicas of one worker trace into one graph, one after another
    from one `merge_call` to the next, and TensorFlow's automatic control
    dependencies order the ops of a graph that share a resource, or are
    stateful without one (assertions), in the order they were created, across
    replicas too. Traced in one stretch, a later replica's op before its
    all-to-all (an assertion on the keys) would wait for an earlier replica's
    op after it (an assertion on what it received), which waits for the later
    replica's all-to-all: the step never completes. The replicas therefore
    meet in a `merge_call` (trace time only, no op) just before the
    collective, which each replica then creates first after it: every op that
    waits for it is created after every replica's instance of it.
    """
    from tensorflow.python.ops import collective_ops

    ctx = tf.distribute.get_replica_context()
    if len(strategy.extended.worker_devices) > 1 and uses_merge_call(strategy):
        ctx.merge_call(lambda _: None)
    launcher = strategy.extended._cross_device_ops._launchers[_local_replica(strategy, ctx)]
    options = launcher._options
    with tf.device(launcher._device):
        return collective_ops.all_to_all_v2(
            tensor,
            launcher._group_size,
            launcher._group_key,
            launcher._next_instance_key(),
            communication_hint=options.implementation.value,
            timeout=options.timeout_seconds,
            ordering_token=launcher._get_ordering_token(),
        )


def _local_replica(strategy, ctx) -> int:
    """This replica's position among the replicas of its worker (its launcher's index)."""
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    return int(replica) - cluster_replicas(strategy)[0]


@contextlib.contextmanager
def outside_keras_stateless_scope():
    """Leaves Keras 3's StatelessScope for the duration of the block.

    Keras builds a subclassed model's layers inside a StatelessScope (while it
    computes output specs), where a new Keras variable is not created but
    deferred, and `.value` is only its initial value. Sharded tables must be
    real variables placed by the strategy hooks, so layers create them outside.
    """
    from keras.src.backend.common import global_state

    saved = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", saved)


def plain_variable(initial_value, name: str, trainable: bool, shape=None) -> tf.Variable:
    """A resource variable created without any strategy's variable creator (no mirroring, no ps placement).

    Dynamic tables hold their row pools in variables of unknown shape that
    grow in place; they are placed by `tf.device` and replicated (or not) by
    the table itself.
    """
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.ResourceVariable(
        initial_value=initial_value, name=name, trainable=trainable, shape=shape
    )


def keras_adopt_variable(weight, variable) -> None:
    """Makes the Keras variable `weight` stand for the existing tf.Variable `variable` (read, train, checkpoint)."""
    weight._value = variable


@contextlib.contextmanager
def increment_in_place(variable):
    """Inside the block, while tracing, `variable.assign_add(n)` (a Keras 3 variable: an optimizer's
    `iterations`) is one `AssignAddVariableOp` where the variable lives.

    Keras adds as `assign(self + n)`: a read where the variable lives, an add on the current device and an
    assign back. Under parameter servers, where the step runs on a worker and the counter lives on a ps, that
    is three crossings between them after every step's gradients, the last work of the step. Left to Keras
    when not tracing, inside Keras's StatelessScope (which records assignments instead of applying them), and
    for a distributed variable (mirrored copies).
    """
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    held = getattr(variable, "_value", None)
    if tf.executing_eagerly() or held is None or isinstance(held, tf.distribute.DistributedValues):
        yield
        return

    def assign_add(value):
        if in_stateless_scope():
            return type(variable).assign_add(variable, value)
        return held.assign_add(tf.cast(value, held.dtype))

    variable.assign_add = assign_add  # this instance only, for the block
    try:
        yield
    finally:
        del variable.assign_add


# ----------------------------------------------------------- cluster recovery --
# After a parameter server restarts, this client still holds handles to resources of the task that died.
# TensorFlow's coordinator recovers restarted *workers* by refreshing the eager context's view of the
# cluster; it treats a restarted ps as unrecoverable. `tf_sharded.keras.training.recovery` does the same refresh,
# then gives every variable, lookup table and critical section on the restarted task a new resource.


def task_alive(task: str) -> bool:
    """Whether `task` ("/job:ps/replica:0/task:1") answers this client."""
    from tensorflow.python.eager import context

    try:
        return bool(context.check_alive(task))
    except (tf.errors.OpError, ValueError):
        return False


def refresh_cluster() -> None:
    """Re-reads the cluster: tasks that restarted get a new remote context (as TF's coordinator does for a
    restarted worker)."""
    from tensorflow.python.eager import context

    context.context().update_server_def(context.get_server_def())


def remote_state() -> list:
    """Every live variable, lookup table and critical section of this process that holds a remote handle,
    as `(object, task)`, `task` like "/job:ps/replica:0/task:1"."""
    import gc

    from tensorflow.python.ops import critical_section_ops, resource_variable_ops
    from tensorflow.python.trackable import resource

    kinds = (
        resource_variable_ops.BaseResourceVariable,
        resource.CapturableResource,
        critical_section_ops.CriticalSection,
    )
    found = []
    for obj in gc.get_objects():
        if not isinstance(obj, kinds):
            continue
        handle = _remote_handle(obj)
        device = getattr(handle, "device", "") if handle is not None else ""
        if device.startswith("/job:"):
            found.append((obj, device.split("/device:")[0]))
    return found


def _remote_handle(obj):
    # The object's own handle: wrappers that delegate to a variable (a parameter server's
    # `CachingVariable`) pass isinstance checks but hold none, and must keep delegating.
    own = getattr(obj, "__dict__", {})
    handle = own.get("_resource_handle_value", own.get("_handle"))
    return handle if isinstance(handle, tf.__internal__.EagerTensor) else None


def local_table_default(table) -> None:
    """Keeps a lookup table's default value on this process. TF creates it as an eager tensor on the table's
    device, and a function captures it by value, reading it: on a task that restarted it is gone."""
    value = table._default_value.numpy()
    with tf.init_scope(), tf.device(None):  # None, not a partial spec: that would merge with the table's task
        table._default_value = tf.constant(value)


def renew_remote_state(obj) -> bool:
    """Gives `obj` (from `remote_state`) a new resource on its device. A variable is left uninitialised
    (restore or assign it next); a table is a new handle to the table of its name, empty on a restarted task.
    Returns whether `obj` is a variable."""
    from tensorflow.python.ops import critical_section_ops, gen_resource_variable_ops, resource_variable_ops

    old = _remote_handle(obj)
    with tf.device(old.device):
        if isinstance(obj, resource_variable_ops.BaseResourceVariable):
            handle = resource_variable_ops._variable_handle_from_shape_and_dtype(
                obj.shape, obj.dtype, shared_name=None, name=obj._handle_name.split(":")[0], graph_mode=False
            )
            for attr in ("_parent_trackable", "_name", "_unique_id"):
                if hasattr(old, attr):
                    setattr(handle, attr, getattr(old, attr))
            obj._handle = handle
            obj._cached_value = None
            return True
        if isinstance(obj, critical_section_ops.CriticalSection):
            obj._handle = gen_resource_variable_ops.mutex_v2(shared_name="", container="")
            obj._signature = (obj._signature[0], id(obj._handle), obj._signature[2])
            return False
        obj._resource_handle = obj._create_resource()
        return False


def write_summary_event(serialized: bytes) -> None:
    """Writes a serialized `Event` proto (a `SessionLog` among them, which `tf.summary` has no function for) with
    the default summary writer: TensorFlow's `import_event`."""
    from tensorflow.python.ops import summary_ops_v2

    summary_ops_v2.import_event(tf.constant(serialized))
