"""Planning: per-table decisions (`tfs.plan`) from the tables, the strategy and a sample of ids.

Modules: `planner` (`plan`, `ids_from_batches`, the cost constants) and
`plans` (what it returns: `Topology`, `TablePlan`, `Plan`). The package is
`planning`, not `plan`, so that `tfs.plan` stays the function.
"""

from tf_sharded.planning.planner import plan
from tf_sharded.planning.plans import Plan, TablePlan, Topology

__all__ = ["Plan", "TablePlan", "Topology", "plan"]
