"""Dynamic tables (raw int64 or string keys) on table servers, the worker side of hybrid training.

A `ServedDynamicTable` is a `tfs.DynamicTable` whose shards live on the
table servers: shard `s` (the keys whose hash lands there, as for any
dynamic table) is a one-shard dynamic table on its server, with its index,
row pool, policies' state and optimizer columns. The worker holds no rows.

* A lookup de-duplicates each table's keys, counts their occurrences, and
  sends every server one call for all its shards of the step's tables of
  one key dtype and width. A training lookup inserts the keys there (under
  the table's admission and eviction policies, which see the batch's
  occurrences); others read absent keys' initial rows, the same function of
  (seed, key) as anywhere.
* The backward pass keeps the keys' gradient rows pending, and the
  worker's optimizer step sends them (`tf_sharded.hybrid.table`'s anchor
  and pending sends, as for `ServedTable`); the server applies them with
  its shard's optimizer, at the worker's learning rate and step.
* `size()`, `export()`, `step`, `assign_keys()` and checkpoints ask the
  servers; the checkpoint entry is a `DynamicTable`'s (live keys, rows,
  optimizer columns, counters, admission sketch), so it restores into a
  dynamic table under any strategy and layout, and back.

Each shard counts its own training lookups (`step`); every training lookup
of a table reaches each of its shards, so they agree, and `step` is theirs.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from tf_sharded import initializers, policies
from tf_sharded.errors import positive_int
from tf_sharded.hybrid import calls
from tf_sharded.hybrid.table import (
    SERVERS,
    Served,
    Servers,
    by_server,
    by_table,
    eager_call,
    in_pair_order,
    pending_list,
    pending_lock,
)
from tf_sharded.table import registry
from tf_sharded.table.dynamic.keys import shard_of_keys
from tf_sharded.table.dynamic.pool import EVENTS, GROWTH
from tf_sharded.table.dynamic.slots import DynamicSlot
from tf_sharded.table.dynamic.table import DYNAMIC, DynamicTable
from tf_sharded.table.norms import clip_rows
from tf_sharded.table.protocol import register_shards

# A step after any table's: an export "since" it holds no keys, only the shard's counters.
_COUNTERS_ONLY = 2**62


class ServedDynamicTable(Served, DynamicTable):
    """A float32 `tfs.DynamicTable` whose shards live on table servers (hybrid training).

    Made by `create_dynamic_table` (and `tfs.layers.DynamicEmbedding`,
    `EmbeddingCollection`) under a `tfs.hybrid.HybridStrategy`: one shard per
    server unless `partitions` says otherwise, placed round-robin after the
    tables made before it. `variables` is the anchor alone: it holds no rows.
    """

    def __init__(self, name: str, dim: int, key_dtype, initializer, seed: int, strategy, servers: Servers,
                 partitions: Optional[int] = None, trainable: bool = True, dtype=tf.float32,
                 max_rows: Optional[int] = None, growth: float = GROWTH, admission=None, eviction=None):  # fmt: skip
        self._settings(name, dim, key_dtype, dtype, initializer, seed, trainable, strategy, admission, eviction)
        if self._dtype != tf.float32:
            raise ValueError(
                f"Dynamic table '{name}': tables on table servers are float32. Received: dtype={self._dtype.name}"
            )
        self._check_growth(growth, max_rows)
        self._exchange, self._placement = None, "servers"
        self.servers = servers
        self._count = positive_int("partitions", partitions) if partitions is not None else len(servers.addresses)
        start, servers.placed = servers.placed, servers.placed + self._count
        self.server_of = [(start + s) % len(servers.addresses) for s in range(self._count)]
        self._shards, self._held, self._ids = [], [], []
        evictions = _per_shard(self._evictions, self._count)
        for shard in range(self._count):
            init = self._initializer
            spec = {"kind": "dynamic", "name": name, "shard": shard, "num_shards": self._count, "dim": self._dim,
                    "key_dtype": self._key_dtype.name, "seed": self._seed, "trainable": self._trainable,
                    "initializer": [init.kind, init.a, init.b, init.seed], "growth": float(growth),
                    "max_rows": None if max_rows is None else -(-int(max_rows) // self._count),
                    "admission": policies.serialize_policies(self._admission),
                    "eviction": [policies.serialize_policies(e) for e in evictions]}  # fmt: skip
            text = json.dumps(spec, sort_keys=True)
            made = eager_call(servers, self.server_of[shard], "create", [text], calls.INTS).numpy()
            self._ids.append(int(made[0]))
            # The first worker to make shard 0 sets the seeds (unseeded workers draw their own): every worker, and
            # every shard, then gives a key the same initial row.
            self._seed = int(made[2])
            self._initializer = initializers.RowInitializer(init.kind, init.a, init.b, int(made[3]))
        with tf.init_scope(), strategy.scope():
            self.anchor = tf.Variable(lambda: tf.zeros([], tf.float32), name=f"{name}/anchor", trainable=trainable)
        self.optimizer_spec: Optional[dict] = None
        self._kind = "keys" if self._key_dtype == tf.int64 else "strings"
        register_shards(self, (self.anchor,))

    # ---------------------------------------------------------------- where --

    ids = property(lambda self: list(self._ids))
    num_shards = property(lambda self: self._count)
    devices = property(lambda self: tuple(self.servers.addresses[i] for i in self.server_of))
    variables = property(lambda self: (self.anchor,))
    held_variables = property(lambda self: (self.anchor,))

    def __repr__(self):
        return (
            f"<tfs.ServedDynamicTable '{self._name}' dim={self._dim} key_dtype={self._key_dtype.name} "
            f"on {list(self.devices)}>"
        )

    # ------------------------------------------------------------ contents --

    def _call_each(self, method: str, args_of, spec) -> list:
        """`method` on every shard's server at once (`args_of(shard)`: its arguments after the shard id)."""
        with tf.init_scope():
            requests = [(self.server_of[s], f"{method}_{self._kind}",
                         [tf.constant(self._ids[s], tf.int64), *args_of(s)], spec)
                        for s in range(self._count)]  # fmt: skip
            return self.servers.call_many(requests)

    def _exports(self, columns: Sequence[str], since_step: Optional[int]) -> list:
        """Per shard: `(keys, rows, {column: values}, seen, hits, step, size, sketch or None, index buckets,
        events)`."""
        text = tf.constant(json.dumps({"columns": list(columns), "since_step": since_step}))
        spec = (calls.KEYS[self._kind], calls.FLAT, calls.INTS)
        out = []
        for keys, floats, ints in self._call_each("export", lambda s: [text], spec):
            n = int(keys.shape[0])
            parts = tf.split(tf.reshape(floats, [-1, self._dim]), [n] * (1 + len(columns)))
            counted = 2 * n + 3 + len(EVENTS)
            seen, hits, sketch = ints[:n], ints[n : 2 * n], ints[counted:]
            step, size, buckets = ints[2 * n : 2 * n + 3].numpy()
            out.append((keys, parts[0], dict(zip(columns, parts[1:])), seen, hits, step, size,
                        sketch if int(sketch.shape[0]) else None, buckets, ints[2 * n + 3 : counted]))  # fmt: skip
        return out

    @property
    def step(self) -> tf.Tensor:
        """Training lookups of the table so far (its shards count them alike)."""
        return tf.constant(max(int(e[5]) for e in self._exports((), _COUNTERS_ONLY)), tf.int64)

    def size(self) -> tf.Tensor:
        return tf.constant(sum(int(e[6]) for e in self._exports((), _COUNTERS_ONLY)), tf.int64)

    def shard_sizes(self) -> tf.Tensor:
        """Live keys of each shard (int64 vector), from its server."""
        return tf.constant([int(e[6]) for e in self._exports((), _COUNTERS_ONLY)], tf.int64)

    def shard_events(self) -> tf.Tensor:
        """Each shard's `EVENTS` counters (`[shards, len(EVENTS)]` int64), from its server."""
        return tf.stack([e[9] for e in self._exports((), _COUNTERS_ONLY)])

    def index_buckets(self) -> tf.Tensor:
        return tf.constant(sum(int(e[8]) for e in self._exports((), _COUNTERS_ONLY)), tf.int64)

    def export_columns(self, columns: Sequence[str] = (), since_step: Optional[int] = None):
        wanted = [c for c in columns if c not in ("seen", "hits")]
        parts = self._exports(wanted, since_step)
        keys = tf.concat([p[0] for p in parts], 0)
        values = tf.concat([p[1] for p in parts], 0)
        extra = {c: tf.concat([p[2][c] for p in parts], 0) for c in wanted}
        for name, k in (("seen", 3), ("hits", 4)):
            if name in columns:
                extra[name] = tf.concat([p[k] for p in parts], 0)
        return keys, values, extra

    def _saved_sketch(self):
        sketches = [e[7] for e in self._exports((), _COUNTERS_ONLY) if e[7] is not None]
        if not sketches:
            return None
        # Each key's counts are in its shard's sketch: the elementwise maximum never underestimates one.
        return tf.cast(tf.reshape(tf.reduce_max(tf.stack(sketches), 0), self._sketch_shape()), tf.int32)

    def _sketch_shape(self) -> Optional[list]:
        """A `MinCountAdmission`'s sketch (int32 counts), the only admission state."""
        if isinstance(self._admission, policies.MinCountAdmission):
            return [self._admission.sketch_depth, self._admission.sketch_width]
        return None

    def _assign_all(self, keys, values, columns: Dict[str, tf.Tensor], step=None, sketch=None) -> None:
        """Every shard's whole content from `(keys, values, columns)` (split by the keys' shards); with `step`
        and `sketch`, the shards' counters too."""
        keys, values = tf.convert_to_tensor(keys), tf.convert_to_tensor(values, tf.float32)
        floats = sorted(c for c in columns if c not in ("seen", "hits"))
        ints = [c for c in ("seen", "hits") if c in columns]
        parts = self._partition(keys, values, *[tf.convert_to_tensor(columns[c]) for c in floats + ints])
        request = {"columns": floats, "ints": ints, "step": None if step is None else int(step),
                   "sketch": sketch is not None}  # fmt: skip
        text = tf.constant(json.dumps(request))

        def args_of(s):
            flat = tf.concat([tf.reshape(tf.cast(p[s], tf.float32), [-1]) for p in parts[1 : 2 + len(floats)]], 0)
            counters = [tf.cast(p[s], tf.int64) for p in parts[2 + len(floats) :]]
            if sketch is not None:
                counters.append(tf.reshape(tf.cast(sketch, tf.int64), [-1]))
            return [text, parts[0][s], flat, tf.concat(counters, 0) if counters else tf.zeros([0], tf.int64)]

        self._call_each("assign", args_of, calls.SCALAR_INT)

    def assign_keys(self, keys, values, columns: Optional[Dict[str, tf.Tensor]] = None) -> None:
        keys = tf.convert_to_tensor(keys)
        if keys.dtype != self._key_dtype:
            raise TypeError(
                f"Dynamic table '{self._name}' has key_dtype={self._key_dtype.name}; the keys to load are "
                f"{keys.dtype.name}. Received keys saved from another table."
            )
        self._assign_all(keys, values, dict(columns or {}))

    def set_column(self, column: str, keys, values) -> None:
        keys = tf.convert_to_tensor(keys, self._key_dtype)
        key_parts, value_parts = self._partition(keys, tf.convert_to_tensor(values, tf.float32))
        column = tf.constant(column)
        args_of = lambda s: [column, key_parts[s], tf.reshape(value_parts[s], [-1])]  # noqa: E731
        self._call_each("set_column", args_of, calls.SCALAR_INT)

    def reset_lost(self) -> int:
        return 0  # nothing of it lives on a parameter server of the strategy

    # ------------------------------------------------------------ training --

    def make_slot(self, name: str, fill: float) -> DynamicSlot:
        """The optimizer column `name` the servers keep beside the shards' rows, read and saved from here."""
        column = name.rsplit("/", 1)[-1]
        if column not in self._slots:
            self._slots[column] = DynamicSlot(self, column, ())
        return self._slots[column]

    # ---------------------------------------------------------- checkpoints --

    def _restore_from_tensors(self, restored_tensors):
        columns = {k[len("slot-") :]: v for k, v in restored_tensors.items() if k.startswith("slot-")}
        columns.update({k: restored_tensors[k] for k in ("seen", "hits") if k in restored_tensors})
        self._assign_all(restored_tensors["keys"], restored_tensors["values"], columns,
                         restored_tensors.get("step"), restored_tensors.get("sketch"))  # fmt: skip
        return tf.no_op() if not tf.executing_eagerly() else None


def _per_shard(evictions, count: int) -> list:
    """The evictions a shard of `count` applies: a capacity bound as its share of the keys."""
    return [
        policies.CapacityEviction(e.per_shard(count), e.policy, e.headroom)
        if isinstance(e, policies.CapacityEviction)
        else e
        for e in evictions
    ]


# ------------------------------------------------------------------ lookups --


def lookup_served_dynamic(pairs, training: bool = True) -> list:
    """Rows for `(ServedDynamicTable, rank-1 keys)` pairs: one call per server for each key dtype and width.

    A table's pairs are looked up as one (one training lookup of the table,
    one update per shard and step, as for `ServedTable`s).
    """
    tables, keys_of = by_table(pairs)
    grouped: Dict[tuple, List[ServedDynamicTable]] = {}
    for table in tables:
        grouped.setdefault((table.key_dtype, table.dim), []).append(table)
    plans = [_plan(members, keys_of) for members in grouped.values()]
    ordered = [t for members in grouped.values() for t in members]
    flag = tf.constant(1 if training else 0, tf.int64)
    sent = [(plan, request) for plan in plans for request in plan["requests"]]
    servers = tables[0].servers

    @tf.custom_gradient
    def fetch(*anchors):
        found = servers.call_many([(server, f"lookup_{plan['kind']}", [ids, counts, keys, occurred, flag], calls.FLAT)
                                   for plan, (server, ids, counts, keys, _, occurred) in sent])  # fmt: skip
        out, k = [], 0
        for plan in plans:
            requests = plan["requests"]
            values = [tf.reshape(v, [-1, plan["dim"]]) for v in found[k : k + len(requests)]]
            k += len(requests)
            stitched = tf.dynamic_stitch([tf.cast(r[4], tf.int32) for r in requests], values)
            out.append(tf.reshape(stitched, [plan["total"], plan["dim"]]))

        def grad(*upstream):
            sends = []
            for rows, dy, plan in zip(out, upstream, plans):
                dy = tf.zeros_like(rows) if dy is None else tf.convert_to_tensor(dy)
                for server, ids, counts, keys, positions, _ in plan["requests"]:
                    gradients = tf.reshape(tf.gather(dy, positions), [-1])
                    sends.append((f"apply_{plan['kind']}", server, ids, counts, keys, gradients))
            with pending_lock():
                pending_list().append((tuple(ordered), sends))
            return [tf.zeros_like(a) for a in anchors]

        return out, grad

    unique_rows = fetch(*[tf.identity(t.anchor) for t in ordered])
    rows_of = {}
    for plan, rows in zip(plans, unique_rows):
        for table, (start, size, idx) in zip(plan["tables"], plan["slices"]):
            mine = tf.gather(tf.slice(rows, [start, 0], [size, plan["dim"]]), idx)
            sizes = [tf.size(f) for f in keys_of[id(table)]]
            rows_of[id(table)] = list(tf.split(mine, sizes)) if len(sizes) > 1 else [mine]
    return in_pair_order(pairs, rows_of)


def _plan(tables: List[ServedDynamicTable], keys_of: Dict[int, list]) -> dict:
    """The calls of a lookup of `tables` (one key dtype and width): each table's distinct keys and their
    occurrences, routed by their shard to the servers (`by_server`)."""
    uniques, occurrences, shards, slices, start = [], [], [], [], 0
    server_of, shard_ids, base = [], [], 0
    for table in tables:
        flat = tf.concat(keys_of[id(table)], 0)
        uniq, idx = tf.unique(flat, out_idx=tf.int32)
        size = tf.size(uniq, out_type=tf.int32)
        uniques.append(uniq)
        occurrences.append(tf.math.unsorted_segment_sum(tf.ones_like(idx, tf.int64), idx, size))
        shards.append(tf.cast(shard_of_keys(uniq, table.num_shards), tf.int64) + base)
        slices.append((start, size, idx))
        start += size
        server_of += table.server_of
        shard_ids += table.ids
        base += table.num_shards
    keys, occurred = tf.concat(uniques, 0), tf.concat(occurrences, 0)
    requests = [(server, ids, counts, local, positions, tf.gather(occurred, positions))
                for server, ids, counts, local, positions in
                by_server(tf.concat(shards, 0), keys, server_of, shard_ids)]  # fmt: skip
    kind = "keys" if tables[0].key_dtype == tf.int64 else "strings"
    return {"tables": tables, "slices": slices, "total": start, "dim": tables[0].dim, "kind": kind,
            "requests": requests}  # fmt: skip


def create(strategy, name, dim, key_dtype, initializer, partitions, seed, admission, eviction, **options):
    """`create_dynamic_table` under a `HybridStrategy`: a `ServedDynamicTable` on its table servers."""
    if options.pop("placement", None) is not None:
        raise ValueError(
            f"Argument `placement` of dynamic table '{name}' does not apply under HybridStrategy (its shards are "
            f"on the table servers). Received: placement='sharded'"
        )
    from tf_sharded.table.builder import draw_seed

    seed = draw_seed() if seed is None else seed
    return ServedDynamicTable(name, dim, key_dtype, initializer, seed, strategy, strategy.servers, partitions,
                              admission=admission, eviction=eviction, **options)  # fmt: skip


registry.register_lookup(
    SERVERS,
    DYNAMIC,
    lambda pairs, max_norm, training: [clip_rows(r, max_norm) for r in lookup_served_dynamic(pairs, training)],
)
