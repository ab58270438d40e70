"""Every registered table kind x placement x strategy, against a single-device reference.

The strategies: the default strategy, OneDeviceStrategy, MirroredStrategy on the 4 virtual CPUs and the
in-process parameter-server cluster (its tests run in the cluster's child process, see conftest.py), and, in
processes of their own, MultiWorkerMirroredStrategy over 2 workers and HybridStrategy with 2 table servers
(`PROCESS_SPECS`: their workers call `run_matrix`, which checks the same combinations one after another).

The matrix is generated from the registry (`registry.kinds()`, `registry.placements()`) when this module is
collected; `tests/conformance/minimal_kind.py` registers a kind of its own first, which the matrix picks up
as it does the library's. A kind takes part through its adapter (`adapters.py`). A combination is run where
the strategy makes a table of that kind with that placement (asked for with the strategy's default or the
placement's `placement=` option) and a lookup route is registered for the pair; it is skipped otherwise,
with the strategy's or the registry's answer as the reason. Each strategy lists the combinations it is
expected to run (`expected`), so that none turns into a skip unnoticed.

Checks, each against a plain `tf.Variable` on one device computed in the same test:
* lookups of keys with repeats, in replica context, one batch per replica (one replica meets none);
* SGD and Adagrad steps: each step's loss, then the live keys and every live row;
* a trained table's rows looked up in the other forms: ids of rank 3 through `tf.nn.embedding_lookup`, and
  weighted ragged rows (an empty one among them) through `tfs.embedding_lookup_sparse`;
* the Adagrad table's checkpoint read into tables of other layouts under the default strategy (and into a
  plain variable where the kind's checkpoints go into one), then one of those written and read back into a
  table of this strategy, kind and placement, which then writes the same entries and object graph as the
  default strategy's table did, so a checkpoint written under any strategy and placement reads under any other;
  every read gives the same rows and the same per-key columns the kind keeps beside them (a dynamic table's
  optimizer slots, whether its optimizer is built before the read or after, and its counters);
* where the placement keeps a copy per replica, the copies agree after training and after a restore.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.conformance import minimal_kind
from tests.conformance.adapters import ADAPTERS
from tests.harness.strategies import mirrored, per_replica, ps_strategy, uid
from tf_sharded.errors import UnsupportedStrategyError
from tf_sharded.table import registry

pytestmark = pytest.mark.timeout(300)


class DefaultSpec:
    """The default strategy: one replica, steps in a `tf.function`."""

    name, replicas, marks = "default", 1, ()
    local_replicas = 1  # the replicas of this process (all of them, but under a multi-process strategy)
    expected = {
        ("fixed", "local"),
        ("dynamic", "local"),
        ("dynamic_string", "local"),
        (minimal_kind.CONSTANT.name, "local"),
    }

    def strategy(self):
        return tf.distribute.get_strategy()

    def local(self):
        """Context of the tables made under the default strategy beside this one's."""
        return contextlib.nullcontext()

    def runner(self, fn):
        """`run(arrays)`: `fn` in replica context, replica r given `arrays[r]`; the replicas' results."""
        strategy = self.strategy()
        step = tf.function(lambda ids: strategy.run(fn, args=(ids,)), reduce_retracing=True)
        return lambda arrays: [step(tf.constant(arrays[0]))]


class MirroredSpec(DefaultSpec):
    """MirroredStrategy on the 4 virtual CPUs (the process's one instance)."""

    name, replicas, marks = "mirrored", 4, (pytest.mark.mirrored,)
    local_replicas = 4
    expected = {
        ("fixed", "device"),
        ("fixed", "host"),
        ("fixed", "replicas"),
        ("dynamic", "host"),
        ("dynamic_string", "host"),
        (minimal_kind.CONSTANT.name, "local"),
    }

    def strategy(self):
        return mirrored()

    def runner(self, fn):
        strategy = self.strategy()
        step = tf.function(lambda ids: strategy.run(fn, args=(ids,)), reduce_retracing=True)
        return lambda arrays: strategy.experimental_local_results(step(per_replica(strategy, arrays)))


class OneDeviceSpec(DefaultSpec):
    """OneDeviceStrategy on the first CPU."""

    name = "one_device"
    _made = []

    def strategy(self):
        if not self._made:
            self._made.append(tf.distribute.OneDeviceStrategy("/cpu:0"))
        return self._made[0]


class ParameterServerSpec(DefaultSpec):
    """The in-process parameter-server cluster (2 ps, 2 workers): each step scheduled on a worker and joined."""

    name, marks = "parameter_server", (pytest.mark.ps_cluster,)
    _made = []

    def strategy(self):
        if not self._made:
            strategy = ps_strategy()
            self._made.append((strategy, tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)))
        return self._made[0][0]

    def local(self):
        return tf.device("/job:chief/replica:0/task:0/device:CPU:0")

    def runner(self, fn):
        strategy = self.strategy()
        coordinator = self._made[0][1]
        step = tf.function(lambda ids: strategy.run(fn, args=(ids,)), reduce_retracing=True)

        def run(arrays):
            result = coordinator.schedule(step, args=(tf.constant(arrays[0]),))
            coordinator.join()
            return [result.fetch()]

        return run


class ProcessSpec(DefaultSpec):
    """A strategy of processes of their own, made there: the spec of the strategy a process was given."""

    def __init__(self, strategy=None):
        self._strategy = strategy

    def strategy(self):
        return self._strategy


class MultiWorkerSpec(ProcessSpec):
    """MultiWorkerMirroredStrategy of 2 worker processes, a CPU replica each. Its combinations run inside the
    workers (`run_matrix`, called by tests/table/dynamic/test_dynamic_multi_worker.py), each worker checking
    every replica's results, gathered over the collectives, against its own single-device reference."""

    name, replicas, local_replicas, marks = "multi_worker", 2, 1, ()
    expected = {
        ("fixed", "device"),
        ("fixed", "host"),
        ("fixed", "workers"),
        ("dynamic", "host"),
        ("dynamic", "workers"),
        ("dynamic_string", "host"),
        ("dynamic_string", "workers"),
        (minimal_kind.CONSTANT.name, "local"),
    }

    def runner(self, fn):
        strategy = self.strategy()
        task, steps, traced = strategy.cluster_resolver.task_id, {}, {}

        def step(ids):
            # Every result of every replica, gathered over the workers with each replica's leading size.
            out = strategy.run(fn, args=(ids,))
            traced[ids.dtype] = out  # the results' structure and ranks
            results = [tf.reshape(t, [-1]) if t.shape.rank == 0 else t for t in tf.nest.flatten(out)]
            return [(strategy.gather(t, 0), strategy.gather(tf.shape(t)[:1], 0)) for t in results]

        def run(arrays):
            # This worker's replica's keys, of a shape every worker traces alike (the last one meets none).
            mine = tf.constant(arrays[task])
            if mine.dtype not in steps:
                steps[mine.dtype] = tf.function(step, input_signature=[tf.TensorSpec([None], mine.dtype)])
            got = steps[mine.dtype](mine)
            scalar = [t.shape.rank == 0 for t in tf.nest.flatten(traced[mine.dtype])]
            flat = [np.split(t.numpy(), np.cumsum(sizes.numpy())[:-1]) for t, sizes in got]
            per_replica = [[t[r][0] if s else t[r] for t, s in zip(flat, scalar)] for r in range(len(arrays))]
            return [tf.nest.pack_sequence_as(traced[mine.dtype], values) for values in per_replica]

        return run


class HybridSpec(ProcessSpec):
    """HybridStrategy with one worker (one replica) and two table servers. Its combinations run in the worker's
    process (`run_matrix`, called by tests/strategy/test_hybrid.py)."""

    name = "hybrid"
    expected = {
        ("fixed", "servers"),
        ("dynamic", "servers"),
        ("dynamic_string", "servers"),
        (minimal_kind.CONSTANT.name, "local"),
    }


SPECS = {spec.name: spec for spec in (DefaultSpec(), OneDeviceSpec(), MirroredSpec(), ParameterServerSpec())}
# Run inside their own processes: `run_matrix(MultiWorkerSpec(strategy))` by the workers of
# tests/table/dynamic/test_dynamic_multi_worker.py, `run_matrix(HybridSpec(strategy))` by the worker of
# tests/strategy/test_hybrid.py.
PROCESS_SPECS = (MultiWorkerSpec, HybridSpec)
KINDS = [k.name for k in registry.kinds()]
PLACEMENTS = [p.name for p in registry.placements()]
# A dynamic kind's case takes 4 to 18 s (its policies' steps, traced under the strategy): `make test` runs it.
SLOW_KINDS = ("dynamic", "dynamic_string")
MATRIX = [
    pytest.param(s, a, p, marks=SPECS[s].marks + ((pytest.mark.slow,) if a in SLOW_KINDS else ()), id=f"{s}-{a}-{p}")
    for s in SPECS
    for a in ADAPTERS
    for p in PLACEMENTS
]
_MADE = {}  # (strategy, kind, placement) -> (option, layout) that made it, or the reason it is skipped


def make(spec, kind: str, placement: str, layout=None):
    """A table of adapter `kind`'s with `placement` under `spec`'s strategy, with `layout` (the adapter's by
    default) where the placement takes it; skips the test, saying why, where the strategy makes no such table."""
    adapter, wanted = ADAPTERS[kind], registry.placement(placement)
    strategy = spec.strategy()
    key = (spec.name, kind, placement)
    found = _made(spec, kind, placement)
    if isinstance(found, str):
        pytest.skip(found)
    option, default_layout = found
    for attempt in ([layout] if layout is not None else []) + [default_layout]:
        try:
            with strategy.scope():
                table = adapter.make(strategy, uid(adapter.kind), option, **attempt)
        except ValueError:
            continue  # the placement fixes its own layout
        assert table.placement_type is wanted
        return table
    raise AssertionError(f"{key}: no layout of {layout} and {default_layout} made a table")


def _made(spec, kind: str, placement: str):
    """`_probe`'s answer for the combination, asked once per process."""
    key = (spec.name, kind, placement)
    if key not in _MADE:
        adapter = ADAPTERS[kind]
        _MADE[key] = _probe(spec, adapter, registry.kind(adapter.kind), registry.placement(placement))
    return _MADE[key]


def _probe(spec, adapter, kind, wanted):
    """`(placement= option, layout)` that make a table of `kind` placed `wanted` under `spec`, or why none does."""
    try:
        registry.lookup_route(wanted, kind)
    except NotImplementedError as e:
        return str(e)
    strategy, reasons = spec.strategy(), []
    for option in dict.fromkeys([None, wanted.option]):
        for layout in (adapter.layout, {}):  # the adapter's layout, else the one the placement fixes
            try:
                with strategy.scope():
                    table = adapter.make(strategy, uid(kind.name), option, **layout)
            except (ValueError, UnsupportedStrategyError) as e:
                reasons.append(f"placement={option!r} {layout}: {e}")
                continue
            if table.placement_type is wanted:
                return option, layout
            reasons.append(f"placement={option!r} made a table placed {table.placement_type.name}")
            break
    return f"{spec.name} makes no {kind.name} table placed {wanted.name}: " + "; ".join(reasons)


# ------------------------------------------------------------------------------------------------- the matrix --


def test_every_registered_kind_has_an_adapter_and_the_minimal_kind_is_in_the_matrix():
    adapted = {adapter.kind for adapter in ADAPTERS.values()}
    assert set(KINDS) <= adapted, f"kinds without a conformance adapter: {set(KINDS) - adapted}"
    assert minimal_kind.CONSTANT.name in KINDS
    assert {"fixed", "dynamic"} <= set(KINDS)
    assert {"local", "device", "host", "replicas"} <= set(PLACEMENTS)
    # Every placement is some strategy's, in this process or in the processes of another.
    expected = {placement for spec in list(SPECS.values()) + list(PROCESS_SPECS) for _, placement in spec.expected}
    assert expected == set(PLACEMENTS), set(PLACEMENTS) - expected


@pytest.mark.parametrize("spec", [pytest.param(s, marks=SPECS[s].marks) for s in SPECS])
def test_each_strategy_runs_the_combinations_it_is_expected_to(spec):
    spec = SPECS[spec]
    runs = {(k, p) for k in ADAPTERS for p in PLACEMENTS if not isinstance(_made(spec, k, p), str)}
    assert runs == spec.expected, {k: v for k, v in _MADE.items() if k[0] == spec.name}


OPTIMIZERS = {
    "sgd": (lambda: tfs.optimizers.SGD(0.2), lambda: keras.optimizers.SGD(0.2)),
    "adagrad": (lambda: tfs.optimizers.Adagrad(0.3), lambda: keras.optimizers.Adagrad(0.3)),
}


class Reference:
    """The rows of `keys` (a table's live keys, then those the batches add, in first-seen order) in one plain
    variable on one device, trained by a Keras optimizer (if any) on the loss the tables are trained on."""

    def __init__(self, adapter, table, batches, optimizer=None):
        self.keys = list(dict.fromkeys(adapter.live_keys(table) + [k for b in batches for k in b.tolist()]))
        self.row = {k: i for i, k in enumerate(self.keys)}
        self.var = tf.Variable(adapter.initial(table, self.keys))
        self.optimizer = optimizer

    def rows(self, keys) -> np.ndarray:
        return self.var.numpy()[np.array([self.row[k] for k in keys.tolist()], np.int64)]

    def step(self, keys) -> float:
        ids = tf.constant([self.row[k] for k in keys.tolist()], tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.gather(self.var, ids) - 1.0))
        if self.optimizer is not None:
            # Dense: a row's gradient summed over its repeats before the optimizer sees it, as the tables sum it.
            self.optimizer.apply_gradients([(tf.convert_to_tensor(tape.gradient(loss, self.var)), self.var)])
        return float(loss)


def run_steps(spec, adapter, tables, optimizers, batches, references=()):
    """Steps looking up each batch's keys in each of `tables`, split over the replicas (the last of several meets
    none), and training the table with its optimizer (if any) on `sum((row - 1) ** 2)`, all tables in one step.
    With `references` (a `Reference` per table), checks each replica's rows and each step's loss (summed over
    the replicas) against its reference's, the reference stepped after."""
    variables = [adapter.variables(t) if o is not None else [] for t, o in zip(tables, optimizers)]
    with spec.strategy().scope():
        for optimizer, held in zip(optimizers, variables):
            if optimizer is not None:
                optimizer.build(held)

    def fn(ids):
        out = []
        for table, optimizer, held in zip(tables, optimizers, variables):
            with tf.GradientTape() as tape:
                rows = tfs.embedding_lookup(table, ids)
                loss = tf.reduce_sum(tf.square(rows - 1.0))
            if optimizer is not None:
                optimizer.apply_gradients(zip(tape.gradient(loss, held), held))
            out.append((rows, loss))
        return out

    run = spec.runner(fn)
    for keys in batches:
        parts = split_keys(spec, keys)
        got = run(parts)
        assert len(got) == len(parts)
        for i, reference in enumerate(references):
            for ids, replica in zip(parts, got):
                np.testing.assert_allclose(np.asarray(replica[i][0]), reference.rows(ids), atol=1e-6)
            loss = sum(float(replica[i][1]) for replica in got)
            np.testing.assert_allclose(loss, reference.step(keys), rtol=1e-5)


def split_keys(spec, keys) -> list:
    """`keys` split over the replicas: as many to each (one trace per test), where several leave one without."""
    return [keys] if spec.replicas == 1 else np.array_split(keys, spec.replicas - 1) + [keys[:0]]


def lookup_forms(lookup, lookup_sparse, ids) -> list:
    """The rows of rank-1 `ids` (4k of them) looked up in other forms: as 2 x 2 blocks (`lookup`), and as ragged
    rows of 1 or 2 ids with an empty last row, weighted and combined by "sqrtn" (`lookup_sparse`; the combiners'
    arithmetic is the same for every kind, and each is checked on fixed tables by tests/harness/bodies.py)."""
    n = tf.size(ids)
    rows, nrows = tf.range(n) * 2 // 3, n * 2 // 3 + 1
    ragged = tf.RaggedTensor.from_value_rowids(ids, rows, nrows)
    weights = tf.RaggedTensor.from_value_rowids(tf.cast(tf.range(n) % 3 + 1, tf.float32) * 0.5, rows, nrows)
    return [lookup(tf.reshape(ids, [-1, 2, 2])), lookup_sparse(ragged, weights, "sqrtn")]


def check_lookup_forms(spec, tables, references, keys) -> None:
    """`lookup_forms` of `keys` (split over the replicas) in each of `tables`, through TensorFlow's own
    `tf.nn.embedding_lookup` (dispatched to the table) and `tfs.embedding_lookup_sparse`, against the same forms
    of TensorFlow's lookups in each table's `Reference` variable."""

    def fn(ids):
        return [
            lookup_forms(
                functools.partial(tf.nn.embedding_lookup, table),
                lambda i, w, c, t=table: tfs.embedding_lookup_sparse(t, i, w, combiner=c),
                ids,
            )
            for table in tables
        ]

    parts = split_keys(spec, keys)
    got = spec.runner(fn)(parts)
    for i, reference in enumerate(references):
        for ids, replica in zip(parts, got):
            want = lookup_forms(
                functools.partial(tf.nn.embedding_lookup, reference.var),
                functools.partial(sparse_reference, reference.var),
                tf.constant([reference.row[k] for k in ids.tolist()], tf.int64),
            )
            for form, (g, w) in enumerate(zip(replica[i], want)):
                np.testing.assert_allclose(np.asarray(g), w.numpy(), atol=1e-6, err_msg=f"form {form}")


def sparse_reference(variable, ragged, weights, combiner) -> tf.Tensor:
    """`tf.nn.embedding_lookup_sparse` of `ragged` in `variable`, a zero row for each empty row at the end too
    (TensorFlow's stops at the last row with an id)."""
    out = tf.nn.embedding_lookup_sparse(variable, ragged.to_sparse(), weights.to_sparse(), combiner=combiner)
    missing = tf.cast(ragged.nrows(), tf.int32) - tf.shape(out)[0]
    return tf.concat([out, tf.zeros(tf.stack([missing, tf.shape(out)[1]]), out.dtype)], 0)


@pytest.mark.parametrize("spec,kind,placement", MATRIX)
def test_lookups_training_and_checkpoints_match_reference(spec, kind, placement):
    check(SPECS[spec], kind, placement)


def run_matrix(spec) -> list:
    """Every combination `spec`'s strategy runs, checked (`check`) one after another: `[(kind, placement)]`.
    Each process of a multi-process strategy calls it, in the same order."""
    ran = []
    for kind in ADAPTERS:
        for placement in PLACEMENTS:
            if not isinstance(_made(spec, kind, placement), str):
                check(spec, kind, placement)
                ran.append((kind, placement))
    return ran


def check(spec, kind: str, placement: str) -> None:
    """Lookups, SGD and Adagrad steps (a table each, trained in the same steps), the first table's rows looked up
    in the other forms (rank 3, weighted ragged rows) and a checkpoint of the Adagrad table read into
    other layouts and back; a kind whose tables do not train is looked up only."""
    adapter = ADAPTERS[kind]
    names = sorted(OPTIMIZERS) if adapter.trains else [None]
    tables = [make(spec, kind, placement) for _ in names]
    with spec.strategy().scope():
        optimizers = [OPTIMIZERS[name][0]() if name else None for name in names]
    rng = np.random.default_rng(1)
    # Keys repeated within a batch, across replicas and across steps.
    batches = [adapter.keys(rng, 12) for _ in range(3)]
    references = [Reference(adapter, t, batches, OPTIMIZERS[n][1]() if n else None) for t, n in zip(tables, names)]
    run_steps(spec, adapter, tables, optimizers, batches, references)
    check_lookup_forms(spec, tables[:1], references[:1], batches[-1])
    if not adapter.trains:
        return
    for name, table, reference in zip(names, tables, references):
        copies_agree(spec, table)
        live = adapter.live_keys(table)
        assert len(live) == len(set(live)) and set(live) == set(reference.keys), (name, live, reference.keys)
        np.testing.assert_allclose(adapter.read(table, reference.keys), reference.var.numpy(), atol=1e-6, err_msg=name)
    if adapter.layouts:
        trained = names.index("adagrad")
        check_checkpoint_round_trip(spec, kind, placement, tables[trained], references[trained].keys)


def copies_agree(spec, table):
    """Where the placement keeps a copy of the table per replica, every copy of every variable is the same."""
    if table.placement_type.per_replica != "copy":
        return
    for variable in table.variables:
        copies = [c.numpy() for c in variable.values]
        assert len(copies) == spec.local_replicas, variable.name
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=variable.name)


def entries(path) -> tuple:
    """A checkpoint's entries (`(name, shape, dtype)`) and its object graph."""
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    listed = sorted((k, tuple(v), dtypes[k].name) for k, v in reader.get_variable_to_shape_map().items())
    return listed, reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")


def with_optimizer(adapter, table):
    """`table` with its Adagrad optimizer's slots built (in the scope of the strategy that made it)."""
    if adapter.trains:
        OPTIMIZERS["adagrad"][0]().build(adapter.variables(table))
    return table


def check_checkpoint_round_trip(spec, kind, placement, table, keys):
    """`table` (`keys`: its live keys) checkpointed, read into tables of other layouts made under the default
    strategy (and a plain variable, where the kind's checkpoints go into one); the last of them written and read
    by a table of `spec`'s strategy, `kind` and `placement` in another layout. Every read gives the same rows,
    and the same columns: into the other layouts before their optimizer is built, into the last after."""
    adapter = ADAPTERS[kind]
    want, want_columns = adapter.read(table, keys), adapter.columns(table, keys)
    directory = tempfile.mkdtemp()
    path = tf.train.Checkpoint(t=table).write(os.path.join(directory, "from"))
    for layout in adapter.layouts:
        with spec.local():
            other = adapter.make(DefaultSpec().strategy(), uid(adapter.kind), None, **layout)
        tf.train.Checkpoint(t=other).read(path).assert_existing_objects_matched()
        assert sorted(adapter.live_keys(other)) == sorted(keys), layout
        np.testing.assert_array_equal(adapter.read(other, keys), want, err_msg=str(layout))
        with spec.local():
            check_columns(adapter.columns(with_optimizer(adapter, other), keys), want_columns, layout)
    with spec.local():
        plain = adapter.plain()
    if plain is not None:
        tf.train.Checkpoint(t=plain).read(path).assert_existing_objects_matched()
        np.testing.assert_array_equal(plain.numpy()[np.asarray(keys)], want)
    path = tf.train.Checkpoint(t=other).write(os.path.join(directory, "back"))
    back = make(spec, kind, placement, layout=adapter.layouts[0])
    with spec.strategy().scope():
        with_optimizer(adapter, back)
    tf.train.Checkpoint(t=back).read(path).assert_existing_objects_matched()
    assert sorted(adapter.live_keys(back)) == sorted(keys)
    copies_agree(spec, back)
    # Written again, the same entries and object graph as the default strategy's table wrote: what reads one reads
    # the other, whatever strategy and placement wrote it.
    assert entries(tf.train.Checkpoint(t=back).write(os.path.join(directory, "again"))) == entries(path)
    np.testing.assert_array_equal(adapter.read(back, keys), want)
    check_columns(adapter.columns(back, keys), want_columns, (spec.name, placement))


def check_columns(got: dict, want: dict, where) -> None:
    """The same per-key columns, of the same values."""
    assert sorted(got) == sorted(want), (where, sorted(got), sorted(want))
    for name, values in want.items():
        np.testing.assert_array_equal(got[name], values, err_msg=f"{where} {name}")
