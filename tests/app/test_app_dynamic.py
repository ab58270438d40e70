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

pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=130)]  # the application's commands on process clusters


def live_keys(inspected: str) -> dict:
    """`{table: live keys}` from the lines `python -m tf_sharded inspect` prints for dynamic tables."""
    found = re.findall(r"tables_(\w+)\s+([\d,]+) live keys x (\d+)\s+string", inspected)
    return {name: int(count.replace(",", "")) for name, count, _ in found}


def table_sizes(inspected: str) -> dict:
    """`{table: (live keys, MiB, bounds in words)}` from the lines `inspect` prints for dynamic tables."""
    found = re.findall(
        r"tables_(\w+)\s+([\d,]+) live keys x \d+\s+string\s+([\d.]+) MiB  dynamic table; (.*)", inspected
    )
    return {name: (int(keys.replace(",", "")), float(mib), said) for name, keys, mib, said in found}


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

    def test_bounds_of_dynamic_tables_in_the_schema_and_from_the_flags(self):
        from tf_sharded import policies
        from tf_sharded.app import models
        from tf_sharded.app import schema as schemas

        schema = dict(RATINGS_SCHEMA)
        schema["features"] = [dict(f) for f in RATINGS_SCHEMA["features"]]
        schema["features"][0] = {"name": "user", "type": "categorical", "vocabulary": "dynamic", "max_keys": 50,
                                 "min_count": 2}  # fmt: skip
        parsed = schemas.parse(schema)
        self.assertEqual(parsed.table_policies(), {"user": {"min_count": 2, "max_keys": 50}})
        self.assertEqual(schemas.parse(parsed.to_json()), parsed)  # kept beside the checkpoints as it was read
        # Each flag bounds the dynamic tables that do not set that bound themselves; hashed tables take none.
        bounded = parsed.with_vocabulary("dynamic").with_policies(min_count=None, evict_after_steps=30, max_keys=9)
        self.assertEqual(
            bounded.table_policies(),
            {"user": {"min_count": 2, "evict_after_steps": 30, "max_keys": 50},
             "movie": {"evict_after_steps": 30, "max_keys": 9},
             "genres": {"evict_after_steps": 30, "max_keys": 9}},
        )  # fmt: skip
        self.assertEqual(parsed.with_policies(max_keys=9).table_policies(), {"user": {"min_count": 2, "max_keys": 50}})
        # The tables' policies: admission by count, eviction by steps unseen and by capacity (least recent first).
        made = models.policies({"min_count": 2, "evict_after_steps": 30, "max_keys": 9})
        self.assertIsInstance(made["admission"], policies.MinCountAdmission)
        self.assertEqual(made["admission"].min_count, 2)
        (unseen, capacity) = made["eviction"]
        self.assertEqual((type(unseen), unseen.max_steps), (policies.StepsSinceSeenEviction, 30))
        self.assertEqual((type(capacity), capacity.max_keys, capacity.policy), (policies.CapacityEviction, 9, "lru"))
        self.assertEqual(models.policies({}), {})

        for change, message in (
            ({"max_keys": 0}, r"features\[0\] \('user'\): `max_keys` must be a positive integer. Received: 0"),
            ({"min_count": "2"}, r"`min_count` must be a positive integer. Received: '2'"),
            (
                {"vocabulary": "hashed", "buckets": 100},
                r'`min_count` bounds a dynamic table: it needs "vocabulary": "dynamic"',
            ),
        ):
            with self.subTest(change=change), self.assertRaisesRegex(schemas.SchemaError, message):
                schemas.parse({**schema, "features": [{**schema["features"][0], **change}, *schema["features"][1:]]})
        shared = {**schema, "features": [{**schema["features"][0], "table": "ids"},
                                         {"name": "movie", "type": "categorical", "vocabulary": "dynamic",
                                          "table": "ids"}, *schema["features"][2:]]}  # fmt: skip
        with self.assertRaisesRegex(
            schemas.SchemaError, r"features 'user' and 'movie' share table 'ids' but have bounds"
        ):
            schemas.parse(shared)

        # The flags: a bound without a dynamic table, and a bound that is not a positive integer, each one line.
        hashed = run_cli_here(["-m", "tf_sharded", "train", "--strategy", "default", "--max_keys", "100"])
        self.assertEqual(hashed.returncode, 1)
        self.assertEqual(
            hashed.stderr.strip().splitlines()[-1],
            "error: --max_keys bound(s) dynamic tables, and Criteo's layout (--data synthetic, --max_vocab) has none: "
            'add --vocabulary dynamic, or "vocabulary": "dynamic" to a column of the schema',
        )
        zero = run_cli_here(["-m", "tf_sharded", "train", "--vocabulary", "dynamic", "--min_count", "0"])
        self.assertNotEqual(zero.returncode, 0)
        self.assertIn("error: flag --min_count=0: 0 is not a positive integer", zero.stderr)


class BoundedVocabularyAppTest(tf.test.TestCase):
    CAPACITY = 3000

    @pytest.mark.timeout(1500)  # about 110 CPU-s; room for a slow machine whose cores the rest of the suite holds
    def test_a_stream_far_past_the_capacity_stays_within_it_and_learns_as_an_uncapped_run(self):
        # Criteo-shaped synthetic data at the default --max_vocab, 300 steps of 256: its 8 largest tables meet
        # about 16,000 distinct values each, over 5 times the capacity. One device, one shard per table.
        out = self.get_temp_dir()
        free, capped = (os.path.join(out, name) for name in ("free", "capped"))
        train = ["-m", "tf_sharded", "train", "--vocabulary", "dynamic", "--strategy", "default", "--steps", "300",
                 "--steps_per_epoch", "100", "--batch_size", "256", "--eval_steps", "20", "--verbose", "0"]  # fmt: skip
        # Beside them, the other bounds on a tiny run under the command's default strategy (parameter servers on a
        # local cluster), as `inspect` names them.
        tiny = os.path.join(out, "tiny")
        runs = run_python_together(
            [train + ["--checkpoint_dir", free], train + ["--max_keys", str(self.CAPACITY), "--checkpoint_dir", capped],
             ["-m", "tf_sharded", "train", *TINY, "--vocabulary", "dynamic", "--min_count", "2",
              "--evict_after_steps", "3", "--checkpoint_dir", tiny]],
            1200,
        )  # fmt: skip
        for proc in runs:
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("parameter_server (local cluster", summary(runs[2]))
        auc = [float(re.search(r"AUC (\d\.\d{4})", summary(proc)).group(1)) for proc in runs[:2]]
        self.assertGreater(auc[0], 0.8)
        self.assertAllClose(auc[1], auc[0], atol=0.005)

        unbounded = table_sizes(run_cli_here(["-m", "tf_sharded", "inspect", free]).stdout)
        self.assertLen(unbounded, 26)
        self.assertGreaterEqual(max(keys for keys, _, _ in unbounded.values()), 5 * self.CAPACITY)  # far past it
        self.assertEqual({said for _, _, said in unbounded.values()}, {"no bounds (admits every key, evicts none)"})
        # Within the capacity at every checkpoint kept, at the bytes per key of the uncapped tables; at the end
        # each table holds every key it met, up to the capacity.
        kept = tf.train.get_checkpoint_state(capped).all_model_checkpoint_paths
        self.assertGreaterEqual(len(kept), 2)
        for path in kept:
            sizes = table_sizes(run_cli_here(["-m", "tf_sharded", "inspect", path]).stdout)
            self.assertEqual(sorted(sizes), sorted(unbounded))
            for table, (keys, mib, said) in sizes.items():
                self.assertLessEqual(keys, self.CAPACITY, msg=(path, table))
                if path == kept[-1]:
                    self.assertEqual(keys, min(unbounded[table][0], self.CAPACITY), msg=table)
                per_key = unbounded[table][1] / unbounded[table][0]
                self.assertLessEqual(mib, keys * per_key + 0.01, msg=(path, table))  # inspect rounds to 0.01 MiB
                self.assertEqual(said, "holds at most 3,000 keys (least recently seen evicted)")

        shown = run_cli_here(["-m", "tf_sharded", "inspect", tiny]).stdout
        bounds = {said for _, _, said in table_sizes(shown).values()}
        self.assertEqual(bounds, {"admits a key after 2 occurrences, evicts keys unseen for 3 steps"})


if __name__ == "__main__":
    tf.test.main()
