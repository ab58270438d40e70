"""Dynamic tables: embedding tables keyed by raw int64 or string ids, with no `[0, rows)` bound.

Modules, from the table down:

* `table`: `DynamicTable`, the user's type: a table of dynamic shards, its
  lookups, training updates, export and checkpoints.
* `shard`: one shard, its key index, the policies' state and the row pool
  it draws rows from.
* `index`: a shard's key -> row index (a dense hash table for int64 keys,
  with reserved keys beside it; a mutable hash table for strings).
* `pool`: the rows of one device (rows, slot columns, seen counts, free
  list), and one insert for many shards.
* `group`: a collection's tables sharing one row pool per device, looked up
  as one id space.
* `packed`: a training lookup's keys, rows and gradients in one transfer
  each way per device.
* `lock`: one critical section per device, many shards' work inside it.
* `agree`: MultiWorkerMirrored workers inserting every worker's keys, so
  their copies stay equal.
* `keys`: key dtypes, fingerprints, the shard of a key, and keys in Keras
  weight files.
* `slots`: a dynamic table's optimizer slots, saved with it.
* `serving`: what a SavedModel holds for a dynamic table, and delta files.
"""

from tf_sharded.table.dynamic.table import DynamicTable

__all__ = ["DynamicTable"]
