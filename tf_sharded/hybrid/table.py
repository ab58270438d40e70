"""The worker side of hybrid training: a table whose shards live on table servers, read and updated by each worker.

A `ServedTable` holds no rows. A lookup de-duplicates its ids, routes them by
the table's layout, and reads each shard's rows from its server inside the
step. All the served tables of one lookup (a collection's) travel together:
one `lookup` call per server and step.

Gradients reach the servers without any collective, and each worker sends
its own:

* the rows a lookup reads come from a call, which has no gradient, so the
  lookup also reads the table's `anchor`, a scalar variable of the worker
  (a Keras weight of the layer that owns the table). The tape then
  differentiates the lookup, and its backward pass keeps each shard's
  summed gradient rows, pending. The anchor's own gradient is zero, and it
  is never all-reduced;
* the optimizer step of the worker (Keras's, through tf_sharded's routing,
  or `apply_pending` in a custom loop) sends them, one `apply` call per
  server, with the optimizer's current learning rate. The server trains the
  shard with the same optimizer class and config (a `tfs.optimizers` one),
  set on the table's first apply.

So the dense variables are all-reduced as usual, and a worker never waits
for another to update a table: each worker's rows are applied by its
servers as they come (Persia's hybrid).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.hybrid import calls
from tf_sharded.layout import PartitionSpec, resolve_spec
from tf_sharded.table import registry
from tf_sharded.table.builder import draw_seed
from tf_sharded.table.ids import check_ids
from tf_sharded.table.norms import clip_rows
from tf_sharded.table.protocol import MAX_IDS_RANK, implements_table, register_shards
from tf_sharded.table.saveable import TableSaveable
from tf_sharded.table.sharded_variable import FIXED

_TIMEOUT_MS = 600_000
# Per graph: backward passes' rows and gradients, waiting for the optimizer step.
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PENDING_LOCK = threading.Lock()
_CHUNK = 1 << 18  # rows per call when a whole array is read or written
SERVED_OPTIMIZERS = ("SGD", "Adagrad", "Adam", "Ftrl")  # tfs.optimizers' classes, by name


class Servers:
    """The table servers of a cluster: one RPC client per address, made once (after the workers' strategy)."""

    def __init__(self, addresses: Sequence[str]):
        if not addresses:
            raise ValueError("Argument `servers` must name at least one table server (a 'ps' task). Received: []")
        self.addresses = list(addresses)
        self._clients: Dict[str, object] = {}
        self.placed = 0  # shards placed so far: tables start on different servers

    def client(self, index: int):
        address = self.addresses[index]
        if address not in self._clients:
            with tf.init_scope():
                self._clients[address] = tf.distribute.experimental.rpc.Client.create(
                    "grpc", address, timeout_in_ms=_TIMEOUT_MS
                )
        return self._clients[address]

    def call(self, index: int, method: str, args, spec):
        """The value of `method(*args)` on server `index` (its error raised)."""
        return self.call_many([(index, method, args, spec)])[0]

    def call_many(self, requests) -> list:
        """The values of `(server, method, args, spec)` requests, all sent before any is awaited: the servers
        work at the same time."""
        futures = [self.client(i).call(m, list(a), [spec], timeout_in_ms=_TIMEOUT_MS) for i, m, a, spec in requests]
        values = [f.get_value() for f in futures]
        return [v[0] if isinstance(v, (list, tuple)) else v for v in values]


def eager_call(servers: Servers, index: int, method: str, args, spec):
    """`servers.call` outside any graph, on values made into tensors."""
    with tf.init_scope():
        return servers.call(index, method, [tf.constant(a) for a in args], spec)


class _RowsOnServers(_compat.Trackable):
    """Whole-array reads and writes of a table on table servers, or of one of its optimizer slots (`_slot`), and
    its checkpoint entry: the same full-shape key as any other table's, so checkpoints restore across modes."""

    _slot = ""

    @property
    def _table(self) -> ServedTable:
        return self

    def read_rows(self, rows) -> tf.Tensor:
        """Rows at logical int64 `rows` (eager or in a graph), one call per shard."""
        table = self._table
        rows = tf.convert_to_tensor(rows, tf.int64)
        shard, local = table.layout.route(rows)
        shard = tf.cast(shard, tf.int32)
        locals_ = tf.dynamic_partition(local, shard, table.num_shards)
        where = tf.dynamic_partition(tf.range(tf.size(rows)), shard, table.num_shards)
        requests = [(table.server_of[s], "gather", [tf.constant(table.ids[s], tf.int64), tf.constant(self._slot),
                     locals_[s]], calls.FLAT) for s in range(table.num_shards)]  # fmt: skip
        parts = [tf.reshape(v, [-1, int(table.shape[1])]) for v in table.servers.call_many(requests)]
        return tf.reshape(tf.dynamic_stitch(where, parts), [-1, int(table.shape[1])])

    def write_rows(self, rows, values) -> list:
        """Writes `values` at logical int64 `rows` (eager or in a graph); returns the calls' results."""
        table = self._table
        rows = tf.convert_to_tensor(rows, tf.int64)
        values = tf.reshape(tf.convert_to_tensor(values, tf.float32), [-1, int(table.shape[1])])
        shard, local = table.layout.route(rows)
        shard = tf.cast(shard, tf.int32)
        locals_ = tf.dynamic_partition(local, shard, table.num_shards)
        parts = tf.dynamic_partition(values, shard, table.num_shards)
        requests = [(table.server_of[s], "scatter", [tf.constant(table.ids[s], tf.int64), tf.constant(self._slot),
                     locals_[s], tf.reshape(parts[s], [-1])], calls.SCALAR_INT)
                    for s in range(table.num_shards)]  # fmt: skip
        return table.servers.call_many(requests)

    def numpy(self) -> np.ndarray:
        """The whole array, read from the servers a chunk of rows at a time."""
        rows = int(self.shape[0])
        with tf.init_scope():
            parts = [self.read_rows(tf.range(a, min(rows, a + _CHUNK), dtype=tf.int64)) for a in range(0, rows, _CHUNK)]
            return np.concatenate([p.numpy() for p in parts]) if parts else np.zeros(self.shape, np.float32)

    def read_value(self) -> tf.Tensor:
        return tf.constant(self.numpy())

    def assign(self, value, use_locking: bool = False, name: Optional[str] = None, read_value: bool = False):
        """Writes the whole array to the servers."""
        value = np.asarray(value, np.float32)
        if list(value.shape) != self.shape.as_list():
            raise ValueError(f"'{self.name}': assign needs shape {self.shape.as_list()}. Received: {list(value.shape)}")
        with tf.init_scope():
            for a in range(0, int(self.shape[0]), _CHUNK):
                b = min(int(self.shape[0]), a + _CHUNK)
                self.write_rows(tf.range(a, b, dtype=tf.int64), value[a:b])
        return self.read_value() if read_value else None

    def checkpoint_slices(self) -> list:
        """`(start, stop, shard)` of the contiguous row ranges saved: one per shard's count of rows."""
        even = PartitionSpec(self._table.num_shards).bind(int(self.shape[0]))
        return [(o, o + s, i) for i, (o, s) in enumerate(zip(even.offsets, even.shard_sizes))]

    def slice_device(self, shard: int) -> str:
        """This worker's host, where the rows from the servers arrive. (Saving on the same task as the strategy's
        variables keeps TensorFlow's restore eager: it traces one across several tasks, where Keras's variables
        cannot take the restored values.)"""
        first = self._table.strategy.extended.worker_devices[0]
        return tf.DeviceSpec.from_string(first).replace(device_type="CPU", device_index=0).to_string()

    def read_slice(self, start: int, stop: int, shard: int) -> tf.Tensor:
        return self.read_rows(tf.range(start, stop, dtype=tf.int64))

    def restore_slices(self, values) -> list:
        ops = []
        for (start, stop, _), value in zip(self.checkpoint_slices(), values):
            ops += self.write_rows(tf.range(start, stop, dtype=tf.int64), value)
        return ops

    def _gather_saveables_for_checkpoint(self):
        return {_compat.VARIABLE_VALUE_KEY: lambda name: TableSaveable(self, name)}


class ServedSlot(_RowsOnServers):
    """An optimizer slot of a `ServedTable`, kept on its servers: read, written and checkpointed from here."""

    def __init__(self, table: ServedTable, slot: str, name: str):
        self._served, self._slot, self.name = table, slot, name
        self.shape, self.dtype = table.shape, table.dtype

    @property
    def _table(self) -> ServedTable:
        return self._served

    def __repr__(self):
        return f"<tfs.ServedSlot '{self.name}' of '{self._served.name}'>"


class _OnServers(registry.PlacementType):
    """Tables whose shards live on table servers, read and updated by each worker alone (hybrid training): the
    servers train them with the worker optimizer's class and config, from each worker's own gradients."""

    def __init__(self):
        super().__init__("servers", "on table servers", trained_remotely=True)

    def attach_optimizer(self, optimizer, table) -> None:
        table.configure(optimizer)

    def after_update(self, optimizer, tables) -> None:
        apply_pending(optimizer, tables)  # this worker's pending rows go to their servers


SERVERS = registry.register_placement(_OnServers())


class Served:
    """What every table on table servers has: its shards' servers (`server_of`) and ids there (`ids`), an
    `anchor` (the worker's variable that carries its gradient to the optimizer step) and the optimizer the
    servers train it with (`configure`)."""

    placement = "servers"
    placement_type = SERVERS
    exchange = None
    servers: Servers
    server_of: List[int]
    ids: List[int]
    optimizer_spec: Optional[dict] = None

    def configure(self, optimizer) -> None:
        """Sets `optimizer`'s class and config (a tfs.optimizers one) as the servers' optimizer of this table."""
        with tf.init_scope():  # the config reads the optimizer's variables' values
            spec = optimizer_spec(optimizer)
        if self.optimizer_spec == spec:
            return
        for s in range(self.num_shards):
            args = [np.int64(self.ids[s]), json.dumps(spec, sort_keys=True)]
            eager_call(self.servers, self.server_of[s], "configure", args, calls.SCALAR_INT)
        self.optimizer_spec = spec


@implements_table
class ServedTable(Served, registry.TableClass, _RowsOnServers):
    """A `rows x dim` float32 table whose shards live on table servers (hybrid training).

    Made by `strategy.create_sharded_variable` (and the layers) under a
    `tfs.hybrid.HybridStrategy`; shard `s` lives on the server that round-robin
    placement gives it. `variables` is the anchor alone: it holds no rows.
    """

    kind = FIXED
    # Set per instance (declared for the table protocol's check).
    name = shape = dtype = variables = num_shards = devices = trainable = strategy = layout = partition = None

    def __init__(self, config, strategy, servers: Servers, variable_factory=None):
        if config.dtype != tf.float32 or len(config.shape) != 2:
            raise ValueError(
                f"Table '{config.name}': tables on table servers are float32 and of rank 2. Received: "
                f"dtype={config.dtype.name}, shape={list(config.shape)}"
            )
        self.name, self.strategy, self.servers = config.name, strategy, servers
        self.shape = tf.TensorShape(config.shape)
        self.dtype = tf.float32
        self.trainable = config.trainable
        self.partition = resolve_spec(config.partitions, config.shape, config.dtype, config.scheme,
                                      len(servers.addresses))  # fmt: skip
        self.layout = self.partition.bind(int(self.shape[0]))
        self.num_shards = self.layout.num_shards
        start, servers.placed = servers.placed, servers.placed + self.num_shards
        self.server_of = [(start + s) % len(servers.addresses) for s in range(self.num_shards)]
        self.devices = tuple(servers.addresses[i] for i in self.server_of)
        seed = int(config.seed) if config.seed is not None else draw_seed()
        initializer, written = _initializer_spec(config.initializer, config.shape, seed)
        self.ids, made = [], []
        for shard in range(self.num_shards):
            spec = {"name": self.name, "rows": int(self.shape[0]), "dim": int(self.shape[1]), "shard": shard,
                    "num_shards": self.num_shards, "scheme": self.layout.scheme,
                    "initializer": initializer}  # fmt: skip
            text = json.dumps(spec, sort_keys=True)
            table_id, created = eager_call(servers, self.server_of[shard], "create", [text], calls.INTS).numpy()
            self.ids.append(int(table_id))
            made.append(bool(created))
        if written is not None:  # by the worker that made the shards: the others take its values
            for shard in (s for s in range(self.num_shards) if made[s]):
                for chunk in written.chunks(self.layout, shard, self.shape.as_list(), tf.float32, _CHUNK):
                    local, part = chunk.compute()
                    self.write_rows(tf.gather(self.layout.logical_rows_tf(shard), local), part)
        with tf.init_scope(), strategy.scope():
            initial = lambda: tf.zeros([], tf.float32)  # noqa: E731
            if variable_factory is None:
                anchor = tf.Variable(initial, name=f"{self.name}/anchor", trainable=config.trainable)
            else:
                anchor = variable_factory(0, initial, [], tf.float32, config.trainable)
        self.anchor = anchor
        self.variables = (anchor,)
        register_shards(self, self.variables)

    # ------------------------------------------------------- protocol --

    # The variables this process holds (the anchor alone), as for every table.
    held_variables = property(lambda self: self.variables)

    def check_ids(self, ids, arg: str = "ids", max_rank: Optional[int] = MAX_IDS_RANK):
        return check_ids(ids, int(self.shape[0]), self.name, arg, max_rank)

    def shard_rows(self, shard: int) -> int:
        return self.layout.shard_sizes[shard]

    def shard_lookups(self) -> np.ndarray:
        """The distinct ids each shard served in training steps so far, every worker's (int64 `[shards]`): the
        rows its server's applies updated, counted there."""
        out = np.zeros([self.num_shards], np.int64)
        for server in sorted(set(self.server_of)):
            mine = [s for s in range(self.num_shards) if self.server_of[s] == server]
            ids = np.array([self.ids[s] for s in mine], np.int64)
            out[mine] = eager_call(self.servers, server, "lookups", [ids], calls.INTS).numpy()
        return out

    def make_slot(self, name: str, fill: float) -> ServedSlot:
        """A view of the optimizer slot `name` that the servers keep beside the shards (`fill`: theirs)."""
        return ServedSlot(self, name.rsplit("/", 1)[-1], name)

    # ------------------------------------------------------- training --

    def __repr__(self):
        return f"<tfs.ServedTable '{self.name}' shape={self.shape.as_list()} on {list(self.devices)}>"


def lost_server(error: BaseException) -> Optional[str]:
    """One line for an error raised because a table server stopped answering a call, else None."""
    text = str(error)
    if "RpcService" not in text:
        return None
    found = re.search(r'grpc_message:"([^"]*)"', text)
    return f"a table server stopped answering ({found.group(1) if found else text.strip().splitlines()[0]})"


def optimizer_spec(optimizer) -> dict:
    """The class and config a server trains a table with: `optimizer`'s, as a `tfs.optimizers` class.

    The learning rate is sent with each step (a schedule runs on the worker), so the config's is a float.
    """
    name = type(optimizer).__name__
    if name not in SERVED_OPTIMIZERS:
        raise ValueError(
            f"Tables on table servers are trained by one of {list(SERVED_OPTIMIZERS)} (tfs.optimizers). "
            f"Received: optimizer={type(optimizer).__module__}.{name}"
        )
    config = dict(optimizer.get_config())
    config["learning_rate"] = 0.0
    for key in ("name", "clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor"):
        config.pop(key, None)
    return {"class_name": name, "config": config}


def _initializer_spec(initializer, shape, seed: int):
    """`(what the server draws rows from, or None; the initializer the worker writes rows from, or None)`.

    Per-row initializers (names, Keras's random and constant ones) are drawn on
    the servers from `[kind, a, b, seed]`, with no transfer; arrays and
    callables are computed here and written, one chunk of a shard at a time.
    """
    from tf_sharded import initializers

    init = initializers.resolve(initializer, list(shape), tf.float32, seed)
    if isinstance(init, initializers.RowInitializer):
        return [init.kind, init.a, init.b, init.seed], None
    return None, init


# ------------------------------------------------------------------ lookups --


def pending_lock() -> threading.Lock:
    """The lock of every graph's pending sends."""
    return _PENDING_LOCK


def pending_list() -> list:
    """The pending sends of the graph being built (eager: of the process's eager graph); they end with it: per
    backward pass, `(its tables, [(call, server, shard ids, counts, rows or keys, gradients)])`."""
    graph = tf.compat.v1.get_default_graph()
    if graph not in _PENDING:
        _PENDING[graph] = []
    return _PENDING[graph]


class _Group:
    """Tables of one lookup routed as one key space: tables of one width whose shards hold contiguous rows
    ("div", the default), or one table of another scheme. Each key is a table's row offset by the rows of the
    group's tables before it; `g` numbers the group's shards (table by table), so that a step's rows are
    de-duplicated, routed and sent with a few ops for all the group's tables."""

    def __init__(self, tables: List[ServedTable]):
        self.tables, self.dim = tables, int(tables[0].shape[1])
        self.row_offsets, starts, servers, shard_ids, base = [], [], [], [], 0
        for table in tables:
            self.row_offsets.append(base)
            for shard in range(table.num_shards):
                starts.append(base + table.layout.offsets[shard])
                servers.append(table.server_of[shard])
                shard_ids.append(table.ids[shard])
            base += int(table.shape[0])
        self.routed_by_layout = tables[0].layout.scheme != "div"  # one table, routed by its own layout
        self.starts, self.server_of, self.shard_ids = starts, servers, shard_ids

    def route(self, keys: tf.Tensor) -> tuple:
        """`(g, local row)` of distinct keys."""
        if self.routed_by_layout:
            shard, local = self.tables[0].layout.route(keys)
            return tf.cast(shard, tf.int64), local
        starts = tf.constant(self.starts, tf.int64)
        g = tf.searchsorted(starts, keys, side="right", out_type=tf.int64) - 1
        return g, keys - tf.gather(starts, g)

    def requests(self, keys: tf.Tensor) -> tuple:
        """`(distinct keys' positions in keys, [(server, shard ids, counts, rows, positions of its rows)])`."""
        uniq, position = tf.unique(keys)
        g, local = self.route(uniq)
        return uniq, position, by_server(g, local, self.server_of, self.shard_ids)


def by_server(g: tf.Tensor, local: tf.Tensor, server_of: List[int], shard_ids: List[int]) -> list:
    """Distinct entries routed to their shards (`g[i]`: entry i's shard among the `server_of` / `shard_ids`
    lists; `local[i]`: what the shard is asked, a row or a key), as one request per server:
    `[(server, its shard ids, counts, entries, positions of its entries)]`. Each server is asked for every
    shard it holds here (a count of 0 for those without entries)."""
    servers = sorted(set(server_of))
    # Each entry's server, then within a server in shard order: `counts` describe contiguous runs.
    server_index = tf.gather(tf.constant([servers.index(s) for s in server_of], tf.int32), g)
    where = tf.dynamic_partition(tf.range(tf.size(g)), server_index, len(servers))
    out = []
    for k, server in enumerate(servers):
        mine = [i for i, s in enumerate(server_of) if s == server]
        index_of = tf.constant([mine.index(i) if i in mine else 0 for i in range(len(server_of))], tf.int32)
        slots = tf.gather(index_of, tf.gather(g, where[k]))
        order = tf.argsort(slots, stable=True)
        positions = tf.gather(where[k], order)
        counts = tf.math.bincount(slots, minlength=len(mine), maxlength=len(mine), dtype=tf.int64)
        ids = tf.constant([shard_ids[i] for i in mine], tf.int64)
        out.append((server, ids, counts, tf.gather(local, positions), positions))
    return out


def lookup_served(pairs) -> list:
    """Rows for `(ServedTable, flat int64 ids)` pairs: one `lookup` call per server for all of them.

    Pairs of one table are read together (one row set per shard and step, so
    the server applies one update per shard and step); tables of one width
    are routed together (`_Group`).
    """
    tables, ids_of = by_table(pairs)
    grouped: Dict[tuple, List[ServedTable]] = {}
    for table in tables:
        div = table.layout.scheme == "div"
        grouped.setdefault((int(table.shape[1]),) if div else (id(table),), []).append(table)
    groups, plans = [_Group(members) for members in grouped.values()], []
    for group in groups:
        flats = [tf.concat(ids_of[id(t)], 0) for t in group.tables]
        keys = tf.concat([f + offset for f, offset in zip(flats, group.row_offsets)], 0)
        plans.append((flats, *group.requests(keys)))
    calls_made = [(group, request) for group, plan in zip(groups, plans) for request in plan[3]]
    servers = tables[0].servers
    ordered = [t for group in groups for t in group.tables]

    @tf.custom_gradient
    def fetch(*anchors):
        found = servers.call_many([(r[0], "lookup", list(r[1:4]), calls.FLAT) for _, r in calls_made])
        out, k = [], 0
        for group, (_, uniq, _, requests) in zip(groups, plans):
            values = [tf.reshape(v, [-1, group.dim]) for v in found[k : k + len(requests)]]
            k += len(requests)
            stitched = tf.dynamic_stitch([tf.cast(r[4], tf.int32) for r in requests], values)
            out.append(tf.reshape(stitched, [tf.size(uniq), group.dim]))

        def grad(*upstream):
            sends = []
            for group_rows, dy, (_, _, _, requests) in zip(out, upstream, plans):
                dy = tf.zeros_like(group_rows) if dy is None else tf.convert_to_tensor(dy)
                for server, shard_ids, counts, rows, positions in requests:
                    gradients = tf.reshape(tf.gather(dy, positions), [-1])
                    sends.append(("apply", server, shard_ids, counts, rows, gradients))
            with _PENDING_LOCK:
                pending_list().append((tuple(ordered), sends))
            return [tf.zeros_like(a) for a in anchors]

        return out, grad

    unique_rows = fetch(*[tf.identity(t.anchor) for t in ordered])
    rows_of = {}
    for group, rows, (flats, _, position, _) in zip(groups, unique_rows, plans):
        parts = tf.split(tf.gather(rows, position), [tf.size(f) for f in flats]) if len(flats) > 1 else [
            tf.gather(rows, position)]  # fmt: skip
        for table, part in zip(group.tables, parts):
            sizes = [tf.size(f) for f in ids_of[id(table)]]
            rows_of[id(table)] = list(tf.split(part, sizes)) if len(sizes) > 1 else [part]
    return in_pair_order(pairs, rows_of)


def by_table(pairs) -> tuple:
    """`(the tables of (table, ids) pairs in first-seen order, {id(table): its ids, pair by pair})`."""
    tables, ids_of = [], {}
    for table, flat in pairs:
        if id(table) not in ids_of:
            tables.append(table)
            ids_of[id(table)] = []
        ids_of[id(table)].append(flat)
    return tables, ids_of


def in_pair_order(pairs, rows_of: Dict[int, list]) -> list:
    """The rows of each pair, from `rows_of[id(table)]` (the table's rows, pair by pair)."""
    used = {id(table): 0 for table, _ in pairs}
    results = []
    for table, _ in pairs:
        results.append(rows_of[id(table)][used[id(table)]])
        used[id(table)] += 1
    return results


def apply_pending(optimizer, tables: Optional[Sequence[ServedTable]] = None) -> list:
    """Sends the pending gradients of `tables` (default: all) from this graph's backward passes to their servers,
    trained there by `optimizer`'s class and config at its current learning rate. Returns the calls' results.

    Keras optimizers do this in their step (tf_sharded's routing); a custom
    loop that applies gradients itself calls it after the backward pass.
    """
    with _PENDING_LOCK:
        pending = pending_list()
        wanted = None if tables is None else {id(t) for t in tables}
        mine = [p for p in pending if wanted is None or {id(t) for t in p[0]} & wanted]
        pending[:] = [p for p in pending if not any(p is m for m in mine)]
    if not mine:
        return []
    for table_set, _ in mine:
        for table in table_set:
            table.configure(optimizer)
    # One call per server and kind of table for all of them: each server steps each of its arenas once.
    sent: Dict[tuple, list] = {}
    for _, sends in mine:
        for method, server, *arrays in sends:
            sent.setdefault((server, method), []).append(arrays)
    learning_rate = tf.cast(optimizer.learning_rate, tf.float32)
    iterations = tf.cast(optimizer.iterations, tf.int64)
    requests = []
    for (server, method), parts in sorted(sent.items()):
        arrays = [tf.concat([part[k] for part in parts], 0) if len(parts) > 1 else parts[0][k] for k in range(4)]
        requests.append((server, method, [*arrays, learning_rate, iterations], calls.SCALAR_INT))
    return mine[0][0][0].servers.call_many(requests)


registry.register_lookup(
    SERVERS, FIXED, lambda pairs, max_norm, training: [clip_rows(r, max_norm) for r in lookup_served(pairs)]
)
