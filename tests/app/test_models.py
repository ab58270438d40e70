"""tf_sharded.app.models: DLRM and DeepFM on tf_sharded tables and on keras.layers.Embedding compute one function."""

import numpy as np
import tensorflow as tf

from tf_sharded.app import data, models, scan


class ModelsTest(tf.test.TestCase):
    def test_keras_embedding_variant_matches_sharded_tables(self):
        vocab = data.vocab_sizes(60)
        features, _ = next(iter(data.synthetic_dataset(8, max_vocab=60)))
        for name in models.MODELS:
            ours = models.build(name, vocab, embedding_dim=4, table_options={"partitions": 2})
            keras_ = models.build(name, vocab, embedding_dim=4, embeddings="keras")
            ours(features)
            keras_(features)
            # Same layers apart from the embeddings: copy every weight across, tables row for row.
            tables = {t.name: t for layer in ours.layers for t in getattr(layer, "tables", {}).values()}
            for layer in keras_.layers:
                if layer.__class__.__name__ == "Embedding":
                    prefix, key = layer.name.rsplit("_", 1)
                    table = next(t for n, t in tables.items() if n.startswith(prefix) and n.endswith(key))
                    layer.embeddings.assign(table.numpy())
                elif layer.weights:
                    layer.set_weights(ours.get_layer(layer.name).get_weights())
            self.assertAllClose(ours(features), keras_(features), atol=1e-5, msg=name)

    def test_the_output_starts_at_the_labels_mean_or_log_odds(self):
        vocab = data.vocab_sizes(60)
        last = {"dlrm": "top_2", "deepfm": "deep_3", "mlp": "hidden_2"}
        for name in models.MODELS:
            model = models.build(name, vocab, embedding_dim=4, output_bias=2.5)
            self.assertAllClose(model.get_layer(last[name]).bias, [2.5], msg=name)
            self.assertEqual(model.get_layer(last[name]).units, 1, name)
        scanned = scan.ScanResult(label_mean=0.2)
        self.assertAllClose(models.output_bias(scanned, binary=True), np.log(0.2 / 0.8))
        self.assertAllClose(models.output_bias(scanned, binary=False), 0.2)
        self.assertEqual(models.output_bias(None, binary=True), 0.0)
        self.assertEqual(models.output_bias(scan.ScanResult(), binary=False), 0.0)

    def test_bad_arguments_are_named(self):
        vocab = data.vocab_sizes(60)
        with self.assertRaisesRegex(ValueError, r"`embeddings` must be one of \('tfs', 'keras'\)\. Received: 'x'"):
            models.build("dlrm", vocab, embeddings="x")
        with self.assertRaisesRegex(ValueError, "`table_options` applies to tf_sharded tables only"):
            models.dlrm(vocab, embeddings="keras", table_options={"partitions": 2})
        with self.assertRaisesRegex(ValueError, "`model` must be one of"):
            models.build("wide", vocab)


if __name__ == "__main__":
    tf.test.main()
