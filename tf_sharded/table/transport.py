"""Ids out, rows back, gradients home: the one transport of every table sharded over workers.

Under MultiWorkerMirroredStrategy a table with `placement="sharded"` is split
over the workers (`tf_sharded.table.remote`), fixed rows one shard per
replica, a dynamic table's keys one shard per worker. A step's lookup sends
each distinct key to the replica that holds it, which answers with the key's
row (a dynamic table's owner first inserts the keys it receives); backward,
each row's gradient goes to its owner, which sums it per distinct row. The
kinds differ only in how an owner is found and how it answers (`serve`); the
exchange is this module's, with one of two transports:

* `"alltoall"`: TensorFlow's `CollectiveAllToAllV2` (kernels on CPU and GPU;
  across workers its generic implementation, NCCL's on GPUs with the NCCL
  hint), on the strategy's own collective group. The collective needs equal
  chunks, so the replicas first agree on the largest per-owner bucket (one
  all-reduce of a vector of one element per replica, two with string keys,
  whose bytes travel in chunks of their own) and pad to it; each owner then
  receives only its own keys and sends back only their rows. It has no
  gradient in TensorFlow: the backward pass is the same all-to-all of the
  gradients, in the same slots. Four rendezvous per step (five with string
  keys).
* `"gather"`: the replicas all-gather their distinct keys; each owner
  answers for the keys it holds among all of them, and an all-reduce of
  those rows (zeros where another replica owns the key) gives every replica
  its rows; backward, the gradients are all-gathered and each owner keeps
  its own. Every replica receives the global batch's keys and rows.

The all-to-all moves fewer bytes in fewer rendezvous at every size, so
`transport_for` takes it in traced steps; `transport_scope` forces either.
Collectives carry numbers only: string keys travel as their byte lengths
and their bytes (`string_codes`), joined again where they arrive.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_sharded import _compat

ALLTOALL, GATHER = "alltoall", "gather"
TRANSPORTS = (ALLTOALL, GATHER)
_FORCED = []  # the innermost transport_scope's transport (module-wide: replica functions run in other threads)
# The cost model that prices the transports (`tfs.exchange.cost.sharded_transport_costs`, which the exchange layer
# registers with `price_with`); without one, the all-to-all.
_PRICES: List[Callable[[int, int, int], dict]] = []
# Byte value -> its one-byte string: rebuilds string keys from their codes with core ops.
_BYTES = [bytes([b]) for b in range(256)]

# `serve(columns, strings) -> (which, count, rows)`: an owner's answer for the keys it received, given as their
# int64 columns (and string keys, if any): each key's position among `count` distinct rows, and those rows (their
# gradient reaches the owner's variables through them).
Serve = Callable[[List[tf.Tensor], Optional[tf.Tensor]], Tuple[tf.Tensor, tf.Tensor, tf.Tensor]]


@contextlib.contextmanager
def transport_scope(transport: str):
    """Steps traced inside the block look tables sharded across workers up by `transport` ("alltoall" or
    "gather") instead of the cost model's choice."""
    if transport not in TRANSPORTS:
        raise ValueError(f"Argument `transport` must be one of {TRANSPORTS}. Received: transport={transport!r}")
    _FORCED.append(transport)
    try:
        yield
    finally:
        _FORCED.pop()


def price_with(costs: Callable[[int, int, int], dict]) -> None:
    """Makes `costs(replicas, distinct keys, row bytes) -> {transport: cost}` the model `transport_for` asks."""
    _PRICES[:] = [costs]


def transport_for(replicas: int, row_bytes: int, bound: Optional[int]) -> str:
    """The transport of one group's lookup: a `transport_scope`'s, else the cheaper by the cost model at
    `bound` distinct keys per replica (1 if unknown), keys spread evenly over the owners.

    Executed eagerly by several replicas of one worker, the all-to-all did not
    complete here, so an eager step takes the gather form (whose all-gather
    TensorFlow refuses in eager mode with its own error).
    """
    if tf.executing_eagerly():
        return GATHER
    if _FORCED:
        return _FORCED[-1]
    if not _PRICES:
        return ALLTOALL
    costs = _PRICES[0](replicas, bound or 1, row_bytes)
    return min(costs, key=costs.get)


def string_codes(keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """`(byte lengths, bytes as int64 codes)` of string keys."""
    lengths = tf.cast(tf.strings.length(keys), tf.int64)
    pieces = tf.strings.bytes_split(keys).flat_values
    codes = tf.reshape(tf.io.decode_raw(pieces, tf.uint8), [-1])
    return lengths, tf.cast(codes, tf.int64)


def join_codes(lengths: tf.Tensor, codes: tf.Tensor) -> tf.Tensor:
    """The string keys of `string_codes`' `(lengths, codes)`."""
    pieces = tf.gather(tf.constant(_BYTES), codes)
    return tf.strings.reduce_join(tf.RaggedTensor.from_row_lengths(pieces, lengths), axis=1)


def exchange(
    columns: Sequence[tf.Tensor],
    owner: tf.Tensor,
    serve: Serve,
    row_shape,
    dtype,
    strings: Optional[tf.Tensor] = None,
    bound: Optional[int] = None,
    transport: Optional[str] = None,
) -> tf.Tensor:
    """Rows of this replica's distinct keys, from the replicas that hold them; call it in a replica context.

    Args:
      columns: int64 `[n]` tensors, one entry per distinct key: what travels
        with it (the key itself where it is a number; a dynamic table's
        counts and table). `columns[0]` is never negative (-1 marks padding).
      owner: int32 `[n]`: the replica that holds each key.
      serve: the owner's answer (`Serve`) for the keys it receives.
      row_shape, dtype: of the rows.
      strings: string `[n]` keys, which travel as bytes beside the columns.
      bound: the number of keys before de-duplication, if static (the cost
        model's estimate of `n`).
      transport: the transport, where the caller has one of its own (else
        `transport_for`'s choice).

    Returns:
      `[n] + row_shape` rows, with a gradient that sends each row's gradient
      to its owner.
    """
    ctx = tf.distribute.get_replica_context()
    row_bytes = tf.as_dtype(dtype).size * (tf.TensorShape(row_shape).num_elements() or 1)
    transport = transport or transport_for(ctx.num_replicas_in_sync, row_bytes, bound)
    move = _all_to_all if transport == ALLTOALL else _gather_reduce
    columns = list(columns)
    lengths = codes = None
    if strings is not None:
        lengths, codes = string_codes(strings)
        columns.append(lengths)
    with tf.name_scope(f"tfs_workers_{transport}"):
        rows = move(ctx, columns, owner, codes, serve, list(row_shape), dtype, strings is not None)
        return tf.ensure_shape(rows, [None] + list(row_shape))


def _dense(upstream, n):
    """The gradient of `n` rows as one dense tensor (an `IndexedSlices` summed per row)."""
    if isinstance(upstream, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(upstream.values, upstream.indices, n)
    return upstream


def _answer(serve, got: List[tf.Tensor], codes: Optional[tf.Tensor], with_strings: bool):
    """`serve`'s answer for received columns `got` (the last the strings' lengths, with `codes` their bytes)."""
    if not with_strings:
        return serve(got, None)
    return serve(got[:-1], join_codes(got[-1], codes))


def _all_to_all(ctx, columns, owner, codes, serve, row_shape, dtype, with_strings):
    """`exchange` over `CollectiveAllToAllV2`: each owner receives only its own keys, sends back only their rows.

    Forward: the keys are bucketed by owner into `replicas` chunks of one
    length, the largest bucket of any replica (one all-reduce; the collective
    needs equal chunks), padded with -1; one all-to-all sends chunk `r` to
    replica `r`, which answers for the keys it received, and a second one
    returns their rows in the same slots. String keys' bytes travel in a third
    one, in chunks of the largest bucket of bytes, in the keys' order.
    Backward: the row gradients travel in those slots to the owners, which
    sum them per distinct row.
    """
    replicas = ctx.num_replicas_in_sync
    strategy = ctx.strategy
    n = tf.size(owner)
    bucket = tf.math.bincount(owner, minlength=replicas, maxlength=replicas)
    peaks = [tf.reduce_max(bucket)]
    if with_strings:
        byte_bucket = tf.math.unsorted_segment_sum(columns[-1], owner, replicas)
        peaks.append(tf.cast(tf.reduce_max(byte_bucket), tf.int32))
    # Every replica's largest buckets, by one all-reduce of each at its replica's position (the strategies
    # reduce by SUM or MEAN only); at least one slot: a collective to which every replica sends nothing never
    # completes.
    me = ctx.replica_id_in_sync_group
    largest = tf.one_hot(me, replicas, dtype=tf.int32)[:, None] * tf.stack(peaks)[None, :]
    chunks = tf.maximum(tf.reduce_max(ctx.all_reduce(tf.distribute.ReduceOp.SUM, largest), 0), 1)
    chunk = chunks[0]
    order = tf.argsort(owner, stable=True)
    first = tf.math.cumsum(bucket, exclusive=True)
    sorted_owner = tf.gather(owner, order)
    in_bucket = tf.range(n) - tf.gather(first, sorted_owner)
    slot = tf.scatter_nd(order[:, None], sorted_owner * chunk + in_bucket, tf.shape(owner))  # key i's slot
    slots = replicas * chunk
    width = len(columns)
    block = tf.stack(columns, 1)
    sent = tf.tensor_scatter_nd_update(tf.fill([slots, width], tf.constant(-1, tf.int64)), slot[:, None], block)
    received = _compat.collective_all_to_all(strategy, tf.reshape(sent, [replicas, chunk * width]))
    received = tf.reshape(received, [slots, width])
    asked = tf.where(received[:, 0] >= 0)[:, 0]  # slots that carry a key held here, in sender order
    got = tf.unstack(tf.gather(received, asked), num=width, axis=1)
    codes_here = None
    if with_strings:
        byte_chunk = tf.cast(chunks[1], tf.int64)
        codes_here = _bytes_to_owners(strategy, replicas, byte_chunk, columns[-1], codes, byte_bucket, order,
                                      sorted_owner)  # fmt: skip
    which, owned, held = _answer(serve, got, codes_here, with_strings)
    slots_shape = tf.concat([[slots], tf.constant(row_shape, tf.int32)], 0)

    def travel(rows):
        """`[slots] + row_shape` rows exchanged chunk for chunk."""
        out = _compat.collective_all_to_all(strategy, tf.reshape(rows, [replicas, -1]))
        return tf.reshape(out, slots_shape)

    @tf.custom_gradient
    def to_replicas(held):
        answered = tf.scatter_nd(asked[:, None], tf.gather(held, which), tf.cast(slots_shape, tf.int64))
        rows = tf.gather(travel(answered), slot)

        def home(upstream):
            grads = travel(tf.scatter_nd(slot[:, None], _dense(upstream, n), slots_shape))
            return tf.math.unsorted_segment_sum(tf.gather(grads, asked), which, owned)

        return rows, home

    return to_replicas(tf.cast(held, dtype))


def _bytes_to_owners(strategy, replicas, byte_chunk, lengths, codes, byte_bucket, order, sorted_owner):
    """The bytes of the string keys this replica receives, in the order of their slots: each key's bytes go
    to its owner's chunk of `byte_chunk` codes, in the order of the keys' slots, padded with -1."""
    sorted_lengths = tf.gather(lengths, order)
    byte_first = tf.math.cumsum(byte_bucket, exclusive=True)
    owner64 = tf.cast(sorted_owner, tf.int64)
    start = tf.math.cumsum(sorted_lengths, exclusive=True) - tf.gather(byte_first, sorted_owner) + owner64 * byte_chunk
    positions = tf.ragged.range(start, start + sorted_lengths).flat_values
    sorted_codes = tf.gather(tf.RaggedTensor.from_row_lengths(codes, lengths), order).flat_values
    padded = tf.fill(tf.reshape(replicas * byte_chunk, [1]), tf.constant(-1, tf.int64))
    sent = tf.tensor_scatter_nd_update(padded, positions[:, None], sorted_codes)
    received = tf.reshape(_compat.collective_all_to_all(strategy, tf.reshape(sent, [replicas, -1])), [-1])
    return tf.boolean_mask(received, received >= 0)


def _gather_reduce(ctx, columns, owner, codes, serve, row_shape, dtype, with_strings):
    """`exchange` over an all-gather of keys, an all-reduce of rows and an all-gather of gradients.

    Forward: the replicas all-gather their distinct keys with their owners;
    each owner answers for its keys among all of them, and an all-reduce of
    those rows (zeros where another replica owns the key) gives every replica
    its rows. Backward: the gradients are all-gathered and each owner sums its
    own per distinct row. Each replica's keys end with a marker (-1): a
    collective to which every replica sends nothing never completes (a step
    whose feature has no key anywhere), and the markers tell where each
    replica's keys start.
    """
    me = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
    n = tf.size(owner)
    block = tf.stack(list(columns) + [tf.cast(owner, tf.int64)], 1)
    marker = tf.fill([1, len(columns) + 1], tf.constant(-1, tf.int64))
    every = ctx.all_gather(tf.concat([block, marker], 0), 0)  # every replica's keys and marker, in replica order
    ends = tf.where(every[:, 0] < 0)[:, 0]
    start = tf.concat([[-1], ends], 0)[me] + 1
    asked = tf.where(tf.equal(every[:, -1], tf.cast(me, tf.int64)))[:, 0]  # positions in `every` of keys held here
    got = tf.unstack(tf.gather(every[:, :-1], asked), num=len(columns), axis=1)
    codes_here = None
    if with_strings:
        every_codes = ctx.all_gather(tf.concat([tf.constant([-1], tf.int64), codes], 0), 0)
        valid = every[:, 0] >= 0
        lengths = tf.where(valid, every[:, -2], tf.zeros_like(every[:, -2]))  # a marker has no bytes
        ragged = tf.RaggedTensor.from_row_lengths(tf.boolean_mask(every_codes, every_codes >= 0), lengths)
        codes_here = tf.gather(ragged, asked).flat_values
    which, owned, held = _answer(serve, got, codes_here, with_strings)
    total = tf.concat([tf.shape(every, out_type=tf.int64)[:1], tf.constant(row_shape, tf.int64)], 0)
    marker_row = tf.zeros([1] + row_shape, dtype)

    @tf.custom_gradient
    def to_replicas(held):
        answered = tf.scatter_nd(asked[:, None], tf.gather(held, which), total)
        rows = ctx.all_reduce(tf.distribute.ReduceOp.SUM, answered)[start : start + tf.cast(n, tf.int64)]

        def home(upstream):
            every_grad = ctx.all_gather(tf.concat([_dense(upstream, n), marker_row], 0), 0)
            return tf.math.unsorted_segment_sum(tf.gather(every_grad, asked), which, owned)

        return rows, home

    return to_replicas(tf.cast(held, dtype))
