"""Training steps built the way users write them."""

from __future__ import annotations

import tensorflow as tf

import tf_sharded as tfs


def squared_norm_step(strategy, table, optimizer):
    """A `tf.function` training `table` on `sum(rows ** 2)` with a Keras optimizer, per replica."""

    # The shards this process trains (a table sharded over workers lists the others' as stand-ins).
    variables = list(getattr(table, "held_variables", table.variables))

    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tfs.embedding_lookup(table, ids) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.run(fn, args=(ids,))

    return step


def squared_norm_tables_step(strategy, tables: dict, optimizer, ids_for=None):
    """`squared_norm_step` over several tables: `sum(rows ** 2)` of every table's lookup, one update for all.

    `ids_for(name, ids)` maps the step's ids to each table's (default: the same ids for all).
    """
    variables = [v for t in tables.values() for v in getattr(t, "held_variables", t.variables)]
    ids_for = ids_for or (lambda name, ids: ids)

    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                loss = tf.add_n(
                    [tf.reduce_sum(tfs.embedding_lookup(t, ids_for(k, ids)) ** 2) for k, t in tables.items()]
                )
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.run(fn, args=(ids,))

    return step


def squared_norm_collection_step(strategy, layer, optimizer):
    """`squared_norm_step` for an `EmbeddingCollection`: `sum(rows ** 2)` of all its features' lookups in one
    call of the layer (a dict of features per step), one update for all its weights."""

    @tf.function
    def step(features):
        def fn(features):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v**2) for v in layer(features).values()])
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))
            return loss

        return strategy.run(fn, args=(features,))

    return step
