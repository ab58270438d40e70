"""Criteo-shaped data: the synthetic generator, TSV and Parquet readers, malformed input."""

import os

import numpy as np
import tensorflow as tf

from tf_sharded.app import data


def collect(dataset):
    batches = list(dataset)
    features = {k: np.concatenate([b[0][k].numpy() for b in batches]) for k in batches[0][0]}
    return features, np.concatenate([b[1].numpy() for b in batches])


class SyntheticTest(tf.test.TestCase):
    def test_shape_vocab_power_law_and_determinism(self):
        vocab = data.vocab_sizes(1000)
        self.assertEqual(vocab[:3], [1000, 583, 1000])
        self.assertLen(vocab, 26)
        features, labels = collect(data.synthetic_dataset(2048, max_vocab=1000, seed=3, num_batches=2))
        self.assertEqual(features["dense"].shape, (4096, 13))
        for key, size in zip(data.CATEGORICAL_KEYS, vocab):
            self.assertTrue(((features[key] >= 0) & (features[key] < size)).all(), key)
        # Heavy head: the most frequent id of a 1000-row table takes a large share, most rows are rare.
        counts = np.bincount(features["C1"], minlength=1000)
        self.assertGreater(counts[1:].max() / counts.sum(), 0.05)
        self.assertGreater((counts[1:] == 0).sum(), 100)
        self.assertTrue(0.2 < labels.mean() < 0.8)
        again, labels_again = collect(data.synthetic_dataset(2048, max_vocab=1000, seed=3, num_batches=2))
        self.assertAllEqual(again["C7"], features["C7"])
        self.assertAllEqual(labels_again, labels)
        other, _ = collect(data.synthetic_dataset(2048, max_vocab=1000, seed=4, num_batches=1))
        self.assertNotAllEqual(other["C7"], features["C7"][:2048])


class FileReaderTest(tf.test.TestCase):
    def test_tsv_and_parquet_files_read_the_same_records(self):
        out = self.get_temp_dir()
        tsv = data.synthesize("tsv", 700, os.path.join(out, "tsv"), max_vocab=500, seed=1)
        pq = data.synthesize("parquet", 700, os.path.join(out, "pq"), max_vocab=500, seed=1)
        self.assertLen(tsv, 1)
        self.assertLen(pq, 1)
        a, la = collect(data.tsv_dataset(os.path.join(out, "tsv"), 128, max_vocab=500))
        b, lb = collect(data.parquet_dataset(os.path.join(out, "pq"), 128, max_vocab=500))
        self.assertEqual(len(la), 700)
        self.assertAllEqual(la, lb)
        self.assertAllClose(a["dense"], b["dense"])
        for key in data.CATEGORICAL_KEYS:
            self.assertAllEqual(a[key], b[key], msg=key)
        # Missing values: empty fields read as 0 (dense) and id 0 (categorical).
        with open(tsv[0]) as f:
            first = f.readline().rstrip("\n").split("\t")
        for j, field in enumerate(first[1:14]):
            self.assertEqual(a["dense"][0, j] == 0, field in ("", "0"))
        for t, field in enumerate(first[14:]):
            self.assertEqual(a[data.CATEGORICAL_KEYS[t]][0] == 0, field == "")

    def test_malformed_lines_are_skipped_and_counted_or_fatal_when_strict(self):
        path = os.path.join(self.get_temp_dir(), "bad.tsv")
        good = "\t".join(["1"] + ["3"] * 13 + ["a1b2c3d4"] * 26)
        lines = [good, "1\t2\t3", "2" + good[1:], good.replace("a1b2c3d4", "zz", 1), "", good]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        stats = data.ReadStats()
        _, labels = collect(data.tsv_dataset(path, 8, max_vocab=100, stats=stats))
        self.assertEqual(len(labels), 2)
        self.assertEqual((stats.records, stats.skipped), (2, 3))
        self.assertIn("bad.tsv:2: expected 40 tab-separated fields, found 3", stats.first_error)
        with self.assertRaisesRegex(Exception, "bad.tsv:2: expected 40 tab-separated fields"):
            list(data.tsv_dataset(path, 8, max_vocab=100, strict=True))

    def test_missing_files_and_bad_format_are_named(self):
        with self.assertRaisesRegex(FileNotFoundError, "No such file or directory: '/nonexistent.tsv'"):
            data.tsv_dataset("/nonexistent.tsv", 8)
        with self.assertRaisesRegex(FileNotFoundError, "No .parquet files in directory"):
            data.parquet_dataset(self.get_temp_dir(), 8)
        with self.assertRaisesRegex(ValueError, "Argument `format` must be 'tsv' or 'parquet'"):
            data.synthesize("csv", 10, self.get_temp_dir())
