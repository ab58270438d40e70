"""Admission and eviction policies of dynamic tables: which keys get a row, which rows are freed.

Every policy runs on the shard's device, inside the shard's critical section,
during a training lookup (`RowPool.inserting`); nothing runs on the
coordinator. A table's *step* counts its training lookups (one per training
step for a table looked up once per step, as layers and collections do); it
is what "last seen" and `export(since_step=)` refer to.

Admission (a key not admitted reads its initial row and gets no update):

* `MinCountAdmission(min_count)`: a key gets a row once it has occurred
  `min_count` times in training batches, counted in a count-min sketch
  (bounded memory; a count is never underestimated, so no key waits longer
  than `min_count` occurrences).
* `ProbabilityAdmission(p)`: each training batch that meets a key without a
  row admits it with probability `p` (a hash of key, step and seed).

Eviction (an evicted key's row and optimizer slots are freed and reused; the
key reads its initial row again until re-inserted):

* `StepsSinceSeenEviction(max_steps)`: keys not looked up in training for
  more than `max_steps` steps are evicted (checked every `every` steps).
* `CapacityEviction(max_keys, policy="lru" | "lfu")`: a shard never holds
  more than its share of `max_keys`; when new keys need room, the least
  recently (or least frequently) seen keys not in the current batch go.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tf_sharded import initializers
from tf_sharded.errors import positive_int

_SKETCH_SALT = 0x632BE59BD9B4E019


def _uniform(fingerprints: tf.Tensor, step: tf.Tensor, seed: int) -> tf.Tensor:
    """A float64 in [0, 1) per key: a hash of (key fingerprint, step, seed)."""
    mix = initializers.mix64(tf.cast(step, tf.uint64) * initializers.u64(0x9E3779B97F4A7C15) + initializers.u64(seed))
    bits = initializers.mix64(tf.cast(fingerprints, tf.uint64) ^ mix)
    return tf.cast(tf.bitwise.right_shift(bits, initializers.u64(11)), tf.float64) / float(2**53)


class Policy:
    """Base of the policies: Keras-serializable (a layer's config carries its policies)."""

    def get_config(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"tfs.{type(self).__name__}({args})"


class Admission(Policy):
    """An admission policy: `admit` says which keys without a row get one now."""

    def make_state(self, shard) -> Optional[tf.Variable]:
        """Per-shard state (created on the shard's device), or None."""
        return None

    def admit(self, state, fingerprints, counts, step, missing, seed: int) -> tf.Tensor:
        raise NotImplementedError


@keras.saving.register_keras_serializable(package="tf_sharded")
class MinCountAdmission(Admission):
    """Admits a key once it occurred `min_count` times in training batches (a count-min sketch per shard).

    Args:
      min_count: occurrences before a key gets a row (1 admits at once).
      sketch_width: counters per hash row (memory: depth x width x 4 bytes per shard).
      sketch_depth: hash rows; an estimate is the minimum over them.

    Example:

    >>> import tf_sharded as tfs
    >>> t = tfs.create_dynamic_table("clicks_doc", dim=2, admission=tfs.policies.MinCountAdmission(2), seed=0)
    >>> _ = tfs.embedding_lookup(t, [7, 8, 8])   # 8 occurred twice: admitted
    >>> int(t.size())
    1
    """

    def __init__(self, min_count: int, sketch_width: int = 1 << 18, sketch_depth: int = 4):
        self.min_count = positive_int("min_count", min_count)
        self.sketch_width = positive_int("sketch_width", sketch_width)
        self.sketch_depth = positive_int("sketch_depth", sketch_depth)

    def get_config(self):
        return {"min_count": self.min_count, "sketch_width": self.sketch_width, "sketch_depth": self.sketch_depth}

    def make_state(self, shard):
        from tf_sharded import _compat

        with tf.init_scope(), tf.device(shard.device):
            return _compat.plain_variable(
                tf.zeros([self.sketch_depth, self.sketch_width], tf.int32), f"{shard.name}/sketch_{shard.shard}", False
            )

    def cells(self, fingerprints) -> tf.Tensor:
        """`[n, depth, 2]` sketch coordinates of each key."""
        depth = tf.range(self.sketch_depth, dtype=tf.int64)
        salted = tf.cast(fingerprints[:, None], tf.uint64) + tf.cast(depth[None, :] + 1, tf.uint64) * initializers.u64(
            _SKETCH_SALT
        )
        column = tf.cast(tf.bitwise.right_shift(initializers.mix64(salted), initializers.u64(1)), tf.int64)
        column = tf.math.floormod(column, self.sketch_width)
        rows = tf.broadcast_to(depth[None, :], tf.shape(column))
        return tf.stack([rows, column], -1)

    def admit(self, state, fingerprints, counts, step, missing, seed):
        where = tf.where(missing)[:, 0]
        cells = self.cells(tf.gather(fingerprints, where))
        added = tf.broadcast_to(tf.cast(tf.gather(counts, where), tf.int32)[:, None], tf.shape(cells)[:2])
        counted = state.scatter_nd_add(cells, added)
        with tf.control_dependencies([counted]):
            estimate = tf.reduce_min(tf.gather_nd(state.read_value(), cells), axis=1)
        admitted = tf.scatter_nd(where[:, None], estimate >= self.min_count, tf.shape(missing, out_type=tf.int64))
        return tf.logical_and(missing, admitted)


@keras.saving.register_keras_serializable(package="tf_sharded")
class ProbabilityAdmission(Admission):
    """Each training batch that meets a key without a row gives it one with probability `p`.

    Args:
      p: probability in (0, 1].

    Example:

    >>> import tf_sharded as tfs
    >>> t = tfs.create_dynamic_table("views_doc", dim=2, admission=tfs.policies.ProbabilityAdmission(0.5), seed=0)
    >>> _ = tfs.embedding_lookup(t, tf.range(1000, dtype=tf.int64))
    >>> 400 < int(t.size()) < 600
    True
    """

    def __init__(self, p: float):
        if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"Argument `p` must be a probability in (0, 1]. Received: p={p!r}")
        self.p = float(p)

    def get_config(self):
        return {"p": self.p}

    def admit(self, state, fingerprints, counts, step, missing, seed):
        return tf.logical_and(missing, _uniform(fingerprints, step, seed) < self.p)


class Eviction(Policy):
    """An eviction policy (`StepsSinceSeenEviction` or `CapacityEviction`)."""


@keras.saving.register_keras_serializable(package="tf_sharded")
class StepsSinceSeenEviction(Eviction):
    """Evicts keys not looked up in training for more than `max_steps` steps, checked every `every` steps.

    At a step `s` divisible by `every`, after the batch's keys are marked as
    seen at `s`, every key last seen at a step `<= s - max_steps` is evicted.

    Args:
      max_steps: steps a key may go unseen.
      every: how often (in steps) the shards are scanned (default: max_steps // 4, at least 1).

    Example:

    >>> import tf_sharded as tfs
    >>> t = tfs.create_dynamic_table("ttl_doc", dim=2, eviction=tfs.policies.StepsSinceSeenEviction(2, every=1), seed=0)
    >>> for keys in ([1, 2], [2], [2]):
    ...     _ = tfs.embedding_lookup(t, keys)
    >>> sorted(t.export()[0].numpy().tolist())
    [2]
    """

    def __init__(self, max_steps: int, every: Optional[int] = None):
        self.max_steps = positive_int("max_steps", max_steps)
        self.every = positive_int("every", every) if every is not None else max(1, self.max_steps // 4)

    def get_config(self):
        return {"max_steps": self.max_steps, "every": self.every}


@keras.saving.register_keras_serializable(package="tf_sharded")
class CapacityEviction(Eviction):
    """Bounds the live keys: each shard holds at most `ceil(max_keys / shards)`; new keys evict old ones.

    When a batch's new keys do not fit, the shard evicts the keys with the
    oldest last-seen step (`policy="lru"`, ties by fewer occurrences) or the
    fewest occurrences (`"lfu"`, ties by older last-seen step), never a key of
    the current batch; `headroom` (a fraction of the shard's capacity) is
    evicted beyond that, so that the scan runs on fewer steps. New keys that
    still do not fit (a batch with more new keys than the shard holds) read
    their initial row and get no update.

    Args:
      max_keys: live keys the table may hold.
      policy: "lru" or "lfu".
      headroom: fraction in [0, 0.5] of a shard's capacity freed beyond need.

    Example:

    >>> import tf_sharded as tfs
    >>> t = tfs.create_dynamic_table("lru_doc", dim=2, eviction=tfs.policies.CapacityEviction(2), seed=0)
    >>> for keys in ([1], [2], [1], [3]):
    ...     _ = tfs.embedding_lookup(t, keys)
    >>> sorted(t.export()[0].numpy().tolist())
    [1, 3]
    """

    def __init__(self, max_keys: int, policy: str = "lru", headroom: float = 0.0):
        self.max_keys = positive_int("max_keys", max_keys)
        if policy not in ("lru", "lfu"):
            raise ValueError(f"Argument `policy` must be 'lru' or 'lfu'. Received: policy={policy!r}")
        if not isinstance(headroom, (int, float)) or not 0.0 <= headroom <= 0.5:
            raise ValueError(f"Argument `headroom` must be in [0, 0.5]. Received: headroom={headroom!r}")
        self.policy, self.headroom = policy, float(headroom)

    def get_config(self):
        return {"max_keys": self.max_keys, "policy": self.policy, "headroom": self.headroom}

    def per_shard(self, num_shards: int) -> int:
        return math.ceil(self.max_keys / num_shards)

    def scores(self, seen: tf.Tensor, hits: tf.Tensor) -> tf.Tensor:
        """int64 per row, smaller = evicted first."""
        first, second = (seen, hits) if self.policy == "lru" else (hits, seen)
        return tf.bitwise.left_shift(first, 32) + tf.minimum(second, 2**32 - 1)


def serialize_policies(policy):
    """A policy, or a list of them, as Keras configs (for a layer's `get_config`)."""
    if isinstance(policy, (list, tuple)):
        return [keras.saving.serialize_keras_object(p) for p in policy]
    return None if policy is None else keras.saving.serialize_keras_object(policy)


def deserialize_policies(config):
    """The inverse of `serialize_policies` (objects passed through)."""
    if isinstance(config, list):
        return [deserialize_policies(c) for c in config]
    return keras.saving.deserialize_keras_object(config) if isinstance(config, dict) else config


def parse(table: str, admission, eviction) -> Tuple[Optional[Admission], Tuple[Eviction, ...]]:
    """Validated `(admission, evictions)`; errors name the table and the argument."""
    if admission is not None and not isinstance(admission, Admission):
        raise TypeError(
            f"Dynamic table '{table}': argument `admission` must be None, tfs.policies.MinCountAdmission or "
            f"tfs.policies.ProbabilityAdmission. Received: {admission!r}"
        )
    evictions: Sequence = () if eviction is None else eviction if isinstance(eviction, (list, tuple)) else (eviction,)
    kinds = [type(e) for e in evictions]
    if any(not isinstance(e, Eviction) for e in evictions) or len(set(kinds)) != len(kinds):
        raise TypeError(
            f"Dynamic table '{table}': argument `eviction` must be None, tfs.policies.StepsSinceSeenEviction, "
            f"tfs.policies.CapacityEviction, or a list with at most one of each. Received: {eviction!r}"
        )
    return admission, tuple(evictions)
