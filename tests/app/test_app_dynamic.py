"""The application with `--vocabulary dynamic`: raw values as keys of dynamic tables, on TSV and Parquet files,
under every strategy."""

import csv
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from tests.app.test_app import RATINGS_SCHEMA, TINY, summary, write_ratings
from tests.harness.subprocs import run_cli_here, run_python, run_python_together

pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=70)]  # the application's commands on process clusters


def live_keys(inspected: str) -> dict:
    """`{table: live keys}` from the lines `python -m tf_sharded inspect` prints for dynamic tables."""
    found = re.findall(r"tables_(\w+)\s+([\d,]+) live keys x (\d+)\s+string", inspected)
    return {name: int(count.replace(",", "")) for name, count, _ in found}


class DynamicVocabularyAppTest(tf.test.TestCase):
    def test_tsv_under_parameter_servers_and_parquet_under_the_other_strategies(self):
        out = self.get_temp_dir()
        csv_path, schema_path = os.path.join(out, "ratings.csv"), os.path.join(out, "schema.json")
        write_ratings(csv_path, rows=700)
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        tsv, parquet = os.path.join(out, "tsv"), os.path.join(out, "pq")
        os.makedirs(tsv)
        os.makedirs(parquet)
        with open(os.path.join(tsv, "ratings.tsv"), "w") as f:
            f.write("\n".join("\t".join(r) for r in [list(rows[0])] + [list(r.values()) for r in rows]) + "\n")
        columns = {k: [r[k] for r in rows] for k in rows[0]}
        table = pa.table({
            "rating": pa.array([float(v) for v in columns["rating"]], pa.float32()),
            "user": pa.array(columns["user"]),
            "movie": pa.array([int(v) for v in columns["movie"]], pa.int64()),
            "genres": pa.array(columns["genres"]),
            "age": pa.array([float(v) for v in columns["age"]], pa.float32()),
        })  # fmt: skip
        pq.write_table(table, os.path.join(parquet, "ratings.parquet"))
        with open(schema_path, "w") as f:
            json.dump(RATINGS_SCHEMA, f)  # its buckets are ignored under --vocabulary dynamic
        common = ["--schema", schema_path, "--model", "mlp", "--vocabulary", "dynamic", "--embedding_dim", "8"]

        ckpt = os.path.join(out, "ckpt")
        train = ["-m", "tf_sharded", "train", *TINY, *common]
        strategies = ("default", "mirrored", "multi_worker")
        # The app's default strategy (parameter servers on a local cluster) on TSV, the others on Parquet;
        # two runs at a time.
        runs = run_python_together([train + ["--data", tsv, "--checkpoint_dir", ckpt],
                                    train + ["--data", parquet, "--strategy", strategies[0]]])  # fmt: skip
        # Mirrored on 2 replicas: string keys in the batches (Keras's model.fit averages the first batch over the
        # replicas, which strings cannot be; tfs.fit runs its own replica loop there).
        # Multi-worker (one worker without TF_CONFIG): the dynamic tables sharded over the workers.
        replicas = {"mirrored": ["--cpu_replicas", "2"], "multi_worker": ["--placement", "sharded"]}
        runs += run_python_together(
            [train + ["--data", parquet, "--strategy", s, *replicas[s]] for s in strategies[1:]]
        )
        # Hybrid: the dynamic tables on a table server, updated by each of the 2 workers.
        served = os.path.join(out, "served")
        hybrid = run_python(train + ["--data", parquet, "--strategy", "hybrid", "--num_workers", "2", "--num_ps", "1",
                                     "--checkpoint_dir", served], timeout=300)  # fmt: skip
        proc = runs[0]
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("under parameter_server", proc.stdout)
        self.assertRegex(summary(proc), r"4 steps \(4 this run\) .* RMSE \d+\.\d+")
        self.assertEqual(hybrid.returncode, 0, hybrid.stderr[-3000:])
        self.assertRegex(summary(hybrid), r"hybrid \(local: 1 table server, 2 workers, a process each\) \| 4 steps")
        for where in (ckpt, served):  # a DynamicTable's entries, whoever held the tables
            shown = run_cli_here(["-m", "tf_sharded", "inspect", where])
            self.assertEqual(shown.returncode, 0, shown.stderr[-2000:])
            keys = live_keys(shown.stdout)
            self.assertEqual(sorted(keys), ["genres", "movie", "user"])
            # Every distinct value is its own key: no more keys than distinct values in the file.
            self.assertBetween(keys["user"], 40, len(set(columns["user"])))
            self.assertBetween(keys["movie"], 20, len(set(columns["movie"])))
            self.assertBetween(keys["genres"], 2, 8)

        for strategy, proc in zip(strategies, runs[1:]):
            self.assertEqual(proc.returncode, 0, f"{strategy}: {proc.stderr[-3000:]}")
            shown = {"default": "default", "mirrored": "mirrored (2 replicas on CPU devices)",
                     "multi_worker": "multi_worker (1 replicas)"}[strategy]  # fmt: skip
            self.assertIn(f"{shown} | 4 steps", summary(proc))

    def test_schema_vocabulary_dynamic_and_its_errors(self):
        from tf_sharded.app import schema as schemas

        schema = dict(RATINGS_SCHEMA)
        schema["features"] = [dict(f) for f in RATINGS_SCHEMA["features"]]
        schema["features"][0] = {"name": "user", "type": "categorical", "vocabulary": "dynamic"}  # no buckets
        parsed = schemas.parse(schema)
        self.assertEqual(parsed.tables(), {"user": None, "movie": 10000, "genres": 64})
        self.assertEqual(schemas.parse(parsed.to_json()), parsed)
        schema["features"][0]["vocabulary"] = "open"
        with self.assertRaisesRegex(schemas.SchemaError, r"features\[0\] \('user'\): `vocabulary` must be 'hashed'"):
            schemas.parse(schema)
        bad = run_cli_here(["-m", "tf_sharded", "train", "--vocabulary", "open"])
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("error: flag --vocabulary=open: value should be one of <hashed|dynamic>", bad.stderr)


if __name__ == "__main__":
    tf.test.main()
