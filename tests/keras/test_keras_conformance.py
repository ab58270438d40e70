"""Keras's own tests, run with tf_sharded's layer and optimizers in place of Keras's.

The test files are read at test time from the installed Keras wheel,
copied into a temporary directory beside a conftest that substitutes ours,
and run by pytest in a child process. Nothing of Keras's tests is kept in
this repository.

* `keras/src/layers/core/embedding_test.py` with `tfs.layers.Embedding`:
  once as it is (one shard), once with 3 shards by default, where the only
  adapted assertions are those that count a layer's weights (a table's
  shards count as one);
* `keras/src/optimizers/{sgd,adagrad,adam,ftrl}_test.py` with
  `tfs.optimizers.*` (dense variables: Keras's own behaviour);
* every `keras/src/optimizers/*_test.py` with Keras's own optimizers, once
  alone and once in a process that imported tf_sharded and created a
  mirrored table (which installs the optimizer routing): the same tests pass.
"""

import glob
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

import keras
import pytest
import tensorflow as tf

from tests.harness.subprocs import ROOT, _env

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.processes(cost=45)]

KERAS_SRC = os.path.join(os.path.dirname(keras.__file__), "src")
KERAS_TESTS = os.path.join(KERAS_SRC, "layers", "core", "embedding_test.py")
OPTIMIZER_TESTS = [os.path.join(KERAS_SRC, "optimizers", f"{n}_test.py") for n in ("sgd", "adagrad", "adam", "ftrl")]
ALL_OPTIMIZER_TESTS = sorted(glob.glob(os.path.join(KERAS_SRC, "optimizers", "*_test.py")))

# Refused on purpose (docs/api.md, compatibility with keras.layers.Embedding): a constraint projects the whole
# table after every step (both tests build a layer with `embeddings_constraint`); negative ids are an error, where
# Keras's `take` wraps them (-1 reads the last row): the last part of the LoRA + int8 / int4 tests feeds float
# noise as ids.
REFUSED = {
    "test_embedding_constraints": "Argument `embeddings_constraint` is not supported",
    "test_enable_lora_with_embeddings_constraint": "Argument `embeddings_constraint` is not supported",
    "test_quantize_lora_integration_int8": "must hold row ids in [0, 10)",
    "test_quantize_lora_integration_int4": "must hold row ids in [0, 10)",
}

CONFTEST = """
import re

import keras
import keras.src.layers as keras_layers
from keras.src.testing import test_case

import tf_sharded as tfs

SHARDS = {shards}

keras_layers.Embedding = tfs.layers.Embedding
if SHARDS > 1:
    init = tfs.layers.Embedding.__init__

    def init_with_shards(self, *args, partitions=SHARDS, **kwargs):
        # SHARDS shards unless a test says otherwise (files saved by a test keep theirs in the config).
        init(self, *args, partitions=partitions, **kwargs)

    tfs.layers.Embedding.__init__ = init_with_shards
    assert_len = test_case.TestCase.assertLen

    def tables(iterable):
        # A table's shards (`<name>_part_<i>`) count as one weight.
        return list(dict.fromkeys(re.sub(r"_part_\\d+$", "", w.path) for w in iterable))

    def assert_len_of_weights(self, iterable, expected_len, msg=None):
        # The one adapted assertion: counts of a layer's weights, which the tests give per table. (Where a
        # test gives none, run_layer_test counts the same layer's weights itself, by shard.)
        items = list(iterable)
        if items and all(isinstance(w, keras.Variable) for w in items) and len(items) != expected_len:
            items = tables(items)
        return assert_len(self, items, expected_len, msg=msg)

    test_case.TestCase.assertLen = assert_len_of_weights
"""


OPTIMIZER_CONFTEST = """
import importlib

import tf_sharded as tfs

# Before the test modules import them: `from keras.src.optimizers.sgd import SGD` then binds ours.
for module, name in (("sgd", "SGD"), ("adagrad", "Adagrad"), ("adam", "Adam"), ("ftrl", "Ftrl")):
    setattr(importlib.import_module(f"keras.src.optimizers.{module}"), name, getattr(tfs.optimizers, name))


def pytest_collection_modifyitems(items):
    # Every test module bound ours (it imported the name after this file ran).
    for item in items:
        for name in ("SGD", "Adagrad", "Adam", "Ftrl"):
            bound = getattr(item.module, name, None)
            assert bound is None or bound is getattr(tfs.optimizers, name), (item.module.__name__, name, bound)
"""


# A process that uses tf_sharded's types beside Keras's own optimizers: importing changes nothing, the first
# table (mirrored) installs the routing, and every Keras optimizer test must still pass.
ROUTED_CONFTEST = """
import tensorflow as tf

import tf_sharded as tfs
from tf_sharded import _compat

assert not _compat.keras_routing_installed(), "importing tf_sharded installed the Keras routing"
STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0"])
with STRATEGY.scope():
    TABLE = tfs.create_sharded_variable("routing_probe", shape=(64, 4), partitions=2)
assert _compat.keras_routing_installed(), "a mirrored table did not install the Keras routing"
"""


def _run_keras_tests(test, files, conftest: str) -> dict:
    """Runs Keras test `files` beside `conftest` (the substitution); `{test name: (passed?, message)}`."""
    directory = tempfile.mkdtemp(dir=test.get_temp_dir())
    copies = []
    for path in files:
        copies.append(os.path.join(directory, "test_keras_" + os.path.basename(path)))
        with open(path) as f, open(copies[-1], "w") as out:
            out.write(f.read())
    with open(os.path.join(directory, "conftest.py"), "w") as f:
        f.write(conftest)
    report = os.path.join(directory, "report.xml")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", directory, "-c", os.devnull,
         f"--junitxml={report}", *copies],
        capture_output=True, text=True, timeout=500, cwd=ROOT, env=_env({"PYTHONPATH": ROOT}),
    )  # fmt: skip
    test.assertTrue(os.path.exists(report), proc.stdout[-3000:] + proc.stderr[-3000:])
    results = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        failed = any(child.tag in ("failure", "error") for child in case)
        name = f"{case.get('classname')}.{case.get('name')}"
        results[name] = (not failed, "".join(child.get("message") or "" for child in case)[:300])
    return results


@pytest.mark.skipif(not os.path.exists(KERAS_TESTS), reason=f"Keras's Embedding tests are not installed: {KERAS_TESTS}")
class KerasEmbeddingSuiteTest(tf.test.TestCase):
    def check(self, shards: int):
        results = _run_keras_tests(self, [KERAS_TESTS], CONFTEST.format(shards=shards))
        results = {name.rsplit(".", 1)[1]: outcome for name, outcome in results.items()}
        self.assertGreaterEqual(len(results), 40)  # the whole file ran (51 tests in Keras 3.15.1)
        expected = {name for name in results if name not in REFUSED}
        failing = {name: message for name, (ok, message) in results.items() if name in expected and not ok}
        self.assertEqual(failing, {}, f"{shards} shard(s)")
        # The refusals are the documented ones.
        for name, message in REFUSED.items():
            self.assertFalse(results[name][0], name)
            self.assertIn(message, results[name][1], name)

    def test_keras_embedding_tests_pass_on_one_shard(self):
        self.check(1)

    def test_keras_embedding_tests_pass_on_three_shards(self):
        self.check(3)


@pytest.mark.skipif(
    not all(os.path.exists(p) for p in OPTIMIZER_TESTS),
    reason=f"Keras's optimizer tests are not installed: {OPTIMIZER_TESTS}",
)
class KerasOptimizerSuiteTest(tf.test.TestCase):
    def test_keras_optimizer_tests_pass_with_tfs_optimizers(self):
        results = _run_keras_tests(self, OPTIMIZER_TESTS, OPTIMIZER_CONFTEST)
        self.assertGreaterEqual(len(results), 30)  # every file ran (32 tests in Keras 3.15.1)
        for kind in ("SGD", "Adagrad", "Adam", "Ftrl"):
            self.assertTrue(any(kind.lower() in name.lower() for name in results), kind)
        self.assertEqual({name: message for name, (ok, message) in results.items() if not ok}, {})


@pytest.mark.timeout(900)
@pytest.mark.skipif(not ALL_OPTIMIZER_TESTS, reason=f"Keras's optimizer tests are not installed in {KERAS_SRC}")
class KerasOptimizersBesideTablesTest(tf.test.TestCase):
    def test_every_keras_optimizer_test_passes_beside_a_mirrored_table(self):
        alone = _run_keras_tests(self, ALL_OPTIMIZER_TESTS, "")
        routed = _run_keras_tests(self, ALL_OPTIMIZER_TESTS, ROUTED_CONFTEST)
        passed = lambda results: sorted(name for name, (ok, _) in results.items() if ok)  # noqa: E731
        self.assertGreaterEqual(len(passed(alone)), 200)  # 257 on TF 2.16.2 / Keras 3.15.1
        self.assertEqual(sorted(routed), sorted(alone))
        self.assertEqual(passed(routed), passed(alone))


if __name__ == "__main__":
    tf.test.main()
