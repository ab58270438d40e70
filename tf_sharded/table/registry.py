"""Table kinds and placements: the two registered axes of every table.

A table's **kind** says how its rows are keyed and stored (fixed rows
`[0, n)`, dynamic raw keys); its **placement** says where the rows live and
how ids and rows travel (this process's devices, one copy per host, split
over the replicas, split over the workers, on table servers). Both are
objects registered here, by the package that defines them, and every table
names its own: `table.kind` and `table.placement_type`. Every table class
derives from `TableClass`, on which TensorFlow's embedding ops dispatch. Code that handles
tables asks them, or the registry, instead of testing a table's class: a
lookup, for one, groups its tables by (placement, kind) and calls the route
registered for the pair (`lookup_route`).

A new kind or placement is a package of its own that registers it and its
routes here when it is imported.

>>> from tf_sharded.table import registry
>>> {"dynamic", "fixed"} <= {k.name for k in registry.kinds()}
True
>>> {"device", "host", "local", "replicas", "servers", "workers"} <= {p.name for p in registry.placements()}
True
>>> registry.kind("fixed").static_rows
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from tf_sharded import _compat

# A lookup route: `route(pairs, max_norm, training) -> rows`, one rows tensor per `(table, flat int64 ids)`
# pair, in order; every pair's table has the route's placement and kind.
Route = Callable[[List[Tuple[Any, Any]], Optional[float], bool], list]


@dataclasses.dataclass(frozen=True)
class Kind:
    """How a table's rows are keyed and stored.

    Attributes:
      name: the registry's key ("fixed", "dynamic").
      static_rows: whether rows are `[0, n)`, all created with the table (a dynamic table's rows come and go with
        its keys, and its shape has no row count).
    """

    name: str
    static_rows: bool


class PlacementType:
    """Where a table's rows live and how ids, rows and gradients travel to them.

    A placement that needs more than these facts subclasses it (the table servers' placement does: their
    optimizer runs on the servers).

    Args:
      name: the registry's key ("local", "device", "host", "replicas", "workers", "servers").
      description: one phrase, for messages and plans.
      single_copy: whether each shard is one plain variable that an optimizer updates once, on its device
        (one copy per host; split over replicas or workers), rather than a copy per replica.
      trained_remotely: whether the rows are updated where they live, from each worker's own gradients: those are
        then neither summed over the replicas nor applied by Keras, and the optimizer hands them over in
        `after_update`.
    """

    def __init__(self, name: str, description: str, single_copy: bool = False, trained_remotely: bool = False):
        self.name, self.description = name, description
        self.single_copy, self.trained_remotely = single_copy, trained_remotely

    def attach_optimizer(self, optimizer, table) -> None:
        """`optimizer` was built to train `table` (where the rows are trained remotely: it tells them how)."""

    def after_update(self, optimizer, tables) -> None:
        """`optimizer` applied a step's gradients, those of `tables` (of this placement) excepted when trained
        remotely: it hands them over here."""

    def __repr__(self):
        return f"PlacementType({self.name!r}: {self.description})"


_KINDS: Dict[str, Kind] = {}
_PLACEMENTS: Dict[str, PlacementType] = {}
# (placement name or None for any, kind name) -> route.
_ROUTES: Dict[Tuple[Optional[str], str], Route] = {}


def _register(registry: dict, item, what: str):
    existing = registry.get(item.name)
    if existing is not None and existing != item:
        raise ValueError(f"A {what} named '{item.name}' is registered already: {existing}")
    registry[item.name] = item
    return item


def register_kind(kind: Kind) -> Kind:
    """Registers `kind` (again: a no-op) and returns it."""
    return _register(_KINDS, kind, "table kind")


def register_placement(placement: PlacementType) -> PlacementType:
    """Registers `placement` (again: a no-op) and returns it."""
    return _register(_PLACEMENTS, placement, "placement")


def kind(name: str) -> Kind:
    """The registered kind `name`."""
    if name not in _KINDS:
        raise ValueError(f"Unknown table kind {name!r}; registered: {sorted(_KINDS)}")
    return _KINDS[name]


def placement(name: str) -> PlacementType:
    """The registered placement `name`."""
    if name not in _PLACEMENTS:
        raise ValueError(f"Unknown placement {name!r}; registered: {sorted(_PLACEMENTS)}")
    return _PLACEMENTS[name]


def kinds() -> Iterable[Kind]:
    return tuple(_KINDS.values())


def placements() -> Iterable[PlacementType]:
    return tuple(_PLACEMENTS.values())


class TableClass:
    """Base of every table class, whatever its kind and placement: `tf.nn.embedding_lookup` and TF's other
    embedding ops dispatch on it (`table.entry_points`), and `is_any_table` recognises it.

    A subclass sets `kind` (a registered `Kind`) and has a `placement_type` (a registered `PlacementType`).
    """

    kind: Kind


# TF's dispatcher skips plain classes it was not told of; subclasses inherit the mark.
_compat.register_dispatchable_type(TableClass)


def placement_of(table: Any) -> Optional[PlacementType]:
    """`table`'s placement, None for anything that is not a table (a shard's owner may be a group of tables
    sharing storage: theirs)."""
    return getattr(table, "placement_type", None)


def is_any_table(obj: Any) -> bool:
    """Whether `obj` is a table, of any kind and placement."""
    return isinstance(obj, TableClass)


def register_lookup(placement: Optional[PlacementType], kind: Kind, route: Route) -> Route:
    """Registers `route` as the lookup of tables of `kind` with `placement` (None: with any placement that has no
    route of its own for `kind`)."""
    _ROUTES[(None if placement is None else placement.name, kind.name)] = route
    return route


def lookup_route(placement: PlacementType, kind: Kind) -> Route:
    """The route that looks up tables of `kind` with `placement`."""
    route = _ROUTES.get((placement.name, kind.name)) or _ROUTES.get((None, kind.name))
    if route is None:
        raise NotImplementedError(f"No lookup is registered for {kind.name} tables placed {placement.description}")
    return route


# The placements of the tables every strategy makes (their lookups are registered by the modules that do them).
LOCAL = register_placement(PlacementType("local", "on this process's devices (default and parameter servers)"))
DEVICE = register_placement(PlacementType("device", "a copy on each replica's device"))
HOST = register_placement(PlacementType("host", "one copy on the worker's host", single_copy=True))
REPLICAS = register_placement(PlacementType("replicas", "split over the replicas of one process", single_copy=True))
WORKERS = register_placement(PlacementType("workers", "split over the workers", single_copy=True))

_BY_OPTION = {None: LOCAL, "device": DEVICE, "host": HOST, "sharded": REPLICAS}


def placement_of_option(option: Optional[str], over_workers: bool) -> PlacementType:
    """The placement of a table made with the `placement=` option `option` (None: the strategy's default), its
    shards held by several workers or not."""
    return WORKERS if over_workers else _BY_OPTION[option]
