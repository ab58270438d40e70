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

from typing import Any, Dict, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_sharded.keras import quantized
from tf_sharded.table import registry
from tf_sharded.table.batched import logical_tables
from tf_sharded.table.dynamic.serving import write_delta
from tf_sharded.table.lookup import substituted
from tf_sharded.table.protocol import Table, owner_of


def _tables_of(model) -> Dict[int, Table]:
    tables = {}
    for v in model.variables:
        tag = owner_of(v)
        if tag is not None:
            # A batched storage is served as its member tables, each looked up by itself.
            tables.update((id(t), t) for t in logical_tables(tag[0]))
    return tables


def _spec_of(t):
    """The spec of one symbolic input: ragged and sparse inputs keep their kind (a dense spec would make a
    caller pad, and padding with 0 silently looks up row 0, a real id)."""
    if getattr(t, "ragged", False):
        return tf.RaggedTensorSpec(t.shape, t.dtype, ragged_rank=1)
    if getattr(t, "sparse", False):
        return tf.SparseTensorSpec(t.shape, t.dtype)
    return tf.TensorSpec(t.shape, t.dtype, name=t.name)


def _default_signature(model):
    if not isinstance(getattr(model, "inputs", None), list) or not model.inputs:
        raise ValueError(
            "Argument `input_signature` is required for a model without symbolic inputs (a subclassed or "
            f"unbuilt model). Received: input_signature=None for {type(model).__name__}"
        )
    return tf.nest.map_structure(_spec_of, model.input)


def _named(spec, model) -> Dict[str, Any]:
    """`{input name: spec}`: dict keys, or the symbolic inputs' names."""
    if isinstance(spec, dict):
        return dict(spec)
    specs = tf.nest.flatten(spec, expand_composites=False)
    inputs = getattr(model, "inputs", None)
    names = [getattr(t, "name", None) for t in inputs] if isinstance(inputs, list) else []
    if len(names) != len(specs) or None in names:
        names = [getattr(s, "name", None) or f"input_{i}" for i, s in enumerate(specs)]
    return dict(zip(names, specs))


def _components(name: str, spec) -> Dict[str, tf.TensorSpec]:
    """The dense tensors a signature takes for one input: a ragged input as `NAME_values` and
    `NAME_row_lengths`, a sparse one as `NAME_indices`, `NAME_values`, `NAME_dense_shape`."""
    if isinstance(spec, tf.RaggedTensorSpec):
        values = tf.TensorSpec([None] + spec.shape[2:].as_list(), spec.dtype, name=f"{name}_values")
        return {f"{name}_values": values, f"{name}_row_lengths": tf.TensorSpec([None], tf.int64, f"{name}_row_lengths")}
    if isinstance(spec, tf.SparseTensorSpec):
        rank = spec.shape.rank
        return {
            f"{name}_indices": tf.TensorSpec([None, rank], tf.int64, f"{name}_indices"),
            f"{name}_values": tf.TensorSpec([None], spec.dtype, f"{name}_values"),
            f"{name}_dense_shape": tf.TensorSpec([rank], tf.int64, f"{name}_dense_shape"),
        }
    return {name: tf.TensorSpec(spec.shape, spec.dtype, name=name)}


def _assemble(name: str, spec, flat: Dict[str, tf.Tensor]):
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensor.from_row_lengths(flat[f"{name}_values"], flat[f"{name}_row_lengths"])
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensor(flat[f"{name}_indices"], flat[f"{name}_values"], flat[f"{name}_dense_shape"])
    return flat[name]


QUANTIZE_MODES = (None, "int8", "int4")
# The int4 export's form is Keras's default for `quantize("int4")`: groups of 128 columns with a zero point.
INT4_EXPORT_BLOCK = 128


class ExportedQuantizedTable(tf.Module):
    """A float table for serving as quantized rows, in the forms of Keras's `quantize` (`quantized.Form`).

    `"int8"`: each row quantized symmetrically by its largest magnitude (as
    Keras's `AbsMaxQuantizer` on the last axis), `q = round(row * scale)` in
    [-127, 127] with `scale = 127 / max|row|`: `dim + 4` bytes a row instead
    of `4 * dim`. `"int4"`: the row's columns in groups of 128, each with a
    float32 scale and an int8 zero point, values in [-8, 7] packed two a
    byte: `ceil(dim / 2) + 5 * groups` bytes a row. A lookup gathers the
    quantized rows and their scales (and zero points) and returns the
    dequantized rows in the table's dtype, with core TensorFlow ops only.

    Args:
      table: the `tfs.ShardedVariable` to copy (read once, wherever its shards live).
      mode: `"int8"` or `"int4"`.
    """

    def __init__(self, table, mode: str):
        stem = table.name.replace("/", "_")
        super().__init__(name=stem)
        self.dtype = table.dtype
        self._row_shape = table.shape[1:].as_list()
        values = tf.cast(table.read_value(), tf.float32).numpy().reshape(table.shape[0], -1)
        self._form = quantized.Form(mode, values.shape[1], INT4_EXPORT_BLOCK if mode == "int4" else None)
        arrays = quantized.quantize_rows(values, self._form)
        with tf.device("/cpu:0"):
            self.values = tf.Variable(arrays.rows, trainable=False, name=f"{stem}_{mode}")
            self.scale = tf.Variable(arrays.scale.astype(np.float32), trainable=False, name=f"{stem}_scale")
            self.zero = None
            if arrays.zero is not None:
                self.zero = tf.Variable(arrays.zero, trainable=False, name=f"{stem}_zero")

    def lookup(self, ids):
        """The dequantized rows of rank-1 `ids`."""
        zero = tf.gather(self.zero, ids) if self.zero is not None else None
        rows = quantized.dequantized(self._form, tf.gather(self.values, ids), tf.gather(self.scale, ids), self.dtype,
                                     zero=zero)  # fmt: skip
        return tf.reshape(rows, [-1, *self._row_shape])


def _served_table(table, quantize: Optional[str]):
    exported = table.kind.exported(table)
    if exported is not None:
        return exported
    if quantize is not None and table.dtype.is_floating and table.shape.rank >= 2:
        return ExportedQuantizedTable(table, quantize)
    return tf.Variable(table.read_value(), trainable=False, name=table.name.replace("/", "_"))


def export(model: keras.Model, path: str, input_signature: Any = None, quantize: Optional[str] = None) -> str:
    """Writes `model` as a SavedModel that `tf.saved_model.load` serves without tf_sharded.

    Call it outside any `strategy.scope()`. The export holds one plain table
    per sharded table (read once from its shards, wherever they live) and a
    copy of every other variable. `serve` is the model's call with its own
    input structure (ragged where the model takes ragged ids; keyword
    arguments for dict inputs); the `serving_default` signature takes dense
    tensors, named by the inputs: a ragged input `x` as `x_values` and
    `x_row_lengths`, a sparse one as `x_indices`, `x_values` and
    `x_dense_shape` (TF Serving and other clients feed dense tensors only).

    Args:
      model: a built Keras 3 model (tf_sharded layers or not).
      path: directory to write.
      input_signature: a `tf.TensorSpec` (or a structure of them, e.g. a
        dict) for the model's input; derived from `model.input` for
        Functional and Sequential models with an `Input`.
      quantize: None (tables as trained), `"int8"` or `"int4"`: every float
        table of rows (rank 2 or more) is served quantized
        (`ExportedQuantizedTable`). int8: a float32 scale per row, about 4x
        smaller for wide rows (`4 * dim / (dim + 4)`: 3.2x at dim 16); int4:
        two values a byte and a scale and zero point per 128 columns (`4 *
        dim / (dim / 2 + 5)`: 4.9x at dim 16). Other variables and dynamic
        tables as trained. `python -m tf_sharded bench quantize` measures the
        accuracy change on the demo model.

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
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"Argument `quantize` must be one of {QUANTIZE_MODES}. Received: quantize={quantize!r}")
    spec = input_signature if input_signature is not None else _default_signature(model)
    with tf.device("/cpu:0"):
        tables = _tables_of(model)
        plain_tables = {key: _served_table(table, quantize) for key, table in tables.items()}
        copies = [(v, tf.Variable(v.numpy(), trainable=False)) for v in model.variables if owner_of(v) is None]

    def serve(inputs):
        mapping = [(v, copy.read_value()) for v, copy in copies]
        with keras.StatelessScope(state_mapping=mapping), substituted(plain_tables):
            outputs = model(inputs, training=False)
        return outputs if isinstance(outputs, dict) else {"output_0": outputs} if tf.is_tensor(outputs) else outputs

    module = tf.Module()
    module.tables = list(plain_tables.values())
    exported = [plain_tables[key] for key, table in tables.items() if table.kind.deltas]
    signatures = {}
    if exported:
        # Updates the dynamic tables in place from a `tfs.export_delta` directory (core ops only).
        module.apply_delta = tf.function(
            lambda path: {t.stem: t.apply_delta(path) for t in exported}, input_signature=[tf.TensorSpec([], tf.string)]
        )
        signatures["apply_delta"] = module.apply_delta.get_concrete_function()
    module.variables_copy = [copy for _, copy in copies]
    if isinstance(spec, dict):
        module.serve = tf.function(lambda **kwargs: serve(kwargs), input_signature=None)
        module.serve.get_concrete_function(**spec)
    else:
        module.serve = tf.function(serve, input_signature=[spec])
    named = _named(spec, model)
    composite = any(not isinstance(s, tf.TensorSpec) for s in named.values())
    if not composite:
        concrete = module.serve.get_concrete_function(**spec) if isinstance(spec, dict) else (
            module.serve.get_concrete_function()
        )  # fmt: skip
    else:
        flat_spec = {k: v for name, s in named.items() for k, v in _components(name, s).items()}

        def dense_signature(**flat):
            inputs = {name: _assemble(name, s, flat) for name, s in named.items()}
            if isinstance(spec, dict):
                return serve(inputs)
            return serve(tf.nest.pack_sequence_as(spec, list(inputs.values()), expand_composites=False))

        module.serve_dense = tf.function(dense_signature)
        concrete = module.serve_dense.get_concrete_function(**flat_spec)
    tf.saved_model.save(module, path, signatures={"serving_default": concrete, **signatures})
    return path


def export_delta(model, path: str, since_step: int) -> Dict[str, int]:
    """Writes the rows of `model`'s dynamic tables updated after table step `since_step` into directory `path`.

    A SavedModel from `tfs.export` applies it in place with its
    `apply_delta` signature (core ops only): keys it holds are overwritten,
    new keys appended. A table's step is `table.step` (its training
    lookups): remember it at export time and pass it as `since_step` next time.

    Args:
      model: a Keras model with dynamic tables, or a `tfs.DynamicTable` / list of them.
      path: directory to write (created if needed).
      since_step: rows looked up in training after this table step are written.

    Returns:
      `{table name: number of keys written}`.

    Example:

    >>> import keras, tempfile, tf_sharded as tfs
    >>> table = tfs.create_dynamic_table("delta_doc", dim=2, seed=0)
    >>> _ = tfs.embedding_lookup(table, [1, 2])
    >>> since = int(table.step.numpy())
    >>> _ = tfs.embedding_lookup(table, [2, 3])
    >>> tfs.export_delta(table, tempfile.mkdtemp(), since_step=since)
    {'delta_doc': 2}
    """
    if isinstance(since_step, bool) or not isinstance(since_step, int) or since_step < 0:
        raise ValueError(f"Argument `since_step` must be an integer >= 0. Received: since_step={since_step!r}")
    if isinstance(model, keras.Model):
        tables = [t for t in _tables_of(model).values() if t.kind.deltas]
    else:
        tables = list(model) if isinstance(model, (list, tuple)) else [model]
    if not tables or not all(registry.is_any_table(t) and t.kind.deltas for t in tables):
        raise TypeError(
            "Argument `model` must be a Keras model with dynamic tables, or tfs.DynamicTable(s). "
            f"Received: {type(model).__name__}" + (" without dynamic tables" if isinstance(model, keras.Model) else "")
        )
    return write_delta(tables, path, since_step)
