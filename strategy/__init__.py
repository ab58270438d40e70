"""The strategy registry: every per-strategy question is answered by the family registered for the strategy type.

Each strategy family lives in its own module (`default`, `mirrored`,
`parameter_server`) and registers one `StrategyFamily`: its
`create_sharded_variable` hook and its traits (how gradients cross replicas,
how `tfs.fit` runs a step, how steps are counted). Lookup walks the
strategy's MRO, so subclasses of a supported strategy are served by its
family. This module holds the registry only; `import tf_sharded` imports the
family modules, which register themselves.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Dict, Optional

from tf_sharded.errors import UnsupportedStrategyError


class Transport(str, enum.Enum):
    """How a mirrored table's sparse gradients meet across replicas."""

    NONE = "none"  # one replica, or the shard that owns the row applies it (parameter servers)
    IN_PROCESS = "in_process"  # replicas are devices of this process and meet in a merge_call
    COLLECTIVE = "collective"  # TensorFlow's collectives (across workers)


class FitLoop(str, enum.Enum):
    """How `tfs.fit` runs training steps."""

    KERAS = "keras"  # Keras's own model.fit
    COORDINATOR = "coordinator"  # tfs.fit's loop, steps scheduled on workers by a ClusterCoordinator
    REPLICAS = "replicas"  # tfs.fit's loop, strategy.run on a distributed dataset


@dataclasses.dataclass(frozen=True)
class StrategyFamily:
    """A strategy family's hook and traits.

    Attributes:
      name: shown in messages.
      create: `create(strategy, config, variable_factory)` -> a table, where
        `config` is a validated `tf_sharded.config.TableConfig`.
      mirrors_tables: tables are mirrored and their gradients exchanged
        (`tfs.exchange`); else the mirrored-only arguments are refused.
      transport: `transport(strategy)` -> `Transport` of the exchange.
      fit_loop: `fit_loop(strategy, steps_per_execution)` -> `FitLoop`.
      asynchronous_steps: workers apply steps without synchronising, so
        `tfs.fit` counts steps with its own atomic counter.
      dataset_function: training input is given as a function of an
        `InputContext` that each worker calls to build its own dataset.
      dynamic_devices: `dynamic_devices(strategy, num_shards or None)` -> the
        device of each shard of a dynamic table (None: the current device);
        None when the family has no dynamic tables yet.
      sharded_dynamic: `sharded_dynamic(strategy, name)` -> `(device of each
        shard, whether each is another worker's)` of a dynamic table with
        `placement="sharded"`; None: the family cannot shard one so.
      create_dynamic: `create_dynamic(strategy, name, dim, key_dtype,
        initializer, partitions, seed, admission, eviction, **options)` -> a
        dynamic table whose shards the family keeps itself (on table
        servers); None: `dynamic_devices` places a `DynamicTable`'s shards.
      create_group: `create_group(strategy, configs, name, variable_factory)`
        -> tables of one dtype and row shape stored together (table-batched
        storage, `tf_sharded.table.batched`); None: each table has its own
        variables.
    """

    name: str
    create: Callable[..., Any]
    mirrors_tables: bool = False
    transport: Callable[[Any], Transport] = lambda strategy: Transport.NONE
    fit_loop: Callable[[Any, int], FitLoop] = lambda strategy, steps_per_execution: FitLoop.KERAS
    asynchronous_steps: bool = False
    dataset_function: bool = False
    dynamic_devices: Optional[Callable[[Any, Optional[int]], list]] = None
    create_group: Optional[Callable[..., list]] = None
    sharded_dynamic: Optional[Callable[[Any, str], tuple]] = None
    create_dynamic: Optional[Callable[..., Any]] = None


_FAMILIES: Dict[type, StrategyFamily] = {}


def register(family: StrategyFamily, *strategy_types: type) -> StrategyFamily:
    """Registers `family` for `strategy_types` (and their subclasses)."""
    for t in strategy_types:
        _FAMILIES[t] = family
    return family


def supported_strategies() -> list:
    """Names of the strategy types that have a family."""
    return sorted({t.__name__ for t in _FAMILIES})


def registered_families() -> Dict[type, StrategyFamily]:
    """Every registered strategy type and its family."""
    return dict(_FAMILIES)


def find_family(strategy) -> Optional[StrategyFamily]:
    """The family serving `strategy`, or None."""
    for t in type(strategy).__mro__:
        if t in _FAMILIES:
            return _FAMILIES[t]
    return None


def family_of(strategy) -> StrategyFamily:
    """The family serving `strategy`, or `tfs.UnsupportedStrategyError`."""
    family = find_family(strategy)
    if family is None:
        raise UnsupportedStrategyError(strategy, supported_strategies())
    return family


def transport_of(strategy) -> Transport:
    """How gradients of mirrored tables cross the replicas of `strategy` (NONE for unsupported strategies)."""
    family = find_family(strategy)
    return family.transport(strategy) if family is not None else Transport.NONE
