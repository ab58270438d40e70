"""Sparse-gradient exchange for mirrored tables (`tfs.exchange`).

Under `MirroredStrategy` / `MultiWorkerMirroredStrategy` each table sums its
shards' sparse gradients across replicas by a de-duplicated all-gather or a
densified all-reduce, chosen per shard by a cost model (`exchange="auto"`) or
forced. The modules: `cost` (the cost model), `policy` (a table's
`ExchangePolicy` and the trace-time part of the choice), `transports` (in
process and collective), `reduce` (`all_reduce_gradients`, the entry point),
and for tables sharded over workers `workers` (their lookup route: ids out,
rows back, gradients to the owners) and `owners`.
"""

from tf_sharded.exchange import workers  # noqa: F401  (registers the lookup of tables sharded over workers)
from tf_sharded.exchange.cost import (
    LOCAL_MERGE_FACTOR,
    MERGE_FACTOR,
    break_even_ids,
    choose,
    cost_bytes,
)
from tf_sharded.exchange.policy import ExchangePolicy
from tf_sharded.exchange.reduce import all_reduce_gradients

__all__ = [
    "LOCAL_MERGE_FACTOR",
    "MERGE_FACTOR",
    "ExchangePolicy",
    "all_reduce_gradients",
    "break_even_ids",
    "choose",
    "cost_bytes",
]
