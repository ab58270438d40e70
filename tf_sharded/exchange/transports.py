"""How one shard's sparse gradient is summed across replicas: the two transports of each exchange mode.

* `"allgather"`: each replica's slices hold each row once (the lookup already
  de-duplicates; several lookups of one table in a step are merged first);
  the slices of all replicas are gathered, merged again (unique + segment
  sum) and applied once;
* `"dense"`: the gradient is densified to its shard's shape and all-reduced
  (TensorFlow's collective, under either strategy); the optimizer gets the
  dense sum;
* `"auto"`: a cost model (below) picks one of the two per shard and step.

Two transports, chosen by where the replicas run:

* **Collective** (`MultiWorkerMirroredStrategy`, or forced by `tfs.strategy.mirrored.exchange_transport_scope`):
  indices travel bit-cast inside the value rows, so one collective gather
  moves both, and every replica merges what it received. "auto": if even the
  number of ids the step looks up (its static batch shape, agreed across
  replicas) is below the break-even, all-gather is chosen when the step is
  traced and costs nothing extra. Otherwise, every step, the replicas
  all-gather their distinct-row counts (one scalar each), evaluate the cost
  model on the largest, and all take the same branch (several shards of one
  row shape share those collectives: `grouped_adaptive_exchange`).
  Collectives cannot sit under `tf.cond` in a replica function, so both collectives run every step
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
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import tensorflow as tf

from tf_sharded.exchange.cost import ID_BYTES, MERGE_FACTOR, cost_bytes, local_costs, row_bytes
from tf_sharded.strategy import Transport, transport_of


def in_process(ctx) -> bool:
    """Whether the replicas of `ctx` are devices of this process that meet in a `merge_call`."""
    return transport_of(ctx.strategy) == Transport.IN_PROCESS


def hash_merge(indices: tf.Tensor, values: tf.Tensor):
    unique, position = tf.unique(indices, out_idx=tf.int32)
    return unique, tf.math.unsorted_segment_sum(values, position, tf.size(unique))


def map_merge(indices: tf.Tensor, values: tf.Tensor, rows: int):
    """`hash_merge` through a table-sized position map instead of a hash table; rows come out sorted.

    Cheaper than hashing once the gathered rows are a large fraction of the
    table (RFC.md, "Mirrored placement and gradient exchange"): two passes over `rows` int32s, no probing.
    """
    dtype = tf.int32 if rows < 2**31 else tf.int64
    at = tf.cast(indices, dtype)
    present = tf.scatter_nd(at[:, None], tf.ones_like(at), tf.constant([rows], dtype)) > 0
    unique = tf.where(present)[:, 0]
    position = tf.math.cumsum(tf.cast(present, dtype)) - 1
    return unique, tf.math.unsorted_segment_sum(values, tf.gather(position, at), tf.size(unique, out_type=dtype))


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
    unique, summed = hash_merge(indices, values)
    return unique[1:], summed[1:]


def local_slices(grad: tf.IndexedSlices, premerged: bool):
    indices, values = tf.cast(grad.indices, tf.int64), grad.values
    return (indices, values) if premerged else hash_merge(indices, values)


def allgather_exchange(grad: tf.IndexedSlices, ctx, premerged: bool = False) -> Tuple[tf.IndexedSlices, tf.Tensor]:
    """De-duplicated all-gather; returns the summed slices and the number of rows gathered.

    `premerged=True` skips the local merge when the indices are known unique.
    """
    indices, values = local_slices(grad, premerged)
    if in_process(ctx):
        with tf.name_scope("tfs_hash_merge"):
            merged_indices, merged_values, rows_gathered = _merge_on_one_device(ctx, indices, values, hash_merge)
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


def _adaptive_in_process(grad, ctx, rows, premerged, merge_factor, decided):
    """In-process "auto": the merge decided once per step (or `decided` when traced) on the exact gathered count."""
    indices, values = local_slices(grad, premerged)
    per_row = row_bytes(values)

    def merge(all_indices, all_values):
        hashed = lambda: hash_merge(all_indices, all_values)  # noqa: E731
        mapped = lambda: map_merge(all_indices, all_values, rows)  # noqa: E731
        if decided is not None:
            return (hashed() if decided == "allgather" else mapped()) + (tf.constant(decided == "allgather"),)
        gathered = tf.cast(tf.size(all_indices), tf.float64)
        gather_cost, dense_cost = local_costs(rows, per_row, gathered, merge_factor)
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
    (summed,), use_gather, _ = grouped_adaptive_exchange([(grad, rows, premerged)], ctx, merge_factor)
    return summed, use_gather[0]


def offsets(sizes: List[int]) -> List[int]:
    """Where each of several shards' rows start in one joint id space: `[0, sizes[0], sizes[0] + sizes[1], ...]`."""
    bases = [0]
    for rows in sizes:
        bases.append(bases[-1] + rows)
    return bases


def split_by_offsets(indices: tf.Tensor, values: tf.Tensor, bases: List[int]) -> List[Tuple[tf.Tensor, tf.Tensor]]:
    """Joint slices (ids offset by `bases`) back to each shard's `(local ids, values)`."""
    member = tf.searchsorted(tf.constant(bases[1:-1], tf.int64), indices, side="right", out_type=tf.int32)
    local = indices - tf.gather(tf.constant(bases[:-1], tf.int64), member)
    n = len(bases) - 1
    return list(zip(tf.dynamic_partition(local, member, n), tf.dynamic_partition(values, member, n)))


def grouped_adaptive_exchange(
    grads: List[Tuple[tf.IndexedSlices, int, bool]], ctx, merge_factor: Optional[float] = None
) -> Tuple[List[tf.IndexedSlices], tf.Tensor, tf.Tensor]:
    """The per-step "auto" exchange of one or more shards (same dtype and row shape) in three collectives in all.

    `grads`: `(gradient, shard rows, premerged)`. Collective transport only.
    Returns the summed slices and, per shard, whether it gathered and the
    bytes this replica sent for it (`sent_bytes`). Each shard
    decides on the largest replica's distinct count (the cost model), but
    the rendezvous are shared: one all-gather of every shard's count, one
    all-gather of the rows of the shards that gather (each shard's rows
    offset by the rows of the shards before it, as `grouped_allgather`
    does) and one all-reduce of the densified gradients of the shards that
    do not, concatenated. Every replica takes the same decisions from the
    same gathered counts, so the concatenations line up. Either way only
    the rows some replica touched come out. Across processes each rendezvous
    costs a round trip; five per shard made a step over 26 tables wait on 130.
    """
    merge_factor = MERGE_FACTOR if merge_factor is None else merge_factor
    replicas = ctx.num_replicas_in_sync
    local = [local_slices(grad, premerged) for grad, _, premerged in grads]
    values_0 = local[0][1]
    inner, per_row = tf.shape(values_0)[1:], row_bytes(values_0)
    row_elements = tf.reduce_prod(inner)
    sizes = [rows for _, rows, _ in grads]
    bases = offsets(sizes)

    counts = tf.stack([tf.size(indices) for indices, _ in local])
    largest = tf.reduce_max(ctx.all_gather(counts[tf.newaxis], axis=0), axis=0)
    gather_cost = tf.cast(largest, tf.float64) * float(
        (per_row + ID_BYTES) * ((replicas - 1) + merge_factor * replicas)
    )
    dense_cost = tf.constant([cost_bytes("dense", rows, per_row, replicas, 0) for rows in sizes], tf.float64)
    use_gather = gather_cost <= dense_cost  # [shards], the same on every replica

    # One gather: the rows of the shards that gather, offset into one id space.
    keep = tf.repeat(use_gather, counts)
    joint_indices = tf.concat([indices + base for (indices, _), base in zip(local, bases)], 0)
    joint_values = tf.concat([values for _, values in local], 0)
    packed, width = _pack(tf.boolean_mask(joint_indices, keep), tf.boolean_mask(joint_values, keep))
    sparse_parts = split_by_offsets(*_merge_gathered(ctx.all_gather(packed, axis=0), width, inner), bases)

    # One all-reduce: the densified gradients of the shards that do not gather, flattened and concatenated.
    def densified(i):
        indices, values = local[i]
        summed = tf.math.unsorted_segment_sum(values, tf.cast(indices, tf.int32), sizes[i])
        return tf.cond(use_gather[i], lambda: tf.zeros([0], values.dtype), lambda: tf.reshape(summed, [-1]))

    flat = [densified(i) for i in range(len(grads))]
    reduced = tf.split(ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat(flat, 0)), [tf.size(f) for f in flat])

    out = []
    for i, ((grad, rows, _), (sparse_indices, sparse_values)) in enumerate(zip(grads, sparse_parts)):

        def dense_result(i=i, rows=rows):
            table = tf.reshape(reduced[i], tf.concat([[rows], inner], 0))
            # Only the rows some replica touched: a lazy optimizer must not see the others.
            touched = tf.where(tf.reduce_any(tf.not_equal(tf.reshape(table, [rows, row_elements]), 0), axis=1))[:, 0]
            return touched, tf.gather(table, touched)

        indices, values = tf.cond(use_gather[i], lambda a=sparse_indices, b=sparse_values: (a, b), dense_result)
        out.append(tf.IndexedSlices(values, indices, grad.dense_shape))
    sent = sent_bytes(tf.cast(counts, tf.int64), tf.constant(sizes, tf.int64), per_row, use_gather)
    return out, use_gather, sent


def sent_bytes(distinct, rows, per_row: int, gathered=True) -> tf.Tensor:
    """Bytes a replica puts into one shard's exchange (int64, elementwise): its `distinct` gradient rows and
    their ids where the shard is gathered (or merged in process), else the densified shard's `rows`. The
    one-row markers and the shared counts are left out."""
    sparse = tf.cast(distinct, tf.int64) * (per_row + ID_BYTES)
    return tf.where(gathered, sparse, tf.cast(rows, tf.int64) * per_row)
