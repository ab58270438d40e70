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
registered for the pair (`lookup_route`); weight files, checkpoint checks,
export and recovery call the kind's stages (`Kind`); the planner and the
mirrored strategy ask a placement what each replica and worker holds
(`PlacementType`), and a table config's kind is the one registered for its
`vocabulary` (`kind_of_config`).

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
    """How a table's rows are keyed and stored, and so how its tables are saved, restored and exported.

    The facts are fields; the stages that differ between kinds are methods, whose versions here are those of a
    table that is one full-shape array of rows. A kind that stores its rows otherwise subclasses it (dynamic
    tables do: their keys and rows are saved apart).

    Attributes:
      name: the registry's key ("fixed", "dynamic").
      static_rows: whether rows are `[0, n)`, all created with the table (a dynamic table's rows come and go with
        its keys, and its shape has no row count): such a table is sized and laid out by its row count, any id
        outside `[0, n)` (a negative one) is padding, and its layout is recorded beside checkpoints.
      vocabulary: the `vocabulary` of the table configs that make tables of this kind (`tf_sharded.config`).
      noun: what a table of this kind is called in messages.
      deltas: whether an export can be brought up to date with the rows changed since a step
        (`tfs.export_delta`).
    """

    name: str
    static_rows: bool
    vocabulary: Optional[str] = None
    noun: str = "table"
    deltas: bool = False

    def save_weights(self, table, store, key: str) -> None:
        """Writes `table` into a Keras weight file's `store` as entry `key`."""
        store[key] = table.numpy()

    def load_weights(self, table, store, key: str, layer: str) -> None:
        """Assigns what `save_weights` wrote as `key` to `table` (errors name `layer`), after checking its shape."""
        if key not in store:
            raise ValueError(
                f"Layer '{layer}': the saved file has no '{key}' entry. Received keys: {list(store.keys())}"
            )
        value = store[key]
        shape = list(value.shape)
        if shape != table.shape.as_list():
            raise ValueError(
                f"Layer '{layer}': saved '{key}' has shape {shape}, the layer's table has shape "
                f"{table.shape.as_list()}. Received a file saved from another model configuration."
            )
        table.assign(value[...])

    def checkpoint_difference(self, table, key: str, shapes: dict, dtypes: dict) -> Optional[Tuple[str, str]]:
        """None where `table` is one entry `key` of a checkpoint, compared as a variable is; else `(prefix, what
        differs)`: the prefix of the checkpoint keys that hold it, and what keeps the checkpoint's from
        restoring into it ("" where nothing does). `shapes` and `dtypes`: the checkpoint reader's maps."""
        return None

    def exported(self, table) -> Any:
        """What serves `table` in a `tfs.export` SavedModel; None: its rows, read once into a variable."""
        return None

    def reset_lost(self, table) -> int:
        """Sets what `table` keeps besides variables to an empty table's state where its task was lost (a
        restore refills it); returns how many variables it set. Variables alone a restore renews: none."""
        return 0

    def shard_rows(self, table) -> List[int]:
        """The rows each shard of `table` holds now, read from where they live: a fixed table's are its layout's."""
        layout = getattr(table, "layout", None)
        return [int(n) for n in layout.shard_sizes] if layout is not None else [int(table.shape[0])]

    def shard_lookups(self, table) -> Optional[Any]:
        """The distinct ids each shard of `table` served in training lookups so far (int64 `[shards]`), counted
        by this process's steps (`table.tally`) or, for a table on table servers, by its servers for every
        worker; None for a kind that counts its lookups in `shard_events`."""
        from tf_sharded.table.tally import shard_counts

        counted = getattr(table, "shard_lookups", None)  # a table whose shards count their own (on table servers)
        return counted() if counted is not None else shard_counts(table)

    def shard_events(self, table) -> Optional[Any]:
        """Each shard's counters of what training lookups did (`[shards, 5]` int64: ids looked up, ids whose
        key was present, keys admitted, rejected, evicted), totals read from where the shards live; None for
        a kind that keeps none (fixed rows: every id has its row)."""
        return None


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
      option: the `placement=` argument that asks for it under mirrored strategies (`tfs.Placement`), None for
        none.
      per_replica: what each replica's device holds: "copy" (the whole table), "shard" (its share of the
        rows) or None (nothing: the rows are elsewhere).
      exchanged: whether the replicas' gradients are summed by the table's `tfs.exchange.ExchangePolicy` (a
        copy per replica or per host) rather than on each row's owner or nowhere.
    """

    def __init__(
        self,
        name: str,
        description: str,
        single_copy: bool = False,
        trained_remotely: bool = False,
        option: Optional[str] = None,
        per_replica: Optional[str] = None,
        exchanged: bool = False,
    ):
        if per_replica not in (None, "copy", "shard"):
            raise ValueError(f"Argument `per_replica` must be None, 'copy' or 'shard'. Received: {per_replica!r}")
        self.name, self.description = name, description
        self.single_copy, self.trained_remotely = single_copy, trained_remotely
        self.option, self.per_replica, self.exchanged = option, per_replica, exchanged

    def replica_bytes(self, nbytes: float, replicas: int) -> float:
        """Bytes of a table of `nbytes` that one replica's device holds, the table split over `replicas`."""
        if self.per_replica == "copy":
            return nbytes
        return nbytes / max(1, replicas) if self.per_replica == "shard" else 0.0

    def copies_per_worker(self, local_replicas: int, replicas: int) -> float:
        """Copies of a table that one worker with `local_replicas` holds, the table split over `replicas` (a
        shard is that share of one copy); one where its replicas hold none (a copy on the host)."""
        if self.per_replica == "copy":
            return local_replicas
        return local_replicas / max(1, replicas) if self.per_replica == "shard" else 1

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
DEVICE = register_placement(
    PlacementType("device", "a copy on each replica's device", option="device", per_replica="copy", exchanged=True)
)
HOST = register_placement(
    PlacementType("host", "one copy on the worker's host", single_copy=True, option="host", exchanged=True)
)
REPLICAS = register_placement(
    PlacementType("replicas", "split over the replicas of one process", single_copy=True, option="sharded",
                  per_replica="shard")
)  # fmt: skip
WORKERS = register_placement(
    PlacementType("workers", "split over the workers", single_copy=True, option="sharded", per_replica="shard")
)

_BY_OPTION = {None: LOCAL, "device": DEVICE, "host": HOST, "sharded": REPLICAS}


def placement_of_option(option: Optional[str], over_workers: bool) -> PlacementType:
    """The placement of a table made with the `placement=` option `option` (None: the strategy's default), its
    shards held by several workers or not."""
    return WORKERS if over_workers else _BY_OPTION[None if option is None else str(option)]


def chosen_placement(option: Optional[str]) -> Optional[PlacementType]:
    """The placement a mirrored table's `placement=` option asks for within one process; None where it leaves
    the choice to the strategy or a plan (None, "auto")."""
    return None if option is None or str(option) == "auto" else _BY_OPTION[str(option)]


def kind_of_config(config: Any) -> Kind:
    """The kind of the tables a table config (`tf_sharded.config`) makes, by its `vocabulary`."""
    vocabulary = str(config.vocabulary)
    for registered in _KINDS.values():
        if registered.vocabulary == vocabulary:
            return registered
    raise ValueError(f"No table kind is registered for {vocabulary!r} tables (config '{config.name}')")
