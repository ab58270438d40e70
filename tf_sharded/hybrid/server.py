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
* `gather(shard, slot, rows)` / `scatter(shard, slot, rows, values)`: rows
  of a shard or of one of its optimizer slots, read or written outside the
  training step (checkpoints, exports, initial values given as arrays);
  `slots(shard)`: the slot names.

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

from tf_sharded.hybrid.calls import CALLS, COUNTS, FLAT, ROWS, SCALAR_FLOAT, SCALAR_INT

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

    @property
    def name(self) -> str:
        return f"table '{self.spec['name']}' shard {self.spec['shard']}"


class _Arena:
    """The shards of one width on a server, packed into one variable (row `offset + r` is a shard's row `r`) and
    trained by one optimizer: one lookup and one optimizer step per width and call, whatever the table count."""

    def __init__(self, shards: List[_Shard], index: int):
        import tf_sharded as tfs

        self.dim, self.shards = shards[0].dim, shards
        values = tf.concat([s.initial for s in shards], 0)
        # A one-shard table of this process: tf_sharded's optimizers update its touched rows only.
        self.table = tfs.create_sharded_variable(f"arena_{index}", [int(values.shape[0]), self.dim],
                                                 initializer=values, partitions=1)  # fmt: skip
        self.variable = self.table.variables[0]
        self.optimizer, self.optimizer_spec = None, None
        offset = 0
        for shard in shards:  # the arena is whole before a shard points to it (calls check without the lock)
            shard.offset, shard.initial = offset, None
            shard.arena = self
            offset += shard.size

    def configure(self, spec: dict, shard: _Shard):
        from tf_sharded.keras.optimizers import get

        if self.optimizer_spec is not None:
            if spec != self.optimizer_spec:
                raise ValueError(
                    f"The tables of width {self.dim} here are trained by {self.optimizer_spec['class_name']} "
                    f"{self.optimizer_spec['config']}; {shard.name} asked for {spec['class_name']} {spec['config']}"
                )
            return
        optimizer = type(get(spec["class_name"])).from_config(spec["config"])
        optimizer.build(self.table.variables)
        self.optimizer, self.optimizer_spec = optimizer, spec

    def slots(self) -> Dict[str, tf.Variable]:
        """The optimizer's slots, by name (none before `configure`)."""
        if self.optimizer is None:
            return {}
        return {name: self.optimizer.table_slot(self.table, name).variables[0] for name in self.optimizer.slot_names()}


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
                return tf.constant([self._by_key[key], 0], tf.int64)
            self._shards.append(_Shard(spec))
            self._by_key[key] = len(self._shards) - 1
            return tf.constant([self._by_key[key], 1], tf.int64)

    def _packed(self, index: int) -> _Shard:
        """Shard `index`, packed: on first use, every unpacked shard of its width goes into a new arena."""
        shard = self._shards[index]
        if shard.arena is None:
            with self._lock:
                if shard.arena is None:
                    waiting = [s for s in self._shards if s.arena is None and s.dim == shard.dim]
                    self._arenas.append(_Arena(waiting, len(self._arenas)))
        return shard

    def _configure(self, index, text) -> int:
        with self._lock:
            shard = self._packed(int(index.numpy()))
            shard.arena.configure(json.loads(text.numpy().decode()), shard)
            self._functions.clear()
        return 0

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
            return apply(counts, rows, gradients, learning_rate, iterations)

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
        def served(fn, specs, out_dtype, out_shape):
            @tf.function(input_signature=specs)
            def call(*args):
                out = tf.py_function(fn, list(args), out_dtype)
                out.set_shape(out_shape)
                return out

            return call

        handlers = {
            "create": self._create,
            "configure": self._configure,
            "lookup": self._lookup,
            "apply": self._apply,
            "gather": self._gather,
            "scatter": self._scatter,
            "slots": self._slot_names,
        }
        calls = {name: served(handlers[name], args, out.dtype, out.shape) for name, (args, out) in CALLS.items()}
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


def _structure(spec: dict) -> dict:
    """What two asks for one shard must agree on: its table's shape and layout."""
    return {k: spec[k] for k in ("name", "rows", "dim", "shard", "num_shards", "scheme")}


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

    @tf.function(input_signature=[COUNTS, ROWS])
    def lookup(counts, rows):
        parts = tf.split(rows, counts, num=n)
        values = [None] * n
        for arena, members, global_rows in by_arena(parts):
            found = tf.split(tf.gather(arena.variable, global_rows), tf.gather(counts, members), num=len(members))
            for i, part in zip(members, found):
                values[i] = tf.reshape(part, [-1])
        return tf.concat(values, 0)

    @tf.function(input_signature=[COUNTS, ROWS, FLAT, SCALAR_FLOAT, SCALAR_INT])
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
    from tf_sharded.hybrid.local import exit_with_parent

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
