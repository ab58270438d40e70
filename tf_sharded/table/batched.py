"""Table-batched storage: the shards of several tables held in one variable per device.

Tables of one dtype and row shape that an `EmbeddingCollection` creates
together under parameter servers (or sharded over a mirrored strategy's
replicas) are stored as one *storage table*: one variable per parameter
server (or replica), holding every shard of those tables that lives there,
one after another (TorchRec's table-batched layout). Each
table is still a `ShardedVariable` with its own layout, whose shards are
`RowSegment`s of the storage variables, so its logical view is unchanged:
one full-shape checkpoint key restoring across layouts, `read_value()`,
`assign()`, weight files and export. What changes is the step: a lookup of
all the tables gathers once per storage variable (`lookup._lookup_group`),
their gradient is one `IndexedSlices` per storage variable, and the
optimizer updates it and its slots once per parameter server.

The storage table is what Keras trains (its variables are the layer's
weights) and what the optimizer builds slots for; the optimizer checkpoints
those slots as one view per member table (`slot_views`), under the names an
unbatched optimizer gives them.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_sharded import initializers
from tf_sharded.config import DynamicTableConfig, TableConfig
from tf_sharded.layout import PartitionSpec
from tf_sharded.table.builder import ShardPlacement, build_sharded_variable, draw_seed
from tf_sharded.table.segment import RowSegment
from tf_sharded.table.sharded_variable import ShardedVariable

# storage table -> ((member table, ((storage shard, row offset) per member shard)), ...)
_MEMBERS = weakref.WeakKeyDictionary()
# member table -> its storage table (held while the member lives: the optimizer finds the storage by its variables)
_STORAGE = weakref.WeakKeyDictionary()


def members_of(table) -> Optional[tuple]:
    """The member tables of a storage table, in creation order; None for any other table."""
    entry = _MEMBERS.get(table) if isinstance(table, ShardedVariable) else None
    return None if entry is None else tuple(member for member, _ in entry)


def logical_tables(table) -> list:
    """The tables a user sees for `table`: a storage table's members (or those of dynamic tables sharing row
    pools, `dynamic.group.PooledTables`), else `table` itself."""
    members = members_of(table) if isinstance(table, ShardedVariable) else getattr(table, "members", None)
    return [table] if members is None else list(members)


def rows_per_member(table, shard: int, rows: tf.Tensor) -> List[tuple]:
    """`(member table, int64 count of rows)` of `rows` (local rows of shard `shard` of `table`) per table whose
    rows they are: a storage table's members holding a segment of that shard, else `table` itself."""
    entry = _MEMBERS.get(table) if isinstance(table, ShardedVariable) else None
    if entry is None:
        return [(table, tf.size(rows, out_type=tf.int64))]
    here = [(offset, member) for member, placed in entry for j, offset in placed if j == shard]
    here.sort(key=lambda e: e[0])
    if len(here) == 1:
        return [(here[0][1], tf.size(rows, out_type=tf.int64))]
    starts = tf.constant([offset for offset, _ in here[1:]], tf.int64)
    which = tf.searchsorted(starts, tf.cast(rows, tf.int64), side="right", out_type=tf.int32)
    counts = tf.math.bincount(which, minlength=len(here), maxlength=len(here), dtype=tf.int64)
    return [(member, counts[k]) for k, (_, member) in enumerate(here)]


def storage_of(table) -> Optional[ShardedVariable]:
    """The storage table holding `table`'s rows, or None for a table with its own variables."""
    return _STORAGE.get(table) if isinstance(table, ShardedVariable) else None


def pool_key(config) -> Optional[tuple]:
    """What dynamic table configs must share to be pooled (row width, shard count and key dtype: a step
    sends each device one tensor of keys per pool), or None for a config that keeps its own pools (a
    `max_rows` bound, which counts a pool's rows). A capacity eviction counts each member's live keys in its
    own index, so bounded tables share pools too."""
    if config.max_rows is not None:
        return None
    return ("dynamic", config.dim, config.partitions, config.key_dtype)


class _StackedInitializer:
    """A storage shard's initial rows: each segment's rows from its table's own initializer (so every table
    starts exactly as it would with its own variables), written at the segment's offset."""

    def __init__(self, parts: List[List[tuple]]):
        self._parts = parts  # per storage shard: (initializer, layout, shard, full shape, offset) per segment

    def chunks(self, layout, shard: int, full_shape, dtype, chunk_rows: int) -> List[initializers.RowChunk]:
        out = []
        for init, member_layout, member_shard, member_shape, offset in self._parts[shard]:
            for chunk in init.chunks(member_layout, member_shard, member_shape, dtype, chunk_rows):
                out.append(initializers.RowChunk(False, lambda c=chunk, o=offset: _shifted(c, o)))
        return out


def _shifted(chunk, offset: int):
    rows, values = chunk.compute()
    return rows + offset, values


def build_batched(
    name: str,
    configs: Sequence[TableConfig],
    specs: Sequence[PartitionSpec],
    shard_devices: Sequence[Sequence[int]],
    device_names: Sequence[str],
    strategy,
    placement_scope,
    variable_factory=None,
    mirrored_placement: Optional[str] = None,
    remote_device=None,
) -> List[ShardedVariable]:
    """Creates `configs`' tables in one storage table; returns the member tables, in order.

    `shard_devices[m][i]` is the index (into `device_names`) of the device holding shard `i` of table `m`;
    the storage has one variable per device, created under `placement_scope(index)` by `variable_factory`
    (as a table's shards are). Every table must have `configs[0]`'s dtype and row shape. `mirrored_placement`
    is recorded on the storage and its members (a mirrored strategy's tables sharded over the replicas).
    `remote_device(index)`: the device of another worker that holds that device's storage, which this process
    then does not create (None: every device is this process's).
    """
    inner, dtype = list(configs[0].shape[1:]), configs[0].dtype
    layouts = [spec.bind(config.shape[0]) for config, spec in zip(configs, specs)]
    parts: List[List[tuple]] = [[] for _ in device_names]
    used = [0] * len(device_names)
    segments: List[List[Tuple[int, int]]] = []
    for config, layout, devices in zip(configs, layouts, shard_devices):
        if list(config.shape[1:]) != inner or config.dtype != dtype:
            raise ValueError(f"Table '{config.name}' does not share the row shape and dtype of '{configs[0].name}'")
        seed = config.seed if config.seed is not None else draw_seed()
        init = initializers.resolve(config.initializer, list(config.shape), dtype, seed)
        mine = []
        for i, d in enumerate(devices):
            parts[d].append((init, layout, i, list(config.shape), used[d]))
            mine.append((d, used[d]))
            used[d] += layout.shard_sizes[i]
        segments.append(mine)
    holding = [d for d in range(len(device_names)) if used[d]]
    stacked = _StackedInitializer([parts[d] for d in holding])
    storage_config = TableConfig(
        name=name, shape=[sum(used)] + inner, dtype=dtype, initializer=stacked, trainable=configs[0].trainable, seed=0
    )
    spec = PartitionSpec(len(holding), splits=[used[d] for d in holding])
    remote = (lambda j: remote_device(holding[j])) if remote_device is not None else None
    placement = ShardPlacement(
        [device_names[d] for d in holding], scope=lambda j: placement_scope(holding[j]), remote=remote
    )
    storage = build_sharded_variable(
        storage_config,
        spec,
        strategy,
        placement,
        variable_factory=variable_factory,
        mirrored_placement=mirrored_placement,
    )
    position = {d: j for j, d in enumerate(holding)}
    members, entry = [], []
    for config, layout, mine in zip(configs, layouts, segments):
        placed = tuple((position[d], offset) for d, offset in mine)
        member = _view(storage, placed, layout, config.name, config.shape, strategy)
        _STORAGE[member] = storage
        members.append(member)
        entry.append((member, placed))
    _MEMBERS[storage] = tuple(entry)
    return members


def _view(storage: ShardedVariable, placed, layout, name: str, shape, strategy) -> ShardedVariable:
    shards = [RowSegment(storage.variables[j], offset, layout.shard_sizes[i]) for i, (j, offset) in enumerate(placed)]
    return ShardedVariable(shards, layout, name, shape, storage.dtype, strategy, placement=storage.placement)


def slot_views(storage: ShardedVariable, slot: ShardedVariable, slot_name: str) -> List[ShardedVariable]:
    """One view of `slot` (a slot table of `storage`, with its layout) per member table, named
    `<member>/<slot_name>`: what the optimizer checkpoints, as it would each member's own slot."""
    views = []
    for member, placed in _MEMBERS[storage]:
        views.append(_view(slot, placed, member.layout, f"{member.name}/{slot_name}", member.shape, member.strategy))
    return views


def batch_key(config) -> tuple:
    """What tables must share to be stored together: dtype and row shape."""
    return (tf.as_dtype(config.dtype).name, tuple(config.shape[1:]))


def storage_runs(configs: dict, batch: bool = True) -> list:
    """The names of `configs` ({name: table config}) in order, cut into runs of consecutive static tables of one
    dtype and row shape, or dynamic tables that can share row pools (`pool_key`): each run can
    share one storage. Only consecutive tables, so that an optimizer numbers
    their slots in table order, as it does unbatched. `batch=False`: every table alone."""
    runs, last = [], None
    for name, config in configs.items():
        dynamic = isinstance(config, DynamicTableConfig)
        key = None if not batch else pool_key(config) if dynamic else batch_key(config)
        if key is not None and key == last:
            runs[-1].append(name)
        else:
            runs.append([name])
        last = key
    return runs
