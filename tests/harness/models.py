"""A small Keras model with one sharded embedding, and the same model on one device with plain Keras."""

import keras
import numpy as np

import tf_sharded as tfs

ROWS, DIM = 60, 4
IDS = np.array([[1, 1, 7], [59, 3, 3], [7, 20, 1], [0, 0, 0]])
LABELS = np.array([[1.0], [0.0], [1.0], [0.5]], np.float32)


def make_model(partitions=3, table0=None, steps_per_execution=1):
    inp = keras.Input((3,), dtype="int64", name="ids")
    init = keras.initializers.Constant(table0) if table0 is not None else "uniform"
    x = tfs.layers.Embedding(
        ROWS, DIM, combiner="mean", partitions=partitions, seed=5, name="emb", embeddings_initializer=init
    )(inp)
    out = keras.layers.Dense(1, kernel_initializer="ones", name="dense")(x)
    model = keras.Model(inp, out)
    model.compile(
        optimizer=tfs.optimizers.SGD(0.3, momentum=0.5),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return model


def single_device_reference(table0, steps):
    """The same model with keras.layers.Embedding and Keras SGD, trained `steps` steps on one device."""
    ref_inp = keras.Input((3,), dtype="int64")
    ref_emb = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.Constant(table0))
    ref_out = keras.layers.Dense(1, kernel_initializer="ones")(keras.layers.GlobalAveragePooling1D()(ref_emb(ref_inp)))
    reference = keras.Model(ref_inp, ref_out)
    reference.compile(optimizer=keras.optimizers.SGD(0.3, momentum=0.5), loss="mse")
    reference.fit(IDS, LABELS, batch_size=len(IDS), epochs=steps, shuffle=False, verbose=0)
    return ref_emb.embeddings.numpy(), reference.layers[-1].kernel.numpy()


# The same ids as raw keys (negative, beyond 2**53): id i of IDS is key RAW_KEYS[i].
RAW_KEYS = np.array([(-1) ** i * (2**55 + 977 * i) for i in range(ROWS)], np.int64)


def make_dynamic_model(partitions=None, seed=5, placement=None):
    """`make_model` with a `tfs.layers.DynamicEmbedding` over raw int64 keys instead of ids."""
    inp = keras.Input((3,), dtype="int64", name="ids")
    emb = tfs.layers.DynamicEmbedding(DIM, combiner="mean", partitions=partitions, seed=seed, placement=placement,
                                      name="emb")  # fmt: skip
    x = emb(inp)
    out = keras.layers.Dense(1, kernel_initializer="ones", name="dense")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=tfs.optimizers.SGD(0.3, momentum=0.5), loss="mse", metrics=["mae"])
    return model


def dynamic_reference(model, steps, table=None):
    """`single_device_reference` from the initial rows of `make_dynamic_model`'s keys: (rows by key, kernel)."""
    table = table or model.get_layer("emb").table
    table0 = table.initial_rows(RAW_KEYS).numpy()
    rows, kernel = single_device_reference(table0, steps)
    used = np.unique(IDS)
    return {int(RAW_KEYS[i]): rows[i] for i in used}, kernel


def assert_matches_dynamic_reference(test, model, steps, table=None):
    """`model` (from `make_dynamic_model`, trained `steps` steps on IDS) has the reference's rows and kernel."""
    table = table or model.get_layer("emb").table
    expected, kernel = dynamic_reference(model, steps, table=table)
    keys, values = table.export()
    rows = dict(zip(keys.numpy().tolist(), values.numpy()))
    test.assertEqual(set(rows), set(expected))
    for key, row in expected.items():
        test.assertAllClose(rows[key], row, atol=1e-5)
    test.assertAllClose(model.get_layer("dense").kernel.numpy(), kernel, atol=1e-5)


def fit_dynamic_like_keras(test, strategy, steps: int = 3, **model_options):
    """`make_dynamic_model(**model_options)` built under `strategy` and trained by `tfs.fit` for `steps` steps on
    the global batch `RAW_KEYS[IDS]`, checked against Keras on one device (`assert_matches_dynamic_reference`).
    Returns the model."""
    import tensorflow as tf

    with strategy.scope():
        model = make_dynamic_model(**model_options)
    data = tf.data.Dataset.from_tensor_slices((RAW_KEYS[IDS], LABELS)).batch(len(IDS)).repeat()
    tfs.fit(model, data, epochs=steps, steps_per_epoch=1, verbose=0)
    assert_matches_dynamic_reference(test, model, steps)
    return model


LORA_RANK = 2


def make_lora_model(partitions=None, optimizer=None):
    """`make_model`'s model with LoRA (rank 2, alpha 3) on its table, B started away from zero (so that A
    trains from the first step); returns (model, initial table, A, B)."""
    model = make_model(partitions=partitions)
    layer = model.get_layer("emb")
    layer.enable_lora(LORA_RANK, lora_alpha=3.0)
    layer.lora_embeddings_b.assign(np.linspace(-0.5, 0.5, LORA_RANK * DIM).reshape(LORA_RANK, DIM))
    model.compile(optimizer=optimizer or tfs.optimizers.SGD(0.3, momentum=0.5), loss="mse")
    return model, layer._table.numpy(), layer.lora_embeddings_a.numpy(), layer.lora_embeddings_b.numpy()


def lora_reference(table0, a0, b0, steps):
    """The LoRA model with keras.layers.Embedding's own LoRA and Keras SGD, `steps` steps on one device:
    (table, A, B, dense kernel)."""
    ref_inp = keras.Input((3,), dtype="int64")
    ref_emb = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.Constant(table0))
    ref_out = keras.layers.Dense(1, kernel_initializer="ones")(keras.layers.GlobalAveragePooling1D()(ref_emb(ref_inp)))
    ref_emb.enable_lora(LORA_RANK, lora_alpha=3.0)
    ref_emb.lora_embeddings_a.assign(a0)
    ref_emb.lora_embeddings_b.assign(b0)
    reference = keras.Model(ref_inp, ref_out)
    reference.compile(optimizer=keras.optimizers.SGD(0.3, momentum=0.5), loss="mse")
    reference.fit(IDS, LABELS, batch_size=len(IDS), epochs=steps, shuffle=False, verbose=0)
    a, b = ref_emb.lora_embeddings_a.numpy(), ref_emb.lora_embeddings_b.numpy()
    return ref_emb._embeddings.numpy(), a, b, reference.layers[-1].kernel.numpy()


def assert_matches_lora_reference(test, model, table0, a0, b0, steps):
    """`model` (from `make_lora_model`, trained `steps` steps on IDS) has the reference's weights; its table
    did not move."""
    layer = model.get_layer("emb")
    table, a, b, kernel = lora_reference(table0, a0, b0, steps)
    test.assertAllEqual(layer._table.numpy(), table0)
    test.assertAllClose(table, table0)
    test.assertGreater(np.abs(a - a0).max(), 1e-3)  # A trained (sparsely: only the rows looked up)
    test.assertAllClose(layer.lora_embeddings_a.numpy(), a, atol=1e-5)
    test.assertAllClose(layer.lora_embeddings_b.numpy(), b, atol=1e-5)
    test.assertAllClose(model.get_layer("dense").kernel.numpy(), kernel, atol=1e-5)


def pooled_model(embedding, optimizer):
    """`embedding` (a layer over 3 ids per example), averaged, under a dense unit; compiled with MSE."""
    inp = keras.Input((3,), dtype="int64")
    x = keras.layers.GlobalAveragePooling1D()(embedding(inp))
    model = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(x))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def optimizer_cases():
    """`(optimizer class, its arguments, scheme, slot name)`: Keras's SGD and each lazy optimizer, over the
    schemes."""
    return [
        (keras.optimizers.SGD, dict(learning_rate=0.5), "div", None),
        (tfs.optimizers.SGD, dict(learning_rate=0.3, momentum=0.9), "mod", "momentum"),
        (tfs.optimizers.Adagrad, dict(learning_rate=0.3), "balanced", "accumulator"),
        (tfs.optimizers.Adam, dict(learning_rate=0.05), "mod", "velocity"),
        (tfs.optimizers.Ftrl, dict(learning_rate=0.3), "div", "linear"),
    ]


def one_device_embedding(optimizer_class, table0):
    """The reference of an optimizer case on one device: Keras's own layer for Keras's optimizer, else the same
    lazy optimizer's tf_sharded layer in one shard; both start from `table0`."""
    rows, dim = table0.shape
    if optimizer_class is keras.optimizers.SGD:
        return keras.layers.Embedding(rows, dim, embeddings_initializer=keras.initializers.Constant(table0))
    return tfs.layers.Embedding(rows, dim, partitions=1, embeddings_initializer=table0)


def mixed_width_layer(strategy, rows: int, name: str, placement: str = "sharded"):
    """`mixed_width_collection`'s layer built under `strategy` with a built `tfs.optimizers.Adagrad(0.1)`:
    `(layer, optimizer, {table: its starting values})`."""
    from tests.harness.references import mixed_width_collection

    tables, features = mixed_width_collection(rows, placement)
    with strategy.scope():
        layer = tfs.layers.EmbeddingCollection(tables, features, name=name)
        layer.build()
        optimizer = tfs.optimizers.Adagrad(0.1)
        optimizer.build(layer.trainable_variables)
    return layer, optimizer, {table: layer.tables[table].numpy() for table in tables}
