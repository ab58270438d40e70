"""Training steps built the way users write them."""

from __future__ import annotations

import tensorflow as tf

import tf_sharded as tfs


def squared_norm_step(strategy, table, optimizer):
    """A `tf.function` training `table` on `sum(rows ** 2)` with a Keras optimizer, per replica."""

    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tfs.embedding_lookup(table, ids) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, list(table.variables)), table.variables))
            return loss

        return strategy.run(fn, args=(ids,))

    return step
