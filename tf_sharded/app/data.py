"""Criteo-shaped click data: a synthetic generator, Criteo-layout files, and `synthesize` to write them.

A record has a binary label, 13 integer ("dense") features and 26 categorical
features. In the Criteo Display-Advertising TSV format a line is
`label \\t i1 .. i13 \\t c1 .. c26`, with integers in decimal, categoricals as
hexadecimal hash strings, and any field but the label possibly empty
(missing). Files are read by `readers` with Criteo's schema
(`schema.criteo`): categorical values hashed into their table (id 0 is kept
for "missing"), integers as `log(1 + max(x, 0))` with missing as 0.

The synthetic data has the Criteo-Kaggle shape: vocabularies as in the
Kaggle set (capped by `max_vocab`), ids drawn from a truncated power law
(Zipf-like, alpha 1.05) scattered over the table, and labels drawn from a
hidden logistic model of per-id effects and dense features, so that a model
that learns shows it in held-out AUC. Every batch is a pure function of
`(seed, batch index)`: any worker or process regenerates the same data.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

NUM_DENSE = 13
NUM_CATEGORICAL = 26
DENSE_KEYS = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
CATEGORICAL_KEYS = [f"C{i}" for i in range(1, NUM_CATEGORICAL + 1)]
# Distinct values per categorical column of the Criteo Kaggle (Display Advertising Challenge) training set.
KAGGLE_VOCAB = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
ALPHA = 1.05
MISSING_RATE = 0.05

Batch = Tuple[Dict[str, tf.Tensor], tf.Tensor]


def vocab_sizes(max_vocab: Optional[int] = None) -> List[int]:
    """The 26 Kaggle vocabularies, each capped at `max_vocab` (and at least 2: id 0 means missing)."""
    return [max(2, v if max_vocab is None else min(v, int(max_vocab))) for v in KAGGLE_VOCAB]


def _mix(x: tf.Tensor, salt: int) -> tf.Tensor:
    """A 32-bit integer hash of int64 `x` (a multiply-xorshift), as int64 in [0, 2^32)."""
    x = tf.bitwise.bitwise_and(x * 2654435761 + salt * 40503, 0xFFFFFFFF)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15))
    x = tf.bitwise.bitwise_and(x * 2246822519, 0xFFFFFFFF)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 13))


def _unit(x: tf.Tensor, salt: int) -> tf.Tensor:
    """Hash of `x` mapped to [-1, 1)."""
    return tf.cast(_mix(x, salt), tf.float32) / float(1 << 31) - 1.0


def _power_law(seed, shape, vocab: int) -> tf.Tensor:
    """Ids in [1, vocab) from a truncated power law over ranks, scattered by a hash (0 stays 'missing')."""
    u = tf.random.stateless_uniform(shape, seed, dtype=tf.float64)
    top = float(vocab - 1)
    # Inverse CDF of a continuous Pareto(alpha) truncated to [1, top + 1): rank r has probability ~ r^-alpha.
    tail = 1.0 - u * (1.0 - (top + 1.0) ** (1.0 - ALPHA))
    rank = tf.minimum(tf.floor(tail ** (1.0 / (1.0 - ALPHA))), top) - 1.0
    return tf.math.floormod(_mix(tf.cast(rank, tf.int64), 7), vocab - 1) + 1


def synthetic_batch(index, batch_size: int, vocab: Sequence[int], seed: int) -> Batch:
    """Batch `index` of the synthetic data set: `({"dense": [b, 13], "C1".."C26": [b]}, labels [b, 1])`."""
    index = tf.cast(index, tf.int64)
    base = tf.stack([tf.cast(seed, tf.int64), index])
    dense_raw = tf.random.stateless_gamma([batch_size, NUM_DENSE], base + 1, alpha=0.7) * 20.0
    missing = tf.random.stateless_uniform([batch_size, NUM_DENSE], base + 2) < MISSING_RATE
    dense = tf.where(missing, 0.0, tf.math.log1p(tf.floor(dense_raw)))
    features = {"dense": dense}
    logit = tf.reduce_sum(dense * tf.linspace(-0.3, 0.3, NUM_DENSE), axis=1)
    for t, (key, size) in enumerate(zip(CATEGORICAL_KEYS, vocab)):
        ids = _power_law(base + 10 + t * 7, [batch_size], size)
        gone = tf.random.stateless_uniform([batch_size], base + 11 + t * 7) < MISSING_RATE
        ids = tf.where(gone, tf.zeros_like(ids), ids)
        features[key] = ids
        # The hidden per-id effect, none for missing values: strong in the smaller tables (learnable in a
        # few hundred steps), weak in the large ones, whose rare ids a short run cannot learn.
        effect = _unit(ids, 100 + t) * (1.0 if size <= 20_000 else 0.3)
        logit += tf.where(gone, 0.0, effect)
    u = tf.random.stateless_uniform([batch_size], base + 3)
    labels = tf.cast(u < tf.sigmoid(logit - 0.5), tf.float32)[:, None]
    return features, labels


def synthetic_dataset(
    batch_size: int, max_vocab: Optional[int] = None, seed: int = 0, start: int = 0, num_batches: Optional[int] = None
) -> tf.data.Dataset:
    """Batches `start, start + 1, ...` of the synthetic data (infinite unless `num_batches`).

    Example:

    >>> from tf_sharded.app import data
    >>> features, labels = next(iter(data.synthetic_dataset(4, max_vocab=1000)))
    >>> sorted(features)[:3], features["dense"].shape, labels.shape
    (['C1', 'C10', 'C11'], TensorShape([4, 13]), TensorShape([4, 1]))
    """
    vocab = vocab_sizes(max_vocab)
    # Without `num_batches` the stream is infinite (not merely long): `tfs.fit` positions a finite Dataset
    # itself on resume, and the caller has positioned this one with `start` already.
    indices = tf.data.Dataset.range(start, start + num_batches) if num_batches else tf.data.Dataset.counter(start)
    batch = _batch_function(batch_size, tuple(vocab))
    return indices.map(lambda i: batch(i, tf.constant(seed, tf.int64)), num_parallel_calls=tf.data.AUTOTUNE)


@functools.cache
def _batch_function(batch_size: int, vocab: Tuple[int, ...]):
    """`synthetic_batch` for one batch size and vocabulary as one traced function, made once per process: the
    data sets built on it (each worker's stretch, the held-out batches, a resumed stream) call it instead of each
    building its thousands of ops again."""
    return tf.function(
        lambda index, seed: synthetic_batch(index, batch_size, vocab, seed),
        input_signature=[tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64)],
        autograph=False,
    )


# ---------------------------------------------------------------------------------------------- files --


def criteo_files(path: str, batch_size: int, max_vocab: Optional[int] = None, fmt: Optional[str] = None):
    """Batches from Criteo-layout file(s) (TSV without a header, or Parquet / TFRecord / CSV with columns
    `label`, `I1`..`I13`, `C1`..`C26`), read with `readers` and Criteo's schema; malformed records dropped."""
    from tf_sharded.app import readers, schema

    criteo = schema.criteo(vocab_sizes(max_vocab))
    source = readers.open_source(path, criteo, fmt)
    return readers.batched(readers.records(source, criteo, source.files), batch_size)


def tsv_dataset(path: str, batch_size: int, max_vocab: Optional[int] = None) -> tf.data.Dataset:
    """Batches from Criteo TSV file(s): a file, or a directory of them (`criteo_files`)."""
    return criteo_files(path, batch_size, max_vocab, "tsv")


def parquet_dataset(path: str, batch_size: int, max_vocab: Optional[int] = None) -> tf.data.Dataset:
    """Batches from Parquet file(s) with columns `label`, `I1`..`I13` and `C1`..`C26` (`criteo_files`)."""
    return criteo_files(path, batch_size, max_vocab, "parquet")


def synthesize(fmt: str, rows: int, out_dir: str, max_vocab: Optional[int] = None, seed: int = 0) -> List[str]:
    """Writes `rows` synthetic records as Criteo TSV or Parquet under `out_dir`; returns the file names.

    Categorical ids are written as 8-digit hexadecimal strings and integers in
    decimal, with missing values left empty (TSV) or empty / -1 (Parquet).
    """
    if fmt not in ("tsv", "parquet"):
        raise ValueError(f"Argument `format` must be 'tsv' or 'parquet'. Received: {fmt!r}")
    os.makedirs(out_dir, exist_ok=True)
    batch = min(rows, 4096)
    vocab = vocab_sizes(max_vocab)
    done, part, files = 0, 0, []
    while done < rows:
        n = min(batch, rows - done)
        features, labels = synthetic_batch(part, batch, vocab, seed)
        dense = np.expm1(features["dense"].numpy()[:n]).round().astype(np.int64)
        missing_dense = features["dense"].numpy()[:n] == 0
        cats = np.stack([features[k].numpy()[:n] for k in CATEGORICAL_KEYS], axis=1)
        y = labels.numpy()[:n, 0].astype(np.int64)
        name = os.path.join(out_dir, f"part-{part:05d}.{'tsv' if fmt == 'tsv' else 'parquet'}")
        if fmt == "tsv":
            with open(name, "w") as f:
                for i in range(n):
                    ints = ["" if missing_dense[i, j] else str(dense[i, j]) for j in range(NUM_DENSE)]
                    hexes = ["" if c == 0 else f"{c:08x}" for c in cats[i]]
                    f.write("\t".join([str(y[i])] + ints + hexes) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = {"label": pa.array(y)}
            for j, key in enumerate(DENSE_KEYS):
                table[key] = pa.array(np.where(missing_dense[:, j], -1, dense[:, j]))
            for t, key in enumerate(CATEGORICAL_KEYS):
                table[key] = pa.array(["" if c == 0 else f"{c:08x}" for c in cats[:, t]])
            pq.write_table(pa.table(table), name)
        files.append(name)
        done += n
        part += 1
    return files


# ------------------------------------------------------------------------------------------- ratings --

RATINGS_FORMATS = ("csv", "tfrecord", "parquet")


def ratings_records(rows: int, seed: int = 0, users: int = 2000, movies: int = 500) -> List[dict]:
    """Movie-rating-like records, the shape of the public rating logs: `rating` (real), `user_id` (a string
    id), `movie_id` (an integer id), `genres` (1-3 of 12 names), `age` (the user's, an integer).

    A rating is 3 + a hidden per-user effect + a per-movie effect + the mean of the movie's genre effects
    + 0.02 × (age − 40) + noise (σ 0.3): the embeddings have something to learn, and a model's MSE can be
    compared with the noise floor (0.09).
    """
    rng = np.random.default_rng(seed)
    user_effect, movie_effect = rng.normal(0, 0.8, users), rng.normal(0, 0.8, movies)
    genre_effect = rng.normal(0, 0.5, 12)
    movie_genres = [rng.choice(12, size=rng.integers(1, 4), replace=False) for _ in range(movies)]
    ages = rng.integers(18, 70, users)
    # Activity follows a power law, as in real logs: a few users and movies hold most ratings.
    user_of = np.minimum((rng.pareto(1.2, rows) * users / 20).astype(np.int64), users - 1)
    movie_of = np.minimum((rng.pareto(1.2, rows) * movies / 20).astype(np.int64), movies - 1)
    noise = rng.normal(0, 0.3, rows)
    out = []
    for u, m, e in zip(user_of, movie_of, noise):
        g = movie_genres[m]
        rating = 3.0 + user_effect[u] + movie_effect[m] + genre_effect[g].mean() + 0.02 * (ages[u] - 40) + e
        out.append({"rating": round(float(rating), 3), "user_id": f"user{u}", "movie_id": int(m),
                    "genres": [f"genre{i}" for i in g], "age": int(ages[u])})  # fmt: skip
    return out


def synthesize_ratings(fmt: str, rows: int, out_dir: str, seed: int = 0) -> List[str]:
    """Writes `ratings_records` as one CSV (genres `|`-separated), TFRecord of `tf.train.Example` (genres a
    bytes list) or Parquet (genres `|`-separated: tensorflow-io reads primitive columns) file."""
    if fmt not in RATINGS_FORMATS:
        raise ValueError(f"Argument `format` must be one of {RATINGS_FORMATS} for ratings. Received: {fmt!r}")
    os.makedirs(out_dir, exist_ok=True)
    records = ratings_records(rows, seed)
    name = os.path.join(out_dir, f"ratings.{fmt}")
    if fmt == "csv":
        with open(name, "w") as f:
            f.write("rating,user_id,movie_id,genres,age\n")
            for r in records:
                f.write(f"{r['rating']},{r['user_id']},{r['movie_id']},{'|'.join(r['genres'])},{r['age']}\n")
    elif fmt == "tfrecord":
        with tf.io.TFRecordWriter(name) as writer:
            for r in records:
                feature = {
                    "rating": tf.train.Feature(float_list=tf.train.FloatList(value=[r["rating"]])),
                    "user_id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[r["user_id"].encode()])),
                    "movie_id": tf.train.Feature(int64_list=tf.train.Int64List(value=[r["movie_id"]])),
                    "genres": tf.train.Feature(bytes_list=tf.train.BytesList(value=[g.encode() for g in r["genres"]])),
                    "age": tf.train.Feature(int64_list=tf.train.Int64List(value=[r["age"]])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {k: [r[k] for r in records] for k in ("rating", "user_id", "movie_id", "age")}
        columns["genres"] = ["|".join(r["genres"]) for r in records]
        pq.write_table(pa.table(columns), name)
    return [name]
