"""The training path never reads or concatenates a whole table."""

import tensorflow as tf

import tf_sharded as tfs
from tests.strategy_bodies import uid

# Ops allowed to consume a shard's resource handle: row gathers and row scatters.
ROW_OPS = {
    "VariableShape",
    "ResourceGather",
    "ResourceScatterAdd",
    "ResourceScatterSub",
    "ResourceScatterUpdate",
    "ResourceScatterMax",
    "ResourceScatterMin",
}


def all_graphs(graph_def):
    yield graph_def.node
    for fn in graph_def.library.function:
        yield fn.node_def


def whole_table_reads(concrete_fn, rows):
    """Ops that touch a shard handle other than by rows, or produce >= `rows` rows."""
    problems = []
    graph = concrete_fn.graph
    handles = {t.name for t in graph.internal_captures if t.dtype == tf.resource}
    for op in graph.get_operations():
        for t in op.inputs:
            if t.name in handles and op.type not in ROW_OPS:
                problems.append(f"{op.type} reads {t.name}")
        for out in op.outputs:
            dims = out.shape.as_list() if out.shape.rank else []
            if dims and dims[0] is not None and dims[0] >= rows:
                problems.append(f"{op.type} {op.name} produces shape {dims}")
    # Nested bodies (cond branches, gradient functions) must not read variables either.
    for nodes in all_graphs(graph.as_graph_def()):
        for node in nodes:
            if node.op == "ReadVariableOp":
                problems.append(f"{node.op} {node.name}")
    return problems


class GraphTest(tf.test.TestCase):
    rows = 1009

    def step_fn(self, table, lookup):
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(lookup(table, ids) ** 2)
            grads = tape.gradient(loss, list(table.variables))
            for v, g in zip(table.variables, grads):
                v.scatter_sub(tf.IndexedSlices(0.1 * g.values, g.indices, g.dense_shape))
            return loss

        return tf.function(step).get_concrete_function(tf.TensorSpec([None, 3], tf.int64))

    def test_lookup_and_update_step_touches_rows_only(self):
        for scheme in ("div", "mod", "balanced"):
            table = tfs.create_sharded_variable(uid("g"), [self.rows, 8], partitions=3, scheme=scheme)
            fn = self.step_fn(table, tfs.embedding_lookup)
            self.assertEqual(whole_table_reads(fn, min(table.layout.shard_sizes)), [], msg=scheme)
            sparse = tf.function(
                lambda ids: tfs.embedding_lookup_sparse(table, ids, combiner="sqrtn")
            ).get_concrete_function(tf.RaggedTensorSpec([None, None], tf.int64, 1))
            self.assertEqual(whole_table_reads(sparse, min(table.layout.shard_sizes)), [])

    def test_checker_catches_a_full_read(self):
        # The same step through read_value() must be flagged, so the test above can fail.
        table = tfs.create_sharded_variable(uid("g"), [self.rows, 8], partitions=3)
        fn = self.step_fn(table, lambda t, ids: tf.nn.embedding_lookup(t.read_value(), ids))
        self.assertNotEqual(whole_table_reads(fn, min(table.layout.shard_sizes)), [])


if __name__ == "__main__":
    tf.test.main()
