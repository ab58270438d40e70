"""Partition specs and the row layout they induce on a table.

A `PartitionSpec` is policy: how many shards and which scheme. A `Layout`
is that policy bound to a vocabulary size: it knows, for every logical row,
which shard owns it and at which local row, and the reverse. All mappings
exist both in NumPy (for set-up and checkpoints) and as TensorFlow ops (for
the training path), and the two agree row for row.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

SCHEMES = ("div", "mod", "balanced")

# 0.6180339887... (golden-ratio conjugate): its Weyl sequence is the most
# evenly spread of all, so consecutive (hot) ids land on distinct shards.
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
# Above this, a * r may overflow int64 and the multiplication is split.
_DIRECT_MULMOD_LIMIT = 3_037_000_499
_SPLIT_BITS = 22
_MAX_BALANCED_ROWS = 1 << 40


class PartitionSpec:
    """How a table is split into shards along its first axis.

    Args:
      num_shards: number of shards, a positive int.
      scheme: `"div"` (contiguous row ranges), `"mod"` (row `r` lives on shard
        `r % num_shards`) or `"balanced"` (a fixed, seeded bijection of the
        rows followed by `div`, so that vocabularies sorted by frequency still
        spread their hot rows evenly over the shards).
      splits: for `"div"` only, optional row counts per shard (uneven shards);
        they must sum to the vocabulary size of the table they are used on.
      seed: seed of the `"balanced"` bijection.

    Example:

    >>> spec = PartitionSpec(4, scheme="mod")
    >>> spec
    PartitionSpec(num_shards=4, scheme='mod')
    >>> spec.with_num_shards(2)
    PartitionSpec(num_shards=2, scheme='mod')
    >>> PartitionSpec(2, splits=[3, 7]).bind(10).shard_sizes
    (3, 7)
    """

    __slots__ = ("_num_shards", "_scheme", "_splits", "_seed")

    def __init__(
        self,
        num_shards: int,
        scheme: str = "div",
        splits: Optional[Sequence[int]] = None,
        seed: int = 0,
    ):
        if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)):
            raise TypeError(
                "Argument `num_shards` must be a positive int. Received: "
                f"num_shards={num_shards!r} (of type {type(num_shards).__name__})"
            )
        if num_shards < 1:
            raise ValueError(f"Argument `num_shards` must be a positive int. Received: num_shards={num_shards}")
        if scheme not in SCHEMES:
            raise ValueError(f"Argument `scheme` must be one of {SCHEMES}. Received: scheme={scheme!r}")
        if splits is not None:
            if scheme != "div":
                raise ValueError(
                    "Argument `splits` is only meaningful with scheme='div'. "
                    f"Received: splits={list(splits)!r} with scheme={scheme!r}"
                )
            splits = tuple(int(s) for s in splits)
            if len(splits) != num_shards or any(s < 1 for s in splits):
                raise ValueError(
                    f"Argument `splits` must hold {num_shards} positive row counts "
                    f"(one per shard). Received: splits={list(splits)!r}"
                )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"Argument `seed` must be an int. Received: seed={seed!r}")
        self._num_shards = int(num_shards)
        self._scheme = scheme
        self._splits = splits
        self._seed = int(seed)

    @property
    def num_shards(self) -> int:
        return self._num_shards

    @property
    def scheme(self) -> str:
        return self._scheme

    @property
    def splits(self) -> Optional[tuple]:
        return self._splits

    @property
    def seed(self) -> int:
        return self._seed

    def with_num_shards(self, num_shards: int) -> PartitionSpec:
        """Returns a copy with another shard count (uneven `splits` dropped)."""
        return PartitionSpec(num_shards, self._scheme, None, self._seed)

    def bind(self, num_rows: int) -> Layout:
        """Returns the `Layout` of this spec on a table of `num_rows` rows."""
        return Layout(self, num_rows)

    def _key(self):
        return (self._num_shards, self._scheme, self._splits, self._seed)

    def __eq__(self, other):
        return isinstance(other, PartitionSpec) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        parts = [f"num_shards={self._num_shards}", f"scheme={self._scheme!r}"]
        if self._splits is not None:
            parts.append(f"splits={list(self._splits)!r}")
        if self._seed:
            parts.append(f"seed={self._seed}")
        return f"PartitionSpec({', '.join(parts)})"

    def to_config(self) -> dict:
        """A JSON-friendly description (stored in checkpoints)."""
        return {
            "num_shards": self._num_shards,
            "scheme": self._scheme,
            "splits": list(self._splits) if self._splits else None,
            "seed": self._seed,
        }

    @classmethod
    def from_config(cls, config: dict) -> PartitionSpec:
        return cls(**config)


def _div_sizes(num_rows: int, num_shards: int) -> tuple:
    # TF's "div" convention: the first `num_rows % num_shards` shards get one
    # extra row.
    base, extra = divmod(num_rows, num_shards)
    return tuple(base + (1 if i < extra else 0) for i in range(num_shards))


class Layout:
    """A `PartitionSpec` bound to a vocabulary: row <-> (shard, local row).

    Args:
      spec: the partition policy.
      num_rows: the vocabulary size (first dimension of the table).

    Example:

    >>> layout = PartitionSpec(3, scheme="mod").bind(10)
    >>> layout.shard_sizes
    (4, 3, 3)
    >>> [int(x) for x in layout.shard_of(np.array([0, 1, 5]))]
    [0, 1, 2]
    >>> [int(x) for x in layout.logical_rows(1)]
    [1, 4, 7]
    """

    def __init__(self, spec: PartitionSpec, num_rows: int):
        num_rows = int(num_rows)
        if num_rows < 1:
            raise ValueError(f"A table must have at least one row. Received: num_rows={num_rows}")
        n = spec.num_shards
        if n > num_rows:
            raise ValueError(
                f"Argument `num_shards` must not exceed the number of rows ({num_rows}): "
                f"every shard must hold at least one row. Received: num_shards={n}"
            )
        self.spec = spec
        self.num_rows = num_rows
        if spec.splits is not None:
            if sum(spec.splits) != num_rows:
                raise ValueError(
                    f"Argument `splits` must sum to the number of rows ({num_rows}). "
                    f"Received: splits={list(spec.splits)!r} (sum {sum(spec.splits)})"
                )
            sizes = spec.splits
        elif spec.scheme == "mod":
            sizes = tuple(len(range(i, num_rows, n)) for i in range(n))
        else:
            sizes = _div_sizes(num_rows, n)
        self.shard_sizes = tuple(int(s) for s in sizes)
        self.offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(sizes)]))
        # With one shard every scheme is the identity layout.
        self._permuted = spec.scheme == "balanced" and n > 1
        if self._permuted:
            if num_rows > _MAX_BALANCED_ROWS:
                raise ValueError(f"scheme='balanced' supports at most 2**40 rows. Received: num_rows={num_rows}")
            self._mult, self._add = _bijection_params(num_rows, spec.seed)
            self._inv_mult = pow(self._mult, -1, num_rows) if num_rows > 1 else 0

    @property
    def num_shards(self) -> int:
        return self.spec.num_shards

    @property
    def scheme(self) -> str:
        return self.spec.scheme

    def __eq__(self, other):
        return isinstance(other, Layout) and self.num_rows == other.num_rows and self.spec == other.spec

    def __hash__(self):
        return hash((self.num_rows, self.spec))

    def __repr__(self):
        return f"Layout({self.spec!r}, num_rows={self.num_rows}, shard_sizes={list(self.shard_sizes)})"

    # ---------------------------------------------------------------- NumPy --

    def _permute_np(self, rows: np.ndarray) -> np.ndarray:
        if not self._permuted:
            return rows
        return _mulmod_np(rows, self._mult, self.num_rows, self._add)

    def _unpermute_np(self, rows: np.ndarray) -> np.ndarray:
        if not self._permuted:
            return rows
        shifted = (rows - self._add) % self.num_rows
        return _mulmod_np(shifted, self._inv_mult, self.num_rows, 0)

    def route_np(self, rows) -> tuple:
        """Maps logical rows to `(shard, local_row)` int64 arrays (NumPy)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.scheme == "mod":
            return rows % self.num_shards, rows // self.num_shards
        keys = self._permute_np(rows)
        shard = np.searchsorted(np.asarray(self.offsets[1:]), keys, side="right").astype(np.int64)
        return shard, keys - np.asarray(self.offsets, dtype=np.int64)[shard]

    def shard_of(self, rows) -> np.ndarray:
        """Shard index owning each logical row (NumPy)."""
        return self.route_np(rows)[0]

    def local_of(self, rows) -> np.ndarray:
        """Local row index of each logical row inside its shard (NumPy)."""
        return self.route_np(rows)[1]

    def logical_rows(self, shard: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Logical row ids held by `shard` at local rows `[start, stop)` (NumPy)."""
        size = self.shard_sizes[shard]
        stop = size if stop is None else min(stop, size)
        local = np.arange(start, stop, dtype=np.int64)
        if self.scheme == "mod":
            return local * self.num_shards + shard
        return self._unpermute_np(local + self.offsets[shard])

    # ----------------------------------------------------------- TensorFlow --

    def _permute_tf(self, rows: tf.Tensor) -> tf.Tensor:
        if not self._permuted:
            return rows
        return _mulmod_tf(rows, self._mult, self.num_rows, self._add)

    def _unpermute_tf(self, rows: tf.Tensor) -> tf.Tensor:
        if not self._permuted:
            return rows
        shifted = tf.math.floormod(rows - self._add, self.num_rows)
        return _mulmod_tf(shifted, self._inv_mult, self.num_rows, 0)

    def route(self, rows: tf.Tensor):
        """Maps int64 logical rows to `(shard, local_row)` int64 tensors."""
        n = self.num_shards
        if n == 1:
            return tf.zeros_like(rows), rows
        if self.scheme == "mod":
            return tf.math.floormod(rows, n), tf.math.floordiv(rows, n)
        keys = self._permute_tf(rows)
        if self.spec.splits is None:
            # Even div split: closed form, no search.
            base, extra = divmod(self.num_rows, n)
            big = extra * (base + 1)
            shard = tf.where(
                keys < big,
                tf.math.floordiv(keys, base + 1),
                extra + tf.math.floordiv(keys - big, max(base, 1)),
            )
        else:
            bounds = tf.constant(self.offsets[1:-1], dtype=tf.int64)
            shard = tf.searchsorted(bounds, keys, side="right", out_type=tf.int64)
        local = keys - tf.gather(tf.constant(self.offsets[:-1], dtype=tf.int64), shard)
        return shard, local

    def keys(self, rows: tf.Tensor) -> tf.Tensor:
        """Shard-major positions of int64 logical rows: shard `s` holds keys `[offsets[s], offsets[s + 1])`.

        A bijection of `[0, num_rows)` (`route` is `searchsorted` of the key
        over `offsets`), so tables of any scheme can share one id space.
        """
        if self.num_shards == 1:
            return rows
        if self.scheme == "mod":
            n = self.num_shards
            starts = tf.constant(self.offsets[:-1], dtype=tf.int64)
            return tf.gather(starts, tf.math.floormod(rows, n)) + tf.math.floordiv(rows, n)
        return self._permute_tf(rows)

    def logical_rows_tf(self, shard: int, start: int = 0, stop: Optional[int] = None) -> tf.Tensor:
        """Logical row ids held by `shard` at local rows `[start, stop)`."""
        size = self.shard_sizes[shard]
        stop = size if stop is None else min(stop, size)
        local = tf.range(start, stop, dtype=tf.int64)
        if self.scheme == "mod":
            return local * self.num_shards + shard
        return self._unpermute_tf(local + self.offsets[shard])


def _bijection_params(num_rows: int, seed: int):
    """Multiplier coprime with `num_rows` near the golden ratio, plus an offset."""
    if num_rows == 1:
        return 1, 0
    rng = np.random.default_rng(seed)
    jitter = int(rng.integers(0, max(1, num_rows // 64))) if seed else 0
    mult = max(1, int(round(num_rows * _GOLDEN)) + jitter) % num_rows or 1
    while math.gcd(mult, num_rows) != 1:
        mult = mult + 1 if mult + 1 < num_rows else 1
    add = int(rng.integers(0, num_rows)) if seed else 0
    return mult, add


def _mulmod_np(rows: np.ndarray, mult: int, modulus: int, add: int) -> np.ndarray:
    rows = rows.astype(np.int64)
    if modulus <= _DIRECT_MULMOD_LIMIT:
        return (rows * mult + add) % modulus
    hi, lo = mult >> _SPLIT_BITS, mult & ((1 << _SPLIT_BITS) - 1)
    part = (rows * hi) % modulus
    part = (part * (1 << _SPLIT_BITS)) % modulus
    return (part + (rows * lo) % modulus + add) % modulus


def _mulmod_tf(rows: tf.Tensor, mult: int, modulus: int, add: int) -> tf.Tensor:
    if modulus <= _DIRECT_MULMOD_LIMIT:
        return tf.math.floormod(rows * mult + add, modulus)
    hi, lo = mult >> _SPLIT_BITS, mult & ((1 << _SPLIT_BITS) - 1)
    part = tf.math.floormod(rows * hi, modulus)
    part = tf.math.floormod(part * (1 << _SPLIT_BITS), modulus)
    return tf.math.floormod(part + tf.math.floormod(rows * lo, modulus) + add, modulus)


def resolve_spec(partitions, shape: tf.TensorShape, dtype, scheme: Optional[str], default_shards: int) -> PartitionSpec:
    """Turns the user's `partitions=` argument into a `PartitionSpec`.

    Args:
      partitions: None (use `default_shards`), an int, a `PartitionSpec`, or a
        partitioner (ours or TF's: callable `(shape, dtype) -> [n, 1, ...]`).
      shape: full shape of the table (size-based partitioners read it).
      dtype: table dtype.
      scheme: optional scheme override (not allowed with a `PartitionSpec`
        that says otherwise).
      default_shards: shard count when `partitions` is None.
    """
    if isinstance(partitions, PartitionSpec):
        if scheme is not None and scheme != partitions.scheme:
            raise ValueError(
                f"Argument `scheme` conflicts with `partitions`: scheme={scheme!r} but "
                f"partitions={partitions!r}. Pass the scheme inside the PartitionSpec only."
            )
        spec = partitions
    else:
        if partitions is None:
            num = default_shards
        elif isinstance(partitions, bool):
            raise TypeError(
                "Argument `partitions` must be None, an int, a tfs.PartitionSpec or a "
                f"partitioner. Received: partitions={partitions!r} (of type bool)"
            )
        elif isinstance(partitions, (int, np.integer)):
            num = int(partitions)
        elif callable(partitions):
            result = partitions(tf.TensorShape(shape), tf.as_dtype(dtype))
            try:
                num = int(list(result)[0])
            except (TypeError, ValueError, IndexError) as e:
                raise TypeError(
                    "Argument `partitions` was called as a partitioner and must return a list "
                    f"of per-axis shard counts. Received: {result!r}"
                ) from e
        else:
            raise TypeError(
                "Argument `partitions` must be None, an int, a tfs.PartitionSpec or a "
                f"partitioner. Received: partitions={partitions!r} "
                f"(of type {type(partitions).__name__})"
            )
        spec = PartitionSpec(num, scheme=scheme or "div")
    return spec
