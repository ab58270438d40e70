"""Tables: the protocol every table type implements, `ShardedVariable`, id validation, checkpoints, lookups.

Modules: `protocol` (the `Table` protocol and the shard registry), `sharded_variable`,
`dynamic` (the subpackage of tables keyed by raw ids), `ids`, `saveable` (the checkpoint entry),
`builder` (creating shards where a strategy hook says), `lookup`, `entry_points` (TF's embedding ops
dispatched to tables).
"""

from tf_sharded.table import entry_points  # noqa: F401  (registers TF's embedding entry points)
from tf_sharded.table.dynamic.table import DynamicTable
from tf_sharded.table.lookup import embedding_lookup, embedding_lookup_sparse
from tf_sharded.table.protocol import Table, is_table, owner_of
from tf_sharded.table.sharded_variable import ShardedVariable

__all__ = [
    "DynamicTable",
    "ShardedVariable",
    "Table",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "is_table",
    "owner_of",
]
