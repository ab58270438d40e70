"""What `tfs.plan` returns: the topology a plan is for, one `TablePlan` per table, and the `Plan` itself."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.config import Exchange, Placement, Scheme, TopologyKind
from tf_sharded.strategy import family_of
from tf_sharded.table import registry

PS, MIRRORED, MULTI, DEFAULT = (
    TopologyKind.PARAMETER_SERVER,
    TopologyKind.MIRRORED,
    TopologyKind.MULTI_WORKER_MIRRORED,
    TopologyKind.DEFAULT,
)


@dataclasses.dataclass(frozen=True)
class Topology:
    """What a plan is for: the strategy family, its parameter servers, replicas and workers, and what the
    replicas run on ("cpu": logical devices sharing a process's cores; "gpu": a device each)."""

    kind: TopologyKind
    num_ps: int = 0
    replicas: int = 1
    workers: int = 1
    devices: str = "cpu"

    def __post_init__(self):
        object.__setattr__(self, "kind", TopologyKind.parse(self.kind, "strategy['kind']"))
        if self.devices not in ("cpu", "gpu"):
            raise ValueError(f"Argument `strategy['devices']` must be 'cpu' or 'gpu'. Received: {self.devices!r}")
        for name in ("num_ps", "replicas", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"Argument `strategy['{name}']` must be a non-negative int. Received: {value!r}")
        if self.kind == PS and self.num_ps < 1:
            raise ValueError(
                f"Argument `strategy['num_ps']` must be >= 1 for parameter servers. Received: {self.num_ps}"
            )

    @classmethod
    def of(cls, strategy) -> Topology:
        if isinstance(strategy, Topology):
            return strategy
        if isinstance(strategy, dict):
            unknown = sorted(set(strategy) - {"kind", "num_ps", "replicas", "workers", "devices"})
            if unknown or "kind" not in strategy:
                raise ValueError(
                    "Argument `strategy` as a dict needs 'kind' and optionally 'num_ps', 'replicas', 'workers', "
                    f"'devices'. Received: {strategy!r}"
                )
            return cls(**strategy)
        if strategy is None:
            strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, tf.distribute.Strategy):
            raise TypeError(
                "Argument `strategy` must be a tf.distribute.Strategy, a dict such as {'kind': 'parameter_server', "
                f"'num_ps': 2}} or None (the current strategy). Received: {strategy!r}"
            )
        kind = family_of(strategy).name
        if kind == PS:
            return cls(kind, num_ps=_compat.ps_num_ps(strategy), workers=1)
        workers = 1
        resolver = getattr(strategy, "cluster_resolver", None) if kind == MULTI else None
        if resolver is not None and resolver.cluster_spec().jobs:
            spec = resolver.cluster_spec()
            workers = sum(spec.num_tasks(job) for job in spec.jobs if job in ("chief", "worker"))
        on_gpus = kind != DEFAULT and any("GPU" in d.upper() for d in strategy.extended.worker_devices)
        return cls(kind, replicas=strategy.num_replicas_in_sync, workers=max(1, workers),
                   devices="gpu" if on_gpus else "cpu")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """One table's part of a plan: the arguments it gets, the estimate, and why."""

    name: str
    rows: Optional[int]
    dim: int
    ids_per_step: Optional[float] = None  # mean ids looked up per step in the sample (all replicas)
    distinct_per_step: Optional[float] = None  # per replica, the largest in the sample
    partitions: Optional[int] = None
    scheme: Optional[Scheme] = None
    placement: Optional[Placement] = None
    exchange: Optional[Exchange] = None  # the exchange it will run: "allgather" or "dense"
    exchange_ids: Optional[int] = None  # the `ids_per_step` bound that fixes it at trace time
    group: Optional[str] = None
    estimate_ms: float = 0.0
    memory_mb: float = 0.0  # per device holding it (a ps's share, or one replica's copy)
    reason: str = ""

    def __post_init__(self):
        for name, choice in (("scheme", Scheme), ("placement", Placement), ("exchange", Exchange)):
            object.__setattr__(self, name, choice.parse_optional(getattr(self, name), name))

    def arguments(self, layout_only: bool = False) -> dict:
        """The table config fields the plan sets (`layout_only`: shards and scheme, which every strategy takes)."""
        values = {"partitions": self.partitions, "scheme": self.scheme}
        if layout_only:
            return {k: v for k, v in values.items() if v is not None}
        values["placement"] = self.placement
        if self.exchange is not None:
            values.update(exchange="auto", ids_per_step=self.exchange_ids)
        return {k: v for k, v in values.items() if v is not None}


class Plan:
    """The result of `tfs.plan`: one `TablePlan` per table, the storage groups, printable as a table.

    `str(plan)` is the table; `plan.tables[name]` one table's decisions;
    `EmbeddingCollection(..., plan=plan)` applies it (also from
    `plan.to_config()`, which is what the layer saves).

    Example:

    >>> import tf_sharded as tfs
    >>> plan = tfs.plan({"items": {"input_dim": 50_000, "output_dim": 8}},
    ...                 {"kind": "mirrored", "replicas": 4, "devices": "gpu"},
    ...                 ids={"items": {"ids_per_step": 4096, "distinct_per_step": 900}})
    >>> plan.tables["items"].exchange, plan.tables["items"].arguments()
    ('allgather', {'placement': 'device', 'exchange': 'auto', 'ids_per_step': 900})
    >>> print(str(plan).splitlines()[0])
    plan for mirrored (4 replicas on 1 worker(s)): estimate ... ms per step for the tables
    >>> tfs.Plan.from_config(plan.to_config()).tables == plan.tables
    True
    """

    def __init__(
        self,
        topology: Topology,
        tables: Dict[str, TablePlan],
        groups: List[List[str]],
        overhead_ms: float = 0.0,
        device_mb: Optional[List[float]] = None,
    ):
        self.topology, self.tables, self.groups = topology, dict(tables), [list(g) for g in groups]
        self.overhead_ms = overhead_ms  # the step's part that is no one table's (dispatch, storage variables)
        # Tables and slots per ps (parameter servers), per worker (mirrored) or on the one device.
        self.device_mb = list(device_mb or [])

    @property
    def kind(self) -> TopologyKind:
        return self.topology.kind

    @property
    def estimate_ms(self) -> float:
        """The estimate of the tables' part of a step: each table's, and under parameter servers the dispatch
        floor and each storage group's variables (one per ps)."""
        return sum(t.estimate_ms for t in self.tables.values()) + self.overhead_ms

    def configs(self, configs: dict, who: str = "plan", layout_only: bool = False) -> dict:
        """`configs` ({name: TableConfig}) with the plan's arguments set (`layout_only`: its shards and scheme);
        the plan must cover these tables."""
        if set(configs) != set(self.tables):
            raise ValueError(
                f"Argument `plan` is for the tables {sorted(self.tables)}, not {sorted(configs)} ({who}). "
                "Make the plan from the same tables."
            )
        out = {}
        for name, config in configs.items():
            planned = self.tables[name]
            if not registry.kind_of_config(config).static_rows:  # its shards follow the strategy
                out[name] = config
                continue
            if (config.rows, config.dim) != (planned.rows, planned.dim):
                raise ValueError(
                    f"Argument `plan` has table '{name}' as {planned.rows} x {planned.dim}; the table is "
                    f"{config.rows} x {config.dim} ({who}). Make the plan from the same tables."
                )
            out[name] = dataclasses.replace(config, **planned.arguments(layout_only))
        return out

    def applies_to(self, strategy, who: str) -> bool:
        """True under the kind of strategy the plan is for; False under the default strategy (only the
        layout applies there); an error under another."""
        kind = Topology.of(strategy).kind
        if kind == self.kind:
            return True
        if kind == DEFAULT:
            return False
        raise ValueError(
            f"Argument `plan` was made for {self.kind}; {who} is built under {kind}. "
            "Make the plan for the strategy the model is built under."
        )

    def __str__(self) -> str:
        head = ("table", "rows x dim", "ids/step", "distinct", "layout", "group", "est. ms", "MB", "why")
        body = []
        for t in self.tables.values():
            shape = f"{t.rows:,} x {t.dim}" if t.rows else f"dynamic x {t.dim}"
            ids = "-" if t.ids_per_step is None else f"{t.ids_per_step:,.0f}"
            distinct = "-" if t.distinct_per_step is None else f"{t.distinct_per_step:,.0f}"
            body.append((t.name, shape, ids, distinct, _layout(t), t.group or "-", f"{t.estimate_ms:.2f}",
                         f"{t.memory_mb:,.1f}", t.reason))  # fmt: skip
        widths = [max(len(str(r[i])) for r in [head] + body) for i in range(len(head))]
        line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
        topo = self.topology
        title = {PS: f"{topo.num_ps} ps", DEFAULT: "one device"}.get(
            self.kind, f"{topo.replicas} replicas on {topo.workers} worker(s)"
        )
        lines = [f"plan for {self.kind} ({title}): estimate {self.estimate_ms:.2f} ms per step for the tables"]
        if self.device_mb:
            where = {PS: "each ps", DEFAULT: "the device"}.get(self.kind, "each worker")
            lines.append(f"tables and slots on {where}: " + ", ".join(f"{mb:,.1f} MB" for mb in self.device_mb))
        return "\n".join(lines + [line(head)] + [line(r) for r in body])

    def __repr__(self):
        return f"Plan(kind={self.kind!r}, tables={list(self.tables)})"

    def to_config(self) -> dict:
        return {
            "topology": dataclasses.asdict(self.topology),
            "tables": {n: dataclasses.asdict(t) for n, t in self.tables.items()},
            "groups": self.groups,
            "overhead_ms": self.overhead_ms,
            "device_mb": self.device_mb,
        }

    @classmethod
    def from_config(cls, config: dict) -> Plan:
        if isinstance(config, Plan):
            return config
        if not isinstance(config, dict) or not {"topology", "tables", "groups"} <= set(config):
            raise ValueError(f"Argument `plan` must be a tfs.plan(...) result or its to_config(). Received: {config!r}")
        tables = {n: TablePlan(**t) for n, t in config["tables"].items()}
        extra = (config.get("overhead_ms", 0.0), config.get("device_mb"))
        return cls(Topology(**config["topology"]), tables, config["groups"], *extra)


def _layout(t: TablePlan) -> str:
    parts = []
    if t.partitions is not None:
        parts.append("1 shard" if t.partitions == 1 else f"{t.partitions} shards, {t.scheme or 'div'}")
    if t.placement:
        parts.append(t.placement)
    if t.exchange:
        parts.append(t.exchange)
    return ", ".join(parts) or ("dynamic" if t.rows is None else "local")
