"""Keys of dynamic tables: their dtypes, fingerprints and shards (pure functions of the key and the layout),
and their encoding in Keras weight files."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_sharded import initializers

KEY_DTYPES = (tf.int64, tf.string)
_SALT = 0x2545F4914F6CDD1D


def parse_key_dtype(key_dtype, table: str) -> tf.DType:
    """`tf.int64` or `tf.string` from a dtype or its name; anything else is refused naming the table."""
    try:
        dtype = tf.as_dtype(key_dtype)
    except TypeError:
        dtype = None
    if dtype not in KEY_DTYPES:
        raise TypeError(
            f"Dynamic table '{table}': argument `key_dtype` must be tf.int64 or tf.string ('int64' / 'string'). "
            f"Received: key_dtype={key_dtype!r}"
        )
    return dtype


def key_fingerprints(keys: tf.Tensor) -> tf.Tensor:
    """int64 keys as they are; string keys as their 64-bit fingerprint (the counter of their initial row)."""
    if keys.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(keys, 2**63 - 1)
    return keys


def shard_of_keys(keys: tf.Tensor, num_shards: int) -> tf.Tensor:
    """The shard (int32) of each key: a hash of the key alone, the same in every process."""
    if num_shards == 1:
        return tf.zeros(tf.shape(keys), tf.int32)
    mixed = initializers.mix64(tf.cast(key_fingerprints(keys), tf.uint64) + initializers.u64(_SALT))
    high = tf.cast(tf.bitwise.right_shift(mixed, initializers.u64(33)), tf.int64)
    return tf.cast(tf.math.floormod(high, num_shards), tf.int32)


def keys_to_file(store, entry: str, keys) -> None:
    """Writes keys to a Keras weight store (numeric arrays only): int64 as is, strings as UTF-8 bytes + lengths."""
    keys = keys.numpy() if hasattr(keys, "numpy") else np.asarray(keys)
    if keys.dtype != object:
        store[entry] = keys
        return
    encoded = [k if isinstance(k, bytes) else str(k).encode() for k in keys]
    store[entry] = np.frombuffer(b"".join(encoded), np.uint8) if encoded else np.zeros([0], np.uint8)
    store[entry + "_lengths"] = np.array([len(k) for k in encoded], np.int64)


def keys_from_file(store, entry: str, key_dtype: tf.DType, where: str) -> tf.Tensor:
    """The keys `keys_to_file` wrote, as a tensor of `key_dtype`.

    Keys written for the other key dtype (int64 for a string table, or strings for an int64 one), and
    string keys whose lengths do not add up to their bytes, are refused in an error that begins with `where`
    (what is loading them, such as "Layer 'tags'") and names the entry, before anything is assigned.
    """
    lengths_entry = entry + "_lengths"
    if entry not in store:
        raise ValueError(f"{where}: the saved file has no '{entry}' entry (a dynamic table's keys)")
    stored = np.asarray(store[entry][...])
    holds_strings = lengths_entry in store
    if key_dtype != tf.string:
        if holds_strings or stored.dtype.kind not in "iu" or stored.ndim != 1:
            raise TypeError(
                f"{where}: the table has key_dtype=int64; entry '{entry}' holds "
                + ("string keys" if holds_strings else f"an array of {stored.dtype} {list(stored.shape)}")
                + ". Received keys saved from another table."
            )
        return tf.constant(stored, key_dtype)
    if not holds_strings or stored.dtype != np.uint8:
        raise TypeError(
            f"{where}: the table has key_dtype=string; entry '{entry}' holds {stored.dtype} keys without "
            f"'{lengths_entry}'. Received keys saved from another table."
        )
    lengths = np.asarray(store[lengths_entry][...])
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any() or lengths.sum() != stored.size:
        raise ValueError(
            f"{where}: entry '{lengths_entry}' does not describe the {stored.size} bytes of '{entry}' (it must be "
            f"one non-negative length per key, adding up to them). Received a damaged file."
        )
    ends, data = np.cumsum(lengths), stored.tobytes()
    return tf.constant([data[e - n : e] for e, n in zip(ends, lengths)], tf.string)
