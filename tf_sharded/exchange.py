"""Sparse-gradient exchange for mirrored tables.

Under `MirroredStrategy` / `MultiWorkerMirroredStrategy` every replica holds
(or reads) the whole table and computes a sparse gradient for the rows its
batch touched. TensorFlow sums such gradients by all-gathering every
replica's indices and values with every duplicate kept. Here each table
chooses:

* `"allgather"`: each replica merges its duplicate rows (unique + segment
  sum), the merged slices are all-gathered, merged again, and applied once;
* `"dense"`: the gradient is densified to its shard's shape and all-reduced;
* `"auto"`: the cheaper of the two by the cost model below, decided when the
  step is traced (collectives cannot sit under `tf.cond` in a replica
  function, so the choice cannot change inside a traced step). Every replica
  traces with the same static shapes and declared sizes, so all reach the same
  decision.

Cost model (bytes each replica receives per step, one shard of `rows` rows of
`row_bytes` bytes, `R` replicas, at most `u` distinct ids per replica):

    allgather = (R - 1) * u * (row_bytes + 8)      # gathered rows + int64 ids
    dense     = 2 * (R - 1) / R * rows * row_bytes  # ring all-reduce

`auto` picks allgather when `allgather <= dense`. `u` is the table's declared
`ids_per_step` if given, else the number of ids the step looks up in the table
(known statically from the batch shape; an upper bound on distinct ids),
capped at the shard's rows; with neither, allgather (its cost is bounded by
the ids, never by the table).
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, List, Optional, Tuple

import tensorflow as tf

EXCHANGES = ("auto", "allgather", "dense")
ID_BYTES = 8

_TRACED_IDS = {}
_LOCK = threading.Lock()


def cost_bytes(mode: str, rows: int, row_bytes: int, replicas: int, distinct_ids: int) -> float:
    """Bytes one replica receives per step for one shard under `mode`.

    Example:

    >>> cost_bytes("allgather", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000)
    408000
    >>> cost_bytes("dense", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000)
    192000000.0
    """
    if mode == "allgather":
        return (replicas - 1) * distinct_ids * (row_bytes + ID_BYTES)
    if mode == "dense":
        return 2.0 * (replicas - 1) / replicas * rows * row_bytes
    raise ValueError(f"Argument `mode` must be 'allgather' or 'dense'. Received: mode={mode!r}")


def choose(rows: int, row_bytes: int, replicas: int, distinct_ids: Optional[int]) -> str:
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
    gather = cost_bytes("allgather", rows, row_bytes, replicas, u)
    return "allgather" if gather <= cost_bytes("dense", rows, row_bytes, replicas, u) else "dense"


class ExchangePolicy:
    """What a mirrored table does with its sparse gradients.

    Args:
      mode: "auto", "allgather" or "dense".
      ids_per_step: optional declared bound on the distinct ids one replica
        looks up in this table per step (used by "auto").
    """

    def __init__(self, mode: str = "auto", ids_per_step: Optional[int] = None):
        if mode not in EXCHANGES:
            raise ValueError(f"Argument `exchange` must be one of {EXCHANGES}. Received: exchange={mode!r}")
        if ids_per_step is not None and (
            isinstance(ids_per_step, bool) or not isinstance(ids_per_step, int) or ids_per_step < 1
        ):
            raise ValueError(
                f"Argument `ids_per_step` must be a positive int or None. Received: ids_per_step={ids_per_step!r}"
            )
        self.mode = mode
        self.ids_per_step = ids_per_step

    def __repr__(self):
        return f"ExchangePolicy(mode={self.mode!r}, ids_per_step={self.ids_per_step})"


def _trace_key():
    return (id(tf.compat.v1.get_default_graph()), threading.get_ident())


def note_lookup(table, num_ids: Optional[int]) -> None:
    """Records how many ids this replica's step looks up in `table` (static count)."""
    if getattr(table, "_exchange", None) is None:
        return
    key = (id(table),) + _trace_key()
    with _LOCK:
        if tf.executing_eagerly():
            _TRACED_IDS[key] = num_ids
        elif key in _TRACED_IDS:
            prev = _TRACED_IDS[key]
            _TRACED_IDS[key] = None if prev is None or num_ids is None else prev + num_ids
        else:
            _TRACED_IDS[key] = num_ids


def traced_ids(table) -> Optional[int]:
    """Static number of ids looked up in `table` by the step being traced, if known."""
    with _LOCK:
        return _TRACED_IDS.get((id(table),) + _trace_key())


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


def mark(variable, table, shard: int) -> None:
    """Tags a shard variable so that gradient reduction routes it through its table's exchange."""
    variable._tfs_exchange = (weakref.ref(table), shard)


def owner(variable) -> Optional[Tuple[object, int]]:
    """`(table, shard)` of a tagged shard variable, else None."""
    tag = getattr(variable, "_tfs_exchange", None)
    if tag is None and hasattr(variable, "value") and not callable(variable.value):
        tag = getattr(variable.value, "_tfs_exchange", None)
    if tag is None:
        return None
    table = tag[0]()
    return None if table is None else (table, tag[1])


def _merge(indices: tf.Tensor, values: tf.Tensor):
    unique, position = tf.unique(indices, out_idx=tf.int32)
    return unique, tf.math.unsorted_segment_sum(values, position, tf.size(unique))


def allgather_exchange(grad: tf.IndexedSlices, ctx) -> Tuple[tf.IndexedSlices, tf.Tensor]:
    """De-duplicated all-gather; returns the summed slices and the number of rows gathered."""
    indices, values = _merge(tf.cast(grad.indices, tf.int64), grad.values)
    all_indices = ctx.all_gather(indices, axis=0)
    all_values = ctx.all_gather(values, axis=0)
    merged_indices, merged_values = _merge(all_indices, all_values)
    return tf.IndexedSlices(merged_values, merged_indices, grad.dense_shape), tf.size(all_indices)


def dense_exchange(grad, ctx, rows: int) -> tf.Tensor:
    """Densify to the shard's shape, then all-reduce."""
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.math.unsorted_segment_sum(grad.values, tf.cast(grad.indices, tf.int32), rows)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, grad)


def resolve_mode(table, shard: int, replicas: int, ids: Optional[int] = None) -> str:
    """The exchange used for `shard` of `table` given a bound on distinct ids per replica."""
    policy = table._exchange
    if policy.mode != "auto":
        return policy.mode
    rows = table.layout.shard_sizes[shard]
    row_bytes = table.dtype.size * max(1, table.shape[1:].num_elements() or 1)
    if policy.ids_per_step is not None:
        ids = policy.ids_per_step
    return choose(rows, row_bytes, replicas, ids)


def _agree_on_ids(ctx, tables) -> dict:
    """Largest static id count per table over the replicas, identical on all of them.

    A replica's own count can differ (e.g. one replica's batch is statically
    empty); deciding on it alone would send replicas down different
    collectives. `merge_call` runs at trace time only: no op is added.
    """
    local = tuple(-1 if traced_ids(t) is None else traced_ids(t) for t in tables)

    def merge(strategy, counts):
        per_replica = strategy.experimental_local_results(counts)
        agreed = []
        for i in range(len(tables)):
            values = [c[i] for c in per_replica]
            agreed.append(None if min(values) < 0 else max(values))
        return tuple(agreed)

    agreed = ctx.merge_call(merge, args=(local,))
    return {id(t): n for t, n in zip(tables, agreed)}


def exchange_gradient(grad, table, shard: int, ctx=None, ids: Optional[int] = None):
    """Sums one shard's gradient across replicas with the table's exchange (replica context).

    `ids` is the agreed bound on distinct ids per replica for "auto" tables
    (`all_reduce_gradients` computes it); it must be the same on every replica.
    """
    ctx = ctx or tf.distribute.get_replica_context()
    mode = resolve_mode(table, shard, ctx.num_replicas_in_sync, ids)
    if mode == "dense" or not isinstance(grad, tf.IndexedSlices):
        return dense_exchange(grad, ctx, table.layout.shard_sizes[shard])
    return allgather_exchange(grad, ctx)[0]


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
    agreed = _agree_on_ids(ctx, auto) if auto else {}
    for i, (table, shard) in ours:
        g, v = pairs[i]
        result[i] = (exchange_gradient(g, table, shard, ctx, agreed.get(id(table))), v)
    return result
