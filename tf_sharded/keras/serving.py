"""`tfs.export`: a SavedModel that serves without tf_sharded, whatever the training layout.

Every sharded table is materialised once (the one place besides
`read_value()` where that is intended) into one plain `tf.Variable`, every
other model variable is copied into a plain `tf.Variable`, and the model is
traced with lookups redirected to the plain tables (`tf.gather`) and Keras
variables mapped to the copies. The SavedModel's object graph holds only a
`tf.Module`, plain variables and the traced function, so `tf.saved_model.load`
needs neither tf_sharded nor the strategy nor the cluster.
"""

from __future__ import annotations

from typing import Any, Dict

import keras
import tensorflow as tf

from tf_sharded.table.lookup import substituted
from tf_sharded.table.protocol import Table, owner_of


def _tables_of(model) -> Dict[int, Table]:
    tables = {}
    for v in model.variables:
        tag = owner_of(v)
        if tag is not None:
            tables[id(tag[0])] = tag[0]
    return tables


def _default_signature(model):
    if not isinstance(getattr(model, "inputs", None), list) or not model.inputs:
        raise ValueError(
            "Argument `input_signature` is required for a model without symbolic inputs (a subclassed or "
            f"unbuilt model). Received: input_signature=None for {type(model).__name__}"
        )
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype, name=t.name), model.input)


def export(model: keras.Model, path: str, input_signature: Any = None) -> str:
    """Writes `model` as a SavedModel that `tf.saved_model.load` serves without tf_sharded.

    Call it outside any `strategy.scope()`. The export holds one plain table
    per sharded table (read once from its shards, wherever they live) and a
    copy of every other variable; the `serving_default` signature maps the
    model's inputs to its outputs.

    Args:
      model: a built Keras 3 model (tf_sharded layers or not).
      path: directory to write.
      input_signature: a `tf.TensorSpec` (or a structure of them, e.g. a
        dict) for the model's input; derived from `model.input` for
        Functional and Sequential models with an `Input`.

    Returns:
      `path`.

    Example:

    >>> import keras, tempfile, tf_sharded as tfs
    >>> inp = keras.Input((2,), dtype="int64", name="ids")
    >>> model = keras.Model(inp, tfs.layers.Embedding(10, 3, partitions=2, combiner="sum", seed=0)(inp))
    >>> path = tfs.export(model, tempfile.mkdtemp())
    >>> served = tf.saved_model.load(path).signatures["serving_default"](ids=tf.constant([[1, 2]], tf.int64))
    >>> bool(np.allclose(list(served.values())[0], model(tf.constant([[1, 2]]))))
    True
    """
    if tf.distribute.has_strategy():
        inside = type(tf.distribute.get_strategy()).__name__
        raise RuntimeError(
            f"tfs.export must be called outside `strategy.scope()` (inside {inside}'s scope its copies would be "
            "distributed variables again). Please call it after the `with` block."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(f"Argument `model` must be a keras.Model. Received: {type(model).__name__}")
    spec = input_signature if input_signature is not None else _default_signature(model)
    with tf.device("/cpu:0"):
        plain_tables = {
            key: tf.Variable(table.read_value(), trainable=False, name=table.name.replace("/", "_"))
            for key, table in _tables_of(model).items()
        }
        copies = [(v, tf.Variable(v.numpy(), trainable=False)) for v in model.variables if owner_of(v) is None]

    def serve(inputs):
        mapping = [(v, copy.read_value()) for v, copy in copies]
        with keras.StatelessScope(state_mapping=mapping), substituted(plain_tables):
            outputs = model(inputs, training=False)
        return outputs if isinstance(outputs, dict) else {"output_0": outputs} if tf.is_tensor(outputs) else outputs

    module = tf.Module()
    module.tables = list(plain_tables.values())
    module.variables_copy = [copy for _, copy in copies]
    if isinstance(spec, dict):
        module.serve = tf.function(lambda **kwargs: serve(kwargs), input_signature=None)
        concrete = module.serve.get_concrete_function(**spec)
    else:
        module.serve = tf.function(serve, input_signature=[spec])
        concrete = module.serve.get_concrete_function()
    tf.saved_model.save(module, path, signatures={"serving_default": concrete})
    return path
