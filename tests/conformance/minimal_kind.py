"""A minimal table kind: rows computed from the id (`[id, -id]`), nothing stored.

It is a kind as a new package would add one: a table class, one kind registration and one lookup route, all
done when this module is imported. `tests/table/test_registry.py` reaches TF's embedding ops through it and the
conformance matrix (`tests/conformance`) picks it up from the registry with the kinds the library registers.
"""

import tensorflow as tf

from tf_sharded.table import registry
from tf_sharded.table.norms import clip_rows

CONSTANT = registry.register_kind(registry.Kind("constant_rows_for_test", static_rows=True))


class ConstantRows(registry.TableClass):
    kind, placement_type = CONSTANT, registry.LOCAL
    name, dtype, shape = "constant", tf.float32, tf.TensorShape([100, 2])

    def check_ids(self, ids, arg="ids", max_rank=3):
        ids = tf.cast(ids, tf.int64)
        return ids, tf.reshape(ids, [-1])


def route(pairs, max_norm, training):
    return [clip_rows(tf.stack([tf.cast(ids, tf.float32), -tf.cast(ids, tf.float32)], 1), max_norm)
            for _, ids in pairs]  # fmt: skip


registry.register_lookup(registry.LOCAL, CONSTANT, route)
