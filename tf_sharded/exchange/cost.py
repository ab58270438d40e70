"""The exchange's cost model: which of all-gather and densified all-reduce is cheaper for one shard and step,
and whether a table is cheaper copied on every replica or sharded over them.

Cost model, per shard and step, in bytes-equivalent (`R` replicas, `u` the
largest distinct-row count of any replica, `b` bytes per row, `k =
MERGE_FACTOR`, `k1 = LOCAL_MERGE_FACTOR`):

    collective  allgather = u * (b + 8) * ((R - 1) + k * R)  # receive, then merge + apply, per replica
                dense     = 2 * (R - 1) / R * rows * b       # ring all-reduce, per replica
    in process  allgather = k1 * R * u * (b + 8)             # one hash merge of all gathered rows
                dense     = 8 * rows + R * u * b              # position map over the table + one segment sum

`k` is what merging and applying one gathered row costs relative to
receiving it; on a single host, where a collective is a memory copy, it
dominates, and on a real network the transfer term does. `k1` is a hash
merge's cost per byte relative to a segment sum's. Both defaults come from
`python -m tf_sharded bench exchange` (`k`) and the merge sweep
`python -m tf_sharded.benchmarks.exchange` (`k1`; RFC.md, "Performance Implications") on a 2-core CPU
machine. A declared `ids_per_step` fixes the choice at trace time
instead.

Placement (`placement_costs`): a copy per replica (`"device"`) against a
shard per replica (`"sharded"`), per table and step, `G = min(R * u, rows)`
the rows the global batch touches, `a = APPLY_FACTOR * (1 + slots) * b` one
row's optimizer update:

    in process  device  = exchange + c * G * a                 # every copy applies every touched row
                sharded = R * u * (8 + 2 * b) + k1 * R * u * (b + 8) + G * a * c / R
                          # ids to owners, rows back, gradients home; one merge; each row applied once
    collective  device  = exchange                              # its k covers merging and applying
                sharded = the lookup's transport (below), its bytes only

`c` is R where the replicas share one process's cores (logical CPU
devices: R copies' updates add up) and 1 where each has its own (GPUs: they
run side by side). Across workers the sharded lookup also waits on two
more rendezvous per step than the copies' exchange; that latency is the
planner's (`tfs.plan`), per step and group of tables, not per byte.
`APPLY_FACTOR` comes from B12's in-process points (`python -m tf_sharded
bench sharded`), which refit it in every run.

Transport of a sharded lookup across workers (`sharded_transport_costs`), per
replica and step, `P` the largest number of one replica's keys that one
owner holds (about `u / R` for ids spread evenly, `u` at worst), `r` one
rendezvous (`RENDEZVOUS_BYTES`):

    gather    = (R - 1) * u * (8 + 3 * b) + k * R * P * (b + 8) + 5 * r
                # id all-gather, ring all-reduce of the R * u rows, gradient all-gather, the owner's merge of
                # its keys; each all-gather of unequal parts is two rendezvous (sizes, then the padded
                # parts), the all-reduce one
    alltoall  = (R - 1) * P * (8 + 2 * b) + k * R * P * (b + 8) + 4 * r
                # one scalar all-reduce (the chunk length), ids out, rows back, gradients home, the same merge

Each owner receives only its own keys and rows, and the all-to-all needs one
rendezvous fewer, so wherever its collective runs it is the cheaper of the
two at every size; the gather form stays for a forced choice
(`tfs.exchange.workers.transport_scope`).
"""

from __future__ import annotations

from typing import Optional

ID_BYTES = 8
MERGE_FACTOR = 4.0
LOCAL_MERGE_FACTOR = 1.1
# Bytes-equivalent per table row of the in-process densified merge's position map (two int32 passes).
MAP_BYTES_PER_ROW = 8
# An optimizer's update of one row per byte of the row and its slots, relative to receiving a byte (B12).
APPLY_FACTOR = 1.3
# One rendezvous of the workers' collectives in bytes-equivalent: half of `tfs.plan`'s SHARDED_RENDEZVOUS_MS
# (two rendezvous, B12) at its EXCHANGE_BYTES_PER_MS (B11).
RENDEZVOUS_BYTES = 6.0e5


def cost_bytes(
    mode: str,
    rows: int,
    row_bytes: int,
    replicas: int,
    distinct_ids: int,
    merge_factor: Optional[float] = None,
    in_process: bool = False,
) -> float:
    """Bytes-equivalent cost of one shard's exchange per step under `mode` (see the module docstring).

    Collective: what one replica handles; in process: what the one merge handles.

    Example:

    >>> cost_bytes("allgather", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000, merge_factor=0)
    408000.0
    >>> cost_bytes("dense", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000)
    192000000.0
    >>> cost_bytes("dense", rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000, in_process=True)
    8512000.0
    """
    if mode not in ("allgather", "dense"):
        raise ValueError(f"Argument `mode` must be 'allgather' or 'dense'. Received: mode={mode!r}")
    if in_process:
        gather, dense = local_costs(rows, row_bytes, replicas * distinct_ids, merge_factor)
        return float(gather if mode == "allgather" else dense)
    k = MERGE_FACTOR if merge_factor is None else merge_factor
    if mode == "allgather":
        return float(distinct_ids * (row_bytes + ID_BYTES) * ((replicas - 1) + k * replicas))
    return 2.0 * (replicas - 1) / replicas * rows * row_bytes


def local_costs(rows: int, row_bytes: int, gathered, merge_factor: Optional[float] = None):
    """In-process (hash merge, densified merge) costs of `gathered` rows (a number or a float tensor)."""
    k = LOCAL_MERGE_FACTOR if merge_factor is None else merge_factor
    return k * (row_bytes + ID_BYTES) * gathered, MAP_BYTES_PER_ROW * rows + row_bytes * gathered


def choose(
    rows: int,
    row_bytes: int,
    replicas: int,
    distinct_ids: Optional[int],
    merge_factor: Optional[float] = None,
    in_process: bool = False,
) -> str:
    """The cheaper exchange for one shard; allgather when `distinct_ids` is unknown.

    Example:

    >>> choose(rows=1_000_000, row_bytes=128, replicas=4, distinct_ids=1000)
    'allgather'
    >>> choose(rows=1_000, row_bytes=128, replicas=4, distinct_ids=1000)
    'dense'
    """
    if distinct_ids is None:
        return "allgather"
    u = min(int(distinct_ids), int(rows))
    args = (rows, row_bytes, replicas, u, merge_factor, in_process)
    return "allgather" if cost_bytes("allgather", *args) <= cost_bytes("dense", *args) else "dense"


def break_even_ids(
    rows: int, row_bytes: int, replicas: int, merge_factor: Optional[float] = None, in_process: bool = False
) -> float:
    """Distinct ids per replica above which "auto" densifies (infinite if it never does).

    Example:

    >>> round(break_even_ids(rows=1_000_000, row_bytes=128, replicas=4))
    74303
    >>> round(break_even_ids(rows=1_000_000, row_bytes=128, replicas=4, in_process=True))
    92593
    """
    args = (rows, row_bytes, replicas)
    dense_at_zero = cost_bytes("dense", *args, 0, merge_factor, in_process)
    per_id = cost_bytes("allgather", *args, 1, merge_factor, in_process) - (
        cost_bytes("dense", *args, 1, merge_factor, in_process) - dense_at_zero
    )
    return dense_at_zero / per_id if per_id > 0 else float("inf")


def row_bytes(values) -> int:
    """Bytes per row of a tensor or table."""
    return values.dtype.size * max(1, values.shape[1:].num_elements() or 1)


def placement_costs(
    rows: int,
    row_bytes: int,
    replicas: int,
    distinct_ids: int,
    slots: int = 1,
    in_process: bool = False,
    shared_cores: bool = True,
    exchange: Optional[str] = None,
    apply_factor: Optional[float] = None,
    transport: Optional[str] = None,
) -> dict:
    """`{"device": ..., "sharded": ...}`: bytes-equivalent per step of one table copied on every replica and
    sharded over them (see the module docstring).

    Args:
      rows, row_bytes: the table's.
      replicas: `R`, the replicas a shard is one of.
      distinct_ids: `u`, the largest number of distinct ids one replica looks up in a step.
      slots: optimizer slots per row (Adagrad 1, Adam 2).
      in_process: the replicas of one process (MirroredStrategy) rather than one per worker.
      shared_cores: in process, whether the replicas share the process's cores (logical CPU devices).
      exchange: the copies' exchange, "allgather" or "dense" (None: the cheaper).
      apply_factor: instead of `APPLY_FACTOR`.
      transport: across workers, the sharded lookup's, "alltoall" or "gather" (None: the cheaper).

    Example:

    >>> costs = placement_costs(rows=100_000, row_bytes=64, replicas=4, distinct_ids=512, in_process=True)
    >>> {k: round(v) for k, v in costs.items()}
    {'device': 1525350, 'sharded': 781517}
    >>> costs = placement_costs(rows=100_000, row_bytes=64, replicas=2, distinct_ids=512)
    >>> {k: round(v) for k, v in costs.items()}
    {'device': 331776, 'sharded': 182272}
    """
    u = min(int(distinct_ids), int(rows))
    touched = min(replicas * u, rows)
    update = (APPLY_FACTOR if apply_factor is None else apply_factor) * (1 + slots) * row_bytes
    args = (rows, row_bytes, replicas, u, None, in_process)
    copies = {mode: cost_bytes(mode, *args) for mode in ("allgather", "dense")}
    device = copies[exchange] if exchange is not None else min(copies.values())
    if in_process:
        cores = replicas if shared_cores else 1
        device += cores * touched * update
        sent = replicas * u  # each replica's distinct ids, to their owners
        route = sent * (ID_BYTES + 2 * row_bytes) + LOCAL_MERGE_FACTOR * sent * (row_bytes + ID_BYTES)
        sharded = route + touched * update * cores / replicas
    else:
        if transport is None:
            ways = sharded_transport_costs(replicas, u, row_bytes)
            transport = min(ways, key=ways.get)
        sharded = sharded_transport_costs(replicas, u, row_bytes, rendezvous=False)[transport]
    return {"device": float(device), "sharded": float(sharded)}


def sharded_transport_costs(
    replicas: int,
    distinct_ids: int,
    row_bytes: int,
    chunk: Optional[int] = None,
    merge_factor: Optional[float] = None,
    rendezvous: bool = True,
) -> dict:
    """`{"alltoall": ..., "gather": ...}`: bytes-equivalent per replica and step of one group's sharded lookup
    across workers (see the module docstring).

    Args:
      replicas: `R`, the replicas the group's shards are spread over.
      distinct_ids: `u`, the largest number of distinct keys of one replica in a step.
      row_bytes: `b`.
      chunk: `P`, the largest number of one replica's keys held by one owner (default: `u / R`, rounded up).
      merge_factor: instead of `MERGE_FACTOR`.
      rendezvous: whether to count the rendezvous (`tfs.plan` prices a group's waits per step instead).

    Example:

    >>> costs = sharded_transport_costs(replicas=2, distinct_ids=4096, row_bytes=64)
    >>> {k: round(v) for k, v in costs.items()}
    {'alltoall': 3858176, 'gather': 4998848}
    >>> costs = sharded_transport_costs(replicas=2, distinct_ids=4096, row_bytes=64, chunk=4096)
    >>> costs["alltoall"] < costs["gather"]
    True
    """
    k = MERGE_FACTOR if merge_factor is None else merge_factor
    u = max(1, int(distinct_ids))
    p = -(-u // replicas) if chunk is None else max(1, int(chunk))
    sent = replicas - 1
    merge = k * replicas * p * (row_bytes + ID_BYTES)
    r = RENDEZVOUS_BYTES if rendezvous else 0.0
    gather = sent * u * (ID_BYTES + 3 * row_bytes) + merge + 5 * r
    alltoall = sent * p * (ID_BYTES + 2 * row_bytes) + merge + 4 * r
    return {"alltoall": float(alltoall), "gather": float(gather)}
