"""Keras 3 under ParameterServerStrategy: tfs.fit, sparse optimizers, graph check, checkpoints across clusters."""

import contextlib
import io
import os
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.graphs import ROW_OPS, handle_uses
from tests.harness.models import (
    IDS,
    LABELS,
    ROWS,
    assert_matches_lora_reference,
    make_lora_model,
    make_model,
    single_device_reference,
)
from tests.harness.serving import serve_elsewhere
from tests.harness.strategies import ps_strategy
from tests.harness.subprocs import run_python
from tf_sharded.keras import quantized
from tf_sharded.keras.training import checkpoints

pytestmark = pytest.mark.ps_cluster

# Rebuilds the model on a 3-ps process cluster, restores, prints the logical table and slot checksums.
RESTORE_ON_3_PS = """
import sys, numpy as np, keras, tensorflow as tf, tf_sharded as tfs
from tests.harness.models import make_model
with tfs.cluster.LocalCluster(num_workers=1, num_ps=3, mode="process") as cluster:
    strategy = cluster.strategy()
    with strategy.scope():
        model = make_model(partitions=None)
        model.optimizer.build(model.trainable_variables)
    emb = model.get_layer("emb").embeddings
    assert emb.num_shards == 3, emb
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(sys.argv[1]).assert_existing_objects_matched()
    np.save(sys.argv[2] + "/table.npy", emb.numpy())
    np.save(sys.argv[2] + "/momentum.npy", model.optimizer.table_slot(emb, "momentum").numpy())
    print("devices", sorted({v.device for v in model.optimizer.table_slot(emb, "momentum").variables}))
"""


def dataset_fn(input_context=None):
    # One fixed batch: whichever worker runs a step, the sequence of updates is the same.
    return tf.data.Dataset.from_tensors((IDS, LABELS)).repeat()


class KerasParameterServerTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()

    @pytest.mark.slow  # over 5 s here
    def test_fit_matches_single_device_keras_and_checkpoints_restore_elsewhere(self):
        with self.strategy.scope():
            model = make_model()
        emb = model.get_layer("emb").embeddings
        self.assertEqual({tf.DeviceSpec.from_string(d).job for d in emb.devices}, {"ps"})
        table0 = emb.numpy()
        ckpt_dir = os.path.join(self.get_temp_dir(), "fit")
        steps = 6
        history = tfs.fit(
            model, dataset_fn, epochs=2, steps_per_epoch=steps // 2, checkpoint_dir=ckpt_dir, verbose=0, log_every=1
        )
        losses = history.history["loss"]
        self.assertLess(losses[-1], losses[0])
        slots = model.optimizer.table_slot(emb, "momentum")
        self.assertEqual(slots.devices, emb.devices)  # each slot shard beside its shard

        ref_table, ref_kernel = single_device_reference(table0, steps)
        self.assertAllClose(emb.numpy(), ref_table, atol=1e-5)
        self.assertAllClose(model.get_layer("dense").kernel.numpy(), ref_kernel, atol=1e-5)
        self.assertEqual(int(model.optimizer.iterations.numpy()), steps)

        latest = tf.train.latest_checkpoint(ckpt_dir)
        self.assertTrue(latest.endswith(f"ckpt-{steps}"), latest)
        momentum = slots.numpy()
        self.assertGreater(np.abs(momentum).sum(), 0)

        # Single device (default strategy), one shard: table and optimizer state.
        local = make_model(partitions=1)
        local.optimizer.build(local.trainable_variables)
        tf.train.Checkpoint(model=local, optimizer=local.optimizer).restore(latest).assert_existing_objects_matched()
        local_emb = local.get_layer("emb").embeddings
        self.assertAllEqual(local_emb.numpy(), emb.numpy())
        self.assertAllEqual(local.optimizer.table_slot(local_emb, "momentum").numpy(), momentum)

        # Three parameter servers, in another process.
        out_dir = self.get_temp_dir()
        proc = run_python(["-c", RESTORE_ON_3_PS, latest, out_dir], timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("task:2", proc.stdout)
        self.assertAllEqual(np.load(out_dir + "/table.npy"), emb.numpy())
        self.assertAllEqual(np.load(out_dir + "/momentum.npy"), momentum)

        # Exported from the cluster, served by a process without tf_sharded.
        exported = tfs.export(model, os.path.join(self.get_temp_dir(), "export"))
        served = serve_elsewhere(self, exported, {"ids": IDS.astype(np.int64)})
        self.assertAllClose(served, model(tf.constant(IDS)).numpy(), atol=1e-6)

        # A rerun resumes from the checkpoint: nothing left to do for the same epochs.
        again = tfs.fit(model, dataset_fn, epochs=2, steps_per_epoch=steps // 2, checkpoint_dir=ckpt_dir, verbose=0)
        self.assertEqual(again.history, {})
        self.assertEqual(int(model.optimizer.iterations.numpy()), steps)

    def test_fit_resumes_checkpoints_written_under_the_default_strategy(self):
        # tfs.fit's checkpoints under the default strategy (step copied from Keras's count), and one written
        # without the step entry (plain tf.train.Checkpoint): parameter servers resume both, 3 steps on to 6.
        for with_step in (True, False):
            ckpt_dir = os.path.join(self.get_temp_dir(), f"from_default_{with_step}")
            local = make_model(partitions=1)
            table0 = local.get_layer("emb").embeddings.numpy()
            if with_step:
                tfs.fit(local, dataset_fn(), epochs=1, steps_per_epoch=3, checkpoint_dir=ckpt_dir, verbose=0)
                written = tf.train.load_checkpoint(tf.train.latest_checkpoint(ckpt_dir))
                self.assertEqual(written.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE"), 3)
            else:
                tfs.fit(local, dataset_fn(), epochs=1, steps_per_epoch=3, verbose=0)
                tf.train.Checkpoint(model=local, optimizer=local.optimizer).save(os.path.join(ckpt_dir, "ckpt"))
            with self.strategy.scope():
                model = make_model()
            # log_every=1: each step is waited for, so no two overlap on the two workers.
            history = tfs.fit(model, dataset_fn, epochs=2, steps_per_epoch=3, checkpoint_dir=ckpt_dir, verbose=0,
                              log_every=1)  # fmt: skip
            self.assertEqual((history.initial_step, tfs.training.steps_done(model)), (3, 6))
            ref_table, _ = single_device_reference(table0, 6)
            embeddings = model.get_layer("emb").embeddings.numpy()
            self.assertAllClose(embeddings, ref_table, atol=1e-5, msg=f"with_step={with_step}")

    @pytest.mark.slow  # over 4 s
    def test_lora_trains_its_factors_on_the_shards_and_matches_keras_lora(self):
        with self.strategy.scope():
            model, table0, a0, b0 = make_lora_model()
        layer = model.get_layer("emb")
        self.assertEqual(layer.lora_embeddings_a.devices, layer._table.devices)  # A sharded as the table
        self.assertLen(model.trainable_weights, 2 + 1 + 2)  # A's shards, B, the dense layer's kernel and bias
        # One step at a time (log_every=1 waits for each): the serial reference's sequence of updates.
        tfs.fit(model, dataset_fn, epochs=1, steps_per_epoch=4, verbose=0, log_every=1)
        assert_matches_lora_reference(self, model, table0, a0, b0, 4)
        # Served without tf_sharded: the rows with their LoRA term.
        exported = tfs.export(model, os.path.join(self.get_temp_dir(), "lora_export"))
        served = serve_elsewhere(self, exported, {"ids": IDS.astype(np.int64)})
        self.assertAllClose(served, model(tf.constant(IDS)).numpy(), atol=1e-6)

    def test_quantization_keeps_rows_scales_and_zero_points_on_the_table_shards(self):
        for mode in ("int8", "int4"):
            with self.strategy.scope():
                model = make_model(partitions=None)
            layer = model.get_layer("emb")
            devices, table = layer._table.devices, layer._table.numpy()
            want = model(tf.constant(IDS)).numpy()
            layer.quantize(mode)  # outside the scope: the new shards still go where the table's were
            self.assertEqual(layer._table.devices, devices)
            self.assertEqual(layer.embeddings_scale.devices, devices)
            if mode == "int8":
                scale = 127.0 / (np.abs(table).max(axis=1) + keras.config.epsilon())
                self.assertAllEqual(layer._table.numpy(), np.round(table * scale[:, None]).astype(np.int8))
                self.assertAllClose(model(tf.constant(IDS)), want, atol=0.01)
            else:  # Keras's default int4, packed: a scale and a zero point per row (one group); before 3.14 a scale
                if quantized.keras_groups_int4():
                    self.assertEqual(layer.embeddings_zero.devices, devices)
                else:
                    self.assertFalse(hasattr(layer, "embeddings_zero"))
                self.assertEqual(layer._table.shape.as_list(), [ROWS, (table.shape[1] + 1) // 2])
                self.assertAllClose(model(tf.constant(IDS)), want, atol=0.05)

    def test_saves_trace_once_and_keep_the_last_three(self):
        with self.strategy.scope():
            model = make_model()
        ckpt_dir = os.path.join(self.get_temp_dir(), "saves")
        logger = tf.get_logger()
        traced = []
        write = checkpoints._write

        def counted(checkpoint, prefix):  # runs when a writer is traced
            traced.append(prefix)
            return write(checkpoint, prefix)

        with self.assertLogs(logger, level="WARNING") as logged, mock.patch.object(checkpoints, "_write", counted):
            tfs.fit(model, dataset_fn, epochs=1, steps_per_epoch=7, checkpoint_dir=ckpt_dir, checkpoint_every=1,
                    verbose=0, log_every=1)  # fmt: skip
            logger.warning("end of fit")  # assertLogs needs one record
        self.assertEqual([r.getMessage() for r in logged.records if "retracing" in r.getMessage()], [])
        self.assertLen(traced, 1)  # 8 saves (steps 0 to 7), one trace
        state = tf.train.get_checkpoint_state(ckpt_dir)
        self.assertEqual(state.all_model_checkpoint_paths, [os.path.join(ckpt_dir, f"ckpt-{n}") for n in (5, 6, 7)])
        self.assertEqual(sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".index")),
                         ["ckpt-5.index", "ckpt-6.index", "ckpt-7.index"])  # fmt: skip
        local = make_model(partitions=1)
        local.optimizer.build(local.trainable_variables)
        restored = tf.train.Checkpoint(model=local, optimizer=local.optimizer)
        restored.restore(state.model_checkpoint_path).assert_existing_objects_matched()
        self.assertAllEqual(local.get_layer("emb").embeddings.numpy(), model.get_layer("emb").embeddings.numpy())

    def test_checkpoint_secs_saves_by_time(self):
        with self.strategy.scope():
            model = make_model()
        ckpt_dir = os.path.join(self.get_temp_dir(), "by_time")
        # The checkpoint state file is written without TF's deprecated writer (a warning on every run).
        deprecated = AssertionError("tf.compat.v1.train.update_checkpoint_state called")
        with mock.patch.object(tf.compat.v1.train, "update_checkpoint_state", side_effect=deprecated):
            tfs.fit(model, dataset_fn, epochs=1, steps_per_epoch=7, checkpoint_dir=ckpt_dir, checkpoint_every=100,
                    checkpoint_secs=1e-6, verbose=0, log_every=100)  # fmt: skip
        # Due after every step by time (not by checkpoint_every, nor only at the epoch end): the last three kept.
        state = tf.train.get_checkpoint_state(ckpt_dir)
        self.assertEqual(state.all_model_checkpoint_paths, [os.path.join(ckpt_dir, f"ckpt-{n}") for n in (5, 6, 7)])

    @pytest.mark.slow  # over 4 s
    def test_a_failing_step_counts_nowhere_and_applies_nothing(self):
        with self.strategy.scope():
            model = make_model()
        emb = model.get_layer("emb").embeddings
        table0 = emb.numpy()
        bad = IDS.copy()
        bad[1, 2] = ROWS + 5  # out of range: the step's lookup fails before any update

        def four_good_then_bad(input_context=None):
            good = tf.data.Dataset.from_tensors((IDS, LABELS)).repeat(4)
            return good.concatenate(tf.data.Dataset.from_tensors((bad, LABELS))).repeat()

        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"must hold row ids in \[0, 60\)"):
            tfs.fit(model, four_good_then_bad, epochs=1, steps_per_epoch=12, verbose=0, log_every=1)
        # Each of the two workers reads four good batches, then the bad one: the first bad step ends the run
        # after 4 to 8 good ones (one at a time, log_every=1). It applied nothing and is counted nowhere,
        # Keras's own count included.
        done = tfs.training.steps_done(model)
        self.assertBetween(done, 4, 8)
        self.assertEqual(int(model.optimizer.iterations.numpy()), done)
        ref_table, _ = single_device_reference(table0, done)
        self.assertAllClose(emb.numpy(), ref_table, atol=1e-5)
        # Without a checkpoint directory a later call trains its own epochs (as model.fit does).
        history = tfs.fit(model, dataset_fn, epochs=2, steps_per_epoch=3, verbose=0, log_every=1)
        self.assertLen(history.history["loss"], 2)
        self.assertEqual(tfs.training.steps_done(model), done + 6)
        ref_table, _ = single_device_reference(table0, done + 6)
        self.assertAllClose(emb.numpy(), ref_table, atol=1e-5)

    @pytest.mark.slow  # over 4 s
    def test_steps_per_execution_runs_several_steps_per_dispatch(self):
        with self.strategy.scope():
            model = make_model(steps_per_execution=4)
        emb = model.get_layer("emb").embeddings
        table0 = emb.numpy()
        # 5 steps per epoch at 4 per dispatch: one dispatch of 4 and one of 1 per epoch. log_every=1 waits for
        # each dispatch, so the two workers never overlap and the result is the sequential one.
        history = tfs.fit(model, dataset_fn, epochs=2, steps_per_epoch=5, verbose=0, log_every=1)
        self.assertLen(history.history["loss"], 2)
        self.assertEqual(tfs.training.steps_done(model), 10)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 10)
        ref_table, ref_kernel = single_device_reference(table0, 10)
        self.assertAllClose(emb.numpy(), ref_table, atol=1e-5)
        self.assertAllClose(model.get_layer("dense").kernel.numpy(), ref_kernel, atol=1e-5)

    def test_training_step_reads_only_rows_of_tables_and_slots(self):
        with self.strategy.scope():
            model = make_model()
            model.optimizer.build(model.trainable_variables)
        emb = model.get_layer("emb").embeddings
        watched = list(emb.variables) + list(model.optimizer.table_slot(emb, "momentum").variables)
        step = tfs.training.train_function(model, self.strategy)
        concrete = step.get_concrete_function(
            (tf.TensorSpec([None, 3], tf.int64), tf.TensorSpec([None, 1], tf.float32))
        )
        captured, uses = handle_uses(concrete.graph, watched)
        self.assertEqual(captured, len(watched))
        self.assertEqual([use for use in uses if use.split()[0] not in ROW_OPS], [])

    def test_step_counts_with_one_op_on_the_ps(self):
        # Keras counts a step as a read of `iterations`, an add and an assign: under parameter servers, three
        # crossings to the ps holding it after the gradients. tfs.optimizers count with one op there.
        with self.strategy.scope():
            model = make_model()
            model.optimizer.build(model.trainable_variables)
        step = tfs.training.train_function(model, self.strategy)
        graph = step.get_concrete_function(
            (tf.TensorSpec([None, 3], tf.int64), tf.TensorSpec([None, 1], tf.float32))
        ).graph
        captured, uses = handle_uses(graph, [model.optimizer.iterations.value])
        self.assertEqual(captured, 1)
        self.assertEqual([use.split()[0] for use in uses], ["AssignAddVariableOp"])

    def test_fit_argument_errors(self):
        with self.strategy.scope():
            model = make_model()
        with self.assertRaisesRegex(ValueError, "`steps_per_epoch` is required"):
            tfs.fit(model, dataset_fn)
        with self.assertRaisesRegex(ValueError, "Argument `dataset`"):
            tfs.fit(model, [1, 2], steps_per_epoch=1)
        with self.assertRaisesRegex(ValueError, "compiled keras.Model"):
            tfs.fit(keras.Sequential([keras.layers.Dense(1)]), dataset_fn, steps_per_epoch=1)


class CollectionOnParameterServersTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.strategy = ps_strategy()

    def test_one_fused_request_per_ps_and_fit_learns(self):
        tables = {name: {"input_dim": 40, "output_dim": 4, "partitions": 2, "seed": i} for i, name in enumerate("abc")}
        features = {"fa": "a", "fb": "b", "fc": {"table": "c", "combiner": "sum"}}
        with self.strategy.scope():
            inputs = {
                "fa": keras.Input((), dtype="int64", name="fa"),
                "fb": keras.Input((), dtype="int64", name="fb"),
                "fc": keras.Input((2,), dtype="int64", name="fc"),
            }
            layer = tfs.layers.EmbeddingCollection(tables, features, name="coll")
            out = layer(inputs)
            x = keras.layers.Concatenate()([out["fa"], out["fb"], out["fc"]])
            model = keras.Model(inputs, keras.layers.Dense(1)(x))
            model.compile(optimizer=tfs.optimizers.Adagrad(0.2), loss="mse")
        shards_on = {}
        for table in layer.tables.values():
            for v in table.variables:
                shards_on[v.device] = shards_on.get(v.device, 0) + 1
        self.assertEqual(sorted(shards_on.values()), [3, 3])
        # The three tables' shards on a ps are one variable there (table-batched storage, tests/table/test_batched.py).
        self.assertEqual(sorted(v.value.device for v in layer.trainable_variables), sorted(shards_on))

        example = {"fa": tf.constant([1, 2]), "fb": tf.constant([3, 3]), "fc": tf.constant([[4, 5], [6, 6]])}
        graph = tf.function(layer).get_concrete_function(example).graph
        for device in shards_on:
            on_device = [op for op in graph.get_operations() if op.device == device]
            # One id tensor in, one gather, one row tensor out: nothing is split by shard on the ps.
            self.assertEqual(sum(op.type == "ResourceGather" for op in on_device), 1, msg=device)
            self.assertEqual(sum(op.type in ("DynamicPartition", "DynamicStitch") for op in on_device), 0, msg=device)

        def dataset_fn(input_context=None):
            rng = np.random.RandomState(0)
            x = {"fa": rng.randint(0, 40, 256), "fb": rng.randint(0, 40, 256), "fc": rng.randint(0, 40, (256, 2))}
            y = (x["fa"] % 2).astype(np.float32)[:, None]
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            losses = tfs.fit(model, dataset_fn, epochs=3, steps_per_epoch=16, log_every=4).history["loss"]
        self.assertLess(losses[-1], losses[0])
        self.assertIn("16/16", printed.getvalue())  # the progress bar, with loss and throughput
        self.assertIn("loss:", printed.getvalue())
        self.assertIn("samples/s:", printed.getvalue())
        # Two workers update asynchronously; the step counts stay exact (tfs.optimizers count `iterations` with
        # one op on its ps: Keras's read, add and assign lost counts when two workers' steps overlapped).
        self.assertEqual(tfs.training.steps_done(model), 3 * 16)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 3 * 16)
