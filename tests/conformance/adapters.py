"""What the conformance checks need of each table kind, keyed by the kind's registered name.

An adapter says how to make a table of its kind under a strategy (with a `placement=` option or the
strategy's default), which keys to look up, what a fresh table holds for them (the single-device
reference), how to read the rows a table holds now, and which other layouts a checkpoint restores into. The
checks themselves (`test_conformance.py`) are the same for every kind; a kind whose tables hold no trainable
rows or write no checkpoint says so (`trains`, `layouts`) and those checks are skipped for it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tests.conformance import minimal_kind
from tests.harness.references import table_values


class KindAdapter:
    """The default adapter: tables with rows, trained through their `held_variables`, checkpointed whole."""

    # Whether its tables hold rows an optimizer trains.
    trains = True
    # Layouts (the keyword arguments of `make`) a checkpoint restores into; empty: no checkpoint.
    layouts = ()
    # The layout the matrix makes its tables with.
    layout = {}

    def make(self, strategy, name: str, option, **layout):
        """A table of this kind made under `strategy` (in its scope) with the `placement=` option `option` (None:
        the strategy's default)."""
        raise NotImplementedError

    def keys(self, rng, n: int) -> np.ndarray:
        """`n` keys to look up, with repeats."""
        raise NotImplementedError

    def initial(self, table, keys: np.ndarray) -> np.ndarray:
        """The rows a fresh `table` holds for `keys`, computed without it (a single-device reference)."""
        raise NotImplementedError

    def live_keys(self, table) -> list:
        """The keys `table` holds rows for."""
        raise NotImplementedError

    def read(self, table, keys: list) -> np.ndarray:
        """The rows `table` holds for `keys` (read without changing it)."""
        raise NotImplementedError

    def variables(self, table) -> list:
        """The variables an optimizer trains."""
        return list(table.held_variables)

    def plain(self):
        """A plain single-device object a checkpoint of a table restores into (its rows by key: `numpy()[key]`),
        None for a kind whose checkpoints only its own tables read."""
        return None


class FixedAdapter(KindAdapter):
    """Rows `[0, n)` made from given values: every row is live from the start."""

    rows, dim = 29, 3
    layout = {"partitions": 3, "scheme": "balanced"}
    layouts = tuple({"partitions": p, "scheme": s} for p, s in ((1, "div"), (2, "mod"), (5, "div"), (4, "balanced")))

    def values(self):
        return table_values(self.rows, self.dim)

    def make(self, strategy, name, option, **layout):
        return strategy.create_sharded_variable(
            name, [self.rows, self.dim], initializer=self.values(), placement=option, **layout
        )

    def keys(self, rng, n):
        return rng.integers(0, self.rows, size=n).astype(np.int64)

    def initial(self, table, keys):
        return self.values()[np.asarray(keys, np.int64)]

    def live_keys(self, table):
        return list(range(self.rows))

    def read(self, table, keys):
        return table.numpy()[np.asarray(keys, np.int64)]

    def plain(self):
        return tf.Variable(tf.zeros([self.rows, self.dim]))


class DynamicAdapter(KindAdapter):
    """Raw int64 keys (negative ones and ones beyond 2**53 included): a key gets its row when a training lookup
    first meets it, initialised from (seed, key)."""

    dim, seed = 3, 11
    layout = {"partitions": 2}
    layouts = ({"partitions": 1}, {"partitions": 3})

    def make(self, strategy, name, option, **layout):
        return strategy.create_dynamic_table(name, self.dim, seed=self.seed, placement=option, **layout)

    def keys(self, rng, n):
        pool = rng.integers(-(2**62), 2**62, size=24, dtype=np.int64)
        pool[:3] = [-1, 0, 2**53 + 1]
        return pool[np.minimum(rng.zipf(1.5, size=n) - 1, len(pool) - 1)]

    def initial(self, table, keys):
        return table.initial_rows(tf.constant(keys, tf.int64)).numpy()

    def live_keys(self, table):
        keys = table.export()[0].numpy().tolist()
        if len(keys) != int(table.size()):
            raise AssertionError(f"{len(keys)} keys exported, size() says {int(table.size())}")
        return keys

    def read(self, table, keys):
        rows = dict(zip(*[t.numpy().tolist() for t in table.export()]))
        return np.array([rows[k] for k in keys], np.float32)


class ConstantAdapter(KindAdapter):
    """`tests/conformance/minimal_kind.py`: rows `[id, -id]` computed by its lookup, nothing stored."""

    trains = False

    def live_keys(self, table):
        return []

    def make(self, strategy, name, option, **layout):
        return minimal_kind.ConstantRows()

    def keys(self, rng, n):
        return rng.integers(0, 100, size=n).astype(np.int64)

    def initial(self, table, keys):
        keys = np.asarray(keys, np.float32)
        return np.stack([keys, -keys], -1)


ADAPTERS = {
    "fixed": FixedAdapter(),
    "dynamic": DynamicAdapter(),
    minimal_kind.CONSTANT.name: ConstantAdapter(),
}
