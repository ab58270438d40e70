"""Layout-independent table initialisation.

The value of logical row `r` depends only on the seed, `r` and the table's
full shape, never on which shard holds the row. Each shard computes exactly
its own rows, on its own device, so the full table is never built in one
place. Random bits come from a counter-based hash (SplitMix64) of the
element's logical position, evaluated with TensorFlow integer ops.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, List, NamedTuple, Optional, Protocol, Tuple

import numpy as np
import tensorflow as tf

_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Inverse CDF of the standard normal at +-2: keras truncates at two stddevs.
_PHI_MINUS_2 = 0.022750131948179195
_TRUNC_STD = 0.87962566103423978  # stddev of a standard normal cut at +-2


def _u64(value: int) -> tf.Tensor:
    return tf.constant(value & 0xFFFFFFFFFFFFFFFF, dtype=tf.uint64)


def _mix(z: tf.Tensor) -> tf.Tensor:
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(30))) * _u64(_MIX1)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(27))) * _u64(_MIX2)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(31)))


def u64(value: int) -> tf.Tensor:
    """A uint64 constant (values wrap modulo 2**64)."""
    return _u64(value)


def mix64(z: tf.Tensor) -> tf.Tensor:
    """SplitMix64's finaliser on uint64 tensors: a bijective, well-mixed hash."""
    return _mix(z)


def _mix_int(z: int) -> int:
    mask = 0xFFFFFFFFFFFFFFFF
    z &= mask
    z = ((z ^ (z >> 30)) * _MIX1) & mask
    z = ((z ^ (z >> 27)) * _MIX2) & mask
    return z ^ (z >> 31)


def _stream_key(seed: int, stream: int) -> int:
    return _mix_int(seed * 0x100000001B3 + stream * 0x632BE59BD9B4E019 + 1)


def _uniform01(rows: tf.Tensor, width: int, seed: int, stream: int, keys: Optional[tf.Tensor] = None) -> tf.Tensor:
    """Uniform float64 in (0, 1) for every element of the given logical rows (`keys`: a uint64 stream key
    per row, `_stream_key` of each row's own seed, instead of `seed`'s)."""
    key = _u64(_stream_key(seed, stream)) if keys is None else keys[:, None]
    counters = (
        tf.cast(rows, tf.uint64)[:, None] * _u64(width) + tf.cast(tf.range(width, dtype=tf.int64), tf.uint64)[None, :]
    )
    z = _mix(key + (counters + _u64(1)) * _u64(_GAMMA))
    mantissa = tf.cast(tf.bitwise.right_shift(z, _u64(11)), tf.float64)
    return (mantissa + 0.5) * (1.0 / 9007199254740992.0)


def compute_fans(shape) -> tuple:
    """Keras's fan-in / fan-out of a weight of this shape."""
    shape = [int(d) for d in shape]
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


class RowChunk(NamedTuple):
    """Part of a shard's initial value: `compute()` gives `(int64 local rows, their values)`.

    `whole`: the chunk is the entire shard in local order, so it can be the
    variable's initial value instead of a write after creation.
    """

    whole: bool
    compute: Callable[[], Tuple[tf.Tensor, tf.Tensor]]


class ShardInitializer(Protocol):
    """What the table builder asks of every initializer kind: a shard's initial rows, chunk by chunk."""

    def chunks(self, layout, shard: int, full_shape, dtype, chunk_rows: int) -> List[RowChunk]:
        """Chunks of at most about `chunk_rows` rows that together cover shard `shard` of `layout`."""


class _PerRow:
    """Initializers defined per logical row (`rows(...)`): any layout gives the same table."""

    def rows(self, logical_rows: tf.Tensor, full_shape, dtype) -> tf.Tensor:
        raise NotImplementedError

    def chunks(self, layout, shard: int, full_shape, dtype, chunk_rows: int) -> List[RowChunk]:
        n = layout.shard_sizes[shard]

        def compute(start, stop):
            values = self.rows(layout.logical_rows_tf(shard, start, stop), full_shape, dtype)
            return tf.range(start, stop, dtype=tf.int64), values

        bounds = [(a, min(n, a + chunk_rows)) for a in range(0, n, chunk_rows)]
        return [RowChunk(len(bounds) == 1, lambda a=a, b=b: compute(a, b)) for a, b in bounds]


class RowInitializer(_PerRow):
    """A deterministic, per-logical-row initializer.

    Args:
      kind: "uniform", "normal", "truncated_normal" or "constant".
      a: minval / mean / constant value.
      b: maxval / stddev (unused for "constant").
      seed: int seed; the same seed gives the same table for any layout.

    Example:

    >>> init = RowInitializer("uniform", -1.0, 1.0, seed=3)
    >>> rows = init.rows(tf.constant([5, 2], tf.int64), [10, 4], tf.float32)
    >>> again = init.rows(tf.constant([2], tf.int64), [10, 4], tf.float32)
    >>> bool(tf.reduce_all(rows[1] == again[0]))
    True
    """

    KINDS = ("uniform", "normal", "truncated_normal", "constant")

    def __init__(self, kind: str, a: float = 0.0, b: float = 0.0, seed: int = 0):
        if kind not in self.KINDS:
            raise ValueError(f"Argument `kind` must be one of {self.KINDS}. Received: kind={kind!r}")
        self.kind, self.a, self.b, self.seed = kind, float(a), float(b), int(seed)

    def __repr__(self):
        return f"RowInitializer({self.kind!r}, {self.a}, {self.b}, seed={self.seed})"

    def stream_key(self) -> int:
        """What `rows` draws this initializer's rows from (a uint64 value), for `rows(..., keys=)`."""
        return _stream_key(self.seed, 0) & 0xFFFFFFFFFFFFFFFF

    def same_draws(self, other) -> bool:
        """Whether `other` draws rows as this one does but for its seed (`rows(..., keys=)` serves both)."""
        return isinstance(other, RowInitializer) and (self.kind, self.a, self.b) == (other.kind, other.a, other.b)

    def rows(self, logical_rows: tf.Tensor, full_shape, dtype, keys: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Values of the given int64 logical rows of a table of `full_shape`.

        `keys`: None, or a uint64 `stream_key()` per row: rows of several tables
        whose initializers make the `same_draws`, each with its own seed, at once.
        """
        dtype = tf.as_dtype(dtype)
        inner = [int(d) for d in full_shape[1:]]
        width = math.prod(inner)
        count = tf.shape(logical_rows)[0]
        out_shape = tf.concat([[count], tf.constant(inner, tf.int32)], 0)
        if self.kind == "constant":
            return tf.fill(out_shape, tf.constant(self.a, dtype))
        if not (dtype.is_floating):
            raise TypeError(
                f"Random initializer {self.kind!r} needs a floating-point `dtype`. Received: dtype={dtype.name}"
            )
        u = _uniform01(logical_rows, width, self.seed, 0, keys)
        if self.kind == "uniform":
            values = self.a + (self.b - self.a) * u
        elif self.kind == "normal":
            values = self.a + self.b * tf.math.ndtri(u)
        else:
            p = _PHI_MINUS_2 + u * (1.0 - 2.0 * _PHI_MINUS_2)
            values = self.a + self.b * tf.math.ndtri(p)
        return tf.reshape(tf.cast(values, dtype), out_shape)


class ArrayInitializer(_PerRow):
    """A full-shape initial value given as a NumPy array or tensor."""

    def __init__(self, value):
        self.value = value

    def rows(self, logical_rows: tf.Tensor, full_shape, dtype) -> tf.Tensor:
        return tf.gather(tf.cast(self.value, dtype), logical_rows)


class CallableInitializer:
    """A user callable `fn(shape, dtype[, partition_offset])`.

    With a `partition_offset` parameter it is called on contiguous logical row
    ranges (so the result does not depend on the layout when the callable is
    deterministic in its offset); without one it is called once per shard with
    the shard's shape, as TensorFlow does.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        try:
            params = inspect.signature(fn).parameters
            self.takes_offset = "partition_offset" in params
        except (TypeError, ValueError):
            self.takes_offset = False

    def call(self, shape, dtype, offset: Optional[int] = None) -> tf.Tensor:
        if self.takes_offset:
            value = self.fn(shape, dtype, partition_offset=[offset or 0] + [0] * (len(shape) - 1))
        else:
            value = self.fn(shape, dtype)
        value = tf.convert_to_tensor(value, dtype_hint=dtype)
        if value.shape.as_list() != list(shape):
            raise ValueError(
                f"Argument `initializer` must return a tensor of the requested shape {list(shape)}. "
                f"Received: a tensor of shape {value.shape.as_list()} from {self.fn!r}"
            )
        return tf.cast(value, dtype)

    def chunks(self, layout, shard: int, full_shape, dtype, chunk_rows: int) -> List[RowChunk]:
        inner = [int(d) for d in full_shape[1:]]
        n = layout.shard_sizes[shard]
        if not self.takes_offset:
            return [RowChunk(True, lambda: (tf.range(n, dtype=tf.int64), self.call([n] + inner, dtype)))]
        if layout.scheme == "div" or layout.num_shards == 1:

            def contiguous(start, stop):
                values = self.call([stop - start] + inner, dtype, layout.offsets[shard] + start)
                return tf.range(start, stop, dtype=tf.int64), values

            bounds = [(a, min(n, a + chunk_rows)) for a in range(0, n, chunk_rows)]
            return [RowChunk(len(bounds) == 1, lambda a=a, b=b: contiguous(a, b)) for a, b in bounds]

        # Not contiguous: evaluate on contiguous logical chunks and keep the rows this shard owns,
        # so that the table equals the div layout's exactly.
        def scattered(start, stop):
            values = self.call([stop - start] + inner, dtype, start)
            shard_of, local = layout.route(tf.range(start, stop, dtype=tf.int64))
            mine = tf.where(tf.equal(shard_of, shard))[:, 0]
            return tf.gather(local, mine), tf.gather(values, mine)

        total = int(full_shape[0])
        return [
            RowChunk(False, lambda a=a: scattered(a, min(total, a + chunk_rows))) for a in range(0, total, chunk_rows)
        ]


_NAMED = {
    "uniform": ("uniform", -0.05, 0.05),
    "random_uniform": ("uniform", -0.05, 0.05),
    "normal": ("normal", 0.0, 0.05),
    "random_normal": ("normal", 0.0, 0.05),
    "truncated_normal": ("truncated_normal", 0.0, 0.05),
    "zeros": ("constant", 0.0, 0.0),
    "zero": ("constant", 0.0, 0.0),
    "ones": ("constant", 1.0, 0.0),
    "one": ("constant", 1.0, 0.0),
}
_SCALING = {
    "glorot_uniform": (1.0, "fan_avg", "uniform"),
    "glorot_normal": (1.0, "fan_avg", "truncated_normal"),
    "he_uniform": (2.0, "fan_in", "uniform"),
    "he_normal": (2.0, "fan_in", "truncated_normal"),
    "lecun_uniform": (1.0, "fan_in", "uniform"),
    "lecun_normal": (1.0, "fan_in", "truncated_normal"),
}


def _variance_scaling(scale, mode, distribution, full_shape, seed) -> RowInitializer:
    fan_in, fan_out = compute_fans(full_shape)
    n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[mode]
    s = scale / max(1.0, n)
    if distribution == "uniform":
        limit = math.sqrt(3.0 * s)
        return RowInitializer("uniform", -limit, limit, seed)
    if distribution == "truncated_normal":
        return RowInitializer("truncated_normal", 0.0, math.sqrt(s) / _TRUNC_STD, seed)
    return RowInitializer("normal", 0.0, math.sqrt(s), seed)


def _from_keras(obj: Any, full_shape, seed: int):
    """Maps a Keras initializer object onto a row initializer, or None."""
    name = type(obj).__name__
    config = obj.get_config() if hasattr(obj, "get_config") else {}
    obj_seed = config.get("seed")
    if obj_seed is not None and not isinstance(obj_seed, (int, np.integer)):
        obj_seed = None
    s = seed if obj_seed is None else int(obj_seed)
    if name == "RandomUniform":
        return RowInitializer("uniform", config["minval"], config["maxval"], s)
    if name == "RandomNormal":
        return RowInitializer("normal", config["mean"], config["stddev"], s)
    if name == "TruncatedNormal":
        return RowInitializer("truncated_normal", config["mean"], config["stddev"], s)
    if name in ("Zeros", "Ones"):
        return RowInitializer("constant", 1.0 if name == "Ones" else 0.0, 0.0, s)
    if name == "Constant":
        # Keras keeps the value on the object; its config holds a serialized form for arrays.
        value = np.asarray(getattr(obj, "value", 0.0))
        if value.ndim == 0:
            return RowInitializer("constant", float(value), 0.0, s)
        if list(value.shape) == list(full_shape):
            return ArrayInitializer(value)
        raise ValueError(
            f"Argument `initializer` is a keras Constant whose value has shape {list(value.shape)}; it must be a "
            f"scalar or have the table's shape {list(full_shape)}."
        )
    if all(hasattr(obj, a) for a in ("scale", "mode", "distribution")):
        return _variance_scaling(obj.scale, obj.mode, obj.distribution, full_shape, s)
    return None


def resolve(initializer: Any, full_shape, dtype, seed: int) -> ShardInitializer:
    """Turns the user's `initializer=` into one of the initializer kinds above.

    Args:
      initializer: a Keras-style name, a Keras initializer object, a callable
        `(shape, dtype[, partition_offset])`, or a full-shape array / tensor.
      full_shape: the table's full shape.
      dtype: the table's dtype.
      seed: used by named initializers and by Keras objects without a seed.
    """
    if initializer is None:
        initializer = "uniform"
    if hasattr(initializer, "chunks"):  # already a ShardInitializer (table-batched storage composes them)
        return initializer
    if isinstance(initializer, str):
        key = initializer.lower()
        if key in _NAMED:
            kind, a, b = _NAMED[key]
            return RowInitializer(kind, a, b, seed)
        if key in _SCALING:
            return _variance_scaling(*_SCALING[key], full_shape, seed)
        raise ValueError(
            "Argument `initializer` must be a known initializer name "
            f"({sorted(list(_NAMED) + list(_SCALING))}), a Keras initializer, a callable or "
            f"an array of the table's shape. Received: initializer={initializer!r}"
        )
    if isinstance(initializer, (np.ndarray, tf.Tensor, list)):
        shape = list(np.shape(initializer)) if not isinstance(initializer, tf.Tensor) else initializer.shape.as_list()
        if shape != list(full_shape):
            raise ValueError(
                f"Argument `initializer` given as a value must have the table's shape {list(full_shape)}. "
                f"Received: a value of shape {shape}"
            )
        return ArrayInitializer(initializer)
    mapped = _from_keras(initializer, full_shape, seed) if hasattr(initializer, "get_config") else None
    if mapped is not None:
        return mapped
    if callable(initializer):
        return CallableInitializer(initializer)
    raise TypeError(
        "Argument `initializer` must be a name, a Keras initializer, a callable or an array. "
        f"Received: initializer={initializer!r} (of type {type(initializer).__name__})"
    )


def is_named(name: str) -> bool:
    """Whether `name` is one of the initializer names resolved here per logical row."""
    return name.lower() in _NAMED or name.lower() in _SCALING


def per_key(initializer: Any, dim: int, dtype, seed: int, table: str) -> RowInitializer:
    """The initializer of a dynamic table: each key's initial row from (seed, key), whatever the layout.

    Keys are the counters of `RowInitializer.rows` (string keys through their
    64-bit fingerprint). Variance-scaling names need a vocabulary size that a
    dynamic table does not have, and callables or arrays are per position,
    not per key: both are refused.
    """
    name = initializer.lower() if isinstance(initializer, str) else None
    if name in _SCALING:
        raise ValueError(
            f"Dynamic table '{table}': argument `initializer` {initializer!r} scales by the vocabulary size, which a "
            f"dynamic table does not have. Use one of {sorted(_NAMED)} or a Keras RandomUniform / RandomNormal / "
            "TruncatedNormal / Constant initializer."
        )
    resolved = resolve(initializer, (1, dim), dtype, seed)
    if not isinstance(resolved, RowInitializer):
        raise TypeError(
            f"Dynamic table '{table}': argument `initializer` must give each key its row from the key alone (a name "
            f"in {sorted(_NAMED)} or a Keras random / constant initializer). Received: {initializer!r}"
        )
    return resolved
