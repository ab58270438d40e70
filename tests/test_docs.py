"""Every public symbol is documented with an example, and the examples run."""

import doctest
import importlib
import inspect
import pkgutil
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs

# Every library module (the application and the benchmarks are documented by their commands).
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(tfs.__path__, "tf_sharded.")
    if not m.name.startswith(("tf_sharded.app", "tf_sharded.benchmarks", "tf_sharded.__main__"))
)


def public_homes() -> set:
    """Modules defining a public name of `tfs` or of its public namespaces (`tfs.layers`, `tfs.exchange`, ...)."""
    homes = set()
    namespaces = (tfs, tfs.layers, tfs.optimizers, tfs.callbacks, tfs.exchange, tfs.partitioners, tfs.cluster)
    for namespace in namespaces + (tfs.policies,):
        names = getattr(namespace, "__all__", None)
        if names is None:  # a plain module: what it defines itself
            names = [n for n, o in vars(namespace).items() if getattr(o, "__module__", None) == namespace.__name__]
        for name in names:
            obj = getattr(namespace, name)
            if inspect.isclass(obj) and issubclass(obj, Exception):
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith("tf_sharded"):
                homes.add(obj.__module__)
    return homes


class DocTest(tf.test.TestCase):
    @pytest.mark.slow  # over 5 s here
    def test_examples_run(self):
        homes = public_homes()
        self.assertIn("tf_sharded.table.lookup", homes)
        for name in MODULES:
            module = importlib.import_module(name)
            result = doctest.testmod(module, extraglobs={"np": np, "tf": tf}, optionflags=doctest.ELLIPSIS)
            self.assertEqual(result.failed, 0, msg=name)
            if name in homes:
                self.assertGreater(result.attempted, 0, msg=f"{name} defines public names but has no example")

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


class PublicApiTest(tf.test.TestCase):
    def test_all_is_small_and_resolves(self):
        self.assertLessEqual(len(tfs.__all__), 30, msg=tfs.__all__)
        self.assertEqual(len(set(tfs.__all__)), len(tfs.__all__))
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # no public name is a deprecated alias
            for name in tfs.__all__:
                self.assertIsNotNone(getattr(tfs, name), msg=name)

    def test_namespaces_outside_all_stay_attributes(self):
        for name in ("exchange", "strategy", "partitioners", "training"):
            self.assertNotIn(name, tfs.__all__)
            self.assertTrue(inspect.ismodule(getattr(tfs, name)), msg=name)
        self.assertIs(tfs.training.steps_done, importlib.import_module("tf_sharded.keras.training").steps_done)

    def test_removed_aliases_are_gone(self):
        for name in ("CapacityEviction", "MinCountAdmission", "ProbabilityAdmission", "StepsSinceSeenEviction",
                     "data", "models"):  # fmt: skip
            self.assertNotIn(name, tfs.__all__)
            self.assertFalse(hasattr(tfs, name), msg=name)
        with self.assertRaisesRegex(AttributeError, "no attribute 'Nothing'"):
            tfs.Nothing  # noqa: B018


if __name__ == "__main__":
    tf.test.main()
