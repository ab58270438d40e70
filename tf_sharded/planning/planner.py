"""`tfs.plan`: an explainable per-table placement plan from the tables, the strategy and a sample of ids.

For each table the plan decides what its strategy leaves open and says why,
with the cost model's estimate of the table's part of a training step:

* parameter servers: the shards (a small table whole on one ps, a large
  or hot one a shard per ps), the partition scheme (hot rows spread with "mod"
  where the sample shows "div" would send them to one shard), which tables
  share one storage variable per ps (table-batched storage), and each ps's
  memory;
* mirrored strategies: where the table lives (`placement`: a copy per
  replica device where the memory holds them, unless the sample's traffic
  makes a shard per replica cheaper (`tfs.exchange.cost.placement_costs`);
  split over the replicas where only a shard per replica fits
  (`memory_per_replica`); else one on the host) and the gradient exchange (all-gather or densified), fixed from the
  sample's distinct ids per replica (`ids_per_step`) instead of decided
  every step;
* the default strategy: one local table; nothing to decide.

The constants below come from the benchmark suite, on this project's 2-core
machine: `python -m tf_sharded bench plan` measures the options the plan
chooses between at its points, fits these constants from the same run and
reports whether the plan picked the faster option at each point (docs/benchmarks.md,
B11). The exchange's own constants are `tfs.exchange`'s (B2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tf_sharded.config import BaseTableConfig
from tf_sharded.exchange.cost import choose, cost_bytes, placement_costs
from tf_sharded.planning.plans import MIRRORED, MULTI, PS, Plan, TablePlan, Topology
from tf_sharded.table import registry
from tf_sharded.table.batched import storage_runs

# Fitted by B11 (`bench plan`, a cluster of 2 ps + 1 worker; docs/benchmarks.md; they vary by ~30% between runs
# here), per step:
# a scheduled step that touches every ps, whatever it does there (the dispatch floor);
PS_DISPATCH_MS = 3.5
# per variable a ps gathers from and scatters to (unbatched minus batched step, per variable);
PS_VARIABLE_MS = 0.18
# per id looked up: de-duplication, routing, the rows out and the gradients back (the rest of the step).
PS_ID_US = 0.35
# A table stays whole on one ps (table-wise) while neither its bytes nor its lookups exceed this share of
# one ps's even part (1 / num_ps of all tables'): placed round-robin, such tables leave the ps within
# about this share of each other. B11 measures table-wise against row-wise for small tables (docs/benchmarks.md, B11):
# a table's rows then travel in one piece instead of one per ps.
TABLE_WISE_SHARE = 0.5
# ... and while, placed so, they leave every ps within this factor of the mean bytes and lookups; past it the
# largest whole table is split over the ps.
BALANCE = 1.1
# Row-wise tables spread hot rows with "mod" where "div" would send this many times the even share of
# the sample's lookups to one shard (vocabularies sorted by frequency).
SKEW_LIMIT = 1.5
# Fitted by B11's mirrored points: bytes-equivalent of the exchange's cost model (`tfs.exchange`, whose
# constants come from B2) per millisecond of step above a lookup-only step.
EXCHANGE_BYTES_PER_MS = 4.0e5
# Fitted by B12 (`bench sharded`, 2 workers, 2 to 26 tables): what a step of tables sharded across workers
# waits beyond the copies' exchange for the rendezvous its lookup puts between the forward pass and the rest
# (the all-to-all's chunk agreement, ids out, rows back), once per group of tables of one width.
SHARDED_RENDEZVOUS_MS = 3.0
# Slots assumed per table for memory (Adagrad's accumulator; Adam has 2).
DEFAULT_SLOTS = 1


def _as_configs(tables) -> dict:
    configs = getattr(tables, "table_configs", None)
    if configs is not None:
        return dict(configs)
    if not isinstance(tables, dict) or not tables:
        raise ValueError(
            "Argument `tables` must be a non-empty dict of table configs (as EmbeddingCollection takes) or an "
            f"EmbeddingCollection. Received: {tables!r}"
        )
    return {name: BaseTableConfig.from_layer_config(name, config) for name, config in tables.items()}


def _features_of(tables, configs: dict) -> dict:
    """{feature: table name} of the static tables (a dynamic table's keys are not ids): the collection's features,
    else each table read by a feature of its name."""
    features = getattr(tables, "feature_configs", None)
    pairs = {f: spec.table for f, spec in features.items()} if features is not None else {n: n for n in configs}
    return {f: t for f, t in pairs.items() if _static(configs[t])}


def ids_from_batches(batches, features: dict) -> dict:
    """{table: [the ids of every feature reading it, per batch]} from batches of {feature: ids} (or (features,
    labels)), `features` being {feature: table name}: `tfs.plan`'s `ids` from a data sample."""
    sample: dict = {}
    for batch in batches:
        if isinstance(batch, tuple):
            batch = batch[0]
        if not isinstance(batch, dict):
            raise TypeError(
                "Argument `ids` as a data sample must yield dicts {feature: ids} or (features, labels). "
                f"Received a batch of type {type(batch).__name__}"
            )
        step: dict = {}
        for feature, table in features.items():
            if feature not in batch:
                continue
            values = batch[feature]
            if isinstance(values, (tf.RaggedTensor, tf.SparseTensor)):
                values = values.values
            values = np.asarray(values).reshape(-1)
            step.setdefault(table, []).append(
                values[values >= 0] if np.issubdtype(values.dtype, np.integer) else values
            )
        for table, parts in step.items():
            sample.setdefault(table, []).append(np.concatenate(parts))
    return sample


def _sample_statistics(name: str, sample, replicas: int, rows: Optional[int]):
    """(mean ids per step, largest distinct ids of one replica in a step, per-id counts) of one table's sample:
    a 1-D batch of ids, a list of batches (or a 2-D array, one row per step), or a dict of statistics."""
    if isinstance(sample, dict):
        unknown = sorted(set(sample) - {"ids_per_step", "distinct_per_step"})
        if unknown or "ids_per_step" not in sample:
            raise ValueError(
                f"Argument `ids['{name}']` as statistics needs 'ids_per_step' and optionally "
                f"'distinct_per_step'. Received: {sample!r}"
            )
        per_step = float(sample["ids_per_step"])
        distinct = float(sample.get("distinct_per_step", per_step / max(replicas, 1)))
        return per_step, distinct, None
    if isinstance(sample, (tf.RaggedTensor, tf.SparseTensor)):
        sample = [sample.values.numpy()]
    elif isinstance(sample, (list, tuple)) and sample and not np.isscalar(sample[0]):
        sample = [np.asarray(s.values if isinstance(s, (tf.RaggedTensor, tf.SparseTensor)) else s) for s in sample]
    else:
        array = np.asarray(sample)
        sample = [array] if array.ndim <= 1 else list(array)
    steps = [np.asarray(s).reshape(-1) for s in sample]
    if not steps or not all(s.size for s in steps):
        raise ValueError(f"Argument `ids['{name}']` must hold at least one id per step. Received: {len(steps)} steps")
    if any(not np.issubdtype(s.dtype, np.integer) for s in steps):
        raise TypeError(f"Argument `ids['{name}']` must hold integer ids. Received: dtype {steps[0].dtype}")
    flat = np.concatenate(steps)
    if rows is not None and (flat.min() < 0 or flat.max() >= rows):
        raise ValueError(
            f"Argument `ids['{name}']` must hold ids in [0, {rows}). Received: ids from {flat.min()} to {flat.max()}"
        )
    distinct = max(len(np.unique(part)) for s in steps for part in np.array_split(s, max(replicas, 1)) if part.size)
    return float(np.mean([s.size for s in steps])), float(distinct), flat


def _busiest_share(flat: Optional[np.ndarray], rows: int, shards: int, scheme: str) -> float:
    """The busiest shard's share of the sample's lookups, over the even share (1.0: perfectly even)."""
    if flat is None or shards < 2:
        return 1.0
    shard = flat % shards if scheme == "mod" else np.minimum(flat // math.ceil(rows / shards), shards - 1)
    return float(np.bincount(shard, minlength=shards).max() / flat.size * shards)


def plan(
    tables,
    strategy=None,
    ids=None,
    slots: int = DEFAULT_SLOTS,
    memory_per_device: Optional[int] = None,
    memory_per_replica: Optional[int] = None,
) -> Plan:
    """An explainable per-table plan for `tables` under `strategy`, from a sample of ids.

    Args:
      tables: the `tables` argument of `tfs.layers.EmbeddingCollection`
        (`{name: {"input_dim": ..., "output_dim": ...}}` or table configs),
        or an `EmbeddingCollection`.
      strategy: a `tf.distribute.Strategy` (default: the current one), or a
        dict `{"kind": "parameter_server" | "mirrored" |
        "multi_worker_mirrored" | "default", "num_ps": int, "replicas": int,
        "workers": int, "devices": "cpu" | "gpu"}` (what the replicas run
        on; default "cpu": logical devices sharing a process's cores).
      ids: `{table name: sample}`, a sample of the ids each table looks up:
        one global batch, a list of batches (one per step) or a 2-D array
        (one row per step); or statistics `{"ids_per_step": n,
        "distinct_per_step": n}` (distinct per replica). Or a data sample:
        a `tf.data.Dataset` or list of global batches, each `{feature:
        ids}` or `(features, labels)`; the collection's features say which
        table each feature reads (with a dict of tables, a feature named
        like a table reads it; other features are ignored; negative ids
        are padding). Tables without a sample are planned from their sizes
        alone.
      slots: optimizer slots per table row, for the memory column.
      memory_per_device: optional bytes a ps (parameter servers) or a
        worker (mirrored: all its replicas' copies) may hold for tables and
        slots: mirrored tables go to the host where their copies would not
        fit; a table or tables that fit nowhere are an error.
      memory_per_replica: optional bytes one replica's device may hold for
        tables and slots (mirrored strategies): in table order, a copy per
        replica while it fits beside the tables before it, else the table
        sharded over the replicas (of every worker) while a shard fits, else
        the host. A table whose config says `placement="device"`
        and whose copy does not fit is an error naming it. With a sample,
        a table whose copy fits is still sharded where the cost model
        estimates its step cheaper so (the module docstring).

    Returns a `Plan`: print it for the table; pass it to
    `EmbeddingCollection(..., plan=plan)` to apply it.

    Settings a table config fixes itself (`partitions`, `scheme`,
    `placement`, `exchange`) are kept, and the plan says so.

    Example:

    >>> import tf_sharded as tfs
    >>> tables = {"user": {"input_dim": 1_000_000, "output_dim": 16}, "country": {"input_dim": 200, "output_dim": 16}}
    >>> hot_first = np.arange(512) % 100  # a vocabulary sorted by frequency: the hot ids are the low ones
    >>> p = tfs.plan(tables, {"kind": "parameter_server", "num_ps": 2}, ids={"user": hot_first})
    >>> p.tables["user"].partitions, p.tables["user"].scheme, p.tables["country"].partitions, p.groups
    (2, 'mod', 1, [['user', 'country']])
    """
    topology = Topology.of(strategy)
    configs = _as_configs(tables)
    if isinstance(ids, (tf.data.Dataset, list, tuple)):
        ids = ids_from_batches(ids, _features_of(tables, configs))
    if ids is not None and not isinstance(ids, dict):
        raise TypeError(
            "Argument `ids` must be a dict {table name: ids}, a tf.data.Dataset or list of batches of "
            f"{{feature: ids}}, or None. Received: {type(ids).__name__}"
        )
    unknown = sorted(set(ids or {}) - set(configs))
    if unknown:
        raise ValueError(f"Argument `ids` names tables that are not in `tables`: {unknown}; tables: {sorted(configs)}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise ValueError(f"Argument `slots` must be a non-negative int. Received: slots={slots!r}")
    for arg, value in (("memory_per_device", memory_per_device), ("memory_per_replica", memory_per_replica)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"Argument `{arg}` must be a positive int (bytes). Received: {value!r}")
    stats = {}
    for name, config in configs.items():
        if ids and name in ids:
            stats[name] = _sample_statistics(name, ids[name], topology.replicas, config.rows)
    planner = {PS: _plan_ps, MIRRORED: _plan_mirrored, MULTI: _plan_mirrored}.get(topology.kind, _plan_default)
    # The storage groups under parameter servers (the collection's runs); else each table alone.
    groups = storage_runs(configs, topology.kind == PS)
    memory = Memory(memory_per_device, memory_per_replica)
    planned, device_mb = planner(configs, stats, topology, slots, memory, groups)
    overhead = 0.0
    if topology.kind == PS:
        overhead = PS_DISPATCH_MS + sum(len(g) > 1 for g in groups) * topology.num_ps * PS_VARIABLE_MS
    return Plan(topology, planned, groups, overhead, device_mb)


@dataclasses.dataclass(frozen=True)
class Memory:
    """The budgets a plan must keep (bytes, None: no limit): a ps or mirrored worker's, one replica's."""

    per_device: Optional[int] = None
    per_replica: Optional[int] = None


def _static(config) -> bool:
    """Whether `config`'s table has rows `[0, n)` (its kind's `static_rows`), which the plan sizes and lays out;
    the shards of any other follow the strategy."""
    return registry.kind_of_config(config).static_rows


def _table_bytes(config) -> int:
    return int(np.prod(config.shape)) * tf.as_dtype(config.dtype).size


def _base(name, config, stats):
    per_step, distinct, _ = stats.get(name, (None, None, None))
    if not _static(config):
        reason = f"{registry.kind_of_config(config).name}: its shards follow the strategy"
        return TablePlan(name, None, config.dim, per_step, distinct, reason=reason)
    return TablePlan(name, config.rows, config.dim, per_step, distinct)


def _plan_default(configs, stats, topology, slots, memory, groups):
    out = {}
    for name, config in configs.items():
        t = _base(name, config, stats)
        if t.rows is not None:
            ms = (t.ids_per_step or 0) * PS_ID_US / 1000
            t = dataclasses.replace(t, estimate_ms=ms, memory_mb=_table_bytes(config) * (1 + slots) / 2**20,
                                    reason=t.reason or "one device: one local table")  # fmt: skip
        out[name] = t
    return out, [sum(t.memory_mb for t in out.values())]


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MB"


def _tasks(parts: Dict[str, int], num_ps: int) -> Dict[str, List[int]]:
    """Each table's shards' ps, placed round-robin in table order as the strategy places them."""
    tasks, placed = {}, 0
    for name, n in parts.items():
        tasks[name] = [(placed + i) % num_ps for i in range(n)]
        placed += n
    return tasks


def _place(parts: Dict[str, int], weights: Dict[str, float], num_ps: int) -> list:
    """Each ps's sum of `weights`, a shard carrying an even part of its table's weight."""
    loads = [0.0] * num_ps
    for name, tasks in _tasks(parts, num_ps).items():
        for task in tasks:
            loads[task] += weights[name] / len(tasks)
    return loads


def _shards(configs, stats, num_ps) -> Dict[str, tuple]:
    """{table: (shards, why)} of the static tables: whole on one ps while small, else a shard per ps; then,
    while whole tables leave a ps over `BALANCE` of the mean bytes or lookups, the largest of them is split."""
    static = {n: c for n, c in configs.items() if _static(c)}
    size = {n: float(_table_bytes(c)) for n, c in static.items()}
    lookups = {n: float(stats[n][0]) if n in stats else 0.0 for n in static}
    share = {n: v / (sum(size.values()) or 1) for n, v in size.items()}
    id_share = {n: v / (sum(lookups.values()) or 1) for n, v in lookups.items()}
    fair = TABLE_WISE_SHARE / num_ps
    out = {}
    for name, config in static.items():
        if config.partitions is not None:
            spec = config.partitions
            out[name] = (spec if isinstance(spec, int) else spec.num_shards, "partitions set by the table config")
        elif num_ps == 1 or (share[name] <= fair and id_share[name] <= fair):
            why = (
                f"whole on one ps: {share[name]:.0%} of the bytes, {id_share[name]:.0%} of the lookups (<= {fair:.0%})"
            )
            out[name] = (1, why)
        else:
            why = f"row-wise: {share[name]:.0%} of the bytes, {id_share[name]:.0%} of the lookups (> {fair:.0%})"
            out[name] = (min(num_ps, config.shape[0]), why)
    while num_ps > 1:
        parts = {n: v[0] for n, v in out.items()}
        worst = max(_imbalance(_place(parts, w, num_ps)) for w in (size, lookups))
        whole = [n for n, (k, _) in out.items() if k == 1 and static[n].partitions is None and static[n].shape[0] > 1]
        if worst <= BALANCE or not whole:
            break
        largest = max(whole, key=lambda n: max(share[n], id_share[n]))
        out[largest] = (
            min(num_ps, static[largest].shape[0]),
            f"row-wise: whole, it left a ps at {worst:.2f}x the mean",
        )
    return out


def _imbalance(loads: list) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def _plan_ps(configs, stats, topology, slots, budgets, groups):
    num_ps, memory = topology.num_ps, budgets.per_device
    group_of = {n: g[0] for g in groups if len(g) > 1 for n in g}
    shards = _shards(configs, stats, num_ps)
    parts = {n: k for n, (k, _) in shards.items()}
    needs = {n: _table_bytes(configs[n]) * (1 + slots) for n in shards}
    loads, tasks_of = _place(parts, needs, num_ps), _tasks(parts, num_ps)
    out = {}
    for name, config in configs.items():
        t = _base(name, config, stats)
        if t.rows is None:
            out[name] = t
            continue
        partitions, why = shards[name]
        tasks = tasks_of[name]
        held = needs[name] / partitions * max(tasks.count(task) for task in tasks)
        if memory is not None and held > memory:
            raise ValueError(
                f"Table '{name}' needs {_mb(held)} on one ps ({_mb(needs[name])} with {slots} slot(s) in "
                f"{partitions} shard(s) over {num_ps} ps); argument `memory_per_device` is {_mb(memory)}. Add "
                "parameter servers or reduce the table."
            )
        scheme = config.scheme
        flat = stats.get(name, (None, None, None))[2]
        if scheme is None and partitions > 1:
            div, mod = (_busiest_share(flat, t.rows, partitions, s) for s in ("div", "mod"))
            scheme = "mod" if div > SKEW_LIMIT * mod else "div"
            if flat is not None:
                why += f"; {scheme}: busiest shard {div:.1f}x its even share of lookups with div, {mod:.1f}x with mod"
        ms = (t.ids_per_step or 0) * PS_ID_US / 1000 + (0 if name in group_of else partitions * PS_VARIABLE_MS)
        out[name] = dataclasses.replace(
            t, partitions=partitions, scheme=scheme if partitions > 1 else None, group=group_of.get(name),
            estimate_ms=ms, memory_mb=held / 2**20, reason=why,
        )  # fmt: skip
    if memory is not None and max(loads) > memory:
        raise ValueError(
            f"The tables need {_mb(max(loads))} on ps {loads.index(max(loads))} with {slots} slot(s) (placed "
            f"round-robin); argument `memory_per_device` is {_mb(memory)}. Add parameter servers or reduce the "
            "tables."
        )
    return out, [load / 2**20 for load in loads]


def _replica_placement(name, config, need, held, replicas, budget):
    """`(placement, why)` of a table from one replica's budget; None where the config fixes a placement that fits.

    `held`: the bytes one replica holds of the tables placed before this one; `replicas`: how many replicas a
    sharded table would be split over (1: it cannot be).
    """
    chosen = registry.chosen_placement(config.placement)
    copy_fits = held + need <= budget
    if chosen is not None and chosen.per_replica == "copy" and not copy_fits:
        raise ValueError(
            f"Table '{name}' with placement='{chosen.option}' needs {_mb(need)} (table and slots) on every replica "
            f"beside {_mb(held)} of the tables before it; argument `memory_per_replica` is {_mb(budget)}. Use "
            "placement='sharded' or 'auto'."
        )
    if chosen is not None:
        return None
    if copy_fits:
        return registry.DEVICE, (
            f"device: a copy of {_mb(need)} beside {_mb(held)} fits memory_per_replica {_mb(budget)}"
        )
    shard = need / replicas
    if replicas > 1 and held + shard <= budget:
        return registry.REPLICAS, (
            f"sharded: a copy of {_mb(need)} beside {_mb(held)} does not fit memory_per_replica {_mb(budget)}; "
            f"a shard of {_mb(shard)} per replica ({replicas}) does"
        )
    where = "a shard per replica" if replicas > 1 else "a copy"
    return registry.HOST, f"host: neither {where} nor a copy fits memory_per_replica {_mb(budget)} beside {_mb(held)}"


def _plan_mirrored(configs, stats, topology, slots, budgets, groups):
    """Each table's placement, as a registered placement (`registry.DEVICE`, `HOST` or `REPLICAS`: the plan
    speaks in `placement=` options, and a table sharded over the workers holds its shards as over the replicas),
    its memory counted as the placement holds it."""
    from tf_sharded.strategy.mirrored import HOST_PLACEMENT_BYTES, resolve_placement

    in_process = topology.kind == MIRRORED
    local_replicas = max(1, topology.replicas // topology.workers)
    # A table is sharded over every replica: those of one process, or every replica of every worker.
    shard_over = topology.replicas
    memory = budgets.per_device
    cores_shared = topology.devices == "cpu"
    chosen = {name: registry.chosen_placement(config.placement) for name, config in configs.items()}
    # Across workers, the tables that may be sharded with a sample share their group's rendezvous (one per width).
    sharing: Dict[tuple, int] = {}
    for name, config in configs.items():
        if name in stats and _static(config) and chosen[name] is None and not in_process:
            sharing[_width(config)] = sharing.get(_width(config), 0) + 1
    out, held = {}, 0.0  # held: the worker's bytes of the tables placed so far
    held_replica = 0.0  # one replica's
    for name, config in configs.items():
        t = _base(name, config, stats)
        if t.rows is None:
            out[name] = t
            continue
        nbytes = _table_bytes(config)
        need = nbytes * (1 + slots)
        by_replica = None
        if budgets.per_replica is not None:
            by_replica = _replica_placement(name, config, need, held_replica, shard_over, budgets.per_replica)
        if chosen[name] is not None:
            placement, why = chosen[name], "placement set by the table config"
        elif by_replica is not None:
            placement, why = by_replica
        elif memory is not None:
            # In table order: a copy per replica while the worker still has room for them, else one on the host.
            fits = held + need * local_replicas <= memory
            placement = registry.DEVICE if fits else registry.HOST
            why = (
                f"{placement.option}: {local_replicas} copies of {_mb(need)} beside {_mb(held)} placed "
                f"{'fit' if fits else 'do not fit'} memory_per_device {_mb(memory)}"
            )
        else:
            placement = registry.chosen_placement(resolve_placement(None, nbytes))
            above = nbytes > HOST_PLACEMENT_BYTES
            why = f"{placement.option}: {_mb(nbytes)} {'>' if above else '<='} {_mb(HOST_PLACEMENT_BYTES)}"
        traffic = None
        if placement.per_replica == "copy" and chosen[name] is None and shard_over > 1 and t.distinct_per_step:
            # A copy per replica, or a shard per replica where the cost model finds the step cheaper so.
            traffic = _placement_ms(t, nbytes // t.rows, topology, slots, in_process, sharing.get(_width(config), 1))
            split = registry.REPLICAS
            if traffic[split.option] < traffic[placement.option]:
                placement, other = split, placement
            else:
                other = split
            why = (
                f"{placement.option}: est. {traffic[placement.option]:.2f} ms a step against "
                f"{traffic[other.option]:.2f} {'copied' if other.per_replica == 'copy' else 'sharded'} at "
                f"{math.ceil(t.distinct_per_step):,} distinct ids per replica"
                + (", the copies' updates sharing this process's cores" if in_process and cores_shared else "")
                + ("; " + why.split(": ", 1)[1] if placement.per_replica == "copy" else "")
            )
        # Copies of the table this worker holds: one per replica, one on the host, or its replicas' shards.
        copies = placement.copies_per_worker(local_replicas, shard_over)
        held += need * copies
        held_replica += placement.replica_bytes(need, shard_over)
        if memory is not None and held > memory:
            raise ValueError(
                f"Table '{name}' needs {_mb(need * copies)} with {slots} slot(s) ({copies} cop(ies)) beside "
                f"{_mb(held - need * copies)} of the tables before it; argument `memory_per_device` is "
                f"{_mb(memory)}. Use parameter servers for these tables."
            )
        exchange, bound, ms = None, None, 0.0
        if not placement.exchanged:
            why += "; rows travel to their owners and back: no exchange to choose"
            ms = traffic[placement.option] if traffic else 0.0
        elif config.exchange not in (None, "auto") or config.ids_per_step is not None:
            why += "; exchange set by the table config"
        elif t.distinct_per_step is not None:
            bound = max(1, int(math.ceil(t.distinct_per_step)))
            row_bytes = nbytes // t.rows
            exchange = choose(t.rows, row_bytes, topology.replicas, bound, in_process=in_process)
            args = (t.rows, row_bytes, topology.replicas, min(bound, t.rows))
            costs = {m: cost_bytes(m, *args, in_process=in_process) for m in ("allgather", "dense")}
            ms = traffic[placement.option] if traffic else costs[exchange] / EXCHANGE_BYTES_PER_MS
            why += (
                f"; {exchange}: {bound:,} distinct ids per replica, cost {costs['allgather'] / 1e6:.2f} MB-eq. "
                f"gathered against {costs['dense'] / 1e6:.2f} dense"
            )
        else:
            why += "; exchange decided every step (no sample)"
        out[name] = dataclasses.replace(
            t, placement=placement.option if chosen[name] is None else None, exchange=exchange,
            exchange_ids=bound, estimate_ms=ms, memory_mb=need * copies / 2**20, reason=why,
        )  # fmt: skip
    return out, [sum(t.memory_mb for t in out.values())]


def _width(config) -> tuple:
    return (config.dim, tf.as_dtype(config.dtype).name)


def _placement_ms(t, row_bytes, topology, slots, in_process, sharing) -> dict:
    """`{"device": ms, "sharded": ms}`: the cost model's estimate of a table's step copied and sharded; across
    workers the sharded step adds its share of its group's rendezvous."""
    bound = max(1, int(math.ceil(t.distinct_per_step)))
    costs = placement_costs(t.rows, row_bytes, topology.replicas, bound, slots, in_process,
                            shared_cores=topology.devices == "cpu")  # fmt: skip
    ms = {k: v / EXCHANGE_BYTES_PER_MS for k, v in costs.items()}
    if not in_process:
        ms["sharded"] += SHARDED_RENDEZVOUS_MS / max(1, sharing)
    return ms
