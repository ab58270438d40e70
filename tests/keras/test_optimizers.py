"""tfs.optimizers: lazy sparse updates against NumPy, sharded slots, checkpoints across layouts."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tf_sharded as tfs
from tests.harness.graphs import handle_uses
from tests.harness.references import table_values
from tests.harness.strategies import mirrored, uid

ROWS, DIM = 23, 3
SCALE = 0.1  # loss = SCALE * sum(lookup(ids) ** 2)
STEPS = [np.array([[1, 1, 1], [4, 20, 1]]), np.array([[4, 4, 9], [22, 0, 1]]), np.array([[9, 9, 9], [9, 9, 9]])]

CASES = [
    ("sgd", tfs.optimizers.SGD, dict(learning_rate=0.3)),
    ("sgd_momentum", tfs.optimizers.SGD, dict(learning_rate=0.3, momentum=0.9)),
    ("sgd_nesterov", tfs.optimizers.SGD, dict(learning_rate=0.3, momentum=0.9, nesterov=True)),
    ("adagrad", tfs.optimizers.Adagrad, dict(learning_rate=0.3)),
    ("adam", tfs.optimizers.Adam, dict(learning_rate=0.05)),
    ("adam_amsgrad_decay", tfs.optimizers.Adam, dict(learning_rate=0.05, amsgrad=True, weight_decay=0.1)),
    ("ftrl", tfs.optimizers.Ftrl, dict(learning_rate=0.3, l1_regularization_strength=0.01, beta=0.1)),
]


def numpy_step(kind, cfg, w, slots, rows, g, t):
    """One lazy update of rows `rows` (distinct) with summed gradient rows `g`, in NumPy float64."""
    lr = cfg["learning_rate"]
    w = w.copy()
    slots = {k: v.copy() for k, v in slots.items()}
    wd = cfg.get("weight_decay")
    if wd:
        w[rows] -= w[rows] * wd * lr
    if kind == "SGD":
        mom = cfg.get("momentum", 0.0)
        if mom == 0:
            w[rows] -= lr * g
        else:
            m = slots["momentum"][rows] * mom - g * lr
            slots["momentum"][rows] = m
            w[rows] += m * mom - g * lr if cfg.get("nesterov") else m
    elif kind == "Adagrad":
        acc = slots["accumulator"][rows] + g**2
        slots["accumulator"][rows] = acc
        w[rows] -= lr * g / np.sqrt(acc + 1e-7)
    elif kind == "Adam":
        b1, b2, eps = 0.9, 0.999, 1e-7
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        m = slots["momentum"][rows] + (g - slots["momentum"][rows]) * (1 - b1)
        v = slots["velocity"][rows] + (g**2 - slots["velocity"][rows]) * (1 - b2)
        slots["momentum"][rows], slots["velocity"][rows] = m, v
        if cfg.get("amsgrad"):
            v = np.maximum(slots["velocity_hat"][rows], v)
            slots["velocity_hat"][rows] = v
        w[rows] -= m * alpha / (np.sqrt(v) + eps)
    elif kind == "Ftrl":
        l1, l2 = cfg.get("l1_regularization_strength", 0.0), cfg.get("beta", 0.0) / (2 * lr)
        acc, lin, var = slots["accumulator"][rows], slots["linear"][rows], w[rows]
        new_acc = acc + g**2
        lin = lin + g - (np.sqrt(new_acc) - np.sqrt(acc)) / lr * var
        quad = np.sqrt(new_acc) / lr + 2 * l2
        w[rows] = (np.clip(lin, -l1, l1) - lin) / quad
        slots["accumulator"][rows], slots["linear"][rows] = new_acc, lin
    return w, slots


def initial_slots(kind, cfg):
    zeros = np.zeros((ROWS, DIM))
    if kind == "SGD":
        return {"momentum": zeros} if cfg.get("momentum") else {}
    if kind == "Adagrad":
        return {"accumulator": np.full((ROWS, DIM), 0.1)}
    if kind == "Adam":
        return {"momentum": zeros, "velocity": zeros, **({"velocity_hat": zeros} if cfg.get("amsgrad") else {})}
    return {"accumulator": np.full((ROWS, DIM), 0.1), "linear": zeros}


def train(table, optimizer, dense=None):
    @tf.function
    def step(ids):
        variables = list(table.variables) + ([dense] if dense is not None else [])
        with tf.GradientTape() as tape:
            emb = tfs.embedding_lookup(table, ids)
            loss = SCALE * tf.reduce_sum(emb**2)
            if dense is not None:
                # Independent of the table, so the dense variable sees the same gradients whatever the table does.
                loss += tf.reduce_sum(dense**2 * tf.reduce_mean(tf.cast(ids, tf.float32)))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))

    for ids in STEPS:
        step(tf.constant(ids))


class SparseUpdateTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(*CASES)
    def test_matches_numpy_on_touched_rows_and_leaves_the_rest_bit_identical(self, cls, cfg):
        kind = cls.__name__
        values = table_values(ROWS, DIM)
        table = tfs.create_sharded_variable(uid("opt"), [ROWS, DIM], initializer=values, partitions=3, scheme="mod")
        optimizer = cls(**cfg)
        train(table, optimizer)

        w, slots = values.astype(np.float64), initial_slots(kind, cfg)
        ever_touched = np.zeros(ROWS, bool)
        for t, ids in enumerate(STEPS, start=1):
            rows, counts = np.unique(ids, return_counts=True)
            g = 2 * SCALE * counts[:, None] * w[rows]
            w, slots = numpy_step(kind, cfg, w, slots, rows, g, t)
            ever_touched[rows] = True
        got = table.numpy()
        self.assertAllClose(got[ever_touched], w[ever_touched], rtol=2e-5, atol=1e-6)
        self.assertAllEqual(got[~ever_touched], values[~ever_touched])  # bit-identical
        for name, want in slots.items():
            slot = optimizer.table_slot(table, name)
            self.assertEqual(slot.partition, table.partition)
            self.assertEqual(slot.devices, table.devices)
            got_slot = slot.numpy()
            self.assertAllClose(got_slot[ever_touched], want[ever_touched], rtol=2e-5, atol=1e-6, msg=name)
            self.assertAllEqual(got_slot[~ever_touched], want[~ever_touched].astype(np.float32))

    @parameterized.named_parameters(*CASES)
    def test_dense_variables_are_updated_exactly_as_keras_does(self, cls, cfg):
        values = table_values(ROWS, DIM)
        dense0 = np.linspace(-1, 1, DIM).astype(np.float32)
        table = tfs.create_sharded_variable(uid("mix"), [ROWS, DIM], initializer=values, partitions=2)
        dense = tf.Variable(dense0)
        train(table, cls(**cfg), dense)
        # The Keras optimizer of the same name on a plain table: the dense variable must match exactly.
        plain = tfs.create_sharded_variable(uid("plain"), [ROWS, DIM], initializer=values, partitions=2)
        keras_dense = tf.Variable(dense0)
        keras_cls = getattr(keras.optimizers, cls.__name__)
        # Weight decay included: Keras decays the whole dense variable, and so must we.
        train(plain, keras_cls(**cfg), keras_dense)
        self.assertAllClose(dense.numpy(), keras_dense.numpy(), rtol=1e-6, atol=1e-7)
        self.assertFalse(np.allclose(dense.numpy(), dense0))

    def test_two_lookups_of_one_table_in_a_step_are_merged(self):
        # Each lookup de-duplicates its own ids; across two lookups rows repeat and must be summed first.
        values = table_values(ROWS, DIM)
        table = tfs.create_sharded_variable(uid("twice"), [ROWS, DIM], initializer=values, partitions=2)
        optimizer = tfs.optimizers.Adagrad(0.3)
        a, b = np.array([1, 4, 4]), np.array([4, 9])

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = SCALE * (
                    tf.reduce_sum(tfs.embedding_lookup(table, a) ** 2)
                    + tf.reduce_sum(tfs.embedding_lookup(table, b) ** 2)
                )
            grads = tape.gradient(loss, list(table.variables))
            optimizer.apply_gradients(zip(grads, table.variables))

        step()
        rows, counts = np.unique(np.concatenate([a, b]), return_counts=True)
        g = 2 * SCALE * counts[:, None] * values[rows]
        want, _ = numpy_step(
            "Adagrad", dict(learning_rate=0.3), values.astype(np.float64), initial_slots("Adagrad", {}), rows, g, 1
        )
        self.assertAllClose(table.numpy(), want, rtol=2e-5, atol=1e-6)


class StepCountTest(tf.test.TestCase):
    def test_a_traced_step_counts_with_one_op(self):
        table = tfs.create_sharded_variable(uid("counted"), [ROWS, DIM], initializer="ones", partitions=2)
        optimizer = tfs.optimizers.SGD(0.3)
        grads = [tf.IndexedSlices(tf.ones([1, DIM]), tf.constant([0], tf.int64), tf.constant([ROWS, DIM]))] * 2
        optimizer.apply(grads, list(table.variables))  # eagerly: Keras's own increment
        step = tf.function(lambda: optimizer.apply(grads, list(table.variables)))
        graph = step.get_concrete_function().graph
        # Keras counts as a read, an add and an assign (three crossings to a ps holding the counter); traced,
        # tfs.optimizers count with one op where the counter lives.
        captured, uses = handle_uses(graph, [optimizer.iterations.value])
        self.assertEqual(captured, 1)
        self.assertEqual([use.split()[0] for use in uses], ["AssignAddVariableOp"])
        step()
        step()
        self.assertEqual(int(optimizer.iterations.numpy()), 3)
        self.assertNotIn("assign_add", vars(optimizer.iterations))  # the counter is as it was after the step

    def test_mirrored_copies_of_the_counter_keep_keras_increment(self):
        strategy = mirrored()
        with strategy.scope():
            weight = keras.Variable(np.ones([2], np.float32))
            optimizer = tfs.optimizers.SGD(0.3)
            optimizer.build([weight])

        @tf.function
        def step():
            strategy.run(lambda: optimizer.apply([tf.ones([2])], [weight]))

        step()
        step()
        self.assertEqual(int(optimizer.iterations.numpy()), 2)
        self.assertAllClose(weight.numpy(), [1 - 2 * 0.3 * strategy.num_replicas_in_sync] * 2)  # summed, twice


class SlotCheckpointTest(tf.test.TestCase):
    def test_optimizer_state_restores_into_another_layout_and_delayed(self):
        values = table_values(ROWS, DIM)
        table = tfs.create_sharded_variable(uid("ck"), [ROWS, DIM], initializer=values, partitions=2)
        optimizer = tfs.optimizers.Adam(0.05)
        train(table, optimizer)
        path = tf.train.Checkpoint(table=table, optimizer=optimizer).save(self.get_temp_dir() + "/opt")
        want = {n: optimizer.table_slot(table, n).numpy() for n in ("momentum", "velocity")}

        for partitions, scheme in ((3, "mod"), (1, "div"), (4, "balanced")):
            other = tfs.create_sharded_variable(
                uid("ck2"), [ROWS, DIM], initializer="zeros", partitions=partitions, scheme=scheme
            )
            fresh = tfs.optimizers.Adam(0.05)
            status = tf.train.Checkpoint(table=other, optimizer=fresh).restore(path)
            fresh.build(list(other.variables))  # delayed: slots are created after restore() was called
            status.assert_existing_objects_matched()
            self.assertAllEqual(other.numpy(), table.numpy())
            self.assertEqual(int(fresh.iterations.numpy()), len(STEPS))
            for name, value in want.items():
                self.assertAllEqual(fresh.table_slot(other, name).numpy(), value, msg=(partitions, scheme, name))

    def test_checkpoint_holds_one_full_shape_entry_per_slot(self):
        table = tfs.create_sharded_variable(uid("keys"), [ROWS, DIM], partitions=3)
        optimizer = tfs.optimizers.Adagrad()
        optimizer.build(list(table.variables))
        path = tf.train.Checkpoint(optimizer=optimizer).save(self.get_temp_dir() + "/keys")
        shapes = dict(tf.train.list_variables(path))
        slot_keys = [k for k in shapes if "table_slots" in k]
        self.assertEqual(slot_keys, ["optimizer/table_slots_0_accumulator/.ATTRIBUTES/VARIABLE_VALUE"])
        self.assertEqual(shapes[slot_keys[0]], [ROWS, DIM])
        self.assertFalse([k for k in shapes if shapes[k] == [8, DIM]], "no per-shard entries")


class OptimizerErrorsTest(tf.test.TestCase):
    def test_bad_options_are_named(self):
        with self.assertRaisesRegex(ValueError, "not recognized|Unrecognized|foo"):
            tfs.optimizers.Adam(foo=1)
        with self.assertRaisesRegex(ValueError, "identifier"):
            tfs.optimizers.get("rmsprop")
        table = tfs.create_sharded_variable(uid("ema"), [ROWS, DIM], partitions=2)
        with self.assertRaisesRegex(ValueError, "`use_ema`.*not supported with sharded tables"):
            tfs.optimizers.SGD(use_ema=True).build(list(table.variables))
        optimizer = tfs.optimizers.Adam()
        optimizer.build(list(table.variables))
        with self.assertRaisesRegex(ValueError, "Argument `name` must be one of"):
            optimizer.table_slot(table, "mom")
        other = tfs.create_sharded_variable(uid("other"), [ROWS, DIM])
        with self.assertRaisesRegex(ValueError, "Argument `table`"):
            optimizer.table_slot(other, "momentum")
