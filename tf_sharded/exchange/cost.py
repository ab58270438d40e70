"""The exchange's cost model: which of all-gather and densified all-reduce is cheaper for one shard and step.

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
"""

from __future__ import annotations

from typing import Optional

ID_BYTES = 8
MERGE_FACTOR = 4.0
LOCAL_MERGE_FACTOR = 1.1
# Bytes-equivalent per table row of the in-process densified merge's position map (two int32 passes).
MAP_BYTES_PER_ROW = 8


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
