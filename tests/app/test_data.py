"""Data: the synthetic generator, Criteo-layout files, and the schema-driven readers of every format."""

import gzip
import json
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

from tf_sharded.app import data, parquet, readers, scan, schema


def collect(dataset):
    batches = list(dataset)
    features = {}
    for k in batches[0][0]:
        parts = [b[0][k] for b in batches]
        if isinstance(parts[0], tf.RaggedTensor):
            features[k] = [row for p in parts for row in p.to_list()]
        else:
            features[k] = np.concatenate([p.numpy() for p in parts])
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


def expected_id(text, buckets):
    """The id a value's text hashes to (schema.py's rule), computed here with TensorFlow's hash directly."""
    if text == "":
        return 0
    return 1 + int(tf.strings.to_hash_bucket_fast([text], buckets - 1)[0])


class CriteoFilesTest(tf.test.TestCase):
    def test_tsv_and_parquet_files_read_the_same_records_as_the_lines_say(self):
        out = self.get_temp_dir()
        tsv = data.synthesize("tsv", 700, os.path.join(out, "tsv"), max_vocab=500, seed=1)
        data.synthesize("parquet", 700, os.path.join(out, "pq"), max_vocab=500, seed=1)
        a, la = collect(data.tsv_dataset(os.path.join(out, "tsv"), 128, max_vocab=500))
        b, lb = collect(data.parquet_dataset(os.path.join(out, "pq"), 128, max_vocab=500))
        self.assertEqual(len(la), 700)
        self.assertAllEqual(la, lb)
        self.assertAllClose(a["dense"], b["dense"])
        for key in data.CATEGORICAL_KEYS:
            self.assertAllEqual(a[key], b[key], msg=key)
        # Every field of the first lines, decoded here by hand.
        vocab = data.vocab_sizes(500)
        with open(tsv[0]) as f:
            lines = [f.readline().rstrip("\n").split("\t") for _ in range(5)]
        for i, fields in enumerate(lines):
            self.assertEqual(la[i, 0], float(fields[0]))
            dense = [np.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]]
            self.assertAllClose(a["dense"][i], dense)
            for t, x in enumerate(fields[14:]):
                self.assertEqual(a[data.CATEGORICAL_KEYS[t]][i], expected_id(x, vocab[t]))


MOVIES = [
    "rating,user_id,age,gender,genres,movie_id",
    '4.0,12,25,M,"Action|Comedy",1193',
    "3.5,13,31,F,Drama,661",
    "bad,14,20,M,Drama,914",
    "5,15,,F,,3408",
    "2,16,40,M,Comedy|Drama|Horror,1193",
]
SCHEMA = {
    "label": {"name": "rating", "type": "regression"},
    "features": [
        {"name": "age", "type": "numeric", "transform": "standardize"},
        {"name": "user_id", "type": "categorical", "buckets": 100},
        {"name": "gender", "type": "categorical", "buckets": 4},
        {"name": "movie_id", "type": "categorical", "buckets": 50, "table": "movie"},
        {"name": "genres", "type": "multi_hot", "buckets": 20, "combiner": "mean"},
    ],
}


def write_example_files(out):
    """The same 5 records (one malformed) as CSV, gzip CSV, TFRecord (typed, genres as a list) and Parquet."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "movies.csv"), "w") as f:
        f.write("\n".join(MOVIES) + "\n")
    with gzip.open(os.path.join(out, "movies.csv.gz"), "wt") as f:
        f.write("\n".join(MOVIES) + "\n")
    rows = [
        (4.0, 12, 25.0, "M", ["Action", "Comedy"], 1193),
        (3.5, 13, 31.0, "F", ["Drama"], 661),
        (5.0, 15, None, "F", [], 3408),
        (2.0, 16, 40.0, "M", ["Comedy", "Drama", "Horror"], 1193),
    ]
    with tf.io.TFRecordWriter(os.path.join(out, "movies.tfrecord")) as w:
        for rating, user, age, gender, genres, movie in rows:
            feature = {
                "rating": tf.train.Feature(float_list=tf.train.FloatList(value=[rating])),
                "user_id": tf.train.Feature(int64_list=tf.train.Int64List(value=[user])),
                "age": tf.train.Feature(float_list=tf.train.FloatList(value=[] if age is None else [age])),
                "gender": tf.train.Feature(bytes_list=tf.train.BytesList(value=[gender.encode()])),
                "genres": tf.train.Feature(bytes_list=tf.train.BytesList(value=[g.encode() for g in genres])),
                "movie_id": tf.train.Feature(int64_list=tf.train.Int64List(value=[movie])),
            }
            w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "rating": [r[0] for r in rows],
            "user_id": [r[1] for r in rows],
            "age": [r[2] if r[2] is not None else float("nan") for r in rows],
            "gender": [r[3] for r in rows],
            "genres": ["|".join(r[4]) for r in rows],
            "movie_id": [r[5] for r in rows],
        }
    )
    pq.write_table(table, os.path.join(out, "movies.parquet.snappy"))
    with open(os.path.join(out, "schema.json"), "w") as f:
        json.dump(SCHEMA, f)


NUMBERED = {
    "label": {"name": "n", "type": "regression"},
    "features": [{"name": "item", "type": "categorical", "buckets": 10}],
}


def write_numbered_csv(out, files, rows):
    """`files` CSV files whose label column numbers the records 0, 1, ... across the files."""
    os.makedirs(os.path.join(out, "numbered"), exist_ok=True)
    names = []
    for f in range(files):
        names.append(os.path.join(out, "numbered", f"part-{f}.csv"))
        with open(names[-1], "w") as fh:
            fh.write("n,item\n" + "".join(f"{f * rows + i},{i}\n" for i in range(rows)))
    return names


class SchemaReadersTest(tf.test.TestCase):
    def test_every_format_reads_the_same_features(self):
        out = self.get_temp_dir()
        write_example_files(out)
        s = schema.load(os.path.join(out, "schema.json"))
        results = {}
        for name, fmt in (
            ("movies.csv", "csv"),
            ("movies.csv.gz", "csv"),
            ("movies.tfrecord", "tfrecord"),
            ("movies.parquet.snappy", "parquet"),
        ):
            source = readers.open_source(os.path.join(out, name), s)
            self.assertEqual(source.format, fmt, name)
            scanned = scan.scan(source, s, source.files)
            text = fmt == "csv"
            self.assertEqual((scanned.records, scanned.malformed), (4, 1 if text else 0), name)
            # age over the records that parse (25, 31, 40; one missing): mean 32, population std sqrt(38).
            self.assertAllClose(scanned.statistics["age"], (32.0, np.sqrt(38.0)), msg=name)
            # The label's mean over the good records (4, 3.5, 5, 2), then without a held-out first record.
            self.assertAllClose(scanned.label_mean, 3.625, msg=name)
            self.assertAllClose(scan.scan(source, s, source.files, held_out=1).label_mean, 3.5, msg=name)
            if text:
                self.assertEqual(scanned.first_error, f"{source.files[0]}:4: label 'rating' is not a number")
            with_stats = s.with_statistics(scanned.statistics)
            results[name] = collect(readers.batched(readers.records(source, with_stats, source.files), 3))
        features, labels = results["movies.csv"]
        self.assertAllEqual(labels[:, 0], [4.0, 3.5, 5.0, 2.0])
        self.assertAllClose(features["dense"][:, 0], [(25 - 32) / 38**0.5, (31 - 32) / 38**0.5, 0.0, 8 / 38**0.5])
        self.assertAllEqual(features["user_id"], [expected_id(str(u), 100) for u in (12, 13, 15, 16)])
        self.assertAllEqual(features["gender"], [expected_id(g, 4) for g in "MFFM"])
        genres = [["Action", "Comedy"], ["Drama"], [], ["Comedy", "Drama", "Horror"]]
        self.assertEqual(features["genres"], [[expected_id(g, 20) for g in row] for row in genres])
        for name, (other, other_labels) in results.items():
            self.assertAllEqual(other_labels, labels, msg=name)
            for key in features:
                if key == "genres":
                    self.assertEqual(other[key], features[key], msg=name)
                else:
                    self.assertAllClose(other[key], features[key], msg=f"{name} {key}")

    def test_a_scan_over_many_batches_counts_and_averages_as_numpy_does(self):
        # 6,000 records (the scan reduces 4,096 at a time), three malformed ones in the second batch, missing
        # values in one standardized column, and a held-out prefix ending in either batch.
        rng = np.random.default_rng(0)
        bad = (4500, 5001, 5999)
        rows = [(rng.random(), None if rng.random() < 0.1 else rng.normal(3, 2), rng.normal()) for _ in range(6000)]
        lines = ["y,a,c,k"] + ["oops,1" if i in bad else f"{y:.3f},{'' if a is None else f'{a:.3f}'},{c:.4f},{i % 7}"
                               for i, (y, a, c) in enumerate(rows)]  # fmt: skip
        out = self.get_temp_dir()
        with open(os.path.join(out, "x.csv"), "w") as f:
            f.write("\n".join(lines) + "\n")
        s = schema.parse({
            "label": {"name": "y", "type": "regression"},
            "features": [{"name": "a", "type": "numeric", "transform": "standardize"},
                         {"name": "c", "type": "numeric", "transform": "standardize"},
                         {"name": "k", "type": "categorical", "buckets": 10}],
        })  # fmt: skip
        source = readers.open_source(os.path.join(out, "x.csv"), s)
        good = [row for i, row in enumerate(rows) if i not in bad]
        y = np.array([float(f"{r[0]:.3f}") for r in good])
        a = np.array([float(f"{r[1]:.3f}") for r in good if r[1] is not None])
        c = np.array([float(f"{r[2]:.4f}") for r in good])
        for held_out in (0, 4300):
            scanned = scan.scan(source, s, source.files, held_out=held_out)
            self.assertEqual((scanned.records, scanned.malformed), (5997, 3))
            self.assertEqual(scanned.first_error, f"{source.files[0]}:4502: Expect 4 fields but have 2 in record 0")
            self.assertAllClose(scanned.statistics["a"], (a.mean(), a.std()), rtol=1e-9)
            self.assertAllClose(scanned.statistics["c"], (c.mean(), c.std()), rtol=1e-9)
            self.assertAllClose(scanned.label_mean, y[held_out:].mean(), rtol=1e-9)

    def test_a_share_is_a_file_in_n_or_a_record_in_n(self):
        out = self.get_temp_dir()
        names = write_numbered_csv(out, files=3, rows=10)
        s = schema.parse(NUMBERED)
        source = readers.open_source(os.path.join(out, "numbered"), s)

        def labels(share, files):
            return [int(y.item()) for _, y in readers.records(source, s, files, share).as_numpy_iterator()]

        self.assertEqual(labels(None, names), list(range(30)))
        self.assertEqual(labels((2, 1), names), list(range(10, 20)))  # files[1::2]
        self.assertEqual(labels((2, tf.constant(0, tf.int64)), names), list(range(10)) + list(range(20, 30)))
        self.assertEqual(labels((4, 3), names), [3, 7, 11, 15, 19, 23, 27])  # fewer files than shares

    def test_bad_files_and_schemas_are_named(self):
        out = self.get_temp_dir()
        write_example_files(out)
        s = schema.load(os.path.join(out, "schema.json"))
        with self.assertRaisesRegex(FileNotFoundError, "No such file or directory: '/nonexistent.tsv'"):
            readers.open_source("/nonexistent.tsv", s)
        wrong = schema.parse({**SCHEMA, "label": {"name": "stars", "type": "regression"}})
        with self.assertRaisesRegex(readers.InputError, r"movies.csv lacks columns \['stars'\]; it has \['rating'"):
            readers.open_source(os.path.join(out, "movies.csv"), wrong)
        with self.assertRaisesRegex(readers.InputError, "movies.tfrecord looks like tfrecord, not --format=csv"):
            readers.open_source(os.path.join(out, "movies.tfrecord"), s, "csv")
        empty = os.path.join(out, "empty.csv")
        open(empty, "w").close()
        with self.assertRaisesRegex(readers.InputError, "empty.csv: the file is empty"):
            readers.open_source(empty, s)
        for bad, message in (
            ({"label": {"name": "y"}, "features": []}, "`features` must be a non-empty list"),
            ({"label": {"name": "y"}, "features": [{"name": "a", "type": "dense"}]}, "`type` must be one of"),
            (
                {"label": {"name": "y"}, "features": [{"name": "a", "type": "categorical", "buckets": 1}]},
                r"features\[0\] \('a'\): `buckets` must be an integer >= 2",
            ),
            (
                {
                    "label": {"name": "y"},
                    "features": [
                        {"name": "a", "type": "categorical", "buckets": 8, "table": "t"},
                        {"name": "b", "type": "categorical", "buckets": 9, "table": "t"},
                    ],
                },
                "features 'a' and 'b' share table 't' but have buckets 8 and 9",
            ),
            ({"label": {"name": "y"}, "features": [{"name": "a", "type": "numeric"}]}, "at least one categorical"),
        ):
            with self.assertRaisesRegex(schema.SchemaError, message):
                schema.parse(bad, "s.json")

    def test_infer_writes_a_usable_starting_schema(self):
        columns = {
            "clicked": ["0", "1"] * 50,
            "price": [str(round(1.1**i, 3)) for i in range(100)],  # skewed: log1p
            "country": ["de", "fr", "us", "jp"] * 25,
            "tags": ["a|b", "c", "b|d", "a"] * 25,
        }
        inferred = schema.infer_from_columns(columns)
        self.assertEqual(inferred.label, schema.Label("clicked", schema.LabelType.BINARY))
        kinds = {f.name: (f.type.value, f.transform.value, f.buckets) for f in inferred.features}
        self.assertEqual(
            kinds,
            {
                "price": ("numeric", "log1p", None),
                "country": ("categorical", "none", 16),
                "tags": ("multi_hot", "none", 16),
            },
        )
        self.assertEqual(schema.parse(inferred.to_json()), inferred)


@pytest.mark.ps_cluster
class SharesTest(tf.test.TestCase):
    def test_worker_pipelines_read_distinct_shares(self):
        from tests.harness.strategies import ps_strategy
        from tf_sharded.app import inputs

        strategy = ps_strategy()
        out = self.get_temp_dir()
        s = schema.parse(NUMBERED)
        for files, rows in ((3, 10), (1, 30)):  # by file, by record
            names = write_numbered_csv(os.path.join(out, str(files)), files=files, rows=rows)
            source = readers.open_source(names[0] if files == 1 else os.path.dirname(names[0]), s)
            shares = inputs.Shares(strategy, workers=2)
            seen = []
            for _ in range(2):  # two pipelines, as two workers start theirs
                pipeline = shares.dataset(lambda share: readers.records(source, s, names, share))
                seen.append([int(y.item()) for _, y in pipeline.as_numpy_iterator()])
            self.assertEqual(sorted(seen[0] + seen[1]), list(range(30)), msg=files)
            self.assertNotEqual(seen[0], [], msg=files)
            self.assertNotEqual(seen[1], [], msg=files)
        whole = inputs.Shares(None, workers=1).dataset(lambda share: tf.data.Dataset.from_tensors(share is None))
        self.assertTrue(whole.get_single_element())

        # Under tfs.fit's coordinator: every scheduled batch's labels, over both workers, without repeats.
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        shares = inputs.Shares(strategy, workers=2)
        names = write_numbered_csv(os.path.join(out, "fit"), files=4, rows=5)
        source = readers.open_source(os.path.dirname(names[0]), s)
        per_worker = coordinator.create_per_worker_dataset(
            lambda: shares.dataset(lambda share: readers.records(source, s, names, share).batch(1))
        )
        iterator = iter(per_worker)
        step = tf.function(lambda it: next(it)[1])
        launched = [coordinator.schedule(step, args=(iterator,)) for _ in range(6)]
        labels = [int(r.fetch()[0].item()) for r in launched]
        self.assertLen(set(labels), 6, labels)


class ResumedInputTest(tf.test.TestCase):
    def test_a_resumed_pipeline_starts_at_the_batch_after_the_checkpoint(self):
        import argparse

        from tf_sharded.app import inputs

        out = self.get_temp_dir()
        with open(os.path.join(out, "numbered.schema.json"), "w") as f:
            json.dump(NUMBERED, f)
        clean = write_numbered_csv(os.path.join(out, "clean"), files=1, rows=42)[0]
        broken = write_numbered_csv(os.path.join(out, "broken"), files=1, rows=42)[0]
        with open(broken) as f:
            lines = f.readlines()
        with open(broken, "w") as f:  # two malformed records: one held out, one in training
            f.writelines(lines[:3] + ["x,1\n"] + lines[3:20] + ["y,2\n"] + lines[20:])
        parts = os.path.dirname(write_numbered_csv(os.path.join(out, "parts"), files=3, rows=14)[0])
        for path in (clean, broken, parts):
            args = argparse.Namespace(
                data=path, schema=os.path.join(out, "numbered.schema.json"), format="auto", checkpoint_dir=None,
                batch_size=4, eval_steps=1, max_vocab=None, strict=False, seed=0, cache_dir=None,
            )  # fmt: skip
            plan = inputs.plan(args, workers=1)
            # Labels number the records; with the held-out batch and malformed ones left out, the train
            # stream repeats every 36 (one file) or 28 (three files, the last held out) records.
            labels = lambda dataset, n: [list(y[:, 0]) for _, y in dataset.take(n).as_numpy_iterator()]  # noqa: E731
            everything = labels(plan.train_fn(None), 14)
            self.assertEqual(everything[0], [4, 5, 6, 7] if path != parts else [0, 1, 2, 3], msg=path)
            for skip in (1, 5, 9, 12):
                resumed = labels(plan.train_fn(None, skip=skip), 2)
                self.assertEqual(resumed, everything[skip : skip + 2], msg=(path, skip))


class KeptSchemaTest(tf.test.TestCase):
    def test_a_worker_reading_the_kept_schema_while_another_writes_it_sees_none_or_all_of_it(self):
        # Every worker of a multi-worker job keeps the schema beside the same checkpoints as it starts, within
        # moments of the others: none may see another's file half-written.
        import threading

        from tf_sharded.app import inputs

        out = self.get_temp_dir()
        kept = schema.criteo(data.vocab_sizes(100))
        halfway, finish = threading.Event(), threading.Event()
        real_dump = json.dump

        def slow_dump(value, f, **kwargs):
            text = json.dumps(value, **kwargs)
            f.write(text[: len(text) // 2])
            f.flush()
            halfway.set()
            finish.wait(10)
            f.write(text[len(text) // 2 :])

        with mock.patch.object(json, "dump", slow_dump):
            writer = threading.Thread(target=inputs.save_schema, args=(kept, out))
            writer.start()
            self.assertTrue(halfway.wait(10))
            during = inputs.saved_schema(out)  # a half-written file would raise SchemaError ("is not JSON")
            finish.set()
            writer.join()
        self.assertIsNone(during)
        self.assertEqual(inputs.saved_schema(out), kept)
        self.assertEqual(os.listdir(out), [inputs.SCHEMA_FILE])  # nothing else left behind
        self.assertIs(json.dump, real_dump)


class ParquetListTest(tf.test.TestCase):
    def test_a_parquet_list_column_is_refused_with_what_to_do(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = os.path.join(self.get_temp_dir(), "lists.parquet")
        pq.write_table(pa.table({"rating": [1.0, 2.0], "user": ["a", "b"], "genres": [["x", "y"], ["z"]]}), name)
        s = schema.parse({**SCHEMA, "features": [f for f in SCHEMA["features"] if f["name"] == "genres"]})
        expected = (
            r"--data .*lists.parquet: Parquet list column\(s\) \['genres'\], which the Parquet readers cannot read; "
            r"write a multi-hot column as '\|'-separated"
        )
        with self.assertRaisesRegex(readers.InputError, expected):
            readers.open_source(name, s)


NULLS_CSV = [
    "rating,user_id,age,gender,genres,movie_id",
    "4.0,12,25,M,Action|Comedy,1193",
    "3.5,,31,F,Drama,661",
    "5,15,,,,3408",
    "2,16,40,M,Comedy|Drama|Horror,",
]


def write_nulls_parquet(name):
    """`NULLS_CSV`'s records as Parquet, each empty field a null (integer, float and text columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [line.split(",") for line in NULLS_CSV[1:]]
    value = lambda text, kind: None if text == "" else kind(text)  # noqa: E731
    kinds = {"rating": float, "user_id": int, "age": float, "gender": str, "genres": str, "movie_id": int}
    columns = NULLS_CSV[0].split(",")
    table = pa.table({c: [value(r[i], kinds[c]) for r in rows] for i, c in enumerate(columns)})
    pq.write_table(table, name, row_group_size=2)
    return table


class ParquetCacheTest(tf.test.TestCase):
    def read(self, source, s):
        stats = scan.scan(source, s, source.files).statistics
        return collect(readers.batched(readers.records(source, s.with_statistics(stats), source.files), 2))

    def test_nulls_read_as_missing_values_as_empty_fields_of_csv_do(self):
        # tensorflow-io drops nulls and shifts the rest of a column up, so a file with nulls in a column read
        # takes the cache on every stack.
        out = self.get_temp_dir()
        with open(os.path.join(out, "nulls.csv"), "w") as f:
            f.write("\n".join(NULLS_CSV) + "\n")
        table = write_nulls_parquet(os.path.join(out, "nulls.parquet"))
        self.assertEqual(table.column("user_id").null_count, 1)
        s = schema.parse(SCHEMA)
        cache = os.path.join(out, "cache")
        from_parquet = readers.open_source(os.path.join(out, "nulls.parquet"), s, cache_dir=cache)
        self.assertLen(from_parquet.cache, 1)
        self.assertTrue(from_parquet.cache[0].startswith(cache))
        self.assertEqual(from_parquet.kinds["user_id"], "string")  # an integer column with nulls, kept as text
        features, labels = self.read(from_parquet, s)
        want, want_labels = self.read(readers.open_source(os.path.join(out, "nulls.csv"), s), s)
        self.assertAllEqual(labels, want_labels)
        self.assertEqual(features["genres"], want["genres"])
        for key in ("dense", "user_id", "gender", "movie_id"):
            self.assertAllClose(features[key], want[key], msg=key)
        self.assertEqual(list(features["user_id"]), [expected_id("12", 100), 0, expected_id("15", 100),
                                                     expected_id("16", 100)])  # fmt: skip

    def test_nulls_are_counted_per_column_whatever_comes_before_it_and_with_or_without_statistics(self):
        # Statistics are per leaf column: a struct column (two leaves) before the ones read shifts their positions.
        import pyarrow as pa
        import pyarrow.parquet as pq

        out = self.get_temp_dir()
        point = [{"x": 1, "y": None}, {"x": None, "y": 2}, {"x": None, "y": None}]
        table = pa.table({"point": point, "a": [1, None, 3], "b": ["x", "y", None], "c": [1.0, 2.0, 3.0]})
        pq.write_table(table, os.path.join(out, "stats.parquet"), row_group_size=2)
        pq.write_table(table, os.path.join(out, "nostats.parquet"), write_statistics=False)
        names = [os.path.join(out, n) for n in ("stats.parquet", "nostats.parquet")]
        self.assertEqual(parquet.null_counts(names, ["a", "b", "c"]), {"a": 2, "b": 2, "c": 0})
        self.assertEqual(parquet.null_counts(names[:1], ["c"]), {"c": 0})

    def test_the_cache_gives_what_tensorflow_io_gives_and_is_written_once(self):
        out = self.get_temp_dir()
        write_example_files(out)
        s = schema.parse(SCHEMA)
        name = os.path.join(out, "movies.parquet.snappy")
        cache = os.path.join(out, "cache")
        with mock.patch.object(parquet, "tensorflow_io_loads", return_value=False):
            cached = readers.open_source(name, s, cache_dir=cache)
        (entry,) = os.listdir(cache)
        self.assertEqual(os.path.dirname(cached.cache[0]), os.path.join(cache, entry))
        if parquet.tensorflow_io_loads():
            direct = readers.open_source(name, s, cache_dir=cache)
            self.assertEqual(direct.cache, ())
            self.assertEqual(direct.kinds, {**direct.kinds, **cached.kinds})
            (features, labels), (want, want_labels) = self.read(cached, s), self.read(direct, s)
            self.assertAllEqual(labels, want_labels)
            self.assertEqual(features["genres"], want["genres"])
            for key in ("dense", "user_id", "gender", "movie_id"):
                self.assertAllClose(features[key], want[key], msg=key)
        # Written once: opening again reads the same directory; a changed file gets a new one.
        stamp = os.path.getmtime(os.path.join(cached.cache[0]))
        with mock.patch.object(parquet, "tensorflow_io_loads", return_value=False):
            self.assertEqual(readers.open_source(name, s, cache_dir=cache).cache, cached.cache)
            self.assertEqual(os.path.getmtime(cached.cache[0]), stamp)
            os.utime(name, ns=(1, 1))
            changed = readers.open_source(name, s, cache_dir=cache)
        self.assertNotEqual(changed.cache, cached.cache)
        self.assertLen(os.listdir(cache), 2)

    def test_a_conversion_killed_midway_leaves_no_entry_and_the_next_run_converts_again(self):
        out = self.get_temp_dir()
        write_example_files(out)
        s = schema.parse(SCHEMA)
        name, cache = os.path.join(out, "movies.parquet.snappy"), os.path.join(out, "cache")

        def killed(*args):
            raise KeyboardInterrupt  # the process is stopped while the file is being converted

        with mock.patch.object(parquet, "tensorflow_io_loads", return_value=False):
            with mock.patch.object(parquet, "_convert", side_effect=killed), self.assertRaises(KeyboardInterrupt):
                readers.open_source(name, s, cache_dir=cache)
            self.assertEqual(os.listdir(cache), [])
            # A kill -9 leaves its staging directory behind; it is not an entry and is not read.
            os.makedirs(os.path.join(cache, "0123456789abcdef0123.partial-99999", "part-00000"))
            source = readers.open_source(name, s, cache_dir=cache)
        features, labels = self.read(source, s)
        self.assertAllEqual(labels[:, 0], [4.0, 3.5, 5.0, 2.0])

    def test_the_reason_given_for_the_cache_is_this_process_s(self):
        with mock.patch.object(parquet, "tensorflow_io_loads", return_value=True):
            self.assertEqual(parquet.why_cached(), "a column it reads has nulls, which tensorflow-io misreads")
        with mock.patch.object(parquet, "tensorflow_io_loads", return_value=False):
            with mock.patch.object(parquet.importlib.util, "find_spec", return_value=None):
                self.assertIn("tensorflow-io is not installed", parquet.why_cached())
            with mock.patch.object(parquet.importlib.util, "find_spec", return_value=object()):
                self.assertEqual(
                    parquet.why_cached(), f"tensorflow-io's Parquet ops do not load into TensorFlow {tf.__version__}"
                )

    @pytest.mark.slow  # starts a Python process with TensorFlow
    def test_load_ops_never_imports_a_tensorflow_io_whose_ops_do_not_load(self):
        # A user's process sees no tensorflow-io warning: it is imported only where its library loaded.
        code = (
            "import sys; from tf_sharded.app import readers, parquet; readers.load_ops(); "
            "print(parquet.tensorflow_io_loads(), 'tensorflow_io' in sys.modules)"
        )
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        loads, imported = done.stdout.split()
        self.assertEqual(imported, "False")
        self.assertNotIn("tensorflow_io", done.stderr)
        self.assertNotIn("tensorflow-io", done.stderr)
        self.assertEqual(loads, str(parquet.tensorflow_io_loads()))


class RatingsDataTest(tf.test.TestCase):
    def test_three_formats_hold_the_same_records_and_infer_the_same_schema(self):
        out = self.get_temp_dir()
        read, inferred = {}, {}
        for fmt in data.RATINGS_FORMATS:
            (name,) = data.synthesize_ratings(fmt, 300, os.path.join(out, fmt), seed=3)
            columns, lists = scan.sample_columns(name)
            s = schema.infer_from_columns(columns, label="rating", list_columns=lists)
            inferred[fmt] = {f.name: (f.type.value, f.buckets) for f in s.features}
            source = readers.open_source(name, s)
            if s.needs_statistics():
                s = s.with_statistics(scan.scan(source, s, source.files).statistics)
            read[fmt] = next(iter(readers.batched(readers.records(source, s, source.files), 300)))
        self.assertEqual(inferred["csv"]["user_id"][0], "categorical")  # named like an id
        self.assertEqual(inferred["csv"]["movie_id"][0], "categorical")  # an integer named like an id
        self.assertEqual(inferred["csv"]["genres"][0], "multi_hot")
        for fmt in ("tfrecord", "parquet"):
            self.assertEqual(inferred[fmt], inferred["csv"], msg=fmt)
            self.assertAllClose(read[fmt][1], read["csv"][1], msg=fmt)
            self.assertEqual(sorted(read[fmt][0]), sorted(read["csv"][0]))
            for key, want in read["csv"][0].items():
                got = read[fmt][0][key]
                if isinstance(want, tf.RaggedTensor):
                    self.assertEqual(got.to_list(), want.to_list(), msg=f"{fmt} {key}")
                else:
                    self.assertAllClose(got, want, msg=f"{fmt} {key}")
        self.assertLen(read["csv"][1], 300)
