"""Sparse-gradient exchange for mirrored tables.

Under `MirroredStrategy` / `MultiWorkerMirroredStrategy` every replica holds
(or reads) the whole table and computes a sparse gradient for the rows its
batch touched. TensorFlow sums such gradients by all-gathering every
replica's indices and values with every duplicate kept. Here each table
chooses, per shard:

* `"allgather"`: each replica's slices hold each row once (the lookup already
  de-duplicates; several lookups of one table in a step are merged first);
  the slices of all replicas are gathered, merged again (unique + segment
  sum) and applied once;
* `"dense"`: the gradient is densified to its shard's shape and all-reduced
  (TensorFlow's collective, under either strategy); the optimizer gets the
  dense sum;
* `"auto"`: a cost model (below) picks one of the two per shard and step.

Two transports, chosen by where the replicas run:

* **Collective** (`MultiWorkerMirroredStrategy`, or `MERGE_IN_PROCESS` off):
  indices travel bit-cast inside the value rows, so one collective gather
  moves both, and every replica merges what it received. "auto": if even the
  number of ids the step looks up (its static batch shape, agreed across
  replicas) is below the break-even, all-gather is chosen when the step is
  traced and costs nothing extra. Otherwise, every step, the replicas
  all-gather their distinct-row counts (one scalar each), evaluate the cost
  model on the largest, and all take the same branch. Collectives cannot sit
  under `tf.cond` in a replica function, so both collectives run every step
  and the branch not taken carries only a one-row marker payload. Every
  collective payload carries one marker row (index -1, zero values), dropped
  by the merge after the gather: a collective whose every participant sends
  nothing never completes, and a shard that no replica touched in a step is
  common.
* **In process** (`MirroredStrategy`: every replica is a device of this
  process and they meet in a `merge_call`): the replicas' slices are
  concatenated on the first replica's device, merged there once, and each
  replica gets a copy of the merged slices. This is what TensorFlow's own
  fallback all-gather does for `MirroredStrategy` (gather on one device, then
  broadcast) minus the padding, and the merge runs once instead of once per
  replica; between host-memory devices the copies are references. "auto"
  then decides inside that one merge, from the exact gathered count, between
  the hash merge and a densified merge (every gathered row is placed by a
  table-sized position map, no hash table): both give the touched rows and
  their sums, so no collective and no marker is needed to agree.

Cost model, per shard and step, in bytes-equivalent (`R` replicas, `u` the
largest distinct-row count of any replica, `b` bytes per row, `k =
MERGE_FACTOR`, `k1 = LOCAL_MERGE_FACTOR`):

    collective  allgather = u * (b + 8) * ((R - 1) + k * R)  # receive, then merge + apply, per replica
                dense     = 2 * (R - 1) / R * rows * b       # ring all-reduce, per replica
    in process  allgather = k1 * R * u * (b + 8)             # one hash merge of all gathered rows
                dense     = 8 * rows + R * u * b              # position map over the table + one segment sum

`k` is what merging and applying one gathered row costs relative to
receiving it; on a single host, where a collective is a memory copy, it
dominates, and on a real network the transfer term does. `k1` is a hash
merge's cost per byte relative to a segment sum's. Both defaults come from
`python -m tf_sharded bench exchange` (`k`) and the merge sweep
`python -m tf_sharded.benchmarks.exchange` (`k1`, RFC.md §5a) on a 2-core CPU
machine. A declared `ids_per_step` fixes the choice at trace time
instead.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from typing import Callable, List, Optional, Tuple

import tensorflow as tf

from tf_sharded.sharded_variable import shard_owner

EXCHANGES = ("auto", "allgather", "dense")
ID_BYTES = 8
MERGE_FACTOR = 4.0
LOCAL_MERGE_FACTOR = 1.1
# Bytes-equivalent per table row of the in-process densified merge's position map (two int32 passes).
MAP_BYTES_PER_ROW = 8
# Under MirroredStrategy, gather on one device and merge once there (see the module docstring).
MERGE_IN_PROCESS = True

# Per graph being traced (weakly, so finished traces are dropped):
# {(table id, thread id): (lookups, static ids)}.
_TRACED = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def cost_bytes(
    mode: str,
    rows: int,
    row_bytes: int,
    replicas: int,
    distinct_ids: int,
    merge_factor: Optional[float] = None,
    in_process: bool = False,
) -> float:
    """Bytes-equivalent cost of one shard's exchange per step under `mode` (see the module docstring).

    Collective: what one replica handles; in process: what the one merge handles.

    Example:

    >>> cost_bytes("allgather", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000, merge_factor=0)
    408000.0
    >>> cost_bytes("dense", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000)
    192000000.0
    >>> cost_bytes("dense", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000, in_process=True)
    8512000.0
    """
    if mode not in ("allgather", "dense"):
        raise ValueError(f"Argument `mode` must be 'allgather' or 'dense'. Received: mode={mode!r}")
    if in_process:
        gather, dense = _local_costs(rows, row_bytes, replicas * distinct_ids, merge_factor)
        return float(gather if mode == "allgather" else dense)
    k = MERGE_FACTOR if merge_factor is None else merge_factor
    if mode == "allgather":
        return float(distinct_ids * (row_bytes + ID_BYTES) * ((replicas - 1) + k * replicas))
    return 2.0 * (replicas - 1) / replicas * rows * row_bytes


def _local_costs(rows: int, row_bytes: int, gathered, merge_factor: Optional[float] = None):
    """In-process (hash merge, densified merge) costs of `gathered` rows (a number or a float tensor)."""
    k = LOCAL_MERGE_FACTOR if merge_factor is None else merge_factor
    return k * (row_bytes + ID_BYTES) * gathered, MAP_BYTES_PER_ROW * rows + row_bytes * gathered


def choose(
    rows: int,
    row_bytes: int,
    replicas: int,
    distinct_ids: Optional[int],
    merge_factor: Optional[float] = None,
    in_process: bool = False,
) -> str:
    """The cheaper exchange for one shard; allgather when `distinct_ids` is unknown.

    Example:

    >>> choose(rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000)
    'allgather'
    >>> choose(rows=1_000, row_bytes=128, replicas=4, distinct_ids=1000)
    'dense'
    """
    if distinct_ids is None:
        return "allgather"
    u = min(int(distinct_ids), int(rows))
    args = (rows, row_bytes, replicas, u, merge_factor, in_process)
    return "allgather" if cost_bytes("allgather", *args) <= cost_bytes("dense", *args) else "dense"


def break_even_ids(
    rows: int, row_bytes: int, replicas: int, merge_factor: Optional[float] = None, in_process: bool = False
) -> float:
    """Distinct ids per replica above which "auto" densifies (infinite if it never does).

    Example:

    >>> round(break_even_ids(rows=1_000_000, row_bytes=128, replicas=4))
    74303
    >>> round(break_even_ids(rows=1_000_000, row_bytes=128, replicas=4, in_process=True))
    92593
    """
    args = (rows, row_bytes, replicas)
    dense_at_zero = cost_bytes("dense", *args, 0, merge_factor, in_process)
    per_id = cost_bytes("allgather", *args, 1, merge_factor, in_process) - (
        cost_bytes("dense", *args, 1, merge_factor, in_process) - dense_at_zero
    )
    return dense_at_zero / per_id if per_id > 0 else float("inf")


class ExchangePolicy:
    """What a mirrored table does with its sparse gradients.

    Args:
      mode: "auto", "allgather" or "dense".
      ids_per_step: optional declared bound on the distinct ids one replica
        looks up in this table per step; "auto" then decides once, at trace
        time, instead of every step.
    """

    def __init__(self, mode: str = "auto", ids_per_step: Optional[int] = None):
        if mode not in EXCHANGES:
            raise ValueError(f"Argument `exchange` must be one of {EXCHANGES}. Received: exchange={mode!r}")
        if ids_per_step is not None and (
            isinstance(ids_per_step, bool) or not isinstance(ids_per_step, numbers.Integral) or ids_per_step < 1
        ):
            raise ValueError(
                f"Argument `ids_per_step` must be a positive int or None. Received: ids_per_step={ids_per_step!r}"
            )
        self.mode = mode
        self.ids_per_step = ids_per_step

    def __repr__(self):
        return f"ExchangePolicy(mode={self.mode!r}, ids_per_step={self.ids_per_step})"


def _traced_here() -> dict:
    graph = tf.compat.v1.get_default_graph()
    if graph not in _TRACED:
        _TRACED[graph] = {}
    return _TRACED[graph]


def note_lookup(table, num_ids: Optional[int] = None) -> None:
    """Counts the lookups of `table` (and their static number of ids) in the step being traced.

    Read by the mirrored exchange and by `tfs.optimizers` (a table looked up
    once has distinct rows per shard). Nothing is recorded eagerly.
    """
    if tf.executing_eagerly():
        return
    key = (id(table), threading.get_ident())
    with _LOCK:
        traced = _traced_here()
        if key not in traced:
            traced[key] = (1, num_ids)
        else:
            lookups, ids = traced[key]
            traced[key] = (lookups + 1, None if ids is None or num_ids is None else ids + num_ids)


def traced_ids(table) -> Optional[int]:
    """Static number of ids the traced step looks up in `table` (an upper bound on distinct ids)."""
    with _LOCK:
        return _traced_here().get((id(table), threading.get_ident()), (0, None))[1]


def single_lookup(table) -> bool:
    """Whether the traced step looked `table` up exactly once.

    Then each shard's gradient already holds every row once (the lookup
    de-duplicates) and the merge before the gather can be skipped. Eagerly
    nothing is recorded and this is False.
    """
    with _LOCK:
        return _traced_here().get((id(table), threading.get_ident()), (0, None))[0] == 1


def owner(variable) -> Optional[Tuple[object, int]]:
    """`(table, shard)` of a shard of a mirrored table (one with an exchange policy), else None."""
    tag = shard_owner(variable)
    return tag if tag is not None and tag[0]._exchange is not None else None


def _merge(indices: tf.Tensor, values: tf.Tensor):
    unique, position = tf.unique(indices, out_idx=tf.int32)
    return unique, tf.math.unsorted_segment_sum(values, position, tf.size(unique))


def _map_merge(indices: tf.Tensor, values: tf.Tensor, rows: int):
    """`_merge` through a table-sized position map instead of a hash table; rows come out sorted.

    Cheaper than hashing once the gathered rows are a large fraction of the
    table (RFC.md §5a): two passes over `rows` int32s, no probing.
    """
    dtype = tf.int32 if rows < 2**31 else tf.int64
    at = tf.cast(indices, dtype)
    present = tf.scatter_nd(at[:, None], tf.ones_like(at), tf.constant([rows], dtype)) > 0
    unique = tf.where(present)[:, 0]
    position = tf.math.cumsum(tf.cast(present, dtype)) - 1
    return unique, tf.math.unsorted_segment_sum(values, tf.gather(position, at), tf.size(unique, out_type=dtype))


def in_process(ctx) -> bool:
    """Whether the replicas of `ctx` are devices of this process that meet in a `merge_call` (MirroredStrategy)."""
    strategy = ctx.strategy
    return (
        MERGE_IN_PROCESS
        and isinstance(strategy, tf.distribute.MirroredStrategy)
        and strategy.extended._use_merge_call()
    )


def _merge_on_one_device(ctx, indices: tf.Tensor, values: tf.Tensor, merge) -> tuple:
    """Every replica's slices concatenated on the first replica's device, merged there once, copied to each.

    `merge(indices, values)` returns a tuple of tensors; each replica gets
    them plus the number of rows gathered.
    """

    def on_one_device(strategy, indices, values):
        with tf.device(strategy.extended.worker_devices[0]):
            all_indices = tf.concat(strategy.experimental_local_results(indices), 0)
            all_values = tf.concat(strategy.experimental_local_results(values), 0)
            result = tuple(merge(all_indices, all_values)) + (tf.size(all_indices),)
        return tuple(strategy.extended.broadcast_to(t, destinations=values) for t in result)

    return ctx.merge_call(on_one_device, args=(indices, values))


def _pack(indices: tf.Tensor, values: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Rows `[index words | value]` plus a leading marker row (index -1); and the word width."""
    flat = tf.reshape(values, [tf.shape(values)[0], -1])
    indices = tf.concat([[-1], indices], 0)
    flat = tf.concat([tf.zeros([1, tf.shape(flat)[1]], flat.dtype), flat], 0)
    words = tf.bitcast(indices, values.dtype)
    words = tf.reshape(words, [tf.shape(indices)[0], -1])
    return tf.concat([words, flat], axis=1), tf.shape(words)[1]


def _merge_gathered(gathered: tf.Tensor, width, inner_shape) -> Tuple[tf.Tensor, tf.Tensor]:
    """Sums gathered `_pack` rows per index; the marker rows drop out without a mask.

    The first gathered row is the first replica's marker, and `tf.unique`
    keeps first-occurrence order, so every marker lands in merged row 0.
    """
    indices = tf.reshape(tf.bitcast(tf.reshape(gathered[:, :width], [-1, width]), tf.int64), [-1])
    values = tf.reshape(gathered[:, width:], tf.concat([[-1], inner_shape], 0))
    unique, summed = _merge(indices, values)
    return unique[1:], summed[1:]


def _local_slices(grad: tf.IndexedSlices, premerged: bool):
    indices, values = tf.cast(grad.indices, tf.int64), grad.values
    return (indices, values) if premerged else _merge(indices, values)


def allgather_exchange(grad: tf.IndexedSlices, ctx, premerged: bool = False) -> Tuple[tf.IndexedSlices, tf.Tensor]:
    """De-duplicated all-gather; returns the summed slices and the number of rows gathered.

    `premerged=True` skips the local merge when the indices are known unique.
    """
    indices, values = _local_slices(grad, premerged)
    if in_process(ctx):
        with tf.name_scope("tfs_hash_merge"):
            merged_indices, merged_values, rows_gathered = _merge_on_one_device(ctx, indices, values, _merge)
        return tf.IndexedSlices(merged_values, merged_indices, grad.dense_shape), rows_gathered
    packed, width = _pack(indices, values)
    gathered = ctx.all_gather(packed, axis=0)
    merged_indices, merged_values = _merge_gathered(gathered, width, tf.shape(values)[1:])
    rows_gathered = tf.shape(gathered)[0] - ctx.num_replicas_in_sync  # one marker row each
    return tf.IndexedSlices(merged_values, merged_indices, grad.dense_shape), rows_gathered


def dense_exchange(grad, ctx, rows: int) -> tf.Tensor:
    """Densify to the shard's shape, then all-reduce."""
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.math.unsorted_segment_sum(grad.values, tf.cast(grad.indices, tf.int32), rows)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, grad)


def _row_bytes(values) -> int:
    """Bytes per row of a tensor or table."""
    return values.dtype.size * max(1, values.shape[1:].num_elements() or 1)


def _adaptive_in_process(grad, ctx, rows, premerged, merge_factor, decided):
    """In-process "auto": the merge decided once per step (or `decided` when traced) on the exact gathered count."""
    indices, values = _local_slices(grad, premerged)
    row_bytes = _row_bytes(values)

    def merge(all_indices, all_values):
        hashed = lambda: _merge(all_indices, all_values)  # noqa: E731
        mapped = lambda: _map_merge(all_indices, all_values, rows)  # noqa: E731
        if decided is not None:
            return (hashed() if decided == "allgather" else mapped()) + (tf.constant(decided == "allgather"),)
        gathered = tf.cast(tf.size(all_indices), tf.float64)
        gather_cost, dense_cost = _local_costs(rows, row_bytes, gathered, merge_factor)
        use_gather = gather_cost <= dense_cost
        return tuple(tf.cond(use_gather, hashed, mapped)) + (use_gather,)

    with tf.name_scope("tfs_auto_merge"):
        merged_indices, merged_values, use_gather, _ = _merge_on_one_device(ctx, indices, values, merge)
    return tf.IndexedSlices(merged_values, merged_indices, grad.dense_shape), use_gather


def adaptive_exchange(
    grad: tf.IndexedSlices,
    ctx,
    rows: int,
    premerged: bool = False,
    merge_factor: Optional[float] = None,
    decided: Optional[str] = None,
) -> Tuple[tf.IndexedSlices, tf.Tensor]:
    """The "auto" exchange decided per step; returns the summed slices and whether it gathered.

    Either way only the rows some replica touched come out. `decided`
    ("allgather" / "dense", in process only) skips the per-step decision.
    """
    if in_process(ctx):
        return _adaptive_in_process(grad, ctx, rows, premerged, merge_factor, decided)
    merge_factor = MERGE_FACTOR if merge_factor is None else merge_factor
    replicas = ctx.num_replicas_in_sync
    indices, values = _local_slices(grad, premerged)
    inner = tf.shape(values)[1:]
    row_bytes = _row_bytes(values)
    counts = ctx.all_gather(tf.reshape(tf.size(indices), [1]), axis=0)
    u = tf.cast(tf.reduce_max(counts), tf.float64)
    gather_cost = u * float((row_bytes + ID_BYTES) * ((replicas - 1) + merge_factor * replicas))
    use_gather = gather_cost <= cost_bytes("dense", rows, row_bytes, replicas, 0)

    packed, width = _pack(indices, values)
    payload = tf.cond(use_gather, lambda: packed, lambda: packed[:1])
    gathered = ctx.all_gather(payload, axis=0)
    dense_in = tf.cond(
        use_gather,
        lambda: tf.zeros(tf.concat([[1], inner], 0), values.dtype),
        lambda: tf.math.unsorted_segment_sum(values, tf.cast(indices, tf.int32), rows),
    )
    reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, dense_in)

    def sparse_result():
        return _merge_gathered(gathered, width, inner)

    def dense_result():
        # Only the rows some replica touched: a lazy optimizer must not see the others.
        touched = tf.where(tf.reduce_any(tf.not_equal(reduced, 0), axis=tf.range(1, tf.rank(reduced))))[:, 0]
        return touched, tf.gather(reduced, touched)

    out_indices, out_values = tf.cond(use_gather, sparse_result, dense_result)
    return tf.IndexedSlices(out_values, out_indices, grad.dense_shape), use_gather


def _trace_time_choice(grad, table, shard: int, ctx, static_ids: Optional[int]) -> str:
    """A shard's exchange as far as tracing decides it: "dense", "allgather", "map" or "auto".

    "map": in process, the densified merge, fixed by a declared
    `ids_per_step`; "auto": decided every step.
    """
    policy = table._exchange
    if policy.mode == "dense" or not isinstance(grad, tf.IndexedSlices):
        return "dense"
    if policy.mode == "allgather":
        return "allgather"
    local = in_process(ctx)
    args = (table.layout.shard_sizes[shard], _row_bytes(table), ctx.num_replicas_in_sync)
    if policy.ids_per_step is not None:
        if choose(*args, policy.ids_per_step, in_process=local) == "allgather":
            return "allgather"
        return "map" if local else "dense"
    if static_ids is not None and choose(*args, static_ids, in_process=local) == "allgather":
        return "allgather"
    return "auto"


def exchange_gradient(grad, table, shard: int, ctx=None, static_ids: Optional[int] = None):
    """Sums one shard's gradient across replicas with the table's exchange (replica context).

    `static_ids`: for "auto", a bound on any replica's distinct ids that every
    replica agrees on (`all_reduce_gradients` derives it from the traced batch
    shapes). When even the bound is below the break-even, all-gather is chosen
    at trace time and the per-step decision is skipped.
    """
    ctx = ctx or tf.distribute.get_replica_context()
    return _exchange_as(grad, table, shard, ctx, _trace_time_choice(grad, table, shard, ctx, static_ids))


def _exchange_as(grad, table, shard: int, ctx, choice: str):
    """One shard's exchange once its trace-time `choice` is known."""
    rows = table.layout.shard_sizes[shard]
    if choice == "dense":
        return dense_exchange(grad, ctx, rows)
    premerged = single_lookup(table)
    if choice == "allgather":
        return allgather_exchange(grad, ctx, premerged)[0]
    return adaptive_exchange(grad, ctx, rows, premerged, decided="dense" if choice == "map" else None)[0]


def grouped_allgather(grads: List[Tuple[tf.IndexedSlices, int, bool]], ctx) -> List[tf.IndexedSlices]:
    """All-gathers several shards' slices as one: one collective (or one in-process merge) for all of them.

    `grads`: `(gradient, shard rows, premerged)` of shards with the same
    dtype and row shape. Each shard's local rows are offset by the rows of
    the shards before it, so the ids never collide; the merged result is
    split back by those offsets. A step over 26 tables then issues one
    gather instead of 26 (each a shape exchange plus the data over the
    network under `MultiWorkerMirroredStrategy`).
    """
    if len(grads) == 1:
        grad, _, premerged = grads[0]
        return [allgather_exchange(grad, ctx, premerged)[0]]
    bases = [0]
    for _, rows, _ in grads:
        bases.append(bases[-1] + rows)
    indices, values = [], []
    for (grad, _, premerged), base in zip(grads, bases):
        local_indices, local_values = _local_slices(grad, premerged)
        indices.append(local_indices + base)
        values.append(local_values)
    joint = tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0))
    merged = allgather_exchange(joint, ctx, premerged=True)[0]
    member = tf.searchsorted(tf.constant(bases[1:-1], tf.int64), merged.indices, side="right", out_type=tf.int32)
    local = merged.indices - tf.gather(tf.constant(bases[:-1], tf.int64), member)
    n = len(grads)
    parts = zip(tf.dynamic_partition(local, member, n), tf.dynamic_partition(merged.values, member, n))
    return [tf.IndexedSlices(v, i, grad.dense_shape) for (grad, _, _), (i, v) in zip(grads, parts)]


def apply_updates(optimizer, distribution, grads_and_vars, learning_rate, fallback) -> None:
    """Keras update step: host-placed shards are updated once, the rest by `fallback`.

    After the exchange every replica holds the same gradient for a shard, so a
    single-copy (host) shard takes the first replica's and applies it once.
    """
    host, rest = [], []
    for g, v in grads_and_vars:
        tag = owner(v)
        is_host = tag is not None and tag[0].placement == "host" and g is not None
        (host if is_host else rest).append((g, v))
    if rest:
        fallback(rest)
    for g, v in host:
        local = distribution.experimental_local_results(g)[0]
        with tf.device(v.device):
            optimizer.update_step(local, v, learning_rate)


def all_reduce_gradients(
    grads_and_vars: List[tuple], fallback: Optional[Callable[[List[tuple]], List[tuple]]] = None
) -> List[tuple]:
    """Sums gradients across replicas; shards of mirrored tables go through their exchange.

    Call it in replica context (inside `strategy.run`) where you would call
    `ReplicaContext.all_reduce(SUM, grads)`. Keras 3 optimizers call it for you
    once `tf_sharded` has created a mirrored table.

    Args:
      grads_and_vars: `(gradient, variable)` pairs; `None` gradients pass through.
      fallback: how the other pairs are reduced (default: `all_reduce(SUM)`).

    Returns:
      The pairs with summed gradients, in the same order.

    Example:

    >>> import tf_sharded as tfs
    >>> v = tf.Variable([1.0])
    >>> tfs.exchange.all_reduce_gradients([(tf.constant([2.0]), v)])[0][0].numpy()
    array([2.], dtype=float32)
    """
    pairs = list(grads_and_vars)
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return fallback(pairs) if fallback is not None else pairs
    ours, others = [], []
    for i, (g, v) in enumerate(pairs):
        tag = owner(v) if g is not None else None
        (ours if tag is not None else others).append((i, tag))
    result = list(pairs)
    rest = [pairs[i] for i, _ in others]
    if not rest:
        reduced_rest = []
    elif fallback is not None:
        reduced_rest = fallback(rest)
    else:
        present = [g for g, _ in rest if g is not None]
        summed = iter(ctx.all_reduce(tf.distribute.ReduceOp.SUM, present) if present else [])
        reduced_rest = [(None if g is None else next(summed), v) for g, v in rest]
    for (i, _), pair in zip(others, reduced_rest):
        result[i] = pair
    auto = []
    for _, (table, _) in ours:
        if table._exchange.mode == "auto" and table._exchange.ids_per_step is None and table not in auto:
            auto.append(table)
    bounds = _agree_on_bounds(ctx, auto) if auto else {}
    gathered = {}  # (dtype, row shape) -> [(pair index, table, shard)]: exchanged together
    for i, (table, shard) in ours:
        g, v = pairs[i]
        choice = _trace_time_choice(g, table, shard, ctx, bounds.get(id(table)))
        row_shape = g.values.shape[1:] if isinstance(g, tf.IndexedSlices) else None
        if choice == "allgather" and row_shape.is_fully_defined():
            gathered.setdefault((g.values.dtype, tuple(row_shape.as_list())), []).append((i, table, shard))
        else:
            result[i] = (_exchange_as(g, table, shard, ctx, choice), v)
    for members in gathered.values():
        grads = [(pairs[i][0], table.layout.shard_sizes[shard], single_lookup(table)) for i, table, shard in members]
        for (i, _, _), summed in zip(members, grouped_allgather(grads, ctx)):
            result[i] = (summed, pairs[i][1])
    return result


def _agree_on_bounds(ctx, tables) -> dict:
    """Largest static id count per table over this worker's replicas, the same on all of them.

    Replicas can trace different static shapes (one replica's batch may be
    statically empty); deciding on their own would send them down different
    collectives. `merge_call` here runs at trace time only and adds no op.
    Across workers, per-replica batch shapes are equal in a normal input
    pipeline; `ids_per_step` removes any doubt.
    """
    local = tuple(-1 if traced_ids(t) is None else traced_ids(t) for t in tables)

    def merge(strategy, counts):
        per_replica = strategy.experimental_local_results(counts)
        agreed = []
        for i in range(len(tables)):
            values = [c[i] for c in per_replica]
            agreed.append(None if min(values) < 0 else max(values))
        return tuple(agreed)

    if tf.executing_eagerly():
        return {}
    agreed = ctx.merge_call(merge, args=(local,))
    return {id(t): n for t, n in zip(tables, agreed)}
