"""tf_sharded: sharded embedding tables for TensorFlow 2 distribution strategies.

Importing the package installs `create_sharded_variable` on every
`tf.distribute.Strategy` and routes `tf.nn.embedding_lookup` on sharded
tables to `tfs.embedding_lookup`.
"""

from tf_sharded import (
    cluster,
    partitioners,
    strategy,  # noqa: F401  (registers the strategy hooks)
)
from tf_sharded.creation import create_sharded_variable
from tf_sharded.creation import install as _install
from tf_sharded.errors import LayoutMismatchError, ShardedError, UnsupportedStrategyError
from tf_sharded.lookup import embedding_lookup, embedding_lookup_sparse
from tf_sharded.partition import Layout, PartitionSpec
from tf_sharded.sharded_variable import ShardedVariable

__version__ = "0.1.0"

_KERAS_MODULES = ("layers", "optimizers", "training", "serving")
_KERAS_FUNCTIONS = {"fit": "training", "export": "serving"}


def __getattr__(name):
    # Keras is imported on first use of these, not by `import tf_sharded`.
    if name in _KERAS_MODULES:
        import importlib

        return importlib.import_module(f"tf_sharded.{name}")
    if name in _KERAS_FUNCTIONS:
        import importlib

        return getattr(importlib.import_module(f"tf_sharded.{_KERAS_FUNCTIONS[name]}"), name)
    raise AttributeError(f"module 'tf_sharded' has no attribute {name!r}")


_install()

__all__ = [
    "Layout",
    "LayoutMismatchError",
    "PartitionSpec",
    "ShardedError",
    "ShardedVariable",
    "UnsupportedStrategyError",
    "cluster",
    "create_sharded_variable",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "exchange",
    "export",
    "fit",
    "layers",
    "optimizers",
    "partitioners",
]
