"""B1's and B7's peer: TFRA 0.8.1 `dynamic_embedding` on the same parameter-server cluster, keys and update rule.

TFRA's tables (`de.get_variable(..., devices=[ps, ...])`, cuckoo hash tables
from its custom ops, one shard per ps) are trained by the same update as
ours (sparse Adagrad in B7, SGD in B1), written out with TFRA's own ops: look
the rows (and accumulators) up, update them, upsert them. (TFRA's optimizer
wrapper needs Keras 2 and TF2's `ParameterServerStrategy` is not supported
by it: tensorflow/recommenders-addons #487, #182; its ops are what that
wrapper runs.) Two layouts: one table per feature, and one table for all
features (its maintainers' advice for many features, TFRA #493; the
features' keys are made disjoint: random 64-bit values in B7, ids offset
per table in B1).

Install it with `pip install -e ".[peers]"`; where it cannot be imported the
report says why and the benchmark runs without it.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

INITIAL_ACCUMULATOR, EPSILON = 0.1, 1e-7  # tfs.optimizers.Adagrad's defaults
TFRA_TENSORFLOW = "2.16.2"  # the newest TensorFlow TFRA 0.8.1 (its newest release) declares


def load() -> Tuple[Optional[object], str]:
    """`(tensorflow_recommenders_addons.dynamic_embedding, "")`, or `(None, why it was skipped)`."""
    import tensorflow as tf

    from tf_sharded import versions

    if versions.parse(tf.__version__) > versions.parse(TFRA_TENSORFLOW):
        return None, (
            f"skipped: TFRA declares tensorflow<={TFRA_TENSORFLOW} and this is TensorFlow {tf.__version__}; "
            "`make bench-peers` measures it beside ours on the oldest tested stack"
        )
    try:
        import tensorflow_recommenders_addons.dynamic_embedding as de
    except Exception as e:  # missing, or built for another TensorFlow: either way the peer is skipped
        return None, f"skipped: tensorflow_recommenders_addons cannot be imported here ({type(e).__name__}: {e})"
    return de, ""


class TfraTables:
    """TFRA tables for `features` features, one per feature or one for all, trained by sparse Adagrad (with
    accumulator tables) or plain SGD (`optimizer="sgd"`). With one table the features' keys must be disjoint."""

    def __init__(self, de, tf, strategy, features: int, dim: int, devices: List[str], one_table: bool, prefix: str,
                 optimizer: str = "adagrad"):  # fmt: skip
        self.tf, self.one_table, self.features, self.dim = tf, one_table, features, dim
        count = 1 if one_table else features
        adagrad = optimizer == "adagrad"

        def table(name, value):
            return de.get_variable(name, key_dtype=tf.int64, value_dtype=tf.float32, dim=dim, devices=devices,
                                   initializer=value)  # fmt: skip

        with strategy.scope():
            self.rows = [table(f"{prefix}_{i}", 0.0) for i in range(count)]
            self.accumulators = (
                [table(f"{prefix}_{i}_acc", INITIAL_ACCUMULATOR) for i in range(count)] if adagrad else []
            )

    def read(self, feature: int, keys):
        """Rows of `feature`'s keys (nothing inserted)."""
        return self.rows[0 if self.one_table else feature].lookup(keys)

    def upsert(self, feature: int, keys, rows) -> None:
        """Sets `feature`'s rows of `keys` (a starting point shared with other variants)."""
        self.rows[0 if self.one_table else feature].upsert(keys, rows)

    def step(self, batch, loss_of, learning_rate: float):
        """One lookup + sparse update of every feature's keys in `batch`; returns the loss."""
        tf = self.tf
        groups = [tf.concat(batch, 0)] if self.one_table else list(batch)
        sizes = [tf.size(k) for k in batch]
        uniques, rows = [], []
        for table, keys in zip(self.rows, groups):
            uniq, idx = tf.unique(keys)
            uniques.append((uniq, idx))
            rows.append(table.lookup(uniq))
        with tf.GradientTape() as tape:
            tape.watch(rows)
            looked_up = [tf.gather(r, idx) for r, (_, idx) in zip(rows, uniques)]
            per_feature = tf.split(looked_up[0], sizes, 0) if self.one_table else looked_up
            loss = loss_of(per_feature)
        writes = []
        accumulators = self.accumulators or [None] * len(self.rows)
        for table, acc_table, r, g, (uniq, _) in zip(self.rows, accumulators, rows, tape.gradient(loss, rows),
                                                     uniques):  # fmt: skip
            g = tf.convert_to_tensor(g)
            if acc_table is None:
                writes.append(table.upsert(uniq, r - learning_rate * g))
                continue
            acc = acc_table.lookup(uniq) + tf.square(g)
            writes += [acc_table.upsert(uniq, acc), table.upsert(uniq, r - learning_rate * g / tf.sqrt(acc + EPSILON))]
        with tf.control_dependencies(writes):
            return tf.identity(loss)

    def size(self) -> int:
        return sum(int(t.size()) for t in self.rows)
