"""The README's Keras examples for the default strategy and for tables sharded over the replicas, run as written
(with the `dataset` they leave to the reader: 64 rows of 3 ids and a label), in a fresh directory."""

import os
import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # two 1M-row tables with their optimizer slots

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()


def _block(marker: str) -> str:
    found = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if marker in b]
    assert len(found) == 1, f"one README block with {marker!r}, found {len(found)}"
    return found[0]


def _dataset() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1_000_000, size=(64, 3))
    return tf.data.Dataset.from_tensor_slices((ids, rng.random((64, 1), np.float32))).batch(16)


class ReadmeExamplesTest(tf.test.TestCase):
    def setUp(self):
        super().setUp()
        self.addCleanup(os.chdir, os.getcwd())
        os.chdir(self.get_temp_dir())

    def test_the_default_strategy_example_trains_checkpoints_and_exports(self):
        scope = {"dataset": _dataset()}
        exec(_block("partitions=4)"), scope)  # noqa: S102  (the README's own code)
        model = scope["model"]
        self.assertLen(model.layers[1].embeddings.variables, 4)
        self.assertTrue(tf.io.gfile.glob("ckpt/*.index"), "tfs.fit wrote no checkpoint")
        served = tf.saved_model.load("serving/1").signatures["serving_default"]
        ids = tf.constant([[1, 2, 3]], tf.int64)
        self.assertAllClose(list(served(ids).values())[0], model(ids), atol=1e-6)

    def test_the_sharded_example_splits_the_table_over_the_replicas(self):
        scope = {"dataset": _dataset()}
        exec(_block('placement="sharded"'), scope)  # noqa: S102
        strategy, table = scope["strategy"], scope["emb"].embeddings
        replicas = strategy.num_replicas_in_sync
        self.assertGreater(replicas, 1)  # the suite's four CPU devices
        self.assertLen(table.variables, replicas)
        self.assertEqual(sum(int(v.shape[0]) for v in table.variables), 1_000_000)
        self.assertEqual(table.placement_type.name, "replicas")


if __name__ == "__main__":
    tf.test.main()
