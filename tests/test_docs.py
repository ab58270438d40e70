"""Every public symbol is documented with an example, and the examples run."""

import doctest
import importlib
import inspect

import numpy as np
import tensorflow as tf

import tf_sharded as tfs

MODULES = [
    "tf_sharded.partition",
    "tf_sharded.partitioners",
    "tf_sharded.initializers",
    "tf_sharded.sharded_variable",
    "tf_sharded.lookup",
    "tf_sharded.creation",
    "tf_sharded.cluster",
    "tf_sharded.exchange",
    "tf_sharded.layers",
    "tf_sharded.optimizers",
    "tf_sharded.training",
    "tf_sharded.serving",
]


class DocTest(tf.test.TestCase):
    def test_examples_run(self):
        for name in MODULES:
            module = importlib.import_module(name)
            result = doctest.testmod(module, extraglobs={"np": np, "tf": tf}, optionflags=doctest.ELLIPSIS)
            self.assertEqual(result.failed, 0, msg=name)
            self.assertGreater(result.attempted, 0, msg=name)

    def test_public_symbols_have_docstrings_with_examples(self):
        for name in tfs.__all__:
            obj = getattr(tfs, name)
            if inspect.ismodule(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            if inspect.isclass(obj) and issubclass(obj, Exception):
                self.assertTrue(doc, msg=name)
                continue
            self.assertIn(">>>", doc, msg=f"{name} has no executed example")
            if inspect.isfunction(obj):
                self.assertIn("Args:", doc, msg=name)
                hints = inspect.signature(obj).parameters
                self.assertTrue(any(p.annotation is not inspect.Parameter.empty for p in hints.values()), msg=name)
        for cls in (tfs.partitioners.FixedShards, tfs.partitioners.MinSize, tfs.partitioners.MaxSize):
            self.assertIn(">>>", inspect.getdoc(cls))


if __name__ == "__main__":
    tf.test.main()
