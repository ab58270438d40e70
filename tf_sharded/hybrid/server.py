"""The table server of hybrid training: table shards and their optimizer slots, served over TensorFlow's RPC ops.

A table server is a `ps` task of its own process. It holds the shards that
the workers' tables place on it, each with the slots of the optimizer that
trains it, and answers these calls (`tf.distribute.experimental.rpc`):

* `create(spec)`: makes a shard from a JSON spec (the first worker to ask
  creates it and sets its initial values, the others get the same shard; a
  different shape or layout under the same name and shard is refused). Named initializers run here, row by logical
  row, so any layout gives the same table;
* `configure(spec)`: sets the optimizer that trains a shard (a
  `tfs.optimizers` class and its config), on the first apply of a worker;
* `lookup(shards, counts, rows)`: for a batch of shards at once, the rows
  at local indices (`counts[i]` of `rows` belong to `shards[i]`), flattened
  into one float32 vector;
* `apply(shards, counts, rows, gradients, learning_rate, iterations)`: one
  optimizer step on each shard's rows with its part of the flat
  `gradients`, at the worker's learning rate and step;
* `lookups(shards)`: per shard, the rows its applies updated so far (each
  worker's step sends its lookups' distinct rows: what a fixed table's
  lookup counters count elsewhere), summed over the workers;
* `gather(shard, slot, rows)` / `scatter(shard, slot, rows, values)`: rows
  of a shard or of one of its optimizer slots, read or written outside the
  training step (checkpoints, exports, initial values given as arrays);
  `slots(shard)`: the slot names.

A dynamic table's shard (`create` with `"kind": "dynamic"`) is a one-shard
`tfs.DynamicTable` here with an optimizer of its own, reached by key: the
calls `lookup_*` (insert, under its policies, when training), `apply_*`,
`export_*`, `assign_*` and `set_column_*`, for int64 (`*_keys`) or string
(`*_strings`) keys (`tf_sharded.hybrid.calls`).

One lookup and one apply call per server and step carry every table that
the step touches there. The shards of one width are packed into one
variable (an arena) on first use, trained by one optimizer, so a call costs
one gather and one optimizer step per width, not per table. The server
compiles one function per set of shards that a call names. Applies run one
at a time on a server: two workers updating one row both land, in some
order, as on a parameter server.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Dict, List

import tensorflow as tf

from tf_sharded.hybrid.calls import CALLS, COUNTS, FLAT, KEYS, ROWS, SCALAR_FLOAT, SCALAR_INT

_CHUNK_ROWS = 1 << 18
# Inter-op threads of a server: each call holds one while it runs Python dispatch that runs TensorFlow ops,
# so with as few as there are cores, concurrent calls from several workers hold them all and wait on each other.
SERVER_THREADS = 32


class _Shard:
    """One shard of one table on this server: its own variable until it is packed into an arena."""

    def __init__(self, spec: dict):
        from tf_sharded import initializers
        from tf_sharded.layout import PartitionSpec

        self.spec = spec
        rows, dim, shard = int(spec["rows"]), int(spec["dim"]), int(spec["shard"])
        layout = PartitionSpec(int(spec["num_shards"]), scheme=spec["scheme"]).bind(rows)
        self.size, self.dim = layout.shard_sizes[shard], dim
        self.initial = tf.Variable(tf.zeros([self.size, dim]), trainable=False)
        if spec["initializer"] is not None:  # [kind, a, b, seed] of a per-row initializer; else written by a worker
            init = initializers.RowInitializer(*spec["initializer"])
            for chunk in init.chunks(layout, shard, [rows, dim], tf.float32, _CHUNK_ROWS):
                local, part = chunk.compute()
                self.initial.scatter_update(tf.IndexedSlices(part, local))
        self.arena, self.offset = None, 0
        self.updated = 0  # rows its applies updated, every worker's

    @property
    def name(self) -> str:
        return f"table '{self.spec['name']}' shard {self.spec['shard']}"


class _Arena:
    """The shards of one width on a server, packed into one variable (row `offset + r` is a shard's row `r`) and
    trained by one optimizer: one lookup and one optimizer step per width and call, whatever the table count."""

    def __init__(self, shards: List[_Shard], index: int):
        from tf_sharded.creation import create_sharded_variable

        self.dim, self.shards = shards[0].dim, shards
        values = tf.concat([s.initial for s in shards], 0)
        # A one-shard table of this process: tf_sharded's optimizers update its touched rows only.
        self.table = create_sharded_variable(f"arena_{index}", [int(values.shape[0]), self.dim],
                                                 initializer=values, partitions=1)  # fmt: skip
        self.variable = self.table.variables[0]
        self.optimizer, self.optimizer_spec = None, None
        offset = 0
        for shard in shards:  # the arena is whole before a shard points to it (calls check without the lock)
            shard.offset, shard.initial = offset, None
            shard.arena = self
            offset += shard.size

    def configure(self, spec: dict, shard: _Shard):
        _configure(self, spec, f"The tables of width {self.dim} here are", shard.name)

    def slots(self) -> Dict[str, tf.Variable]:
        """The optimizer's slots, by name (none before `configure`)."""
        if self.optimizer is None:
            return {}
        return {name: self.optimizer.table_slot(self.table, name).variables[0] for name in self.optimizer.slot_names()}


def _configure(owner, spec: dict, trained: str, asking: str) -> None:
    """Sets `owner.optimizer` (a `tfs.optimizers` class and config, built for `owner.table`) once; a later ask
    for another optimizer is refused."""
    from tf_sharded.keras.optimizers import get

    if owner.optimizer_spec is not None:
        if spec != owner.optimizer_spec:
            raise ValueError(
                f"{trained} trained by {owner.optimizer_spec['class_name']} {owner.optimizer_spec['config']}; "
                f"{asking} asked for {spec['class_name']} {spec['config']}"
            )
        return
    optimizer = type(get(spec["class_name"])).from_config(spec["config"])
    optimizer.build(owner.table.variables)
    owner.optimizer, owner.optimizer_spec = optimizer, spec


class _DynamicShard:
    """One shard of a dynamic table on this server: a one-shard `tfs.DynamicTable` (its index, row pool,
    policies' state and optimizer columns) and the optimizer that trains it. The table's bounds (`max_rows`, a
    capacity eviction's keys) arrive as this shard's part of them."""

    dynamic = True

    def __init__(self, spec: dict):
        from tf_sharded import initializers, policies
        from tf_sharded.table.dynamic.table import DynamicTable

        self.spec, self.dim = spec, int(spec["dim"])
        self.table = DynamicTable(
            f"{spec['name']}/shard_{spec['shard']}", self.dim, spec["key_dtype"],
            initializer=initializers.RowInitializer(*spec["initializer"]), seed=int(spec["seed"]),
            growth=float(spec["growth"]), max_rows=spec["max_rows"], trainable=bool(spec["trainable"]),
            admission=policies.deserialize_policies(spec["admission"]),
            eviction=policies.deserialize_policies(spec["eviction"]),
        )  # fmt: skip
        self.optimizer, self.optimizer_spec = None, None

    @property
    def name(self) -> str:
        return f"dynamic table '{self.spec['name']}' shard {self.spec['shard']}"

    def configure(self, spec: dict) -> None:
        _configure(self, spec, f"The {self.name} is", "a worker")

    def export(self, request: dict) -> tuple:
        """`(keys, [rows | each column] flat, [seen | hits | step, live keys, index buckets | events | sketch])`
        of the live keys (those seen after `request["since_step"]` if given; `events`: the shard's `EVENTS`)."""
        columns = list(request["columns"])
        held = [c for c in columns if c in self.table.slot_columns]
        keys, values, extra = self.table.export_columns(held + ["seen", "hits"], request.get("since_step"))
        floats = [tf.reshape(values, [-1])]
        for column in columns:  # a column this shard does not have yet (no optimizer): its fill, zeros
            floats.append(tf.reshape(extra[column], [-1]) if column in extra else tf.zeros_like(floats[0]))
        counters = [self.table.step.read_value(), tf.cast(self.table.size(), tf.int64), self.table.index_buckets()]
        ints = [extra["seen"], extra["hits"], tf.stack(counters), self.table.shard_events()[0]]
        sketch = self.table.shards[0].admission_state
        if sketch is not None:
            ints.append(tf.reshape(tf.cast(sketch, tf.int64), [-1]))
        return keys, tf.concat(floats, 0), tf.concat(ints, 0)

    def assign(self, request: dict, keys, floats, ints) -> None:
        """Makes `keys` the shard's whole content: rows and `request["columns"]` from `floats`,
        `request["ints"]` ("seen", "hits") from `ints`, then its step and admission sketch if given there."""
        n, columns, int_columns = int(keys.shape[0]), list(request["columns"]), list(request["ints"])
        parts = tf.split(tf.reshape(floats, [-1, self.dim]), [n] * (1 + len(columns)))
        given = dict(zip(columns, parts[1:]))
        given.update(zip(int_columns, tf.split(ints[: n * len(int_columns)], [n] * len(int_columns))))
        self.table.assign_keys(keys, parts[0], given)
        rest = ints[n * len(int_columns) :]
        if request.get("step") is not None:
            self.table.step.assign(request["step"])
        sketch = self.table.shards[0].admission_state
        if request.get("sketch") and sketch is not None:
            sketch.assign(tf.cast(tf.reshape(rest, sketch.shape), sketch.dtype))


class TableServer:
    """Serves table shards at `address` ("host:port") until the process ends.

    Run one per `ps` task; `python -m tf_sharded.hybrid` does it from
    `TF_CONFIG`. Example, in a process of its own:

        server = tfs.hybrid.TableServer("localhost:5000").start()
        server.join()
    """

    def __init__(self, address: str, threads: int = SERVER_THREADS):
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        self.address = address
        self._shards: List[_Shard] = []
        self._arenas: List[_Arena] = []
        self._by_key: Dict[tuple, int] = {}
        self._functions: Dict[tuple, tuple] = {}
        self._lock = threading.RLock()  # creation, packing and compilation
        self._apply_lock = threading.Lock()
        self._server = tf.distribute.experimental.rpc.Server.create("grpc", address)
        self._register()

    # ------------------------------------------------------------ calls --

    def _create(self, text):
        """`[shard id, 1 if this call made it]`. A shard is made once: later asks (other workers) must describe
        the same shape and layout and get the first one's, initial values included (as MultiWorkerMirrored
        strategy's workers take the chief's)."""
        spec = json.loads(text.numpy().decode())
        key = (spec["name"], int(spec["shard"]))
        with self._lock:
            if key in self._by_key:
                known = self._shards[self._by_key[key]].spec
                if _structure(known) != _structure(spec):
                    raise ValueError(
                        f"Table '{spec['name']}' shard {spec['shard']} exists on {self.address} as "
                        f"{_structure(known)}. Received: {_structure(spec)}"
                    )
                return tf.constant([self._by_key[key], 0, *_seed_of(known)], tf.int64)
            self._shards.append(_DynamicShard(spec) if spec.get("kind") == "dynamic" else _Shard(spec))
            self._by_key[key] = len(self._shards) - 1
            return tf.constant([self._by_key[key], 1, *_seed_of(spec)], tf.int64)

    def _packed(self, index: int) -> _Shard:
        """Shard `index`, packed: on first use, every unpacked shard of its width goes into a new arena."""
        shard = self._shards[index]
        if getattr(shard, "dynamic", False):
            raise ValueError(f"{shard.name} on {self.address} is reached by key, not by row")
        if shard.arena is None:
            with self._lock:
                if shard.arena is None:
                    waiting = [s for s in self._shards if not getattr(s, "dynamic", False) and s.arena is None
                               and s.dim == shard.dim]  # fmt: skip
                    self._arenas.append(_Arena(waiting, len(self._arenas)))
        return shard

    def _dynamic(self, index: int) -> _DynamicShard:
        """Shard `index`, refused unless it is a dynamic table's."""
        shard = self._shards[index] if 0 <= index < len(self._shards) else None
        if not getattr(shard, "dynamic", False):
            raise ValueError(f"Shard {index} on {self.address} is not a dynamic table's")
        return shard

    def _configure(self, index, text) -> int:
        spec, index = json.loads(text.numpy().decode()), int(index.numpy())
        with self._lock:
            if getattr(self._shards[index], "dynamic", False):
                self._shards[index].configure(spec)
            else:
                shard = self._packed(index)
                shard.arena.configure(spec, shard)
            self._functions.clear()
        return 0

    # ------------------------------------------------- dynamic tables --

    def _compiled_dynamic(self, ids: tuple, training: bool) -> tuple:
        """The lookup and apply functions of the dynamic shards `ids` (compiled once per set and mode)."""
        with self._lock:
            key = ("dynamic", ids, training)
            if key not in self._functions:
                self._functions[key] = _compile_dynamic([self._dynamic(i) for i in ids], training)
            return self._functions[key]

    def _lookup_keys(self, shards, counts, keys, occurrences, training):
        lookup, _ = self._compiled_dynamic(tuple(int(i) for i in shards.numpy()), bool(training.numpy()))
        return lookup(counts, keys, occurrences)

    def _apply_keys(self, shards, counts, keys, gradients, learning_rate, iterations):
        ids = tuple(int(i) for i in shards.numpy())
        unconfigured = [self._dynamic(i).name for i in ids if self._dynamic(i).optimizer is None]
        if unconfigured:
            raise ValueError(f"{unconfigured} have no optimizer on {self.address}: configure them first")
        _, apply = self._compiled_dynamic(ids, False)
        with self._apply_lock:
            return apply(counts, keys, gradients, learning_rate, iterations)

    def _export_keys(self, index, text):
        with self._apply_lock:
            return self._dynamic(int(index.numpy())).export(json.loads(text.numpy().decode()))

    def _assign_keys(self, index, text, keys, floats, ints):
        with self._apply_lock:
            self._dynamic(int(index.numpy())).assign(json.loads(text.numpy().decode()), keys, floats, ints)
        return tf.size(keys, tf.int64)

    def _set_column_keys(self, index, column, keys, values):
        shard = self._dynamic(int(index.numpy()))
        with self._apply_lock:
            shard.table.set_column(column.numpy().decode(), keys, tf.reshape(values, [-1, shard.dim]))
        return tf.size(keys, tf.int64)

    def _compiled(self, ids: tuple) -> tuple:
        """The lookup and apply functions of the shards `ids`, in that order (compiled once per set)."""
        with self._lock:
            if ids not in self._functions:
                self._functions[ids] = _compile([self._packed(i) for i in ids])
            return self._functions[ids]

    def _lookup(self, shards, counts, rows):
        lookup, _ = self._compiled(tuple(int(i) for i in shards.numpy()))
        return lookup(counts, rows)

    def _apply(self, shards, counts, rows, gradients, learning_rate, iterations):
        ids = tuple(int(i) for i in shards.numpy())
        unconfigured = [self._shards[i].name for i in ids if self._packed(i).arena.optimizer is None]
        if unconfigured:
            raise ValueError(f"{unconfigured} have no optimizer on {self.address}: configure them first")
        _, apply = self._compiled(ids)
        with self._apply_lock:
            applied = apply(counts, rows, gradients, learning_rate, iterations)
            for i, n in zip(ids, counts.numpy().tolist()):
                self._shards[i].updated += n
            return applied

    def _lookups(self, shards):
        with self._apply_lock:
            found = [self._shards[i] for i in shards.numpy().tolist() if 0 <= i < len(self._shards)]
            if len(found) < len(shards.numpy()) or any(getattr(s, "dynamic", False) for s in found):
                raise ValueError(f"Shards {shards.numpy().tolist()} on {self.address} are not all fixed-row shards "
                                 f"(it has {len(self._shards)})")  # fmt: skip
            return tf.constant([s.updated for s in found], tf.int64)

    def _rows(self, index, slot) -> tuple:
        """`(variable, first row, rows)` of shard `index` or of its optimizer slot `slot` in its arena."""
        shard, slot = self._packed(int(index.numpy())), slot.numpy().decode()
        if not slot:
            return shard.arena.variable, shard.offset, shard.size
        slots = shard.arena.slots()
        if slot not in slots:
            raise ValueError(f"{shard.name} has no optimizer slot '{slot}' on {self.address} (it has {sorted(slots)})")
        return slots[slot], shard.offset, shard.size

    def _gather(self, index, slot, rows):
        variable, first, size = self._rows(index, slot)
        return tf.reshape(tf.gather(variable, _checked(rows, size) + first), [-1])

    def _scatter(self, index, slot, rows, values):
        variable, first, size = self._rows(index, slot)
        values = tf.reshape(values, [-1, int(variable.shape[1])])
        rows = _checked(rows, size)
        if int(rows.shape[0]) != int(values.shape[0]):
            raise ValueError(f"{int(rows.shape[0])} rows to write with {int(values.shape[0])} values")
        with self._apply_lock:
            variable.scatter_update(tf.IndexedSlices(values, rows + first))
        return tf.size(rows, tf.int64)

    def _slot_names(self, index):
        return json.dumps(sorted(self._packed(int(index.numpy())).arena.slots()))

    def _register(self):
        def served(fn, specs, out):
            outs = out if isinstance(out, tuple) else (out,)

            @tf.function(input_signature=specs, autograph=False)
            def call(*args):
                found = tf.py_function(fn, list(args), [o.dtype for o in outs])
                for value, o in zip(found, outs):
                    value.set_shape(o.shape)
                return tuple(found) if isinstance(out, tuple) else found[0]

            return call

        handlers = {
            "create": self._create,
            "configure": self._configure,
            "lookup": self._lookup,
            "apply": self._apply,
            "gather": self._gather,
            "scatter": self._scatter,
            "slots": self._slot_names,
            "lookups": self._lookups,
        }
        for kind in KEYS:  # one handler for either key dtype
            for call in ("lookup", "apply", "export", "assign", "set_column"):
                handlers[f"{call}_{kind}"] = getattr(self, f"_{call}_keys")
        calls = {name: served(handlers[name], args, out) for name, (args, out) in CALLS.items()}
        for name, fn in calls.items():
            self._server.register(name, fn)

    def start(self) -> TableServer:
        self._server.start()
        return self

    def join(self) -> None:
        """Serves until the process is killed."""
        threading.Event().wait()


def _checked(rows, size: int) -> tf.Tensor:
    """`rows`, refused unless each is a row of a shard of `size` rows."""
    bad = rows.numpy()[(rows.numpy() < 0) | (rows.numpy() >= size)]
    if bad.size:
        raise ValueError(f"Rows {bad[:5].tolist()} are outside the shard's {size} rows")
    return rows


def _seed_of(spec: dict) -> list:
    """`[the table's seed, its initial rows' seed]` for a dynamic table's shard, else `[]`."""
    return [int(spec["seed"]), int(spec["initializer"][3])] if spec.get("kind") == "dynamic" else []


def _structure(spec: dict) -> dict:
    """What two asks for one shard must agree on: its table's shape and layout (a dynamic table's: its keys,
    rows and policies; the first ask's seed wins, as the first ask's initial values do for other tables)."""
    if spec.get("kind") == "dynamic":
        agreed = ("kind", "name", "dim", "key_dtype", "shard", "num_shards", "admission", "eviction", "max_rows")
        return {"initializer": spec["initializer"][:3], **{k: spec[k] for k in agreed}}  # its seed: the first ask's
    return {k: spec.get(k) for k in ("kind", "name", "rows", "dim", "shard", "num_shards", "scheme")}


def _compile_dynamic(shards: List[_DynamicShard], training: bool) -> tuple:
    """`(lookup, apply)` traced for the dynamic `shards`, in order: a call's keys and values split by its `counts`.

    A lookup resolves every shard's keys in one `lookup_many` (a training one
    inserts them in one critical section), each key repeated as often as it
    occurred in the worker's batch so that admission and hit counts see the
    batch as it was. An apply reads the keys' rows without inserting and
    applies the gradient that reading them gives (the rows of live keys) with
    each shard's optimizer: as `tfs.optimizers` train a local dynamic table.
    """
    from tf_sharded.table.dynamic.table import lookup_many

    n, key_spec = len(shards), KEYS["keys" if shards[0].table.key_dtype == tf.int64 else "strings"]
    dims = tf.constant([s.dim for s in shards], tf.int64)

    @tf.function(input_signature=[COUNTS, key_spec, COUNTS], autograph=False)
    def lookup(counts, keys, occurrences):
        parts, occurred = tf.split(keys, counts, num=n), tf.split(occurrences, counts, num=n)
        found = lookup_many([(s.table, tf.repeat(k, o)) for s, k, o in zip(shards, parts, occurred)], training)
        first = [tf.cumsum(o, exclusive=True) for o in occurred]  # each key's first occurrence
        return tf.concat([tf.reshape(tf.gather(rows, f), [-1]) for rows, f in zip(found, first)], 0)

    @tf.function(input_signature=[COUNTS, key_spec, FLAT, SCALAR_FLOAT, SCALAR_INT], autograph=False)
    def apply(counts, keys, gradients, learning_rate, iterations):
        parts, flat = tf.split(keys, counts, num=n), tf.split(gradients, counts * dims, num=n)
        for shard, part, values in zip(shards, parts, flat):
            variables = shard.table.variables
            with tf.GradientTape() as tape:
                rows = shard.table.lookup(part, training=False)
            grads = tape.gradient(rows, variables, output_gradients=tf.reshape(values, [-1, shard.dim]))
            shard.optimizer.learning_rate.assign(learning_rate)
            shard.optimizer.iterations.assign(iterations)
            shard.optimizer.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        return tf.reduce_sum(counts)

    return lookup, apply


def _compile(shards: List[_Shard]) -> tuple:
    """`(lookup, apply)` traced for `shards`, in order: a call's rows and values split by its `counts`.

    Each arena is read with one gather and stepped by one optimizer update
    for all its shards in the call.
    """
    n = len(shards)
    dims = tf.constant([s.dim for s in shards], tf.int64)
    arenas = []
    for shard in shards:
        if not any(a is shard.arena for a in arenas):
            arenas.append(shard.arena)

    def by_arena(parts):
        """Per arena: the positions in `shards` of its shards, and their rows as arena rows."""
        out = []
        for arena in arenas:
            members = [i for i, s in enumerate(shards) if s.arena is arena]
            out.append((arena, members, tf.concat([parts[i] + shards[i].offset for i in members], 0)))
        return out

    @tf.function(input_signature=[COUNTS, ROWS], autograph=False)
    def lookup(counts, rows):
        parts = tf.split(rows, counts, num=n)
        values = [None] * n
        for arena, members, global_rows in by_arena(parts):
            found = tf.split(tf.gather(arena.variable, global_rows), tf.gather(counts, members), num=len(members))
            for i, part in zip(members, found):
                values[i] = tf.reshape(part, [-1])
        return tf.concat(values, 0)

    @tf.function(input_signature=[COUNTS, ROWS, FLAT, SCALAR_FLOAT, SCALAR_INT], autograph=False)
    def apply(counts, rows, gradients, learning_rate, iterations):
        parts = tf.split(rows, counts, num=n)
        flat = tf.split(gradients, counts * dims, num=n)
        for arena, members, global_rows in by_arena(parts):
            values = tf.concat([tf.reshape(flat[i], [-1, arena.dim]) for i in members], 0)
            grad = tf.IndexedSlices(values, global_rows, tf.constant([int(arena.variable.shape[0]), arena.dim]))
            # The worker's learning rate and step: a schedule, and Adam's bias correction, follow the worker.
            arena.optimizer.learning_rate.assign(learning_rate)
            arena.optimizer.iterations.assign(iterations)
            arena.optimizer.apply_gradients([(grad, arena.variable)])
        return tf.reduce_sum(counts)

    return lookup, apply


def serve_from_tf_config(tf_config: str = None) -> TableServer:
    """Starts the table server of this `ps` task of `TF_CONFIG` (or `tf_config`)."""
    config = json.loads(tf_config if tf_config is not None else os.environ.get("TF_CONFIG", "{}"))
    task = config.get("task", {})
    addresses = config.get("cluster", {}).get("ps", [])
    if task.get("type") != "ps" or not 0 <= int(task.get("index", 0)) < len(addresses):
        raise ValueError(f"TF_CONFIG's task must be one of its 'ps' tasks here. Received: task={task!r}")
    return TableServer(addresses[int(task.get("index", 0))]).start()


def main(argv=None) -> int:
    """`python -m tf_sharded.hybrid [ADDRESS]`: serves tables at ADDRESS, or as TF_CONFIG's ps task."""
    from tf_sharded.lifetime import exit_with_parent

    argv = sys.argv[1:] if argv is None else argv
    exit_with_parent()
    try:
        server = TableServer(argv[0]).start() if argv else serve_from_tf_config()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving tables at {server.address}", flush=True)
    server.join()
    return 0
