"""B1's overlap probe: would overlapping one step's lookup with the previous step's update shorten a step?

A parameter-server step goes to the ps and back in order: ids out, rows
back, gradients out. If those crossings set the step time, a loop of steps
could overlap them, as TorchRec's pipelines do. This probe measures that
directly, on the simplest storage (all tables' rows in one id space, one
plain variable per ps, rows by id % 2), with `PER_EXECUTION` steps in one
scheduled function, in three loops over the same batches:

* `sync`: each iteration routes its batch's ids, gathers, computes the loss
  and its gradient and scatters it (B1's order);
* `pipelined`: each iteration receives its batch's rows from the previous
  one, computes and scatters its gradient, then routes and gathers the next
  batch's rows. The gather runs on the ps after the scatter (both touch the
  variable, so the function orders them), so every row read is the same as
  in `sync`; only the worker no longer waits for the ids of the next batch;
* `stale`: as `pipelined`, but the next batch's gather comes before this
  batch's scatter, so they can overlap: a row touched by two consecutive
  batches is read one update late (TorchRec's semi-synchronous pipeline).

`check` trains each loop from the same rows on small tables: `sync` must
land where a local reference does, `pipelined` where `sync` does (the same
reads), and `stale`'s difference from `sync` is what one update of
staleness moved.
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

SHARDS = 2
NAMES = ("sync", "pipelined", "stale")


class Probe:
    """The three loops on `sum(vocab)` rows of `dim` in one plain variable per ps.

    Args:
      tf: the TensorFlow module.
      strategy: the cluster's ParameterServerStrategy (its ps devices hold the rows).
      keys: the batches' feature names, in table order.
      vocab: each table's rows (table `i`'s id `x` is row `offset[i] + x` of the one id space).
      dim, lr, scale: row width, SGD learning rate, and the loss's scale (`scale * sum(rows ** 2)`).
      initial: `[sum(vocab), dim]` starting rows (else uniform in +-0.05).
    """

    def __init__(self, tf, strategy, keys: Sequence[str], vocab: Sequence[int], dim: int, lr: float, scale: float,
                 initial=None):  # fmt: skip
        self.tf, self.strategy, self.keys, self.dim, self.lr, self.scale = tf, strategy, list(keys), dim, lr, scale
        self.offsets = tf.constant(np.concatenate([[0], np.cumsum(vocab)[:-1]]).astype(np.int64))
        total = int(sum(vocab))
        self.variables = []
        for s in range(SHARDS):
            rows = (total - s + SHARDS - 1) // SHARDS  # ids s, s + 2, ...
            start = (
                tf.random.uniform([rows, dim], -0.05, 0.05, seed=100 + s)
                if initial is None
                else tf.constant(initial[s::SHARDS])
            )
            with tf.device(f"/job:ps/replica:0/task:{s}"):
                self.variables.append(tf.Variable(start, name=f"overlap_rows_{s}"))

    def rows(self) -> np.ndarray:
        """The rows of the one id space, in id order."""
        parts = [v.numpy() for v in self.variables]
        out = np.empty((sum(len(p) for p in parts), self.dim), parts[0].dtype)
        for s, part in enumerate(parts):
            out[s::SHARDS] = part
        return out

    def loops(self) -> Dict:
        """`{name: function}`: each runs its loop over stacked batches `{key: [count, batch]}` (scheduled)."""
        return {name: self._scheduled(name) for name in NAMES}

    def _scheduled(self, name: str):
        return self.tf.function(lambda stacked: self.strategy.run(self._loop, args=(stacked, name)))

    def _ids(self, stacked, i):
        tf = self.tf
        return tf.concat([stacked[k][i] + self.offsets[j] for j, k in enumerate(self.keys)], 0)

    def _route(self, ids):
        tf = self.tf
        unique, idx = tf.unique(ids, out_idx=tf.int32)
        shard = tf.cast(unique % SHARDS, tf.int32)
        local = tf.dynamic_partition(unique // SHARDS, shard, SHARDS)
        positions = tf.dynamic_partition(tf.range(tf.size(unique)), shard, SHARDS)
        return (idx, *local, *positions)

    def _gather(self, route):
        tf = self.tf
        local, positions = route[1 : 1 + SHARDS], route[1 + SHARDS :]
        parts = []
        for v, rows in zip(self.variables, local):
            with tf.device(v.device):
                parts.append(tf.gather(v, rows))
        return tf.dynamic_stitch(list(positions), parts)

    def _update(self, values, route):
        """The loss on `values` (the batch's distinct rows) and its SGD update, scattered on each ps."""
        tf = self.tf
        idx, local, positions = route[0], route[1 : 1 + SHARDS], route[1 + SHARDS :]
        with tf.GradientTape() as tape:
            tape.watch(values)
            loss = self.scale * tf.reduce_sum(tf.square(tf.gather(values, idx)))
        grad = tape.gradient(loss, values)
        for v, rows, where in zip(self.variables, local, positions):
            step = self.lr * tf.gather(grad, where)
            with tf.device(v.device):
                v.scatter_sub(tf.IndexedSlices(tf.identity(step), rows))
        return loss

    def _loop(self, stacked, name: str):
        tf = self.tf
        count = tf.shape(stacked[self.keys[0]])[0]
        if name == "sync":

            def body(i, loss):
                route = self._route(self._ids(stacked, i))
                return i + 1, self._update(self._gather(route), route)

            return tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), tf.constant(0.0)))[1]

        def body(i, loss, values, *route):  # updates batch i, gathers batch i + 1
            following = self._route(self._ids(stacked, i + 1))
            if name == "stale":
                ahead = self._gather(following)  # before this batch's scatter: may read a row one update late
                loss = self._update(values, route)
            else:
                loss = self._update(values, route)
                ahead = self._gather(following)  # after it, on each ps
            return (i + 1, loss, ahead, *following)

        first = self._route(self._ids(stacked, 0))
        state = (tf.constant(0), tf.constant(0.0), self._gather(first), *first)
        shapes = (tf.TensorShape([]), tf.TensorShape([]), tf.TensorShape([None, self.dim]))
        shapes += (tf.TensorShape([None]),) * len(first)
        _, _, values, *route = tf.while_loop(lambda i, *_: i < count - 1, body, state, shape_invariants=shapes)
        return self._update(values, route)  # the last batch


def check(tf, strategy, coordinator, keys, vocab, dim, lr, scale, batches) -> Dict[str, float]:
    """Each loop trained from the same rows over `batches` (`[{key: ids}]`, numpy) in one scheduled function:
    the largest difference of `sync`'s rows from a local reference (numpy, the same SGD in order), and of the
    other loops' rows from `sync`'s; and how far the reference moved ("reference_moved")."""
    rng = np.random.default_rng(7)
    start = rng.uniform(-0.05, 0.05, size=(int(sum(vocab)), dim)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(vocab)[:-1]]).astype(np.int64)
    reference = start.copy()
    for batch in batches:
        ids, counts = np.unique(np.concatenate([batch[k] + offsets[j] for j, k in enumerate(keys)]),
                                return_counts=True)  # fmt: skip
        reference[ids] -= (lr * 2 * scale * counts[:, None] * reference[ids]).astype(np.float32)
    stacked = {k: tf.constant(np.stack([b[k] for b in batches])) for k in keys}
    rows = {}
    for name in NAMES:
        probe = Probe(tf, strategy, keys, vocab, dim, lr, scale, initial=start)
        coordinator.schedule(probe.loops()[name], args=(stacked,))
        coordinator.join()
        rows[name] = probe.rows()
    out = {"reference_moved": float(np.abs(reference - start).max())}
    out["sync"] = float(np.abs(rows["sync"] - reference).max())
    out.update({f"{name}_vs_sync": float(np.abs(rows[name] - rows["sync"]).max()) for name in NAMES[1:]})
    return out
