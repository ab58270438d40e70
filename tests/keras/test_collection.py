"""tfs.layers.EmbeddingCollection: values, gradients, shared tables, Keras models, saving, errors."""

import os

import keras
import numpy as np
import tensorflow as tf

import tf_sharded as tfs

TABLES = {
    "user": {"input_dim": 30, "output_dim": 4, "partitions": 3, "scheme": "mod", "seed": 1},
    "item": {"input_dim": 20, "output_dim": 4, "partitions": 2, "seed": 2},
    "tag": {"input_dim": 9, "output_dim": 2, "seed": 3},
}
FEATURES = {
    "user_id": "user",
    "candidate": "item",
    "history": {"table": "item", "combiner": "mean"},  # shares the item table
    "tags": {"table": "tag", "combiner": "sum"},
}


def inputs():
    return {
        "user_id": tf.constant([3, 3, 29], tf.int64),
        "candidate": tf.constant([1, 19, 1], tf.int64),
        "history": tf.ragged.constant([[1, 2, 2], [], [19]], dtype=tf.int64),
        "tags": tf.constant([[0, 8, -1], [-1, -1, -1], [4, 4, 4]], tf.int64),  # padded, -1 = pad
    }


def reference(values, x):
    """NumPy outputs from the logical tables."""
    out = {
        "user_id": values["user"][x["user_id"].numpy()],
        "candidate": values["item"][x["candidate"].numpy()],
    }
    hist = [values["item"][r].mean(0) if len(r) else np.zeros(4) for r in x["history"].to_list()]
    out["history"] = np.stack(hist)
    out["tags"] = np.stack([values["tag"][[i for i in r if i >= 0]].sum(0) for r in x["tags"].numpy()])
    return out


def plain_sgd_fit(tables0, dense0, data, y, epochs, batch_size, lr):
    """The collection's model on plain `tf.Variable`s, trained by hand with SGD; returns epoch losses and tables."""
    tables = {name: tf.Variable(v) for name, v in tables0.items()}
    kernel, bias = (tf.Variable(w) for w in dense0)

    def pooled(table, ids, combiner):
        ragged = tf.ragged.boolean_mask(ids, ids >= 0)  # -1 pads
        rows = tf.nn.embedding_lookup(table, ragged)
        return tf.reduce_mean(rows, 1) if combiner == "mean" else tf.reduce_sum(rows, 1)

    epoch_losses = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(y), batch_size):
            x = {k: tf.constant(v[start : start + batch_size]) for k, v in data.items()}
            with tf.GradientTape() as tape:
                features = [
                    tf.nn.embedding_lookup(tables["user"], x["user_id"]),
                    tf.nn.embedding_lookup(tables["item"], x["candidate"]),
                    tf.where(
                        tf.reduce_any(x["history"] >= 0, 1, keepdims=True),
                        pooled(tables["item"], x["history"], "mean"),
                        0.0,
                    ),
                    pooled(tables["tag"], x["tags"], "sum"),
                ]
                out = tf.matmul(tf.concat(features, 1), kernel) + bias
                loss = tf.reduce_mean(tf.square(out - y[start : start + batch_size]))
            variables = [tables["user"], tables["item"], tables["tag"], kernel, bias]
            for v, g in zip(variables, tape.gradient(loss, variables)):
                v.assign_sub(lr * tf.convert_to_tensor(g))
            total += float(loss)
        epoch_losses.append(total / (len(y) // batch_size))
    return epoch_losses, {name: t.numpy() for name, t in tables.items()}


class EmbeddingCollectionTest(tf.test.TestCase):
    def test_outputs_and_sgd_step_match_plain_tables(self):
        layer = tfs.layers.EmbeddingCollection(TABLES, FEATURES)
        x = inputs()
        out = layer(x)
        values = {name: t.numpy() for name, t in layer.tables.items()}
        for feature, want in reference(values, x).items():
            self.assertAllClose(out[feature], want, atol=1e-6, msg=feature)

        plain = {name: tf.Variable(v) for name, v in values.items()}
        optimizer = tfs.optimizers.SGD(0.5)
        variables = layer.trainable_variables

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v**2) for v in layer(x).values()])
            grads = tape.gradient(loss, variables)
            for g in grads:
                assert isinstance(g, tf.IndexedSlices), type(g)
            optimizer.apply_gradients(zip(grads, variables))

        step(x)
        with tf.GradientTape() as tape:
            looked = {
                "user_id": tf.gather(plain["user"], x["user_id"]),
                "candidate": tf.gather(plain["item"], x["candidate"]),
                "history": tf.stack(
                    [
                        tf.reduce_mean(tf.gather(plain["item"], r), 0) if len(r) else tf.zeros(4)
                        for r in x["history"].to_list()
                    ]
                ),
                "tags": tf.stack([tf.reduce_sum(tf.gather(plain["tag"], r[r >= 0]), 0) for r in x["tags"].numpy()]),
            }
            loss = tf.add_n([tf.reduce_sum(v**2) for v in looked.values()])
        for name, g in zip(plain, tape.gradient(loss, list(plain.values()))):
            want = values[name] - 0.5 * tf.convert_to_tensor(g).numpy()
            self.assertAllClose(layer.tables[name].numpy(), want, atol=1e-6, msg=name)

    def test_one_id_space_per_row_shape(self):
        layer = tfs.layers.EmbeddingCollection(TABLES, FEATURES)
        layer(inputs())
        graph = tf.function(layer).get_concrete_function(inputs()).graph
        types = [op.type for op in graph.get_operations()]
        self.assertEqual(types.count("ResourceGather"), 6)  # one per shard
        # "user" (mod) and "item" (div) share the width 4: one de-duplication for both, shared features
        # included; "tag" (width 2) has its own.
        self.assertEqual(types.count("Unique"), 2)
        # The 5 width-4 shards on this device are served from one id tensor, split by shard once.
        splits = [
            op for op in graph.get_operations() if op.type == "DynamicPartition" and op.outputs[0].dtype == tf.int64
        ]
        self.assertLen(splits, 1)
        self.assertLen(splits[0].outputs, 5)

    def test_one_id_space_over_every_scheme_matches_plain_tables(self):
        from tf_sharded.table.lookup import lookup_many

        rng = np.random.RandomState(4)
        specs = [
            ("div", tfs.PartitionSpec(3, splits=[5, 1, 11])),
            ("mod", tfs.PartitionSpec(2, scheme="mod")),
            ("balanced", tfs.PartitionSpec(4, scheme="balanced", seed=3)),
            ("single", 1),
        ]
        values = {name: rng.uniform(-1, 1, (17, 3)).astype(np.float32) for name, _ in specs}
        tables = {
            name: tfs.create_sharded_variable(f"group_{name}", [17, 3], initializer=values[name], partitions=spec)
            for name, spec in specs
        }
        # "mod" is listed twice: its ids are de-duplicated together with the other listing's.
        order = ["div", "mod", "balanced", "single", "mod"]
        ids = [tf.constant(rng.randint(0, 17, n), tf.int64) for n in (9, 7, 12, 1, 6)]
        ids[1] = tf.constant([16, 16, 0, 3, 3, 3, 1], tf.int64)
        weights = [tf.constant(rng.uniform(-1, 1, (int(i.shape[0]), 3)), tf.float32) for i in ids]
        variables = [v for name, _ in specs for v in tables[name].variables]
        with tf.GradientTape() as tape:
            rows = lookup_many([(tables[n], i) for n, i in zip(order, ids)], max_norm=0.9)
            loss = tf.add_n([tf.reduce_sum(r * w) for r, w in zip(rows, weights)])
        grads = tape.gradient(loss, variables)
        self.assertTrue(all(isinstance(g, tf.IndexedSlices) for g in grads))
        plain = {name: tf.Variable(v) for name, v in values.items()}
        with tf.GradientTape() as tape:
            want = [tf.nn.embedding_lookup(plain[n], i, max_norm=0.9) for n, i in zip(order, ids)]
            ref_loss = tf.add_n([tf.reduce_sum(r * w) for r, w in zip(want, weights)])
        ref_grads = dict(zip(plain, tape.gradient(ref_loss, list(plain.values()))))
        for got, expected in zip(rows, want):
            self.assertAllClose(got, expected, atol=1e-6)
        optimizer = tfs.optimizers.SGD(0.5)
        optimizer.apply_gradients(zip(grads, variables))
        for name in tables:
            dense = tf.convert_to_tensor(ref_grads[name]).numpy()
            self.assertAllClose(tables[name].numpy(), values[name] - 0.5 * dense, atol=1e-6, msg=name)

    def test_keras_models_fit_config_and_keras_file(self):
        ids = {
            "user_id": keras.Input((), dtype="int64", name="user_id"),
            "candidate": keras.Input((), dtype="int64", name="candidate"),
            "history": keras.Input((3,), dtype="int64", name="history"),
            "tags": keras.Input((3,), dtype="int64", name="tags"),
        }
        layer = tfs.layers.EmbeddingCollection(TABLES, FEATURES, name="emb")
        out = layer(ids)
        x = keras.layers.Concatenate()([out["user_id"], out["candidate"], out["history"], out["tags"]])
        model = keras.Model(ids, keras.layers.Dense(1)(x))
        model.compile(optimizer=tfs.optimizers.SGD(0.1), loss="mse")
        rng = np.random.RandomState(0)
        data = {
            "user_id": rng.randint(0, 30, 64),
            "candidate": rng.randint(0, 20, 64),
            "history": rng.randint(-1, 20, (64, 3)),
            "tags": rng.randint(0, 9, (64, 3)),
        }
        y = rng.rand(64, 1).astype(np.float32)
        tables0 = {name: t.numpy() for name, t in layer.tables.items()}
        dense0 = [w.numpy() for w in model.layers[-1].weights]
        losses = model.fit(data, y, epochs=2, batch_size=16, shuffle=False, verbose=0).history["loss"]
        want_losses, want_tables = plain_sgd_fit(tables0, dense0, data, y, epochs=2, batch_size=16, lr=0.1)
        self.assertAllClose(losses, want_losses, rtol=1e-5)
        for name, table in layer.tables.items():
            self.assertAllClose(table.numpy(), want_tables[name], atol=1e-6, msg=name)

        clone = tfs.layers.EmbeddingCollection.from_config(layer.get_config())
        self.assertEqual(clone.get_config()["tables"], layer.get_config()["tables"])
        path = os.path.join(self.get_temp_dir(), "c.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        for name, table in layer.tables.items():
            self.assertAllEqual(loaded.get_layer("emb").tables[name].numpy(), table.numpy())
        self.assertAllClose(loaded.predict(data, verbose=0), model.predict(data, verbose=0), atol=1e-6)

    def test_checkpoint_restores_every_table_into_other_layouts(self):
        layer = tfs.layers.EmbeddingCollection(TABLES, FEATURES, name="coll")
        layer(inputs())
        path = tf.train.Checkpoint(layer=layer).save(os.path.join(self.get_temp_dir(), "coll"))
        keys = {k for k, _ in tf.train.list_variables(path)}
        self.assertTrue({f"layer/tables_{n}/.ATTRIBUTES/VARIABLE_VALUE" for n in TABLES} <= keys, keys)
        other_tables = {n: {**c, "partitions": 4, "scheme": "balanced", "seed": 99} for n, c in TABLES.items()}
        other = tfs.layers.EmbeddingCollection(other_tables, FEATURES, name="coll")
        other(inputs())
        tf.train.Checkpoint(layer=other).restore(path).assert_existing_objects_matched()
        for name, table in layer.tables.items():
            self.assertEqual(other.tables[name].num_shards, 4)
            self.assertAllEqual(other.tables[name].numpy(), table.numpy())

    def test_subclassed_model(self):
        class Ranker(keras.Model):
            def __init__(self):
                super().__init__()
                self.emb = tfs.layers.EmbeddingCollection(TABLES, FEATURES)
                self.out = keras.layers.Dense(1)

            def call(self, x):
                vectors = self.emb(x)
                return self.out(tf.concat([vectors[f] for f in sorted(vectors)], axis=1))

        model = Ranker()
        self.assertEqual(tuple(model(inputs()).shape), (3, 1))
        self.assertLen(model.trainable_weights, 6 + 2)  # 6 table shards, kernel, bias

    def test_collection_defaults_capped_per_table_and_overridden(self):
        tables = {
            "tiny": {"input_dim": 2, "output_dim": 4, "seed": 0},
            "big": {"input_dim": 20, "output_dim": 4, "partitions": 2, "seed": 1},
            "own": {"input_dim": 20, "output_dim": 4, "scheme": "div", "seed": 2},
        }
        layer = tfs.layers.EmbeddingCollection(
            tables, {"f": "tiny", "g": "big", "h": "own"}, partitions=3, scheme="mod"
        )
        out = layer({"f": tf.constant([1]), "g": tf.constant([3]), "h": tf.constant([5])})
        partition = {name: (t.num_shards, str(t.partition.scheme)) for name, t in layer.tables.items()}
        self.assertEqual(partition, {"tiny": (2, "mod"), "big": (2, "mod"), "own": (3, "div")})
        # The same rows as one unsharded table with the same seed: defaults change the layout only.
        plain = tfs.layers.EmbeddingCollection(tables, {"f": "tiny", "g": "big", "h": "own"}, partitions=1)
        want = plain({"f": tf.constant([1]), "g": tf.constant([3]), "h": tf.constant([5])})
        for name in out:
            self.assertAllClose(out[name], want[name], msg=name)
        again = tfs.layers.EmbeddingCollection.from_config(layer.get_config())
        self.assertEqual((again.partitions, again.scheme), (3, "mod"))
        self.assertEqual(again.table_configs, layer.table_configs)

        too_many = tfs.layers.EmbeddingCollection(
            {"tiny": {"input_dim": 2, "output_dim": 4, "partitions": 3}}, {"f": "tiny"}
        )
        with self.assertRaisesRegex(ValueError, r"Table 'tiny' of layer '.*': Argument `num_shards` must not exceed"):
            too_many({"f": tf.constant([1])})
        self.assertEqual(too_many.tables, {})
        with self.assertRaisesRegex(ValueError, "Argument `partitions` must be None, a positive int or a tfs.Parti"):
            tfs.layers.EmbeddingCollection(tables, {"f": "tiny"}, partitions="3")
        with self.assertRaisesRegex(ValueError, r"Table 'tiny' of layer '.*' \(collection defaults"):
            tfs.layers.EmbeddingCollection(tables, {"f": "tiny"}, scheme="zigzag")

    def test_bad_config_and_input(self):
        with self.assertRaisesRegex(ValueError, "must name one of the tables"):
            tfs.layers.EmbeddingCollection(TABLES, {"f": "nope"})
        with self.assertRaisesRegex(ValueError, "unknown keys \\['dim'\\]"):
            tfs.layers.EmbeddingCollection({"t": {"input_dim": 3, "output_dim": 2, "dim": 2}}, {"f": "t"})
        with self.assertRaisesRegex(ValueError, "combiner'\\]` must be None or one of"):
            tfs.layers.EmbeddingCollection(TABLES, {"f": {"table": "user", "combiner": "max"}})
        layer = tfs.layers.EmbeddingCollection(TABLES, FEATURES)
        x = inputs()
        del x["tags"]
        with self.assertRaisesRegex(ValueError, "needs a dict with exactly the features"):
            layer(x)
        x = inputs()
        x["user_id"] = tf.ragged.constant([[1]], dtype=tf.int64)
        with self.assertRaisesRegex(
            TypeError, "Feature .user_id. of layer .* received multi-hot input .* but has combiner=None"
        ):
            layer(x)
        x = inputs()
        x["candidate"] = tf.constant([1.0, 2.0, 3.0])
        with self.assertRaisesRegex(TypeError, "must be an int32 or int64 tensor"):
            layer(x)


class ShardEmbeddingsTest(tf.test.TestCase):
    def test_one_line_switch_keeps_weights_and_trains(self):
        ids = keras.Input((3,), dtype="int64", name="ids")
        user = keras.Input((), dtype="int64", name="user")
        items = keras.layers.Embedding(50, 4, mask_zero=True, name="items")(ids)
        users = keras.layers.Embedding(20, 4, name="users")(user)
        x = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling1D()(items), users])
        model = keras.Model({"ids": ids, "user": user}, keras.layers.Dense(1, name="out")(x))
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.RandomState(0)
        data = {"ids": rng.randint(0, 50, (32, 3)), "user": rng.randint(0, 20, 32)}
        model.fit(data, rng.rand(32, 1), epochs=1, verbose=0)

        sharded = tfs.layers.shard_embeddings(model, partitions=3, scheme="mod")
        for name in ("items", "users"):
            layer = sharded.get_layer(name)
            self.assertIsInstance(layer, tfs.layers.Embedding)
            self.assertEqual(layer.embeddings.num_shards, 3)
            self.assertAllEqual(layer.embeddings.numpy(), model.get_layer(name).embeddings.numpy())
        self.assertAllEqual(sharded.get_layer("out").kernel.numpy(), model.get_layer("out").kernel.numpy())
        self.assertAllClose(sharded.predict(data, verbose=0), model.predict(data, verbose=0), atol=1e-6)
        # Both trained on, with the same optimizer: the sharded copy follows the Keras original step for step.
        y = rng.rand(32, 1)
        sharded.compile(optimizer=tfs.optimizers.SGD(0.1), loss="mse")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses = sharded.fit(data, y, epochs=3, batch_size=8, shuffle=False, verbose=0).history["loss"]
        want = model.fit(data, y, epochs=3, batch_size=8, shuffle=False, verbose=0).history["loss"]
        self.assertAllClose(losses, want, rtol=1e-5)
        for name in ("items", "users"):
            self.assertAllClose(
                sharded.get_layer(name).embeddings.numpy(), model.get_layer(name).embeddings.numpy(), atol=1e-6
            )

    def test_subclassed_model_is_refused_clearly(self):
        class Sub(keras.Model):
            def call(self, x):
                return x

        with self.assertRaisesRegex(ValueError, "Functional or Sequential"):
            tfs.layers.shard_embeddings(Sub())


class SubclassedSwitchTest(tf.test.TestCase):
    def test_sharded_embeddings_block_and_weights_both_ways(self):
        class Tower(keras.Model):
            def __init__(self):
                super().__init__()
                # Keras locates weights in a file by layer name: named as in any model meant to be reloaded.
                self.items = keras.layers.Embedding(40, 4, mask_zero=True, name="items")
                self.users = keras.layers.Embedding(input_dim=15, output_dim=4, name="users")
                self.out = keras.layers.Dense(1, name="out")

            def call(self, x):
                pooled = keras.ops.mean(self.items(x["ids"]), axis=1)
                return self.out(keras.ops.concatenate([pooled, self.users(x["user"])], axis=1))

        rng = np.random.RandomState(0)
        data = {"ids": rng.randint(0, 40, (16, 3)), "user": rng.randint(0, 15, 16)}
        plain = Tower()
        plain.compile(optimizer="sgd", loss="mse")
        plain.fit(data, rng.rand(16, 1), epochs=1, verbose=0)
        path = os.path.join(self.get_temp_dir(), "tower.weights.h5")
        plain.save_weights(path)

        keras_embedding = keras.layers.Embedding
        with tfs.layers.sharded_embeddings(partitions=3, scheme="mod"):
            self.assertIsNot(keras.layers.Embedding, keras_embedding)
            sharded = Tower()
        self.assertIs(keras.layers.Embedding, keras_embedding)  # restored after the block
        self.assertIsInstance(sharded.items, tfs.layers.Embedding)
        sharded(data)
        self.assertEqual(sharded.items.embeddings.num_shards, 3)
        sharded.load_weights(path)
        self.assertEqual(sharded.users.embeddings.num_shards, 3)
        self.assertAllEqual(sharded.items.embeddings.numpy(), plain.items.embeddings.numpy())
        self.assertAllClose(sharded(data), plain(data), atol=1e-6)

        # And back: the sharded model's weights load into the plain model.
        sharded.users.embeddings.assign(sharded.users.embeddings.numpy() + 1.0)
        back = os.path.join(self.get_temp_dir(), "back.weights.h5")
        sharded.save_weights(back)
        plain.load_weights(back)
        self.assertAllEqual(plain.users.embeddings.numpy(), sharded.users.embeddings.numpy())

    def test_unsupported_keras_arguments_are_named(self):
        with tfs.layers.sharded_embeddings():
            with self.assertRaisesRegex(ValueError, "Argument `lora_rank` of keras.layers.Embedding is not supported"):
                keras.layers.Embedding(10, 2, lora_rank=4)
