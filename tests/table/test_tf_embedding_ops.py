"""TensorFlow 2.16's embedding-op tests (`nn_ops/embedding_ops_test.py`), ported onto `tfs.ShardedVariable`.

Each case keeps TF's shapes, ids, dtypes and tolerances. Where TF splits a
table into a list of shard tensors with `partition_strategy="mod"` or
`"div"`, the port builds a `ShardedVariable` with the equivalent
`PartitionSpec` (checking that its shards hold exactly TF's shard values)
and compares it against two references computed in the same test: TF's own
op on that list of shard tensors, and a NumPy computation on the logical
table. Gradients are checked numerically on the shard variables with TF's
bounds.

Not ported, having no `ShardedVariable` form: `ScatterAddSubTest`,
`DynamicStitchOpTest` and `ParallelDynamicStitchOpTest` (TF's own kernels,
not lookups); `testTransform` (the private `_embedding_lookup_and_transform`,
which no entry point exposes); `testGradientsEmbeddingLookupWithComputedParams`
(a list of computed tensors, not a table);
`testShardedDivPartitioningUnknownParamShape` and `testConstruction*`
(graph-mode placeholders and lists of `tf.Variable`: a table always knows
its shape); the first half of the `*_inconsistent_weights` cases (a list of
shards of mixed dtypes: one table has one dtype).
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.harness.strategies import uid

pytestmark = pytest.mark.timeout(600)


def tf_shards(values: np.ndarray, num_shards: int, scheme: str) -> list:
    """TF's split of a table into `num_shards` tensors: row r on shard r % n ("mod"), or contiguous ranges
    with the extra rows on the first shards ("div")."""
    if scheme == "mod":
        return [values[i::num_shards] for i in range(num_shards)]
    base, extra = divmod(len(values), num_shards)
    return np.split(values, np.cumsum([base + (i < extra) for i in range(num_shards)])[:-1])


def random_table(rows, shape=(10,), dtype=np.float32, seed=0):
    """Values in [1, 2), as TF's tests draw them."""
    return (np.random.RandomState(seed).rand(rows, *shape) + 1).astype(dtype)


class PortCase(tf.test.TestCase):
    def table(self, values, num_shards=1, scheme="div", dtype=None, splits=None):
        spec = tfs.PartitionSpec(num_shards, scheme, splits=splits)
        dtype = dtype or tf.as_dtype(values.dtype)
        table = tfs.create_sharded_variable(uid("port"), values.shape, dtype, initializer=values, partitions=spec)
        if splits is None:  # the same shards as TF's partitioned tables
            for ours, theirs in zip(table.variables, tf_shards(values, num_shards, scheme)):
                self.assertAllEqual(tf.cast(ours, tf.float64), tf.cast(tf.constant(theirs, dtype), tf.float64))
        return table

    def gradient_error(self, table, fn, delta):
        """Max |theoretical - numerical| Jacobian entry of `fn()` with respect to the shards of `table`
        (central differences of size `delta`, as TF's gradient checker)."""
        variables = list(table.variables)
        fn = tf.function(fn)

        @tf.function
        def theoretical_row(k):
            with tf.GradientTape() as tape:
                out = tf.reshape(fn(), [-1])[k]
            grads = tape.gradient(out, variables)
            row = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
            return tf.concat([tf.reshape(r, [-1]) for r in row], 0)

        theoretical = [theoretical_row(tf.constant(k)).numpy() for k in range(int(tf.size(fn())))]
        numerical = []
        for v in variables:
            start = v.numpy()
            for j in range(start.size):
                values = []
                for step in (delta, -delta):
                    moved = start.copy().ravel()
                    moved[j] += step
                    v.assign(moved.reshape(start.shape))
                    values.append(tf.reshape(fn(), [-1]).numpy().astype(np.float64))
                v.assign(start)
                numerical.append((values[0] - values[1]) / (2 * delta))
        return float(np.max(np.abs(np.array(theoretical) - np.array(numerical).T)))


class EmbeddingLookupTest(PortCase):
    def test_simple_sharded(self):
        values = random_table(4)
        table = self.table(values, 2, "mod")
        ids = tf.constant([0, 0], tf.int32)
        result = tf.nn.embedding_lookup(table, ids)
        self.assertAllEqual(result, values[[0, 0]])
        self.assertAllEqual(result, tf.compat.v1.nn.embedding_lookup(tf_shards(values, 2, "mod"), ids))
        self.assertEqual(result.shape, (2, 10))

    def test_max_norm(self):
        table = self.table(np.array([[2.0]], np.float32))
        self.assertAllEqual(tf.nn.embedding_lookup([table], tf.constant([0]), max_norm=1.0), [[1.0]])
        values = np.array([[2.0, 4.0], [3.0, 1.0]], np.float32)
        table = self.table(values, 2, "mod")
        result = tf.nn.embedding_lookup([table], tf.constant([0, 1]), max_norm=2.0)
        self.assertAllClose(result, 2 * values / np.linalg.norm(values, axis=1, keepdims=True))

    def test_sharded_mod_and_div_int32_and_int64_ids(self):
        # 13 rows of 10 in 5 shards (3, 3, 3, 2, 2 rows), 30 ids: repeats included.
        values = random_table(13)
        ids = np.random.RandomState(1).randint(13, size=30)
        for scheme, id_dtype in itertools.product(("mod", "div"), (tf.int32, tf.int64)):
            with self.subTest(scheme=scheme, ids=id_dtype.name):
                table = self.table(values, 5, scheme)
                tensor_ids = tf.constant(ids, id_dtype)
                result = tf.compat.v1.nn.embedding_lookup(table, tensor_ids, partition_strategy=scheme)
                theirs = tf.compat.v1.nn.embedding_lookup(
                    tf_shards(values, 5, scheme), tensor_ids, partition_strategy=scheme
                )
                self.assertAllEqual(result, values[ids])
                self.assertAllEqual(result, theirs)
                self.assertEqual(result.shape, theirs.shape)
                self.assertAllEqual(tfs.embedding_lookup(table, tensor_ids), values[ids])

    def test_uneven_splits(self):
        # No TF partitioner makes these shards: TF's op on the whole table is the reference.
        values = random_table(13)
        ids = tf.constant(np.random.RandomState(2).randint(13, size=30), tf.int64)
        table = self.table(values, 3, "div", splits=[1, 9, 3])
        self.assertEqual([v.shape[0] for v in table.variables], [1, 9, 3])
        self.assertAllEqual(tf.nn.embedding_lookup(table, ids), tf.nn.embedding_lookup(values, ids))

    def test_gradients(self):
        values = random_table(9, (2,))
        id_values = np.random.RandomState(3).randint(9, size=10)
        for ids_shape, num_shards in itertools.product(((10,), (2, 5)), (1, 3)):
            with self.subTest(ids_shape=ids_shape, num_shards=num_shards):
                table = self.table(values, num_shards, "mod")
                ids = tf.constant(id_values.reshape(ids_shape), tf.int32)
                self.assertEqual(tf.nn.embedding_lookup(table, ids).shape, ids_shape + (2,))
                error = self.gradient_error(table, lambda: tf.nn.embedding_lookup(table, ids), 1e-3)
                self.assertLess(error, 1e-4)

    def test_higher_rank(self):
        rng = np.random.RandomState(8)
        for params_shape in ((12,), (6, 3)):
            params = rng.randn(*params_shape)
            for ids_shape, shards in itertools.product(((3, 2), (4, 3)), (1, 2, 3)):
                ids = rng.randint(params.shape[0], size=np.prod(ids_shape)).reshape(ids_shape)
                with self.subTest(params=params_shape, ids=ids_shape, shards=shards):
                    table = self.table(params, shards, "mod")
                    self.assertAllEqual(tf.nn.embedding_lookup(table, ids), tf.gather(params, ids))

    def test_higher_rank_max_norm(self):
        rng = np.random.RandomState(8)
        for params_shape in ((12,), (6, 3), (6, 2, 3)):  # rows of rank 0, 1 and 2
            params = 2 * np.ones(params_shape)
            norms = np.sqrt(np.sum(params * params, axis=tuple(range(1, params.ndim)), keepdims=True))
            for ids_shape, shards in itertools.product(((), (3,), (4, 3), (2, 3, 4)), (1, 2, 3)):
                ids = rng.randint(params.shape[0], size=np.prod(ids_shape, dtype=np.int64)).reshape(ids_shape)
                with self.subTest(params=params_shape, ids=ids_shape, shards=shards):
                    table = self.table(params, shards, "mod")
                    result = tf.nn.embedding_lookup(table, ids, max_norm=1.0)
                    self.assertAllClose(result, np.take(params / norms, ids, axis=0))
                    self.assertAllClose(result, tf.nn.embedding_lookup(params, ids, max_norm=1.0))

    def test_ragged_max_norm(self):
        table = self.table(np.array([[2.0]], np.float32))
        ids = tf.ragged.constant([[0, 0], [0]], dtype=tf.int32)
        self.assertAllEqual(tf.nn.embedding_lookup([table], ids, max_norm=1.0), [[[1.0], [1.0]], [[1.0]]])


def random_bags(rng, batch_size, vocab_size, ragged=False):
    """1 to 5 ids per example (weights in [1, 2)), as TF's sparse tests draw them; `ragged`: as RaggedTensors."""
    counts = rng.randint(1, 6, size=batch_size)
    ids = rng.randint(vocab_size, size=counts.sum())
    weights = 1 + rng.rand(counts.sum())
    indices = [[b, k] for b, n in enumerate(counts) for k in range(n)]
    sp_ids = tf.SparseTensor(tf.constant(indices, tf.int64), tf.constant(ids, tf.int32), [batch_size, 6])
    sp_weights = tf.SparseTensor(tf.constant(indices, tf.int64), tf.constant(weights, tf.float32), [batch_size, 6])
    if ragged:
        sp_ids, sp_weights = tf.RaggedTensor.from_sparse(sp_ids), tf.RaggedTensor.from_sparse(sp_weights)
    return sp_ids, sp_weights, np.split(ids, np.cumsum(counts)[:-1]), np.split(weights, np.cumsum(counts)[:-1])


def combined(values, bags, bag_weights, combiner):
    """NumPy: each bag's weighted sum of rows, divided by the weights' sum ("mean") or root sum of squares."""
    out = []
    for ids, weights in zip(bags, bag_weights):
        total = np.tensordot(weights, values[ids].astype(np.float64), axes=1)
        scale = {"sum": 1.0, "mean": np.sum(weights), "sqrtn": np.sqrt(np.sum(weights * weights))}[combiner]
        out.append(total / scale)
    return np.array(out)


class EmbeddingLookupSparseTest(PortCase):
    """TF's cases run with `SparseTensor` and `RaggedTensor` ids, and `allow_fast_lookup` both ways (TF's
    option to look up each distinct id once, which a table always does)."""

    def test_embedding_lookup_sparse(self):
        rng = np.random.RandomState(4)
        dtypes = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
        cases = itertools.product((1, 5), ("sum", "mean", "sqrtn"), dtypes, (True, False), (True, False), (True, False))
        for shards, combiner, dtype, no_weights, ragged, fast in cases:
            with self.subTest(shards=shards, combiner=combiner, dtype=dtype.name, weights=not no_weights,
                              ragged=ragged, allow_fast_lookup=fast):  # fmt: skip
                sp_ids, sp_weights, bags, bag_weights = random_bags(rng, 10, 13, ragged)
                values = tf.cast(random_table(13, (2, 5), np.float64, seed=rng.randint(1000)), dtype).numpy()
                table = self.table(values, shards, "mod", dtype)
                weights = None if no_weights else sp_weights
                result = tf.nn.embedding_lookup_sparse(table, sp_ids, weights, combiner, allow_fast_lookup=fast)
                theirs = tf.compat.v1.nn.embedding_lookup_sparse(
                    [tf.constant(s, dtype) for s in tf_shards(values, shards, "mod")], sp_ids, weights,
                    partition_strategy="mod", combiner=combiner, allow_fast_lookup=fast,
                )  # fmt: skip
                self.assertEqual(result.dtype, dtype)
                tol = {tf.bfloat16: 1e-2, tf.float16: 1e-3}.get(dtype, 1e-6)
                used = [np.ones(len(b)) for b in bags] if no_weights else bag_weights
                expected = combined(values, bags, used, combiner)
                self.assertAllClose(tf.cast(result, tf.float64), expected, rtol=tol, atol=tol)
                self.assertAllClose(tf.cast(result, tf.float64), tf.cast(theirs, tf.float64), rtol=tol, atol=tol)
        # Traced with unknown batch size: [None] + the row shape, as TF's static shape.
        table = self.table(random_table(13, (2, 5)), 5, "mod")
        for spec in (tf.SparseTensorSpec([None, 6], tf.int32), tf.RaggedTensorSpec([None, None], tf.int32)):
            lookup = tf.function(lambda ids: tf.nn.embedding_lookup_sparse(table, ids, None))
            self.assertEqual(lookup.get_concrete_function(spec).output_shapes.as_list(), [None, 2, 5])

    def test_missing_in_sparse_ids(self):
        table = self.table(np.ones((4, 5), np.float32), 2, "mod")
        sp_ids = tf.SparseTensor(tf.constant([[1, 0], [3, 0]], tf.int64), tf.constant([0, 2], tf.int32), [4, 1])
        sp_weights = tf.SparseTensor(sp_ids.indices, tf.constant([1.0, 1.0]), [4, 1])
        for combiner, ragged, fast in itertools.product(("sum", "mean", "sqrtn"), (True, False), (True, False)):
            ids, weights = sp_ids, sp_weights
            if ragged:
                ids, weights = tf.RaggedTensor.from_sparse(ids), tf.RaggedTensor.from_sparse(weights)
            result = tf.nn.embedding_lookup_sparse(table, ids, weights, combiner=combiner, allow_fast_lookup=fast)
            self.assertAllClose(result, [np.zeros(5), np.ones(5), np.zeros(5), np.ones(5)])

    @pytest.mark.slow  # over 5 s here
    def test_gradients(self):
        # Numerical checks for both id types; `allow_fast_lookup` changes nothing here, checked exactly below.
        rng = np.random.RandomState(5)
        cases = itertools.product((1, 3), ("sum", "mean", "sqrtn"), (tf.float32, tf.float64), (True, False),
                                  (True, False))  # fmt: skip
        for shards, combiner, dtype, no_weights, ragged in cases:
            with self.subTest(shards=shards, combiner=combiner, dtype=dtype.name, weights=not no_weights,
                              ragged=ragged):  # fmt: skip
                sp_ids, sp_weights, _, _ = random_bags(rng, 4, 12, ragged)
                table = self.table(random_table(12, (2, 3), dtype.as_numpy_dtype, rng.randint(1000)), shards, "mod")
                weights = None if no_weights else sp_weights
                fn = lambda: tf.nn.embedding_lookup_sparse(table, sp_ids, weights, combiner=combiner)  # noqa: E731
                self.assertEqual(fn().shape, (4, 2, 3))
                error = self.gradient_error(table, fn, 1e-3)
                self.assertLess(error, 1e-5 if dtype == tf.float64 else 2e-3)
                fast = lambda: tf.nn.embedding_lookup_sparse(table, sp_ids, weights, combiner, allow_fast_lookup=True)  # noqa: E731
                for slow_grad, fast_grad in zip(*(self.shard_gradients(table, f) for f in (fn, fast))):
                    self.assertAllEqual(slow_grad, fast_grad)

    def shard_gradients(self, table, fn):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn() * tf.reshape(tf.range(24, dtype=table.dtype), [4, 2, 3]))
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, list(table.variables))]

    def test_sparse_gradient_of_a_table(self):
        # TF checks the IndexedSlices gradient of one resource variable: distinct rows, each row's summed
        # update. Here each shard's gradient, its local rows mapped back to table rows.
        rng = np.random.RandomState(7)
        sp_ids, sp_weights, bags, bag_weights = random_bags(rng, 32, 128)
        for combiner, dtype, no_weights in itertools.product(("sum", "mean", "sqrtn"), (tf.float32, tf.float64),
                                                             (True, False)):  # fmt: skip
            with self.subTest(combiner=combiner, dtype=dtype.name, weights=not no_weights):
                values = (rng.uniform(size=(128, 16)) + 1).astype(dtype.as_numpy_dtype)
                table = self.table(values, 3, "mod")
                weights = None if no_weights else sp_weights
                with tf.GradientTape() as tape:
                    out = tf.nn.embedding_lookup_sparse(table, sp_ids, weights, combiner=combiner)
                grads = tape.gradient(out, list(table.variables))
                expected = np.zeros((128, 16))
                for ids, w in zip(bags, [np.ones(len(b)) for b in bags] if no_weights else bag_weights):
                    scale = {"sum": 1.0, "mean": np.sum(w), "sqrtn": np.sqrt(np.sum(w * w))}[combiner]
                    np.add.at(expected, ids, np.outer(w / scale, np.ones(16)))
                touched = set()
                for shard, grad in enumerate(grads):
                    self.assertIsInstance(grad, tf.IndexedSlices)
                    self.assertAllEqual(grad.dense_shape, table.variables[shard].shape)
                    rows = grad.indices.numpy() * 3 + shard  # "mod": local row r of shard s is table row 3r + s
                    summed = np.zeros((128, 16))
                    np.add.at(summed, rows, grad.values.numpy())
                    self.assertAllClose(summed[rows], expected[rows], rtol=1e-5)
                    touched.update(rows.tolist())
                self.assertEqual(touched, set(np.concatenate(bags).tolist()))

    def test_incompatible_shapes_and_types(self):
        table = self.table(random_table(10), 1)
        sp_ids = tf.SparseTensor(tf.constant([[0, 0], [0, 1], [1, 0]], tf.int64), tf.constant([0, 1, 2]), [2, 2])
        sp_weights = tf.SparseTensor(tf.constant([[0, 0], [0, 1]], tf.int64), tf.constant([12.0, 5.0]), [1, 2])
        for ragged, fast in itertools.product((True, False), (True, False)):
            ids, weights = sp_ids, sp_weights
            if ragged:
                ids, weights = tf.RaggedTensor.from_sparse(ids), tf.RaggedTensor.from_sparse(weights)
            with self.assertRaises(ValueError):
                tf.nn.embedding_lookup_sparse(table, ids, weights, combiner="mean", allow_fast_lookup=fast)
        # SparseTensor ids with RaggedTensor weights.
        ones = self.table(np.ones((4, 5), np.float32))
        ids = tf.SparseTensor(tf.constant([[1, 0], [3, 0]], tf.int64), tf.constant([0, 2], tf.int32), [4, 1])
        weights = tf.RaggedTensor.from_sparse(tf.SparseTensor(ids.indices, tf.constant([1.0, 1.0]), [4, 1]))
        with self.assertRaises(TypeError):
            tf.nn.embedding_lookup_sparse(ones, ids, weights)


safe = tf.nn.safe_embedding_lookup_sparse


class SafeEmbeddingLookupSparseTest(PortCase):
    """TF's cases: ids -1 are invalid and pruned, weights <= 0 pruned (the combiner is "mean"), empty bags
    read zeros or `default_id`'s row."""

    def weights_table(self, num_shards=1):
        # TF: a 4 x 4 table from a truncated normal (stddev 1 / sqrt(4)), `fixed_size_partitioner` ("div").
        initializer = tf.keras.initializers.TruncatedNormal(stddev=0.5, seed=6)
        return tfs.create_sharded_variable(uid("safe"), [4, 4], initializer=initializer, partitions=num_shards)

    def ids_2d(self):
        # Rows: valid ids and one -1 (weighted mean); all invalid; none; one id; all weights <= 0.
        indices = [[0, 0], [0, 1], [0, 2], [1, 0], [3, 0], [4, 0], [4, 1]]
        return self.bags(indices, [5, 4])

    def ids_3d(self):
        # The same bags at positions [0, 0], [0, 1], [0, 2] (none), [1, 0], [1, 1], [1, 2] (none).
        indices = [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
        return self.bags(indices, [2, 3, 4])

    def bags(self, indices, shape):
        ids = tf.SparseTensor(tf.constant(indices, tf.int64), tf.constant([0, 1, -1, -1, 2, 0, 1], tf.int64), shape)
        weights = [1.0, 2.0, 1.0, 1.0, 3.0, 0.0, -0.5]
        return ids, tf.SparseTensor(ids.indices, tf.constant(weights, tf.float32), shape)

    def test_2d(self):
        zero = [0.0] * 4
        for shards, ragged, fast in itertools.product((1, 3), (False, True), (False, True)):
            table = self.table_of(shards)
            w = table.numpy()
            ids, weights = self.ids_2d()
            if ragged:
                ids, weights = tf.RaggedTensor.from_sparse(ids), tf.RaggedTensor.from_sparse(weights)
            kw = {"allow_fast_lookup": fast}
            weighted = (1.0 * w[0] + 2.0 * w[1]) / 3.0
            self.same(table, lambda p: safe(p, ids, weights, **kw), [weighted, zero, zero, w[2], zero])
            self.same(table, lambda p: safe(p, ids, weights, default_id=3, **kw), [weighted, w[3], w[3], w[2], w[3]])
            mean = (w[0] + w[1]) / 2.0
            self.same(table, lambda p: safe(p, ids, None, **kw), [mean, zero, zero, w[2], mean])
            self.same(
                table,
                lambda p: tf.compat.v1.nn.safe_embedding_lookup_sparse(p if isinstance(p, list) else [p], ids, **kw),
                [mean, zero, zero, w[2], mean],
            )

    def test_3d(self):
        zero = [0.0] * 4
        for shards in (1, 3):
            table = self.table_of(shards)
            w = table.numpy()
            ids, weights = self.ids_3d()
            weighted, mean = (1.0 * w[0] + 2.0 * w[1]) / 3.0, (w[0] + w[1]) / 2.0
            self.same(table, lambda p: safe(p, ids, weights), [[weighted, zero, zero], [w[2], zero, zero]])
            self.same(
                table,
                lambda p: safe(p, ids, weights, default_id=3),
                [[weighted, w[3], w[3]], [w[2], w[3], w[3]]],
            )
            self.same(table, lambda p: safe(p, ids, None), [[mean, zero, zero], [w[2], mean, zero]])

    def test_inconsistent_weights(self):
        # A float64 table with float32 weights: TF refuses the conversion (ValueError), so do we.
        table = tfs.create_sharded_variable(uid("safe64"), [4, 4], tf.float64, partitions=3)
        for ids, weights in (self.ids_2d(), self.ids_3d()):
            with self.assertRaises(ValueError):
                safe(table, ids, weights)
            with self.assertRaises(ValueError):
                safe(tf.Variable(table.numpy()), ids, weights)

    def table_of(self, shards):
        table = self.weights_table(shards)
        self.assertEqual([v.shape[0] for v in table.variables], [4] if shards == 1 else [2, 1, 1])
        return table

    def same(self, table, call, expected):
        """`call(params)` on the table and, with TF's op, on its shards as a list of tensors."""
        self.assertAllClose(call(table), expected)
        self.assertAllClose(call([tf.constant(v.numpy()) for v in table.variables]), expected)


if __name__ == "__main__":
    tf.test.main()
