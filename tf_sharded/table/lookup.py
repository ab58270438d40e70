"""Row lookups on sharded tables: dense ids and multi-hot (sparse / ragged) ids.

A lookup de-duplicates its ids, routes each distinct id to the shard that
owns it, gathers there, and stitches the rows back in the caller's order.
Its gradient is assembled by hand: upstream rows are summed per distinct id
and handed to each shard as an `IndexedSlices` of that shard's local rows,
so nothing on the backward path is dense or table-sized.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Dict, Optional, Sequence, Union

import tensorflow as tf

from tf_sharded import trace
from tf_sharded.config import Combiner
from tf_sharded.table import registry
from tf_sharded.table.batched import storage_of
from tf_sharded.table.norms import clip_rows
from tf_sharded.table.remote import is_remote
from tf_sharded.table.segment import physical
from tf_sharded.table.sharded_variable import FIXED, gather_rows
from tf_sharded.table.tally import key_of, tally_on

_SUBSTITUTES = threading.local()


@contextlib.contextmanager
def substituted(tables: Dict[int, Any]):
    """Inside the block (this thread), lookups of table `t` read `tables[id(t)]`, one plain whole-table variable.

    (For a dynamic table, an `ExportedDynamicTable`; for a quantized export, an
    `ExportedQuantizedTable`: objects with a `lookup(ids)`.) `tfs.export` traces the
    model this way, so the SavedModel holds plain variables and `tf.gather`
    instead of shards.
    """
    saved = getattr(_SUBSTITUTES, "tables", {})
    _SUBSTITUTES.tables = {**saved, **tables}
    try:
        yield
    finally:
        _SUBSTITUTES.tables = saved


def _assemble(parts, positions, shard, idx, num_unique):
    """Rows in caller order from per-shard unique rows, with a dense-per-part gradient.

    TensorFlow's own gradients of `dynamic_stitch` + `gather` would hand each
    shard's gather an `IndexedSlices` that is then densified (with the familiar
    "unknown shape" warning). Here the upstream rows are summed per distinct id
    and split by shard, so each shard's `ResourceGather` gradient receives a
    dense `[rows_on_shard, dim]` tensor and emits `IndexedSlices` of its local
    rows. Only tensors cross this boundary: wrapping the variables themselves
    in `tf.custom_gradient` would read every shard in full.
    """
    n = len(parts)

    @tf.custom_gradient
    def assemble(*parts):
        unique_rows = parts[0] if n == 1 else tf.dynamic_stitch(positions, list(parts))

        def grad(dy):
            summed = tf.math.unsorted_segment_sum(dy, idx, num_unique)
            return [summed] if n == 1 else tf.dynamic_partition(summed, shard, n)

        return tf.gather(unique_rows, idx), grad

    return assemble(*parts)


def device_rows(variables, local, slot):
    """On one device: rows of its shard `variables` at `local` ids, `slot[i]` naming the shard of id `i`."""
    if len(variables) == 1:
        return gather_rows(variables[0], local)
    m = len(variables)
    pieces = tf.dynamic_partition(local, slot, m)
    where = tf.dynamic_partition(tf.range(tf.size(local, out_type=tf.int32)), slot, m)
    return tf.dynamic_stitch(where, [gather_rows(v, piece) for v, piece in zip(variables, pieces)])


def lookup_group(members, max_norm, remote_rows=None, training: bool = False):
    """Rows for `(table, flat ids)` pairs whose tables share dtype and row shape, as one id space.

    Each table's ids become shard-major keys (`Layout.keys`) offset by the
    table's base, so one `unique`, one `searchsorted` and one partition by
    device serve every table; each device gets one id tensor and returns one
    row tensor (its shards read by `device_rows`). A table listed twice is
    looked up once. The gradient reaches every shard as `IndexedSlices` of
    distinct local rows (`_assemble`). Where other workers hold the shards,
    `remote_rows` reads the group's rows across them instead
    (`exchange.workers.rows_over_workers`). A `training` lookup adds each
    shard's distinct ids to the tallies (`table.tally`).
    """
    tables = list({id(t): t for t, _ in members}.values())  # first-appearance order
    bases, starts, shards, owners, total = {}, [], [], [], 0
    for table in tables:
        bases[id(table)] = total
        starts.extend(total + o for o in table.layout.offsets[:-1])
        shards.extend(table.variables)
        owners.extend(range(table.num_shards))  # sharded over workers: replica `i` holds shard `i`
        total += table.shape[0]
    counts = {}
    for table, flat_ids in members:
        n, before = flat_ids.shape[0], counts.get(id(table), 0)
        counts[id(table)] = None if n is None or before is None else before + n
    for table in tables:
        trace.note_lookup(table, counts[id(table)])
    keys = tf.concat([table.layout.keys(flat_ids) + bases[id(table)] for table, flat_ids in members], 0)
    uniq, idx = tf.unique(keys, out_idx=tf.int32)
    # A shard is a variable, or a segment of a storage variable that holds several tables' shards
    # (table-batched storage): each storage variable is read by one gather, at the segment's offset.
    placed = [physical(v) for v in shards]
    storage = list({id(v): v for v, _ in placed}.values())
    _note_storage_lookups(tables, counts)
    shift = [start - offset for start, (_, offset) in zip(starts, placed)]  # key - shift = row in its variable
    if len(shards) == 1:
        shard = tf.zeros_like(uniq, tf.int32)
    else:
        shard = tf.searchsorted(tf.constant(starts[1:], tf.int64), uniq, side="right", out_type=tf.int32)
    if training:  # each shard's distinct ids, counted once for the group on a device of this process's
        n = len(shards)
        held = [v.device for v in storage if not is_remote(v)]
        tally_on(held[0]).add([key_of(t, i) for t in tables for i in range(t.num_shards)],
                              tf.math.bincount(shard, minlength=n, maxlength=n, dtype=tf.int64))  # fmt: skip
    if remote_rows is not None:
        rows = remote_rows(tables, uniq, starts, owners, shift, placed, max_norm, keys.shape[0])
        return _split(rows, idx, members)
    devices = list(dict.fromkeys(v.device for v in storage))
    if len(shards) == 1:
        local = uniq - shift[0] if shift[0] else uniq
    else:
        local = uniq - tf.gather(tf.constant(shift, tf.int64), shard)
    on_device = [[] for _ in devices]
    where = {}  # id(variable) -> (its device, its position among that device's variables)
    for v in storage:
        d = devices.index(v.device)
        where[id(v)] = (d, len(on_device[d]))
        on_device[d].append(v)
    device_index = [where[id(v)][0] for v, _ in placed]
    slot_of = [where[id(v)][1] for v, _ in placed]
    inner_axes = list(range(1, tables[0].shape.rank))
    clip = max_norm is not None  # rank-1 tables: each scalar row clipped to |max_norm| (TF's `axes=[]`)
    if len(devices) == 1:
        same = slot_of == list(range(len(shards)))
        slots = [shard if same else tf.gather(tf.constant(slot_of, tf.int32), shard)]
        device_of, locals_ = tf.zeros_like(shard), [local]
        positions = [tf.range(tf.size(uniq, out_type=tf.int32))]
    else:
        device_of = tf.gather(tf.constant(device_index, tf.int32), shard)
        slot = tf.gather(tf.constant(slot_of, tf.int32), shard)
        locals_ = tf.dynamic_partition(local, device_of, len(devices))
        slots = tf.dynamic_partition(slot, device_of, len(devices))
        positions = tf.dynamic_partition(tf.range(tf.size(uniq, out_type=tf.int32)), device_of, len(devices))
    parts = []
    for device, variables, local_d, slot_d in zip(devices, on_device, locals_, slots):
        with tf.device(device):
            rows = device_rows(variables, local_d, slot_d)
        parts.append(clip_rows(rows, max_norm, inner_axes) if clip else rows)
    return _split(_assemble(parts, positions, device_of, idx, tf.size(uniq)), None, members)


def _split(rows, idx, members) -> list:
    """Each member's rows from the group's rows (at the distinct keys' positions `idx` if given)."""
    if idx is not None:
        rows = tf.gather(rows, idx)
    if len(members) == 1:
        return [rows]
    sizes = [flat_ids.shape[0] for _, flat_ids in members]
    if any(n is None for n in sizes):
        sizes = tf.stack([tf.size(flat_ids, out_type=tf.int32) for _, flat_ids in members])
    return tf.split(rows, sizes, num=len(members))


def _note_storage_lookups(tables, counts) -> None:
    """Records one lookup of the batched storage of each of `tables` that has one (its optimizer's update
    then knows whether its gradient rows are already distinct), with its member tables' ids here."""
    ids = {}
    for table in tables:
        storage = storage_of(table)
        if storage is not None:
            ids.setdefault(id(storage), (storage, []))[1].append(counts[id(table)])
    for storage, numbers in ids.values():
        trace.note_lookup(storage, None if None in numbers else sum(numbers))


def lookup_many(pairs, max_norm: Optional[float] = None, training: bool = True) -> list:
    """Rows for several `(table, int64 ids of rank 1)` pairs at once, with sparse per-shard gradients.

    Tables are grouped by placement and kind, and each group is looked up
    together by the route registered for the pair (`registry.lookup_route`).
    Fixed-row tables on this process's devices, for one, are read as one id
    space per dtype and row shape (`lookup_group`): one de-duplication, one
    routing and one request per device for the whole group; dynamic tables
    insert into all of them in one critical section per device; tables on
    table servers are read with one call per server.
    """
    results = [None] * len(pairs)
    routes = {}
    for i, (table, flat_ids) in enumerate(pairs):
        plain = getattr(_SUBSTITUTES, "tables", {}).get(id(table))
        if plain is not None:  # a plain variable, or a served table (dynamic ones too) that looks its rows up
            rows = plain.lookup(flat_ids) if hasattr(plain, "lookup") else tf.gather(plain, flat_ids)
            results[i] = clip_rows(rows, max_norm)
            continue
        routes.setdefault((table.placement_type, table.kind), []).append(i)
    for (placement, kind), members in routes.items():
        route = registry.lookup_route(placement, kind)
        for i, rows in zip(members, route([pairs[i] for i in members], max_norm, training)):
            results[i] = rows
    return results


def lookup_by_row_shape(pairs, max_norm: Optional[float], remote_rows=None, training: bool = False) -> list:
    """Rows for fixed-row tables, looked up as one id space per dtype and row shape (`lookup_group`)."""
    results = [None] * len(pairs)
    groups = {}
    for i, (table, _) in enumerate(pairs):
        groups.setdefault((table.dtype, tuple(table.shape[1:].as_list())), []).append(i)
    for members in groups.values():
        for i, rows in zip(members, lookup_group([pairs[i] for i in members], max_norm, remote_rows, training)):
            results[i] = rows
    return results


# Fixed-row tables on this process's devices, whatever their placement there (sharded over workers is the
# exchange's route: `tfs.exchange.workers`).
registry.register_lookup(
    None, FIXED, lambda pairs, max_norm, training: lookup_by_row_shape(pairs, max_norm, training=training)
)


@dataclasses.dataclass(frozen=True)
class FeatureLookup:
    """One feature's ids into one table, for `lookup_features`.

    Attributes:
      table: the table.
      ids: dense ids (any rank up to 3) when `combiner` is None; else
        `tf.RaggedTensor` / `tf.SparseTensor` ids of shape `[batch, None]`.
      combiner: None (one row per id) or "sum" / "mean" / "sqrtn".
      weights: per-id weights with the structure of `ids` (combiner only).
      arg: the argument name errors use for `ids`.
    """

    table: Any
    ids: Any
    combiner: Optional[str] = None
    weights: Any = None
    arg: str = "ids"


def multi_hot_components(ids, arg: str):
    """`(values, row_ids, num_rows, kind)` of `[batch, None]` SparseTensor or RaggedTensor ids."""
    if isinstance(ids, tf.RaggedTensor):
        if ids.ragged_rank != 1:
            raise ValueError(f"Argument `{arg}` must be a 2-D RaggedTensor. Received: ragged_rank={ids.ragged_rank}")
        return ids.values, ids.value_rowids(), ids.nrows(), "ragged"
    if isinstance(ids, tf.SparseTensor):
        if ids.shape.rank is not None and ids.shape.rank != 2:
            raise ValueError(f"Argument `{arg}` must be a 2-D SparseTensor. Received: rank {ids.shape.rank}")
        return ids.values, ids.indices[:, 0], ids.dense_shape[0], "sparse"
    raise TypeError(
        f"Argument `{arg}` must be a tf.SparseTensor or tf.RaggedTensor of shape [batch, None]. "
        f"Received: {type(ids).__name__}. For dense ids use tfs.embedding_lookup."
    )


def _prepare(request: FeatureLookup):
    """`(flat int64 ids, finish)`: the ids to look up and how their rows become the feature's output."""
    table, arg = request.table, request.arg
    if request.combiner is None:
        ids64, flat = table.check_ids(request.ids, arg=arg)
        inner = table.shape[1:]

        def reshape(rows):
            out = tf.reshape(rows, tf.concat([tf.shape(ids64), tf.constant(inner.as_list(), tf.int32)], 0))
            if ids64.shape.rank is not None:
                out.set_shape(ids64.shape.concatenate(inner))
            return out

        return flat, reshape
    combiner = Combiner.parse(request.combiner, "combiner")
    values, row_ids, num_rows, kind = multi_hot_components(request.ids, arg)
    _, flat = table.check_ids(values, arg=arg, max_rank=1)
    row_ids, num_rows = tf.cast(row_ids, tf.int32), tf.cast(num_rows, tf.int32)
    if request.weights is None:
        weights = tf.ones(tf.shape(flat), dtype=table.dtype)
    else:
        w_values, _, _, w_kind = multi_hot_components(request.weights, "weights")
        if w_kind != kind:
            raise TypeError(f"Argument `weights` must have the same structure as `{arg}` ({kind}). Received: {w_kind}")
        weights = tf.cast(w_values, table.dtype)
        check = tf.debugging.assert_equal(
            tf.size(weights), tf.size(flat), message="Argument `weights` must have one weight per id"
        )
        with tf.control_dependencies([check]):
            weights = tf.identity(weights)
    return flat, lambda rows: combine(rows, row_ids, num_rows, weights, combiner)


def lookup_features(requests: Sequence[FeatureLookup], max_norm: Optional[float] = None, training: bool = True) -> list:
    """Outputs of several features at once: one lookup per table over all its features, fused across tables.

    Each table's ids from every feature that reads it are de-duplicated once,
    and tables of one dtype and row shape share one id space (`lookup_many`).
    """
    prepared = [_prepare(r) for r in requests]
    by_table: Dict[int, list] = {}
    for i, request in enumerate(requests):
        by_table.setdefault(id(request.table), []).append(i)
    groups = list(by_table.values())
    pairs = [(requests[g[0]].table, tf.concat([prepared[i][0] for i in g], 0)) for g in groups]
    outputs = [None] * len(requests)
    for members, rows in zip(groups, lookup_many(pairs, max_norm, training)):
        if len(members) == 1:
            pieces = [rows]
        else:
            sizes = tf.stack([tf.size(prepared[i][0], out_type=tf.int32) for i in members])
            pieces = tf.split(rows, sizes, num=len(members))
        for i, piece in zip(members, pieces):
            outputs[i] = prepared[i][1](piece)
    return outputs


def _check_max_norm(max_norm) -> None:
    if max_norm is not None and (not isinstance(max_norm, (int, float)) or max_norm <= 0):
        raise ValueError(f"Argument `max_norm` must be a positive number or None. Received: max_norm={max_norm!r}")


def embedding_lookup(
    params, ids, max_norm: Optional[float] = None, name: Optional[str] = None, training: bool = True
) -> tf.Tensor:
    """Looks up rows of a sharded or dynamic table; the result has shape `ids.shape + row_shape`.

    `tf.nn.embedding_lookup(table, ids)` dispatches here when `table` is a
    `tfs.ShardedVariable`. Distinct ids are fetched once each from the shard
    that owns them; the gradient reaches each shard as `tf.IndexedSlices`.

    Args:
      params: the sharded table, or a `tfs.DynamicTable`.
      ids: int32 or int64 ids of rank 0 to 3, duplicates allowed, each in
        `[0, params.shape[0])`; for a dynamic table any keys of its
        `key_dtype` (int64 of any value, or strings).
      max_norm: if set, rows whose L2 norm exceeds it are scaled down to it.
      name: optional name scope.
      training: a training lookup: dynamic tables insert absent keys (trainable tables), and every
        table's lookup counters count it (`tf_sharded.table.tally`, `DynamicTable.shard_events`).
        With False, absent keys read their initial row and nothing is stored.

    Returns:
      A tensor of `params.dtype`.

    Raises:
      TypeError: `ids` are not integers.
      ValueError: `ids` have rank above 3.
      tf.errors.InvalidArgumentError: an id is negative or `>= params.shape[0]`.

    Example:

    >>> import tf_sharded as tfs
    >>> table = tfs.create_sharded_variable(
    ...     "lookup_doc", shape=[6, 2], initializer=np.arange(12.).reshape(6, 2),
    ...     partitions=tfs.PartitionSpec(2, scheme="mod"))
    >>> tfs.embedding_lookup(table, [[5, 0], [5, 5]]).numpy().tolist()
    [[[10.0, 11.0], [0.0, 1.0]], [[10.0, 11.0], [10.0, 11.0]]]
    """
    if not registry.is_any_table(params):
        return tf.nn.embedding_lookup(params, ids, max_norm=max_norm, name=name)
    _check_max_norm(max_norm)
    with tf.name_scope(name or f"{params.name}_lookup"):
        return lookup_features([FeatureLookup(params, ids)], max_norm, training)[0]


def embedding_lookup_sparse(
    params,
    ids: Union[tf.SparseTensor, tf.RaggedTensor],
    weights: Union[tf.SparseTensor, tf.RaggedTensor, None] = None,
    combiner: str = "mean",
    max_norm: Optional[float] = None,
    name: Optional[str] = None,
    training: bool = True,
) -> tf.Tensor:
    """Combines the rows of each example's multi-hot ids into one vector.

    Args:
      params: the sharded table.
      ids: `tf.SparseTensor` or `tf.RaggedTensor` of shape `[batch, None]`.
      weights: None (all 1) or per-id weights with the same structure.
      combiner: "sum", "mean" (weighted mean) or "sqrtn" (sum divided by the
        L2 norm of the weights). Examples without ids get zeros.
      max_norm: optional row clipping, as in `embedding_lookup`.
      name: optional name scope.
      training: as in `embedding_lookup`.

    Returns:
      A `[batch] + row_shape` tensor.

    Example:

    >>> import tf_sharded as tfs
    >>> table = tfs.create_sharded_variable(
    ...     "sparse_doc", shape=[4, 1], initializer=[[1.], [2.], [3.], [4.]], partitions=2)
    >>> ids = tf.ragged.constant([[0, 3], [2], []], dtype=tf.int64)
    >>> tfs.embedding_lookup_sparse(table, ids, combiner="sum").numpy().ravel().tolist()
    [5.0, 3.0, 0.0]
    """
    combiner = Combiner.parse(combiner, "combiner")
    if not registry.is_any_table(params):
        raise TypeError(
            f"Argument `params` must be a tfs.ShardedVariable or tfs.DynamicTable. Received: "
            f"{type(params).__name__}. For plain tables use tf.nn.embedding_lookup_sparse."
        )
    _check_max_norm(max_norm)
    _check_weights_match(ids, weights)
    with tf.name_scope(name or f"{params.name}_lookup_sparse"):
        return lookup_features([FeatureLookup(params, ids, combiner, weights)], max_norm, training)[0]


def _check_weights_match(ids, weights) -> None:
    """Weights whose values cannot line up with the ids' are refused when tracing, as TF refuses them."""
    if weights is None or not hasattr(weights, "values") or not hasattr(ids, "values"):
        return
    have, want = weights.values.shape, ids.values.shape
    if not have.is_compatible_with(want):
        raise ValueError(
            f"Argument `weights` must have one weight per id: its values have shape {have.as_list()}, the ids' "
            f"{want.as_list()}"
        )


def combine(rows: tf.Tensor, row_ids: tf.Tensor, num_rows, weights: tf.Tensor, combiner: str) -> tf.Tensor:
    """Weighted sum / mean / sqrtn of `rows` per example (`row_ids` int32); empty examples give zeros."""
    if rows.dtype in (tf.float16, tf.bfloat16):
        # Sums of half-precision rows accumulate in float32 (as TF's sorted segment sum does): a bag's
        # rounding error then stays within one half-precision step of the exact result.
        out = combine(tf.cast(rows, tf.float32), row_ids, num_rows, tf.cast(weights, tf.float32), combiner)
        return tf.cast(out, rows.dtype)
    inner_rank = rows.shape.rank - 1
    w_b = tf.reshape(weights, tf.concat([tf.shape(weights), tf.ones([inner_rank], tf.int32)], 0))
    total = tf.math.unsorted_segment_sum(rows * w_b, row_ids, num_rows)
    if combiner == "sum":
        return total
    if combiner == "mean":
        denom = tf.math.unsorted_segment_sum(weights, row_ids, num_rows)
    else:
        denom = tf.sqrt(tf.math.unsorted_segment_sum(tf.square(weights), row_ids, num_rows))
    denom = tf.reshape(denom, tf.concat([tf.shape(denom), tf.ones([inner_rank], tf.int32)], 0))
    return tf.math.divide_no_nan(total, denom)
