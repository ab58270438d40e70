"""A training lookup of dynamic tables, with one transfer each way per device instead of several per shard.

Sent shard by shard, a training lookup of 26 tables of 2 shards moved about
seven tensors per shard between the worker and the parameter servers (keys,
fingerprints, counts, the table's step, the rows found, their values, then
the gradient's values and indices), and those transfers, not the work, set
the step time (docs/benchmarks.md, B7). Here each device receives one tensor of keys, one
of counts and one of table steps per device that holds steps; it splits
them, runs the inserts under its lock (`locked_together`), gathers and
returns one tensor of values. The gradient comes back as one tensor, which
the device splits into each pool's `IndexedSlices` itself (`_gather_on`'s
custom gradient), so the optimizer's update runs where the rows live with
nothing more to fetch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_sharded.table.dynamic.lock import locked_together


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: it holds tensors, compared by identity
class Request:
    """One shard's part of a training lookup: its distinct keys and their counts (on the worker), the table's
    step for this lookup (where the step variable lives), and which of the keys' values come back (`wanted`:
    their positions among `keys`; None: all). A worker under MultiWorkerMirroredStrategy inserts every
    replica's keys into its copy but reads only its own."""

    table: Any
    shard: int
    keys: tf.Tensor
    counts: tf.Tensor
    step: tf.Tensor
    wanted: Optional[tf.Tensor] = None
    device: str = dataclasses.field(init=False)  # the shard's

    def __post_init__(self):
        object.__setattr__(self, "device", self.table.shards[self.shard].device)


def resolve(requests: Sequence[Request]) -> List[tf.Tensor]:
    """Each request's keys' rows (values, on the worker), inserting absent keys first; a key turned away
    by a policy reads its initial row."""
    out: List[tf.Tensor] = [None] * len(requests)
    for members, values, sizes in resolve_by_device(requests):
        for i, part in zip(members, tf.split(values, sizes, num=len(members))):
            out[i] = part
    return out


def resolve_by_device(requests: Sequence[Request]) -> List[Tuple[List[int], tf.Tensor, tf.Tensor]]:
    """`resolve`, as it comes back: per device (and key dtype), `(positions of its requests, their values
    concatenated in that order, each request's number of values)` (a request's `wanted` keys, where it names
    them). Requests whose shards share a row pool insert in one body."""
    by_device: Dict[tuple, List[int]] = {}  # keys of one dtype travel together (a collection mixes them)
    for i, request in enumerate(requests):
        by_device.setdefault((request.device, request.keys.dtype), []).append(i)
    stacked, position = _stacked_steps(requests)
    bodies, inputs = [], []
    for (device, _), members in by_device.items():
        mine = [requests[i] for i in members]
        sizes = tf.stack([tf.size(r.keys, out_type=tf.int32) for r in mine])
        keys, counts = tf.concat([r.keys for r in mine], 0), tf.concat([r.counts for r in mine], 0)
        with tf.device(device):
            here = tf.identity(sizes)
            key_parts = tf.split(tf.identity(keys), here, num=len(mine))
            count_parts = tf.split(tf.identity(counts), here, num=len(mine))
            local = {home: tf.identity(stacked[home]) for home, _ in (position[id(r.step)] for r in mine)}
            step_of = [(local[home], j) for home, j in (position[id(r.step)] for r in mine)]
        parts = [
            r.table.insert_part(r.shard, k, c, step) for r, k, c, step in zip(mine, key_parts, count_parts, step_of)
        ]
        pooled, order = _bodies(parts)
        bodies += pooled
        inputs.append((device, members, key_parts, sizes, here, order, len(pooled)))
    rows = iter(locked_together(bodies))
    out = []
    for device, members, key_parts, sizes, here, order, count in inputs:
        results = [next(rows) for _ in range(count)]
        found = [results[b][j] for b, j in order]
        mine = [requests[i] for i in members]
        if any(r.wanted is not None for r in mine):
            key_parts, found, sizes, here = _wanted(device, mine, key_parts, found)
        out.append((members, _gather_on(device, mine, key_parts, found, here), sizes))
    return out


def _wanted(device: str, requests: Sequence[Request], keys, found):
    """The `wanted` keys and found rows of each of `requests` (all of them where None), with their numbers
    on the worker and on `device`."""
    with tf.device(device):
        keys = [k if r.wanted is None else tf.gather(k, r.wanted) for r, k in zip(requests, keys)]
        found = [f if r.wanted is None else tf.gather(f, r.wanted) for r, f in zip(requests, found)]
        here = tf.stack([tf.size(k, out_type=tf.int32) for k in keys])
    sizes = tf.stack([tf.size(r.keys if r.wanted is None else r.wanted, out_type=tf.int32) for r in requests])
    return keys, found, sizes, here


def _bodies(parts) -> tuple:
    """`([(pool, body)], [(body, position in it)] per part)`: one insert body per pool for the parts whose
    shards draw rows from it; a shard met again (a table looked up twice) starts another body, which runs
    after the first and sees its inserts."""
    bodies: List[list] = []  # per body: its pool and parts
    latest: Dict[int, int] = {}  # id(pool) -> its latest body
    order = []
    for part in parts:
        pool = part.member.pool
        b = latest.get(id(pool))
        if b is None or any(p.member is part.member for p in bodies[b][1]):
            b = latest[id(pool)] = len(bodies)
            bodies.append([pool, []])
        order.append((b, len(bodies[b][1])))
        bodies[b][1].append(part)
    return [(pool, pool.inserting(members)) for pool, members in bodies], order


def single(part):
    """The body inserting one shard's `part` alone, returning its rows."""
    body = part.member.pool.inserting([part])
    return lambda: body()[0]


def _stacked_steps(requests: Sequence[Request]):
    """`({device: its table steps stacked}, {id(step): (device, position)})`: a device reads every table's
    step from one tensor per device that holds steps, not one per table."""
    homes: Dict[str, dict] = {}
    for r in requests:
        homes.setdefault(r.table.step.device, {}).setdefault(id(r.step), r.step)
    stacked, position = {}, {}
    for home, held in homes.items():
        with tf.device(home):
            stacked[home] = tf.stack(list(held.values()))
        position.update({key: (home, j) for j, key in enumerate(held)})
    return stacked, position


def _gather_on(device: str, requests: Sequence[Request], keys: Sequence[tf.Tensor], rows: Sequence[tf.Tensor], sizes):
    """On `device`: the values of every request's `rows` of its `keys` (`sizes` of them, on `device`), as one
    tensor sent back once; its gradient is split on `device` into one `IndexedSlices` per pool."""

    @tf.custom_gradient
    def gathered(*found):
        with tf.device(device):
            result = tf.concat([_values(run, requests, keys, found) for run in _runs(requests)], 0)

        def grad(dy, variables=None):
            by_pool: Dict[int, tuple] = {}
            with tf.device(device):
                for r, rows_, g in zip(requests, found, tf.split(dy, sizes, num=len(requests))):
                    if not r.table.every_key_held:  # keys turned away read their initial row: no gradient
                        stored = tf.where(rows_ >= 0)
                        rows_, g = tf.gather_nd(rows_, stored), tf.gather_nd(g, stored)
                    shard = r.table.shards[r.shard]
                    if id(shard.rows) not in by_pool:
                        by_pool[id(shard.rows)] = ([], [], shard.dense_shape())
                    by_pool[id(shard.rows)][0].append(g)
                    by_pool[id(shard.rows)][1].append(rows_)
                slices = []
                for v in variables:
                    values, indices, shape = by_pool[id(v)]
                    slices.append(tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), shape))
            return [None] * len(found), slices

        return result, grad

    with tf.device(device):
        values = gathered(*rows)
    return tf.identity(values)


def _runs(requests: Sequence[Request]) -> List[List[int]]:
    """Positions of `requests` cut into runs of consecutive ones whose keys are all held in one pool (gathered
    at once); any other request is a run of its own."""
    runs: List[List[int]] = []
    last = None
    for i, r in enumerate(requests):
        pool = r.table.shards[r.shard].pool if r.table.every_key_held else None
        if pool is not None and pool is last:
            runs[-1].append(i)
        else:
            runs.append([i])
        last = pool
    return runs


def _values(run: List[int], requests, keys, found) -> tf.Tensor:
    """The values of a run's requests' rows, in order (one gather when they share a pool)."""
    if len(run) == 1:
        r = requests[run[0]]
        return r.table.shard_values(r.shard, keys[run[0]], found[run[0]], r.table.every_key_held)
    return requests[run[0]].table.shards[requests[run[0]].shard].pool.gather(tf.concat([found[i] for i in run], 0))


@tf.custom_gradient
def expand(unique_rows, idx, num_unique):
    """Rows in the caller's order (`unique_rows[idx]`); the upstream gradient summed per distinct key
    (nothing table-sized)."""

    def grad(dy):
        return tf.math.unsorted_segment_sum(dy, idx, num_unique), None, None

    return tf.gather(unique_rows, idx), grad
