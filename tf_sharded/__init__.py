"""tf_sharded: sharded embedding tables for TensorFlow 2 distribution strategies.

Importing the package registers the strategy families (`tf_sharded.strategy`),
installs `create_sharded_variable` on every `tf.distribute.Strategy`, and
routes `tf.nn.embedding_lookup` on tables to `tfs.embedding_lookup`. The
process's first table routes Keras 3 optimizers' gradient reduction through
the mirrored exchange (`tf_sharded.keras.routing`); until then Keras runs as
it ships. It refuses a TensorFlow or Keras release outside the supported
ranges (`tf_sharded.versions`).

`__all__` is the concepts a user holds in their head: tables, configs,
layers, optimizers, fit / evaluate / predict / export, the plan, the
cluster, the policies and the errors. The exchange, the strategy registry,
the partitioners, the training loop and its callbacks stay reachable as namespaces
(`tfs.exchange`, `tfs.strategy`, `tfs.partitioners`, `tfs.training`, `tfs.callbacks`) for
the users who need them. The training application is the `[app]` extra,
imported as `tf_sharded.app.data` / `tf_sharded.app.models`.
"""

import sys as _sys

if _sys.argv[:1] == ["-m"]:
    # `python -m tf_sharded COMMAND`, still one thread: a command that starts a local cluster moves into a
    # network of its own before TensorFlow loads (tf_sharded.isolation).
    from tf_sharded import isolation as _isolation

    _isolation.enter_for_command(_sys.argv[1:])

from tf_sharded import _console, versions  # noqa: E402

with _console.quiet_import():
    import keras as _keras
    import tensorflow as _tf

versions.check(_tf.__version__, _keras.__version__)

from tf_sharded import _compat  # noqa: E402

_compat.leave_unconverted(__name__)

from tf_sharded import cluster, policies
from tf_sharded import exchange as exchange
from tf_sharded import hybrid as hybrid
from tf_sharded import partitioners as partitioners
from tf_sharded import strategy as strategy
from tf_sharded.config import Combiner, DynamicTableConfig, Exchange, FeatureConfig, Placement, Scheme, TableConfig
from tf_sharded.creation import create_dynamic_table, create_sharded_variable
from tf_sharded.creation import install as _install
from tf_sharded.errors import LayoutMismatchError, ShardedError, UnsupportedStrategyError
from tf_sharded.keras import callbacks as callbacks
from tf_sharded.keras import layers, optimizers
from tf_sharded.keras import training as training
from tf_sharded.keras.serving import export, export_delta
from tf_sharded.keras.training.evaluation import evaluate, predict
from tf_sharded.keras.training.trainer import fit
from tf_sharded.layout import Layout, PartitionSpec
from tf_sharded.planning.planner import plan
from tf_sharded.planning.plans import Plan
from tf_sharded.strategy import default as _default  # noqa: F401  (registers the family)
from tf_sharded.strategy import hybrid as _hybrid  # noqa: F401
from tf_sharded.strategy import mirrored as _mirrored  # noqa: F401
from tf_sharded.strategy import parameter_server as _parameter_server  # noqa: F401
from tf_sharded.table import DynamicTable, ShardedVariable, Table, embedding_lookup, embedding_lookup_sparse

__version__ = "0.1.0"

_install()

__all__ = [
    "Combiner",
    "DynamicTable",
    "DynamicTableConfig",
    "Exchange",
    "FeatureConfig",
    "Layout",
    "LayoutMismatchError",
    "PartitionSpec",
    "Placement",
    "Plan",
    "Scheme",
    "ShardedError",
    "ShardedVariable",
    "Table",
    "TableConfig",
    "UnsupportedStrategyError",
    "cluster",
    "create_dynamic_table",
    "create_sharded_variable",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "evaluate",
    "export",
    "export_delta",
    "fit",
    "layers",
    "optimizers",
    "plan",
    "policies",
    "predict",
]
