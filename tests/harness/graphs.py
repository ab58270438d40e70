"""Checks on traced graphs: which ops touch a table's shards."""

from __future__ import annotations

import tensorflow as tf

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
    """The node lists of a graph and of every function in its library."""
    yield graph_def.node
    for fn in graph_def.library.function:
        yield fn.node_def


def nodes(concrete_fn) -> list:
    """Every node of a concrete function, nested functions included."""
    return [node for graph in all_graphs(concrete_fn.graph.as_graph_def()) for node in graph]


def op_types(concrete_fn) -> set:
    """Every op type in a concrete function, nested functions included."""
    return {node.op for node in nodes(concrete_fn)}


def handle_uses(graph, variables) -> tuple:
    """`(captured, uses)`: how many of `variables`' handles `graph` captures, and `"<op type> <op name>"` for
    each input of an op of `graph` that is one of those handles."""
    watched = {id(v.handle) for v in variables}
    handles = {internal.ref() for external, internal in graph.captures if id(external) in watched}
    uses = [f"{op.type} {op.name}" for op in graph.get_operations() for t in op.inputs if t.ref() in handles]
    return len(handles), uses


def whole_table_reads(concrete_fn, rows):
    """Ops that touch a shard handle other than by rows, or produce >= `rows` rows."""
    from tf_sharded.table import tally

    problems = []
    graph = concrete_fn.graph
    # The lookup tallies' counters (`tf_sharded.table.tally`) are not tables: the step adds to them.
    counters = {id(v.handle) for v in tally.counter_variables()}
    handles = {i.name for o, i in graph.captures if i.dtype == tf.resource and id(o) not in counters}
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


def sends_per_call(fn, calls: int) -> float:
    """Tensors sent between devices (the `_Send` ops TensorFlow's profiler records) per call of `fn`,
    averaged over `calls` calls, in this process (an in-process cluster's tasks included)."""
    import glob
    import shutil
    import tempfile

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp()
    try:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(calls):
                fn()
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        with open(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0], "rb") as f:
            space.ParseFromString(f.read())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    sends = 0
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        sends += sum(names.get(e.metadata_id, "").endswith(":_Send") for line in plane.lines for e in line.events)
    return sends / calls
