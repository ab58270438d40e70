"""The calls a table server answers: their names and argument types, shared by the server and its clients.

Arguments travel as tensors of fixed dtypes and ranks (TensorFlow's RPC ops
take `tf.function`s with an input signature). A call that names several
shards at once (`lookup`, `apply`) gives `counts[i]` rows of `rows` to
`shards[i]`, and its values travel flat (float32), `counts[i] * dim_i` of
them per shard: tables of different widths share one call.

The shards of dynamic tables (raw keys) are reached by the calls named
`*_keys` (int64 keys) and `*_strings` (string keys): their keys travel
instead of rows, with each distinct key's occurrences in the worker's
batch (what admission policies and the "hits" column count).
"""

import tensorflow as tf

SHARDS = tf.TensorSpec([None], tf.int64)
COUNTS = tf.TensorSpec([None], tf.int64)
ROWS = tf.TensorSpec([None], tf.int64)
FLAT = tf.TensorSpec([None], tf.float32)
SCALAR_INT = tf.TensorSpec([], tf.int64)
SCALAR_FLOAT = tf.TensorSpec([], tf.float32)
TEXT = tf.TensorSpec([], tf.string)
INTS = tf.TensorSpec([None], tf.int64)
# The key tensors of dynamic tables, by the suffix of their calls' names.
KEYS = {"keys": tf.TensorSpec([None], tf.int64), "strings": tf.TensorSpec([None], tf.string)}

# name: (argument types, result type)
CALLS = {
    # JSON spec -> [shard id, 1 if this call made it] (a dynamic table's shard: then its seed and its rows' seed)
    "create": ([TEXT], INTS),
    "configure": ([SCALAR_INT, TEXT], SCALAR_INT),  # shard, JSON optimizer spec
    "lookup": ([SHARDS, COUNTS, ROWS], FLAT),
    "apply": ([SHARDS, COUNTS, ROWS, FLAT, SCALAR_FLOAT, SCALAR_INT], SCALAR_INT),  # ..., learning rate, step
    "gather": ([SCALAR_INT, TEXT, ROWS], FLAT),  # shard, slot ("": the table), local rows
    "scatter": ([SCALAR_INT, TEXT, ROWS, FLAT], SCALAR_INT),
    "slots": ([SCALAR_INT], TEXT),  # JSON list of the shard's optimizer slot names
    # shards -> the rows each shard's applies updated so far (its training lookups' distinct ids, every worker's)
    "lookups": ([SHARDS], INTS),
}
for _kind, _keys in KEYS.items():
    CALLS.update(
        {
            # shards, counts, keys, occurrences, 1 to insert absent keys (training) -> rows, flat
            f"lookup_{_kind}": ([SHARDS, COUNTS, _keys, COUNTS, SCALAR_INT], FLAT),
            f"apply_{_kind}": ([SHARDS, COUNTS, _keys, FLAT, SCALAR_FLOAT, SCALAR_INT], SCALAR_INT),
            # shard, JSON {"columns", "since_step"} -> live keys, [rows | columns] flat, [seen | hits | step | sketch]
            f"export_{_kind}": ([SCALAR_INT, TEXT], (_keys, FLAT, INTS)),
            # shard, JSON {"columns", "ints", "step", "sketch"}, keys, values as export gives them: the whole content
            f"assign_{_kind}": ([SCALAR_INT, TEXT, _keys, FLAT, INTS], SCALAR_INT),
            f"set_column_{_kind}": ([SCALAR_INT, TEXT, _keys, FLAT], SCALAR_INT),  # shard, column, keys, values
        }
    )
