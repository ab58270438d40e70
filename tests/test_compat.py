"""Every name in `tf_sharded._compat`, exercised on real TensorFlow and Keras objects.

Each test fails loudly when an upgrade moves or changes the internal behind a
name. `test_every_compat_name_is_exercised` fails when a name is added to
`_compat` without a test here.
"""

import ast
import contextlib
import inspect
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness import strategies
from tf_sharded import _compat

EXERCISED = set()


def exercises(*names):
    EXERCISED.update(names)

    def mark(fn):
        return fn

    return mark


ROOT = pathlib.Path(__file__).resolve().parent.parent


def locked_versions(path: pathlib.Path) -> dict:
    """`{package: version}` of a constraints file's `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


class TestedStackTest(tf.test.TestCase):
    @exercises()
    def test_the_installed_releases_are_supported_and_a_tested_stack_is_installed_whole(self):
        from tf_sharded import versions

        self.assertTrue(versions.supported(tf.__version__, versions.TENSORFLOW), tf.__version__)
        self.assertTrue(versions.supported(keras.__version__, versions.KERAS), keras.__version__)
        stacks = {p.stem: locked_versions(p) for p in sorted((ROOT / "constraints").glob("*.txt"))}
        self.assertEqual(sorted(stacks), ["newest", "oldest"])
        # Each stack's TensorFlow and Keras are the ends of the supported ranges.
        self.assertEqual(stacks["oldest"]["tensorflow"], versions.TENSORFLOW[0])
        self.assertEqual(stacks["oldest"]["keras"], versions.KERAS[0])
        self.assertTrue(versions.supported(stacks["newest"]["tensorflow"], versions.TENSORFLOW))
        mine = [name for name, pins in stacks.items() if pins["tensorflow"] == tf.__version__]
        if not mine:
            self.skipTest(f"TensorFlow {tf.__version__} is supported but no tested stack's ({sorted(stacks)})")
        pins = stacks[mine[0]]
        installed = {"keras": keras.__version__, "numpy": np.__version__}
        self.assertEqual(installed, {k: pins[k] for k in installed}, f"constraints/{mine[0]}.txt")

    def test_an_unsupported_release_is_refused_at_import_with_the_range(self):
        from tf_sharded import versions

        with self.assertRaisesRegex(
            ImportError, r"supports TensorFlow >=2\.16\.2,<2\.22\. Received: TensorFlow 2\.15\.1\."
        ):
            versions.check("2.15.1", "3.15.1")
        with self.assertRaisesRegex(ImportError, r"supports Keras >=3\.12\.0,<4\. Received: Keras 3\.11\.3\."):
            versions.check("2.21.0", "3.11.3")
        with self.assertRaisesRegex(ImportError, r"Received: TensorFlow 2\.22\.0-dev20261101\."):
            versions.check("2.22.0-dev20261101", "3.15.1")
        versions.check("2.16.2", "3.12.0")
        versions.check("2.21.0", "3.15.1")


class CheckpointInternalsTest(tf.test.TestCase):
    @exercises("Trackable", "VARIABLE_VALUE_KEY", "CheckpointPosition", "SaveableObject", "save_spec")
    def test_trackable_and_saveable_classes(self):
        self.assertIs(_compat.Trackable, tf.__internal__.tracking.Trackable)
        self.assertEqual(_compat.VARIABLE_VALUE_KEY, "VARIABLE_VALUE")
        spec = _compat.save_spec(lambda: tf.zeros([2]), "4 0,2", "k", tf.float32, "/cpu:0")
        self.assertEqual((spec.slice_spec, spec.name, spec.dtype), ("4 0,2", "k", tf.float32))
        self.assertAllEqual(spec.tensor, [0.0, 0.0])
        saveable = _compat.SaveableObject(tf.zeros([2]), [spec], "k")
        self.assertEqual(saveable.name, "k")
        for attr in ("object_proto", "checkpoint", "trackable"):
            self.assertTrue(hasattr(_compat.CheckpointPosition, attr), attr)

    @exercises("pending_restore")
    def test_pending_restore_sees_the_checkpoint(self):
        seen = []
        original = _compat.pending_restore

        def spy(trackable):
            seen.append(original(trackable))
            return seen[-1]

        table = tfs.create_sharded_variable("compat_t", [6, 2], partitions=2)
        path = tf.train.Checkpoint(t=table).save(self.get_temp_dir() + "/c")
        self.assertIsNone(original(table))  # not restoring
        _compat.pending_restore = spy
        try:
            tf.train.Checkpoint(t=table).restore(path)
        finally:
            _compat.pending_restore = original
        self.assertIn(("t/.ATTRIBUTES/VARIABLE_VALUE", [6, 2], tf.float32), seen)

    @exercises("checkpoint_key")
    def test_checkpoint_key_matches_what_tensorflow_writes(self):
        root = tf.Module()
        root.sub = tf.Module()
        setattr(root.sub, "odd/name.x", tf.Variable([1.0]))
        path = tf.train.Checkpoint(model=root).save(self.get_temp_dir() + "/k")
        written = {name for name, _ in tf.train.list_variables(path)}
        self.assertIn(_compat.checkpoint_key(["model", "sub", "odd/name.x"]), written)


class DistributeInternalsTest(tf.test.TestCase):
    @exercises("default_strategy_type")
    def test_default_strategy_type(self):
        self.assertIs(type(tf.distribute.get_strategy()), _compat.default_strategy_type())
        self.assertNotEqual(_compat.default_strategy_type(), tf.distribute.MirroredStrategy)

    @exercises("register_dispatchable_type")
    def test_dispatch_registration(self):
        table = tfs.create_sharded_variable("compat_d", [6, 2], initializer="ones", partitions=3)
        self.assertAllEqual(tf.nn.embedding_lookup(table, [5]), [[1.0, 1.0]])

        class Plain:
            pass

        self.assertIs(_compat.register_dispatchable_type(Plain), Plain)

    @exercises("keras_untrack")
    def test_untracked_weights_leave_the_layer(self):
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        kernel, bias = layer.kernel, layer.bias
        _compat.keras_untrack(layer, [kernel])
        self.assertEqual([w.path for w in layer.weights], [bias.path])

    @exercises("keras_unlocked")
    def test_a_built_layer_gains_a_weight_only_while_unlocked(self):
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        with self.assertRaisesRegex(ValueError, "already built"):
            layer.add_weight(shape=(1,), name="late")
        with _compat.keras_unlocked(layer):
            layer.add_weight(shape=(1,), name="late")
        self.assertLen(layer.weights, 3)
        with self.assertRaisesRegex(ValueError, "already built"):  # locked again
            layer.add_weight(shape=(1,), name="later")

    @exercises("ragged_embedding_targets")
    def test_ragged_embedding_targets_are_tfs_own_dispatch_targets(self):
        import inspect

        for api, target in _compat.ragged_embedding_targets().items():
            self.assertTrue(callable(target))
            # The same arguments as the API they serve, so calls can be handed on positionally.
            self.assertEqual(list(inspect.signature(target).parameters), list(inspect.signature(api).parameters))
            # Replaced by one target per API in tf_sharded.table.entry_points: TF's own is no longer registered.
            with self.assertRaises(ValueError):
                tf.experimental.unregister_dispatch_for(target)
        # Ragged ids on other params still reach TF's target.
        plain = tf.Variable(np.arange(12.0, dtype=np.float32).reshape(4, 3))
        ids = tf.ragged.constant([[0, 3], [1]], dtype=tf.int64)
        self.assertAllEqual(tf.compat.v1.nn.embedding_lookup(plain, ids).flat_values, tf.gather(plain, [0, 3, 1]))

    @exercises("_own_attribute", "local_component", "distributed_container")
    def test_plain_variables_pass_through(self):
        v = tf.Variable([1.0])
        self.assertIs(_compat.local_component(v), v)
        self.assertIsNone(_compat.distributed_container(v))
        self.assertIsNone(_compat._own_attribute(v, "no_such_attribute"))


@pytest.mark.mirrored
class MirroredInternalsTest(tf.test.TestCase):
    @exercises("local_component", "distributed_container", "_own_attribute")
    def test_components_and_containers(self):
        strategy = strategies.mirrored()
        with strategy.scope():
            mirrored = tf.Variable([[1.0], [2.0]])
        component = _compat.local_component(mirrored)
        self.assertNotIsInstance(component, tf.distribute.DistributedValues)
        self.assertIn(component, mirrored.values)
        for each in mirrored.values:
            self.assertIs(_compat.distributed_container(each), mirrored)
        # Reading an unknown attribute never reads the variable through the container.
        self.assertIsNone(_compat._own_attribute(mirrored, "_handle"))

        @tf.function
        def in_replica():
            return strategy.run(lambda: tf.identity(_compat.local_component(mirrored).device))

        devices = strategy.experimental_local_results(in_replica())
        self.assertEqual([d.numpy().decode() for d in devices], [v.device for v in mirrored.values])

    @exercises("single_device")
    def test_single_device_places_a_plain_variable_under_mirrored(self):
        strategy = strategies.mirrored()

        def creator(next_creator, **kwargs):
            kwargs["colocate_with"] = _compat.single_device("/cpu:3")
            return next_creator(**kwargs)

        with strategy.scope(), tf.variable_creator_scope(creator):
            plain = tf.Variable([1.0])
        self.assertNotIsInstance(plain, tf.distribute.DistributedValues)
        self.assertEqual(tf.DeviceSpec.from_string(plain.device).device_index, 3)

    @exercises("uses_merge_call", "in_multi_worker_mode")
    def test_merge_call_and_multi_worker_mode(self):
        strategy = strategies.mirrored()
        self.assertTrue(_compat.uses_merge_call(strategy))
        self.assertFalse(_compat.in_multi_worker_mode(strategy))


class ParameterServerInternalsTest(tf.test.TestCase):
    @exercises("ps_variable_partitioner", "ps_num_ps", "ps_num_workers")
    def test_ps_extended_attributes(self):
        # A real strategy needs a cluster connection (last in the suite); the
        # constructor's source is what these two names read, so guard that.
        from tensorflow.python.distribute import parameter_server_strategy_v2 as ps

        init_src = inspect.getsource(ps.ParameterServerStrategyV2Extended.__init__)
        self.assertIn("self._variable_partitioner = variable_partitioner", init_src)
        self.assertIn("self._num_ps", init_src)
        self.assertIn("self._num_workers", init_src)
        # Shards rely on the PS creator honouring `colocate_with` (and not partitioning).
        self.assertIn(
            '"colocate_with" in kwargs', inspect.getsource(ps.ParameterServerStrategyV2Extended._create_variable)
        )


@pytest.mark.ps_cluster
class ParameterServerClusterTest(tf.test.TestCase):
    @exercises("ps_variable_partitioner", "ps_num_ps")
    def test_on_a_real_strategy(self):
        cluster = tfs.cluster.local_cluster(num_workers=2, num_ps=2)  # the process's one in-process cluster
        partitioner = tfs.partitioners.FixedShards(3)
        strategy = cluster.strategy(variable_partitioner=partitioner)
        self.assertEqual(_compat.ps_num_ps(strategy), 2)
        self.assertEqual(_compat.ps_num_workers(strategy), 2)
        self.assertIs(_compat.ps_variable_partitioner(strategy), partitioner)

    @exercises("task_alive", "refresh_cluster", "remote_state", "renew_remote_state", "local_table_default")
    def test_renewing_the_resources_of_a_ps(self):
        # Renewing on a live task gives the same objects new, empty resources there, as after a restart.
        strategy = tfs.cluster.local_cluster(num_workers=2, num_ps=2).strategy()
        self.assertTrue(_compat.task_alive("/job:ps/replica:0/task:1"))
        with strategy.scope():
            v = tf.Variable(tf.ones([3]), name="renewed_v")
        device = v.device.split("/device:")[0]
        with tf.device(device):
            table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default_value=-1)
            table.insert(tf.constant([7], tf.int64), tf.constant([1], tf.int64))
            lock = tf.CriticalSection(name="renewed_lock")
        self.assertTrue(table._default_value.device.startswith(device))
        _compat.local_table_default(table)
        self.assertFalse(table._default_value.device.startswith("/job:ps"))
        _compat.refresh_cluster()
        found = {id(obj): task for obj, task in _compat.remote_state()}
        self.assertEqual(found.get(id(v._v if hasattr(v, "_v") else v)), device)  # the variable itself, not a wrapper
        self.assertEqual((found.get(id(table)), found.get(id(lock))), (device, device))
        inner = v._v if hasattr(v, "_v") else v
        self.assertTrue(_compat.renew_remote_state(inner))
        self.assertFalse(bool(inner.is_initialized()))
        v.assign([1.0, 2.0, 3.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        self.assertAllEqual(tape.gradient(loss, v), [2.0, 4.0, 6.0])  # reads and the tape meet on the new handle
        old_handle = table.resource_handle
        self.assertFalse(_compat.renew_remote_state(table))
        self.assertIsNot(table.resource_handle, old_handle)
        table.insert(tf.constant([8], tf.int64), tf.constant([2], tf.int64))  # TF shares a table by its name on a
        self.assertAllEqual(table.lookup(tf.constant([8], tf.int64)), [2])  # task: empty only on a restarted one
        self.assertAllEqual(tf.function(lambda: table.lookup(tf.constant([9], tf.int64)))(), [-1])
        self.assertFalse(_compat.renew_remote_state(lock))
        self.assertAllEqual(lock.execute(lambda: tf.constant(5)), 5)


class KerasInternalsTest(tf.test.TestCase):
    @exercises("keras_variable_value")
    def test_keras_variable_value(self):
        variable = keras.Variable(np.ones([2, 2], np.float32))
        self.assertIsInstance(_compat.keras_variable_value(variable), tf.Variable)
        self.assertIsNone(_compat.keras_variable_value(tf.Variable(1.0)))

    @exercises("keras_track")
    def test_keras_track_puts_hidden_objects_in_checkpoints(self):
        layer = keras.layers.Layer()
        hidden = {"v": tf.Variable([3.0])}
        layer.hidden = hidden
        _compat.keras_track(layer, hidden["v"], "hidden_v")
        path = tf.train.Checkpoint(layer=layer).save(self.get_temp_dir() + "/t")
        names = [n for n, _ in tf.train.list_variables(path)]
        self.assertIn("layer/hidden_v/.ATTRIBUTES/VARIABLE_VALUE", names)

    @exercises("set_untracked")
    def test_set_untracked_skips_keras_tracking(self):
        layer = keras.layers.Layer()
        _compat.set_untracked(layer, "side", [tf.Variable([1.0])])
        layer.tracked = [tf.Variable([2.0])]
        self.assertIs(type(layer.side), list)
        self.assertIsNot(type(layer.tracked), list)  # Keras wraps what it tracks

    @exercises("keras_register_trainable")
    def test_register_trainable_lets_apply_gradients_accept_a_variable(self):
        optimizer = keras.optimizers.SGD(0.5)
        built = keras.Variable(np.zeros([1], np.float32))
        optimizer.build([built])
        extra = tf.Variable([1.0])
        _compat.keras_register_trainable(optimizer, extra)
        self.assertIn(optimizer._var_key(extra), optimizer._trainable_variables_indices)

    @exercises("keras_builds_before_tracing")
    def test_keras_builds_before_tracing_only_in_a_strategys_scope(self):
        traces = []

        class Counted(keras.Sequential):
            def train_step(self, data):
                traces.append(1)  # runs once per trace of the step
                return super().train_step(data)

        def traced_fit(scope):
            traces.clear()
            with scope:
                model = Counted([keras.Input([2]), keras.layers.Dense(1)])
                model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
            model.fit(np.ones([4, 2], np.float32), np.ones([4, 1], np.float32), batch_size=2, verbose=0)
            return model, len(traces)

        outside, count = traced_fit(contextlib.nullcontext())
        self.assertFalse(_compat.keras_builds_before_tracing(outside))
        self.assertEqual(count, 2)  # Adam's slots made in the first trace: traced again
        inside, count = traced_fit(tf.distribute.OneDeviceStrategy("/cpu:0").scope())
        self.assertTrue(_compat.keras_builds_before_tracing(inside))
        self.assertEqual(count, 1)

    @exercises("keras_uses_weight_decay", "KerasOptimizerHooks")
    def test_weight_decay_hooks(self):
        class Hooked(_compat.KerasOptimizerHooks, keras.optimizers.AdamW):
            def dense_decay_variables(self, variables):
                return [v for v in variables if v.name != "skip"]

        optimizer = Hooked(learning_rate=0.0, weight_decay=0.5)
        keep = keras.Variable(np.ones([2], np.float32), name="keep")
        skip = keras.Variable(np.ones([2], np.float32), name="skip")
        optimizer.exclude_from_weight_decay(var_names=["nothing"])
        self.assertTrue(_compat.keras_uses_weight_decay(optimizer, keep))
        optimizer.apply_gradients([(tf.zeros([2]), keep), (tf.zeros([2]), skip)])
        # lr 0 leaves Adam's step at zero; decay is applied as v -= v * wd * lr == 0 too, so use lr > 0:
        optimizer.learning_rate.assign(0.1)
        optimizer.apply_gradients([(tf.zeros([2]), keep), (tf.zeros([2]), skip)])
        self.assertAllClose(keep.numpy(), [1 - 0.1 * 0.5] * 2)
        self.assertAllClose(skip.numpy(), [1.0, 1.0])
        excluded = keras.optimizers.AdamW(weight_decay=0.5)
        excluded.exclude_from_weight_decay(var_names=["keep"])
        self.assertFalse(_compat.keras_uses_weight_decay(excluded, keep))

    @exercises("is_functional_or_sequential")
    def test_model_kinds(self):
        inputs = keras.Input([2])
        functional = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        self.assertTrue(_compat.is_functional_or_sequential(functional))
        self.assertTrue(_compat.is_functional_or_sequential(keras.Sequential([keras.layers.Dense(1)])))

        class Sub(keras.Model):
            def call(self, x):
                return x

        self.assertFalse(_compat.is_functional_or_sequential(Sub()))

    @exercises("tf_keras_layers_module")
    def test_tf_keras_layers_module_is_what_tf_keras_serves(self):
        module = _compat.tf_keras_layers_module()
        self.assertIs(module.Embedding, tf.keras.layers.Embedding)

    @exercises("route_keras_gradient_reduction", "_KERAS_ROUTED", "keras_routing_installed")
    def test_keras_optimizer_steps_are_routed_once(self):
        from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer

        cls = keras_tf_optimizer.TFOptimizer
        tfs.create_sharded_variable("routed_probe", shape=(4, 2))  # a table installs the routing, if none yet has
        self.assertTrue(_compat.keras_routing_installed())
        self.assertLen(_compat._KERAS_ROUTED, 1)
        original_reduce, original_update = _compat._KERAS_ROUTED[0]
        self.assertEqual(list(inspect.signature(original_reduce).parameters), ["self", "grads_and_vars"])
        self.assertEqual(
            list(inspect.signature(original_update).parameters),
            ["self", "distribution", "grads_and_vars", "learning_rate"],
        )
        self.assertIsNot(cls._all_reduce_sum_gradients, original_reduce)
        _compat.route_keras_gradient_reduction(None, None)  # idempotent
        self.assertLen(_compat._KERAS_ROUTED, 1)
        self.assertTrue(hasattr(cls, "update_step"))

    @exercises("outside_keras_stateless_scope")
    def test_keras_stateless_scope_is_left_for_table_creation(self):
        from keras.src.backend.common.stateless_scope import in_stateless_scope

        with keras.StatelessScope():
            with _compat.outside_keras_stateless_scope():
                self.assertFalse(in_stateless_scope())
                inside = keras.Variable(1.0)
            self.assertTrue(in_stateless_scope())
        self.assertIsInstance(inside.value, tf.Variable)  # created for real, not deferred

    @exercises("keras_weights_rollback")
    def test_weights_added_in_a_failing_block_leave_the_layer(self):
        layer = keras.layers.Layer()
        layer.add_weight(shape=(1,), name="kept")
        kept = [v.path for v in layer.weights]
        with self.assertRaisesRegex(RuntimeError, "boom"):
            with _compat.keras_weights_rollback(layer):
                layer.add_weight(shape=(2,), name="extra")
                layer.add_weight(shape=(2,), name="frozen", trainable=False)
                raise RuntimeError("boom")
        self.assertEqual([v.path for v in layer.weights], kept)
        with _compat.keras_weights_rollback(layer):
            layer.add_weight(shape=(2,), name="extra")
        self.assertLen(layer.weights, 2)


@exercises("leave_unconverted", "converts")
def test_autograph_leaves_the_librarys_code_as_written_and_converts_the_users():
    from tf_sharded.table.lookup import lookup_many

    def users(x):
        if x > 0:  # a tensor's condition: autograph makes it a tf.cond
            return x
        return -x

    assert not _compat.converts(lookup_many)
    assert not _compat.converts(tfs.layers.Embedding(4, 2).call)
    assert _compat.converts(users)
    _compat.leave_unconverted("tf_sharded")  # again: no change
    assert not _compat.converts(lookup_many) and _compat.converts(users)

    embedding = tfs.layers.Embedding(4, 1, embeddings_initializer="ones")

    @tf.function
    def step(ids, x):
        return users(tf.reduce_sum(embedding(ids)) - x)

    assert np.allclose(step(tf.constant([2]), tf.constant(3.0)), 2.0)  # |1 - 3|: the user's `if`, a tf.cond


def test_every_compat_name_is_exercised():
    tree = ast.parse(pathlib.Path(_compat.__file__).read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name) and not t.id.startswith("_restore"))
    defined -= {n for n in defined if n.startswith("_") and n not in ("_own_attribute", "_KERAS_ROUTED")}
    missing = sorted(defined - EXERCISED)
    assert not missing, f"_compat names with no test in tests/test_compat.py: {missing}"


@exercises("cluster_workers")
def test_cluster_workers_orders_the_chief_first():
    """The order of TensorFlow's `id_in_cluster` on a cluster spec with a chief; `test_multi_worker` checks a
    real two-worker MultiWorkerMirroredStrategy's attributes with it."""
    from types import SimpleNamespace

    spec = tf.train.ClusterSpec({"worker": ["w0:1", "w1:1"], "chief": ["c:1"]})
    extended = SimpleNamespace(
        _cluster_spec=spec, _id_in_cluster=2, worker_devices=("/job:worker/replica:0/task:1/device:CPU:0",)
    )
    me, devices = _compat.cluster_workers(SimpleNamespace(extended=extended))
    assert me == 2
    assert devices == [
        "/job:chief/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
    ]
    local = SimpleNamespace(_cluster_spec=None, _id_in_cluster=0, worker_devices=("/device:CPU:0",))
    assert _compat.cluster_workers(SimpleNamespace(extended=local)) == (0, ["/device:CPU:0"])


@exercises("cluster_replicas")
def test_cluster_replicas_numbers_each_workers_local_replicas_after_the_workers_before_it():
    """TensorFlow's replica numbering with two local devices per worker (`_get_replica_id_in_sync_group`);
    `test_multi_worker` runs such a cluster."""
    from types import SimpleNamespace

    spec = tf.train.ClusterSpec({"worker": ["w0:1", "w1:1"]})
    local = ("/job:worker/replica:0/task:1/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:1")
    strategy = SimpleNamespace(extended=SimpleNamespace(_cluster_spec=spec, _id_in_cluster=1, worker_devices=local))
    first, devices = _compat.cluster_replicas(strategy)
    assert first == 2
    assert devices == [f"/job:worker/replica:0/task:{t}/device:GPU:{g}" for t in (0, 1) for g in (0, 1)]
    assert _compat.cluster_workers(strategy) == (1, devices[::2])


ALL_TO_ALL = """
import numpy as np, tensorflow as tf
from tests.harness.strategies import multi_worker_with_local_replicas

strategy = multi_worker_with_local_replicas(3)
from tf_sharded import _compat

replicas = strategy.num_replicas_in_sync
assert replicas == 3, replicas


@tf.function
def step():
    def fn():
        ctx = tf.distribute.get_replica_context()
        me = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        sent = 10.0 * me + tf.reshape(tf.range(2 * replicas, dtype=tf.float32), [replicas, 2])  # row i to replica i
        before = ctx.all_reduce("SUM", me)
        # Assertions on what is sent and what arrives: stateful ops, which TensorFlow runs in the order the
        # replicas traced them, one replica after another.
        with tf.control_dependencies([tf.debugging.assert_non_negative(sent)]):
            got = _compat.collective_all_to_all(strategy, tf.identity(sent))
        with tf.control_dependencies([tf.debugging.assert_non_negative(got)]):
            got = tf.identity(got)
        return got, ctx.all_reduce("SUM", before + got[0, 0])

    return strategy.run(fn)


for _ in range(2):  # a second call takes new instance keys
    got, after = step()
    for r, rows in enumerate(strategy.experimental_local_results(got)):
        want = np.array([[10 * s + 2 * r, 10 * s + 2 * r + 1] for s in range(replicas)])
        assert np.array_equal(rows.numpy(), want), (r, rows.numpy(), want)
    assert [float(a) for a in strategy.experimental_local_results(after)] == [3 * 3.0 + 0 + 2 + 4] * 3
print("ALL TO ALL OK")
"""


@exercises("collective_all_to_all")
@pytest.mark.slow
@pytest.mark.processes(cost=12)
def test_collective_all_to_all_exchanges_rows_among_the_strategys_replicas():
    """Row `i` of each replica's tensor reaches replica `i`, between two all-reduces of the strategy's own
    group and between assertions on each replica's tensors (which a replica traced after another must not
    wait for); three replicas of one worker (logical CPUs standing in for its GPUs), traced. `test_multi_worker`
    runs it across two workers inside sharded lookups."""
    from tests.harness.subprocs import run_python

    done = run_python(["-c", ALL_TO_ALL], timeout=240)
    assert done.returncode == 0 and "ALL TO ALL OK" in done.stdout, done.stdout + done.stderr[-3000:]


@exercises("plain_variable")
def test_plain_variable_skips_the_strategy_creator():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        v = _compat.plain_variable(tf.zeros([2, 3]), name="plain", trainable=True, shape=tf.TensorShape(None))
    assert type(v).__name__ == "ResourceVariable"
    v.assign(tf.ones([5, 3]))
    assert v.numpy().shape == (5, 3)


@exercises("keras_adopt_variable")
def test_keras_adopt_variable():
    inner = tf.Variable(tf.ones([2, 2]), shape=tf.TensorShape(None))
    weight = keras.Variable(initializer="zeros", shape=(0, 2), name="adopted")
    _compat.keras_adopt_variable(weight, inner)
    assert weight.value is inner
    inner.assign(tf.ones([4, 2]))
    assert weight.numpy().shape == (4, 2)


@exercises("restoring_attributes")
def test_restoring_attributes_sees_the_checkpoint_being_restored():
    seen = []

    class Probe(_compat.Trackable):
        def _serialize_to_tensors(self):
            seen.append(_compat.restoring_attributes(self))
            return {"a": tf.constant([1.0, 2.0]), "b": tf.constant(3, tf.int64)}

        def _restore_from_tensors(self, restored_tensors):
            return None

    path = tf.train.Checkpoint(p=Probe()).write("/tmp/tfs_compat_restoring/ck")
    tf.train.Checkpoint(p=Probe()).read(path)
    assert seen[0] is None
    restored = seen[-1]
    assert sorted(restored) == ["a", "b"]
    assert restored["a"][1] == [2] and restored["b"][2] == tf.int64


@exercises("increment_in_place")
def test_increment_in_place_is_one_op_while_tracing():
    counter = keras.Variable(0, dtype="int64", trainable=False, name="counter")

    def op_types(fn):
        return [op.type for op in tf.function(fn).get_concrete_function().graph.get_operations()]

    # Keras's own increment reads, adds and assigns; inside the block, one AssignAddVariableOp.
    keras_types = op_types(lambda: counter.assign_add(1))
    assert "AssignVariableOp" in keras_types and "AssignAddVariableOp" not in keras_types

    @tf.function
    def bump():
        with _compat.increment_in_place(counter):
            counter.assign_add(1)

    types = [op.type for op in bump.get_concrete_function().graph.get_operations()]
    assert "AssignAddVariableOp" in types and "AssignVariableOp" not in types
    bump()
    bump()
    assert int(counter.numpy()) == 2
    assert "assign_add" not in vars(counter)  # the instance is as it was
    with _compat.increment_in_place(counter):  # eagerly: Keras's own increment
        counter.assign_add(1)
    assert int(counter.numpy()) == 3

    @tf.function
    def recorded():  # inside Keras's StatelessScope the increment is recorded, not applied
        with keras.StatelessScope() as scope, _compat.increment_in_place(counter):
            counter.assign_add(5)
        return scope.get_current_value(counter)

    assert int(recorded().numpy()) == 8
    assert int(counter.numpy()) == 3


@exercises("write_summary_event")
def test_write_summary_event_writes_the_event_as_given(tmp_path):
    from tensorboard.compat.proto import event_pb2

    event = event_pb2.Event(step=7, wall_time=1.5)
    event.session_log.status = event_pb2.SessionLog.START
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        _compat.write_summary_event(event.SerializeToString())
    writer.close()
    (path,) = tmp_path.iterdir()
    written = [e for e in tf.compat.v1.train.summary_iterator(str(path)) if e.HasField("session_log")]
    assert [(e.step, e.session_log.status) for e in written] == [(7, event_pb2.SessionLog.START)]
