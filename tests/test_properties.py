"""Property tests: any shape, scheme and shard count behaves like a plain table."""

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tf_sharded as tfs
from tests.harness.strategies import uid

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw, rows):
    n = draw(st.integers(1, min(rows, 6)))
    scheme = draw(st.sampled_from(["div", "mod", "balanced"]))
    seed = draw(st.integers(0, 5)) if scheme == "balanced" else 0
    return tfs.PartitionSpec(n, scheme, seed=seed)


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 60))
    dim = draw(st.integers(1, 4))
    values = np.random.RandomState(draw(st.integers(0, 1000))).randn(rows, dim).astype(np.float32)
    ids = np.array(draw(st.lists(st.integers(0, rows - 1), min_size=0, max_size=40)), np.int64)
    return values, ids, draw(layouts(rows)), draw(layouts(rows))


def table_and_reference(values, spec):
    """The sharded table under test and a plain single-device variable with the same values."""
    table = tfs.create_sharded_variable(uid("h"), list(values.shape), initializer=values, partitions=spec)
    return table, tf.Variable(values)


class PropertyTest(tf.test.TestCase):
    @SETTINGS
    @given(cases())
    def test_lookup_equals_plain_table(self, case):
        values, ids, spec, _ = case
        table, reference = table_and_reference(values, spec)
        self.assertAllEqual(tfs.embedding_lookup(table, ids), tf.nn.embedding_lookup(reference, ids))
        self.assertAllEqual(table.numpy(), values)

    @SETTINGS
    @given(cases())
    def test_scatter_add_and_gradient_equal_plain_table(self, case):
        values, ids, spec, _ = case
        table, reference = table_and_reference(values, spec)
        deltas = np.random.RandomState(len(ids)).randn(len(ids), values.shape[1]).astype(np.float32)
        table.scatter_add(tf.IndexedSlices(deltas, ids))
        reference.scatter_add(tf.IndexedSlices(deltas, ids))
        self.assertAllClose(table.numpy(), reference.numpy(), atol=1e-6)
        with tf.GradientTape(persistent=True) as tape:
            ours = tf.reduce_sum(tfs.embedding_lookup(table, ids) ** 2)
            theirs = tf.reduce_sum(tf.nn.embedding_lookup(reference, ids) ** 2)
        dense = np.zeros_like(values)
        for s, g in enumerate(tape.gradient(ours, list(table.variables))):
            if g is None:
                continue
            self.assertIsInstance(g, tf.IndexedSlices)
            rows = table.layout.logical_rows(s)[g.indices.numpy()]
            np.add.at(dense, rows, g.values.numpy())
        self.assertAllClose(dense, tf.convert_to_tensor(tape.gradient(theirs, reference)), atol=1e-5)

    @SETTINGS
    @given(cases())
    def test_checkpoint_round_trip_between_random_layouts(self, case):
        values, _, spec, other = case
        table = tfs.create_sharded_variable(uid("h"), list(values.shape), initializer=values, partitions=spec)
        path = tf.train.Checkpoint(t=table).save(self.get_temp_dir() + f"/{uid('p')}")
        restored = tfs.create_sharded_variable(uid("h"), list(values.shape), initializer="zeros", partitions=other)
        tf.train.Checkpoint(t=restored).restore(path)
        self.assertAllEqual(restored.numpy(), values)

    @SETTINGS
    @given(st.integers(1, 80), st.integers(1, 3), st.integers(0, 9), st.data())
    def test_initial_table_independent_of_layout(self, rows, dim, seed, data):
        a = tfs.create_sharded_variable(uid("h"), [rows, dim], partitions=data.draw(layouts(rows)), seed=seed)
        b = tfs.create_sharded_variable(uid("h"), [rows, dim], partitions=data.draw(layouts(rows)), seed=seed)
        self.assertAllEqual(a.numpy(), b.numpy())


if __name__ == "__main__":
    tf.test.main()
