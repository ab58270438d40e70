"""TensorFlow's embedding entry points, dispatched to tf_sharded tables.

`tf.nn.embedding_lookup`, `tf.nn.embedding_lookup_sparse`,
`tf.nn.safe_embedding_lookup_sparse` and their `tf.compat.v1` forms run on any
table (`registry.TableClass`: a `tfs.ShardedVariable`, a table on table
servers, a `tfs.DynamicTable` except in the safe form, whose pruning of
negative ids means nothing for raw keys: refused there) given alone or as a
one-element list (TF's partitioned-variable form), with TF's semantics:
ragged ids give ragged rows, `SparseTensor` ids of rank above 2 are combined
as TF combines them, and the safe form prunes negative ids (and, unless
summing, non-positive weights) and fills empty rows with `default_id`'s row
or zeros. `partition_strategy` is ignored: a table knows its own layout, and
ids are logical rows whatever it is.
"""

from __future__ import annotations

from typing import List, Union

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.lookup import embedding_lookup, embedding_lookup_sparse
from tf_sharded.table.registry import TableClass

# Every table class, of every kind and placement, derives from TableClass: one dispatch covers them all.
Tables = Union[TableClass, List[TableClass]]


def _table(params, arg: str = "params"):
    """The table of `params`: a table, or a list holding exactly one."""
    if isinstance(params, (list, tuple)):
        if len(params) != 1:
            raise ValueError(
                f"Argument `{arg}` must be one tf_sharded table or a list holding one (a table is partitioned "
                f"already). Received: a list of {len(params)} tables"
            )
        return params[0]
    return params


def _lookup(params, ids, max_norm=None, name=None):
    table = _table(params)
    if isinstance(ids, tf.RaggedTensor):  # as TF: one row per id, ragged as the ids
        return ids.with_flat_values(embedding_lookup(table, ids.flat_values, max_norm=max_norm, name=name))
    return embedding_lookup(table, ids, max_norm=max_norm, name=name)


def _as_batch_of_bags(sp_ids, sp_weights):
    """Rank > 2 SparseTensor ids (and weights) as `[dense_shape[0], -1]`: TF combines per first index."""
    if isinstance(sp_ids, tf.SparseTensor) and sp_ids.shape.rank is not None and sp_ids.shape.rank > 2:
        shape = tf.stack([sp_ids.dense_shape[0], -1])
        sp_ids = tf.sparse.reshape(sp_ids, shape)
        sp_weights = tf.sparse.reshape(sp_weights, shape) if isinstance(sp_weights, tf.SparseTensor) else sp_weights
    return sp_ids, sp_weights


def _lookup_sparse(params, sp_ids, sp_weights, combiner=None, max_norm=None, name=None):
    sp_ids, sp_weights = _as_batch_of_bags(sp_ids, sp_weights)
    return embedding_lookup_sparse(_table(params), sp_ids, sp_weights, combiner or "mean", max_norm, name)


def _safe_lookup_sparse(params, sparse_ids, sparse_weights, combiner, default_id, max_norm, name):
    table = _table(params, "embedding_weights")
    if not table.kind.static_rows:
        raise TypeError(
            f"Argument `embedding_weights` must be a table of rows [0, n): the safe lookup prunes negative ids, which "
            f"are keys like any other in a {table.kind.name} table. Received: {type(table).__name__} '{table.name}'. "
            f"Use tf.nn.embedding_lookup_sparse."
        )
    combiner = combiner or "mean"
    if not isinstance(sparse_ids, (tf.SparseTensor, tf.RaggedTensor)):
        raise TypeError(
            f"Argument `sparse_ids` must be a tf.SparseTensor or tf.RaggedTensor. Received: {type(sparse_ids).__name__}"
        )
    if sparse_weights is not None and type(sparse_weights) is not type(sparse_ids):
        raise TypeError(
            f"Argument `sparse_weights` must be None or of the type of `sparse_ids` ({type(sparse_ids).__name__}). "
            f"Received: {type(sparse_weights).__name__}"
        )
    if isinstance(sparse_ids, tf.RaggedTensor):  # as TF: a ragged batch is the SparseTensor of its values
        sparse_ids = sparse_ids.to_sparse()
        sparse_weights = sparse_weights.to_sparse() if sparse_weights is not None else None
    if sparse_ids.shape.rank is not None and sparse_ids.shape.rank < 2:
        raise ValueError(f"Argument `sparse_ids` must have rank 2 or more. Received: rank {sparse_ids.shape.rank}")
    if sparse_weights is not None and sparse_weights.dtype != table.dtype:
        # As TF, which converts the table to the weights' dtype and refuses a conversion that changes it.
        raise ValueError(
            f"Argument `sparse_weights` must have the table's dtype {table.dtype.name}. "
            f"Received: {sparse_weights.dtype.name}"
        )
    with tf.name_scope(name or "embedding_lookup"):
        dense_shape = sparse_ids.dense_shape
        # [d0, ..., dk-2, dk-1] -> [d0 * ... * dk-2, dk-1]: one bag per position of the leading dims.
        bags = tf.stack([tf.reduce_prod(dense_shape[:-1]), dense_shape[-1]])
        ids = tf.sparse.reshape(sparse_ids, bags)
        weights = tf.sparse.reshape(sparse_weights, bags) if sparse_weights is not None else None
        keep = ids.values >= 0  # invalid ids are pruned (TF)
        if weights is not None and combiner != "sum":
            keep = tf.logical_and(keep, weights.values > 0)  # and non-positive weights, unless summing
        ids = tf.sparse.retain(ids, keep)
        weights = tf.sparse.retain(weights, keep) if weights is not None else None
        ids, empty = tf.sparse.fill_empty_rows(ids, tf.cast(default_id or 0, ids.dtype))
        if weights is not None:
            weights, _ = tf.sparse.fill_empty_rows(weights, tf.cast(1, weights.dtype))
        rows = embedding_lookup_sparse(table, ids, weights, combiner, max_norm)
        if default_id is None:  # empty bags give zeros
            mask = tf.reshape(empty, tf.concat([tf.shape(empty), tf.ones([rows.shape.rank - 1], tf.int32)], 0))
            rows = tf.where(mask, tf.zeros_like(rows), rows)
        out_shape = tf.concat([tf.cast(dense_shape[:-1], tf.int32), tf.shape(rows)[1:]], 0)
        out = tf.reshape(rows, out_shape)
        if sparse_ids.shape.rank is not None:
            out.set_shape(sparse_ids.shape[:-1].concatenate(rows.shape[1:]))
        return out


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup, {"params": Tables})
def _embedding_lookup(params, ids, max_norm=None, name=None):
    return _lookup(params, ids, max_norm, name)


# TF routes RaggedTensor ids of the compat.v1 forms to its own targets, whatever the params: one target per
# API takes both our tables and ragged ids, and hands ragged ids on other params to TF's.
_RAGGED = _compat.ragged_embedding_targets()
for _target in _RAGGED.values():
    tf.experimental.unregister_dispatch_for(_target)


def _ours(params) -> bool:
    return isinstance(params[0] if isinstance(params, (list, tuple)) and params else params, TableClass)


@tf.experimental.dispatch_for_api(tf.compat.v1.nn.embedding_lookup, {"params": Tables}, {"ids": tf.RaggedTensor})
def _embedding_lookup_v1(params, ids, partition_strategy="mod", name=None, validate_indices=True, max_norm=None):
    if not _ours(params):
        return _RAGGED[tf.compat.v1.nn.embedding_lookup](params, ids, partition_strategy, name, validate_indices,
                                                          max_norm)  # fmt: skip
    return _lookup(params, ids, max_norm, name)


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup_sparse, {"params": Tables})
def _embedding_lookup_sparse(params, sp_ids, sp_weights, combiner=None, max_norm=None, name=None,
                             allow_fast_lookup=False):  # fmt: skip
    return _lookup_sparse(params, sp_ids, sp_weights, combiner, max_norm, name)


@tf.experimental.dispatch_for_api(
    tf.compat.v1.nn.embedding_lookup_sparse, {"params": Tables}, {"sp_ids": tf.RaggedTensor}
)
def _embedding_lookup_sparse_v1(params, sp_ids, sp_weights, partition_strategy="mod", name=None, combiner=None,
                                max_norm=None, allow_fast_lookup=False):  # fmt: skip
    if not _ours(params):
        return _RAGGED[tf.compat.v1.nn.embedding_lookup_sparse](
            params, sp_ids, sp_weights, partition_strategy, name, combiner, max_norm, allow_fast_lookup
        )
    return _lookup_sparse(params, sp_ids, sp_weights, combiner, max_norm, name)


@tf.experimental.dispatch_for_api(tf.nn.safe_embedding_lookup_sparse, {"embedding_weights": Tables})
def _safe_embedding_lookup_sparse(embedding_weights, sparse_ids, sparse_weights=None, combiner="mean",
                                  default_id=None, max_norm=None, name=None, allow_fast_lookup=False):  # fmt: skip
    return _safe_lookup_sparse(embedding_weights, sparse_ids, sparse_weights, combiner, default_id, max_norm, name)


@tf.experimental.dispatch_for_api(
    tf.compat.v1.nn.safe_embedding_lookup_sparse, {"embedding_weights": Tables}, {"sparse_ids": tf.RaggedTensor}
)
def _safe_embedding_lookup_sparse_v1(embedding_weights, sparse_ids, sparse_weights=None, combiner="mean",
                                     default_id=None, name=None, partition_strategy="div", max_norm=None,
                                     allow_fast_lookup=False):  # fmt: skip
    if not _ours(embedding_weights):
        return _RAGGED[tf.compat.v1.nn.safe_embedding_lookup_sparse](
            embedding_weights, sparse_ids, sparse_weights, combiner, default_id, name, partition_strategy, max_norm,
            allow_fast_lookup,
        )  # fmt: skip
    return _safe_lookup_sparse(embedding_weights, sparse_ids, sparse_weights, combiner, default_id, max_norm, name)
