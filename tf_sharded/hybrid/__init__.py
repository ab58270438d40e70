"""Hybrid training (Persia's): tables on table servers updated by each worker alone, dense variables all-reduced.

`HybridStrategy` runs on the workers; a `TableServer` runs in each `ps`
task (`python -m tf_sharded.hybrid`).
"""

from tf_sharded.hybrid.dynamic import ServedDynamicTable
from tf_sharded.hybrid.local import LocalHybridCluster
from tf_sharded.hybrid.server import TableServer
from tf_sharded.hybrid.strategy import HybridStrategy
from tf_sharded.hybrid.table import ServedSlot, ServedTable, apply_pending

__all__ = [
    "HybridStrategy",
    "LocalHybridCluster",
    "ServedDynamicTable",
    "ServedSlot",
    "ServedTable",
    "TableServer",
    "apply_pending",
]
