"""The hybrid strategy family: `HybridStrategy`'s tables (`tf_sharded.hybrid`) made by the strategy hooks.

Under a `tfs.hybrid.HybridStrategy`, `create_sharded_variable` and the
layers make `ServedTable`s, `create_dynamic_table` `ServedDynamicTable`s,
and `tfs.fit` runs its replica loop.
"""

from __future__ import annotations

from tf_sharded.hybrid.dynamic import create as create_served_dynamic
from tf_sharded.hybrid.strategy import HybridStrategy
from tf_sharded.hybrid.table import ServedTable
from tf_sharded.strategy import FitLoop, StrategyFamily, register
from tf_sharded.strategy.common import refuse_mirrored_arguments


def create(strategy, config, variable_factory=None):
    refuse_mirrored_arguments(config, "HybridStrategy")
    return ServedTable(config, strategy, strategy.servers, variable_factory=variable_factory)


FAMILY = register(
    StrategyFamily(
        name="hybrid",
        create=create,
        fit_loop=lambda strategy, steps_per_execution: FitLoop.REPLICAS,
        create_dynamic=create_served_dynamic,
    ),
    HybridStrategy,
)
