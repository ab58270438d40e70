"""Test bodies shared by every strategy, of the fixed-row kind's own variable API (`ShardedVariable`).

A concrete test class mixes `StrategyBodies` into `tf.test.TestCase` and
provides `strategy` (the strategy under test) and `execute(fn, *args)` (how a
`tf.function` is executed: eagerly, as a function, or scheduled on a worker
through `ClusterCoordinator`). Every body compares against a plain
single-device `tf.Variable` reference computed in the same test. What every kind and
placement share (lookups of every form, optimizer steps, checkpoints into other layouts)
is checked by the conformance matrix, `tests/conformance`; these bodies are what a
fixed-row table adds as a variable: scatter and assign methods, `sparse_read`, `max_norm`,
every combiner, bad ids refused with nothing applied.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.references import table_values
from tests.harness.strategies import bound, uid

SCHEMES = ("div", "mod", "balanced")


class StrategyBodies:
    """Mixin: requires `self.strategy` and `self.execute(fn, *args)`."""

    rows, dim = 23, 4
    eager = False  # True: `run` executes the python function eagerly.
    table_kwargs = {}  # Extra arguments for every table (e.g. a mirrored placement).
    # Partition schemes the looping bodies cover. The scheme is the layout's business (the same under every
    # strategy, and covered for all three elsewhere); strategies that trace slowly run one.
    schemes = SCHEMES

    def make(self, values=None, partitions=3, scheme="div", **kwargs):
        values = table_values(self.rows, self.dim) if values is None else values
        with self.strategy.scope():
            return self.strategy.create_sharded_variable(
                uid("t"),
                list(values.shape),
                initializer=values,
                partitions=partitions,
                scheme=scheme,
                **{**self.table_kwargs, **kwargs},
            )

    def call(self, fn, *args):
        if self.eager:
            return fn(*args)
        return self.execute(tf.function(fn), *args)

    # ---------------------------------------------------------------- lookups --

    def test_lookup_matches_reference_for_every_rank_and_dtype(self):
        values = table_values(self.rows, self.dim)
        reference = tf.Variable(values)
        id_sets = [
            np.array(7),
            np.array([0, 22, 5, 5, 5]),
            np.array([[1, 2], [2, 1], [22, 0]]),
            np.array([[[3, 3], [4, 11]], [[0, 0], [22, 21]]]),
        ]
        for scheme in self.schemes:
            table = self.make(values, scheme=scheme)
            for ids in id_sets:
                for dtype in (tf.int32, tf.int64):
                    t_ids = tf.constant(ids, dtype)
                    got = self.call(bound(lambda i, table: tf.nn.embedding_lookup(table, i), table=table), t_ids)
                    want = tf.nn.embedding_lookup(reference, t_ids)
                    self.assertAllEqual(got, want, msg=f"{scheme} {ids.shape} {dtype}")

    def test_sparse_read_and_gather_match_lookup(self):
        values = table_values(self.rows, self.dim)
        table = self.make(values, scheme="mod")
        ids = tf.constant([4, 4, 0, 19])
        got = self.call(lambda i: table.sparse_read(i) + tf.gather(table, i), ids)
        self.assertAllClose(got, 2 * values[ids.numpy()])

    def test_max_norm_values_and_gradients_match_tf(self):
        values = table_values(self.rows, self.dim) * 3
        reference = tf.Variable(values)
        table = self.make(values, scheme="balanced")
        ids = tf.constant([[1, 2, 2], [9, 1, 0]])
        weights = tf.constant(np.random.RandomState(1).randn(2, 3, self.dim).astype(np.float32))

        def step(i):
            with tf.GradientTape() as tape:
                out = tf.nn.embedding_lookup(table, i, max_norm=1.5)
                loss = tf.reduce_sum(out * weights)
            grads = tape.gradient(loss, list(table.variables))
            for v, g in zip(table.variables, grads):
                v.scatter_sub(g)
            return out

        with tf.GradientTape() as tape:
            want = tf.nn.embedding_lookup(reference, ids, max_norm=1.5)
            loss = tf.reduce_sum(want * weights)
        reference.scatter_sub(tape.gradient(loss, reference))
        got = self.call(step, ids)
        self.assertAllClose(got, want, atol=1e-6)
        self.assertAllClose(table.numpy(), reference.numpy(), atol=1e-5)

    def test_lookup_sparse_matches_tf_for_every_combiner(self):
        values = table_values(self.rows, self.dim)
        reference = tf.Variable(values)
        table = self.make(values, scheme="mod")
        ragged = tf.ragged.constant([[1, 5, 5], [22], [0, 3, 7, 7]], dtype=tf.int64)
        weights = tf.ragged.constant([[1.0, 0.5, 2.0], [3.0], [1.0, 1.0, -1.0, 0.25]])
        for combiner in ("sum", "mean", "sqrtn"):
            for w in (None, weights):
                sp_w = None if w is None else w.to_sparse()
                want = tf.nn.embedding_lookup_sparse(reference, ragged.to_sparse(), sp_w, combiner=combiner)
                got_ragged = self.call(
                    bound(lambda i, w, c: tfs.embedding_lookup_sparse(table, i, w, combiner=c), w=w, c=combiner),
                    ragged,
                )
                got_sparse = self.call(
                    bound(lambda i, w, c: tf.nn.embedding_lookup_sparse(table, i, w, combiner=c), w=sp_w, c=combiner),
                    ragged.to_sparse(),
                )
                self.assertAllClose(got_ragged, want, atol=1e-6, msg=f"{combiner} ragged")
                self.assertAllClose(got_sparse, want, atol=1e-6, msg=f"{combiner} sparse")

    def test_lookup_sparse_empty_rows_are_zero(self):
        table = self.make(table_values(self.rows, self.dim))
        ids = tf.ragged.constant([[], [2], []], dtype=tf.int64)
        got = self.call(lambda i: tfs.embedding_lookup_sparse(table, i, combiner="mean"), ids)
        self.assertAllClose(got[0], np.zeros(self.dim))
        self.assertAllClose(got[2], np.zeros(self.dim))

    # --------------------------------------------------------------- training --

    def test_sgd_steps_match_single_device_reference(self):
        values = table_values(self.rows, self.dim)
        dense0 = np.random.RandomState(2).randn(self.dim, 1).astype(np.float32)
        batches = [
            np.array([[1, 1, 1], [1, 1, 1]]),  # all duplicates
            np.array([[0, 22, 5], [5, 9, 14]]),
            np.array([[13, 2, 2], [22, 22, 0]]),
        ]
        labels = np.array([[1.0], [0.0]], np.float32)
        for scheme in self.schemes:
            table = self.make(values, scheme=scheme)
            with self.strategy.scope():
                dense = tf.Variable(dense0)
            reference, ref_dense = tf.Variable(values), tf.Variable(dense0)

            def loss_of(emb, w):
                logits = tf.matmul(tf.reduce_mean(emb, axis=1), w)
                return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))

            def step(ids):
                with tf.GradientTape() as tape:
                    loss = loss_of(tfs.embedding_lookup(table, ids), dense)
                grads = tape.gradient(loss, list(table.variables) + [dense])
                for v, g in zip(table.variables, grads[:-1]):
                    self_check = isinstance(g, tf.IndexedSlices)
                    if not self_check:
                        raise AssertionError(f"dense gradient for {v.name}: {type(g)}")
                    v.scatter_sub(tf.IndexedSlices(0.5 * g.values, g.indices, g.dense_shape))
                dense.assign_sub(0.5 * grads[-1])
                return loss

            for ids in batches:
                got = self.call(step, tf.constant(ids))
                with tf.GradientTape() as tape:
                    want = loss_of(tf.nn.embedding_lookup(reference, ids), ref_dense)
                g_table, g_dense = tape.gradient(want, [reference, ref_dense])
                reference.scatter_sub(tf.IndexedSlices(0.5 * g_table.values, g_table.indices))
                ref_dense.assign_sub(0.5 * g_dense)
                self.assertAllClose(got, want, atol=1e-6)
            self.assertAllClose(table.numpy(), reference.numpy(), atol=1e-6, msg=scheme)
            self.assertAllClose(dense.numpy(), ref_dense.numpy(), atol=1e-6)

    def test_gradient_reaches_each_shard_deduplicated(self):
        table = self.make(table_values(self.rows, self.dim), scheme="div")

        def grads_of(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tfs.embedding_lookup(table, ids))
            grads = tape.gradient(loss, list(table.variables))
            return [(g.indices, g.values) for g in grads]

        got = self.call(grads_of, tf.constant([0, 0, 0, 9, 22, 22]))
        # div over 3 shards of 23 rows: sizes 8, 8, 7.
        self.assertAllEqual(got[0][0], [0])
        self.assertAllClose(got[0][1], 3 * np.ones((1, self.dim)))
        self.assertAllEqual(got[1][0], [1])
        self.assertAllEqual(got[2][0], [6])
        self.assertAllClose(got[2][1], 2 * np.ones((1, self.dim)))

    # ---------------------------------------------------------------- scatter --

    def test_scatter_ops_match_reference(self):
        values = table_values(self.rows, self.dim)
        delta = tf.IndexedSlices(
            tf.constant(np.random.RandomState(3).randn(4, self.dim).astype(np.float32)),
            tf.constant([21, 3, 8, 0], tf.int64),
        )
        for scheme in self.schemes:
            for method in ("scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min"):
                table = self.make(values, scheme=scheme)
                reference = tf.Variable(values)

                def apply(v, i, m, t):
                    getattr(t, m)(tf.IndexedSlices(v, i))
                    return tf.constant(0)

                self.call(bound(apply, m=method, t=table), delta.values, delta.indices)
                getattr(reference, method)(delta)
                self.assertAllClose(table.numpy(), reference.numpy(), msg=f"{scheme} {method}")

    def test_assign_family_and_read_value(self):
        values = table_values(self.rows, self.dim)
        other = table_values(self.rows, self.dim, seed=5)
        for scheme in self.schemes:
            table = self.make(values, scheme=scheme)

            def assigns(a, b, t):
                t.assign(a)
                t.assign_add(b)
                t.assign_sub(0.5 * b)
                return t.read_value()

            got = self.call(bound(assigns, t=table), tf.constant(other), tf.constant(values))
            self.assertAllClose(got, other + 0.5 * values, msg=scheme)
            self.assertAllClose(table.numpy(), other + 0.5 * values)

    # -------------------------------------------------------------- bad input --

    def test_out_of_range_and_negative_ids_fail_and_apply_nothing(self):
        values = table_values(self.rows, self.dim)
        table = self.make(values, scheme="mod")
        for bad in ([3, self.rows], [-1, 2]):

            def lookup(i):
                return tfs.embedding_lookup(table, i)

            with self.assertRaisesRegex(
                tf.errors.InvalidArgumentError, r"Argument `ids` must hold row ids in \[0, 23\)"
            ):
                self.call(lookup, tf.constant(bad))

            def update(i):
                table.scatter_add(tf.IndexedSlices(tf.ones([2, self.dim]), i))
                return tf.constant(0)

            with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "sparse_delta.indices"):
                self.call(update, tf.constant(bad))
            self.assertAllEqual(table.numpy(), values)

    def test_float_and_wrong_rank_ids_are_rejected_early(self):
        table = self.make(table_values(self.rows, self.dim))
        with self.assertRaisesRegex(
            TypeError, "Argument `ids` must be an int32 or int64 tensor. Received: ids of dtype float32"
        ):
            self.call(lambda i: tfs.embedding_lookup(table, i), tf.constant([1.0]))
        with self.assertRaisesRegex(ValueError, "Argument `ids` must have rank 0 to 3. Received: ids of rank 4"):
            self.call(lambda i: tfs.embedding_lookup(table, i), tf.zeros([1, 1, 1, 1], tf.int32))
        with self.assertRaisesRegex(TypeError, "must hold integers"):
            tfs.embedding_lookup(table, [0.5])
