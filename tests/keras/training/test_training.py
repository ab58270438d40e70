"""`tfs.fit` and `tf_sharded.keras.training.checkpoints` under the default strategy, against Keras's own `model.fit`.

The other fit loops are tested where their strategies run: the coordinator
loop in `tests/keras/test_keras_ps.py`, the replica loop in
`tests/keras/test_layers.py` (Mirrored, `steps_per_execution > 1`) and
`tests/strategy/test_multi_worker.py`.
"""

import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tf_sharded.keras.training import checkpoints

ROWS, DIM = 30, 4


def model_and_twin():
    """The same model twice: a sharded one trained by `tfs.fit`, and one with Keras layers for `model.fit`."""
    table0 = np.random.RandomState(0).uniform(-0.5, 0.5, (ROWS, DIM)).astype(np.float32)
    kernel0 = np.linspace(-1, 1, DIM)[:, None].astype(np.float32)

    def build(embedding):
        inp = keras.Input((3,), dtype="int64")
        x = embedding(inp)
        if len(x.shape) == 3:
            x = keras.layers.GlobalAveragePooling1D()(x)
        out = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(kernel0))(x)
        return keras.Model(inp, out)

    ours = build(
        tfs.layers.Embedding(
            ROWS, DIM, combiner="mean", partitions=3, embeddings_initializer=keras.initializers.Constant(table0)
        )
    )
    # Plain SGD: a lazy row update equals Keras's dense one (momentum would keep moving untouched rows in Keras).
    ours.compile(optimizer=tfs.optimizers.SGD(0.2), loss="mse")
    twin = build(keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.Constant(table0)))
    twin.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    return ours, twin


def data():
    rng = np.random.RandomState(1)
    x, y = rng.randint(0, ROWS, (48, 3)), rng.rand(48, 1).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 6 steps per epoch


def table_of(model):
    return next(w for w in model.weights if "embedding" in w.path).numpy()


def ours_table(model):
    return model.get_layer(index=1).embeddings.numpy()


class FitTest(tf.test.TestCase):
    def test_fit_is_keras_fit_step_for_step(self):
        ours, twin = model_and_twin()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tfs.fit(ours, data(), epochs=3, verbose=0).history["loss"]
        # Keras warns when its default `shuffle=True` meets a Dataset (which it never shuffles): tfs.fit passes False.
        self.assertEqual([str(w.message) for w in caught if "shuffle" in str(w.message)], [])
        want = twin.fit(data(), epochs=3, verbose=0, shuffle=False).history["loss"]
        self.assertAllClose(got, want, rtol=1e-5)
        self.assertAllClose(ours.get_layer(index=1).embeddings.numpy(), table_of(twin), atol=1e-6)
        self.assertEqual(tfs.training.steps_done(ours), 18)

    def test_the_step_is_traced_once(self):
        # tf.function traces a step whose first trace creates variables a second time: tfs.fit creates the
        # optimizer's slots and the metrics' variables before the step, as Keras does only in a strategy's scope.
        ours, _ = model_and_twin()
        traces = []

        def mse(y, p):
            traces.append(1)  # once per trace of the step (Python runs only while tracing)
            return keras.ops.mean(keras.ops.square(y - p))

        ours.compile(optimizer=tfs.optimizers.Adam(0.1), loss=mse, metrics=["mae"])
        tfs.fit(ours, data(), epochs=2, verbose=0)
        self.assertLen(traces, 1)
        self.assertEqual(tfs.training.steps_done(ours), 12)

    def test_checkpoint_secs_saves_by_time(self):
        # By the step count only: the epoch end. By time (a tiny interval): after every step as well, the last
        # three kept.
        for secs, want in ((None, (6,)), (1e-6, (4, 5, 6))):
            directory = os.path.join(self.get_temp_dir(), f"secs_{secs}")
            ours, _ = model_and_twin()
            tfs.fit(ours, data(), epochs=1, steps_per_epoch=6, checkpoint_dir=directory, checkpoint_every=100,
                    checkpoint_secs=secs, verbose=0)  # fmt: skip
            paths = tf.train.get_checkpoint_state(directory).all_model_checkpoint_paths
            self.assertEqual([int(p.rsplit("-", 1)[1]) for p in paths][-len(want) :], list(want), secs)
            if secs is None:
                self.assertEqual(len(paths), 1)

    def test_resume_continues_where_the_checkpoint_stopped(self):
        directory = os.path.join(self.get_temp_dir(), "resume")
        first, twin = model_and_twin()
        tfs.fit(first, data(), epochs=1, steps_per_epoch=6, checkpoint_dir=directory, checkpoint_every=4, verbose=0)
        # Saved at step 4 (checkpoint_every) and at the epoch end, with the layout manifest beside them.
        self.assertEqual(tf.train.get_checkpoint_state(directory).all_model_checkpoint_paths[-2:],
                         [os.path.join(directory, "ckpt-4"), os.path.join(directory, "ckpt-6")])  # fmt: skip
        with open(os.path.join(directory, checkpoints.LAYOUT_FILE)) as f:
            layouts = json.load(f)["tables"]
        self.assertEqual([v["partition"] for v in layouts.values()], ["PartitionSpec(num_shards=3, scheme='div')"])

        again, _ = model_and_twin()  # a fresh process's model: restored, then epochs 2 and 3 only
        history = tfs.fit(again, data(), epochs=3, steps_per_epoch=6, checkpoint_dir=directory, verbose=0)
        self.assertLen(history.history["loss"], 2)
        twin.fit(data(), epochs=3, verbose=0, shuffle=False)
        self.assertAllClose(again.get_layer(index=1).embeddings.numpy(), table_of(twin), atol=1e-6)
        self.assertEqual(tfs.training.steps_done(again), 18)

    def test_max_steps_ends_inside_an_epoch_and_a_rerun_continues_to_it(self):
        # Keras's model.fit (one step per function), 3 epochs of 4 steps cut at step 10; the rerun (a fresh
        # model restored from step 10, the stream positioned by its caller) goes on to 14 in epoch 3.
        directory = os.path.join(self.get_temp_dir(), "max_steps")
        stream = data().repeat()
        ours, twin = model_and_twin()
        history = tfs.fit(ours, stream, epochs=3, steps_per_epoch=4, max_steps=10, checkpoint_dir=directory,
                          verbose=0)  # fmt: skip
        self.assertEqual((tfs.training.steps_done(ours), history.initial_step), (10, 0))
        self.assertLen(history.history["loss"], 3)  # the third epoch cut short after 2 steps
        self.assertEqual(tf.train.latest_checkpoint(directory), os.path.join(directory, "ckpt-10"))
        twin.fit(stream, epochs=1, steps_per_epoch=10, verbose=0, shuffle=False)
        self.assertAllClose(ours_table(ours), table_of(twin), atol=1e-6)

        again, _ = model_and_twin()
        history = tfs.fit(again, stream.skip(10), epochs=4, steps_per_epoch=4, max_steps=14,
                          checkpoint_dir=directory, verbose=0)  # fmt: skip
        self.assertEqual((tfs.training.steps_done(again), history.initial_step), (14, 10))
        twin.fit(stream.skip(10), epochs=1, steps_per_epoch=4, verbose=0, shuffle=False)
        self.assertAllClose(ours_table(again), table_of(twin), atol=1e-6)

        # Already there: nothing runs, nothing is written.
        done, _ = model_and_twin()
        history = tfs.fit(done, stream, epochs=4, steps_per_epoch=4, max_steps=12, checkpoint_dir=directory, verbose=0)
        self.assertEqual((tfs.training.steps_done(done), history.initial_step, history.history), (14, 14, {}))
        self.assertEqual(tf.train.latest_checkpoint(directory), os.path.join(directory, "ckpt-14"))

    def test_a_run_resumed_inside_an_epoch_ends_where_the_whole_run_ends(self):
        # Stopped at step 4 of an epoch of 6 (as a killed run would be), then rerun for 2 epochs: the rerun
        # finishes the epoch and stops at step 12, as an uninterrupted run (the stream positioned by its caller).
        directory = os.path.join(self.get_temp_dir(), "inside")
        stream = data().repeat()
        first, twin = model_and_twin()
        tfs.fit(first, stream, epochs=1, steps_per_epoch=6, max_steps=4, checkpoint_dir=directory, verbose=0)
        again, _ = model_and_twin()
        history = tfs.fit(again, stream.skip(4), epochs=2, steps_per_epoch=6, checkpoint_dir=directory, verbose=0)
        self.assertEqual((tfs.training.steps_done(again), history.initial_step), (12, 4))
        twin.fit(stream, epochs=1, steps_per_epoch=12, verbose=0, shuffle=False)
        self.assertAllClose(ours_table(again), table_of(twin), atol=1e-6)

    @pytest.mark.slow  # over 4 s
    def test_a_rerun_reads_a_finite_dataset_on_from_the_batch_its_checkpoint_stopped_at(self):
        # A first run under Keras's model.fit stopped part way (max_steps, as a killed run would be), then rerun
        # with the same Dataset: it goes on from the batch and epoch where it stopped, and ends equal to Keras's
        # uninterrupted model.fit. Epochs of the whole Dataset (6 batches), and epochs of 4 steps, in which
        # Keras reads on through the Dataset, ends an epoch early where it runs out, and starts it over.
        # The input as a Dataset, and as a function returning it (Keras reads the function's Dataset).
        cases = [(None, 8, 18, 2, False), (4, 6, 10, 1, False), (4, 9, 10, 1, False), (None, 8, 18, 2, True)]
        for per_epoch, stop_at, steps, epochs_left, function in cases:
            with self.subTest(steps_per_epoch=per_epoch, stopped_at=stop_at, function=function):
                directory = os.path.join(self.get_temp_dir(), f"finite_{per_epoch}_{stop_at}_{function}")
                source = (lambda context: data()) if function else data()
                first, twin = model_and_twin()
                tfs.fit(first, source, epochs=3, steps_per_epoch=per_epoch, max_steps=stop_at,
                        checkpoint_dir=directory, verbose=0)  # fmt: skip
                self.assertEqual(tfs.training.steps_done(first), stop_at)
                again, _ = model_and_twin()
                history = tfs.fit(again, source, epochs=3, steps_per_epoch=per_epoch, checkpoint_dir=directory,
                                  verbose=0)  # fmt: skip
                self.assertEqual((tfs.training.steps_done(again), history.initial_step), (steps, stop_at))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # Keras warns when its input runs out inside an epoch
                    twin.fit(data(), epochs=3, steps_per_epoch=per_epoch, verbose=0, shuffle=False)
                self.assertEqual(int(twin.optimizer.iterations.numpy()), steps)
                self.assertAllClose(ours_table(again), table_of(twin), atol=1e-6)
                # The rerun's epochs: the one it resumed inside (or at the start of), and those after it.
                self.assertLen(history.history["loss"], epochs_left)

        # The same model trained on by a second call (a callback of the first left Keras's stop flag set).
        same, twin = model_and_twin()
        directory = os.path.join(self.get_temp_dir(), "same_model")
        tfs.fit(same, data(), epochs=3, max_steps=8, checkpoint_dir=directory, verbose=0)
        history = tfs.fit(same, data(), epochs=3, checkpoint_dir=directory, verbose=0)
        self.assertEqual((tfs.training.steps_done(same), history.initial_step), (18, 8))
        twin.fit(data(), epochs=3, verbose=0, shuffle=False)
        self.assertAllClose(ours_table(same), table_of(twin), atol=1e-6)

        # Without steps_per_epoch, a Dataset of unknown length cannot be positioned: a clear error, nothing run.
        directory = os.path.join(self.get_temp_dir(), "unknown_length")
        first, _ = model_and_twin()
        tfs.fit(first, data().repeat(), epochs=3, steps_per_epoch=6, max_steps=8, checkpoint_dir=directory, verbose=0)
        again, _ = model_and_twin()
        with self.assertRaisesRegex(ValueError, "steps_per_epoch` is required to resume from .* of unknown length"):
            tfs.fit(again, data().filter(lambda x, y: True), epochs=3, checkpoint_dir=directory, verbose=0)
        self.assertEqual(int(again.optimizer.iterations.numpy()), 0)
        # With it, model.fit resumes in the checkpoint's epoch, on a stream its caller positions.
        unknown = data().repeat().filter(lambda x, y: True).skip(8)
        history = tfs.fit(again, unknown, epochs=3, steps_per_epoch=6, checkpoint_dir=directory, verbose=0)
        self.assertEqual((tfs.training.steps_done(again), history.initial_step), (18, 8))
        self.assertAllClose(ours_table(again), table_of(twin), atol=1e-6)

    def test_max_steps_with_steps_per_execution_runs_exactly_that_many(self):
        # Keras would run whole groups of 4 (8 steps); tfs.fit's replica loop runs 4 + 2.
        ours, twin = model_and_twin()
        ours.compile(optimizer=tfs.optimizers.SGD(0.2), loss="mse", steps_per_execution=4)
        tfs.fit(ours, data().repeat(), epochs=2, steps_per_epoch=4, max_steps=6, verbose=0)
        self.assertEqual(tfs.training.steps_done(ours), 6)
        twin.fit(data().repeat(), epochs=1, steps_per_epoch=6, verbose=0, shuffle=False)
        self.assertAllClose(ours_table(ours), table_of(twin), atol=1e-6)

    def test_replica_loop_epochs_read_on_through_the_dataset(self):
        # tfs.fit's replica loop (steps_per_execution > 1 with max_steps) reads as Keras's model.fit with
        # steps_per_epoch: an endless stream goes on from epoch to epoch; a finite Dataset too, where an epoch
        # ends early when it runs out and the next starts it over (6 batches, epochs of 4: 0-3, 4-5, 0-3).
        for source, steps in ((data().repeat(), 12), (data(), 10)):
            ours, twin = model_and_twin()
            ours.compile(optimizer=tfs.optimizers.SGD(0.2), loss="mse", steps_per_execution=2)
            history = tfs.fit(ours, source, epochs=3, steps_per_epoch=4, max_steps=100, verbose=0)
            self.assertEqual(tfs.training.steps_done(ours), steps)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Keras warns when its input runs out inside an epoch
                keras_history = twin.fit(source, epochs=3, steps_per_epoch=4, verbose=0, shuffle=False)
            self.assertEqual(int(twin.optimizer.iterations.numpy()), steps)
            self.assertAllClose(ours_table(ours), table_of(twin), atol=1e-6)
            self.assertAllClose(history.history["loss"], keras_history.history["loss"], atol=1e-5)

    def test_layout_file_is_replaced_whole_or_not_at_all(self):
        directory = self.get_temp_dir()
        model, _ = model_and_twin()
        path = checkpoints.write_layouts(model, directory)
        with open(path) as f:
            before = f.read()
        self.assertIn("PartitionSpec(num_shards=3", before)

        def fail_midway(obj, f, **kwargs):
            f.write('{"tables": {"half')
            raise OSError("disk full")

        original = json.dump
        json.dump = fail_midway
        try:
            with self.assertRaisesRegex(OSError, "disk full"):
                checkpoints.write_layouts(model, directory)
        finally:
            json.dump = original
        with open(path) as f:
            self.assertEqual(f.read(), before)
        self.assertEqual(os.listdir(directory), [checkpoints.LAYOUT_FILE])  # no partial file left behind

    def test_a_failing_step_advances_no_step_count(self):
        ours, _ = model_and_twin()
        tfs.fit(ours, data(), epochs=1, verbose=0)
        before = [v.numpy().copy() for v in ours.weights]
        steps = int(ours.optimizer.iterations.numpy())
        bad = tf.data.Dataset.from_tensors((np.array([[1, 2, ROWS + 3]]), np.array([[1.0]], np.float32)))
        with self.assertRaises(tf.errors.InvalidArgumentError):
            tfs.fit(ours, bad, epochs=1, verbose=0)
        self.assertEqual(int(ours.optimizer.iterations.numpy()), steps)  # Keras's own Embedding counts it
        for old, new in zip(before, ours.weights):
            self.assertAllEqual(old, new.numpy())

    def test_a_checkpoint_of_another_model_is_refused_and_nothing_restored(self):
        directory = os.path.join(self.get_temp_dir(), "another")
        first, _ = model_and_twin()
        tfs.fit(first, data(), epochs=1, steps_per_epoch=6, checkpoint_dir=directory, verbose=0)
        latest = tf.train.latest_checkpoint(directory)

        def variant(rows=ROWS, hidden=False, optimizer=None, per_execution=1):
            inp = keras.Input((3,), dtype="int64")
            x = tfs.layers.Embedding(rows, DIM, combiner="mean", partitions=2, name="emb")(inp)
            if hidden:
                x = keras.layers.Dense(4, name="hidden")(x)
            model = keras.Model(inp, keras.layers.Dense(1, name="head")(x))
            model.compile(optimizer=optimizer or tfs.optimizers.SGD(0.2), loss="mse", steps_per_execution=per_execution)
            return model

        cases = {
            "a table of another shape": (
                variant(rows=ROWS + 1),
                f"model/_operations/1/embeddings (table 'emb'): shape [{ROWS}, {DIM}] in the checkpoint, "
                f"[{ROWS + 1}, {DIM}] in the model",
            ),
            "another layer": (
                variant(hidden=True),
                "optimizer/_trainable_variables/2 (variable 'head/kernel'): in the model, not in the checkpoint",
            ),
            "another optimizer": (
                variant(optimizer=tfs.optimizers.Adagrad(0.2)),
                "optimizer/table_slots_0_accumulator (table 'emb/accumulator'): in the model, not in the checkpoint",
            ),
            # The cases above run Keras's model.fit (an endless stream: a rerun resumes it there); this one
            # tfs.fit's own loop (it builds the optimizer before it restores).
            "another layer, tfs.fit's loop": (
                variant(hidden=True, per_execution=2),
                "optimizer/_trainable_variables/0 (variable 'hidden/kernel'): shape [4, 1] in the checkpoint, "
                "[4, 4] in the model",
            ),
        }
        for case, (model, difference) in cases.items():
            before = [w.numpy().copy() for w in model.weights]
            with self.assertRaises(tfs.training.CheckpointMismatchError, msg=case) as caught:
                tfs.fit(model, data().repeat(), epochs=3, steps_per_epoch=6, max_steps=18, checkpoint_dir=directory,
                        verbose=0)  # fmt: skip
            self.assertIsInstance(caught.exception, ValueError)
            self.assertEqual(caught.exception.path, latest)
            self.assertIn(difference, caught.exception.differences, case)
            message = str(caught.exception)
            self.assertEqual(len(message.splitlines()), 1)
            self.assertIn(f"Cannot restore checkpoint '{latest}': it was written by another model", message)
            self.assertIn("Nothing was restored.", message)
            self.assertEqual(tfs.training.steps_done(model), 0, case)
            self.assertEqual(int(model.optimizer.iterations.numpy()), 0, case)
            for old, new in zip(before, model.weights):
                self.assertAllEqual(old, new.numpy(), f"{case}: {new.path}")
        self.assertEqual(tf.train.latest_checkpoint(directory), latest)  # and nothing written

        # A checkpoint holding more than the model: the entries the model lacks are named.
        bigger = os.path.join(self.get_temp_dir(), "bigger")
        tfs.fit(variant(hidden=True), data(), epochs=1, steps_per_epoch=6, checkpoint_dir=bigger, verbose=0)
        with self.assertRaises(tfs.training.CheckpointMismatchError) as caught:
            tfs.fit(variant(), data(), epochs=2, steps_per_epoch=6, checkpoint_dir=bigger, verbose=0)
        self.assertIn(
            "optimizer/_trainable_variables/3: in the checkpoint, not in the model", caught.exception.differences
        )
        # The model that wrote it resumes.
        again = variant(hidden=True)
        tfs.fit(again, data(), epochs=2, steps_per_epoch=6, checkpoint_dir=bigger, verbose=0)
        self.assertEqual(tfs.training.steps_done(again), 12)

    def test_a_checkpoint_of_another_dynamic_table_is_refused_and_nothing_restored(self):
        directory = os.path.join(self.get_temp_dir(), "dynamic")
        words = tf.constant([["a", "b"], ["c", "a"], ["b", "d"], ["d", "c"]])
        tags = tf.data.Dataset.from_tensor_slices((words, tf.ones([4, 1]))).batch(2)

        def tagged(dim=DIM, key_dtype="string"):
            inp = keras.Input((2,), dtype=key_dtype)
            rows = tfs.layers.DynamicEmbedding(dim, key_dtype=key_dtype, combiner="mean", seed=0, name="tags")(inp)
            model = keras.Model(inp, keras.layers.Dense(1, name="head")(rows))
            model.compile(optimizer=tfs.optimizers.Adagrad(0.1), loss="mse")
            return model

        ids = tf.data.Dataset.from_tensor_slices(([[1, 2], [3, 1], [2, 4], [4, 3]], tf.ones([4, 1]))).batch(2)
        tfs.fit(tagged(), tags, epochs=1, steps_per_epoch=2, checkpoint_dir=directory, verbose=0)
        for model, inputs, difference in (
            (tagged(dim=DIM + 1), tags,
             f"(dynamic table 'tags'): rows of {DIM} in the checkpoint, {DIM + 1} in the model"),
            (tagged(key_dtype="int64"), ids,
             "(dynamic table 'tags'): string keys in the checkpoint, int64 in the model"),
        ):  # fmt: skip
            with self.assertRaises(tfs.training.CheckpointMismatchError) as caught:
                tfs.fit(model, inputs, epochs=2, steps_per_epoch=2, checkpoint_dir=directory, verbose=0)
            self.assertTrue(any(d.endswith(difference) for d in caught.exception.differences), caught.exception)
            self.assertEqual(int(model.get_layer("tags").table.size()), 0)  # no key restored
            self.assertEqual(tfs.training.steps_done(model), 0)

    def test_bad_arguments_are_named(self):
        ours, _ = model_and_twin()
        uncompiled = keras.Sequential([keras.layers.Dense(1)])
        with self.assertRaisesRegex(ValueError, r"Argument `model` must be a compiled keras.Model.*\(not compiled\)"):
            tfs.fit(uncompiled, data())
        with self.assertRaisesRegex(ValueError, "Argument `dataset` must be a tf.data.Dataset or a function"):
            tfs.fit(ours, [1, 2])
        with self.assertRaisesRegex(ValueError, "Argument `epochs` must be a positive int"):
            tfs.fit(ours, data(), epochs=0)
        with self.assertRaisesRegex(ValueError, "Argument `checkpoint_every` must be a positive int"):
            tfs.fit(ours, data(), checkpoint_every=-1)
        with self.assertRaisesRegex(ValueError, "Argument `checkpoint_secs` must be a positive number. Received: 0"):
            tfs.fit(ours, data(), checkpoint_secs=0)
        with self.assertRaisesRegex(ValueError, "Argument `max_restarts` must be an int >= 0. Received: -1"):
            tfs.fit(ours, data(), max_restarts=-1)
        with self.assertRaisesRegex(ValueError, "Argument `max_steps` must be a positive int"):
            tfs.fit(ours, data(), max_steps=0)
        self.assertEqual(tfs.training.steps_done(ours), 0)  # nothing ran
